"""What the runtime's own Python costs: per action of the executor, per torch call of the shim.

Every span is an action, so each extra span pays the executor's bookkeeping (receive, span data,
span context, loss record, send, trace and timer hooks) and, on the CPU, the platform layer's
`TorchFunctionMode`, which sees every torch call the span's layers make. These two costs are
measured apart from any model compute:

- `executor_cost`: one iteration of a single-stage schedule whose model chunk is one tiny
  parameter, so an action is almost only the executor's Python (and autograd's bookkeeping);
  microseconds per action, wall and main-thread CPU time, the best of `repeats` iterations;
- `shim_cost`: microseconds per torch call, the same calls with the platform layer's mode
  active and with torch-function dispatch disabled, for a plain op, a factory call that names a
  device and a tensor method.

The numbers are for comparing two versions of the code on one machine: print them, never assert.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from seq1f1b import megatron_adapter, platform
from seq1f1b.plan import registry
from seq1f1b.runtime.executor import Executor, StepInputs


@dataclass(frozen=True)
class PerAction:
    """Cost of one executor action."""

    schedule: str
    actions: int            # per iteration
    wall_us: float
    cpu_us: float           # main-thread CPU time (time.thread_time)


class _TinyChunk(torch.nn.Module):
    """A model chunk that computes next to nothing: one scalar weight times the span's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, tensors: list) -> None:
        self.input_tensor = tensors[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens * self.weight


def _loss_func(output: torch.Tensor):
    loss = output.sum()
    tokens = torch.tensor(output.numel(), dtype=torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def _forward_step(data_iterator: Iterator, chunk: torch.nn.Module):
    return chunk(next(data_iterator)["tokens"]), _loss_func


def executor_cost(schedule: str = "seq1f1b", microbatches: int = 8, splits: int = 8,
                  seq_length: int = 64, repeats: int = 5) -> PerAction:
    """μs per action of one single-stage iteration of `schedule` on a chunk that does no work."""
    config = megatron_adapter.make_transformer_config(num_layers=1, hidden_size=8,
                                                      num_attention_heads=1)
    chunk = _TinyChunk().to(platform.compute_device())
    plan = registry.build(schedule, 1, microbatches, splits)
    step = seq_length // splits
    spans = [(s * step, (s + 1) * step) for s in range(splits)]
    tokens = torch.ones(1, seq_length, device=platform.compute_device())
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        inputs = StepInputs(schedule=plan, spans=spans, rank=0, pp_group=None,
                            forward_step_func=_forward_step,
                            data_iterators=[iter([{"tokens": tokens}] * microbatches)],
                            model_chunks=[chunk], config=config, seq_length=seq_length,
                            micro_batch_size=1)
        executor = Executor(inputs)
        wall, cpu = time.perf_counter(), time.thread_time()
        executor.run()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.thread_time() - cpu)
    actions = len(plan.programs[0])
    return PerAction(schedule, actions, 1e6 * best_wall / actions, 1e6 * best_cpu / actions)


def _per_call_us(call: Callable[[], object], calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, time.thread_time() - start)
    return 1e6 * best / calls


def _calls(device: torch.device) -> dict[str, Callable[[], object]]:
    x = torch.ones(4, device=device)
    return {"x.add(x)": lambda: x.add(x),
            "torch.empty(4, device=...)": lambda: torch.empty(4, device=device),
            "x.view(2, 2)": lambda: x.view(2, 2)}


def shim_cost(calls: int = 20000, repeats: int = 5) -> dict[str, tuple[float, float]]:
    """{call: (μs with the platform layer's mode, μs with torch-function dispatch off, on the
    host device)} per call; both alike without the layer (a machine with CUDA)."""
    shimmed = {name: _per_call_us(call, calls, repeats)
               for name, call in _calls(platform.compute_device()).items()}
    with torch._C.DisableTorchFunction():
        bare = {name: _per_call_us(call, calls, repeats)
                for name, call in _calls(torch.device("cpu")).items()}
    return {name: (shimmed[name], bare[name]) for name in shimmed}
