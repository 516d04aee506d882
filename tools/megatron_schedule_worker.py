"""One rank of tools/megatron_schedule_tests.py: Megatron-LM's schedule tests under pytest, on the
CPU over gloo, optionally with our schedule functions in megatron-core's slots.

    torchrun --nproc-per-node 8 tools/megatron_schedule_worker.py MEGATRON_REPO OUT_DIR
             {ours,megatron} TEST_FILE [PYTEST_ARGS...]

Megatron's tests expect one GPU per rank and NCCL. Here the CPU platform layer is active, their
`Utils.initialize_distributed` joins the torchrun world over gloo instead, and their conftest.py is
not loaded (it downloads test data and imports test utilities this suite does not need). With
`ours`, each slot of `SLOTS` holds a `CheckedSlot` (seq1f1b/megatron_suite/slots.py): the tests call our function at k=1, and every
forward-only call is first run through megatron's own function on the same arguments and RNG
state, which must agree. Each rank writes its outcomes to OUT_DIR/rank<R>.json and its output to
OUT_DIR/rank<R>.log; the launcher merges them.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.pipeline_parallel import schedules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seq1f1b import platform  # noqa: E402
from seq1f1b.megatron_suite.rank_report import RankReport  # noqa: E402
from seq1f1b.megatron_suite.slots import GROUP_TIMEOUT, install_slots, use_gloo  # noqa: E402


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
