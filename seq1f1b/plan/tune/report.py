"""The planner's answer as text and as JSON: the ranked table, then the winner's flags."""
from __future__ import annotations

import shlex
from dataclasses import asdict

from seq1f1b.plan.memory import GIB
from seq1f1b.plan.tune.launch import pretrain_flags
from seq1f1b.plan.tune.search import Ranked, TuneResult
from seq1f1b.plan.tune.searched import why_none

TERMS = (("fixed", "span_fixed"), ("p2p", "p2p"), ("GEMM", "gemm"), ("attn", "attention"))
"""The k-dependent overhead terms (projection.TERMS), by column heading."""


def row_dict(row: Ranked) -> dict:
    setup, projection = row.setup, row.projection
    return {"layout": row.name, "tp": setup.tp, "cp": setup.cp, "pp": setup.pp,
            "chunks": setup.chunks, "dp": setup.dp, "microbatches": setup.microbatches,
            "schedule": setup.schedule, "splits": setup.splits, "partition": setup.partition,
            "recompute": setup.recompute_granularity,
            "first_stage_layers": setup.decoder_first_pipeline_num_layers,
            "last_stage_layers": setup.decoder_last_pipeline_num_layers,
            "loss_backward_in_forward": setup.loss_backward_in_forward,
            "span_lengths": projection.span_lengths,
            "stage_peak_gib": [stage.total_bytes / GIB for stage in row.estimate.stages],
            "peak_gib": row.estimate.peak_bytes / GIB,
            "tokens_per_s": projection.tokens_per_s, "tflops_per_gpu": projection.tflops_per_gpu,
            "iteration_s": projection.iteration_s, "bubble_ratio": projection.report.bubble_ratio,
            "data_parallel_s": projection.data_parallel_s, "overheads_s": row.overheads_s}


def _searched_dicts(result: TuneResult) -> list[dict]:
    """seq1f1b-zb-auto on each searched layout (`layout` None and `why` where there is none)."""
    out = []
    for index, twin in result.searched.items():
        if twin is None:
            row = {"layout": None, "why": why_none(result.ranked[index].setup)}
        else:
            row = {**row_dict(twin), "placement": twin.projection.schedule.placement,
                   "schedule_memory_cap": twin.setup.schedule_memory_cap,
                   "output_layer": _output_layer(twin)}
        out.append({"on_layout": index + 1, **row})
    return out


def to_dict(result: TuneResult) -> dict:
    query = result.query
    winner = result.winner
    return {"query": {"model": asdict(query.model), "seq_length": query.seq_length,
                      "gpus": query.gpus, "gpus_per_node": query.gpus_per_node,
                      "global_batch_size": query.global_batch_size,
                      "micro_batch_size": query.micro_batch_size,
                      "schedules": list(query.schedules), "max_splits": query.max_splits,
                      "min_span": query.min_span, "chunks": list(query.chunks),
                      "partitions": list(query.partitions),
                      "recomputes": [name or "none" for name in query.recomputes],
                      "uneven": query.uneven,
                      "loss_backward_in_forward": query.loss_backward_in_forward},
            "gpu": {"device": result.gpu.device.name, "memory_gib": result.gpu.memory_gib,
                    "reserve_ratio": result.gpu.reserve_ratio, "source": result.gpu.source},
            "search": asdict(result.counts),
            "layouts": [row_dict(row) for row in result.ranked],
            "searched": _searched_dicts(result),
            "winner": winner.name if winner else None,
            "winner_flags": pretrain_flags(winner.setup, query.global_batch_size)
            if winner else None}


def _stages(row: Ranked) -> str:
    peaks = [stage.total_bytes / GIB for stage in row.estimate.stages]
    if len(peaks) <= 4:
        return " ".join(f"{p:.1f}" for p in peaks)
    return f"{min(peaks):.1f}..{max(peaks):.1f} ({len(peaks)})"


