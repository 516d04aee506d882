"""Zero bubble on a V: `zbv`, `seq1f1b-zbv` and the searched `seq1f1b-zb-auto`.

ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024) gives each rank two model
chunks in a V (`placement="vshape"`: chunk 0 of rank r is stage r, chunk 1 is stage 2P-1-r), so
rank 0 holds both the first and the last stage: the first forward comes back as a backward after
one trip down and up the V instead of a trip through P whole stages, the warm-up bubble halves,
and W (weight grads) fills the rest. Every rank carries the same mix of early and late stages,
so memory is even across ranks.

- `zbv`: the published ZB-V order (zbv_construction.py; torch's ScheduleZBVZeroBubble action
  for action at k = 1), whole micro-batches run span by span: 1F1B's memory (P micro-batches);
- `seq1f1b-zbv`: that order over single spans with k-1 more warm-up pairs: Seq1F1B's memory
  (P + k - 1 spans), the V's bubble;
- `seq1f1b-zb-auto`: searched against `ScheduleBudget` (per-action costs and a memory cap, see
  budget.py; no cap: Seq1F1B's peak on those costs, seq1f1b-zbv's on two chunks, seq1f1b's on
  one). It runs on one chunk per rank or two, as the model is laid out, and chooses the
  placement: on two chunks a V and a loop (interleaved) are each searched and the shorter kept
  (under 7B costs the V's rank 0 also runs the output layer, and a loop can win), on one chunk
  a loop. Candidates per placement: the constructions (on a V: ZB-V over spans and over
  micro-batches, DualPipeV over micro-batches; on a loop: the registry's loop schedules of
  that chunk count) and greedy replays
  (greedy.py: sixteen policies, forward or backward first, which chunk's ready forwards and
  backwards go first, whether a forward waits for a backward due before it would end; each
  again with promised bytes kept in turn where keeping them for every admitted micro-batch at
  once held a forward back, and again keeping none; then, from the best replay of each way of
  keeping promises (the other two only when their best replay is within DEPTH_SEARCH_REACH of
  at once's) and from each replay of that way within DEPTH_SEARCH_REACH of its best, a local
  search over per-rank caps on the
  spans in flight between F and B); the better of the best construction that fits and each
  way's result from its best replay, and its shortest from any, is
  improved by moves on its critical path (refine.py), and the shortest simulated makespan
  within the cap is kept, so it never loses to a construction that fits; then each placement
  near the shortest order (`ANNEAL_REACH`) whose lower bound leaves room to beat it
  (`ANNEAL_ABOVE_BOUND`) walks on from its order by simulated annealing (anneal.py). Lower
  bound and exact optimum: bounds.py, exact.py. Without a budget (the registry's plain
  (P, m, k, V) call, as in the grid tests): unit costs, its own placement only (a V on two
  chunks), the constructions and the greedy policies, no local search. Costs that spread the
  output layer over the ranks (`SpanCosts.output`: O actions) make it place the O's too: each
  greedy policy with O's on any rank (`OUTPUT_SLACKS`) and on the last stage's rank alone, the
  constructions with each O right after its span's last forward.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Optional

from seq1f1b.plan.actions import (Action, Schedule, ScheduleError, placement_words,
                                  split_full_backwards)
from seq1f1b.plan.bounds import lower_bound
from seq1f1b.plan.budget import ScheduleBudget
from seq1f1b.plan.registry import register
from seq1f1b.plan.schedules.anneal import anneal
from seq1f1b.plan.schedules.greedy import (PROMISES, Placed, Placer, Policy, Problem,
                                             unit_costs)
from seq1f1b.plan.schedules.refine import refine
from seq1f1b.plan.schedules.zbv_construction import dualpipev_programs, zbv_programs
from seq1f1b.plan.search_progress import Progress
from seq1f1b.plan.simulate import SpanCosts, simulate

OUTPUT_SLACKS = (0.0, 2.0, None)
"""The `Policy.output_slack` values a search with the output layer spread replays, each with a
family of its own for the depth search and the refinement (the shortest replay is not always
the start that refines shortest). At 7B/64K (TP 8, SP), with one slack for every policy, the
best of 0, 0.5, 1, 2 and 4 was 0 at P=4, m=8, k=4 under 0.5x (5.015 s against 5.046 at 1), 2 at
P=8, m=8, k=4 (2.576 against 2.616 at 1) and 4 at P=4, m=4, k=4 (2.477, where the search with
these keeps the layer in the last stage, 2.506). With these three: 5.015, 2.575 and, at P=4,
m=8, k=4 under the default cap, 4.884 (4.896 with the slack 1 alone); the search at k=8 takes
about twice as long (45 s on one core). With the ways of keeping promises within
DEPTH_SEARCH_REACH searched on too, P=4, m=4, k=4 under the default cap gives 2.469 with the
layer spread, shorter than with it kept (2.506)."""

SEARCH_ROUNDS = 3
"""Passes of the local search over the per-rank depths (each pass tries every rank once up and
once down); the replay costs O(actions), so this bounds the search at 2 * P * rounds replays."""

DEPTH_SEARCH_REACH = 1.03
"""The depth search runs from every replay of a family (one way of keeping promises) at most
this factor longer than the family's best, not from the best alone: at 7B/64K (TP 8, SP), P = 4,
m = 4, k = 2 on a V under Seq1F1B's peak the best replay (2.897 s) led to 2.744 s, another
policy's (2.969 s) to depths whose replay is 2.870 s and to 2.709 s after the refinement. Over
88 capped 7B cases (P, m, k from (2, 2, 2) to (8, 8, 2), k 1 to 4, capped at every rival's
peak) three ended shorter (by 1.29%, 0.21% and 0.04%), none longer (the best replay's result
is still refined), the search taking about 1.3 times as long; 60 cases under unit and skewed
costs ended the same. From every replay of the family it found nothing more in 1.75 times.
A way of keeping promises whose best replay is up to this factor longer than at once's is
searched on too (it was only where shorter): at 7B/64K with even spans, P = 4, m = 4, k = 2 on a
V under Seq1F1B's peak, keeping promises in turn (best replay 3.506 s against 3.442) led to
depths and an order of 3.136 s, at once's to 3.259 s. Over the 88 cases with even spans three
ended shorter (by 2.91%, 0.33% and 0.69%), none longer; with the compute partition none
changed. Families whose best replay ties at once's stay out (the same work again)."""


