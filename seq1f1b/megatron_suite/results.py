"""What tools/megatron_schedule_tests.py needs besides its command line: the Megatron-LM test file
and what it imports beyond this project's requirements (`check_setup`), and the merge and
rendering of the ranks' reports (seq1f1b.megatron_suite.rank_report)."""
from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from typing import Optional

TEST_FILE = Path("tests/unit_tests/pipeline_parallel/test_schedules.py")
# What the tests import beyond this project's requirements: pytest-mock (the `mocker` fixture) and
# einops (megatron-core's HyperCommGrid, used by the explicit process-group tests).
TEST_DEPENDENCIES = {"pytest-mock": "pytest_mock", "einops": "einops"}


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
