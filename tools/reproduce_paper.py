#!/usr/bin/env python3
"""The paper's tables from our plans: memory with OOM verdicts, projected throughput, ablation.

    reproduce_paper.py                  the tables and their assumptions
    reproduce_paper.py --json           {"memory": [...], "throughput": [...],
                                         "microbatch_sweep": [...], "ablation": [...]}
    reproduce_paper.py --device-check OUT/device_check.json
                                        the same with what tools/device_check.py measured on
                                        a GPU: its efficiencies in the cost model, and OOM
                                        verdicts on allocated x its reserved/allocated ratio
                                        (with --json also "calibration": {...})
    reproduce_paper.py --launch DIR     write DIR/submit.sh, the sweep as jobs of the shipped
                                        examples/slurm scripts, and DIR/sweeps.json
    reproduce_paper.py --launch DIR --submit [-- --partition=NAME --account=NAME ...]
                                        the same, submitted now (sbatch); prints the job ids
    reproduce_paper.py --collect DIR [--json]
                                        the three tables from those jobs' logs, OOM runs
                                        included (read with examples/slurm/job_results.py)

(a) memory: per panel of the paper's memory figure, the estimator's peak GiB per GPU (the
    largest stage) with an OOM verdict at --gpu-memory (79.25: the total capacity torch reports
    of an A100 80 GB, CUDA context included, as the estimate's overhead includes it), beside
    the paper's number or OOM mark where PAPER.md has them (the paper logged
    max_memory_reserved; the estimate counts allocated bytes until --device-check gives a
    measured reserve); (b) TFLOPS/GPU and
    tokens/s projected by the simulator with an A100 cost model
    (seq1f1b.plan.projection.DeviceModel, printed with each term's value and source), then the
    7B / 32-GPU panel at 8, 16 and 32 micro-batches, each row with its simulated bubble and
    what each cost term that grows with k adds to the iteration (fixed cost per span, p2p,
    GEMM and attention efficiency lost to short spans: seq1f1b/plan/overheads.py);
    (c) the partition ablation: Seq1F1B and Seq1F1B-I with even spans vs computation-balanced
    spans.
The paper does not state TP/PP per panel; `PANELS` holds what we assume and why, and the
shipped sbatch scripts' defaults are these layouts (tests/unit/test_reproduce_paper.py checks).

--launch runs nothing of its own: DIR/submit.sh calls examples/slurm/sweep.sh once per panel, V
and partition, so every job is a panel's shipped script (pretrain_gpt_<model>_<gpus>gpu.sbatch)
with the cell in its environment, as README's "Launch on Slurm" documents: SCHEDULE, SPLITS,
SEQ_LENGTH, MICRO_BATCHES from sweep.sh; TP, PP, VPP_LAYERS, PARTITION_METHOD, TRAIN_ITERS from
the sweep file. Each sweep's jobs.tsv, job outputs and run folders land in DIR/<model>-<gpus>gpu-
v<V>-<partition>/; --collect reads them through job_results.py (status OK, OOM, TIMEOUT,
FAILED, PENDING) and names each job by DIR/sweeps.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from seq1f1b.plan.actions import ScheduleError  # noqa: E402
from seq1f1b.plan.context_parallel import check_heads  # noqa: E402
from seq1f1b.plan.costs import preset  # noqa: E402
from seq1f1b.plan.memory import (GIB, MemoryEstimate, TrainingSetup,  # noqa: E402
                                 estimate_memory)
from seq1f1b.plan.calibration import (Calibration, CalibrationError,  # noqa: E402
                                      read_device_check)
from seq1f1b.plan.projection import A100, DeviceModel, Projection, project  # noqa: E402

PROG = "reproduce_paper.py"
REPO = Path(__file__).resolve().parents[1]
JOB_RESULTS = REPO / "examples" / "slurm" / "job_results.py"
SPLITS = 4                  # k of the authors' scripts (--pipe-sp-splits 4)
CHUNKS = 2                  # V of the interleaved runs (the authors' VPP 2)
SWEPT_PANEL = ("7b", 32)    # the panel whose throughput is shown by micro-batch count
MICROBATCH_COUNTS = (8, 16, 32)
CP_SIZES = (1, 2, 4, 8)
REACH_LENGTHS = tuple(16384 * 2 ** i for i in range(9))     # 16K .. 4M tokens
REACH_SPAN = 32768
"""Seq1F1B's spans in the context-reach table: k = L / 32K (at least SPLITS, at most 32)."""
RECOMPUTES = (None, "selective", "full")
"""Tried in this order at each length of the reach table: the least recompute that fits."""
"""The paper measured 8 and 16 micro-batches (PAPER.md holds none of its throughput figures);
32 is the authors' 7B script's."""


@dataclass(frozen=True)
class Panel:
    """One panel of the paper's memory figure and the layout we assume for it."""

    model: str
    gpus: int
    tp: int
    pp: int
    microbatches: int
    seq_lengths: tuple[int, ...]
    why: str

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def script(self) -> str:
        """The shipped sbatch script of this panel (its defaults are this layout)."""
        return f"examples/slurm/pretrain_gpt_{self.model}_{self.gpus}gpu.sbatch"


