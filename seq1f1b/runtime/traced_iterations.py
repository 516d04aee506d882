"""Traced iterations of every rank, gathered: the measured span times a fit partition is cut by
(`pretrain_gpt.py --seq1f1b-partition fit`, `benchmark.py`'s `@fit` entries) and the actions a
measured timeline draws (`pretrain_gpt.py --timeline-path`).

Each rank records its own actions (`ExecutionTrace`: seconds from its iteration's start, so the
caller puts a barrier before a traced iteration to line the ranks' clocks up). One rank per
pipeline stage speaks for it, the one at data-parallel, context-parallel and tensor-parallel
rank 0: the others run the same program on other data or other shards (a CP rank on its part
of every span). The gather is collective and every rank gets the
same lists, so every rank fits the same cut without a broadcast.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist
from megatron.core import parallel_state

from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.partition import partition
from seq1f1b.plan.simulate import MeasuredActions, measured_report, span_timings
from seq1f1b.plan.span_fit import SpanTimeFit, fit_span_times
from seq1f1b.runtime.trace import ExecutionTrace


def gather_pipeline_actions(traces: Sequence[ExecutionTrace]) -> list[list[MeasuredActions]]:
    """Collective over the world: for each of `traces` (this rank's traced iterations, the same
    count on every rank), every pipeline rank's actions (label, start, end), in rank order."""
    speaks = (parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
              and parallel_state.get_tensor_model_parallel_rank() == 0)
    mine = (parallel_state.get_pipeline_model_parallel_rank(),
            [[(a.action, a.start, a.end) for a in trace.actions] for trace in traces]
            if speaks else None)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    stages = sorted((entry for entry in gathered if entry[1] is not None), key=lambda e: e[0])
    return [[iterations[n] for _, iterations in stages] for n in range(len(traces))]


def calibrate_fit(schedule: Schedule, traces: Sequence[ExecutionTrace], seq_length: int,
                  tp: int = 1, sequence_parallel: bool = False, align: int = 1
                  ) -> tuple[tuple[int, ...], SpanTimeFit]:
    """Collective: the fit partition's span lengths (multiples of `align`), and the fit, from
    `traces` of `schedule` (this rank's traced iterations, all run with the same cut): each
    span's median F and B summed over the stages, fitted per token and per causal query-key pair
    (span_fit.py)."""
    reports = [measured_report(schedule, ranks) for ranks in gather_pipeline_actions(traces)]
    fit = fit_span_times(span_timings(schedule, reports, traces[0].span_bounds))
    lengths = partition(seq_length, schedule.splits, "fit", tp=tp,
                        sequence_parallel=sequence_parallel, align=align, fit=fit)
    return tuple(lengths), fit
