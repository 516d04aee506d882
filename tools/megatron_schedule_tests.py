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
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seq1f1b.megatron_suite.results import (TEST_FILE, check_setup,  # noqa: E402
                                            merge_reports, render, summary_line)

TOOLS = Path(__file__).resolve().parent
WORKER = TOOLS / "megatron_schedule_worker.py"
# gloo connects a group's pairs on first use, as NCCL creates its communicators lazily. The tests
# build some groups non-collectively (_populate_embedding_and_position_groups: each pipeline
# passes its own rank list, under the same group number on every rank): gloo's eager rendezvous
# mixes their store keys and mostly hangs; those groups are never used.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TORCH_GLOO_LAZY_INIT": "1"}


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