PANELS = (
    Panel("2.7b", 8, tp=1, pp=8, microbatches=32, seq_lengths=(16384, 24576, 32768),
          why="one node, no node boundary to keep TP inside: pure pipeline PP=8 (a TP=2, PP=4 "
              "layout would put 1F1B at 16K near 28 GiB, far below the paper's 51.4 GB)"),
    Panel("7b", 32, tp=8, pp=4, microbatches=32, seq_lengths=(32768, 65536, 131072),
          why="TP=8 inside each node, PP=4 across the 4 nodes, as the authors' 30B script "
              "(TP=8, PP=8 on 64 GPUs); the authors' 7B script (TP=2, PP=4) is a one-node 16K run"),
    Panel("13b", 32, tp=8, pp=4, microbatches=32, seq_lengths=(32768, 49152, 65536),
          why="as 7B: TP=8 inside a node, PP=4 across 4 nodes"),
    Panel("30b", 64, tp=8, pp=8, microbatches=16, seq_lengths=(32768, 49152, 65536),
          why="the authors' 30B script: TP=8, PP=8, 16 micro-batches"),
)
"""Micro-batch size 1, m=32 as the authors' 7B script (16 for 30B as its script); the peak does
not depend on m once m >= P (x V). bf16, sequence parallelism where TP > 1, distributed
optimizer, no recompute, k=4 computation-balanced spans, V=2 for the interleaved schedules."""

SCHEDULES = (("1F1B", "1f1b"), ("1F1B-I", "interleaved-1f1b"), ("Seq1F1B", "seq1f1b"),
             ("Seq1F1B-I", "seq1f1b-interleaved"))
"""The paper's names and the registry's."""

OOM = "OOM"
PAPER_MEMORY_GB: dict[tuple[str, int], tuple] = {
    ("2.7b", 16384): (51.40, 70.95, 29.85, 29.70),
    ("2.7b", 24576): (74.30, OOM, 41.45, 41.90),
    ("2.7b", 32768): (OOM, OOM, 53.10, 54.45),
    ("7b", 32768): (28.00, 34.20, 18.90, 16.35),
    ("7b", 65536): (51.40, 62.90, 34.30, 28.45),
    ("7b", 131072): (OOM, OOM, 69.80, 57.55),
}
"""PAPER.md's memory table, in SCHEDULES order (GB as the paper prints them)."""


SLURM_TIME = re.compile(r"^(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|UNLIMITED|INFINITE)$")
"""The time limits sbatch --time accepts."""


class UsageError(Exception):
    """Bad command line: one line on stderr, exit code 2."""


