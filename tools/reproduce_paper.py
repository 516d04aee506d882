#!/usr/bin/env python3
"""The paper's tables from our plans: memory with OOM verdicts, projected throughput, ablation.

    reproduce_paper.py                     three tables and their assumptions
    reproduce_paper.py --json              {"memory": [...], "throughput": [...], "ablation": [...]}
    reproduce_paper.py --launch DIR        one Slurm job per cell of the sweep (--submit: sbatch)
    reproduce_paper.py --collect DIR       the same tables from those jobs' logs, OOM runs included
                                           (read with examples/slurm/job_results.py)

(a) memory: per panel of the paper's memory figure, the estimator's peak GiB per GPU (the
    largest stage) with an OOM verdict at --gpu-memory (80), beside the paper's number or OOM
    mark where PAPER.md has them; (b) TFLOPS/GPU and tokens/s projected by the simulator with an
    A100 cost model (seq1f1b.plan.projection.DeviceModel, printed); (c) the partition ablation:
    Seq1F1B and Seq1F1B-I with even spans vs computation-balanced spans.
The paper does not state TP/PP per panel; `PANELS` holds what we assume and why.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from seq1f1b.plan.actions import ScheduleError  # noqa: E402
from seq1f1b.plan.costs import preset  # noqa: E402
from seq1f1b.plan.memory import GIB, TrainingSetup, estimate_memory  # noqa: E402
from seq1f1b.plan.projection import A100, project  # noqa: E402

PROG = "reproduce_paper.py"
REPO = Path(__file__).resolve().parents[1]
JOB_RESULTS = REPO / "examples" / "slurm" / "job_results.py"
SPLITS = 4                  # k of the authors' scripts (--pipe-sp-splits 4)
CHUNKS = 2                  # V of the interleaved runs (the authors' VPP 2)


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


class UsageError(Exception):
    """Bad command line: one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def _setup(panel: Panel, seq_length: int, schedule: str, partition: str = "compute"
           ) -> TrainingSetup:
    seq1f1b = schedule.startswith("seq1f1b")
    return TrainingSetup(
        model=preset(panel.model), seq_length=seq_length, schedule=schedule, pp=panel.pp,
        microbatches=panel.microbatches, splits=SPLITS if seq1f1b else 1,
        chunks=CHUNKS if "interleaved" in schedule else 1, tp=panel.tp, dp=panel.dp,
        sequence_parallel=panel.tp > 1, distributed_optimizer=True,
        partition=partition if seq1f1b else "even")


def _cell(panel: Panel, seq_length: int, schedule: str) -> dict:
    """The keys every table row starts with."""
    return {"model": panel.model, "gpus": panel.gpus, "seq_length": seq_length,
            "schedule": schedule, "tp": panel.tp, "pp": panel.pp,
            "microbatches": panel.microbatches}


def memory_rows(gpu_memory_gib: float) -> list[dict]:
    rows = []
    for panel in PANELS:
        for seq_length in panel.seq_lengths:
            paper = PAPER_MEMORY_GB.get((panel.model, seq_length))
            for n, (_, schedule) in enumerate(SCHEDULES):
                setup = _setup(panel, seq_length, schedule)
                estimate = estimate_memory(setup)
                paper_value = paper[n] if paper else None
                rows.append({**_cell(panel, seq_length, schedule),
                             "splits": setup.splits, "chunks": setup.chunks,
                             "estimate_gb": estimate.peak_bytes / GIB,
                             "oom": not estimate.fits(gpu_memory_gib),
                             "paper_gb": None if paper_value in (None, OOM) else paper_value,
                             "paper_oom": None if paper_value is None else paper_value == OOM})
    return rows


def throughput_rows(gpu_memory_gib: float) -> list[dict]:
    rows = []
    for panel in PANELS:
        for seq_length in panel.seq_lengths:
            for _, schedule in SCHEDULES:
                setup = _setup(panel, seq_length, schedule)
                projection = project(setup, A100)
                rows.append({**_cell(panel, seq_length, schedule),
                             "splits": setup.splits, "chunks": setup.chunks,
                             "tflops_per_gpu": projection.tflops_per_gpu,
                             "tokens_per_s": projection.tokens_per_s,
                             "iteration_s": projection.iteration_s,
                             "bubble_ratio": projection.report.bubble_ratio,
                             "oom": not estimate_memory(setup).fits(gpu_memory_gib),
                             "paper_tflops": None})
    return rows


