"""The simulator's timing replay, compiled once per schedule so a planner can run it thousands
of times.

`simulate.timelines` walks `validate.execution_graph` and looks every duration and p2p delay up
through `SpanCosts.duration` and the schedule's placement on each step: right for one replay,
slow for a search that replays one schedule shape (P, m, k, V) under many layouts' costs. A
`CompiledSchedule` does that lookup work once: each step's rank, virtual stage, op and span, and
for each dependency the p2p row it crosses (or none on its own rank), so a replay is one loop of
additions and maxima. The rules are the simulator's, read from the same execution graph; the
makespan is bit-for-bit the simulator's (tests/unit/test_tune.py compares every registered
schedule), and busy and idle time agree to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.simulate import RankReport, SimulationReport, SpanCosts
from seq1f1b.plan.validate import execution_graph, validate

_OPS = {"F": 0, "B": 1, "W": 2}


@dataclass(frozen=True)
class CompiledSchedule:
    """One schedule's steps as flat lists (see the module docstring)."""

    schedule: Schedule
    order: tuple[int, ...]
    ranks: tuple[int, ...]                  # per step
    cells: tuple[tuple[int, int, int, bool], ...]   # per step: op, stage, span, full backward
    needs: tuple[tuple[tuple[int, int, int], ...], ...]  # per step: (step, hop row or -1, span)

    @classmethod
    def of(cls, schedule: Schedule) -> "CompiledSchedule":
        validate(schedule)          # an invalid schedule is refused with the simulator's message
        graph = execution_graph(schedule)
        ranks, cells = [], []
        for rank, action in graph.steps:
            stage = schedule.stage_of(rank, action.chunk)
            ranks.append(rank)
            cells.append((_OPS[action.op], stage, action.span,
                          schedule.full_backward(rank, action)))
        needs = []
        for step, (rank, _) in enumerate(graph.steps):
            crossing = []
            for need in graph.needs[step]:
                sender, action = graph.steps[need]
                if sender == rank:
                    crossing.append((need, -1, 0))
                else:       # simulate._p2p: activations go forward, gradients back
                    stage = cells[need][1]
                    crossing.append((need, stage if action.op == "F" else stage - 1,
                                     action.span))
            needs.append(tuple(crossing))
        return cls(schedule, tuple(graph.order), tuple(ranks), tuple(cells), tuple(needs))

    def durations(self, costs: SpanCosts) -> list[float]:
        """Each step's seconds, as `SpanCosts.duration` gives them."""
        tables = (costs.forward, costs.backward, costs.weight)
        weight = costs.weight
        return [tables[op][stage][span] + (weight[stage][span] if full and weight is not None
                                           else 0.0)
                for op, stage, span, full in self.cells]

    def simulate(self, costs: SpanCosts) -> SimulationReport:
        """`simulate.simulate(schedule, costs)`'s makespan, bubble and per-rank busy and idle
        time (the ranks' timelines are not kept, and their memory fields are empty: held.py
        finds the held peaks)."""
        duration = self.durations(costs)
        hop = costs.hop
        finished = [0.0] * len(duration)
        free_at = [0.0] * self.schedule.pp
        busy = [0.0] * self.schedule.pp
        ranks, needs = self.ranks, self.needs
        for step in self.order:
            rank = ranks[step]
            start = free_at[rank]
            for need, row, span in needs[step]:
                ready = finished[need] + (hop[row][span] if row >= 0 and hop is not None
                                          else 0.0)
                if ready > start:
                    start = ready
            finished[step] = free_at[rank] = start + duration[step]
            busy[rank] += duration[step]
        makespan = max(free_at, default=0.0)
        schedule = self.schedule
        reports = [RankReport(rank, busy[rank], makespan - busy[rank], 0, None, None, [])
                   for rank in range(schedule.pp)]
        idle = sum(r.idle for r in reports)
        return SimulationReport(schedule.name, schedule.pp, schedule.microbatches,
                                schedule.splits, schedule.chunks, makespan,
                                idle / (schedule.pp * makespan) if makespan else 0.0, reports)