class SubmitError(Exception):
    """sbatch refused or failed: one line on stderr, exit code 1."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def _is_seq1f1b(schedule: str) -> bool:
    return schedule.startswith("seq1f1b")


def _chunks(schedule: str) -> int:
    return CHUNKS if "interleaved" in schedule else 1


def _setup(panel: Panel, seq_length: int, schedule: str, partition: str = "compute"
           ) -> TrainingSetup:
    seq1f1b = _is_seq1f1b(schedule)
    return TrainingSetup(
        model=preset(panel.model), seq_length=seq_length, schedule=schedule, pp=panel.pp,
        microbatches=panel.microbatches, splits=SPLITS if seq1f1b else 1,
        chunks=_chunks(schedule), tp=panel.tp, dp=panel.dp,
        sequence_parallel=panel.tp > 1, distributed_optimizer=True,
        partition=partition if seq1f1b else "even")


def _paper_memory(model: str, seq_length: int, schedule: str) -> dict:
    """The paper's figure for one cell: paper_gb (None: not given or OOM) and paper_oom (None:
    the cell is not in PAPER_MEMORY_GB)."""
    paper = PAPER_MEMORY_GB.get((model, seq_length))
    value = paper[[name for _, name in SCHEDULES].index(schedule)] if paper else None
    return {"paper_gb": None if value in (None, OOM) else value,
            "paper_oom": None if value is None else value == OOM}


def _cell(panel: Panel, seq_length: int, schedule: str) -> dict:
    """The keys every table row starts with."""
    return {"model": panel.model, "gpus": panel.gpus, "seq_length": seq_length,
            "schedule": schedule, "tp": panel.tp, "pp": panel.pp,
            "microbatches": panel.microbatches}


def _cells(panels: tuple[Panel, ...] = ()) -> Iterator[tuple[dict, TrainingSetup]]:
    """Every (panel, sequence length, schedule) cell of the paper's tables (of `panels`, when
    given): the keys its rows start with (k and V included) and the setup it assumes."""
    for panel in panels or PANELS:
        for seq_length in panel.seq_lengths:
            for _, schedule in SCHEDULES:
                setup = _setup(panel, seq_length, schedule)
                yield ({**_cell(panel, seq_length, schedule), "splits": setup.splits,
                        "chunks": setup.chunks}, setup)


@dataclass(frozen=True)
class Models:
    """What the estimated tables assume of the device: its memory, its rates and, once
    device_check has measured them (--device-check), the measured efficiencies and the caching
    allocator's reserve, by which the OOM verdicts then judge reserved rather than allocated
    bytes."""

    gpu_memory_gib: float = A100.memory_gib
    calibration: Optional[Calibration] = None

    @property
    def device(self) -> DeviceModel:
        return self.calibration.device_model(A100) if self.calibration else A100

    @property
    def reserve_ratio(self) -> Optional[float]:
        return self.calibration.reserve_ratio if self.calibration else None

    def fits(self, estimate: MemoryEstimate) -> bool:
        return estimate.fits(self.gpu_memory_gib, self.reserve_ratio or 1.0)


def memory_rows(models: Models) -> list[dict]:
    rows = []
    for cell, setup in _cells():
        estimate = estimate_memory(setup)
        reserved = (estimate.reserved_peak_bytes(models.reserve_ratio) / GIB
                    if models.reserve_ratio else None)
        rows.append({**cell, "estimate_gb": estimate.peak_bytes / GIB, "reserved_gb": reserved,
                     "fits_up_to_reserve": estimate.largest_fitting_reserve(
                         models.gpu_memory_gib),
                     "oom": not models.fits(estimate),
                     **_paper_memory(cell["model"], cell["seq_length"],
                                     cell["schedule"])})
    return rows


def _throughput_row(cell: dict, setup: TrainingSetup, models: Models) -> tuple[dict, Projection]:
    projection = project(setup, models.device)
    return {**cell, "tflops_per_gpu": projection.tflops_per_gpu,
            "tokens_per_s": projection.tokens_per_s, "iteration_s": projection.iteration_s,
            "bubble_ratio": projection.report.bubble_ratio,
            "oom": not models.fits(estimate_memory(setup)), "paper_tflops": None}, projection


def throughput_rows(models: Models) -> list[dict]:
    return [_throughput_row(cell, setup, models)[0] for cell, setup in _cells()]


def cp_layout(panel: Panel, cp: int) -> Optional[tuple[int, int]]:
    """(TP, PP) for the panel's GPUs with CP = `cp` and DP = 1: the largest TP up to the panel's
    whose heads C can shard, PP the rest (dividing the layers); None when none exists."""
    model = preset(panel.model)
    tp = panel.tp
    while tp >= 1:
        pp = panel.gpus // (tp * cp)
        try:
            check_heads(model.num_attention_heads, model.num_query_groups, tp, cp)
            heads_ok = model.num_attention_heads % tp == 0
        except ScheduleError:
            heads_ok = False
        if heads_ok and pp >= 1 and pp * tp * cp == panel.gpus and model.num_layers % pp == 0:
            return tp, pp
        tp //= 2
    return None


def _reach_setup(panel: Panel, layout: tuple[int, int], cp: int, schedule: str,
                 seq_length: int, recompute: Optional[str]) -> TrainingSetup:
    tp, pp = layout
    splits = min(max(seq_length // REACH_SPAN, SPLITS), 32) if _is_seq1f1b(schedule) else 1
    return TrainingSetup(
        model=preset(panel.model), seq_length=seq_length, schedule=schedule, pp=pp,
        microbatches=panel.microbatches, splits=splits, tp=tp, cp=cp, dp=1,
        sequence_parallel=tp > 1, distributed_optimizer=True, recompute_granularity=recompute)


def reach_rows(models: Models) -> list[dict]:
    """Per paper panel, CP size and schedule (1F1B, Seq1F1B): the longest context of
    REACH_LENGTHS that fits its GPUs (DP = 1, the least recompute of RECOMPUTES that fits),
    with the projected throughput there."""
    rows = []
    for panel in PANELS:
        for cp in CP_SIZES:
            layout = cp_layout(panel, cp)
            for schedule in ("1f1b", "seq1f1b"):
                row = {"model": panel.model, "gpus": panel.gpus, "cp": cp, "schedule": schedule,
                       "tp": layout[0] if layout else None, "pp": layout[1] if layout else None,
                       "seq_length": None, "splits": None, "recompute": None,
                       "tflops_per_gpu": None, "tokens_per_s": None}
                reached = None
                for seq_length in REACH_LENGTHS if layout else ():
                    fitting = next((setup for recompute in RECOMPUTES
                                    for setup in [_reach_setup(panel, layout, cp, schedule,
                                                               seq_length, recompute)]
                                    if models.fits(estimate_memory(setup))), None)
                    if fitting is None:
                        break
                    reached = fitting
                if reached is not None:
                    projection = project(reached, models.device)
                    row.update(seq_length=reached.seq_length, splits=reached.splits,
                               recompute=reached.recompute_granularity,
                               tflops_per_gpu=projection.tflops_per_gpu,
                               tokens_per_s=projection.tokens_per_s)
                rows.append(row)
    return rows


def microbatch_rows(models: Models) -> list[dict]:
    """SWEPT_PANEL's throughput at each of MICROBATCH_COUNTS, each row with the seconds each
    k-dependent term adds to its iteration (`Projection.overheads`); none without the panel."""
    panels = [panel for panel in PANELS if (panel.model, panel.gpus) == SWEPT_PANEL]
    rows = []
    for cell, setup in _cells(tuple(replace(panel, microbatches=m) for panel in panels
                                    for m in MICROBATCH_COUNTS)):
        row, projection = _throughput_row(cell, setup, models)
        rows.append({**row, "overheads_s": projection.overheads()})
    return rows


def ablation_rows(models: Models) -> list[dict]:
    rows = []
    for panel in PANELS:
        for seq_length in panel.seq_lengths:
            for _, schedule in SCHEDULES[2:]:
                even = project(_setup(panel, seq_length, schedule, "even"), models.device)
                balanced = project(_setup(panel, seq_length, schedule, "compute"),
                                   models.device)
                rows.append({**_cell(panel, seq_length, schedule), "splits": SPLITS,
                             "even_spans": even.span_lengths,
                             "compute_spans": balanced.span_lengths,
                             "tflops_even": even.tflops_per_gpu,
                             "tflops_compute": balanced.tflops_per_gpu,
                             "gain": balanced.tflops_per_gpu / even.tflops_per_gpu - 1})
    return rows


def agreeing_reserves(memory: list[dict]) -> Optional[tuple[float, float]]:
    """(low, high): every OOM verdict agrees with the paper's marks at a reserved/allocated
    ratio above low (at least 1) and up to high; None where no ratio does. What a device
    measurement of the allocator's reserve would have to show for the tables to match."""
    checked = [r for r in memory if r["paper_oom"] is not None]
    low = max([1.0] + [r["fits_up_to_reserve"] for r in checked if r["paper_oom"]])
    high = min([math.inf] + [r["fits_up_to_reserve"] for r in checked if not r["paper_oom"]])
    return (low, high) if low < high else None


