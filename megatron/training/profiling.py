"""--profile and --record-memory-history: what a run records for a later look, Megatron's way.

`--profile` runs torch.profiler over the iterations [--profile-step-start, --profile-step-end) on
the ranks in --profile-ranks (counted, as in Megatron-LM, from the first iteration of this run:
one step of warm-up before them) and writes one chrome trace per rank into --tensorboard-dir
(where Megatron-LM's profiler writes), named `<host>_rank<r>.<time>.pt.trace.json`; TensorBoard's
profiler plugin and chrome://tracing / Perfetto read it. The executor wraps every action in a
`record_function` named as the plan prints it ("F3.1", "B3.1", "W3.1", with "@c" when interleaving),
so the trace reads like the schedule's timeline.

`--record-memory-history` (CUDA only; refused at start-up without a GPU) records the caching
allocator's history from the first iteration, and the last rank dumps a snapshot to
--memory-snapshot-path at every log line, as Megatron-LM does (open it at pytorch.org/memory_viz).
"""
from __future__ import annotations

import argparse
import socket
from typing import Optional

import torch


class Profiler:
    """This rank's share of --profile and --record-memory-history for one run."""

    def __init__(self, args: argparse.Namespace, rank: int, is_last_rank: bool) -> None:
        self._profile: Optional[torch.profiler.profile] = None
        self._recording = args.record_memory_history
        self._snapshot_path = (args.memory_snapshot_path
                               if args.record_memory_history and is_last_rank else None)
        if self._recording:
            torch.cuda.memory._record_memory_history(max_entries=100000)
        if args.profile and rank in args.profile_ranks:
            start, end = args.profile_step_start, args.profile_step_end
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=max(start - 1, 0),
                                                 warmup=1 if start > 0 else 0,
                                                 active=end - start, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    args.tensorboard_dir, worker_name=f"{socket.gethostname()}_rank{rank}"),
                record_shapes=True)
            self._profile.start()

    def step(self) -> None:
        """Before each training iteration."""
        if self._profile is not None:
            self._profile.step()

    def log_interval(self) -> None:
        """At each log line: the memory snapshot so far."""
        if self._snapshot_path is not None:
            torch.cuda.memory._dump_snapshot(self._snapshot_path)

    def stop(self) -> None:
        """End of the run: a trace still recording is written, the last snapshot dumped."""
        if self._profile is not None:
            self._profile.stop()
            self._profile = None
        if self._recording:
            self.log_interval()
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
