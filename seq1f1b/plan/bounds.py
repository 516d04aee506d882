"""A lower bound on the makespan of any schedule of one problem (P, m, k, V, placement) under
given costs, whatever its memory: the yardstick the search and `plan.py compare` report gaps to.

Each rank is relaxed to one machine that may interrupt an action and resume it later. Its
actions become ready no sooner than their dependencies allow (their heads) and each is followed
by a chain of work on other ranks before the iteration can end (its tail). Jackson's preemptive
rule, always running the ready action of longest tail, is optimal for that relaxation (one
machine, heads, tails, preemption), so the longest "finish + tail" it reaches bounds every real
schedule from below.

Heads and tails count more than one micro-batch's chain. Micro-batches are alike, so for each
(op, virtual stage, span) the m actions' earliest starts are kept as a sorted list: the n-th F of
span j to start on stage v cannot start before n+1 of those on stage v-1 have finished, one
after another on their rank, and then crossed the hop (`SpanCosts.hop`, between ranks only).
The dependencies are `actions.dependencies`'; the n-th smallest of a pointwise maximum is at
least the maximum of the n-th smallest, so the lists combine per dependency. Tails are the
mirror image, from the end of the iteration backwards. Which head and which tail belong to the
same micro-batch is not known, so each rank is relaxed twice, sorted heads with each group's
smallest tail and each group's smallest head with sorted tails, and the larger result is kept.

A W may run as part of a full backward; splitting it off never makes a schedule slower here, so
W is a separate action (of cost 0 when the costs have none). Without a cap memory is ignored, and
the search reaches this bound on most shapes (docs/schedules.md). Given a per-rank `cap` on the
held bytes, one more bound counts the warm-up the cap forces: a rank frees nothing before the
earliest end of an action that frees (a W, or B(i,0), which frees the K/V), so the forwards it
starts before then must fit in the cap together (at most as many as the smallest allocations
fit); everything else it runs before then is bounded by its heads, and the rest of its work
comes after.

With the output layer spread (O actions, any rank runs each: costs with `output`), an O joins
the chain between the last stage's F and B of its span; the m O's of a span may run side by
side on different ranks, so their stream does not run them one after another, and a rank's
relaxation leaves them out (any rank may take them). One more bound counts them: all the work
spread evenly over the P ranks.
"""
from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence

from seq1f1b.plan.actions import Action, Schedule
from seq1f1b.plan.simulate import SpanCosts, held_change, held_tables

Group = tuple[str, int, int]
"""(op, virtual stage, span): the m alike actions of one kind."""


def lower_bound(shape: Schedule, costs: SpanCosts, cap: Optional[float] = None) -> float:
    """Makespan no valid schedule of `shape`'s problem can beat under `costs`, with each rank
    holding at most `cap` bytes when given (module doc)."""
    durations = group_durations(shape, costs)
    average = sum(durations[g] for g in durations) * shape.microbatches / shape.pp
    return max([average] + rank_lower_bounds(shape, costs, cap))


def rank_lower_bounds(shape: Schedule, costs: SpanCosts, cap: Optional[float] = None
                      ) -> list[float]:
    """Each rank's part of `lower_bound`: its work with heads and tails, and under `cap` its
    warm-up (module doc)."""
    heads, tails = group_heads(shape, costs), group_tails(shape, costs)
    durations = group_durations(shape, costs)
    tables = held_tables(costs) if cap is not None else None
    bounds = []
    for rank in range(shape.pp):
        groups = [(op, shape.stage_of(rank, chunk), span) for op in "FBW"
                  for chunk in range(shape.chunks) for span in range(shape.splits)]
        by_heads = [(h, durations[g], tails[g][0]) for g in groups for h in heads[g]]
        by_tails = [(heads[g][0], durations[g], q) for g in groups for q in tails[g]]
        best = max(_preemptive_makespan(by_heads), _preemptive_makespan(by_tails))
        if tables is not None:
            best = max(best, _warm_up_bound(shape, tables, cap, groups, heads, durations))
        bounds.append(best)
    return bounds