# -- text ----------------------------------------------------------------------------------------
def _paper_names() -> dict[str, str]:
    return {registry_name: paper_name for paper_name, registry_name in SCHEDULES}


def _grid(rows: list[dict], value) -> list[str]:
    """One line per (model, seq_length), one column per schedule ("-": no row)."""
    names = _paper_names()
    lines = ["| model, GPUs | TP/PP/DP | m | L | " + " | ".join(names.values()) + " |",
             "|" + "---|" * (4 + len(names))]
    order: dict[tuple, dict] = {}
    for row in rows:
        order.setdefault((row["model"], row["gpus"], row["seq_length"]), {})[row["schedule"]] = row
    for (model, gpus, seq_length), cells in order.items():
        first = next(iter(cells.values()))
        dp = gpus // (first["tp"] * first["pp"])
        lines.append(f"| {model}, {gpus} | {first['tp']}/{first['pp']}/{dp} | "
                     f"{first['microbatches']} | {seq_length // 1024}K | "
                     + " | ".join(value(cells[s]) if s in cells else "-" for s in names)
                     + " |")
    return lines


def _ablation_table(rows: list[dict], columns: list[tuple[str, Callable[[dict], str]]]
                    ) -> list[str]:
    """The partition ablation as a markdown table: each row's model, L and schedule, then one
    column per (heading, cell text) of `columns`."""
    names = _paper_names()
    lines = ["| model, GPUs | L | schedule | " + " | ".join(h for h, _ in columns) + " |",
             "|" + "---|" * (3 + len(columns))]
    for r in rows:
        lines.append(f"| {r['model']}, {r['gpus']} | {r['seq_length'] // 1024}K | "
                     f"{names[r['schedule']]} | " + " | ".join(cell(r) for _, cell in columns)
                     + " |")
    return lines


def _with_paper(text: str, row: dict, verdict: bool = True) -> str:
    """`text`, then the paper's figure where it has one, marked when our OOM `verdict` (False:
    none yet) differs from the paper's."""
    if row["paper_oom"] is None:
        return text
    paper = OOM if row["paper_oom"] else f"{row['paper_gb']:.2f}"
    mark = " (verdict differs)" if verdict and row["paper_oom"] != row["oom"] else ""
    return f"{text} / paper {paper}{mark}"


def _memory_cell(row: dict) -> str:
    reserved = "" if row["reserved_gb"] is None else f" ({row['reserved_gb']:.1f} reserved)"
    return _with_paper(f"{row['estimate_gb']:.1f}{reserved} {OOM if row['oom'] else 'fits'}",
                       row)


def _measured(text: Optional[str], status: str) -> str:
    """A measured figure, then the job's status unless OK; the status alone without a figure."""
    if text is None:
        return status
    return text if status == "OK" else f"{text} {status}"


def _number(value: Optional[float], form: str = "{:.1f}") -> Optional[str]:
    return None if value is None else form.format(value)


def _measured_memory_cell(row: dict) -> str:
    return _with_paper(_measured(_number(row["measured_gb"]), row["status"]), row,
                       verdict=row["status"] in ("OK", OOM))


def _measured_throughput_cell(row: dict) -> str:
    figures = (None if row["tflops_per_gpu"] is None or row["tokens_per_s"] is None else
               f"{row['tflops_per_gpu']:.0f} TF {row['tokens_per_s']:.0f} tok/s")
    return _measured(figures, row["status"])


