"""--manual-gc: Python's cycle collector run at the same iterations on every rank, as Megatron-LM.

Left to itself the collector runs a full collection whenever its allocation counts say so, on
each rank at its own moment; with hundreds of thousands of objects alive (torch, megatron-core,
the model) one costs ~0.2 s, and the rank that collects is the straggler every other rank of the
pipeline waits for. With --manual-gc the collector is off for the run and collects only:
- once when training starts;
- after every --manual-gc-interval-th iteration (0: never between iterations);
- around each evaluation of the loop (unless --no-manual-gc-eval): everything before it, and
  after it generation 0 only (what the evaluation itself made).
Megatron-LM does the same in the same places (its train()) and leaves the collector off; here
it is turned back on, if it was on, once the end-of-training evaluations are done, so a process
that trains twice, or does more after training, is left as it was.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
from typing import Iterator


class ManualCollection:
    """The collections --manual-gc asks for, at the loop's points (a no-op without it)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.enabled = bool(args.manual_gc)
        self.interval = args.manual_gc_interval
        self.around_evaluation = args.manual_gc_eval

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The training run: the automatic collector off (one full collection first), then
        back to how it was."""
        if not self.enabled:
            yield
            return
        was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """An evaluation: a full collection before, generation 0 after."""
        collect = self.enabled and self.around_evaluation
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)
