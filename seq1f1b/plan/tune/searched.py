"""seq1f1b-zb-auto on the planner's top layouts: what the searched schedule adds to a layout.

The ranking (search.py) leaves the searched schedule out: each order is a search of its own,
seconds rather than the lookup a fixed schedule is, so it cannot be bounded and pruned over
thousands of layouts. Once the top layouts are known, each is planned again with
seq1f1b-zb-auto at the same TP, CP, PP, V, k, partition, recompute and stages, under the most
held bytes (activations, K/V, logits) that every rank of that layout has room for beside its
weights, optimizer and workspace (`MemoryEstimate.held_room`), and judged like the rest: the
estimator's verdict on the searched order itself (a V or a loop of two places other stages on a
rank) and the projection. The cap goes into the layout's flags (--schedule-memory-cap), with which
pretrain_gpt.py searches the same order on the same costs at start-up.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Optional

from seq1f1b.plan.actions import ScheduleError
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
    fit the GPU."""
    setup = row.setup
    if not_searched(setup) is not None:
        return None
    room = row.estimate.held_room(gpu.memory_gib, gpu.reserve_ratio)
    if room < GIB / 100:
        return None
    twin = replace(setup, schedule="seq1f1b-zb-auto", schedule_memory_cap=cap_flag(room))
    try:
        schedule = plan_schedule(twin)
    except ScheduleError:
        return None           # no order of F, B and W fits the room
    estimate = estimate_memory(twin, schedule=schedule)
    if not estimate.fits(gpu.memory_gib, gpu.reserve_ratio):
        return None
    projection = project(twin, gpu.device, schedule=schedule)
    return Ranked(twin, estimate, projection, projection.overheads())


def search_top(result: TuneResult, count: int) -> None:
    """`result.searched` for its first `count` layouts, and the seconds it took."""
    started = time.perf_counter()
    for index, row in enumerate(result.ranked[:count]):
        result.searched[index] = searched_twin(row, result.gpu)
    result.counts.searched_seconds = time.perf_counter() - started
