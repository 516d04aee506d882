"""Rank the layouts of a query: the fastest that fit, without simulating most of them.

Every candidate's projected iteration time is at least its pipeline's lower bound: rank r can
start no earlier than span j's forward has crossed the stages before it, and then runs all of
its actions back to back (`_Bound`, from the same per-action costs the projection replays; it
depends on the layout, not on the schedule's order, so one bound serves every schedule of the
same placement and m only scales it). Candidates are taken in order of that bound; each is
judged by the estimator's OOM verdict first (`estimate_memory`, as `plan.py memory`) and only a
fitting one is projected (`project`, as reproduce_paper.py). The search stops when the next
bound exceeds the top-N'th projected time, so the top N are exactly those an exhaustive
evaluation would rank first (tests/unit/test_tune.py checks). Schedules are built, compiled
(replay.py) and profiled (held.py) once per shape (schedule, P, m, k, V) and shared by every
layout of that shape. A layout out of memory on the rank of its last stage brings in its twin
with the loss's backward at F (`--loss-backward-in-forward`, which lowers only that rank) at
the twin's own bound, unless the query asks for the flag always or never: the flag is listed
where only it makes a layout fit.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from seq1f1b.plan import registry
from seq1f1b.plan.actions import Schedule, ScheduleError
from seq1f1b.plan.memory import MemoryEstimate, TrainingSetup, estimate_memory
from seq1f1b.plan.projection import Projection, pipeline_costs, project
from seq1f1b.plan.simulate import RankReport, SimulationReport, SpanCosts
from seq1f1b.plan.tune.devices import Gpu
from seq1f1b.plan.tune.held import HeldProfile
from seq1f1b.plan.tune.replay import CompiledSchedule
from seq1f1b.plan.tune.space import Query, candidates


def layout_name(setup: TrainingSetup) -> str:
    """The layout in one token-ish line: TP, CP, PP, V, DP, m, schedule, k, partition,
    recompute, uneven stages, the loss's backward at F ("loss@F"), a searched schedule's cap and
    whether its search may spread the output layer ("spread")."""
    text = (f"TP{setup.tp} CP{setup.cp} PP{setup.pp} V{setup.chunks} DP{setup.dp} "
            f"m{setup.microbatches} {setup.schedule} k{setup.splits}")
    if setup.splits > 1:
        text += f" {setup.partition}"
    text += f" rc:{setup.recompute_granularity or 'none'}"
    if setup.stage_layers.uneven:
        text += (f" first:{setup.decoder_first_pipeline_num_layers or '-'}"
                 f" last:{setup.decoder_last_pipeline_num_layers or '-'}")
    if setup.loss_backward_in_forward:
        text += " loss@F"
    if setup.schedule_memory_cap:
        text += f" cap:{setup.schedule_memory_cap}"
    if setup.spread_output:
        text += " spread"
    return text


@dataclass
class Ranked:
    """One projected layout that fits."""

    setup: TrainingSetup
    estimate: MemoryEstimate
    projection: Projection
    overheads_s: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return layout_name(self.setup)


@dataclass
class Counts:
    """What the search did, for its report."""

    candidates: int = 0
    memory_checked: int = 0
    oom: int = 0
    invalid: int = 0            # a schedule that refuses the shape (e.g. its m)
    projected: int = 0
    shapes: int = 0
    seconds: float = 0.0
    searched_seconds: float = 0.0     # seq1f1b-zb-auto on the top layouts (searched.py)


@dataclass
class TuneResult:
    query: Query
    gpu: Gpu
    ranked: list[Ranked]
    counts: Counts
    searched: dict[int, Optional[Ranked]] = field(default_factory=dict)
    """seq1f1b-zb-auto on the layout of `ranked[i]`, by i (None: none fits), searched.py."""

    @property
    def winner(self) -> Optional[Ranked]:
        """What to launch: the fastest of the top layout and the searched ones."""
        rows = self.ranked[:1] + [row for row in self.searched.values() if row is not None]
        return min(rows, key=lambda row: row.projection.iteration_s, default=None)


def _shape(setup: TrainingSetup) -> tuple:
    return setup.plan_name, setup.pp, setup.microbatches, setup.splits, setup.chunks


def _schedule_shape(schedule: Schedule) -> tuple:
    return schedule.name, schedule.pp, schedule.microbatches, schedule.splits, schedule.chunks


class _Shapes:
    """Schedules, their compiled replays and held profiles, one per shape (name, P, m, k, V)."""

    def __init__(self) -> None:
        self.schedules: dict[tuple, Schedule] = {}
        self.compiled: dict[tuple, CompiledSchedule] = {}
        self.held: dict[tuple, HeldProfile] = {}

    def schedule(self, setup: TrainingSetup) -> Schedule:
        key = _shape(setup)
        if key not in self.schedules:
            self.schedules[key] = registry.build(*key)
        return self.schedules[key]

    def simulate(self, schedule: Schedule, costs: SpanCosts) -> SimulationReport:
        key = _schedule_shape(schedule)
        if key not in self.compiled:
            self.compiled[key] = CompiledSchedule.of(schedule)
        return self.compiled[key].simulate(costs)

    def held_peaks(self, schedule: Schedule, costs: SpanCosts) -> list[RankReport]:
        key = _schedule_shape(schedule)
        if key not in self.held:
            self.held[key] = HeldProfile.of(schedule)
        return self.held[key].peaks(costs)


@dataclass(frozen=True)
class _Bound:
    """Per rank: the earliest its first action can start, and its busy seconds per
    micro-batch (forward, backward and weight-gradient of every span of its chunks)."""

    warm_up: tuple[float, ...]
    busy_per_microbatch: tuple[float, ...]

    @classmethod
    def of(cls, schedule: Schedule, costs: SpanCosts) -> "_Bound":
        splits = range(schedule.splits)
        warm_up = []
        for rank in range(schedule.pp):     # stages 0..rank-1 sit on ranks 0..rank-1
            warm_up.append(min(sum(costs.forward[v][j] + (costs.hop[v][j] if costs.hop else 0)
                                   for v in range(rank)) for j in splits))
        busy = []
        for rank in range(schedule.pp):
            total = 0.0
            for chunk in range(schedule.chunks):
                v = schedule.stage_of(rank, chunk)
                total += sum(costs.forward[v][j] + costs.backward[v][j]
                             + (costs.weight[v][j] if costs.weight else 0.0) for j in splits)
            busy.append(total)
        return cls(tuple(warm_up), tuple(busy))

    def seconds(self, microbatches: int) -> float:
        return max(w + microbatches * b for w, b in zip(self.warm_up, self.busy_per_microbatch))


class _Bounds:
    """Lower bounds of the pipeline seconds, one cost table per layout and placement."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.standins: dict[tuple, Optional[Schedule]] = {}
        self.bounds: dict[tuple, Optional[_Bound]] = {}

    def _standin(self, setup: TrainingSetup) -> Optional[Schedule]:
        """A schedule of the setup's name, P, k and V (the fewest micro-batches that build):
        its cost tables are the setup's, whatever m."""
        key = (setup.plan_name, setup.pp, setup.splits, setup.chunks)
        if key not in self.standins:
            self.standins[key] = None
            for microbatches in dict.fromkeys((setup.pp, 2 * setup.pp, setup.microbatches)):
                try:
                    self.standins[key] = registry.build(*key[:2], microbatches, *key[2:])
                    break
                except ScheduleError:
                    continue
        return self.standins[key]

    def seconds(self, setup: TrainingSetup) -> Optional[float]:
        info = registry.get(setup.plan_name)
        key = (setup.tp, setup.cp, setup.pp, setup.dp, setup.chunks, setup.splits,
               setup.partition, setup.recompute_granularity, setup.stage_layers,
               setup.loss_backward_in_forward, info.placement, info.splits_backward)
        if key not in self.bounds:
            schedule = self._standin(setup)
            self.bounds[key] = None if schedule is None else _Bound.of(
                schedule, pipeline_costs(setup, self.gpu.device, schedule))
        bound = self.bounds[key]
        return None if bound is None else bound.seconds(setup.microbatches)