def ablation_rows() -> list[dict]:
    rows = []
    for panel in PANELS:
        for seq_length in panel.seq_lengths:
            for _, schedule in SCHEDULES[2:]:
                even = project(_setup(panel, seq_length, schedule, "even"), A100)
                balanced = project(_setup(panel, seq_length, schedule, "compute"), A100)
                rows.append({**_cell(panel, seq_length, schedule), "splits": SPLITS,
                             "even_spans": even.span_lengths,
                             "compute_spans": balanced.span_lengths,
                             "tflops_even": even.tflops_per_gpu,
                             "tflops_compute": balanced.tflops_per_gpu,
                             "gain": balanced.tflops_per_gpu / even.tflops_per_gpu - 1})
    return rows


# -- text ----------------------------------------------------------------------------------------
def _paper_names() -> dict[str, str]:
    return {registry_name: paper_name for paper_name, registry_name in SCHEDULES}


def _grid(rows: list[dict], value) -> list[str]:
    """One line per (model, seq_length), one column per schedule."""
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
                     + " | ".join(value(cells[s]) for s in names) + " |")
    return lines


def _memory_cell(row: dict) -> str:
    ours = OOM if row["oom"] else "fits"
    text = f"{row['estimate_gb']:.1f} {ours}"
    if row["paper_oom"] is None:
        return text
    paper = OOM if row["paper_oom"] else f"{row['paper_gb']:.2f}"
    mark = "" if row["paper_oom"] == row["oom"] else " (verdict differs)"
    return f"{text} / paper {paper}{mark}"


def print_tables(result: dict, gpu_memory_gib: float) -> None:
    print(f"(a) Peak memory per GPU, GiB (largest stage), OOM at {gpu_memory_gib:g} GiB: "
          "ours / the paper's")
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
    print()
    print("(b) Projected TFLOPS per GPU and tokens/s (simulator, A100 cost model; "
          "* = the memory estimate says OOM)")
    print("\n".join(_grid(result["throughput"], lambda r: f"{r['tflops_per_gpu']:.0f} TF "
                          f"{r['tokens_per_s']:.0f} tok/s{' *' if r['oom'] else ''}")))
    print("Cost model: " + "; ".join(A100.describe()))
    print("  B = 2 x F FLOPs; TP collectives per layer 4 forward + 4 backward, not overlapped; "
          "p2p hop = latency + span activations / link; DP: fp32 grad reduce-scatter + bf16 "
          "param all-gather once per iteration; no optimizer-step time; TFLOPS counted as the "
          "paper does (3 x forward FLOPs, embedding as a GEMM). The paper's TFLOPS are not in "
          "PAPER.md: no paper column.")
    print()
    print("(c) Partition ablation: projected TFLOPS per GPU, even vs computation-balanced spans")
    print("| model, GPUs | L | schedule | even spans | TFLOPS | compute spans | TFLOPS | gain |")
    print("|" + "---|" * 8)
    names = _paper_names()
    for r in result["ablation"]:
        print(f"| {r['model']}, {r['gpus']} | {r['seq_length'] // 1024}K | "
              f"{names[r['schedule']]} | {' '.join(map(str, r['even_spans']))} | "
              f"{r['tflops_even']:.1f} | {' '.join(map(str, r['compute_spans']))} | "
              f"{r['tflops_compute']:.1f} | {r['gain']:+.1%} |")


