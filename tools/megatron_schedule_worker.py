"""One rank of tools/megatron_schedule_tests.py: Megatron-LM's schedule tests under pytest, on the
CPU over gloo, optionally with our schedule functions in megatron-core's slots.

    torchrun --nproc-per-node 8 tools/megatron_schedule_worker.py MEGATRON_REPO OUT_DIR
             {ours,megatron} TEST_FILE [PYTEST_ARGS...]

Megatron's tests expect one GPU per rank and NCCL. Here the CPU platform layer is active, their
`Utils.initialize_distributed` joins the torchrun world over gloo instead, and their conftest.py is
not loaded (it downloads test data and imports test utilities this suite does not need). With
`ours`, each slot of `SLOTS` holds a `CheckedSlot`: the tests call our function at k=1, and every
forward-only call is first run through megatron's own function on the same arguments and RNG
state, which must agree. Each rank writes its outcomes to OUT_DIR/rank<R>.json and its output to
OUT_DIR/rank<R>.log; the launcher merges them.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import schedules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seq1f1b import platform  # noqa: E402
from seq1f1b.runtime.forward_backward import (SpanSettings,  # noqa: E402
                                              get_forward_backward_func)

# megatron-core's slot -> the registry schedule put there; at k=1 each is megatron's schedule.
SLOTS = {"forward_backward_pipelining_without_interleaving": "seq1f1b",
         "forward_backward_pipelining_with_interleaving": "seq1f1b-interleaved"}
# Long enough for 8 processes on 2 cores, short enough that a rank stuck in a collective (another
# rank failed between two of them) ends the run instead of freezing it.
GROUP_TIMEOUT = timedelta(minutes=5)


def same_result(ours: Any, theirs: Any) -> bool:
    """Whether two forward-backward results are equal: the same nesting of lists, tuples and
    dicts, equal plain values, tensors equal in dtype, shape and every element."""
    if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
        return (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor)
                and ours.dtype == theirs.dtype and torch.equal(ours, theirs))
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(same_result(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, (list, tuple)) or isinstance(theirs, (list, tuple)):
        return (type(ours) is type(theirs) and len(ours) == len(theirs)
                and all(same_result(a, b) for a, b in zip(ours, theirs)))
    return ours == theirs


class CheckedSlot:
    """Our forward-backward function in one of megatron's slots, checked against megatron's own.

    A forward-only call runs megatron's function first, then ours from the same RNG state, and
    requires the same result, or an exception of the same type (the test then sees ours). A
    training call runs ours alone: running it twice would accumulate every gradient twice.
    `compared` counts the calls that were checked.
    """

    def __init__(self, name: str, ours: Callable, theirs: Callable) -> None:
        self.name = name
        self.ours = ours
        self.theirs = theirs
        self.compared = 0

    def __call__(self, **kwargs: Any) -> Any:
        if not kwargs.get("forward_only", False):
            return self.ours(**kwargs)
        rng = torch.get_rng_state()
        expected: Any = None
        refusal: Optional[Exception] = None
        try:
            expected = self.theirs(**kwargs)
        except Exception as err:  # noqa: BLE001 - any refusal of megatron's is part of the contract
            refusal = err
        torch.set_rng_state(rng)
        try:
            result = self.ours(**kwargs)
        except Exception as err:
            if refusal is None:
                raise
            if type(err) is not type(refusal):
                raise AssertionError(f"{self.name}: ours raised {type(err).__name__}, megatron's "
                                     f"{type(refusal).__name__} ({refusal})") from err
            self.compared += 1
            raise
        if refusal is not None:
            raise AssertionError(f"{self.name}: megatron's raised {type(refusal).__name__} "
                                 f"({refusal}), ours returned {result!r}")
        if not same_result(result, expected):
            raise AssertionError(f"{self.name}: ours returned {result!r}, megatron's {expected!r}")
        self.compared += 1
        return result


def install_slots(schedules: ModuleType) -> list[CheckedSlot]:
    """Put our k=1 functions, checked against megatron's, into `schedules`' slots."""
    slots = []
    for slot, name in SLOTS.items():
        settings = SpanSettings(splits=1, p2p_timeout_s=GROUP_TIMEOUT.total_seconds())
        checked = CheckedSlot(slot, get_forward_backward_func(name, settings),
                              getattr(schedules, slot))
        setattr(schedules, slot, checked)
        slots.append(checked)
    return slots


def use_gloo(utils: type) -> None:
    """Replace megatron's `Utils.initialize_distributed` (NCCL, `torch.cuda.set_device(rank %
    device_count)`) with a join of the torchrun world over gloo."""

    def initialize_distributed() -> None:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
            dist.barrier()
        utils.inited = True

    utils.initialize_distributed = staticmethod(initialize_distributed)


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


def main(argv: list[str]) -> int:
    repo, out, schedules_choice, pytest_args = Path(argv[0]), Path(argv[1]), argv[2], argv[3:]
    rank = int(os.environ["RANK"])
    log = open(out / f"rank{rank}.log", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    platform.activate()
    # Megatron's tests import their helpers as `tests.unit_tests...`: the checkout goes last on
    # the path, so the installed megatron-core (not the checkout's megatron/core) is the one run.
    sys.path.append(str(repo))
    from tests.unit_tests.test_utilities import Utils

    use_gloo(Utils)
    slots = install_slots(schedules) if schedules_choice == "ours" else []
    # --import-mode=append: see above. -c os.devnull: not the checkout's pytest settings, whose
    # addopts include -x (stop at the first failure). A test still running after the group
    # timeout has every thread's stack dumped into the rank's log.
    return pytest.main(
        ["-p", "no:cacheprovider", "--noconftest", "--import-mode=append",
         "--rootdir", str(repo), "-c", os.devnull, "-rA",
         "-o", f"faulthandler_timeout={GROUP_TIMEOUT.total_seconds():g}", *pytest_args],
        plugins=[RankReport(out / f"rank{rank}.json", rank, slots)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
