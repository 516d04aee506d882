"""The GPUs the planner can plan for: the projection's A100, an H100 model, or a device_check
measurement (its efficiencies and its allocator reserve)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.calibration import read_device_check
from seq1f1b.plan.overheads import Link
from seq1f1b.plan.projection import A100, DeviceModel

H100 = replace(
    A100, name="H100-SXM5-80GB", peak_tflops=989.0,
    gemm=replace(A100.gemm, saturated=0.55, half_tokens=2048,
                 source="estimate: Megatron-LM's H100 GPT runs reach ~45-50% of the bf16 dense "
                        "peak per GPU with memory-bound ops included; half_tokens doubled from "
                        "the A100's for 132 SMs at ~3x the rate, not measured"),
    attention=replace(A100.attention, saturated=0.35,
                      source="flash-attention 2 on H100 (Shah et al. 2024, causal, head dim "
                             "128, fwd+bwd) runs ~330-350 TFLOPS at long sequences, read from "
                             "the paper's figure; curve shape as the A100's"),
    nvlink=Link(latency_s=10e-6, gbps=150.0,
                source="NVLink4 gives 450 GB/s per direction per H100 (NVIDIA datasheet); one "
                       "NCCL send reaches a fraction, 150 GB/s estimated"),
    infiniband=Link(latency_s=20e-6, gbps=45.0,
                    source="one 400 Gb/s NDR NIC per GPU (DGX H100): 50 GB/s line rate, ~45 "
                           "GB/s estimated; latency as the A100's"),
    tp_bus_gbps=350.0, memory_gib=79.1)
"""An H100 SXM 80 GB in 8-GPU NDR InfiniBand nodes: every rate an estimate (sources above)."""

DEVICES = {"a100": A100, "h100": H100}


@dataclass(frozen=True)
class Gpu:
    """What the planner assumes of each GPU."""

    device: DeviceModel
    memory_gib: float
    reserve_ratio: float = 1.0      # reserved / allocated of the caching allocator (measured)
    source: str = "model"

    def describe(self) -> str:
        reserve = ("allocated bytes" if self.reserve_ratio == 1.0 else
                   f"allocated x {self.reserve_ratio:.3f} reserved/allocated")
        return (f"{self.device.name} ({self.source}), {self.memory_gib:g} GiB judged on "
                f"{reserve}")


def resolve_gpu(name: str, memory_gib: Optional[float] = None, gpus_per_node: int = 8) -> Gpu:
    """`name`: a100, h100, or a device_check.json (its measured efficiencies on the model of
    the device it ran on, H100 rates for a Hopper, A100 rates otherwise, and its reserve)."""
    if name.lower() in DEVICES:
        device = replace(DEVICES[name.lower()], gpus_per_node=gpus_per_node)
        return Gpu(device, memory_gib or device.memory_gib, source="model")
    if not Path(name).is_file():
        raise ScheduleError(f"--gpu {name!r}: give a100, h100 or a device_check.json file")
    calibration = read_device_check(name)
    base = H100 if calibration.peak_tflops >= H100.peak_tflops else A100
    device = replace(calibration.device_model(base), gpus_per_node=gpus_per_node)
    return Gpu(device, memory_gib or device.memory_gib, calibration.reserve_ratio or 1.0,
               source=f"efficiencies measured by device_check {name}")
