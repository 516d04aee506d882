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
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from seq1f1b.plan.actions import ScheduleError  # noqa: E402
from seq1f1b.plan.calibration import CalibrationError, read_device_check  # noqa: E402
from seq1f1b.plan import paper  # noqa: E402
from seq1f1b.plan.paper import (CHUNKS, OOM, REACH_LENGTHS, REACH_SPAN, SCHEDULES,  # noqa: E402
                                SPLITS, SWEPT_PANEL, Models, Sweep, ablation_rows,
                                agreeing_reserves, memory_rows, microbatch_rows, paper_memory,
                                reach_rows, sweeps, throughput_rows)
from seq1f1b.plan.projection import A100  # noqa: E402

PROG = "reproduce_paper.py"
REPO = Path(__file__).resolve().parents[1]
JOB_RESULTS = REPO / "examples" / "slurm" / "job_results.py"
SLURM_TIME = re.compile(r"^(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|UNLIMITED|INFINITE)$")
"""The time limits sbatch --time accepts."""
TRAIN_ITERS = 10
"""--launch's iterations per job when --train-iters is not given."""
TIME_LIMIT = "00:30:00"
"""--launch's sbatch --time when --time is not given."""


class UsageError(Exception):
    """Bad command line: one line on stderr, exit code 2."""


class SubmitError(Exception):
    """sbatch refused or failed: one line on stderr, exit code 1."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


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
    for panel in paper.PANELS:
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
    """One line per (panel, CP): the layout, then each run's reach (1F1B, Seq1F1B, Seq1F1B with
    the loss's backward at F)."""
    lines = [f"{'model':>6} {'GPUs':>4} {'CP':>2} {'TP':>2} {'PP':>2}  "
             f"{'1F1B: L, recompute, TFLOPS, tok/s':<40}  "
             f"{'Seq1F1B: L, k, recompute, TFLOPS, tok/s':<44}  "
             "Seq1F1B, --loss-backward-in-forward"]

    def reach(row: Optional[dict]) -> str:
        if row is None or row["tp"] is None:
            return "no layout (heads)"
        if row["seq_length"] is None:
            return f"< {REACH_LENGTHS[0] // 1024}K"
        k = f" k={row['splits']}" if row["schedule"] != "1f1b" else ""
        return (f"{row['seq_length'] // 1024}K{k} {row['recompute'] or 'none'} "
                f"{row['tflops_per_gpu']:.0f} TF {row['tokens_per_s']:.0f} tok/s")

    by_key = {(r["model"], r["gpus"], r["cp"], r["schedule"], r["loss_backward_in_forward"]): r
              for r in rows}
    for model, gpus, cp in dict.fromkeys((r["model"], r["gpus"], r["cp"]) for r in rows):
        one, seq, early = (by_key.get((model, gpus, cp, *run)) for run in paper.REACH_RUNS)
        tp = "-" if one["tp"] is None else one["tp"]
        pp = "-" if one["pp"] is None else one["pp"]
        lines.append(f"{model:>6} {gpus:>4} {cp:>2} {tp:>2} {pp:>2}  {reach(one):<40}  "
                     f"{reach(seq):<44}  {reach(early)}")
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
    for sweep in read_manifest(manifest):
        if not (folder / sweep["folder"] / "jobs.tsv").exists():
            continue                                     # not submitted
        for job in results.collect(folder / sweep["folder"]):
            runs.append(_run(sweep, job))
    if not runs:
        raise UsageError(f"--collect: no submitted job under {folder} "
                         f"(submit with {folder / SWEEP_FILE})")
    return runs


def read_manifest(manifest: Path) -> list[dict]:
    """The sweeps of a launch folder's sweeps.json, each checked against what --launch writes
    (Sweep.record(): its keys and their types), so a damaged or foreign file is refused in one
    line naming it instead of failing mid-collection."""
    try:
        entries = json.loads(manifest.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UsageError(f"--collect: {manifest} is not valid JSON ({err.msg}, line "
                         f"{err.lineno}): not written by --launch") from None
    except UnicodeDecodeError:
        raise UsageError(f"--collect: {manifest} is not UTF-8 text: not written by --launch") \
            from None
    expected = sweeps()[0].record()
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"--collect: {manifest} should be a non-empty list of sweeps, as "
                         f"--launch writes it")
    for number, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise UsageError(f"--collect: {manifest}: sweep {number} is not a JSON object")
        for key, value in expected.items():
            if not isinstance(entry.get(key), type(value)):
                raise UsageError(f"--collect: {manifest}: sweep {number} has no {key!r} "
                                 f"{type(value).__name__}: not written by --launch")
    return entries


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
               **paper_memory(r["model"], r["seq_length"], r["schedule"])} for r in tables]
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
    parser.add_argument("--train-iters", type=int,
                        help=f"with --launch: iterations per job (default {TRAIN_ITERS}; the "
                             "first is not timed)")
    parser.add_argument("--time",
                        help="with --launch: the jobs' time limit (sbatch --time; default "
                             f"{TIME_LIMIT})")
    parser.add_argument("sbatch_options", nargs="*", metavar="--SBATCH-OPTION=VALUE",
                        help="with --launch --submit, after --: sbatch options for every job "
                             "(e.g. -- --partition=gpu --account=me)")
    return parser


def _check_given(args: argparse.Namespace) -> None:
    """An empty --launch, --collect or --device-check (an unset shell variable) is refused, not
    taken as "not given": that would silently print the estimated tables instead. The --launch
    settings are refused without --launch, which alone reads them."""
    for flag in ("launch", "collect", "device_check"):
        if getattr(args, flag) == "":
            raise UsageError(f"--{flag.replace('_', '-')}: empty value; name the "
                             f"{'file' if flag == 'device_check' else 'folder'}")
    if not args.launch:
        for flag in ("train_iters", "time"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} only with --launch (the jobs' "
                                 f"setting)")


def _check(args: argparse.Namespace) -> None:
    _check_given(args)
    if (args.submit or args.sbatch_options) and not args.launch:
        raise UsageError("--submit and sbatch options need --launch DIR")
    if args.sbatch_options and not args.submit:
        raise UsageError(f"sbatch options without --submit: give them to {SWEEP_FILE} instead")
    for option in args.sbatch_options:
        if not (option.startswith("--") and "=" in option):
            raise UsageError(f"sbatch option {option!r}: give it as --name=value after --")
    if not math.isfinite(args.gpu_memory) or args.gpu_memory <= 0:
        raise UsageError(f"--gpu-memory must be a positive number of GiB, got "
                         f"{args.gpu_memory:g}")
    if args.train_iters is not None and args.train_iters < 2:
        raise UsageError("--train-iters must be >= 2 (the first iteration is not timed)")
    if args.device_check and (args.launch or args.collect):
        raise UsageError("--device-check applies to the estimated tables, not to --launch or "
                         "--collect")
    if args.collect and not Path(args.collect).is_dir():
        raise UsageError(f"--collect: {args.collect} is not a directory")
    if args.launch:
        if args.time is not None and not SLURM_TIME.match(args.time):
            raise UsageError(f"--time {args.time!r} is not a Slurm time limit (MINUTES, "
                             f"MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS[:MINUTES"
                             f"[:SECONDS]] or UNLIMITED)")
        from seq1f1b.writable import check_output_dir
        try:
            check_output_dir(args.launch, "--launch")
        except ValueError as err:
            raise UsageError(str(err)) from None


def _launch(args: argparse.Namespace) -> None:
    script = launch(Path(args.launch),
                    TRAIN_ITERS if args.train_iters is None else args.train_iters,
                    TIME_LIMIT if args.time is None else args.time)
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
