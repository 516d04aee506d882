#!/usr/bin/env python3
"""What a Slurm training job came to, as one line and as one row of a sweep's table.

    job_results.py summarize --log FILE --exit-code N [KEY=VALUE ...]
        the job's summary line (printed by the sbatch scripts as their last line):
        SEQ1F1B_RESULT status=OK exit=0 KEY=VALUE ... iterations=10 lm_loss=... ms_per_iteration=...
    job_results.py collect DIR
        DIR/results.csv from the jobs sweep.sh submitted (DIR/jobs.tsv): one row per job, OOM and
        failed jobs included; a job that printed no summary (killed at its time limit, never
        started) gets its status from its output file, or PENDING when there is none.

Status: OK (exit 0), OOM (non-zero exit and an out-of-memory message in the log: torch's CUDA or
CPU allocator, Python's MemoryError, C++'s std::bad_alloc (a library thread's allocation, such
as a communication buffer), ENOMEM's "Cannot allocate memory" (mmap, a thread's stack, a fork),
Slurm's memory-limit kill; or a SIGKILL short of the time limit, exit 137 or torchrun's "Signal
9": the host's OOM killer, which leaves no message), TIMEOUT (killed at the time limit), FAILED
(any other non-zero exit), MISSING (summarize: the log file does not exist, whatever the exit
code). Only the standard library: runs with any python3.
"""
from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

MARKER = "SEQ1F1B_RESULT"
OOM_MESSAGES = ("CUDA out of memory", "OutOfMemoryError", "DefaultCPUAllocator: can't allocate",
                "DefaultCPUAllocator: not enough memory", "MemoryError", "std::bad_alloc",
                "Cannot allocate memory", "Exceeded job memory limit", "exceeded memory limit",
                "oom-kill", "Out Of Memory")
TIMEOUT_MESSAGES = ("DUE TO TIME LIMIT",)
SIGKILL_EXITS = (137, -9)          # 128 + SIGKILL from a shell or srun, -9 from Python's wait
SIGKILL_MESSAGES = ("Signal 9 (SIGKILL)", "exitcode  : -9")   # torchrun's report of a rank
ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|")
FIELDS = {"lm_loss": re.compile(r"\| lm loss: ([0-9.eE+-]+) \|"),
          "ms_per_iteration": re.compile(r"\| elapsed time per iteration \(ms\): ([0-9.]+) \|"),
          "tokens_per_s": re.compile(r"\| tokens/s: ([0-9.]+) \|"),
          "tflops_per_gpu": re.compile(r"\| TFLOPS/GPU: ([0-9.eE+-]+) \|"),
          "peak_mem_mb": re.compile(r"\| peak mem per stage \([^)]*\): ([0-9., ]+) \|")}
METRICS = ("iterations", "train_iters", "first_lm_loss", "lm_loss", "ms_per_iteration",
           "tokens_per_s", "tflops_per_gpu", "peak_mem_mb")


def classify(log: str, exit_code: Optional[int]) -> str:
    """OK / OOM / TIMEOUT / FAILED from the exit code and the log (exit code None: unknown)."""
    if exit_code == 0:
        return "OK"
    if any(message in log for message in OOM_MESSAGES):
        return "OOM"
    if any(message in log for message in TIMEOUT_MESSAGES):
        return "TIMEOUT"
    if exit_code in SIGKILL_EXITS or any(message in log for message in SIGKILL_MESSAGES):
        return "OOM"      # killed with no time limit reached: the host's OOM killer
    return "FAILED"


def metrics(log: str) -> dict[str, str]:
    """Figures of the training log: iterations reached, first and last loss, and the median
    time, throughput and peak memory (largest stage) over the logged iterations after the
    first (the first includes warm-up), or the first when it is the only one."""
    lines = [line for line in log.splitlines() if ITERATION_LINE.search(line)]
    if not lines:
        return {}
    values: dict[str, list[float]] = {name: [] for name in FIELDS}
    for line in lines:
        for name, pattern in FIELDS.items():
            found = pattern.search(line)
            if found:
                numbers = [float(x) for x in found.group(1).replace(",", " ").split()]
                values[name].append(max(numbers))
    iteration, total = ITERATION_LINE.search(lines[-1]).groups()
    result = {"iterations": iteration, "train_iters": total}
    if values["lm_loss"]:
        result["first_lm_loss"] = f"{values['lm_loss'][0]:.6E}"
        result["lm_loss"] = f"{values['lm_loss'][-1]:.6E}"
    for name in ("ms_per_iteration", "tokens_per_s", "tflops_per_gpu", "peak_mem_mb"):
        steady = values[name][1:] or values[name]
        if steady:
            result[name] = f"{statistics.median(steady):.6g}"
    return result


def summary_line(log: Optional[str], exit_code: int, cell: dict[str, str]) -> str:
    """The summary of a job whose captured output is `log` (None: the file is missing)."""
    status = "MISSING" if log is None else classify(log, exit_code)
    fields = {"status": status, "exit": str(exit_code), **cell, **metrics(log or "")}
    return " ".join([MARKER] + [f"{key}={value}" for key, value in fields.items()])


def parse_summary(text: str) -> Optional[dict[str, str]]:
    """The last summary line in `text` as a dict, or None."""
    found = None
    for line in text.splitlines():
        if line.startswith(MARKER + " "):
            found = dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
    return found


def collect(folder: Path) -> list[dict[str, str]]:
    """One row per job listed in folder/jobs.tsv (header: job_id, output, then the cell)."""
    with open(folder / "jobs.tsv", newline="") as handle:
        jobs = list(csv.DictReader(handle, delimiter="\t"))
    rows = []
    for job in jobs:
        output = Path(job["output"].replace("%j", job["job_id"]))
        text = output.read_text(errors="replace") if output.exists() else ""
        row = {key: value for key, value in job.items() if key != "output"}
        summary = parse_summary(text)
        if summary is not None:
            row.update(summary)
        else:
            row.update(status=classify(text, None) if text else "PENDING", exit="",
                       **metrics(text))
        row["log"] = str(output)
        rows.append(row)
    return rows


def write_csv(rows: list[dict[str, str]], path: Path) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def _cell(items: list[str]) -> dict[str, str]:
    cell = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or " " in item:
            raise ValueError(f"cell field {item!r} is not KEY=VALUE without spaces")
        cell[key] = value
    return cell


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="job_results.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    summarize = commands.add_parser("summarize", help="the summary line of one job")
    summarize.add_argument("--log", required=True, help="the job's captured training output")
    summarize.add_argument("--exit-code", type=int, required=True, help="the launcher's exit code")
    summarize.add_argument("cell", nargs="*", help="KEY=VALUE fields naming the job's settings")
    gather = commands.add_parser("collect", help="results.csv of a sweep folder")
    gather.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "summarize":
            log = Path(args.log).read_text(errors="replace") if Path(args.log).exists() else None
            print(summary_line(log, args.exit_code, _cell(args.cell)))
            return 0
        if not (args.folder / "jobs.tsv").exists():
            raise ValueError(f"{args.folder}/jobs.tsv not found: not a sweep folder")
        rows = collect(args.folder)
        write_csv(rows, args.folder / "results.csv")
        for row in rows:
            print(" ".join(f"{key}={value}" for key, value in row.items() if key != "log"))
        return 0
    except ValueError as err:
        print(f"job_results.py: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
