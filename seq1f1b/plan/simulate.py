"""Replay a schedule with per-action costs: makespan, bubble and peak memory per rank.

Each rank runs its program in order; an action starts when its rank is free and every action it
depends on (`actions.dependencies`, the one place the rules live) has finished, plus a p2p latency
when that action ran on another rank. Nothing else is shared, so timing the actions in any order
that respects those two constraints yields the event-driven timeline: `validate.execution_graph`
gives one, with each action's dependencies. Invalid schedules (incomplete, misordered,
deadlocking) are refused with `validate.validate`'s message.

Memory: a span is live on a rank from the start of its F until the end of the action that frees its
activations: W, or B when the rank runs no W of that unit (a full backward); the loss's logits (last stage only) go with
the activations. The K/V cache is per micro-batch, not per span: the runtime allocates one buffer
for the whole sequence (all k spans) of a micro-batch on a virtual stage at its first span's
forward F(i,0) and frees it after its last backward B(i,0) (see costs.kv_cache_bytes), so a
micro-batch in flight holds all of its spans' K/V however few of them have run.

Measured iterations enter through `measured_report` (the same report built from a runtime trace)
and `calibrated_costs` (per-action costs taken from measured reports), so a measured run and its
prediction are compared on one footing; `span_timings` sums those costs per span, the records a
time fit of the spans takes (span_fit.py).
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Callable, NamedTuple, Sequence

from seq1f1b.plan.actions import (Action, Schedule, ScheduleError, dependencies,
                                  parse_action)
from seq1f1b.plan.context_parallel import kv_replication
from seq1f1b.plan.costs import (ModelConfig, Recompute, SpanFlops, chunk_activation_bytes,
                                kv_cache_bytes, layer_flops, logits_bytes, logits_flops,
                                output_layer_input_bytes)
from seq1f1b.plan.partition import span_bounds
from seq1f1b.plan.span_fit import SpanTiming
from seq1f1b.plan.stage_layers import EVEN, StageLayers, layers_per_virtual_stage
from seq1f1b.plan.validate import execution_graph, validate

Table = tuple[tuple[float, ...], ...]
"""Indexed [virtual stage][span]."""


class Efficiency(NamedTuple):
    """Fractions of the given FLOP rates one span reaches: its GEMMs, its core attention's
    forward and backward (different kernels, split along different axes)."""

    gemm: float
    attention_forward: float
    attention_backward: float


@dataclass(frozen=True)
class SpanCosts:
    """Duration of each op, and optionally the bytes, of every (virtual stage, span)."""

    forward: Table
    backward: Table            # the B action: full backward, or input grad when W is split off
    weight: Table | None       # the W action; None for schedules without W
    activation_bytes: Table | None = None
    kv_cache_bytes: Table | None = None
    logits_bytes: Table | None = None      # the loss's fp32 softmax and the head's inputs:
                                           # non-zero on the last stage only
    kv_accumulator_bytes: Table | None = None  # dK/dV accumulated for each span's rows (fp32
                                               # whatever the precision); None: kv_cache_bytes
    hop: Table | None = None   # [v][span]: p2p seconds between virtual stages v and v+1 (either
                               # way, P*V - 1 rows); None: simulate's flat p2p_latency
    head_gradient_bytes: Table | None = None   # [v][0]: with the loss's backward at F, the output
                               # weights' gradient of each micro-batch in flight on the last
                               # stage, from F(i,0) until after B(i,k-1) (runtime/early_loss.py)
    layer_groups: tuple[int, ...] | None = None  # [v]: the parts a full backward of stage v
                               # goes through one after another, each freeing its share of the
                               # span's activations and making its share of the dK/dV
                               # accumulators (its layers, or its full-recompute groups);
                               # None: one part (both at once)
    output: tuple[float, ...] | None = None  # [span]: an O action (the output layer and the
                               # loss, forward and backward), on whichever rank runs it; None:
                               # the last stage's F and B run them (actions.OPS)
    output_bytes: tuple[float, ...] | None = None  # [span]: what an O holds while it runs (the
                               # loss's fp32 softmax, the layer's input and its gradient)

    def duration(self, stage: int, action: Action, full_backward: bool = False) -> float:
        """Seconds of `action` on `stage`; a `full_backward` B (its unit has no W) also does the
        weight grads: B + W when the costs split them (`weight` given), else B."""
        if action.op == "O":
            if self.output is None:
                raise ScheduleError("no cost given for O actions (the output layer spread over "
                                    "the ranks)")
            return self.output[action.span]
        table = {"F": self.forward, "B": self.backward, "W": self.weight}[action.op]
        if table is None:
            raise ScheduleError(f"no cost given for {action.op} actions (--uniform-cost F B W)")
        if full_backward and self.weight is not None:
            return table[stage][action.span] + self.weight[stage][action.span]
        return table[stage][action.span]


def uniform_costs(schedule: Schedule, forward: float = 1.0, backward: float = 2.0,
                  weight: float | None = None, output: float | None = None) -> SpanCosts:
    """The same F, B (and W) duration for every span on every stage; `output`: every O's (a
    schedule with O actions needs it)."""
    if schedule.split_backward and weight is None:
        raise ScheduleError(f"--uniform-cost: schedule {schedule.name!r} has W actions; "
                            "give three costs F B W")
    if schedule.spread_output and output is None:
        raise ScheduleError(f"--uniform-cost: schedule {schedule.name!r} has O actions; give "
                            "their cost too (--output-cost)")
    if min(forward, backward, weight if weight is not None else 0.0,
           output if output is not None else 0.0) < 0:
        raise ScheduleError("--uniform-cost: costs must not be negative")

    def table(value: float) -> Table:
        return tuple((float(value),) * schedule.splits for _ in range(schedule.num_stages))

    return SpanCosts(table(forward), table(backward),
                     table(weight) if schedule.split_backward else None,
                     output=(float(output),) * schedule.splits if output is not None else None)


def layers_per_stage(model: ModelConfig, schedule: Schedule, split: StageLayers = EVEN
                     ) -> tuple[int, ...]:
    """Transformer layers of each virtual stage, in stage order: N / (P * V) each, or with the
    uneven first and last stages of `split` (stage_layers.py)."""
    return layers_per_virtual_stage(model.num_layers, schedule.pp, schedule.chunks,
                                    schedule.placement, split)


def model_costs(schedule: Schedule, model: ModelConfig, span_lengths: list[int], *,
                flops_per_second: float, tp: int = 1, sequence_parallel: bool = False,
                batch: int = 1, bytes_per_element: int = 2,
                attention_flops_per_second: float | None = None,
                recompute: Recompute | None = None,
                efficiency: Callable[[int, int], Efficiency] | None = None,
                stage_layers: StageLayers = EVEN, cp: int = 1,
                loss_backward_in_forward: bool = False, spread_output: bool = False
                ) -> SpanCosts:
    """Durations and bytes from costs.py for `model` with the sequence cut into `span_lengths`.

    A virtual stage runs N/(P*V) layers on each span (or its own count with uneven first and
    last stages, `stage_layers`); the last one also runs the output layer and keeps the loss's
    logits. Each GPU does 1/TP of the FLOPs at `flops_per_second`, the core
    attention's at `attention_flops_per_second` when given (its kernels run at another rate than
    GEMMs). B is the full backward (2x forward), or the input-gradient part when the schedule has
    W actions (see costs.SpanFlops). Bytes are per GPU, activations in `bytes_per_element`
    (2: bf16/fp16); a virtual stage keeps what costs.chunk_activation_bytes says under
    `recompute` (None: no activation recompute), and its B also re-runs the recomputed forward:
    every layer (full, uniform), the first N layers (full, block) or the core attention of every
    layer (selective). `efficiency(start, end)` (None: all 1) gives the fractions of the rates
    the span [start, end) reaches (`Efficiency`): how short spans run slower
    (projection.DeviceModel's curves). With `loss_backward_in_forward` (runtime/early_loss.py)
    the last stage's F also runs the output layer's backward and keeps, instead of the loss's
    softmax, the output layer's input gradient (the input itself is freed: the sizes of
    `output_layer_input_bytes` stay) and per micro-batch the output weights' fp32 gradient;
    its B and W do no output-layer work. Under context parallelism (`cp` = C ranks per span) a rank
    does 1/C of every FLOP and holds span / C tokens' activations and logits, and its share of
    the K/V cache (plan/context_parallel.py); the all-to-alls are the projection's to price.
    With `spread_output` the output layer and the loss leave the last stage for O actions
    (actions.OPS): each O runs their forward and backward on one span and holds, while it runs,
    the softmax, the layer's input and its gradient; the last stage keeps only the final norm's
    input for its backward.
    """
    if spread_output and loss_backward_in_forward:
        raise ScheduleError("--loss-backward-in-forward: with the output layer spread over the "
                            "ranks each O already runs the loss's backward at once")
    if len(span_lengths) != schedule.splits:
        raise ScheduleError(f"--splits is {schedule.splits} but {len(span_lengths)} span "
                            "lengths were given")
    if attention_flops_per_second is None:
        attention_flops_per_second = flops_per_second
    if flops_per_second <= 0 or attention_flops_per_second <= 0:
        raise ScheduleError("--device-tflops must be positive")
    layers = layers_per_stage(model, schedule, stage_layers)
    bounds = span_bounds(span_lengths)
    last = schedule.num_stages - 1

    def stage_flops(stage: int, start: int, end: int) -> SpanFlops:
        body = layer_flops(model, end - start, end, batch).scaled(layers[stage])
        if stage != last or loss_backward_in_forward or spread_output:
            return body
        return body + logits_flops(model, end - start, batch)

    def recomputed_flops(stage: int, start: int, end: int) -> SpanFlops:
        layer = layer_flops(model, end - start, end, batch)
        if recompute is None:
            return SpanFlops(0.0, 0.0)
        if recompute.granularity == "selective":
            return SpanFlops(0.0, layer.attention).scaled(layers[stage])
        rerun = (layers[stage] if recompute.method == "uniform"
                 else min(recompute.num_layers, layers[stage]))
        return layer.scaled(rerun)

    grid = [[stage_flops(stage, start, end) for start, end in bounds]
            for stage in range(schedule.num_stages)]
    rerun = [[recomputed_flops(stage, start, end) for start, end in bounds]
             for stage in range(schedule.num_stages)]
    shares = [efficiency(start, end) if efficiency else Efficiency(1.0, 1.0, 1.0)
              for start, end in bounds]

    def duration(flops: SpanFlops, kind: Callable[[SpanFlops], float], span: int,
                 backward: bool) -> float:
        # The TP group shares each span's FLOPs.
        share = shares[span]
        attention = share.attention_backward if backward else share.attention_forward
        return (kind(SpanFlops(flops.linear, 0.0)) / (tp * cp * flops_per_second * share.gemm)
                + kind(SpanFlops(0.0, flops.attention))
                / (tp * cp * attention_flops_per_second * attention))

    def output_seconds(j: int) -> float:
        """The output layer's forward and backward on span j."""
        start, end = bounds[j]
        return duration(logits_flops(model, end - start, batch),
                        lambda f: f.forward + f.backward, j, False)

    def head_seconds(v: int, j: int) -> float:
        """The output layer's forward and backward, run by F when the loss's backward is."""
        return output_seconds(j) if v == last and loss_backward_in_forward else 0.0

    def seconds(kind: Callable[[SpanFlops], float], backward: bool = False,
                recomputed: bool = False) -> Table:
        return tuple(tuple(
            duration(cell, kind, j, backward)
            + (duration(rerun[v][j], lambda f: f.forward, j, False) if recomputed else 0.0)
            + (0.0 if backward else head_seconds(v, j))
            for j, cell in enumerate(row)) for v, row in enumerate(grid))

    def per_span_bytes(kind: Callable[[int, int], float], scale: float = 1.0) -> Table:
        """kind(layers of the stage, a CP rank's tokens of the span): the spans are multiples
        of C."""
        return tuple(tuple(float(kind(layers[v], length // cp)) * scale
                           for length in span_lengths) for v in range(schedule.num_stages))

    replication = kv_replication(model, tp, cp)
    no_logits = tuple(0.0 for _ in span_lengths)

    def hidden_bytes(n: int) -> float:
        """One span x hidden tensor of a CP rank, split over TP with sequence parallelism."""
        return n // cp * batch * model.hidden_size * bytes_per_element \
            / (tp if sequence_parallel else 1)

    head_input = [output_layer_input_bytes(model, n // cp, batch, tp, sequence_parallel,
                                           bytes_per_element) for n in span_lengths]
    if spread_output:   # the output layer's input is the O's; the final norm's stays
        logits = tuple(float(kept - hidden_bytes(n)) for kept, n in zip(head_input, span_lengths))
    else:
        logits = tuple(float((0.0 if loss_backward_in_forward
                              else logits_bytes(model, n // cp, batch, tp)) + kept)
                       for kept, n in zip(head_input, span_lengths))
    head_gradient = tuple(
        tuple(float(model.vocab_size * model.hidden_size / tp * ACCUMULATOR_BYTES)
              if v == last and j == 0 else 0.0
              for j in range(len(span_lengths))) for v in range(schedule.num_stages)
    ) if loss_backward_in_forward else None

    split = schedule.split_backward
    return SpanCosts(
        forward=seconds(lambda f: f.forward),
        backward=seconds(lambda f: f.input_grad if split else f.backward, backward=True,
                         recomputed=True),
        weight=seconds(lambda f: f.weight_grad, backward=True) if split else None,
        activation_bytes=per_span_bytes(
            lambda count, n: chunk_activation_bytes(model, count, n, batch, tp,
                                                    sequence_parallel, bytes_per_element,
                                                    recompute)),
        kv_cache_bytes=per_span_bytes(
            lambda count, n: count * kv_cache_bytes(model, n, batch, tp, bytes_per_element),
            replication),
        kv_accumulator_bytes=per_span_bytes(
            lambda count, n: count * kv_cache_bytes(model, n, batch, tp,
                                                    max(bytes_per_element, ACCUMULATOR_BYTES)),
            replication),
        logits_bytes=tuple(logits if stage == last else no_logits
                           for stage in range(schedule.num_stages)),
        head_gradient_bytes=head_gradient,
        layer_groups=tuple(max(1, count // recompute.num_layers
                               if recompute is not None and recompute.method == "uniform"
                               else count) for count in layers),
        output=tuple(output_seconds(j) for j in range(len(span_lengths)))
        if spread_output else None,
        output_bytes=tuple(float(logits_bytes(model, n // cp, batch, tp) + 2 * hidden_bytes(n))
                           for n in span_lengths) if spread_output else None)


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
    peak_logits_bytes: float | None = None
    peak_held_bytes: float | None = None         # max over time of activations + K/V + logits
    held_at_peak: dict[str, float] | None = None  # those three at the moment of that peak


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
    return _report(schedule, costs, timelines(schedule, costs, p2p_latency))


def timelines(schedule: Schedule, costs: SpanCosts, p2p_latency: float = 0.0
              ) -> list[list[TimedAction]]:
    """Each rank's actions, in program order, with their start and end: `simulate` without the
    report, for a schedule known to be valid (one that deadlocks still raises)."""
    graph = execution_graph(schedule)
    finished = [0.0] * len(graph.steps)
    ranks: list[list[TimedAction]] = [[] for _ in range(schedule.pp)]
    free_at = [0.0] * schedule.pp
    for step in graph.order:
        rank, action = graph.steps[step]
        start = max([free_at[rank]] + [
            finished[need] + _p2p(schedule, costs, p2p_latency, graph.steps[need], rank)
            for need in graph.needs[step]])
        end = start + costs.duration(schedule.stage_of(rank, action.chunk), action,
                                     schedule.full_backward(rank, action))
        finished[step] = free_at[rank] = end
        ranks[rank].append(TimedAction(action, start, end))
    return ranks


def _p2p(schedule: Schedule, costs: SpanCosts, p2p_latency: float,
         sender: tuple[int, Action], rank: int) -> float:
    """Delay from `sender` finishing to its dependant on `rank` starting: none on its own rank,
    else the hop between the two virtual stages (`costs.hop`) or the flat `p2p_latency`. Only
    activations (F on v-1 -> v) and gradients (B on v+1 -> v) cross ranks."""
    sender_rank, action = sender
    if sender_rank == rank:
        return 0.0
    if costs.hop is None:
        return p2p_latency
    stage = schedule.stage_of(sender_rank, action.chunk)
    last = schedule.num_stages - 1
    if action.op == "O" or (action.op == "F" and stage == last):
        # the last stage's output or its gradient: a span x hidden tensor, as between stages
        return costs.hop[last - 1][action.span] if last else p2p_latency
    return costs.hop[stage if action.op == "F" else stage - 1][action.span]


ACCUMULATOR_BYTES = 4
"""Bytes per element of the runtime's dK/dV accumulators: fp32 at least, whatever the training
precision (`seq1f1b.runtime.kv_cache.MIN_ACCUMULATOR_DTYPE`)."""

_HELD = ("activation", "kv_cache", "logits")
"""What a rank holds for backward, by kind: activations and logits per span (freed with the span's
activations), K/V per micro-batch (the whole sequence's, from F(i,0) until after B(i,0)) and, from
the micro-batch's first backward (its last span's B) on, the cache's dK/dV accumulators of the
earlier spans' rows (spans 0..k-2, in fp32: twice their K/V bytes in bf16 training; none with
k = 1). The accumulators count under "kv_cache". With the loss's backward at F, the last stage
also holds each micro-batch's output-weight gradient from F(i,0) until after its first backward
(B(i,k-1)), under "logits". An O action (the output layer spread over the ranks) holds its
span's softmax, input and input gradient on its rank while it runs, under "logits" too.

A full first backward on a stage of G layer groups (`SpanCosts.layer_groups`) runs the loss's
backward first (on the last stage: the span's logits go), then the groups last to first: each
makes its accumulators (runtime/kv_cache.py, `route_grads`) and frees its saved
tensors before the next begins, so the rank peaks either at the first group (1/G of the
accumulators on top of everything) or at the last (all accumulators, all but 1/G of the span's
activations gone), not with both whole (13% high on an H200's 8-layer stage at 32K, k = 4:
docs/measuring.md). A split backward (B then W) keeps the activations for W: its B makes all
the accumulators on top of them."""


class HeldChange(NamedTuple):
    """Bytes by kind an action allocates when it starts, changes while it runs (a second moment
    the rank may peak at: `_HELD`'s first backward of several groups) and releases after it
    ends."""

    allocated: dict[str, float]
    during: dict[str, float]
    released: dict[str, float]


def held_tables(costs: SpanCosts | None) -> dict[str, Table] | None:
    """The byte tables `held_change` reads, by kind; None when `costs` carries no bytes. The
    "per_group" tables are a layer group's share (`SpanCosts.layer_groups`) of the span's
    activations and of its rows' accumulators."""
    if costs is None or costs.activation_bytes is None or costs.kv_cache_bytes is None:
        return None
    logits = costs.logits_bytes or tuple((0.0,) * len(row) for row in costs.activation_bytes)
    tables = dict(zip(_HELD, (costs.activation_bytes, costs.kv_cache_bytes, logits)))
    tables["kv_accumulator"] = costs.kv_accumulator_bytes or costs.kv_cache_bytes
    tables["head_gradient"] = costs.head_gradient_bytes or tuple(
        (0.0,) * len(row) for row in costs.activation_bytes)
    tables["output"] = (costs.output_bytes or (0.0,) * len(costs.activation_bytes[0]),)
    groups = costs.layer_groups or (1,) * len(costs.activation_bytes)
    for kind in ("activation", "kv_accumulator"):
        tables[f"{kind}_per_group"] = tuple(tuple(value / count for value in row)
                                            for row, count in zip(tables[kind], groups))
    return tables


def held_change(tables: dict[str, Table], stage: int, action: Action, frees_activations: bool
                ) -> HeldChange:
    """Bytes of each kind `action` allocates when it starts, changes while it runs and releases
    after it ends; `frees_activations`: it is its unit's last backward action
    (Schedule.frees_activations)."""
    span = action.span
    last_span = len(tables["kv_cache"][stage]) - 1
    whole_sequence_kv = sum(tables["kv_cache"][stage])
    allocated = dict.fromkeys(_HELD, 0.0)
    during = dict.fromkeys(_HELD, 0.0)
    released = dict.fromkeys(_HELD, 0.0)
    if action.op == "O":    # held while it runs, on whichever rank: counted with the logits
        allocated["logits"] = released["logits"] = tables["output"][0][span]
        return HeldChange(allocated, during, released)
    if action.op == "F":
        allocated["activation"] = tables["activation"][stage][span]
        allocated["logits"] = tables["logits"][stage][span]
        if span == 0:
            allocated["kv_cache"] = whole_sequence_kv
    if frees_activations:
        released["activation"] = tables["activation"][stage][span]
        released["logits"] = tables["logits"][stage][span]
    earlier_spans_kv = sum(tables["kv_accumulator"][stage][:-1])
    if action.op == "B" and span == last_span and frees_activations:
        # the loss's backward first (the span's logits go), then group by group (_HELD): the
        # first group's accumulators, then the others' as all but the last group's
        # activations go; the last group's go after the end
        first_group = sum(tables["kv_accumulator_per_group"][stage][:-1])
        last_group = tables["activation_per_group"][stage][span]
        allocated["kv_cache"] = first_group
        allocated["logits"] = -released["logits"]
        released["logits"] = 0.0
        during["kv_cache"] = earlier_spans_kv - first_group
        during["activation"] = -(released["activation"] - last_group)
        released["activation"] = last_group
    elif action.op == "B" and span == last_span:
        allocated["kv_cache"] = earlier_spans_kv
    if action.op == "B" and span == 0:
        released["kv_cache"] = whole_sequence_kv + earlier_spans_kv
    if action.op == "F" and span == 0:
        allocated["logits"] += tables["head_gradient"][stage][0]
    if action.op == "B" and span == last_span:
        released["logits"] += tables["head_gradient"][stage][0]
    return HeldChange(allocated, during, released)


def held_rise(change: HeldChange) -> tuple[float, float]:
    """(the most `change` adds while its action runs, what it releases after that) in total
    bytes: the two-event view of an action that the searches' memory rule takes."""
    allocated = sum(change.allocated.values())
    after = allocated + sum(change.during.values())
    rise = max(allocated, after)
    return rise, rise - (after - sum(change.released.values()))


def _rank_report(schedule: Schedule, costs: SpanCosts | None, rank: int,
                 timeline: list[TimedAction], makespan: float) -> RankReport:
    tables = held_tables(costs)
    live = peak_live = 0
    held = dict.fromkeys(_HELD, 0.0)
    peaks = dict.fromkeys(_HELD, 0.0)
    at_peak, peak_total = dict(held), 0.0
    for timed in timeline:          # program order = time order on one rank
        action = timed.action
        if action.op == "F":
            live += 1
            peak_live = max(peak_live, live)
        # The freeing action still holds its span while it runs: release after it.
        frees = schedule.frees_activations(rank, action)
        if frees:
            live -= 1
        if tables is None:
            continue
        change = held_change(tables, schedule.stage_of(rank, action.chunk), action, frees)
        for step in (change.allocated, change.during):
            for kind in _HELD:
                held[kind] += step[kind]
                peaks[kind] = max(peaks[kind], held[kind])
            if sum(held.values()) > peak_total:
                peak_total, at_peak = sum(held.values()), dict(held)
        for kind in _HELD:
            held[kind] -= change.released[kind]
    busy = sum(t.end - t.start for t in timeline)
    if tables is None:
        return RankReport(rank, busy, makespan - busy, peak_live, None, None, timeline)
    return RankReport(rank, busy, makespan - busy, peak_live, peaks["activation"],
                      peaks["kv_cache"], timeline, peaks["logits"], peak_total, at_peak)


def _report(schedule: Schedule, costs: SpanCosts | None,
            timelines: list[list[TimedAction]]) -> SimulationReport:
    makespan = max((t.end for timeline in timelines for t in timeline), default=0.0)
    ranks = [_rank_report(schedule, costs, rank, timelines[rank], makespan)
             for rank in range(schedule.pp)]
    idle = sum(r.idle for r in ranks)
    return SimulationReport(schedule.name, schedule.pp, schedule.microbatches, schedule.splits,
                            schedule.chunks, makespan,
                            idle / (schedule.pp * makespan) if makespan else 0.0, ranks)


# -- measured iterations ----------------------------------------------------------------------
MeasuredActions = Sequence[tuple[str, float, float]]
"""One rank's measured actions in program order: (label as "F3.1" / "B0.2@1", start, end), in
seconds from a start of the iteration common to all ranks."""


def measured_report(schedule: Schedule, ranks: Sequence[MeasuredActions],
                    costs: SpanCosts | None = None) -> SimulationReport:
    """A measured iteration as a SimulationReport, with bubble counted the simulator's way.

    The runtime's action times include waiting for the neighbour's tensor (the receive happens
    inside the action). An action cannot compute before the actions it depends on have finished,
    so its compute starts at max(recorded start, end of each dependency on another rank); the
    time before that is idle, as in the simulator. `costs` (optional) only adds bytes held, from
    the same tables the simulator would use.
    """
    if len(ranks) != schedule.pp:
        raise ScheduleError(f"measured timelines of {len(ranks)} ranks for pp={schedule.pp}")
    recorded: dict[tuple[int, Action], tuple[float, float]] = {}
    for rank, actions in enumerate(ranks):
        labels = [parse_action(label) for label, _, _ in actions]
        if labels != list(schedule.programs[rank]):
            raise ScheduleError(f"rank {rank}: measured actions do not follow the program of "
                                f"{schedule.name} (P={schedule.pp}, m={schedule.microbatches}, "
                                f"k={schedule.splits}, V={schedule.chunks})")
        for action, (_, start, end) in zip(labels, actions):
            recorded[(rank, action)] = (start, end)
    timelines: list[list[TimedAction]] = []
    for rank in range(schedule.pp):
        timeline = []
        for action in schedule.programs[rank]:
            start, end = recorded[(rank, action)]
            waits = [recorded[dep][1] for dep in dependencies(schedule, rank, action)
                     if dep[0] != rank]
            timeline.append(TimedAction(action, min(max([start] + waits), end), end))
        timelines.append(timeline)
    return _report(schedule, costs, timelines)


def calibrated_costs(schedule: Schedule, measured: Sequence[SimulationReport]) -> SpanCosts:
    """Per-action costs from measured iterations: for each op, virtual stage and span, the median
    duration over micro-batches and iterations (durations as `measured_report` counts them); an
    O's (the output layer spread over the ranks) per span, over whichever ranks ran it."""
    if not measured:
        raise ScheduleError("calibration needs at least one measured iteration")
    samples: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for report in measured:
        for rank in report.ranks:
            for timed in rank.timeline:
                action = timed.action
                stage = -1 if action.op == "O" else schedule.stage_of(rank.rank, action.chunk)
                samples[(action.op, stage, action.span)].append(timed.end - timed.start)

    def table(op: str) -> Table:
        return tuple(tuple(statistics.median(samples[(op, stage, span)])
                           for span in range(schedule.splits))
                     for stage in range(schedule.num_stages))

    output = tuple(statistics.median(samples[("O", -1, span)])
                   for span in range(schedule.splits)) if schedule.spread_output else None
    return SpanCosts(table("F"), table("B"), table("W") if schedule.split_backward else None,
                     output=output)


OUTPUT_FORWARD_SHARE = 1 / 3
"""The share of an O (the output layer's forward and backward on a span) that counts as the
span's forward, the rest as its backward: the FLOPs' shares (costs.logits_flops), as the last
stage's F and B hold the layer when it runs there. Measured spans fold a timed O so
(span_timings), and a fit's times price an O so (budget._scaled_to_fit)."""


def span_timings(schedule: Schedule, measured: Sequence[SimulationReport],
                 bounds: Sequence[tuple[int, int]]) -> list[SpanTiming]:
    """Each span [start, end) of `bounds`: its calibrated F and B (B + W when the backward is
    split) summed over the virtual stages, from measured iterations (`calibrated_costs`). With
    the output layer spread, its O counts OUTPUT_FORWARD_SHARE to F and the rest to B."""
    costs = calibrated_costs(schedule, measured)
    stages = range(schedule.num_stages)
    output = costs.output or (0.0,) * schedule.splits
    share = OUTPUT_FORWARD_SHARE
    return [SpanTiming(start, end,
                       sum(costs.forward[v][j] for v in stages) + output[j] * share,
                       sum(costs.backward[v][j] + (costs.weight[v][j] if costs.weight else 0.0)
                           for v in stages) + output[j] * (1 - share))
            for j, (start, end) in enumerate(bounds)]
