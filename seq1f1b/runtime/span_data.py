"""Cut each micro-batch that a Megatron data iterator yields into the spans of the plan.

Megatron's `forward_step_func(data_iterator, model)` calls `next(data_iterator)` once per
micro-batch. For span j the executor hands it an iterator that yields the micro-batch sliced to the
span's tokens, so users' forward steps run unchanged. Slicing rule (batch-first data, as Megatron's):
a tensor whose dim 1 is the sequence length is cut to [start, end) on dim 1 (tokens, labels,
loss_mask, position_ids — absolute positions, so learned position embeddings need nothing else); a
[b, 1, L, L] attention mask becomes its rows [start, end) and columns [0, end) (the span's queries
against every key up to its end); document ids (integer [b, 1, 1, L], runtime/documents.py) pass
whole, since a span's attention needs its keys' ids too; anything else passes through unchanged.
Under context parallelism every CP rank reads the whole micro-batch and keeps its contiguous
1/C of each span's tokens (the masks stay as above: attention sees the whole span).
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from seq1f1b import platform
from seq1f1b.runtime.documents import is_document_ids


def cp_shard(start: int, end: int, cp_rank: int, cp_size: int) -> tuple[int, int]:
    """CP rank `cp_rank`'s contiguous 1/cp_size of the span [start, end)."""
    local = (end - start) // cp_size
    return start + cp_rank * local, start + (cp_rank + 1) * local


def slice_span(item: Any, seq_length: int, start: int, end: int, cp_rank: int = 0,
               cp_size: int = 1) -> Any:
    """`item` (tensor, dict, list, tuple or other) cut to tokens [start, end), or under context
    parallelism to this CP rank's part of them (cp_shard); an attention mask keeps the span's
    rows whole, since the span attention sees every query of the span for its heads."""
    if isinstance(item, torch.Tensor):
        if is_document_ids(item):
            return item
        if item.dim() == 4 and item.shape[-1] == seq_length and item.shape[-2] == seq_length:
            return item[:, :, start:end, :end]
        if item.dim() >= 2 and item.shape[1] == seq_length:
            first, last = cp_shard(start, end, cp_rank, cp_size)
            return item[:, first:last]
        return item
    if isinstance(item, dict):
        return {key: slice_span(value, seq_length, start, end, cp_rank, cp_size)
                for key, value in item.items()}
    if isinstance(item, (list, tuple)):
        return type(item)(slice_span(value, seq_length, start, end, cp_rank, cp_size)
                          for value in item)
    return item


class SpanDataSource:
    """Pulls micro-batches from one chunk's data iterator in order (Megatron's iterators know no
    other) and serves them span by span, in whatever order the schedule asks for them."""

    def __init__(self, iterator: Optional[Iterator], seq_length: int, cp_rank: int = 0,
                 cp_size: int = 1) -> None:
        self.iterator = iterator
        self.seq_length = seq_length
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self._held: dict[int, Any] = {}
        self._host_ids: dict[int, torch.Tensor] = {}
        self._next_microbatch = 0

    def span_iterator(self, microbatch: int, start: int, end: int, last_use: bool
                      ) -> Optional[Iterator]:
        """A one-item iterator over micro-batch `microbatch` cut to [start, end).

        Micro-batch i is pulled from the wrapped iterator at its first use and dropped at its
        last (`last_use`: the last span of its forwards, or the last read of the output layer
        when O actions read this chunk's data too). A schedule may start a later micro-batch
        first (a searched order, a file): the ones before it are pulled then and held (their
        tokens only) until their turn.
        """
        if self.iterator is None:
            return None
        item = self._item(microbatch)
        if last_use:
            del self._held[microbatch]
        return iter([slice_span(item, self.seq_length, start, end, self.cp_rank, self.cp_size)])

    def loss_tokens(self, microbatch: int) -> torch.Tensor:
        """The loss tokens of the whole micro-batch `microbatch` (every span, every CP rank's
        part): the sum of its `loss_mask`, on the device the mask is on, read without a host
        sync. What megatron's per-token loss function counts; an O action scales its span's
        loss by it (the last stage, which sees every span's loss, counts them from the losses)."""
        if self.iterator is None:
            raise RuntimeError("an O action (the output layer off the last stage) reads the "
                               "labels and the loss mask: this pipeline rank has no data iterator")
        item = self._item(microbatch)
        mask = item.get("loss_mask") if isinstance(item, dict) else None
        if mask is None:
            raise RuntimeError("an O action (the output layer off the last stage) scales each "
                               "span's loss by its micro-batch's loss tokens, read from the "
                               "batch's 'loss_mask': this data iterator yields none")
        return mask.sum()

    def _item(self, microbatch: int) -> Any:
        """Micro-batch `microbatch`, pulled (with any before it) if not yet held."""
        if microbatch not in self._held:
            if microbatch < self._next_microbatch:
                raise RuntimeError(f"micro-batch {microbatch} requested again after its last "
                                   "use: a chunk reads each micro-batch once")
            while self._next_microbatch <= microbatch:
                pulled = next(self.iterator)
                self._held[self._next_microbatch] = pulled
                ids = _host_document_ids(pulled)
                if ids is not None:
                    self._host_ids[self._next_microbatch] = ids
                self._next_microbatch += 1
        return self._held[microbatch]

    def host_document_ids(self, microbatch: int) -> Optional[torch.Tensor]:
        """Micro-batch `microbatch`'s document ids as the data loader made them in host memory
        (before the forward step moves them to the device), once, after its first span was
        served; None when it has none there."""
        return self._host_ids.pop(microbatch, None)


def _host_document_ids(item: Any) -> Optional[torch.Tensor]:
    """The document ids among a micro-batch's values, if they are in host memory."""
    values = item.values() if isinstance(item, dict) else item if isinstance(
        item, (list, tuple)) else (item,)
    for value in values:
        if is_document_ids(value) and value.device.type == "cpu" \
                and not platform.seen_on_device(value):
            return value
    return None
