"""The fit partition: span costs fitted to measured F and B times, and cuts balanced in time."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.costs import ModelConfig
from seq1f1b.plan.partition import imbalance, partition, span_bounds
from seq1f1b.plan.span_fit import (OpFit, SpanTiming, fit_span_times, read_span_timings)

REPO = Path(__file__).resolve().parents[2]
# A CPU-like machine: F mostly per-token work, B dominated by the attention backward.
FORWARD, BACKWARD = OpFit(2e-4, 4e-8), OpFit(1e-4, 3e-6)


def _measure(lengths):
    return [SpanTiming(start, end, FORWARD.seconds(start, end), BACKWARD.seconds(start, end))
            for start, end in span_bounds(lengths)]


def test_fit_recovers_the_costs_of_the_spans_it_measured():
    fit = fit_span_times(_measure([264, 258, 254, 248]))
    for op, truth in ((fit.forward, FORWARD), (fit.backward, BACKWARD)):
        assert op.per_token == pytest.approx(truth.per_token, rel=1e-6)
        assert op.per_pair == pytest.approx(truth.per_pair, rel=1e-6)
    assert fit.worst_error < 1e-9 and fit.samples == 4


def test_fit_partition_balances_time_where_the_flop_balance_does_not():
    model = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16)
    compute = partition(1024, 4, "compute", model)
    fit = fit_span_times(_measure(compute))
    fitted = partition(1024, 4, "fit", fit=fit)

    def seconds(lengths):
        return [FORWARD.seconds(s, e) + BACKWARD.seconds(s, e) for s, e in span_bounds(lengths)]

    assert imbalance(seconds(compute)) > 1.5
    assert imbalance(seconds(fitted)) < 1.02
    assert sum(fitted) == 1024 and fitted == sorted(fitted, reverse=True)


def test_a_coefficient_the_data_makes_negative_is_dropped():
    # Times that fall as spans see more keys (noise, or a cache warming up): no negative cost.
    falling = [SpanTiming(s, e, 0.4 - 0.1 * j, 0.3) for j, (s, e) in
               enumerate(span_bounds([256] * 4))]
    fit = fit_span_times(falling)
    assert fit.forward.per_pair == 0 and fit.forward.per_token > 0
    assert partition(1024, 4, "fit", fit=fit) == [256] * 4


@pytest.mark.parametrize("timings, needle", [
    ([SpanTiming(0, 8, 1.0, 2.0)], "at least 2"),
    ([SpanTiming(0, 8, 1.0, 2.0), SpanTiming(8, 8, 1.0, 2.0)], "no tokens"),
    ([SpanTiming(0, 8, 1.0, 2.0), SpanTiming(8, 16, 0.0, 2.0)], "no positive time"),
])
def test_bad_timings_are_refused(timings, needle):
    with pytest.raises(ScheduleError, match=needle):
        fit_span_times(timings)


def test_timings_are_read_from_any_json_holding_span_records(tmp_path):
    path = tmp_path / "benchmark.json"
    spans = [vars(t) for t in _measure([10, 6])]
    path.write_text(json.dumps({"runs": [{"schedule": "seq1f1b", "spans": spans}]}))
    assert read_span_timings(path) == _measure([10, 6])
    (tmp_path / "empty.json").write_text("{}")
    for name, needle in (("empty.json", "no measured spans"), ("missing.json", "not a readable")):
        with pytest.raises(ScheduleError, match=f"--calibration .*{name}: {needle}"):
            read_span_timings(tmp_path / name)


@pytest.mark.parametrize("extra, needle", [
    ([], "needs --calibration"),
    (["--calibration", "{tmp}/cal.json", "--method", "even"], "read by the fit method"),
])
def test_plan_cli_fit_errors_are_one_line(tmp_path, extra, needle):
    (tmp_path / "cal.json").write_text(json.dumps({"spans": [vars(t) for t in _measure([8, 8])]}))
    argv = ["partition", "--seq-length", "64", "--splits", "4", "--method", "fit"]
    argv += [a.replace("{tmp}", str(tmp_path)) for a in extra]
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), *argv],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_plan_cli_fit_prints_the_fit_and_its_balance(tmp_path):
    (tmp_path / "cal.json").write_text(json.dumps(
        {"spans": [vars(t) for t in _measure([300, 260, 240, 224])]}))
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), "partition",
                           "--seq-length", "1024", "--splits", "4", "--method", "fit",
                           "--calibration", str(tmp_path / "cal.json"), "--json"],
                          capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    assert sum(out["spans"]) == 1024 and out["time_imbalance"] < 1.02


def test_the_runs_fit_cut_keeps_the_span_alignment(monkeypatch):
    """calibrate_fit (the trainer's and the benchmark's re-cut after the measured iterations)
    cuts with the run's alignment: a fit whose per-pair cost shortens the later spans gives
    44 29 23 of 96 tokens alone and 40 32 24 with --seq1f1b-span-alignment 8."""
    from types import SimpleNamespace

    from seq1f1b.plan.registry import build
    from seq1f1b.runtime import traced_iterations
    fit = SimpleNamespace(per_token=1.0, per_pair=0.02)
    monkeypatch.setattr(traced_iterations, "gather_pipeline_actions", lambda traces: [])
    monkeypatch.setattr(traced_iterations, "span_timings", lambda *args: [])
    monkeypatch.setattr(traced_iterations, "fit_span_times", lambda timings: fit)
    schedule = build("seq1f1b", 2, 2, 3, 1)
    plain, _ = traced_iterations.calibrate_fit(schedule, [SimpleNamespace(span_bounds=())], 96)
    aligned, _ = traced_iterations.calibrate_fit(schedule, [SimpleNamespace(span_bounds=())], 96,
                                                 align=8)
    assert (plain, aligned) == ((44, 29, 23), (40, 32, 24))
