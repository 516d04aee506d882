"""A launch that never ends fails at run_cases' timeout with every rank's stacks in the error,
the only text CI keeps of it (a hang at the world-4 equivalence launch once left none)."""
import re

import pytest

from launch import run_cases


def test_a_stuck_launch_fails_with_each_ranks_stacks():
    with pytest.raises(RuntimeError) as failed:
        run_cases(2, "stuck_worker.py", [{}], timeout_s=40)
    error = str(failed.value)
    assert error.startswith("torchrun x2 still running after 40 s; every process's stacks:")
    frames = re.findall(r'File "[^"]*stuck_worker\.py", line \d+ in (\w+)', error)
    assert {"wait_in_barrier", "sleep_forever"} <= set(frames), error[-3000:]
