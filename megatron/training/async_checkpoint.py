"""--async-save: checkpoints written in the background by megatron-core's async save.

`dist_checkpointing.save(..., async_sharded_save=True)` writes the common state at once and
returns an `AsyncRequest` for the shards; megatron-core's `AsyncCallsQueue` runs it in a writer
process forked per rank (its `TemporalAsyncCaller`: the fork is the snapshot of the state, so
training may change the parameters at once). The request's finalize functions run on every rank
once every rank's writer is done: megatron-core's metadata, then `checkpointing`'s publish (the
staging folder renamed, the tracker updated). Until then the checkpoint is a hidden staging
folder that no --load reads, so a job killed before finalization resumes from the previous one.

As in Megatron-LM the queue is polled at the start of each iteration (one small all-reduce) and
drained at the end of training; here a new save also waits for the pending one, so that one
save at a time holds a writer and a snapshot.

Megatron-LM core_v0.16.1 turns --async-save off (with a warning) unless
--use-persistent-ckpt-worker is given, its spawned worker that needs a CUDA device; this harness
keeps megatron-core's forked writer instead, on the CPU and on GPUs alike.
"""
from __future__ import annotations

from megatron.core.dist_checkpointing.strategies.async_utils import (AsyncCallsQueue,
                                                                     AsyncRequest)


class AsyncSaves:
    """The run's checkpoint writes in flight (at most one); every method is collective."""

    def __init__(self) -> None:
        self._queue = AsyncCallsQueue(persistent=False)

    def schedule(self, request: AsyncRequest) -> None:
        """Start writing `request` after the previous write has been published."""
        self.finalize(blocking=True)
        self._queue.schedule_async_request(request)

    def finalize(self, blocking: bool) -> None:
        """Publish the writes every rank has finished (all of them, waiting, with `blocking`)."""
        self._queue.maybe_finalize_async_calls(blocking=blocking, no_dist=False)