def print_tables(result: dict, models: Models) -> None:
    judged = ("allocated bytes" if models.reserve_ratio is None else
              f"reserved bytes, allocated x {models.reserve_ratio:.3f} measured by device_check")
    print(f"(a) Peak memory per GPU, GiB (largest stage), OOM at {models.gpu_memory_gib:g} GiB "
          f"of {judged}: ours / the paper's")
    print("\n".join(_grid(result["memory"], _memory_cell)))
    print("Assumed layouts (the paper does not state them):")
    for panel in PANELS:
        print(f"  {panel.model} on {panel.gpus} GPUs: TP={panel.tp} PP={panel.pp} "
              f"DP={panel.dp} m={panel.microbatches}: {panel.why}")
    print(f"  all: micro-batch 1, bf16, SP when TP > 1, distributed optimizer, no recompute, "
          f"k={SPLITS} computation-balanced spans, V={CHUNKS} for the interleaved schedules.")
    checked = [r for r in result["memory"] if r["paper_oom"] is not None]
    agree = sum(r["paper_oom"] == r["oom"] for r in checked)
    print(f"  OOM verdicts agreeing with the paper: {agree} of {len(checked)}")
    window = agreeing_reserves(result["memory"])
    print("  " + (f"all {len(checked)} would agree at a reserved/allocated ratio above "
                  f"{window[0]:.3f} and up to {window[1]:.3f} (device_check measures it)"
                  if window else "no reserved/allocated ratio makes all of them agree"))
    print()
    print("(b) Projected TFLOPS per GPU and tokens/s (simulator, A100 cost model; "
          "* = the memory estimate says OOM)")
    print("\n".join(_grid(result["throughput"], lambda r: f"{r['tflops_per_gpu']:.0f} TF "
                          f"{r['tokens_per_s']:.0f} tok/s{' *' if r['oom'] else ''}")))
    print()
    model, gpus = SWEPT_PANEL
    print(f"(b) {model} on {gpus} GPUs by micro-batch count m: projected TFLOPS per GPU, "
          "simulated bubble, and the seconds each cost term that grows with k adds to the "
          "iteration (its time with the term minus without it)")
    print("\n".join(_microbatch_table(result["microbatch_sweep"])))
    print("Cost model (each term's value [source]):")
    for line in models.device.describe():
        print(f"  {line}")
    if models.calibration:
        print(f"  efficiencies {models.calibration.describe()}; assumed to carry over to "
              f"{models.device.name} as fractions of its peak")
    print("  B = 2 x F FLOPs; per span: GEMM FLOPs at gemm.at(tokens), attention at "
          "attention.forward/backward(queries, keys), plus span_fixed per layer; TP "
          "collectives per layer 4 forward + 4 backward, not overlapped; p2p hop = latency + "
          "span activations / bandwidth of NVLink or InfiniBand by where the two stages sit "
          "(megatron's rank order: TP, DP, PP); DP: fp32 grad reduce-scatter + bf16 param "
          "all-gather once per iteration; no optimizer-step time; TFLOPS counted as the paper "
          "does (3 x forward FLOPs, embedding as a GEMM). None of the terms is fitted to the "
          "paper's throughput. The paper's TFLOPS are not in PAPER.md (for m = 8 and 16 "
          "either): no paper column.")
    print()
    print("(c) Partition ablation: projected TFLOPS per GPU, even vs computation-balanced spans")
    print("\n".join(_ablation_table(result["ablation"], [
        ("even spans", lambda r: " ".join(map(str, r["even_spans"]))),
        ("TFLOPS", lambda r: f"{r['tflops_even']:.1f}"),
        ("compute spans", lambda r: " ".join(map(str, r["compute_spans"]))),
        ("TFLOPS", lambda r: f"{r['tflops_compute']:.1f}"),
        ("gain", lambda r: f"{r['gain']:+.1%}")])))
    print()
    print(f"(d) Context reach with context parallelism (Ulysses a2a, --context-parallel-size): "
          f"the longest of {REACH_LENGTHS[0] // 1024}K x 2^i tokens that fits each panel's "
          f"GPUs at DP=1, with the least recompute that fits, and the projected throughput "
          f"there; Seq1F1B with k = L / {REACH_SPAN // 1024}K spans ({SPLITS} to 32)")
    print("\n".join(_reach_table(result["context_reach"])))


def _reach_table(rows: list[dict]) -> list[str]:
    """One line per (panel, CP): the layout, then each schedule's reach."""
    lines = [f"{'model':>6} {'GPUs':>4} {'CP':>2} {'TP':>2} {'PP':>2}  "
             f"{'1F1B: L, recompute, TFLOPS, tok/s':<40}  Seq1F1B: L, k, recompute, TFLOPS, tok/s"]

    def reach(row: Optional[dict]) -> str:
        if row is None or row["tp"] is None:
            return "no layout (heads)"
        if row["seq_length"] is None:
            return f"< {REACH_LENGTHS[0] // 1024}K"
        k = f" k={row['splits']}" if row["schedule"] != "1f1b" else ""
        return (f"{row['seq_length'] // 1024}K{k} {row['recompute'] or 'none'} "
                f"{row['tflops_per_gpu']:.0f} TF {row['tokens_per_s']:.0f} tok/s")

    by_key = {(r["model"], r["gpus"], r["cp"], r["schedule"]): r for r in rows}
    for model, gpus, cp in dict.fromkeys((r["model"], r["gpus"], r["cp"]) for r in rows):
        one, seq = by_key.get((model, gpus, cp, "1f1b")), by_key.get((model, gpus, cp, "seq1f1b"))
        tp = "-" if one["tp"] is None else one["tp"]
        pp = "-" if one["pp"] is None else one["pp"]
        lines.append(f"{model:>6} {gpus:>4} {cp:>2} {tp:>2} {pp:>2}  {reach(one):<40}  "
                     f"{reach(seq)}")
    return lines


def _microbatch_table(rows: list[dict]) -> list[str]:
    """One line per (L, m, schedule) of the micro-batch sweep."""
    names = _paper_names()
    terms = (("fixed", "span_fixed"), ("p2p", "p2p"), ("GEMM eff.", "gemm"),
             ("attention eff.", "attention"))
    lines = ["| L | m | schedule | k | TFLOPS | tok/s | iteration s | bubble | "
             + " | ".join(heading for heading, _ in terms) + " |",
             "|" + "---|" * (8 + len(terms))]
    for r in sorted(rows, key=lambda r: (r["seq_length"], r["microbatches"])):
        cost = " | ".join(f"{r['overheads_s'][key]:.2f} s "
                          f"({r['overheads_s'][key] / r['iteration_s']:.1%})"
                          for _, key in terms)
        lines.append(f"| {r['seq_length'] // 1024}K | {r['microbatches']} | "
                     f"{names[r['schedule']]} | {r['splits']} | {r['tflops_per_gpu']:.0f}"
                     f"{' *' if r['oom'] else ''} | {r['tokens_per_s']:.0f} | "
                     f"{r['iteration_s']:.2f} | {r['bubble_ratio']:.1%} | {cost} |")
    return lines


