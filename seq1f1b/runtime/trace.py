"""Per-action timing and bytes held for backward, recorded by the executor when asked.

Cheap enough to leave on in benchmarks: one `time.perf_counter()` pair per action, and (with
`measure_memory`) saved-tensor hooks that count each saved storage once. Times are seconds from the
start of the iteration, so the ranks' traces line up when their iterations start together
(benchmarks put a barrier before each iteration).
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from seq1f1b.runtime.memory import SavedTensorMeter


@dataclass
class TimedAction:
    action: str
    start: float
    end: float


@dataclass
class ExecutionTrace:
    """What one iteration of the executor did on this rank."""

    measure_memory: bool = False
    actions: list[TimedAction] = field(default_factory=list)
    peak_saved_bytes: int = 0
    peak_device_bytes: Optional[int] = None          # torch.cuda.max_memory_allocated
    peak_device_reserved_bytes: Optional[int] = None  # max_memory_reserved: allocator's share
    _origin: float = 0.0
    _meter: Optional[SavedTensorMeter] = None
    _stack: Optional[ExitStack] = None

    def begin(self, held_tensors: Callable[[], Iterable[torch.Tensor]],
              parameters: Iterable[torch.Tensor] = ()) -> None:
        """Start of the iteration; `held_tensors` lists what the executor holds outside autograd,
        `parameters` the model's (held whatever the schedule: not counted)."""
        self.actions.clear()
        self._origin = time.perf_counter()
        self._stack = ExitStack()
        if self.measure_memory:
            self._meter = self._stack.enter_context(SavedTensorMeter(held_tensors, parameters))
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

    def record(self, label: str, start: float, end: float) -> None:
        self.actions.append(TimedAction(label, start - self._origin, end - self._origin))
        if self._meter is not None:
            self._meter.sample()

    def end(self) -> None:
        if self._meter is not None:
            self.peak_saved_bytes = self._meter.peak_bytes
            if torch.cuda.is_available():
                self.peak_device_bytes = torch.cuda.max_memory_allocated()
                self.peak_device_reserved_bytes = torch.cuda.max_memory_reserved()
        if self._stack is not None:
            self._stack.close()
        self._meter = self._stack = None

    @property
    def busy(self) -> float:
        return sum(a.end - a.start for a in self.actions)

    @property
    def makespan(self) -> float:
        return max((a.end for a in self.actions), default=0.0)
