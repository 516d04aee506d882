"""kernel_time.summarize_trace on hand-made chrome traces: kernel time, busy time (overlaps
counted once), the span first kernel to last, and the kernels that took the most."""
import json

import pytest

from seq1f1b.device_checks.kernel_time import summarize_trace


def _trace(tmp_path, events):
    path = tmp_path / "host_rank0.1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_busy_time_counts_overlapping_kernels_once_and_gaps_not_at_all(tmp_path):
    events = [_kernel("gemm", 0, 100), _kernel("gemm", 50, 100),      # overlap: busy 0-150
              _kernel("softmax", 300, 50),                              # gap 150-300
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000}]
    summary = summarize_trace(_trace(tmp_path, events), iterations=2)
    assert summary["kernels_per_iteration"] == 1.5
    assert summary["kernel_ms_per_iteration"] == pytest.approx(250 / 2e3)
    assert summary["busy_ms_per_iteration"] == pytest.approx(200 / 2e3)
    assert summary["span_ms_per_iteration"] == pytest.approx(350 / 2e3)
    assert summary["busy_fraction"] == pytest.approx(200 / 350)
    assert list(summary["top_kernels_ms_per_iteration"]) == ["gemm", "softmax"]
    assert summary["top_kernels_ms_per_iteration"]["gemm"] == pytest.approx(0.1)


def test_a_trace_without_kernels_says_so(tmp_path):
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10}]
    assert "no GPU kernels" in summarize_trace(_trace(tmp_path, events), 1)["skipped"]
