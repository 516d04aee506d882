"""The exact optimum of a small scheduling problem, by constraint programming (OR-Tools CP-SAT):
what `plan.py search --exact` runs to measure how far the search (seq1f1b-zb-auto) is from it.

The model is the search's problem, nothing relaxed: every F, B and W of every (micro-batch, span,
chunk) is an interval of its cost's length on its rank; a rank runs one at a time (no overlap);
an action starts after each action it depends on has ended (`actions.dependencies`, the one
place the rules live); and each rank's held bytes (allocated when an action starts, released
after it ends, as `simulate.held_change` says) stay within the cap at all times (a reservoir
constraint). The makespan is minimised. Every unit's backward is split: a W right after its B
is the full backward, so nothing is lost. The search's best order is given to the solver as a
hint (replayed with the solver's integer durations, so it is feasible as given): the solver
starts from it and only improves on it.

CP-SAT works on integers: durations are scaled so that the longest action is 10^4 ticks, and
bytes are counted exactly, in the largest unit they are all whole multiples of. The makespan
reported is the simulator's, with the true costs; `bound` is the solver's proven lower bound scaled back (within the
duration rounding, under 10^-4 of the longest action per action on the critical path).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from seq1f1b.plan.actions import (Action, Schedule, ScheduleError, dependencies,
                                  split_full_backwards)
from seq1f1b.plan.simulate import SpanCosts, held_change, held_rise, held_tables, simulate
from seq1f1b.plan.validate import execution_graph

TICKS = 10_000           # the longest action, in solver time units


@dataclass(frozen=True)
class ExactResult:
    """What the solver found within its time limit."""

    schedule: Optional[Schedule]   # None when it found no order at all in time
    makespan: float                # the simulator's, with the true costs (inf without one)
    peak: float                    # the fullest rank's held bytes, the simulator's
    bound: float                   # proven lower bound on the optimum
    optimal: bool                  # the solver proved `schedule` optimal (up to the rounding)
    status: str                    # CP-SAT's status name

    @property
    def gap(self) -> float:
        """How far the makespan is above the proven bound, as a fraction of it."""
        return self.makespan / self.bound - 1.0 if self.bound > 0 else math.inf


def solve(shape: Schedule, costs: SpanCosts, cap: float, time_limit_s: float,
          hint: Optional[Schedule] = None, workers: int = 2) -> ExactResult:
    """The order of F, B and W with the least makespan for `shape`'s problem (P, m, k, V,
    placement; its programs are ignored) under `costs` with each rank holding at most `cap`.
    `hint`: a valid schedule to start from (its units' backwards split or not)."""
    if costs.output is not None:
        raise ScheduleError("--exact: the output layer spread over the ranks (O actions) is not "
                            "modelled by the exact solver yet")
    try:
        from ortools.sat.python import cp_model
    except ImportError:       # pinned in requirements.txt; a trimmed install may lack it
        raise ScheduleError("--exact needs OR-Tools (pip install -r requirements.txt)") from None
    tables = held_tables(costs)
    if tables is None:
        raise ScheduleError("--exact needs the bytes of every span (a model or unit costs)")
    if costs.weight is None:
        raise ScheduleError("--exact splits every backward: give W costs (--uniform-cost F B W)")
    actions = [(rank, Action(op, i, j, c)) for rank in range(shape.pp)
               for c in range(shape.chunks) for op in ("F", "B", "W")
               for i in range(shape.microbatches) for j in range(shape.splits)]
    longest = max(costs.duration(shape.stage_of(r, a.chunk), a) for r, a in actions)
    scale = TICKS / longest if longest > 0 else 1.0
    unit = _memory_unit(tables)

    model = cp_model.CpModel()
    horizon = sum(max(1, round(costs.duration(shape.stage_of(r, a.chunk), a) * scale)) + 1
                  for r, a in actions)
    start, end, intervals = {}, {}, {rank: [] for rank in range(shape.pp)}
    length = {(rank, action): max(1, round(costs.duration(shape.stage_of(rank, action.chunk),
                                                           action) * scale))
              for rank, action in actions}
    for rank, action in actions:
        s = model.NewIntVar(0, horizon, f"s{rank}{action}")
        e = model.NewIntVar(0, horizon, f"e{rank}{action}")
        intervals[rank].append(model.NewIntervalVar(s, length[rank, action], e,
                                                    f"i{rank}{action}"))
        start[rank, action], end[rank, action] = s, e
    for rank, action in actions:
        for need in dependencies(shape, rank, action):
            model.Add(start[rank, action] >= end[need])
        if action.op == "W":
            model.Add(start[rank, action] >= end[rank, action.with_op("B")])
    times: dict[int, list] = {rank: [] for rank in range(shape.pp)}
    changes: dict[int, list[int]] = {rank: [] for rank in range(shape.pp)}
    for rank, action in actions:
        up, down = _memory_changes(tables, shape.stage_of(rank, action.chunk), action, unit)
        if up:
            times[rank].append(start[rank, action])
            changes[rank].append(up)
        if down:
            times[rank].append(end[rank, action])
            changes[rank].append(-down)
    for rank in range(shape.pp):
        model.AddNoOverlap(intervals[rank])
        if times[rank]:
            model.AddReservoirConstraint(times[rank], changes[rank], 0,
                                         math.floor(cap / unit * (1 + 1e-12)))
    makespan = model.NewIntVar(0, horizon, "makespan")
    model.AddMaxEquality(makespan, list(end.values()))
    model.Minimize(makespan)
    if hint is not None:
        _add_hint(model, hint, length, start)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = workers
    status = solver.Solve(model)
    name = solver.StatusName(status)
    bound = solver.BestObjectiveBound() / scale
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return ExactResult(None, math.inf, math.inf, bound, False, name)
    programs = []
    for rank in range(shape.pp):
        mine = [(solver.Value(start[r, a]), a) for r, a in actions if r == rank]
        programs.append(tuple(a for _, a in sorted(mine, key=lambda t: (t[0], "FBW".index(
            t[1].op)))))
    schedule = Schedule("exact", shape.pp, shape.microbatches, shape.splits, shape.chunks,
                        tuple(programs), shape.placement)
    report = simulate(schedule, costs)
    if hint is not None:
        # Ticks round the durations: an order optimal in ticks may time a hair longer than
        # the hint with the true costs. The result is never worse than the hint.
        hinted = simulate(hint, costs)
        if hinted.makespan <= report.makespan:
            schedule, report = hint, hinted
    return ExactResult(schedule, report.makespan, max(r.peak_held_bytes for r in report.ranks),
                       bound, status == cp_model.OPTIMAL, name)


def _memory_unit(tables: dict) -> Fraction:
    """The largest amount every byte count of `tables` is a whole multiple of (bytes are whole
    numbers on a model, simple fractions under unit costs): CP-SAT's memory unit, exact. The
    layer groups' shares of a full backward are left out: every backward here is split."""
    values = [Fraction(value).limit_denominator(10**6) for kind, table in tables.items()
              if not kind.endswith("_per_group") for row in table for value in row]
    denominator = math.lcm(*(v.denominator for v in values))
    numerator = math.gcd(*(int(v * denominator) for v in values))
    return Fraction(numerator or 1, denominator)


def _memory_changes(tables: dict, stage: int, action: Action, unit: Fraction
                    ) -> tuple[int, int]:
    """(units allocated at the start, units released after the end) of `action`."""
    rise, release = held_rise(held_change(tables, stage, action, action.op == "W"))

    def units(value: float) -> int:
        return round(Fraction(value).limit_denominator(10**6) / unit)

    return units(rise), units(release)


def _add_hint(model, hint: Schedule, length: dict, start: dict) -> None:
    """Start times of `hint` replayed with the solver's own integer durations (so the hint is
    feasible as given); a full backward becomes its B then its W."""
    programs = tuple(map(tuple, split_full_backwards(hint.programs)))
    split_hint = Schedule("hint", hint.pp, hint.microbatches, hint.splits, hint.chunks,
                          programs, hint.placement)
    graph = execution_graph(split_hint)
    finished = [0] * len(graph.steps)
    free = [0] * hint.pp
    for step in graph.order:
        rank, action = graph.steps[step]
        begin = max([free[rank]] + [finished[need] for need in graph.needs[step]])
        model.AddHint(start[rank, action], begin)
        finished[step] = free[rank] = begin + length[rank, action]
