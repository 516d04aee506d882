"""The per-micro-batch K/V cache and the "which span is running" context.

The executor owns one `MicrobatchKVCache` per (micro-batch, model chunk): created at F(i,0), freed
after B(i,0). While it runs span j it enters `span_context(...)`; the span-aware core attention of
every layer reads `current_span()` to learn the span's absolute offset and finds its layer's
`LayerKV` in the cache.

Storage: per attention layer one contiguous K buffer and one V buffer for the whole sequence,
allocated when span 0 writes its K/V. Span j copies its own K/V into rows [start, end) and attends
over the view rows [0, end): prefix and current keys are one tensor without any concatenated copy,
so the attention kernel's autograd graph can save that view (it shares the buffer's storage) and
the backward needs no re-run of the forward. The view handed to a graph comes from `.data`, whose
version counter is its own: a later span writing rows >= end does not invalidate an earlier span's
saved view (those rows are outside it); a recomputed forward (activation recompute) rewrites a
span's rows with the same values after every later span has finished its backward.

Exact gradients: the backward of span j's attention yields dK/dV for rows [0, end). `route_grads`
keeps rows [0, start) in the layer's accumulators for the earlier spans and returns rows
[start, end) plus what the later spans left there, i.e. span j's complete dK/dV: backward runs
spans in reverse, so when B(i,j) reaches a layer every later span has contributed.
Memory: K/V of a whole micro-batch from its first span on (the estimator counts it so), dK/dV
accumulators of rows [0, start) from the micro-batch's first backward until the cache is freed,
in fp32 whatever the training precision (see `MIN_ACCUMULATOR_DTYPE`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from seq1f1b.runtime.memory import sample_active_meters

MIN_ACCUMULATOR_DTYPE = torch.float32
"""The dK/dV that later spans leave for the earlier spans' rows are summed in at least fp32. In
bf16 each span's addition would round the running sum, an error that grows with k (eager bf16,
L=1024, dK against fp64: 16% above the unsplit kernel's error at k=8, 24% at k=16); in fp32 the
split adds one bf16 rounding of the result, 8% at any k (each span's contribution leaves its
kernel rounded to bf16; no accumulator can undo that). A span's complete dK/dV is rounded to the
gradient's dtype once, when its backward takes it. The price: 4 bytes per accumulated element
instead of 2 in bf16 training."""


@dataclass
class LayerKV:
    """One attention layer's K/V buffers for a micro-batch and the dK/dV later spans left."""

    key: torch.Tensor               # [seq_length, b, groups, d]
    value: torch.Tensor
    filled: int = 0                 # rows [0, filled) hold K/V of spans already run
    key_grad: Optional[torch.Tensor] = None      # rows [0, n): dK from later spans' attention
    value_grad: Optional[torch.Tensor] = None

    def write(self, start: int, end: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store span [start, end)'s K/V; the rows before `start` must hold the earlier spans'."""
        if start > self.filled:
            raise RuntimeError(f"the span [{start}, {end}) starts at token {start} but the cached "
                               f"K/V hold {self.filled} tokens: out-of-order forward")
        if end > self.key.size(0):
            raise RuntimeError(f"span [{start}, {end}) ends beyond the cache's "
                               f"{self.key.size(0)} tokens")
        with torch.no_grad():
            self.key.data[start:end].copy_(key)
            self.value.data[start:end].copy_(value)
        self.filled = max(self.filled, end)

    def views(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of rows [0, end), sharing the buffers' storage (own version counters)."""
        return self.key.data[:end], self.value.data[:end]

    def route_grads(self, start: int, end: int, grad_key: torch.Tensor,
                    grad_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dK/dV of rows [0, end) from span [start, end)'s attention -> the span's own complete
        dK/dV (its rows plus the later spans' contributions); rows [0, start) are kept for the
        earlier spans."""
        if self.key_grad is None:           # the micro-batch's last span: the first backward
            if start > 0:
                dtype = torch.promote_types(grad_key.dtype, MIN_ACCUMULATOR_DTYPE)
                self.key_grad = grad_key[:start].to(dtype, copy=True)
                self.value_grad = grad_value[:start].to(dtype, copy=True)
                sample_active_meters()
            return grad_key[start:end], grad_value[start:end]
        # One in-place pass over rows [0, end) (end <= the accumulator's rows: spans run in
        # reverse), summed in the accumulator's precision. The span's rows are then final and
        # no later backward touches them, so the span's dK/dV is a view of them, rounded once.
        self.key_grad[:end] += grad_key
        self.value_grad[:end] += grad_value
        return (self.key_grad[start:end].to(grad_key.dtype),
                self.value_grad[start:end].to(grad_value.dtype))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.key, self.value, self.key_grad, self.value_grad) if t is not None]


@dataclass
class MicrobatchKVCache:
    """K/V of one micro-batch on one model chunk, per attention layer, for `seq_length` tokens."""

    microbatch: int
    seq_length: int
    chunk: int = 0
    requires_grad: bool = True       # False for forward-only (evaluation) iterations
    _layers: dict = field(default_factory=dict)
    # What every layer of a span derives alike from the micro-batch's attention mask (a span's
    # document mask, block mask or varlen layout, runtime/documents.py), built once per span.
    derived: dict = field(default_factory=dict)
    # The micro-batch's document ids in host memory (the data loader's, before get_batch moved
    # them): what flash's varlen layout reads without a host sync. Not device memory: not in
    # `tensors()`.
    host_document_ids: Optional[torch.Tensor] = None

    def layer(self, layer: object, key: torch.Tensor, value: torch.Tensor) -> LayerKV:
        """`layer`'s buffers, allocated on first use with `key`/`value`'s per-token shape."""
        entry = self._layers.get(layer)
        if entry is None:
            entry = LayerKV(key.new_empty((self.seq_length, *key.shape[1:])),
                            value.new_empty((self.seq_length, *value.shape[1:])))
            self._layers[layer] = entry
        return entry

    def __len__(self) -> int:
        """Number of attention layers with buffers."""
        return len(self._layers)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer, gradient accumulator and derived mask the cache holds (a derived form
        that is no tensor itself, a varlen layout or a BlockMask, holds its tensors as
        attributes)."""
        derived = [t for form in self.derived.values() for t in tensors_of(form)]
        return [t for entry in self._layers.values() for t in entry.tensors()] + derived


def tensors_of(form: object) -> list[torch.Tensor]:
    """The tensors `form` holds: itself, or those in its tuples and lists and among its
    attributes (a varlen layout's rows, a BlockMask's block tables)."""
    if isinstance(form, torch.Tensor):
        return [form]
    if isinstance(form, (tuple, list)):
        return [t for item in form for t in tensors_of(item)]
    return [t for value in getattr(form, "__dict__", {}).values()
            if isinstance(value, (torch.Tensor, tuple, list)) for t in tensors_of(value)]


@dataclass(frozen=True)
class SpanContext:
    """The span now running: tokens [start, end) of micro-batch `microbatch`, span index `span`."""

    microbatch: int
    span: int
    start: int
    end: int
    cache: Optional[MicrobatchKVCache]

    @property
    def length(self) -> int:
        return self.end - self.start


_CURRENT: list[SpanContext] = []


@contextlib.contextmanager
def span_context(ctx: SpanContext) -> Iterator[SpanContext]:
    """Make `ctx` the current span for the forward pass run inside the block."""
    _CURRENT.append(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.pop()


def current_span() -> Optional[SpanContext]:
    """The span whose forward is running, or None outside any span (a plain full-sequence run)."""
    return _CURRENT[-1] if _CURRENT else None