ANNEAL_ABOVE_BOUND = 1.02
"""Annealing (anneal.py) walks on from a placement's order only where the shortest order of all
placements is more than this factor above that placement's lower bound (bounds.py): within it
the order already meets issue 26's target (2% of the bound), and the walk costs seconds a
placement. Over 88 capped 7B cases (compute spans) the search's order was within 0.1% of the
least bound of its placements in 52 and within 2% in 59 before annealing; with the gate at 0.1%
six of those seven ended shorter, by 0.11-0.61%, and the 88 took 543 s against 273."""


ANNEAL_REACH = 1.05
"""Of the placements searched (a V, a loop), annealing walks on from each whose order is within
this factor of the shortest: at 7B/64K with even spans, P = 4, m = 4, k = 2 under Seq1F1B's peak
the loop of two (3.230 s) was 3% behind the V (3.136 s), and both annealed end within 0.3%."""


def _v_problem(name: str, pp: int, microbatches: int, splits: int, chunks: int, unit: int
               ) -> Problem:
    if chunks != 2:
        raise ScheduleError(f"--chunks: {name} places two model chunks per rank in a V, got "
                            f"{chunks}")
    return Problem(pp, microbatches, splits, 2, "vshape", unit)


@register("zbv", chunked=True, placement="vshape", splits_backward=True,
          description="ZB-V (Qi et al. 2024): two chunks per rank in a V, 1F1B's memory, whole "
                      "micro-batches (run span by span), the published order")
def zbv(pp: int, microbatches: int, splits: int, chunks: int) -> list[list[Action]]:
    _v_problem("zbv", pp, microbatches, splits, chunks, unit=splits)
    return zbv_programs(pp, microbatches, splits, unit_size=splits)


@register("seq1f1b-zbv", chunked=True, placement="vshape", splits_backward=True,
          description="Seq1F1B on a V (the ZB-V order over spans): seq1f1b's memory (P+k-1 "
                      "spans), B in reverse span order, W deferred into the bubbles")
