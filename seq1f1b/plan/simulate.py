"""Replay a schedule with per-action costs: makespan, bubble and peak memory per rank.

Each rank runs its program in order; an action starts when its rank is free and every action it
depends on (`actions.dependencies`, the one place the rules live) has finished, plus a p2p latency
when that action ran on another rank. Nothing else is shared, so timing the actions in any order
that respects those two constraints yields the event-driven timeline: `validate.topological_order`
gives one. Invalid schedules (incomplete, misordered, deadlocking) are refused with
`validate.validate`'s message.

Memory: a span is live on a rank from the start of its F until the end of the action that frees its
activations: B, or W when the schedule splits backward. Its K/V stay in the cache until its B (the
last reader, see costs.kv_cache_bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

from seq1f1b.plan.actions import Action, Schedule, ScheduleError, dependencies
from seq1f1b.plan.costs import (ModelConfig, SpanFlops, activation_bytes, kv_cache_bytes,
                                layer_flops, logits_flops)
from seq1f1b.plan.partition import span_bounds
from seq1f1b.plan.validate import topological_order, validate

Table = tuple[tuple[float, ...], ...]
"""Indexed [virtual stage][span]."""


@dataclass(frozen=True)
class SpanCosts:
    """Duration of each op, and optionally the bytes, of every (virtual stage, span)."""

    forward: Table
    backward: Table            # the B action: full backward, or input grad when W is split off
    weight: Table | None       # the W action; None for schedules without W
    activation_bytes: Table | None = None
    kv_cache_bytes: Table | None = None

    def duration(self, stage: int, action: Action) -> float:
        table = {"F": self.forward, "B": self.backward, "W": self.weight}[action.op]
        if table is None:
            raise ScheduleError(f"no cost given for {action.op} actions (--uniform-cost F B W)")
        return table[stage][action.span]


def uniform_costs(schedule: Schedule, forward: float = 1.0, backward: float = 2.0,
                  weight: float | None = None) -> SpanCosts:
    """The same F, B (and W) duration for every span on every stage."""
    if schedule.split_backward and weight is None:
        raise ScheduleError(f"--uniform-cost: schedule {schedule.name!r} has W actions; "
                            "give three costs F B W")
    if min(forward, backward, weight if weight is not None else 0.0) < 0:
        raise ScheduleError("--uniform-cost: costs must not be negative")

    def table(value: float) -> Table:
        return tuple((float(value),) * schedule.splits for _ in range(schedule.num_stages))

    return SpanCosts(table(forward), table(backward),
                     table(weight) if schedule.split_backward else None)


def layers_per_stage(model: ModelConfig, schedule: Schedule) -> int:
    """Transformer layers of one virtual stage: N / (P * V), which must be whole."""
    if model.num_layers % schedule.num_stages:
        raise ScheduleError(f"--pp/--chunks: the model's {model.num_layers} layers are not "
                            f"divisible by pp*chunks = {schedule.pp}*{schedule.chunks}")
    return model.num_layers // schedule.num_stages


def model_costs(schedule: Schedule, model: ModelConfig, span_lengths: list[int], *,
                flops_per_second: float, tp: int = 1, sequence_parallel: bool = False,
                batch: int = 1) -> SpanCosts:
    """Durations and bytes from costs.py for `model` with the sequence cut into `span_lengths`.

    A virtual stage runs N/(P*V) layers on each span; the last one also runs the output layer.
    Each GPU does 1/TP of the FLOPs at `flops_per_second`. B is the full backward (2x forward),
    or the input-gradient part when the schedule has W actions (see costs.SpanFlops).
    """
    if len(span_lengths) != schedule.splits:
        raise ScheduleError(f"--splits is {schedule.splits} but {len(span_lengths)} span "
                            "lengths were given")
    if flops_per_second <= 0:
        raise ScheduleError("--device-tflops must be positive")
    layers = layers_per_stage(model, schedule)
    bounds = span_bounds(span_lengths)
    last = schedule.num_stages - 1

    def stage_flops(stage: int, start: int, end: int) -> SpanFlops:
        body = layer_flops(model, end - start, end, batch).scaled(layers)
        return body + logits_flops(model, end - start, batch) if stage == last else body

    grid = [[stage_flops(stage, start, end) for start, end in bounds]
            for stage in range(schedule.num_stages)]
    group_rate = tp * flops_per_second           # the TP group shares each span's FLOPs

    def seconds(kind: Callable[[SpanFlops], float]) -> Table:
        return tuple(tuple(kind(cell) / group_rate for cell in row) for row in grid)

    def per_span_bytes(kind: Callable[[int], float]) -> Table:
        row = tuple(float(layers * kind(length)) for length in span_lengths)
        return (row,) * schedule.num_stages

    split = schedule.split_backward
    return SpanCosts(
        forward=seconds(lambda f: f.forward),
        backward=seconds(lambda f: f.input_grad if split else f.backward),
        weight=seconds(lambda f: f.weight_grad) if split else None,
        activation_bytes=per_span_bytes(
            lambda n: activation_bytes(model, n, batch, tp, sequence_parallel)),
        kv_cache_bytes=per_span_bytes(lambda n: kv_cache_bytes(model, n, batch, tp)))


@dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclass
class RankReport:
    rank: int
    busy: float
    idle: float
    peak_live_spans: int
    peak_activation_bytes: float | None
    peak_kv_cache_bytes: float | None
    timeline: list[TimedAction] = field(repr=False)


@dataclass
class SimulationReport:
    """What one replay of a schedule found; `to_dict` is the JSON form tools print."""

    schedule: str
    pp: int
    microbatches: int
    splits: int
    chunks: int
    makespan: float
    bubble_ratio: float
    ranks: list[RankReport]

    def to_dict(self, timeline: bool = True) -> dict:
        """Plain data for JSON; with `timeline`, each rank's actions with start and end times."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "ranks"}
        out["ranks"] = []
        for rank in self.ranks:
            rank_out = {f.name: getattr(rank, f.name) for f in fields(rank)
                        if f.name != "timeline"}
            if timeline:
                rank_out["actions"] = [
                    {"action": t.action.format(self.chunks > 1), "start": t.start, "end": t.end}
                    for t in rank.timeline]
            out["ranks"].append(rank_out)
        return out


