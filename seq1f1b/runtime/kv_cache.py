"""The per-micro-batch K/V cache and the "which span is running" context.

The executor owns one `MicrobatchKVCache` per (micro-batch, model chunk): created at F(i,0), freed
after B(i,0). While it runs the forward of span j it enters `span_context(...)`; the span-aware core
attention of every layer reads `current_span()` to learn the span's absolute offset and to fetch
the cached K/V of spans 0..j-1 (as leaves) and store its own.

Exact gradients: span j's K/V enter later spans' graphs as detached leaves that require grad, so
after B(i,j') of every later span j' their `.grad` holds the later spans' dK/dV contribution. Span j
itself attends through `with_later_span_grads(key, value, entry)`: an identity whose backward adds
those leaf grads to the gradient of K_j and V_j at the moment it runs, i.e. during B(i,j), when the
reverse span order guarantees they are complete. Because the routing lives in the span's own graph,
it holds for any graph that B(i,j) back-propagates: the original one, or the one megatron's
activation recompute rebuilds (the executor runs B(i,j) inside the span's context, so a recomputed
forward finds the same prefix leaves and re-stores its K/V under the same leaves).
Memory: a leaf is `detach()` of the graph tensor, so both share one storage; nothing is copied.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch


@dataclass
class SpanKV:
    """K and V of one span in one attention layer: the graph tensors and their detached leaves."""

    key: torch.Tensor
    value: torch.Tensor
    key_leaf: torch.Tensor
    value_leaf: torch.Tensor


@dataclass
class MicrobatchKVCache:
    """K/V of the spans of one micro-batch on one model chunk, per attention layer."""

    microbatch: int
    chunk: int = 0
    requires_grad: bool = True       # False for forward-only (evaluation) iterations
    _layers: dict = field(default_factory=dict)

    def prefix(self, layer: object, span: int) -> list[SpanKV]:
        """The cached K/V of spans 0..span-1 of `layer` (each span's entry must exist)."""
        entries = self._layers.get(layer, {})
        missing = [s for s in range(span) if s not in entries]
        if missing:
            raise RuntimeError(f"KV cache of micro-batch {self.microbatch} chunk {self.chunk} "
                               f"lacks spans {missing} when span {span} runs: out-of-order forward")
        return [entries[s] for s in range(span)]

    def store(self, layer: object, span: int, key: torch.Tensor, value: torch.Tensor) -> SpanKV:
        """Keep span `span`'s K/V for the later spans; returns the entry (with its leaves).

        Storing again for the same span (a recomputed forward) replaces the graph tensors and keeps
        the existing leaves, whose `.grad` may already hold later spans' contributions.
        """
        entries = self._layers.setdefault(layer, {})
        old = entries.get(span)
        if old is not None:
            entry = SpanKV(key, value, old.key_leaf, old.value_leaf)
        else:
            # Leaves require grad even when this forward runs without a graph (the first pass of
            # activation recompute): their recomputed consumers must still produce dK/dV.
            entry = SpanKV(key, value, key.detach().requires_grad_(self.requires_grad),
                           value.detach().requires_grad_(self.requires_grad))
        entries[span] = entry
        return entry

    def release(self, span: int) -> None:
        """Drop span `span` of every layer: after its backward, nothing reads it again."""
        for entries in self._layers.values():
            entries.pop(span, None)

    def __len__(self) -> int:
        """Number of cached (layer, span) entries."""
        return sum(len(entries) for entries in self._layers.values())

    def nbytes(self) -> int:
        """Bytes held by the cached K/V (graph tensor and leaf share storage: counted once)."""
        return sum(e.key.numel() * e.key.element_size() + e.value.numel() * e.value.element_size()
                   for entries in self._layers.values() for e in entries.values())


class _LaterSpanGrads(torch.autograd.Function):
    """Identity on (K, V) of a span; backward adds the dK/dV later spans left in the leaves."""

    @staticmethod
    def forward(ctx, key, value, entry):
        ctx.entry = entry
        return key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        entry = ctx.entry
        if entry.key_leaf.grad is not None:
            grad_key = grad_key + entry.key_leaf.grad
        if entry.value_leaf.grad is not None:
            grad_value = grad_value + entry.value_leaf.grad
        return grad_key, grad_value, None


def with_later_span_grads(key: torch.Tensor, value: torch.Tensor, entry: SpanKV
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) for the span's own attention, routing later spans' dK/dV into this span's graph."""
    if not torch.is_grad_enabled() or not (key.requires_grad or value.requires_grad):
        return key, value
    return _LaterSpanGrads.apply(key, value, entry)


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