# -- the real sweep ------------------------------------------------------------------------------
def training_flags(panel: Panel, seq_length: int, schedule: str, train_iters: int) -> list[str]:
    """pretrain_gpt.py flags (megatron/training/arguments.py) of one cell, data flags aside."""
    setup = _setup(panel, seq_length, schedule)
    model = setup.model
    flags = ["--num-layers", model.num_layers, "--hidden-size", model.hidden_size,
             "--num-attention-heads", model.num_attention_heads, "--seq-length", seq_length,
             "--max-position-embeddings", seq_length, "--micro-batch-size", 1,
             "--global-batch-size", panel.microbatches * panel.dp,
             "--tensor-model-parallel-size", panel.tp,
             "--pipeline-model-parallel-size", panel.pp, "--pipeline-schedule", schedule]
    if setup.chunks > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage",
                  model.num_layers // (panel.pp * setup.chunks)]
    if setup.splits > 1:
        flags += ["--seq1f1b-splits", setup.splits, "--seq1f1b-partition", setup.partition]
    if panel.tp > 1:
        flags.append("--sequence-parallel")
    flags += ["--use-distributed-optimizer", "--bf16", "--position-embedding-type", "rope",
              "--untie-embeddings-and-output-weights", "--hidden-dropout", 0,
              "--attention-dropout", 0, "--init-method-std", 0.006, "--lr", 6e-5,
              "--min-lr", 6e-6, "--lr-decay-style", "cosine", "--weight-decay", 0.1,
              "--adam-beta1", 0.9, "--adam-beta2", 0.95, "--clip-grad", 1.0,
              "--train-iters", train_iters, "--log-interval", 1, "--eval-iters", 0]
    return [str(flag) for flag in flags]


def _job_name(panel: Panel, seq_length: int, schedule: str) -> str:
    return f"{panel.model}-{panel.gpus}gpu-{seq_length // 1024}k-{schedule}"