def simulate(schedule: Schedule, costs: SpanCosts, p2p_latency: float = 0.0
             ) -> SimulationReport:
    """Replay `schedule` with `costs`; raises ScheduleError when it is invalid (incomplete,
    misordered, deadlocking: validate.validate's message)."""
    if p2p_latency < 0:
        raise ScheduleError("--p2p-latency must not be negative")
    validate(schedule)
    finished: dict[tuple[int, Action], float] = {}
    timelines: list[list[TimedAction]] = [[] for _ in range(schedule.pp)]
    free_at = [0.0] * schedule.pp
    for rank, action in topological_order(schedule):
        start = max([free_at[rank]] + [
            finished[(dep_rank, dep)] + (p2p_latency if dep_rank != rank else 0.0)
            for dep_rank, dep in dependencies(schedule, rank, action)])
        end = start + costs.duration(schedule.stage_of(rank, action.chunk), action)
        finished[(rank, action)] = free_at[rank] = end
        timelines[rank].append(TimedAction(action, start, end))
    makespan = max(free_at, default=0.0)
    ranks = [_rank_report(schedule, costs, rank, timelines[rank], makespan)
             for rank in range(schedule.pp)]
    idle = sum(r.idle for r in ranks)
    return SimulationReport(schedule.name, schedule.pp, schedule.microbatches, schedule.splits,
                            schedule.chunks, makespan,
                            idle / (schedule.pp * makespan) if makespan else 0.0, ranks)


def _rank_report(schedule: Schedule, costs: SpanCosts, rank: int, timeline: list[TimedAction],
                 makespan: float) -> RankReport:
    frees_activations = "W" if schedule.split_backward else "B"
    live = 0
    peak_live = 0
    with_bytes = costs.activation_bytes is not None and costs.kv_cache_bytes is not None
    act = kv = peak_act = peak_kv = 0.0
    for timed in timeline:          # program order = time order on one rank
        action = timed.action
        stage = schedule.stage_of(rank, action.chunk)
        if action.op == "F":
            live += 1
            peak_live = max(peak_live, live)
            if with_bytes:
                act += costs.activation_bytes[stage][action.span]
                kv += costs.kv_cache_bytes[stage][action.span]
                peak_act, peak_kv = max(peak_act, act), max(peak_kv, kv)
        # The freeing action still holds its span while it runs: release after it.
        if action.op == frees_activations:
            live -= 1
            if with_bytes:
                act -= costs.activation_bytes[stage][action.span]
        if action.op == "B" and with_bytes:
            kv -= costs.kv_cache_bytes[stage][action.span]
    busy = sum(t.end - t.start for t in timeline)
    return RankReport(rank, busy, makespan - busy, peak_live,
                      peak_act if with_bytes else None, peak_kv if with_bytes else None, timeline)
