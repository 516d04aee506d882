"""A lower bound under a memory cap from one rank solved exactly (OR-Tools CP-SAT), the others
relaxed to the time they must take: what `plan.py search --exact` adds where neither the cheap
bound (bounds.py, blind to memory but for the warm-up) nor the whole problem's solver proves
much.

For each rank alone: its F, B and W of every (micro-batch, chunk, span) are intervals on one
machine (no overlap), its held bytes stay within the cap (a reservoir), and everything the other
ranks do is replaced by delays no schedule can beat: an action starts no sooner than its head
(bounds.py), the iteration ends no sooner than an action's end plus its tail, and within one
micro-batch one of the rank's actions starts at least the longest chain of the micro-batch's
actions (on any rank, with the hops) after another that chain leads from. Every schedule of the
problem keeps its rank's actions in such an order, so the relaxed optimum of any rank bounds the
makespan from below, and CP-SAT's proven bound on it does too, solved or not.

Micro-batches are alike, so each group's m actions on the rank (one op, stage and span) are
taken in the order they start: renumbering a group's actions by their starts keeps every chain
(of two groups' starts, the earlier is matched with the earlier: if each start of one group is
at least its own micro-batch's start of another plus the chain, so is the n-th smallest of the
first at least the n-th smallest of the second plus the chain), and leaves the bytes and the
overlap as they were. The n-th of a group then starts no sooner than its n-th smallest head and
leaves at least its n-th smallest tail before the end (bounds.py's sorted lists), and the solver
no longer tries the m! numberings of each group.

Memory is counted for a unit's backward run full or split, whichever holds less at each moment
(the simulator's `held_change` and `held_rise` for both, the most an action holds while it runs
counted from its start to its end): a full backward of several layer groups frees activations
while it runs, where a split one has made all its accumulators on top of them, so the bound
holds for schedules of either kind (exact.py's model splits every backward). An O
(the output layer spread) runs on any rank: it stays in the chains, its time and bytes on no
rank's machine.

Durations and delays are rounded down to integer ticks, so the solver's bound, scaled back, is
below the true costs' optimum.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterator, Optional

from seq1f1b.plan.actions import Action, Schedule
from seq1f1b.plan.bounds import (Group, group_durations, group_heads, group_lags,
                                 group_tails, rank_lower_bounds)
from seq1f1b.plan.exact import cp_sat_and_tables, memory_unit
from seq1f1b.plan.simulate import SpanCosts, held_change, held_rise, timelines

TICKS = 10_000           # the longest action, in solver time units
_NOISE = 1e-6            # of a tick: far above float error, far below a tick


@dataclass(frozen=True)
class RankBound:
    """The relaxation's proven bound on each rank, and the largest."""

    bound: float                   # max over ranks: no schedule of the problem is shorter
    per_rank: tuple[float, ...]
    solved: tuple[bool, ...]       # the rank's relaxation was solved to optimality


def rank_bound(shape: Schedule, costs: SpanCosts, cap: float, time_limit_s: float,
               hint: Optional[Schedule] = None, workers: int = 2) -> RankBound:
    """The bound of the module doc for `shape`'s problem (P, m, k, V, placement) under `costs`
    with each rank holding at most `cap`, the ranks sharing `time_limit_s`: taken in order of
    their cheap bound (bounds.rank_lower_bounds), highest first, each given half the time left
    (the last all of it), since the rank that binds is most often the one that binds cheaply
    too (at 7B/64K, P = 8 on a loop, the last stage's rank: it needs about 18 s of 2 workers,
    which an even share of 60 s left it short of, 2.808 against 2.8296 proven).
    `hint`: a valid schedule of the problem, whose timing on each rank the solver starts from."""
    cp_model, _ = cp_sat_and_tables(costs)
    timed = timelines(hint, costs) if hint is not None else None
    cheap = rank_lower_bounds(shape, costs, cap)
    order = sorted(range(shape.pp), key=lambda rank: (-cheap[rank], rank))
    found, solved, left = [0.0] * shape.pp, [False] * shape.pp, float(time_limit_s)
    for taken, relaxed in enumerate(relaxations(shape, costs, cap, order)):
        began = time.monotonic()
        if timed is not None:
            relaxed.add_hint(timed[relaxed.rank])
        solver = cp_model.CpSolver()
        # a rank solved early leaves its time to the next
        share = left if taken == shape.pp - 1 else left / 2
        solver.parameters.max_time_in_seconds = max(0.1, share)
        solver.parameters.num_workers = workers
        status = solver.Solve(relaxed.model)
        found[relaxed.rank] = max(0.0, solver.BestObjectiveBound() / relaxed.scale)
        solved[relaxed.rank] = status == cp_model.OPTIMAL
        left -= time.monotonic() - began
    return RankBound(max(found), tuple(found), tuple(solved))


def relaxations(shape: Schedule, costs: SpanCosts, cap: float,
                ranks: Optional[list[int]] = None) -> Iterator["RankRelaxation"]:
    """Each rank's relaxation of `shape`'s problem under `costs` and `cap`, in the order of
    `ranks` (default: rank by rank; the chains between them computed once)."""
    cp_model, tables = cp_sat_and_tables(costs)
    durations = group_durations(shape, costs)
    heads, tails, lags = group_heads(shape, costs), group_tails(shape, costs), \
        group_lags(shape, costs)
    scale = TICKS / max(durations.values()) if max(durations.values()) > 0 else 1.0
    for rank in range(shape.pp) if ranks is None else ranks:
        relaxed = RankRelaxation(cp_model, shape, rank, durations, heads, tails, lags, scale)
        relaxed.add_memory(tables, cap, memory_unit(tables))
        yield relaxed


