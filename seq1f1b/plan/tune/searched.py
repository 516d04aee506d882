"""seq1f1b-zb-auto on the planner's top layouts: what the searched schedule adds to a layout.

The ranking (search.py) leaves the searched schedule out: each order is a search of its own,
seconds rather than the lookup a fixed schedule is, so it cannot be bounded and pruned over
thousands of layouts. Once the top layouts are known, each is planned again with
seq1f1b-zb-auto at the same TP, CP, PP, V, k, partition, recompute and stages, under the most
held bytes (activations, K/V, logits) that every rank of that layout has room for beside its
weights, optimizer and workspace (`MemoryEstimate.held_room`), and judged like the rest: the
estimator's verdict on the searched order itself (a V or a loop of two places other stages on a
rank) and the projection. The search may also spread the output layer over the ranks (O actions:
at 7B on four stages of a V most of what it gains over the listed schedule). The cap goes into
the layout's flags (--schedule-memory-cap, and --spread-output), with which pretrain_gpt.py
searches the same order on the same costs at start-up.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Optional

from seq1f1b.plan.actions import Schedule, ScheduleError
from seq1f1b.plan.memory import GIB, TrainingSetup, estimate_memory, plan_schedule
from seq1f1b.plan.projection import project
from seq1f1b.plan.tune.devices import Gpu
from seq1f1b.plan.tune.search import Ranked, TuneResult


def cap_flag(held_bytes: float) -> str:
    """--schedule-memory-cap's value: GiB, rounded down to the hundredth."""
    return f"{math.floor(held_bytes / GIB * 100) / 100:.2f}GiB"


def not_searched(setup: TrainingSetup) -> Optional[str]:
    """Why seq1f1b-zb-auto is not planned on `setup`'s layout, or None when it is."""
    if setup.pp == 1:
        return "one pipeline rank runs 1F1B's order whatever the schedule"
    if setup.chunks > 2:
        return f"seq1f1b-zb-auto runs one or two chunks per rank, not V = {setup.chunks}"
    return None


def why_none(setup: TrainingSetup) -> str:
    """Why the planner found no seq1f1b-zb-auto row for `setup`'s layout."""
    return not_searched(setup) or "no order found fits the held bytes its ranks have room for"


def searched_twin(row: Ranked, gpu: Gpu) -> Optional[Ranked]:
    """`row`'s layout with seq1f1b-zb-auto under its estimate's `held_room`, or None where the
    layout is not searched (`not_searched`), no order fits the room, or the order found does not
    fit the GPU. The search may spread the output layer over the ranks (`--spread-output`: the
    shorter of the layer kept and spread under the same cap, as the trainer searches with the
    flag; not with the loss's backward at F); where the spread order wins but the layer's
    copies leave it short of memory, the layer stays in the last stage (a search without the
    flag)."""
    setup = row.setup
    if not_searched(setup) is not None:
        return None
    room = row.estimate.held_room(gpu.memory_gib, gpu.reserve_ratio)
    if room < GIB / 100:
        return None
    # the loss's backward at F runs the output layer where an O would (the trainer refuses both)
    twin = replace(setup, schedule="seq1f1b-zb-auto", schedule_memory_cap=cap_flag(room),
                   spread_output=not setup.loss_backward_in_forward)
    judged, schedule = _judged(twin, gpu)
    if judged is None and schedule is not None and schedule.spread_output:
        judged, _ = _judged(replace(twin, spread_output=False), gpu)
    return judged


def _judged(setup: TrainingSetup, gpu: Gpu) -> tuple[Optional[Ranked], Optional[Schedule]]:
    """`setup`'s searched order, estimated and projected, and the order: (None, None) where no
    order of F, B and W fits its cap, (None, order) where the order does not fit the GPU."""
    try:
        schedule = plan_schedule(setup)
    except ScheduleError:
        return None, None
    estimate = estimate_memory(setup, schedule=schedule)
    if not estimate.fits(gpu.memory_gib, gpu.reserve_ratio):
        return None, schedule
    projection = project(setup, gpu.device, schedule=schedule)
    return Ranked(setup, estimate, projection, projection.overheads()), schedule


def search_top(result: TuneResult, count: int) -> None:
    """`result.searched` for its first `count` layouts, and the seconds it took."""
    started = time.perf_counter()
    for index, row in enumerate(result.ranked[:count]):
        result.searched[index] = searched_twin(row, result.gpu)
    result.counts.searched_seconds = time.perf_counter() - started
