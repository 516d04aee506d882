"""seq1f1b.plan.calibration: device_check's span times back to the efficiencies that produced
them, its allocator peaks to the reserve the OOM verdicts apply, and its misuse refused by name
(also through reproduce_paper.py and plan.py)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from seq1f1b.plan import paper
from seq1f1b.plan.calibration import (CalibrationError, fit_efficiencies, peak_tflops,
                                      read_device_check)
from seq1f1b.plan.costs import layer_flops, logits_flops, preset
from seq1f1b.plan.memory import GIB, TrainingSetup, estimate_memory
from seq1f1b.plan.partition import partition, span_bounds
from seq1f1b.plan.projection import A100

REPO = Path(__file__).resolve().parents[2]
PEAK = 989e12


def _spans(gemm: float, attention: float, lengths=(32768, 65536), layers=8) -> list[dict]:
    """device_check's spans of a 7B-shaped stage, timed as a device with these efficiencies
    would run them under the simulator's model (B = 2 x F)."""
    model = preset("7b")
    spans = []
    for length in lengths:
        for start, end in span_bounds(partition(length, 4, "compute", model)):
            flops = (layer_flops(model, end - start, end).scaled(layers)
                     + logits_flops(model, end - start))
            forward = flops.linear / (PEAK * gemm) + flops.attention / (PEAK * attention)
            spans.append({"forward_linear_flops": flops.linear,
                          "forward_attention_flops": flops.attention,
                          "forward_s": forward, "backward_s": 2 * forward})
    return spans


def _device_check(folder: Path, spans: list[dict], ratios=(1.05, 1.2, 1.1), cuda=True,
                  device="NVIDIA H200") -> Path:
    """A device_check.json with these spans and reserved/allocated ratios (32K run, 64K run,
    GPipe run)."""
    runs = [{"seq_length": 32768, "spans": spans[:4],
             "memory": {"reserved_over_allocated": ratios[0]}},
            {"seq_length": 65536, "spans": spans[4:],
             "memory": {"reserved_over_allocated": ratios[1]}}]
    environment = {"cuda": cuda, "device": device} if cuda else {"cuda": False}
    path = folder / "device_check.json"
    path.write_text(json.dumps({"environment": environment, "stage": runs, "held_microbatches": {
        "memory": {"reserved_over_allocated": ratios[2]}}}))
    return path


def test_the_fit_recovers_the_efficiencies_that_timed_the_spans():
    gemm, attention, worst = fit_efficiencies(_spans(0.62, 0.41), PEAK)
    assert gemm == pytest.approx(0.62, rel=1e-9)
    assert attention == pytest.approx(0.41, rel=1e-9)
    assert worst < 1e-9


def test_the_fit_reports_how_far_noisy_times_are_from_the_model():
    spans = _spans(0.6, 0.5)
    spans[0]["forward_s"] *= 1.1
    gemm, attention, worst = fit_efficiencies(spans, PEAK)
    assert gemm == pytest.approx(0.6, rel=0.05) and attention == pytest.approx(0.5, rel=0.05)
    assert 0.01 < worst < 0.11


def test_times_that_one_rate_cannot_explain_are_refused():
    spans = _spans(0.6, 0.5)
    for span in spans:              # time falls as attention grows: no positive rates fit
        span["forward_s"] = span["backward_s"] = 1e-3 * span["forward_linear_flops"] / (
            span["forward_attention_flops"] + span["forward_linear_flops"])
    with pytest.raises(ValueError, match="do not separate"):
        fit_efficiencies(spans, PEAK)


def test_a_device_check_file_gives_efficiencies_and_the_largest_reserve(tmp_path):
    calibration = read_device_check(_device_check(tmp_path, _spans(0.55, 0.45)))
    assert calibration.device == "NVIDIA H200" and calibration.peak_tflops == 989.0
    assert calibration.gemm_efficiency == pytest.approx(0.55)
    assert calibration.attention_efficiency == pytest.approx(0.45)
    assert calibration.reserve_ratio == 1.2
    held = read_device_check(_device_check(tmp_path, _spans(0.55, 0.45), (1.05, 1.2, 1.3)))
    assert held.reserve_ratio == 1.3          # the GPipe run's counts too
    device = calibration.device_model(A100)
    assert (device.name, device.peak_tflops) == (A100.name, A100.peak_tflops)
    assert (device.gemm.saturated, device.attention.saturated) == (0.55, 0.45)
    assert device.gemm.source == device.attention.source == \
        f"device_check {tmp_path / 'device_check.json'}"
    assert (device.span_fixed, device.nvlink, device.infiniband) == \
        (A100.span_fixed, A100.nvlink, A100.infiniband)


def test_peaks_by_device_name():
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("Tesla T4") is None