def _warm_up_bound(shape: Schedule, tables: dict, cap: float, groups: list[Group],
                   heads: dict[Group, list[float]], durations: dict[Group, float]) -> float:
    """One rank's bound under `cap` (module doc): the first free, then all the work that could
    not run before it."""
    frees = [heads[g][0] + durations[g] for g in groups
             if g[0] == "W" or (g[0] == "B" and g[2] == 0)]
    first_free = min(frees)
    forwards = sorted((sum(held_change(tables, v, Action("F", 0, j, 0), False)[0].values()),
                       durations[op, v, j])
                      for op, v, j in groups if op == "F" for _ in heads[op, v, j])
    room, fit = cap * (1 + 1e-9), 0
    for allocated, _ in forwards:
        room -= allocated
        if room < 0:
            break
        fit += 1
    if fit == len(forwards):
        return 0.0
    early = sum(sorted((d for _, d in forwards), reverse=True)[:fit])
    early += sum(min(durations[g], max(0.0, first_free - h))
                 for g in groups if g[0] != "F" for h in heads[g])
    work = sum(durations[g] * len(heads[g]) for g in groups)
    return first_free + work - min(early, first_free)


def gap_to_bound(makespan: float, bound: float) -> float:
    """How far `makespan` is above `bound`, as a fraction of it; a schedule that reaches the
    bound is 0, not the -1e-16 of summing the same costs in another order."""
    gap = makespan / bound - 1.0
    return 0.0 if abs(gap) < 1e-9 else gap


def group_durations(shape: Schedule, costs: SpanCosts) -> dict[Group, float]:
    """Each group's cost (W's 0 without W costs; O's with the output layer spread)."""
    weight = costs.weight or tuple((0.0,) * shape.splits for _ in range(shape.num_stages))
    tables = {"F": costs.forward, "B": costs.backward, "W": weight}
    found = {(op, v, j): tables[op][v][j] for op in "FBW" for v in range(shape.num_stages)
             for j in range(shape.splits)}
    if costs.output is not None:
        found.update({("O", shape.num_stages - 1, j): costs.output[j]
                      for j in range(shape.splits)})
    return found


def _hop(shape: Schedule, costs: SpanCosts, low: int, span: int) -> float:
    """p2p seconds between virtual stages `low` and `low`+1, none on one rank."""
    same_rank = shape.owner_of(low)[0] == shape.owner_of(low + 1)[0]
    return 0.0 if costs.hop is None or same_rank else costs.hop[low][span]


def _one_after_another(ready: Sequence[float], duration: float, delay: float = 0.0,
                       side_by_side: bool = False) -> list[float]:
    """Earliest n-th finish (+ `delay`) of actions of one rank that become ready at the sorted
    times `ready` and run one at a time (or, `side_by_side`, each on a rank of its own: O)."""
    if side_by_side:
        return [time + duration + delay for time in ready]
    out, clock = [], -math.inf
    for time in ready:
        clock = max(clock, time) + duration
        out.append(clock + delay)
    return out


def _latest(*lists: list[float]) -> list[float]:
    return [max(values) for values in zip(*lists)]


def _needs(shape: Schedule, costs: SpanCosts) -> dict[Group, list[tuple[Group, float]]]:
    """Each group's dependencies (`actions.dependencies` per micro-batch, lifted to groups),
    with the hop between them."""
    last, final = shape.num_stages - 1, shape.splits - 1
    needs: dict[Group, list[tuple[Group, float]]] = {}
    for v in range(shape.num_stages):
        for j in range(shape.splits):
            needs["F", v, j] = ([(("F", v - 1, j), _hop(shape, costs, v - 1, j))] if v else []) \
                + ([(("F", v, j - 1), 0.0)] if j else [])
            needs["B", v, j] = [(("F", v, j), 0.0)] \
                + ([(("B", v + 1, j), _hop(shape, costs, v, j))] if v < last else []) \
                + ([(("B", v, j + 1), 0.0)] if j < final else [])
            needs["W", v, j] = [(("B", v, j), 0.0)]
    if costs.output is not None:     # the O may run on the last stage's rank: no hop
        for j in range(shape.splits):
            needs["O", last, j] = [(("F", last, j), 0.0)]
            needs["B", last, j].append((("O", last, j), 0.0))
    return needs


