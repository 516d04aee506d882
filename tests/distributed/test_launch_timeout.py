"""A launch that never ends fails at run_cases' timeout with every rank's stacks in the error,
the only text CI keeps of it (a hang at the world-4 equivalence launch once left none)."""
import re
import time

import pytest

from launch import run_cases
from stuck_worker import ORPHAN_SECONDS


def test_a_stuck_launch_fails_with_each_ranks_stacks():
    """Also when a process outside the launch's tree holds its output (an orphan of rank 1's):
    run_cases kills it rather than reading until it ends."""
    started = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        run_cases(2, "stuck_worker.py", [{}], timeout_s=40)
    assert time.monotonic() - started < ORPHAN_SECONDS / 2
    error = str(failed.value)
    assert error.startswith("torchrun x2 still running after 40 s; every process's stacks:")
    frames = re.findall(r'File "[^"]*stuck_worker\.py", line \d+ in (\w+)', error)
    assert {"wait_in_barrier", "sleep_forever"} <= set(frames), error[-3000:]