def seq1f1b_zbv(pp: int, microbatches: int, splits: int, chunks: int) -> list[list[Action]]:
    _v_problem("seq1f1b-zbv", pp, microbatches, splits, chunks, unit=1)
    return zbv_programs(pp, microbatches, splits, unit_size=1)


def _stand_in(pp: int, microbatches: int, splits: int, chunks: int
              ) -> tuple[list[list[Action]], str]:
    """seq1f1b-zb-auto's shape (registry.shape) without a search: its own placement's
    construction over spans, every backward split as in its orders (seq1f1b-zbv on a V,
    seq1f1b-zb-h1 on a loop of one chunk)."""
    if chunks == 2:
        return zbv_programs(pp, microbatches, splits, unit_size=1), "vshape"
    from seq1f1b.plan import registry   # the registry loads this family
    return list(registry.build("seq1f1b-zb-h1", pp, microbatches, splits).programs), "loop"


@register("seq1f1b-zb-auto", placement="vshape", splits_backward=True, searched=True,
          any_chunks=True, stand_in=_stand_in,
          description="Seq1F1B zero bubble, searched: F, B and W placed under a memory cap "
                      "(--schedule-memory-cap; default: Seq1F1B's peak, seq1f1b-zbv's on two "
                      "chunks), on a V or a loop (two chunks) or a loop (one), shortest "
                      "simulated makespan with the run's costs (unit costs without a model)")
def seq1f1b_zb_auto(pp: int, microbatches: int, splits: int, chunks: int,
                    budget: Optional[ScheduleBudget] = None
                    ) -> tuple[list[list[Action]], str]:
    if chunks not in (1, 2):
        raise ScheduleError(f"--chunks: seq1f1b-zb-auto runs one or two model chunks per rank, "
                            f"got {chunks}")
    own = _own_placement(chunks)
    options = budget.options() if budget is not None else [(own, None)]
    cap = searched_cap(pp, microbatches, splits, chunks, budget)
    found, refused = [], None
    progress = Progress()
    for placement, costs in options:
        problem = Problem(pp, microbatches, splits, chunks, placement or own, unit=1,
                          spread_output=costs is not None and costs.output is not None)
        costs = costs if costs is not None else unit_costs(problem)
        try:
            # The registry's plain (P, m, k, V) call knows no costs: policies only, no local
            # search (grid tests build it on thousands of shapes); tools pass the run's costs
            # in a budget.
            placed = search(problem, costs, cap,
                            rounds=SEARCH_ROUNDS if budget is not None else 0,
                            progress=progress)
        except ScheduleError as err:
            refused = refused or err
            continue
        found.append((placed.makespan, len(found), placed, problem, costs))
    if not found:
        raise refused
    if budget is not None and budget.anneal:
        # Annealing is dear (seconds a placement): from the shortest order on, only where the
        # placement is near it and its lower bound leaves room to beat it
        shortest = min(makespan for makespan, *_ in found)
        for at, (makespan, order, placed, problem, costs) in sorted(enumerate(found),
                                                                      key=lambda f: f[1]):
            bound = lower_bound(_schedule(problem, placed.programs), costs, cap)
            if makespan <= shortest * ANNEAL_REACH and shortest > bound * ANNEAL_ABOVE_BOUND:
                progress.done(f"{_where(problem)}: annealing from makespan {makespan:.6g}")
                placed = annealed(problem, costs, cap, placed, bound)
                progress.done(f"{_where(problem)}: annealed, makespan {placed.makespan:.6g}")
                found[at] = (placed.makespan, order, placed, problem, costs)
                shortest = min(shortest, placed.makespan)
    _, _, placed, problem, _ = min(found)
    return placed.programs, problem.placement


def _where(problem: Problem) -> str:
    """Which of its searches a progress line is about."""
    return (f"seq1f1b-zb-auto on {placement_words(problem.placement)}"
            + (", output layer spread" if problem.spread_output else ""))


def _own_placement(chunks: int) -> str:
    return "vshape" if chunks == 2 else "loop"


