"""When this rank's gradients are reduced over data parallelism, and its parameters gathered:
megatron DDP's protocol, placed where the plan says.

megatron's DistributedDataParallel reduces gradients in buckets. With `overlap_grad_reduce` each
parameter's gradient hook reports the gradient "ready" (`register_grad_ready`), and a bucket's
all-reduce / reduce-scatter starts, asynchronously, once every report the bucket expects has come
in; `finish_grad_sync` (in `finalize_model_grads`) only waits. Reports count only while the
chunk's `no_sync` context is *closed*: megatron's schedules close it before the last backward of
the chunk, so exactly the last contribution to every gradient is counted (the first iteration
learns the expected counts, later ones launch on them).

A plan is data, so the window follows from it: for each model chunk, sync opens just before the
chunk's last B action of the rank's program (or its last O, for the last chunk, which holds the
output layer's copy when O actions run it; the executor reports every copy's weights once more
after the program, so a rank that runs no O still completes its buckets). Every gradient still
to come after that point is counted: the B's own (biases, norms, embeddings and, without a
split backward, everything) and, with a zero-bubble schedule, the weight gradients of every W
that follows, which come in when W runs (megatron's `delay_wgrad_compute` mechanism,
`seq1f1b.runtime.wgrad`), not at B. The count is the same every iteration because the program
is, and a bucket launches only after its last counted gradient; contributions before the window
are already in `main_grad`.

Parameter gathering (`overlap_param_gather` with the distributed optimizer) is megatron's too: the
optimizer step leaves the updated shards, and each module's forward pre-hook waits for (and if
needed starts) the all-gather of its bucket. When the caller sets megatron's
`config.param_sync_func` (Megatron-LM does, by default, with --overlap-param-gather), the executor
calls it as megatron's interleaved schedule does, one chunk ahead: chunk 0 when the iteration
starts, chunk c+1 at the first forward of chunk c. megatron's `config.grad_sync_func` is not
called: the hooks above launch every bucket, as soon as it is complete.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import torch

from seq1f1b.plan.actions import Action


def _per_chunk(func: Any, chunks: int) -> Optional[list[Callable]]:
    """megatron's hooks on `config` come as one function or one per model chunk."""
    if func is None:
        return None
    return list(func) if isinstance(func, (list, tuple)) else [func] * chunks


class GradSync:
    """Opens each chunk's grad-sync window and prefetches parameters at the plan's positions."""

    def __init__(self, program: Sequence[Action], model_chunks: Sequence[torch.nn.Module],
                 config: Any) -> None:
        chunks = len(model_chunks)
        self._chunks = model_chunks
        self._param_sync = _per_chunk(getattr(config, "param_sync_func", None), chunks)
        no_sync = config.no_sync_func
        # (no_sync function, the chunks it covers): one per chunk, or one for all of them
        groups = ([(func, [c]) for c, func in enumerate(no_sync) if func is not None]
                  if isinstance(no_sync, (list, tuple)) else
                  [] if no_sync is None else [(no_sync, list(range(chunks)))])
        # An O's gradients go into the output layer's copy, a child of the last chunk.
        last_b = {chunks - 1 if a.op == "O" else a.chunk: n for n, a in enumerate(program)
                  if a.op in ("B", "O")}
        first_f: dict[int, int] = {}
        for n, action in enumerate(program):
            if action.op == "F":
                first_f.setdefault(action.chunk, n)
        self._no_sync = [func for func, _ in groups]
        # A group's window opens at the earliest last-B of its chunks (earlier only counts more
        # contributions, never fewer).
        self._opens: dict[int, list[int]] = {}
        for index, (_, covered) in enumerate(groups):
            positions = [last_b[c] for c in covered if c in last_b]
            if positions:
                self._opens.setdefault(min(positions), []).append(index)
        self._prefetch = {n: chunk + 1 for chunk, n in first_f.items() if chunk + 1 < chunks}
        self._closed: dict[int, contextlib.ExitStack] = {}

    def start(self) -> None:
        """Start of a training iteration: gradients unsynchronised, chunk 0's gather launched."""
        for index, no_sync in enumerate(self._no_sync):
            if index not in self._closed:
                stack = contextlib.ExitStack()
                stack.enter_context(no_sync())
                self._closed[index] = stack
        self._sync_params(0)

    def before(self, position: int) -> None:
        """Before action `position` of the program."""
        for index in self._opens.get(position, ()):
            self._open(index)
        if position in self._prefetch:
            self._sync_params(self._prefetch[position])

    def finish(self) -> None:
        """End of the iteration: every window open (megatron's state between iterations)."""
        for index in list(self._closed):
            self._open(index)

    def _open(self, index: int) -> None:
        stack = self._closed.pop(index, None)
        if stack is not None:
            stack.close()

    def _sync_params(self, chunk: int) -> None:
        if self._param_sync is not None:
            self._param_sync[chunk](self._chunks[chunk].parameters())
