"""One rank's outcomes of Megatron-LM's schedule tests (a pytest plugin), written as JSON for
tools/megatron_schedule_tests.py to merge (seq1f1b.megatron_suite.results)."""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from seq1f1b.megatron_suite.slots import CheckedSlot


def _one_line(report) -> str:
    """A failure's exception line or a skip's reason."""
    if isinstance(report.longrepr, tuple):          # a skip: (file, line, reason)
        return report.longrepr[2]
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    return text.strip().splitlines()[0] if text.strip() else ""


class RankReport:
    """pytest plugin: each test's outcome on this rank, written as JSON when the session ends."""

    def __init__(self, path: Path, rank: int, slots: list[CheckedSlot]) -> None:
        self.path = path
        self.rank = rank
        self.slots = slots
        self.tests: dict[str, dict] = {}
        self._compared = 0

    def pytest_runtest_logreport(self, report) -> None:
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "detail": ""})
        if report.failed or (report.skipped and entry["outcome"] == "passed"):
            entry["outcome"] = "failed" if report.failed else "skipped"
            entry["detail"] = _one_line(report)
        if report.when == "teardown":
            total = sum(slot.compared for slot in self.slots)
            entry["compared"] = total - self._compared
            self._compared = total

    def pytest_sessionfinish(self) -> None:
        self.path.write_text(json.dumps({"rank": self.rank, "tests": self.tests}))
        if dist.is_initialized():  # what megatron's conftest does at the end of its session
            dist.barrier()
            dist.destroy_process_group()