def print_measured(result: dict) -> None:
    """The tables of --collect: what the jobs measured, each cell's job status where not OK
    (OOM, TIMEOUT, FAILED, PENDING: examples/slurm/job_results.py)."""
    print("(a) Measured peak memory per GPU, GiB (largest stage, the trainer's max reserved): "
          "ours / the paper's")
    print("\n".join(_grid(result["memory"], _measured_memory_cell)))
    print()
    print("(b) Measured TFLOPS per GPU and tokens/s (the trainer's, median over the iterations "
          "after the first)")
    print("\n".join(_grid(result["throughput"], _measured_throughput_cell)))
    print()
    print("(c) Partition ablation: measured TFLOPS per GPU, even vs computation-balanced spans")
    print("\n".join(_ablation_table(result["ablation"], [
        ("TFLOPS even", lambda r: _measured(_number(r["tflops_even"]), r["status_even"])),
        ("TFLOPS compute", lambda r: _measured(_number(r["tflops_compute"]),
                                               r["status_compute"])),
        ("gain", lambda r: "-" if r["gain"] is None else f"{r['gain']:+.1%}")])))


# -- the real sweep: the shipped examples/slurm scripts, submitted by sweep.sh -------------------
SWEEP_FILE = "submit.sh"
MANIFEST = "sweeps.json"
PARTITIONS = ("compute", "even")
"""The partition of the tables' runs, then the ablation's other half (Seq1F1B schedules only)."""


@dataclass(frozen=True)
class Sweep:
    """One examples/slurm/sweep.sh call: the cells of a panel that share V and the partition.

    sweep.sh crosses schedules x k x lengths x micro-batches and hands every other variable to
    its jobs unchanged, so a panel's cells fall into one call per (V, partition): the whole-
    sequence and Seq1F1B schedules, their interleaved forms (VPP_LAYERS), and the Seq1F1B ones
    again with even spans for the ablation.
    """

    panel: Panel
    schedules: tuple[str, ...]
    chunks: int
    partition: str

    @property
    def folder(self) -> str:
        """Its sweep.sh --out, under the launch folder."""
        return f"{self.panel.model}-{self.panel.gpus}gpu-v{self.chunks}-{self.partition}"

    @property
    def jobs(self) -> int:
        return len(self.schedules) * len(self.panel.seq_lengths)

    def environment(self, train_iters: int) -> dict[str, str]:
        """sweep.sh's grid (SCHEDULES, SPLITS, SEQ_LENGTHS, MICRO_BATCHES) and the variables of
        examples/slurm/launch_pretrain.sh the jobs read. Every layout setting is explicit, so a
        variable left in the submitting shell cannot change a cell (an empty VPP_LAYERS is
        unset for the script)."""
        layers = preset(self.panel.model).num_layers
        vpp_layers = str(layers // (self.panel.pp * self.chunks)) if self.chunks > 1 else ""
        return {"SCHEDULES": " ".join(self.schedules), "SPLITS": str(SPLITS),
                "SEQ_LENGTHS": " ".join(map(str, self.panel.seq_lengths)),
                "MICRO_BATCHES": str(self.panel.microbatches), "TP": str(self.panel.tp),
                "PP": str(self.panel.pp), "VPP_LAYERS": vpp_layers,
                "PARTITION_METHOD": self.partition, "TRAIN_ITERS": str(train_iters)}

    def record(self) -> dict:
        """Its entry in the launch folder's sweeps.json: what --collect names its jobs by."""
        return {"folder": self.folder, "script": self.panel.script, "model": self.panel.model,
                "gpus": self.panel.gpus, "tp": self.panel.tp, "pp": self.panel.pp,
                "chunks": self.chunks, "partition": self.partition}


def sweeps() -> list[Sweep]:
    """The whole sweep: every cell of the tables (computation-balanced spans) and, for the
    ablation, the Seq1F1B cells with even spans."""
    found = []
    for panel in PANELS:
        for partition in PARTITIONS:
            for chunks in (1, CHUNKS):
                schedules = tuple(name for _, name in SCHEDULES if _chunks(name) == chunks
                                  and (partition == "compute" or _is_seq1f1b(name)))
                found.append(Sweep(panel, schedules, chunks, partition))
    return found


def sweep_file(folder: Path, plan: list[Sweep], train_iters: int, time_limit: str) -> str:
    """The bash script that submits `plan`: one sweep.sh call per Sweep, from the repository
    root (the scripts find launch_pretrain.sh through the submit directory)."""
    about = (f"The paper's sweep, written by tools/{PROG} --launch: "
             f"{sum(s.jobs for s in plan)} jobs of the shipped examples/slurm scripts with the "
             "layouts of its PANELS, one examples/slurm/sweep.sh call per panel, V and "
             "partition. Arguments are sbatch options for every job, in their --name=value form "
             "(e.g. --partition=gpu --account=me); the jobs also get this shell's exports "
             "(DATA_PATH, VOCAB_FILE, MERGE_FILE, LAUNCHER, PYTHON, ... of launch_pretrain.sh).")
    lines = ["#!/bin/bash", *textwrap.wrap(about, 98, initial_indent="# ",
                                           subsequent_indent="# "),
             "set -euo pipefail",
             f"cd {shlex.quote(str(REPO))}"]
    for sweep in plan:
        env = " ".join(f"{key}={shlex.quote(value)}"
                       for key, value in sweep.environment(train_iters).items())
        lines.append(f"{env} \\\n    examples/slurm/sweep.sh --out "
                     f"{shlex.quote(str(folder / sweep.folder))} "
                     f"--time={shlex.quote(time_limit)} \"$@\" {sweep.panel.script}")
    lines.append(f"echo {shlex.quote(f'collect when done: {_collect_command(folder)}')}")
    return "\n".join(lines) + "\n"


def _collect_command(folder: Path) -> str:
    return f"tools/{PROG} --collect {shlex.quote(str(folder))}"


def launch(folder: Path, train_iters: int, time_limit: str) -> Path:
    """Write the sweep file and sweeps.json into `folder` (made absolute); return the file.

    Refuses a folder whose sweeps were already submitted (sweep.sh would refuse each of them).
    """
    folder = folder.resolve()
    plan = sweeps()
    if any((folder / sweep.folder / "jobs.tsv").exists() for sweep in plan):
        raise UsageError(f"--launch: {folder} already holds submitted jobs: use another folder")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps([sweep.record() for sweep in plan], indent=1))
    script = folder / SWEEP_FILE
    script.write_text(sweep_file(folder, plan, train_iters, time_limit))
    script.chmod(0o755)
    return script