def group_heads(shape: Schedule, costs: SpanCosts) -> dict[Group, list[float]]:
    """For each group, the sorted earliest starts of its m actions."""
    return _stream(_needs(shape, costs), group_durations(shape, costs), shape.microbatches)


def group_tails(shape: Schedule, costs: SpanCosts) -> dict[Group, list[float]]:
    """For each group, the sorted least time its m actions leave between their end and the
    iteration's: the dependants' work, one after another on their rank, and the hops (heads of
    the iteration run backwards)."""
    dependants: dict[Group, list[tuple[Group, float]]] = {}
    for group, needs in _needs(shape, costs).items():
        dependants.setdefault(group, [])
        for need, hop in needs:
            dependants.setdefault(need, []).append((group, hop))
    return _stream(dependants, group_durations(shape, costs), shape.microbatches)


def group_lags(shape: Schedule, costs: SpanCosts) -> dict[Group, dict[Group, float]]:
    """For each group, the least time from its start to the start of each group that depends
    on it within one micro-batch: the longest chain of actions and hops between them."""
    needs, durations = _needs(shape, costs), group_durations(shape, costs)
    order: list[Group] = []
    seen: set[Group] = set()

    def visit(group: Group) -> None:         # dependencies first
        if group not in seen:
            seen.add(group)
            for need, _ in needs[group]:
                visit(need)
            order.append(group)

    for group in needs:
        visit(group)
    lags: dict[Group, dict[Group, float]] = {}
    for position, source in enumerate(order):
        reach = {source: 0.0}
        for group in order[position + 1:]:
            after = [reach[need] + durations[need] + hop for need, hop in needs[group]
                     if need in reach]
            if after:
                reach[group] = max(after)
        lags[source] = reach
    return lags


def _stream(before: dict[Group, list[tuple[Group, float]]], durations: dict[Group, float],
            microbatches: int) -> dict[Group, list[float]]:
    """For each group, the sorted earliest times its m actions may begin when every group in
    `before` it must have run its n+1 first actions, one after another, and crossed the hop
    before the n-th of this one begins (module doc)."""
    found: dict[Group, list[float]] = {}

    def times(group: Group) -> list[float]:
        if group not in found:
            found[group] = _latest([0.0] * microbatches,
                                   *(_one_after_another(times(g), durations[g], hop,
                                                        g[0] == "O")
                                     for g, hop in before[group]))
        return found[group]

    for group in before:
        times(group)
    return found


def _preemptive_makespan(jobs: list[tuple[float, float, float]]) -> float:
    """Jackson's preemptive schedule of (head, duration, tail) jobs on one machine: the least
    max(finish + tail) any schedule of them reaches, interruptions allowed."""
    jobs = sorted(jobs)
    ready: list[tuple[float, float]] = []      # (-tail, remaining duration)
    clock, best, n = 0.0, 0.0, 0
    while n < len(jobs) or ready:
        if not ready:
            clock = max(clock, jobs[n][0])
        while n < len(jobs) and jobs[n][0] <= clock:
            head, duration, tail = jobs[n]
            heapq.heappush(ready, (-tail, duration))
            n += 1
        negative_tail, remaining = heapq.heappop(ready)
        arrival = jobs[n][0] if n < len(jobs) else math.inf
        if clock + remaining <= arrival:
            clock += remaining
            best = max(best, clock - negative_tail)
        else:
            heapq.heappush(ready, (negative_tail, remaining - (arrival - clock)))
            clock = arrival
    return best