@pytest.mark.parametrize("change, message", [
    (lambda p: p.write_text("{"), "not a device_check.json"),
    (lambda p: p.unlink(), "not a device_check.json"),
    (lambda p: _device_check(p.parent, _spans(0.6, 0.5), cuda=False), "without a GPU"),
    (lambda p: _device_check(p.parent, _spans(0.6, 0.5), device="Tesla T4"), "unknown bf16 peak"),
    (lambda p: p.write_text(json.dumps({"environment": {"cuda": True, "device": "H200"},
                                        "stage": [{"skipped": "out of time"}]})), "no stage run"),
    (lambda p: _device_check(p.parent, [{"forward_s": 1.0, "backward_s": 2.0}] * 8),
     "no 'forward_linear_flops'"),
])
def test_unusable_files_are_refused_naming_the_file(tmp_path, change, message):
    path = _device_check(tmp_path, _spans(0.6, 0.5))
    change(path)
    with pytest.raises(CalibrationError, match=message) as error:
        read_device_check(path)
    assert str(path) in str(error.value)


def test_the_reserve_scales_what_the_allocator_holds_not_the_fixed_overhead():
    estimate = estimate_memory(TrainingSetup(model=preset("7b"), seq_length=131072,
                                             schedule="1f1b", pp=4, microbatches=32, tp=8,
                                             sequence_parallel=True, distributed_optimizer=True))
    overhead = estimate.setup.overhead_gib * GIB
    assert estimate.reserved_peak_bytes(1.0) == estimate.peak_bytes
    assert estimate.reserved_peak_bytes(1.1) == pytest.approx(
        (estimate.peak_bytes - overhead) * 1.1 + overhead)
    limit = estimate.peak_bytes * 1.05 / GIB
    assert estimate.fits(limit) and not estimate.fits(limit, 1.1)


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def _reproduce_paper(monkeypatch):
    """tools/reproduce_paper.py as a module, with one panel and one length (a quick run)."""
    spec = importlib.util.spec_from_file_location("reproduce_paper_calibrated",
                                                  REPO / "tools" / "reproduce_paper.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)      # its dataclasses look it up
    spec.loader.exec_module(module)
    monkeypatch.setattr(paper, "PANELS", (paper.Panel("7b", 32, tp=8, pp=4, microbatches=8,
                                                      seq_lengths=(65536,), why="test"),))
    return module


def test_reproduce_paper_judges_reserved_bytes_and_uses_the_measured_rates(
        tmp_path, monkeypatch, capsys):
    rp = _reproduce_paper(monkeypatch)
    path = str(_device_check(tmp_path, _spans(0.7, 0.35), ratios=(1.1, 1.6, 1.0)))

    def run(*args: str) -> str:
        assert rp.main(list(args)) == 0
        return capsys.readouterr().out

    plain, calibrated = (json.loads(run("--json", *more)) for more in ((), ("--device-check",
                                                                          path)))
    for before, after in zip(plain["memory"], calibrated["memory"]):
        assert before["estimate_gb"] == after["estimate_gb"] and before["reserved_gb"] is None
        assert after["reserved_gb"] > after["estimate_gb"]
        assert after["oom"] == (after["reserved_gb"] > A100.memory_gib)
    assert sum(r["oom"] for r in calibrated["memory"]) > sum(r["oom"] for r in plain["memory"])
    assert "calibration" not in plain and calibrated["calibration"]["reserve_ratio"] == 1.6
    assert any(a["tflops_per_gpu"] != b["tflops_per_gpu"]
               for a, b in zip(plain["throughput"], calibrated["throughput"]))
    text = run("--device-check", path)
    assert f"gemm: saturated 0.7, half_tokens 1024, width 512 [device_check {path}]" in text
    assert f"attention: saturated 0.35, half_rows 8192, half_loop 600 [device_check {path}]" \
        in text
    assert "allocated x 1.600 measured by device_check" in text


def test_the_tools_refuse_a_bad_device_check_in_one_line(tmp_path):
    missing = str(tmp_path / "nothing.json")
    for args in (["tools/reproduce_paper.py", "--device-check", missing],
                 ["tools/plan.py", "memory", "--schedule", "seq1f1b", "--pp", "2",
                  "--microbatches", "2", "--model", "7b", "--seq-length", "4096",
                  "--device-check", missing]):
        proc = _tool(*args)
        assert proc.returncode == 2 and proc.stdout == ""
        assert len(proc.stderr.strip().splitlines()) == 1 and missing in proc.stderr
    proc = _tool("tools/reproduce_paper.py", "--collect", str(tmp_path), "--device-check",
                 missing)
    assert proc.returncode == 2 and "--device-check applies to the estimated tables" in proc.stderr


def test_plan_memory_prints_the_reserved_peak(tmp_path):
    path = _device_check(tmp_path, _spans(0.6, 0.5), ratios=(1.0, 1.5, 1.2))
    args = ["tools/plan.py", "memory", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8",
            "--model", "7b", "--seq-length", "65536", "--tp", "8", "--sequence-parallel"]
    plain = json.loads(_tool(*args, "--json").stdout)
    calibrated = json.loads(_tool(*args, "--json", "--device-check", str(path)).stdout)
    assert plain["reserve_ratio"] == 1.0 and calibrated["reserve_ratio"] == 1.5
    assert calibrated["reserved_peak_bytes"] > plain["reserved_peak_bytes"] == plain["peak_bytes"]
    assert "reserved at the measured reserved/allocated 1.500" in _tool(
        *args, "--device-check", str(path)).stdout
