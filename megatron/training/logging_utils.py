"""What a run reports: Megatron's log line, throughput as the paper counts it, peak memory per
pipeline stage and an ETA (the same figures go to TensorBoard and W&B: megatron/training/
writers.py).

The log line keeps Megatron-LM's fields, order and number formats (so tools that parse Megatron
logs keep working) and appends the paper's metrics:

     [2026-01-31 12:00:00.123456] iteration       10/     100 | consumed samples:          320 |
     elapsed time per iteration (ms): 812.4 | learning rate: 3.000000E-04 | global batch size:
     32 | lm loss: 4.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped
     iterations:   0 | number of nan iterations:   0 | tokens/s: 5042 | TFLOPS/GPU: 0.01 | peak
     mem per stage (MB held for backward): 12.5, 9.8 | ETA 0:01:13 |

(one line in the log; the timestamp is when the line was written, with microseconds, as in
Megatron-LM core_v0.16.1; the learning rate is Megatron-LM's: the optimizer's after the
scheduler stepped, i.e. the one the next iteration uses). A nan
iteration is, as in Megatron, a skipped iteration (no update) whose loss was NaN or infinite.
Peak memory: on a GPU, `torch.cuda.max_memory_reserved` (what the paper's
reference logged); on the CPU, the bytes autograd holds for backward (activations and the weights
their graphs reference), measured by `seq1f1b.runtime.memory.SavedTensorMeter`, since a CPU has no
allocator statistics and the process RSS is dominated by imports. Each stage reports the maximum
over its TP and DP ranks.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Iterator, Optional, Sequence

import torch

from seq1f1b.plan.costs import ModelConfig, iteration_flops


@dataclass(frozen=True)
class Throughput:
    """tokens/s of the whole job and model TFLOPS per GPU (the paper's definitions)."""

    tokens_per_second: float
    tflops_per_gpu: float


def throughput(model: ModelConfig, seq_length: int, global_batch_size: int, world_size: int,
               seconds_per_iteration: float) -> Throughput:
    """tokens/s = global batch x sequence / time; TFLOPS/GPU = 3 x forward FLOPs of the global
    batch (seq1f1b.plan.costs.iteration_flops) / time / GPUs."""
    seconds = max(seconds_per_iteration, 1e-12)
    return Throughput(global_batch_size * seq_length / seconds,
                      iteration_flops(model, seq_length, global_batch_size)
                      / seconds / world_size / 1e12)


def format_eta(seconds: float) -> str:
    """H:MM:SS (days folded into hours)."""
    whole = max(0, int(round(seconds)))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


@dataclass(frozen=True)
class IntervalReport:
    """The figures of one log line: means over the iterations since the previous line."""

    iteration: int
    train_iters: int
    consumed_samples: int
    seconds_per_iteration: float
    learning_rate: float
    global_batch_size: int
    lm_loss: Optional[float]            # None: no iteration of the interval produced a loss
    loss_scale: float
    grad_norm: Optional[float]          # None with --clip-grad 0 (megatron then computes none)
    skipped_iterations: int
    throughput: Throughput
    peak_memory_mb: Sequence[float]     # one per pipeline stage
    memory_source: str
    nan_iterations: int = 0
    time: Optional[datetime] = None     # when the line is written (None: now)
    log_throughput: bool = False        # --log-throughput: Megatron-LM's TFLOP/s/GPU field
    num_zeros_in_grad: Optional[int] = None     # --log-num-zeros-in-grad (last iteration's)
    params_norm: Optional[float] = None         # --log-params-norm

    def line(self) -> str:
        stamp = (self.time or datetime.now()).strftime("%Y-%m-%d %H:%M:%S.%f")
        fields = [f" [{stamp}] iteration {self.iteration:8d}/{self.train_iters:8d}",
                  f" consumed samples: {self.consumed_samples:12d}",
                  f" elapsed time per iteration (ms): {self.seconds_per_iteration * 1000:.1f}"]
        if self.log_throughput:
            fields.append(f" throughput per GPU (TFLOP/s/GPU): "
                          f"{self.throughput.tflops_per_gpu:.1f}")
        fields += [f" learning rate: {self.learning_rate:.6E}",
                  f" global batch size: {self.global_batch_size:5d}"]
        if self.lm_loss is not None:
            fields.append(f" lm loss: {self.lm_loss:.6E}")
        fields.append(f" loss scale: {self.loss_scale:.1f}")
        if self.grad_norm is not None:
            fields.append(f" grad norm: {self.grad_norm:.3f}")
        if self.num_zeros_in_grad is not None:
            fields.append(f" num zeros: {self.num_zeros_in_grad}")
        if self.params_norm is not None:
            fields.append(f" params norm: {self.params_norm:.3f}")
        remaining = (self.train_iters - self.iteration) * self.seconds_per_iteration
        fields += [f" number of skipped iterations: {self.skipped_iterations:3d}",
                   f" number of nan iterations: {self.nan_iterations:3d}",
                   f" tokens/s: {self.throughput.tokens_per_second:.0f}",
                   f" TFLOPS/GPU: {self.throughput.tflops_per_gpu:.4g}",
                   f" peak mem per stage ({self.memory_source}): "
                   + ", ".join(f"{mb:.1f}" for mb in self.peak_memory_mb),
                   f" ETA {format_eta(remaining)}"]
        return "".join(f"{field} |" for field in fields)


def validation_lines(where: str, lm_loss: float) -> list[str]:
    """Megatron's boxed evaluation report: loss and perplexity."""
    ppl = math.exp(min(20.0, lm_loss))
    text = f" validation loss at {where} | lm loss value: {lm_loss:.6E} | lm loss PPL: {ppl:.6E} | "
    rule = "-" * (len(text) + 1)
    return [rule, text, rule]


def params_l2_norm(model: Sequence[torch.nn.Module]) -> float:
    """--log-params-norm: the L2 norm of the whole model's parameters, as Megatron-LM counts
    it (each tensor-parallel shard once, a tied output layer once); collective over the
    model-parallel group. From the model's own (bf16 or fp32) weights, in fp32: Megatron-LM
    reads the optimizer's fp32 main copies under mixed precision, which differ by rounding."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    squares = torch.zeros((), dtype=torch.float32)
    for chunk in model:
        for param in chunk.parameters():
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                squares = squares + param.detach().float().pow(2).sum().cpu()
    if torch.cuda.is_available():
        squares = squares.cuda()
    dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    return float(squares.sqrt())


class PeakMemory:
    """Peak memory of this rank over a logging interval (see the module docstring for what)."""

    def __init__(self) -> None:
        self.on_gpu = torch.cuda.is_available()
        self.source = "MB reserved" if self.on_gpu else "MB held for backward"
        self._peak_bytes = 0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Wrap the forward-backward of one iteration."""
        if self.on_gpu:
            yield
            self._peak_bytes = max(self._peak_bytes, torch.cuda.max_memory_reserved())
            return
        from seq1f1b.runtime.memory import SavedTensorMeter
        with SavedTensorMeter() as meter:
            yield
        self._peak_bytes = max(self._peak_bytes, meter.peak_bytes)

    def take_bytes(self) -> int:
        """The peak since the last call; starts a new interval."""
        peak, self._peak_bytes = self._peak_bytes, 0
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats()
        return peak
