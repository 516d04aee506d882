"""Per-action timing and bytes held for backward, recorded by the executor when asked.

Cheap enough to leave on in benchmarks: two clock marks per action, and (with `measure_memory`)
saved-tensor hooks that count each saved storage once. Times are seconds from the start of the
iteration, so the ranks' traces line up when their iterations start together (benchmarks put a
barrier before each iteration).

On a GPU the marks are CUDA events recorded on the current stream: the host only enqueues
kernels, so its clock would time an F's launches and charge a B with whatever was queued before
it. Events are read when `actions` is first asked for, after the iteration: no host sync inside
it. On the CPU the marks are `time.perf_counter()`, which is when the work ran; beside them each
action's main-thread CPU time (`time.thread_time()`), which is the work itself: the wall time
also holds waits for a neighbour and whatever the machine's other processes took.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

import torch

from seq1f1b.runtime.memory import SavedTensorMeter


@dataclass
class TimedAction:
    action: str
    start: float
    end: float
    cpu: float = 0.0      # main-thread CPU seconds inside the action (time.thread_time)


Mark = Union[float, "torch.cuda.Event"]


def _mark(on_cuda: bool) -> Mark:
    if on_cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds_between(origin: Mark, mark: Mark) -> float:
    if isinstance(mark, float):
        return mark - origin
    return origin.elapsed_time(mark) / 1e3


@dataclass
class ExecutionTrace:
    """What one iteration of the executor did on this rank."""

    measure_memory: bool = False
    peak_saved_bytes: int = 0
    peak_device_bytes: Optional[int] = None          # torch.cuda.max_memory_allocated
    peak_device_reserved_bytes: Optional[int] = None  # max_memory_reserved: allocator's share
    span_bounds: tuple[tuple[int, int], ...] = ()     # the [start, end) of each span it ran
    _on_cuda: bool = False                            # the clock, chosen once per iteration
    _origin: Mark = 0.0
    _marks: list[tuple[str, Mark, Mark, float]] = field(default_factory=list)
    _actions: list[TimedAction] = field(default_factory=list)
    _meter: Optional[SavedTensorMeter] = None
    _stack: Optional[ExitStack] = None

    @property
    def actions(self) -> list[TimedAction]:
        """Each action's start and end, seconds from the iteration's start (reading CUDA events
        waits for them: ask after the iteration)."""
        if self._marks:
            last = self._marks[-1][2]
            if not isinstance(last, float):
                last.synchronize()
            self._actions = [TimedAction(label, _seconds_between(self._origin, start),
                                         _seconds_between(self._origin, end), cpu)
                             for label, start, end, cpu in self._marks]
            self._marks = []
        return self._actions

    def mark(self) -> Mark:
        """A point in time on the device's clock (a CUDA event, or the CPU's)."""
        return _mark(self._on_cuda)

    def begin(self, held_tensors: Callable[[], Iterable[torch.Tensor]],
              parameters: Iterable[torch.Tensor] = (),
              span_bounds: tuple[tuple[int, int], ...] = ()) -> None:
        """Start of the iteration; `held_tensors` lists what the executor holds outside autograd,
        `parameters` the model's (held whatever the schedule: not counted), `span_bounds` the
        tokens of each span (what a time fit of the spans needs)."""
        self._marks, self._actions = [], []
        self.span_bounds = tuple(span_bounds)
        self._on_cuda = torch.cuda.is_available()
        self._origin = _mark(self._on_cuda)
        self._stack = ExitStack()
        if self.measure_memory:
            self._meter = self._stack.enter_context(SavedTensorMeter(held_tensors, parameters))
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

    def record(self, label: str, start: Mark, end: Mark, cpu: float = 0.0) -> None:
        """Action `label` ran from `start` to `end` (marks) using `cpu` main-thread seconds."""
        self._marks.append((label, start, end, cpu))
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
