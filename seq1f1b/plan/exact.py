"""The exact optimum of a small scheduling problem, by constraint programming (OR-Tools CP-SAT):
what `plan.py search --exact` runs to measure how far the search (seq1f1b-zb-auto) is from it.

The model is the search's problem, nothing relaxed: every F, B and W of every (micro-batch, span,
chunk) is an interval of its cost's length on its rank (with the output layer spread, every O
of every (micro-batch, span) one on a rank the solver chooses: an optional interval on each
rank, exactly one present, its bytes held there while it runs); a rank runs one at a time (no
overlap); an action starts after each action it depends on has ended (`actions.dependencies`,
the one place the rules live); and each rank's held bytes (allocated when an action starts,
released after it ends, as `simulate.held_change` says) stay within the cap at all times (a
reservoir constraint). The makespan is minimised. Every unit's backward is split, as in the
search's orders: a W right after its B takes as long as the full backward, but holds more at its
peak where a stage has several layer groups (a full backward frees activations as it goes,
`simulate._HELD`), so under a tight cap the optimum and bound are those of orders that split
every backward (rank_bound.py's bound holds for both). The search's best order is given to the
solver as a hint (replayed with the solver's integer durations, so it is feasible as given):
the solver starts from it and only improves on it.

CP-SAT works on integers: durations are scaled so that the longest action is 10^4 ticks, and
bytes are counted exactly, in the largest unit they are all whole multiples of. The makespan
reported is the simulator's, with the true costs; `bound` is the solver's proven lower bound
scaled back (within the duration rounding, under 10^-4 of the longest action per action on the
critical path).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

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
    """The order of F, B and W (and O, when `shape` spreads the output layer) with the least
    makespan for `shape`'s problem (P, m, k, V, placement, whether O's; its programs are
    otherwise ignored) under `costs` with each rank holding at most `cap`.
    `hint`: a valid schedule to start from (its units' backwards split or not)."""
    if (costs.output is not None) != shape.spread_output:
        raise ScheduleError("--exact: the costs and the shape disagree on whether the output "
                            "layer is spread over the ranks (O actions)")
    cp_model, tables = cp_sat_and_tables(costs)
    if costs.weight is None:
        raise ScheduleError("--exact splits every backward: give W costs (--uniform-cost F B W)")
    actions = [(rank, Action(op, i, j, c)) for rank in range(shape.pp)
               for c in range(shape.chunks) for op in ("F", "B", "W")
               for i in range(shape.microbatches) for j in range(shape.splits)]
    # An O runs on one rank the solver chooses: one start and end, an optional interval and
    # an optional memory event on every rank, exactly one present.
    outputs = [Action("O", i, j) for i in range(shape.microbatches)
               for j in range(shape.splits)] if shape.spread_output else []
    durations = {_key(rank, action): costs.duration(shape.stage_of(rank, action.chunk), action)
                 for rank, action in actions}
    durations.update({_key(None, action): costs.duration(0, action) for action in outputs})
    longest = max(durations.values())
    scale = TICKS / longest if longest > 0 else 1.0
    unit = memory_unit(tables)
    length = {k: max(1, round(seconds * scale)) for k, seconds in durations.items()}

    model = cp_model.CpModel()
    horizon = sum(length.values()) + len(length)
    start, end = {}, {}
    for k in length:
        start[k] = model.NewIntVar(0, horizon, f"s{k}")
        end[k] = model.NewIntVar(0, horizon, f"e{k}")
    intervals = {rank: [model.NewIntervalVar(start[rank, a], length[rank, a], end[rank, a], "")
                        for r, a in actions if r == rank] for rank in range(shape.pp)}
    always = model.NewConstant(1)
    events: dict[int, list] = {rank: [] for rank in range(shape.pp)}  # (time, change, active)

    def add_events(rank: int, action: Action, stage: int, active) -> None:
        up, down = _memory_changes(tables, stage, action, unit)
        k = _key(rank, action)
        if up:
            events[rank].append((start[k], up, active))
        if down:
            events[rank].append((end[k], -down, active))

    runs_on = {}
    for action in outputs:
        k = _key(None, action)
        runs_on[action] = [model.NewBoolVar(f"o{rank}{action}") for rank in range(shape.pp)]
        model.AddExactlyOne(runs_on[action])
        for rank, present in enumerate(runs_on[action]):
            intervals[rank].append(model.NewOptionalIntervalVar(start[k], length[k], end[k],
                                                                present, ""))
            add_events(rank, action, 0, present)
    for rank, action in actions + [(None, action) for action in outputs]:
        for need_rank, need in dependencies(shape, 0 if rank is None else rank, action):
            model.Add(start[_key(rank, action)] >= end[_key(need_rank, need)])
        if action.op == "W":
            model.Add(start[rank, action] >= end[rank, action.with_op("B")])
    for rank, action in actions:
        add_events(rank, action, shape.stage_of(rank, action.chunk), always)
    for rank in range(shape.pp):
        model.AddNoOverlap(intervals[rank])
        if events[rank]:
            times, changes, actives = zip(*events[rank])
            model.AddReservoirConstraintWithActive(list(times), list(changes), list(actives), 0,
                                                   math.floor(cap / unit * (1 + 1e-12)))
    makespan = model.NewIntVar(0, horizon, "makespan")
    model.AddMaxEquality(makespan, list(end.values()))
    model.Minimize(makespan)
    if hint is not None:
        _add_hint(model, hint, length, start, runs_on)

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
        mine = [a for r, a in actions if r == rank]
        mine += [a for a in outputs if solver.Value(runs_on[a][rank])]
        programs.append(tuple(sorted(mine, key=lambda a: solver.Value(start[_key(rank, a)]))))
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


def cp_sat_and_tables(costs: SpanCosts) -> tuple[Any, dict]:
    """OR-Tools' CP-SAT module and `costs`' held-byte tables (`simulate.held_tables`), or the
    one-line refusal of `--exact` without either."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:       # pinned in requirements.txt; a trimmed install may lack it
        raise ScheduleError("--exact needs OR-Tools (pip install -r requirements.txt)") from None
    tables = held_tables(costs)
    if tables is None:
        raise ScheduleError("--exact needs the bytes of every span (a model or unit costs)")
    return cp_model, tables


def memory_unit(tables: dict) -> Fraction:
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


def _key(rank: Optional[int], action: Action) -> tuple[Optional[int], Action]:
    """The solver's name for `action` on `rank`: an O's is the same on every rank (None), as
    the solver chooses its rank."""
    return (None, action) if action.op == "O" else (rank, action)


def _add_hint(model, hint: Schedule, length: dict, start: dict, runs_on: dict) -> None:
    """Start times of `hint` replayed with the solver's own integer durations (so the hint is
    feasible as given), and the rank of each of its O's; a full backward becomes its B then its
    W."""
    programs = tuple(map(tuple, split_full_backwards(hint.programs)))
    split_hint = Schedule("hint", hint.pp, hint.microbatches, hint.splits, hint.chunks,
                          programs, hint.placement)
    graph = execution_graph(split_hint)
    finished = [0] * len(graph.steps)
    free = [0] * hint.pp
    for step in graph.order:
        rank, action = graph.steps[step]
        k = _key(rank, action)
        begin = max([free[rank]] + [finished[need] for need in graph.needs[step]])
        model.AddHint(start[k], begin)
        finished[step] = free[rank] = begin + length[k]
    for action, present in runs_on.items():
        for rank, literal in enumerate(present):
            model.AddHint(literal, rank == hint.output_rank(action.microbatch, action.span))