def text(result: TuneResult) -> list[str]:
    query, counts = result.query, result.counts
    lines = [f"{query.gpus} GPUs ({query.gpus_per_node} per node) of {result.gpu.describe()}; "
             f"L={query.seq_length}, global batch {query.global_batch_size} x micro-batch "
             f"{query.micro_batch_size}",
             f"searched {counts.candidates} layouts in {counts.seconds:.1f} s: "
             f"{counts.memory_checked} memory-checked ({counts.oom} OOM), {counts.projected} "
             f"projected, {counts.invalid} refused by their schedule, {counts.shapes} schedule "
             "shapes built; the rest bounded out"]
    if not result.ranked:
        lines.append("no layout fits: try more GPUs, a larger --gpu-memory or more recompute")
        return lines
    width = max(len(row.name) for row in result.ranked)
    heading = (f"{'#':>2} {'layout':<{width}} {'GiB/stage':>16} {'tok/s':>9} {'TFLOPS':>6} "
               f"{'bubble':>6} " + " ".join(f"{h:>6}" for h, _ in TERMS) + f" {'DP s':>6}")
    lines += ["", heading]
    for rank, row in enumerate(result.ranked, 1):
        p = row.projection
        terms = " ".join(f"{row.overheads_s[key] / p.iteration_s:>6.1%}" for _, key in TERMS)
        lines.append(f"{rank:>2} {row.name:<{width}} {_stages(row):>16} {p.tokens_per_s:>9.0f} "
                     f"{p.tflops_per_gpu:>6.1f} {p.report.bubble_ratio:>6.1%} {terms} "
                     f"{p.data_parallel_s:>6.2f}")
    lines += ["(GiB/stage: the estimator's peak per pipeline rank, as plan.py memory; fixed, "
              "p2p, GEMM, attn: the share of the iteration each k-dependent term adds, as "
              "reproduce_paper.py; DP s: the distributed optimizer's exchange)"]
    lines += _searched_lines(result)
    winner = result.winner
    if winner is result.ranked[0]:
        lines += ["", "winner's pretrain_gpt.py flags (mock data: give --data-path and your "
                  "tokenizer instead):"]
    else:
        index = next(i for i, twin in result.searched.items() if twin is winner)
        gain = result.ranked[0].projection.iteration_s / winner.projection.iteration_s - 1
        lines += ["", f"winner: layout {index + 1} with seq1f1b-zb-auto, "
                  f"{winner.projection.tokens_per_s:.0f} tokens/s ({gain:+.1%} over layout 1); "
                  "its pretrain_gpt.py flags (mock data: give --data-path and your tokenizer "
                  "instead):"]
    lines.append(shlex.join(pretrain_flags(winner.setup, query.global_batch_size)))
    return lines


def _searched_lines(result: TuneResult) -> list[str]:
    """seq1f1b-zb-auto on the first layouts: its projection beside the listed schedule's."""
    if not result.searched:
        return []
    lines = ["", f"seq1f1b-zb-auto on the top {len(result.searched)} layouts (searched in "
             f"{result.counts.searched_seconds:.1f} s, each under the held bytes every rank of "
             "the layout has room for, with the output layer in the last stage or spread over "
             "the ranks):",
             f"{'#':>2} {'GiB/stage':>16} {'tok/s':>9} {'TFLOPS':>6} {'bubble':>6} "
             f"{'vs listed':>9} {'placement':>9} {'output':>6} cap"]
    for index, twin in result.searched.items():
        if twin is None:
            lines.append(f"{index + 1:>2} none: {why_none(result.ranked[index].setup)}")
            continue
        p, listed = twin.projection, result.ranked[index].projection
        lines.append(f"{index + 1:>2} {_stages(twin):>16} {p.tokens_per_s:>9.0f} "
                     f"{p.tflops_per_gpu:>6.1f} {p.report.bubble_ratio:>6.1%} "
                     f"{listed.iteration_s / p.iteration_s - 1:>+9.1%} "
                     f"{p.schedule.placement:>9} {_output_layer(twin):>6} "
                     f"{twin.setup.schedule_memory_cap}")
    return lines


def _output_layer(twin: Ranked) -> str:
    """Where the searched order runs the output layer: spread over the ranks (O actions), or
    in the last stage ("last")."""
    return "spread" if twin.projection.schedule.spread_output else "last"
