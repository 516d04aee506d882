"""When a run stops early on its own: Megatron-LM's --exit-signal-handler and
--exit-duration-in-mins.

A batch system ends a job with a signal (Slurm: SIGTERM at the time limit, or earlier when asked
with `sbatch --signal`; torchrun forwards it to its workers). With the handler installed the signal
no longer kills the process: it is remembered, and at the end of each iteration every rank learns
whether any rank got it (or ran past the wall-clock budget) through one all-reduce, so all of them
save the same iteration and exit together.

Slurm signals every process of a job step, helpers included. megatron-core's checkpoint writer
keeps a multiprocessing manager for the whole run, started with `spawn`, which imports the entry
script as `__mp_main__`; `ignore_batch_signals()`, called there, keeps that helper alive through
the warning, or the very save the warning asks for would fail. (Writer processes forked during a
save inherit the rank's handler and live on too.) The module imports torch only when checking.
"""
from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Optional

BATCH_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""The signals batch systems warn a job with (Slurm's `--signal`, its time limit's SIGTERM)."""


def ignore_batch_signals() -> None:
    """For a helper process a rank starts with `spawn` (it imports the entry script as
    `__mp_main__`): outlive the batch system's signals, which are the ranks' to act on."""
    for batch_signal in BATCH_SIGNALS:
        signal.signal(batch_signal, signal.SIG_IGN)


class ExitSignalHandler:
    """Catches `signal_name` from `install()` until `release()`: the signal sets `received`
    instead of running its previous handler (for SIGTERM: death)."""

    def __init__(self, signal_name: str) -> None:
        self.signal = signal.Signals[signal_name]
        self.received = False
        self._previous: Optional[object] = None

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        self.received = True

    def install(self) -> "ExitSignalHandler":
        self._previous = signal.signal(self.signal, self._on_signal)
        return self

    def release(self) -> None:
        if self._previous is not None:
            signal.signal(self.signal, self._previous)
            self._previous = None


class ExitConditions:
    """The early exits a run asked for; `check()` after each iteration is collective (every rank
    calls it, or none: it is a no-op when neither exit is asked for)."""

    def __init__(self, signal_name: Optional[str], duration_mins: Optional[float]) -> None:
        self.handler = ExitSignalHandler(signal_name).install() if signal_name else None
        self.duration_s = None if duration_mins is None else 60.0 * duration_mins
        self.started = time.monotonic()

    def check(self) -> Optional[str]:
        """Why the run should stop now (the same answer on every rank), or None."""
        if self.handler is None and self.duration_s is None:
            return None
        import torch
        import torch.distributed as dist

        from seq1f1b import platform

        elapsed = time.monotonic() - self.started
        flags = torch.tensor([self.handler is not None and self.handler.received,
                              self.duration_s is not None and elapsed > self.duration_s],
                             dtype=torch.int32, device=platform.compute_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, out_of_time = (bool(flag) for flag in flags.tolist())
        if signalled:
            return f"received {self.handler.signal.name}"
        if out_of_time:
            return f"--exit-duration-in-mins {self.duration_s / 60:g} reached"
        return None

    def release(self) -> None:
        if self.handler is not None:
            self.handler.release()