class RankRelaxation:
    """One rank's relaxation (module doc) as a CP-SAT model."""

    def __init__(self, cp_model, shape: Schedule, rank: int, durations: dict[Group, float],
                 heads: dict[Group, list[float]], tails: dict[Group, list[float]],
                 lags: dict[Group, dict[Group, float]], scale: float) -> None:
        self.shape, self.rank, self.scale, self.seconds = shape, rank, scale, durations
        self.groups = [(op, shape.stage_of(rank, chunk), span) for chunk in range(shape.chunks)
                       for op in "FBW" for span in range(shape.splits)]
        self.model = model = cp_model.CpModel()
        self.length = {g: self._ticks(durations[g]) for g in self.groups}
        m = shape.microbatches
        horizon = self._ticks(max(heads[g][-1] for g in self.groups)) \
            + m * sum(self.length.values()) + self._ticks(max(t[0] for t in tails.values())) + 1
        self.start, self.end, intervals = {}, {}, []
        for g in self.groups:
            for i in range(m):
                self.start[g, i] = model.NewIntVar(self._ticks(heads[g][0]), horizon, "")
                self.end[g, i] = model.NewIntVar(0, horizon, "")
                intervals.append(model.NewIntervalVar(self.start[g, i], self.length[g],
                                                      self.end[g, i], ""))
        model.AddNoOverlap(intervals)
        for i in range(m):
            for before in self.groups:
                for after, lag in lags[before].items():
                    if after in self.length and after != before:
                        model.Add(self.start[after, i] >= self.start[before, i]
                                  + self._ticks(lag))
        # each group's actions in micro-batch order, with the sorted heads and tails
        # (module doc)
        self.makespan = model.NewIntVar(0, horizon, "makespan")
        for g in self.groups:
            for i in range(m):
                model.Add(self.start[g, i] >= self._ticks(heads[g][i]))
                model.Add(self.makespan >= self.end[g, i] + self._ticks(tails[g][m - 1 - i]))
                if i:
                    model.Add(self.start[g, i] >= self.start[g, i - 1])
        model.Minimize(self.makespan)

    def _group(self, action: Action) -> Group:
        return action.op, self.shape.stage_of(self.rank, action.chunk), action.span

    def _ticks(self, seconds: float) -> int:
        """A duration or delay in whole ticks, rounded down (and past float noise: a real
        schedule's times, from sums taken in another order, still satisfy it in ticks)."""
        return max(0, math.floor(seconds * self.scale - _NOISE))

    def _time(self, seconds: float) -> int:
        """A real schedule's time in ticks, for a hint: rounded down, float noise up."""
        return math.floor(seconds * self.scale + _NOISE)

    def add_memory(self, tables: dict, cap: float, unit: Fraction) -> None:
        """The rank's held bytes, at most `cap`: each unit's backward counted full or split,
        whichever holds less (module doc)."""
        times, changes = [], []
        for op, stage, span in self.groups:
            if op == "W":
                continue
            for i in range(self.shape.microbatches):
                if op == "F":
                    rise = _total(held_change(tables, stage, Action("F", i, span), False)
                                  .allocated)
                    events = [(self.start[("F", stage, span), i], rise)]
                else:
                    at_start, at_end, after_w = _least_backward(tables, stage, span)
                    events = [(self.start[("B", stage, span), i], at_start),
                              (self.end[("B", stage, span), i], at_end),
                              (self.end[("W", stage, span), i], after_w)]
                for moment, change in events:
                    count = _units(change, unit)
                    if count:
                        times.append(moment)
                        changes.append(count)
        if times:
            rises = sum(c for c in changes if c > 0)
            self.model.AddReservoirConstraint(times, changes, -rises,
                                              math.floor(cap / unit * (1 + 1e-12)))

    def add_hint(self, timeline: list) -> None:
        """Start the solver from a real schedule's timing on this rank, each group's actions
        taken in the order they start (as the model numbers them)."""
        starts: dict[Group, list[float]] = {}
        for t in timeline:
            action = t.action
            if action.op == "O":
                continue
            g = self._group(action)
            starts.setdefault(g, []).append(t.start)
            if action.op == "B" and self.shape.full_backward(self.rank, action):
                starts.setdefault(("W", g[1], g[2]), []).append(t.start + self.seconds[g])
        for g, found in starts.items():
            for i, start in enumerate(sorted(found)):
                self.model.AddHint(self.start[g, i], self._time(start))


def _total(change: dict[str, float]) -> float:
    return sum(change.values())


def _least_backward(tables: dict, stage: int, span: int) -> tuple[float, float, float]:
    """A unit's held-byte changes at its B's start, its B's end and its W's end (a full
    backward's end), the least of running it full or split at each moment (module doc)."""
    b, w = Action("B", 0, span), Action("W", 0, span)
    rise, release = held_rise(held_change(tables, stage, b, True))
    full = [rise, rise, rise - release]          # one action from the B's start to the W's end
    rise, release = held_rise(held_change(tables, stage, b, False))
    w_rise, w_release = held_rise(held_change(tables, stage, w, True))
    split = [rise, rise - release, rise - release + w_rise - w_release]
    least = [min(pair) for pair in zip(full, split)]
    return least[0], least[1] - least[0], least[2] - least[1]


def _units(change: float, unit: Fraction) -> int:
    """`change` bytes in whole units, rounded down: an allocation a little less, a release a
    little more (a layer group's share need not be a whole unit), so a level never exceeds the
    true one rounded down, nor the cap in units when the true one is within it."""
    return math.floor(Fraction(change).limit_denominator(10**6) / unit)
