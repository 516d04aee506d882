"""What tools/device_check.py measured on a GPU, turned into the planning models' inputs.

device_check runs one 7B-shaped stage with the seq1f1b executor at two sequence lengths, times
every span's forward and backward, and reads the caching allocator's peaks. From its JSON:

- GEMM and attention efficiencies. The simulator takes a span's F to last
  linear / (peak x e_gemm) + attention / (peak x e_attn) seconds and its B twice that
  (costs.SpanFlops). With the two kinds of FLOPs of every measured span known, the two unknowns
  1/e_gemm and 1/e_attn are fitted by least squares on relative error over all F and B times.
  The spans of one sequence mix the two kinds in different proportions (the first is mostly
  GEMMs, the last mostly attention), which is what separates them. What else a span runs
  (norms, RoPE, the embedding, the loss) folds into the rates, as `DeviceModel` says.
- the allocator's reserve: max_memory_reserved / max_memory_allocated, the largest over the
  runs (the seq1f1b stage runs and the GPipe run that holds 4 micro-batches, as 1F1B's first
  stage does at P = 4). The estimator counts bytes tensors use; a run fails, and the paper's
  figures are logged, on bytes the caching allocator reserves.

Efficiencies are fractions of the measured device's bf16 dense peak. Applying them to another
device (the A100 of the paper's tables, measured on an H200) assumes those fractions carry over;
tools/reproduce_paper.py prints that assumption with the numbers.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np

from seq1f1b.plan.projection import DeviceModel

PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
                    ("H200", 989.0), ("A100", 312.0), ("L40S", 362.0))
"""Dense bf16 peak by device name (first match wins: the PCIe/NVL variants before "H100";
"H200" also names the GH200)."""


class CalibrationError(ValueError):
    """A device_check file that cannot calibrate the models (the message names the file)."""


def peak_tflops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a device as torch.cuda.get_device_name() names it (None: unknown)."""
    return next((peak for part, peak in PEAK_BF16_TFLOPS if part in device_name), None)


@dataclass(frozen=True)
class Calibration:
    """Rates and reserve measured by one device_check run."""

    source: str
    device: str
    peak_tflops: float
    gemm_efficiency: float
    attention_efficiency: float
    worst_fit_error: float              # largest |fitted - measured| / measured over the times
    reserve_ratio: Optional[float]      # None: device_check measured no allocator peaks

    def device_model(self, base: DeviceModel) -> DeviceModel:
        """`base` with the measured efficiencies as its saturated ones, sourced to this file
        (its peak, links, fixed cost, curve shapes and name unchanged). device_check's spans
        are thousands of tokens long, near saturation, where the curves still take a few
        percent off: the saturated values read that much low."""
        source = f"device_check {self.source}"
        return replace(
            base, gemm=replace(base.gemm, saturated=round(self.gemm_efficiency, 3),
                               source=source),
            attention=replace(base.attention, saturated=round(self.attention_efficiency, 3),
                              source=source))

    def describe(self) -> str:
        reserve = ("not measured" if self.reserve_ratio is None
                   else f"{self.reserve_ratio:.3f}")
        return (f"from {self.source}, measured on {self.device} (bf16 peak "
                f"{self.peak_tflops:g} TFLOPS): gemm_efficiency {self.gemm_efficiency:.3f}, "
                f"attention_efficiency {self.attention_efficiency:.3f} (span times fitted "
                f"within {self.worst_fit_error:.0%}), reserved/allocated {reserve}")

    def to_dict(self) -> dict:
        return asdict(self)


def fit_efficiencies(spans: list[dict], peak: float) -> tuple[float, float, float]:
    """(e_gemm, e_attn, worst relative error) from spans with forward_linear_flops,
    forward_attention_flops, forward_s and backward_s (see the module docstring)."""
    rows, times = [], []
    for span in spans:
        flops = np.array([span["forward_linear_flops"], span["forward_attention_flops"]]) / peak
        rows += [flops, 2 * flops]
        times += [span["forward_s"], span["backward_s"]]
    a, t = np.array(rows), np.array(times)
    inverse, *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    if (inverse <= 0).any():
        raise ValueError("the span times do not separate GEMM from attention time "
                         f"(fitted 1/efficiency {inverse.tolist()})")
    worst = float(np.max(np.abs(a @ inverse - t) / t))
    return float(1 / inverse[0]), float(1 / inverse[1]), worst


def read_device_check(path: str | Path) -> Calibration:
    """The calibration in device_check's JSON at `path` (CalibrationError naming it if none)."""
    path = Path(path)
    try:
        result = json.loads(path.read_text())
        environment = result["environment"]
        if "memory" in result:          # --suite gpu keeps the stage runs in its memory part
            result = {**result, **result["memory"]}
        runs = [run for run in result.get("stage", []) if "spans" in run]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CalibrationError(f"{path}: not a device_check.json ({err})") from None
    if not environment.get("cuda"):
        raise CalibrationError(f"{path}: measured without a GPU (device_check --tiny); "
                               "nothing to calibrate from")
    device = environment.get("device", "?")
    peak = environment.get("peak_bf16_tflops") or peak_tflops(device)
    if not peak:
        raise CalibrationError(f"{path}: unknown bf16 peak of {device!r}; add it to "
                               "seq1f1b.plan.calibration.PEAK_BF16_TFLOPS")
    if not runs:
        raise CalibrationError(f"{path}: no stage run (device_check ran with --skip-stage or "
                               "out of time)")
    try:
        gemm, attention, worst = fit_efficiencies(
            [span for run in runs for span in run["spans"]], peak * 1e12)
    except KeyError as err:
        raise CalibrationError(f"{path}: a span has no {err} (written by an older "
                               "device_check.py; run it again)") from None
    except ValueError as err:
        raise CalibrationError(f"{path}: {err}") from None
    memories = [run["memory"] for run in runs] + [result.get("held_microbatches", {}).get(
        "memory", {})]
    ratios = [ratio for ratio in (m.get("reserved_over_allocated") for m in memories) if ratio]
    return Calibration(source=str(path), device=device, peak_tflops=peak,
                       gemm_efficiency=gemm, attention_efficiency=attention,
                       worst_fit_error=worst, reserve_ratio=max(ratios) if ratios else None)