def _job_script(panel: Panel, seq_length: int, schedule: str, folder: Path,
                train_iters: int, time_limit: str) -> str:
    nodes = max(1, panel.gpus // A100.gpus_per_node)
    flags = " ".join(shlex.quote(f) for f in training_flags(panel, seq_length, schedule,
                                                            train_iters))
    cell = " ".join(f"{key}={value}"
                    for key, value in _full_cell(panel, seq_length, schedule).items())
    log = shlex.quote(str(folder / "train.log"))
    return f"""#!/bin/bash
#SBATCH --job-name={_job_name(panel, seq_length, schedule)}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={min(panel.gpus, A100.gpus_per_node)}
#SBATCH --gpus-per-node={min(panel.gpus, A100.gpus_per_node)}
#SBATCH --time={time_limit}
#SBATCH --output={folder}/slurm-%j.out
# Written by tools/reproduce_paper.py --launch. Partition and account: give them to sbatch
# (sbatch -p NAME ...). Needs VOCAB_FILE and MERGE_FILE (GPT-2 BPE, the paper's vocabulary);
# DATA_PATH (a preprocessed prefix) or, when unset, mock data.
set -u
: "${{VOCAB_FILE:?set VOCAB_FILE to the GPT-2 vocab.json}}"
: "${{MERGE_FILE:?set MERGE_FILE to the GPT-2 merges.txt}}"
PYTHON="${{PYTHON:-{REPO}/.venv/bin/python}}"
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
export MASTER_PORT="${{MASTER_PORT:-29500}}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
if [ -n "${{DATA_PATH:-}}" ]; then DATA=(--data-path "$DATA_PATH"); else DATA=(--mock-data); fi
srun --kill-on-bad-exit=1 "$PYTHON" {shlex.quote(str(REPO / "pretrain_gpt.py"))} {flags} "${{DATA[@]}}" \\
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \\
    2>&1 | tee {log}
rc=${{PIPESTATUS[0]}}
"$PYTHON" {shlex.quote(str(JOB_RESULTS))} summarize --log {log} --exit-code "$rc" {cell}
exit "$rc"
"""


def _full_cell(panel: Panel, seq_length: int, schedule: str) -> dict:
    setup = _setup(panel, seq_length, schedule)
    return {**_cell(panel, seq_length, schedule), "splits": setup.splits, "chunks": setup.chunks}


def launch(folder: Path, submit: bool, train_iters: int, time_limit: str) -> list[Path]:
    """Write one job per (panel, L, schedule) under `folder`; with `submit`, sbatch each and
    list them in folder/jobs.tsv (the format examples/slurm/job_results.py collect reads)."""
    jobs = []
    for panel in PANELS:
        for seq_length in panel.seq_lengths:
            for _, schedule in SCHEDULES:
                job = (folder / _job_name(panel, seq_length, schedule)).resolve()
                job.mkdir(parents=True, exist_ok=True)
                cell = _full_cell(panel, seq_length, schedule)
                (job / "cell.json").write_text(json.dumps(cell))
                script = job / "job.sbatch"
                script.write_text(_job_script(panel, seq_length, schedule, job, train_iters,
                                              time_limit))
                jobs.append((script, cell))
    if submit:
        lines = ["\t".join(["job_id", "output", *jobs[0][1]])]
        for script, cell in jobs:
            job_id = subprocess.run(["sbatch", "--parsable", str(script)], check=True,
                                    capture_output=True, text=True).stdout.strip()
            job_id = job_id.split(";")[0]
            lines.append("\t".join([job_id, str(script.parent / "slurm-%j.out"),
                                    *map(str, cell.values())]))
        (folder / "jobs.tsv").write_text("\n".join(lines) + "\n")
    return [script for script, _ in jobs]


def _job_results():
    """examples/slurm/job_results.py: the one parser of training logs and job summary lines."""
    spec = importlib.util.spec_from_file_location("job_results", JOB_RESULTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def collect(folder: Path) -> dict:
    """The memory and throughput tables from the jobs under `folder` (launch's layout).

    Each job's status and figures come from its summary line (job_results.py summarize, the
    job script's last step) or, for a job that never printed one (killed, still running), from
    its output as far as it got. Memory is the trainer's peak per stage (max_memory_reserved on a
    GPU, the largest stage, median over the iterations after the first), in GiB.
    """
    results = _job_results()
    memory, throughput = [], []
    for cell_file in sorted(folder.glob("*/cell.json")):
        cell = json.loads(cell_file.read_text())
        outputs = sorted(cell_file.parent.glob("slurm-*.out"))
        text = "\n".join(p.read_text(errors="replace") for p in outputs)
        summary = results.parse_summary(text)
        if summary is None:
            summary = ({"status": results.classify(text, None), **results.metrics(text)}
                       if text else {"status": "PENDING"})

        def number(key: str) -> Optional[float]:
            return float(summary[key]) if key in summary else None

        status = summary["status"]
        peak_mb, ms = number("peak_mem_mb"), number("ms_per_iteration")
        memory.append({**cell, "status": status, "oom": status == "OOM",
                       "measured_gb": peak_mb / 1024 if peak_mb is not None else None})
        throughput.append({**cell, "status": status, "oom": status == "OOM",
                           "iteration_s": ms / 1000 if ms is not None else None,
                           "tokens_per_s": number("tokens_per_s"),
                           "tflops_per_gpu": number("tflops_per_gpu")})
    return {"memory": memory, "throughput": throughput}


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GB",
                        help="device memory in GiB for the OOM verdicts (default 80)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--launch", metavar="DIR", help="write the sweep's Slurm jobs here")
    mode.add_argument("--collect", metavar="DIR", help="tables from the jobs' logs under DIR")
    parser.add_argument("--submit", action="store_true", help="with --launch: sbatch each job")
    parser.add_argument("--train-iters", type=int, default=10,
                        help="iterations per job (default 10; the first is not timed)")
    parser.add_argument("--time", default="00:30:00", help="#SBATCH --time of each job")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.submit and not args.launch:
            raise UsageError("--submit needs --launch DIR")
        if args.gpu_memory <= 0:
            raise UsageError("--gpu-memory must be positive")
        if args.train_iters < 2:
            raise UsageError("--train-iters must be >= 2 (the first iteration is not timed)")
        if args.launch:
            scripts = launch(Path(args.launch), args.submit, args.train_iters, args.time)
            print(f"wrote {len(scripts)} jobs under {args.launch}"
                  + (" and submitted them" if args.submit else
                     f"; submit with: for j in {args.launch}/*/job.sbatch; do sbatch $j; done"))
            return 0
        if args.collect:
            folder = Path(args.collect)
            if not folder.is_dir():
                raise UsageError(f"--collect: {folder} is not a directory")
            print(json.dumps(collect(folder), indent=None if args.json else 1))
            return 0
        result = {"memory": memory_rows(args.gpu_memory),
                  "throughput": throughput_rows(args.gpu_memory),
                  "ablation": ablation_rows()}
    except (UsageError, ScheduleError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, subprocess.CalledProcessError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print_tables(result, args.gpu_memory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
