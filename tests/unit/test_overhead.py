"""The per-span Python micro-benchmark (seq1f1b/runtime_overhead.py, tools/span_overhead.py):
it runs and reports what it says; its times are printed, never asserted."""
import subprocess
import sys
from pathlib import Path

import pytest

from seq1f1b import runtime_overhead as overhead

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("megatron_world")
def test_executor_cost_counts_the_programs_actions():
    cost = overhead.executor_cost("seq1f1b", microbatches=2, splits=2, repeats=1)
    assert cost.actions == 2 * 2 * 2                     # F and B of each span of each micro-batch
    assert cost.wall_us > 0 and cost.cpu_us > 0


@pytest.mark.usefixtures("megatron_world")
def test_shim_cost_times_each_call_with_and_without_the_mode():
    costs = overhead.shim_cost(calls=200, repeats=1)
    assert set(costs) == {"x.add(x)", "torch.empty(4, device=...)", "x.view(2, 2)"}
    assert all(shimmed > 0 and bare > 0 for shimmed, bare in costs.values())


def test_the_tool_refuses_a_bad_count_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "span_overhead.py"),
                           "--splits", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["--splits must be >= 1"]