def searched_cap(pp: int, microbatches: int, splits: int, chunks: int,
                 budget: Optional[ScheduleBudget]) -> float:
    """The cap seq1f1b-zb-auto places under: the budget's, or Seq1F1B's peak (`default_cap`)
    on the costs of its own placement (a V on two chunks, a loop on one) when the budget has
    them, else on the first it has; one cap for every placement it tries."""
    if budget is not None and budget.cap is not None:
        return budget.cap
    own = _own_placement(chunks)
    options = budget.options(restricted=False) if budget is not None else [(own, None)]
    placement, costs = next((o for o in options if (o[0] or own) == own), options[0])
    problem = Problem(pp, microbatches, splits, chunks, placement or own, unit=1)
    return default_cap(problem, costs if costs is not None else unit_costs(problem))


def constructions(problem: Problem) -> dict[str, list[list[Action]]]:
    """The fixed orders the search starts from. On a V (zbv_construction): the published ZB-V
    over spans and over whole micro-batches, and DualPipeV over whole micro-batches (m >= 2P).
    On a loop: the registry's loop schedules of that chunk count (seq1f1b, 1f1b and their
    zero-bubble forms on one chunk; the interleaved ones on two, where they build), each full
    backward as its B then its W. With the output layer spread, the same with each O right
    after its span's last forward."""
    m, k = problem.microbatches, problem.splits
    if problem.spread_output:
        plain = constructions(replace(problem, spread_output=False))
        return {name: outputs_after_last_forward(problem, programs)
                for name, programs in plain.items()}
    if problem.placement == "loop":
        from seq1f1b.plan import registry   # the registry loads this family
        names = (("seq1f1b-zb-h1", "zb-h1", "seq1f1b", "1f1b") if problem.chunks == 1
                 else ("seq1f1b-interleaved", "interleaved-1f1b"))
        found = {}
        for name in names:
            try:
                built = registry.build(name, problem.pp, m, k, problem.chunks)
            except ScheduleError:
                continue           # a shape this family does not build (interleaving's m)
            found[name] = split_full_backwards(built.programs)
        return found
    found = {"seq1f1b-zbv": zbv_programs(problem.pp, m, k, unit_size=1),
             "zbv": zbv_programs(problem.pp, m, k, unit_size=k)}
    dualpipev = dualpipev_programs(problem.pp, m, k)
    if dualpipev is not None:
        # Its full backwards as B then W: never slower, and every W is its own action as the
        # runtime of a split-backward schedule expects.
        found["dualpipev"] = split_full_backwards(dualpipev)
    return found


def outputs_after_last_forward(problem: Problem, programs: list[list[Action]]
                               ) -> list[list[Action]]:
    """`programs` with each span's O right after the last stage's F of that span, on its rank:
    an order with the output layer in the last stage, for costs that spread it."""
    rank, chunk = problem.shape().owner_of(problem.pp * problem.chunks - 1)
    out = [list(program) for program in programs]
    out[rank] = []
    for action in programs[rank]:
        out[rank].append(action)
        if action.op == "F" and action.chunk == chunk:
            out[rank].append(Action("O", action.microbatch, action.span))
    return out


def default_cap(problem: Problem, costs: SpanCosts) -> float:
    """Seq1F1B's memory with these costs: the peak held bytes of `seq1f1b-zbv` on two chunks
    (in a V: the same stages, so the same bytes, for a loop of two), of `seq1f1b` on one.
    That peak has the output layer in the last stage: costs that spread it (O actions) cannot
    price it, and a caller gives the cap from the costs that do not."""
    if costs.output is not None:
        raise ScheduleError("the default memory cap is Seq1F1B's peak with the output layer in "
                            "the last stage: give it, or a cap, with costs that keep it there")
    if problem.chunks == 1:
        from seq1f1b.plan import registry
        programs = registry.build("seq1f1b", problem.pp, problem.microbatches,
                                  problem.splits).programs
    else:
        problem = replace(problem, placement="vshape")
        programs = zbv_programs(problem.pp, problem.microbatches, problem.splits, unit_size=1)
    return _replayed(problem, programs, costs)[1]


def _schedule(problem: Problem, programs: list[list[Action]]) -> Schedule:
    return Schedule("candidate", problem.pp, problem.microbatches, problem.splits,
                    problem.chunks, tuple(map(tuple, programs)), problem.placement)


