"""Megatron-LM's own schedule tests, run against our schedule functions: the peer suite.

    python tools/megatron_schedule_tests.py --megatron-repo PATH [--schedules {ours,megatron}]

Runs tests/unit_tests/pipeline_parallel/test_schedules.py of a Megatron-LM checkout (tag
core_v0.16.1, the megatron-core this project pins) under torchrun, one process per rank (8 by
default: the tests lay out TP 2 x PP 4), on the CPU over gloo. `--schedules ours` puts seq1f1b and
seq1f1b-interleaved at k=1 into megatron-core's two slots (forward_backward_pipelining_without_
interleaving and ..._with_interleaving), every forward-only call checked against megatron's own
function in the same process (same losses, or the same exception type); `--schedules megatron`
runs the suite untouched, the baseline. A test passes when it passes on every rank.

Not part of `make test`: CI has no Megatron-LM checkout, and nothing of Megatron-LM is copied
here; the tests are read from the checkout. The tests also need pytest-mock and einops.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional

TOOLS = Path(__file__).resolve().parent
WORKER = TOOLS / "megatron_schedule_worker.py"
TEST_FILE = Path("tests/unit_tests/pipeline_parallel/test_schedules.py")
# What the tests import beyond this project's requirements: pytest-mock (the `mocker` fixture) and
# einops (megatron-core's HyperCommGrid, used by the explicit process-group tests).
TEST_DEPENDENCIES = {"pytest-mock": "pytest_mock", "einops": "einops"}
# gloo connects a group's pairs on first use, as NCCL creates its communicators lazily. The tests
# build some groups non-collectively (_populate_embedding_and_position_groups: each pipeline
# passes its own rank list, under the same group number on every rank): gloo's eager rendezvous
# mixes their store keys and mostly hangs; those groups are never used.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TORCH_GLOO_LAZY_INIT": "1"}


def merge_reports(reports: dict[int, Optional[dict]], world_size: int) -> dict[str, dict]:
    """Per test: `failed` if it failed on any rank (or a rank wrote no report), else `passed` if
    it passed on every rank, else `skipped`; the failing ranks, one detail line, and the calls
    compared with megatron's summed over ranks."""
    missing = [r for r in range(world_size) if reports.get(r) is None]
    names = sorted({name for report in reports.values() if report for name in report["tests"]})
    merged = {}
    for name in names:
        entries = {r: reports[r]["tests"].get(name) for r in range(world_size) if r not in missing}
        failed = sorted(set(missing) | {r for r, e in entries.items()
                                        if e is None or e["outcome"] == "failed"})
        outcomes = {e["outcome"] for e in entries.values() if e is not None}
        outcome = "failed" if failed else "passed" if outcomes == {"passed"} else "skipped"
        details = [e["detail"] for r, e in sorted(entries.items())
                   if e is not None and e["outcome"] == outcome and e["detail"]]
        if failed and not details:
            details = [f"rank {failed[0]} has no result for this test"]
        merged[name] = {"outcome": outcome, "failed_ranks": failed,
                        "detail": details[0] if details else "",
                        "compared": sum(e.get("compared", 0) for e in entries.values() if e)}
    return merged


def summary_line(merged: dict[str, dict]) -> str:
    counts = Counter(test["outcome"] for test in merged.values())
    return f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"


def render(merged: dict[str, dict], schedules: str) -> str:
    """One line per passed or failed test; skips grouped by test function and reason."""
    lines = []
    skips: Counter = Counter()
    for name, test in merged.items():
        short = name.split("::")[-1]
        if test["outcome"] == "skipped":
            skips[(short.split("[")[0], test["detail"])] += 1
            continue
        line = f"{test['outcome'].upper():7} {short}"
        if schedules == "ours":
            line += f"  ({test['compared']} calls on all ranks checked against megatron's)"
        if test["outcome"] == "failed":
            line += f"\n        ranks {test['failed_ranks']}: {test['detail']}"
        lines.append(line)
    lines += [f"SKIPPED {name} x{count}: {reason}" for (name, reason), count in skips.items()]
    return "\n".join(lines + [summary_line(merged)])


def _read_report(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-repo", required=True, type=Path, metavar="PATH",
                        help="a Megatron-LM checkout at tag core_v0.16.1")
    parser.add_argument("--schedules", choices=("ours", "megatron"), default="ours",
                        help="ours: seq1f1b / seq1f1b-interleaved at k=1 in megatron's slots; "
                             "megatron: the suite untouched (baseline)")
    parser.add_argument("--nproc", type=int, default=8,
                        help="torchrun processes (the tests need 8: TP 2 x PP 4)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression to select tests")
    parser.add_argument("--out", type=Path,
                        help="folder for each rank's log and report (default: a new temp folder)")
    parser.add_argument("--json", action="store_true", help="print the merged result as JSON")
    return parser


def check_setup(repo: Path) -> Optional[str]:
    """What stops the suite from running here, as one line, or None."""
    if not (repo / TEST_FILE).is_file():
        return f"--megatron-repo {repo}: no {TEST_FILE} there (a Megatron-LM checkout is needed)"
    missing = [package for package, module in TEST_DEPENDENCIES.items()
               if importlib.util.find_spec(module) is None]
    if missing:
        return (f"{' and '.join(missing)} not installed: Megatron-LM's test_schedules.py needs "
                f"them (pip install {' '.join(missing)})")
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_setup(args.megatron_repo)
    if problem is not None:
        print(f"megatron_schedule_tests.py: error: {problem}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="megatron-schedule-tests-"))
    out.mkdir(parents=True, exist_ok=True)
    repo = args.megatron_repo.resolve()
    pytest_args = [str(repo / TEST_FILE)] + (["-k", args.keyword] if args.keyword else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc), str(WORKER), str(repo), str(out), args.schedules, *pytest_args]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, **WORKER_ENV})
    (out / "torchrun.log").write_text(proc.stdout + proc.stderr)
    reports = {r: _read_report(out / f"rank{r}.json") for r in range(args.nproc)}
    merged = merge_reports(reports, args.nproc)
    if not merged:
        print(f"megatron_schedule_tests.py: error: no rank reported a test; see the logs in {out}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"schedules": args.schedules, "summary": summary_line(merged),
                          "logs": str(out), "tests": merged}, indent=1))
    else:
        print(f"Megatron-LM {TEST_FILE}, --schedules {args.schedules}, {args.nproc} ranks "
              f"(logs: {out})")
        print(render(merged, args.schedules))
    return 1 if any(test["outcome"] == "failed" for test in merged.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
