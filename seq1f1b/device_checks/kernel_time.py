"""Where an iteration's GPU time goes, from a torch.profiler chrome trace (`--profile`).

The H200's training part found k=4 spans 38% slower than k=1 on one stage of the 1.3B shape at
16K, with span attention no longer the cause. Two explanations predict different traces: the
kernels themselves take longer (smaller GEMMs, more elementwise passes), or the GPU waits
between kernels for the host to launch them (Python per span). `summarize_trace` tells them
apart: the kernels' summed time per iteration, the time the GPU was busy (the union of kernel
intervals, so overlapping streams count once) against the span from the first kernel to the
last, the kernel count, and the kernels that took the most time.
"""
from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Iterable

TOP_KERNELS = 8


def _busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy


def summarize_trace(path: Path, iterations: int) -> dict:
    """The GPU kernels of the chrome trace at `path`, which covers `iterations` iterations."""
    events = json.loads(Path(path).read_text())
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    if not kernels:
        return {"skipped": "the trace holds no GPU kernels"}
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy = _busy_us(intervals)
    by_name: collections.Counter = collections.Counter()
    for event, (start, end) in zip(kernels, intervals):
        by_name[event.get("name", "?")[:90]] += end - start
    per = 1e3 * iterations
    return {"iterations": iterations,
            "kernels_per_iteration": len(kernels) / iterations,
            "kernel_ms_per_iteration": sum(e - s for s, e in intervals) / per,
            "busy_ms_per_iteration": busy / per,
            "span_ms_per_iteration": span / per,
            "busy_fraction": busy / span if span else None,
            "top_kernels_ms_per_iteration": {name: us / per
                                             for name, us in by_name.most_common(TOP_KERNELS)}}