def _replayed(problem: Problem, programs: list[list[Action]], costs: SpanCosts
              ) -> tuple[float, float]:
    """(makespan, peak held bytes of the fullest rank) of `programs` with `costs`."""
    report = simulate(_schedule(problem, programs), costs)
    return report.makespan, max(rank.peak_held_bytes for rank in report.ranks)


def search(problem: Problem, costs: SpanCosts, cap: float, rounds: int = SEARCH_ROUNDS,
           progress: Optional[Progress] = None) -> Placed:
    """The shortest makespan under `cap` among: the fixed constructions (`constructions`), the
    greedy replays of every policy (forward or backward first, which chunk's ready forwards
    and backwards go first, whether a forward waits for a backward due before it ends, how
    promises are kept), and `rounds` passes of a local search that moves one rank's depth (the
    spans it may hold between F and B) by one span at a time while the makespan improves,
    from the best replay of each way of keeping promises and from the replays near it
    (DEPTH_SEARCH_REACH, module doc); with `rounds`, the
    better of the best construction and each of those is then refined on its critical path
    (refine.py). `progress` hears how far it is (search_progress.py)."""
    placer = Placer(problem, costs)
    replays: dict[Policy, Optional[tuple[Placed, Policy]]] = {}
    progress = progress or Progress()
    where = _where(problem)

    def evaluate(policy: Policy) -> Optional[tuple[Placed, Policy]]:
        """The replay of `policy` (None where it gets stuck), each policy replayed once: the
        depth searches from the replays of a family reach the same depths again (108 of 544
        replays at 7B/64K, TP 8, SP, P = 8, m = 8, k = 2 on a V)."""
        if policy not in replays:
            try:
                replays[policy] = placer.place(cap, policy), policy
            except ScheduleError:
                replays[policy] = None
            progress.tick(f"{where}: {len(replays)} greedy replays")
        return replays[policy]

    found = []
    # with the output layer spread: O's on any rank, within an even share of the work plus
    # none or two O's (no one slack wins everywhere), and on the last stage's rank alone
    slacks = OUTPUT_SLACKS if problem.spread_output else (1.0,)
    for first, later_f, later_b, wait, spread in itertools.product(
            (True, False), (True, False), (True, False), (True, False), slacks):
        at_once = evaluate(Policy(first, None, later_f, later_b, wait, output_slack=spread))
        found += [at_once] if at_once is not None else []
        # Kept in turn, the replay differs only where keeping every promise at once held a
        # forward back (or got stuck): otherwise it is the same replay. Keeping none may differ
        # either way (a forward whose own promise did not fit now goes).
        ways = ("in turn", "none") if at_once is None or at_once[0].held_back else ("none",)
        for way in ways:
            other = evaluate(Policy(first, None, later_f, later_b, wait, way, spread))
            found += [other] if other is not None else []
    fixed = []
    for programs in constructions(problem).values():
        makespan, peak = _replayed(problem, programs, costs)
        if peak <= cap * (1 + 1e-9):
            fixed.append(Placed(programs, makespan))
    if not found and not fixed:
        raise ScheduleError(f"--schedule-memory-cap {cap:g}: no order of F, B and W fits it "
                            f"(pp={problem.pp}, m={problem.microbatches}, k={problem.splits}); "
                            "raise the cap")
    starts = []
    # A way of keeping promises other than at once is searched on only where its best replay
    # differs from at once's by less than DEPTH_SEARCH_REACH, or is shorter: where the cap is
    # loose (or so tight that admitting more chokes the pipeline) the replays tie, and the
    # depth search and refinement would repeat the same work; a little longer, depths may
    # still make it the shorter.
    families = [[f for f in found if f[1].promises == way] for way in PROMISES]
    at_once = min((f[0].makespan for f in families[0]), default=math.inf)

    def differs_within_reach(family: list) -> bool:
        if not family or math.isinf(at_once):      # at once got stuck everywhere
            return bool(family)
        best = min(f[0].makespan for f in family)
        return best < at_once * DEPTH_SEARCH_REACH and abs(best - at_once) > at_once * 1e-12

    families = families[:1] + [family for family in families[1:] if differs_within_reach(family)]
    # With the output layer spread, also one family per way of placing the O's: the shortest
    # replay is not always the start that refines to the shortest order (module doc)
    families = [[f for f in family if f[1].output_slack == slack]
                for family in families for slack in slacks]
    progress.done(f"{where}: {len(replays)} greedy replays and the constructions, makespan "
                  f"{min(p.makespan for p in fixed + [f[0] for f in found]):.6g}")

    def depth_search(best: Placed, policy: Policy) -> Placed:
        """`best` (the replay of `policy`) improved by moving one rank's depth at a time,
        `rounds` passes."""
        depth = _depths(best.programs)     # what the free replay reached on each rank
        for _ in range(rounds):
            improved = False
            for rank in range(problem.pp):
                for step in (-1, 1):
                    trial = list(depth)
                    trial[rank] += step
                    if trial[rank] < 1:
                        continue
                    candidate = evaluate(replace(policy, depth=tuple(trial)))
                    if candidate is not None and \
                            candidate[0].makespan < best.makespan * (1 - 1e-12):
                        (best, policy), depth, improved = candidate, trial, True
            if not improved:
                break
        return best

    for family in families:
        if not family:
            continue
        # The depth search starts from the best replay of each way of keeping promises, and
        # from every other replay of the family within DEPTH_SEARCH_REACH of it: the shorter
        # start does not always lead to the shorter end. Both the best replay's result and
        # the shortest of all go on to the refinement.
        first = min(family, key=lambda f: f[0].makespan)
        own = depth_search(*first)
        starts.append(own)
        if not rounds:      # no depth search: the other replays are longer as they stand
            continue
        others = [depth_search(*f) for f in family if f is not first
                  and f[0].makespan <= first[0].makespan * DEPTH_SEARCH_REACH]
        shortest_other = min(others, key=lambda placed: placed.makespan, default=own)
        if shortest_other.makespan < own.makespan * (1 - 1e-12):
            starts.append(shortest_other)

    def shortest(candidates: list[Placed]) -> Placed:
        return min(candidates, key=lambda placed: placed.makespan)

    best = shortest(fixed + starts)
    if not rounds:
        return best
    progress.done(f"{where}: depth search, makespan {best.makespan:.6g}")
    # Refined from the better of the constructions and each family's best replay: the local
    # search, too, does not always end shorter from the shorter start.
    refined_from = []
    for start in starts or [best]:
        start = shortest(fixed + [start])
        if all(start is not other for other in refined_from):
            refined_from.append(start)
    for start in refined_from:
        refined = refine(placer, start, cap)
        if refined is not start:
            best = _shorter_within(problem, costs, cap, refined.programs, best)
    progress.done(f"{where}: refined, makespan {best.makespan:.6g}")
    return best


