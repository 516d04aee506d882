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
  budget.py; no cap: seq1f1b-zbv's peak on those costs). Candidates: the constructions (ZB-V
  over spans and over micro-batches, DualPipeV over micro-batches) and greedy replays
  (greedy.py: sixteen policies, forward or backward first, which chunk's ready forwards and
  backwards go first, whether a forward waits for a backward due before it would end, then a
  local search over per-rank caps on the spans in flight between F and B); the shortest
  simulated makespan among those within the cap is kept, so it never loses to a construction
  that fits, and is then improved by moves on its critical path (refine.py). Lower bound and
  exact optimum: bounds.py, exact.py. Without a budget (the registry's plain (P, m, k, V) call,
  as in the grid tests): unit costs, the constructions and the sixteen policies, no local
  search.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Optional

from seq1f1b.plan.actions import Action, Schedule, ScheduleError, split_full_backwards
from seq1f1b.plan.budget import ScheduleBudget
from seq1f1b.plan.registry import register
from seq1f1b.plan.schedules.greedy import Placed, Placer, Policy, Problem, unit_costs
from seq1f1b.plan.schedules.refine import refine
from seq1f1b.plan.schedules.zbv_construction import dualpipev_programs, zbv_programs
from seq1f1b.plan.simulate import SpanCosts, simulate

SEARCH_ROUNDS = 3
"""Passes of the local search over the per-rank depths (each pass tries every rank once up and
once down); the replay costs O(actions), so this bounds the search at 2 * P * rounds replays."""


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


@register("seq1f1b-zb-auto", chunked=True, placement="vshape", splits_backward=True,
          searched=True,
          description="Seq1F1B zero bubble, searched: F, B and W placed on a V under a memory "
                      "cap (--schedule-memory-cap; default: seq1f1b-zbv's peak), shortest "
                      "simulated makespan with the run's costs (unit costs without a model)")
def seq1f1b_zb_auto(pp: int, microbatches: int, splits: int, chunks: int,
                    budget: Optional[ScheduleBudget] = None) -> list[list[Action]]:
    problem = _v_problem("seq1f1b-zb-auto", pp, microbatches, splits, chunks, unit=1)
    costs = budget.costs if budget is not None and budget.costs is not None \
        else unit_costs(problem)
    cap = budget.cap if budget is not None and budget.cap is not None \
        else default_cap(problem, costs)
    # The registry's plain (P, m, k, V) call knows no costs: policies only, no local search
    # (grid tests build it on thousands of shapes); tools pass the run's costs in a budget.
    return search(problem, costs, cap, rounds=SEARCH_ROUNDS if budget is not None else 0
                  ).programs


def constructions(problem: Problem) -> dict[str, list[list[Action]]]:
    """The fixed V orders the search starts from (zbv_construction): the published ZB-V over
    spans and over whole micro-batches, and DualPipeV over whole micro-batches (m >= 2P)."""
    m, k = problem.microbatches, problem.splits
    found = {"seq1f1b-zbv": zbv_programs(problem.pp, m, k, unit_size=1),
             "zbv": zbv_programs(problem.pp, m, k, unit_size=k)}
    dualpipev = dualpipev_programs(problem.pp, m, k)
    if dualpipev is not None:
        # Its full backwards as B then W: never slower, and every W is its own action as the
        # runtime of a split-backward schedule expects.
        found["dualpipev"] = split_full_backwards(dualpipev)
    return found


def default_cap(problem: Problem, costs: SpanCosts) -> float:
    """Seq1F1B's memory on a V with these costs: the peak held bytes of `seq1f1b-zbv`."""
    return _replayed(problem, constructions(problem)["seq1f1b-zbv"], costs)[1]


def _replayed(problem: Problem, programs: list[list[Action]], costs: SpanCosts
              ) -> tuple[float, float]:
    """(makespan, peak held bytes of the fullest rank) of `programs` with `costs`."""
    schedule = Schedule("candidate", problem.pp, problem.microbatches, problem.splits,
                        problem.chunks, tuple(map(tuple, programs)), problem.placement)
    report = simulate(schedule, costs)
    return report.makespan, max(rank.peak_held_bytes for rank in report.ranks)


def search(problem: Problem, costs: SpanCosts, cap: float, rounds: int = SEARCH_ROUNDS
           ) -> Placed:
    """The shortest makespan under `cap` among: the fixed constructions (`constructions`), the
    greedy replays of every policy (forward or backward first, which chunk's ready forwards
    and backwards go first, whether a forward waits for a backward due before it ends), and
    `rounds` passes of a local search that moves one rank's depth (the spans it may hold
    between F and B) by one span at a time while the makespan improves; with `rounds`, the
    best is then refined on its critical path (refine.py)."""
    placer = Placer(problem, costs)

    def evaluate(policy: Policy) -> Optional[tuple[Placed, Policy]]:
        try:
            return placer.place(cap, policy), policy
        except ScheduleError:
            return None

    policies = [Policy(first, None, later_f, later_b, wait) for first, later_f, later_b, wait in
                itertools.product((True, False), repeat=4)]
    found = [f for f in map(evaluate, policies) if f is not None]
    fixed = []
    for programs in constructions(problem).values():
        makespan, peak = _replayed(problem, programs, costs)
        if peak <= cap * (1 + 1e-9):
            fixed.append(Placed(programs, makespan))
    if not found and not fixed:
        raise ScheduleError(f"--schedule-memory-cap {cap:g}: no order of F, B and W fits it "
                            f"(pp={problem.pp}, m={problem.microbatches}, k={problem.splits}); "
                            "raise the cap")
    if found:
        best, policy = min(found, key=lambda f: f[0].makespan)
        # Depths start at what the free replay reached on each rank, then move one span at a
        # time.
        depth = _depths(best.programs)
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
        fixed.append(best)
    best = min(fixed, key=lambda placed: placed.makespan)
    if rounds:
        refined = refine(placer, best, cap)
        if refined is not best:
            makespan, peak = _replayed(problem, refined.programs, costs)
            if makespan < best.makespan and peak <= cap * (1 + 1e-9):
                best = Placed(refined.programs, makespan)
    return best


def _depths(programs: list[list[Action]]) -> list[int]:
    """Most spans each program holds between their F and their B."""
    depths = []
    for program in programs:
        live = peak = 0
        for action in program:
            live += {"F": 1, "B": -1, "W": 0}[action.op]
            peak = max(peak, live)
        depths.append(peak)
    return depths