def _last_stage_is_fullest(estimate: MemoryEstimate, schedule: Schedule) -> bool:
    """Whether the rank holding the last stage (the output layer's) has the peak."""
    rank, _ = schedule.owner_of(schedule.num_stages - 1)
    return next(stage for stage in estimate.stages if stage.rank == rank) is estimate.peak_stage


def _without_recompute(setup: TrainingSetup) -> TrainingSetup:
    return replace(setup, recompute_granularity=None, recompute_method=None,
                   recompute_num_layers=None)


def tune(query: Query, gpu: Gpu, top: int = 10) -> TuneResult:
    """The `top` fastest fitting layouts of `query` on `gpu`, best first, each with its
    memory estimate, projection and the seconds each k-dependent term adds.

    A layout with recompute first enters the queue at its no-recompute twin's bound (its
    backward re-runs forwards, so that bound holds for it too) and gets its own when it comes
    up: most are never bounded on their own costs."""
    if top < 1:
        raise ScheduleError(f"--top must be a positive integer, got {top}")
    started = time.perf_counter()
    counts = Counts()
    bounds, shapes = _Bounds(gpu), _Shapes()
    queue: list[tuple[float, bool, int, TrainingSetup]] = []   # (bound, own bound?, ...)
    for index, setup in enumerate(candidates(query)):
        counts.candidates += 1
        own = setup.recompute is None
        try:
            seconds = bounds.seconds(setup if own else _without_recompute(setup))
        except ScheduleError:
            seconds = None
        if seconds is None:
            counts.invalid += 1
            continue
        queue.append((seconds, own, index, setup))
    heapq.heapify(queue)
    best: list[tuple[float, int, Ranked]] = []       # a min-heap of -iteration: worst on top
    while queue:
        seconds, own, index, setup = heapq.heappop(queue)
        if len(best) == top and seconds > -best[0][0]:
            break
        if not own:
            seconds = bounds.seconds(setup)
            heapq.heappush(queue, (seconds, True, index, setup))
            continue
        counts.memory_checked += 1
        try:
            schedule = shapes.schedule(setup)
            estimate = estimate_memory(setup, held_peaks=shapes.held_peaks, schedule=schedule)
        except ScheduleError:
            counts.invalid += 1
            continue
        if not estimate.fits(gpu.memory_gib, gpu.reserve_ratio):
            counts.oom += 1
            if query.loss_backward_in_forward == "both" and _last_stage_is_fullest(
                    estimate, schedule) and not setup.loss_backward_in_forward:
                # the flag lowers only the last stage's rank: its twin may fit
                twin = replace(setup, loss_backward_in_forward=True)
                counts.candidates += 1
                heapq.heappush(queue, (bounds.seconds(twin), True, index, twin))
            continue
        projection = project(setup, gpu.device, simulator=shapes.simulate, schedule=schedule)
        counts.projected += 1
        entry = (-projection.iteration_s, -index, Ranked(setup, estimate, projection))
        if len(best) < top:
            heapq.heappush(best, entry)
        elif entry[:2] > best[0][:2]:
            heapq.heapreplace(best, entry)
    ranked = [entry[2] for entry in sorted(best, key=lambda e: (-e[0], -e[1]))]
    for row in ranked:
        row.overheads_s = row.projection.overheads()
    counts.shapes = len(shapes.schedules)
    counts.seconds = time.perf_counter() - started
    return TuneResult(query, gpu, ranked, counts)