def annealed(problem: Problem, costs: SpanCosts, cap: float, placed: Placed,
             bound: float = 0.0) -> Placed:
    """`placed` (the search's order) walked on by annealing (anneal.py), where the refinement
    stopped in a local optimum, until it reaches `bound` (a lower bound) at the latest, the walk
    with swaps only where the first ends more than `ANNEAL_ABOVE_BOUND` above it: never
    longer, and within `cap` by the simulator."""
    walked = anneal(Placer(problem, costs), placed, cap, bound, bound * ANNEAL_ABOVE_BOUND)
    return placed if walked is placed else _shorter_within(problem, costs, cap,
                                                           walked.programs, placed)


def _shorter_within(problem: Problem, costs: SpanCosts, cap: float,
                    programs: list[list[Action]], than: Placed) -> Placed:
    """`programs` as the simulator times them where that is shorter than `than` within `cap`
    (a local search times with the placer's durations; the simulator has the last word), else
    `than`."""
    makespan, peak = _replayed(problem, programs, costs)
    return Placed(programs, makespan) if makespan < than.makespan and \
        peak <= cap * (1 + 1e-9) else than


def _depths(programs: list[list[Action]]) -> list[int]:
    """Most spans each program holds between their F and their B."""
    depths = []
    for program in programs:
        live = peak = 0
        for action in program:
            live += {"F": 1, "B": -1}.get(action.op, 0)
            peak = max(peak, live)
        depths.append(peak)
    return depths