def submit(script: Path, sbatch_options: list[str]) -> list[dict]:
    """Run the sweep file (sbatch for every job); the jobs as --collect lists them, PENDING."""
    done = subprocess.run(["bash", str(script), *sbatch_options], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise SubmitError(f"submitting failed ({last}); the jobs submitted before are listed "
                          f"in {script.parent}/*/jobs.tsv")
    return collect_runs(script.parent)


def _job_results():
    """examples/slurm/job_results.py: the one reader of jobs.tsv, training logs and summaries."""
    spec = importlib.util.spec_from_file_location("job_results", JOB_RESULTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def collect_runs(folder: Path) -> list[dict]:
    """One dict per submitted job of the launch `folder`: its cell, partition, job id, status
    and figures (read by job_results.collect from the job's summary line, or from its output
    as far as it got when it printed none; PENDING without output)."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise UsageError(f"--collect: {folder} holds no {MANIFEST}: not a --launch folder")
    results = _job_results()
    runs = []
    for sweep in json.loads(manifest.read_text()):
        if not (folder / sweep["folder"] / "jobs.tsv").exists():
            continue                                     # not submitted
        for job in results.collect(folder / sweep["folder"]):
            runs.append(_run(sweep, job))
    if not runs:
        raise UsageError(f"--collect: no submitted job under {folder} "
                         f"(submit with {folder / SWEEP_FILE})")
    return runs


def _run(sweep: dict, job: dict[str, str]) -> dict:
    def number(key: str, scale: float = 1.0) -> Optional[float]:
        return float(job[key]) / scale if job.get(key) else None

    return {"model": sweep["model"], "gpus": sweep["gpus"], "seq_length": int(job["seq_length"]),
            "schedule": job["schedule"], "tp": sweep["tp"], "pp": sweep["pp"],
            "microbatches": int(job["micro_batches"]), "splits": int(job["splits"]),
            "chunks": sweep["chunks"], "partition": sweep["partition"],
            "job_id": job["job_id"], "log": job["log"], "status": job["status"],
            "oom": job["status"] == OOM, "measured_gb": number("peak_mem_mb", 1024),
            "iteration_s": number("ms_per_iteration", 1000),
            "tokens_per_s": number("tokens_per_s"), "tflops_per_gpu": number("tflops_per_gpu")}


CELL_KEYS = ("model", "gpus", "seq_length", "schedule", "tp", "pp", "microbatches", "splits",
             "chunks")
MEMORY_KEYS = ("job_id", "log", "status", "oom", "measured_gb")
THROUGHPUT_KEYS = ("job_id", "log", "status", "oom", "iteration_s", "tokens_per_s",
                   "tflops_per_gpu")


def collect(folder: Path) -> dict:
    """The three tables from the jobs of the launch `folder`, OOM and unfinished runs included.

    Memory is the trainer's peak per stage (max_memory_reserved on a GPU; the largest stage,
    median over the iterations after the first) in GiB, beside the paper's figure; throughput is
    the trainer's; the ablation pairs each Seq1F1B cell's even-span and balanced-span runs.
    """
    runs = collect_runs(folder)
    tables = [r for r in runs if r["partition"] == "compute"]
    memory = [{**{k: r[k] for k in CELL_KEYS + MEMORY_KEYS},
               **_paper_memory(r["model"], r["seq_length"], r["schedule"])} for r in tables]
    throughput = [{k: r[k] for k in CELL_KEYS + THROUGHPUT_KEYS} for r in tables]
    even = {_cell_key(r): r for r in runs if r["partition"] == "even"}
    ablation = []
    for balanced in tables:
        other = even.get(_cell_key(balanced))
        if other is None:
            continue
        gain = (balanced["tflops_per_gpu"] / other["tflops_per_gpu"] - 1
                if balanced["tflops_per_gpu"] and other["tflops_per_gpu"] else None)
        ablation.append({**{k: balanced[k] for k in CELL_KEYS},
                         "status_even": other["status"], "status_compute": balanced["status"],
                         "tflops_even": other["tflops_per_gpu"],
                         "tflops_compute": balanced["tflops_per_gpu"], "gain": gain})
    return {"memory": memory, "throughput": throughput, "ablation": ablation}


def _cell_key(run: dict) -> tuple:
    return run["model"], run["gpus"], run["seq_length"], run["schedule"]


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                    epilog=__doc__.split("\n\n")[1],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true",
                        help="print JSON instead of tables (also with --collect)")
    parser.add_argument("--gpu-memory", type=float, default=A100.memory_gib, metavar="GiB",
                        help="device memory for the OOM verdicts (default "
                             f"{A100.memory_gib:g}: the total capacity torch reports of an "
                             "A100 80 GB)")
    parser.add_argument("--device-check", metavar="FILE",
                        help="device_check.json of tools/device_check.py: its measured GEMM and "
                             "attention efficiencies replace the A100 model's saturated ones "
                             "(their printed source then names FILE), and the OOM "
                             "verdicts judge allocated bytes times its measured "
                             "reserved/allocated ratio")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--launch", metavar="DIR",
                      help=f"write DIR/{SWEEP_FILE}: the sweep's jobs, the shipped "
                           "examples/slurm scripts submitted by examples/slurm/sweep.sh")
    mode.add_argument("--collect", metavar="DIR",
                      help="the tables from the logs of the jobs --launch DIR submitted")
    parser.add_argument("--submit", action="store_true",
                        help=f"with --launch: run DIR/{SWEEP_FILE} now (sbatch) and print the "
                             "job ids")
    parser.add_argument("--train-iters", type=int, default=10,
                        help="with --launch: iterations per job (default 10; the first is not "
                             "timed)")
    parser.add_argument("--time", default="00:30:00",
                        help="with --launch: the jobs' time limit (sbatch --time; default "
                             "00:30:00)")
    parser.add_argument("sbatch_options", nargs="*", metavar="--SBATCH-OPTION=VALUE",
                        help="with --launch --submit, after --: sbatch options for every job "
                             "(e.g. -- --partition=gpu --account=me)")
    return parser


def _check(args: argparse.Namespace) -> None:
    if (args.submit or args.sbatch_options) and not args.launch:
        raise UsageError("--submit and sbatch options need --launch DIR")
    if args.sbatch_options and not args.submit:
        raise UsageError(f"sbatch options without --submit: give them to {SWEEP_FILE} instead")
    for option in args.sbatch_options:
        if not (option.startswith("--") and "=" in option):
            raise UsageError(f"sbatch option {option!r}: give it as --name=value after --")
    if args.gpu_memory <= 0:
        raise UsageError("--gpu-memory must be positive")
    if args.train_iters < 2:
        raise UsageError("--train-iters must be >= 2 (the first iteration is not timed)")
    if args.device_check and (args.launch or args.collect):
        raise UsageError("--device-check applies to the estimated tables, not to --launch or "
                         "--collect")
    if args.collect and not Path(args.collect).is_dir():
        raise UsageError(f"--collect: {args.collect} is not a directory")
    if args.launch:
        if not SLURM_TIME.match(args.time):
            raise UsageError(f"--time {args.time!r} is not a Slurm time limit (MINUTES, "
                             f"MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS[:MINUTES"
                             f"[:SECONDS]] or UNLIMITED)")
        from megatron.training.writable import check_output_dir
        try:
            check_output_dir(args.launch, "--launch")
        except ValueError as err:
            raise UsageError(str(err)) from None


def _launch(args: argparse.Namespace) -> None:
    script = launch(Path(args.launch), args.train_iters, args.time)
    if not args.submit:
        plan = sweeps()
        print(f"wrote {script}: {sum(sweep.jobs for sweep in plan)} jobs of the shipped "
              f"examples/slurm scripts ({len(plan)} sweep.sh calls)")
        print(f"submit with: bash {shlex.quote(str(script))} [--partition=NAME "
              "--account=NAME ...]")
        print(f"collect when done: {_collect_command(script.parent)}")
        return
    runs = submit(script, args.sbatch_options)
    for run in runs:
        print(f"submitted {run['job_id']} {run['model']} {run['gpus']}gpu "
              f"{run['seq_length'] // 1024}K {run['schedule']} k={run['splits']} "
              f"V={run['chunks']} {run['partition']}")
    print(f"{len(runs)} jobs submitted; collect when done: {_collect_command(script.parent)}")


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _check(args)
        if args.launch:
            _launch(args)
            return 0
        if args.collect:
            result = collect(Path(args.collect))
        else:
            models = Models(args.gpu_memory, read_device_check(args.device_check)
                            if args.device_check else None)
            result = {"memory": memory_rows(models), "throughput": throughput_rows(models),
                      "microbatch_sweep": microbatch_rows(models),
                      "ablation": ablation_rows(models), "context_reach": reach_rows(models)}
            if models.calibration:
                result["calibration"] = models.calibration.to_dict()
    except (UsageError, ScheduleError, CalibrationError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except (SubmitError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    elif args.collect:
        print_measured(result)
    else:
        print_tables(result, models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
