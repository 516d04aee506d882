"""Absolute positions for a span: RoPE rows [start, end) instead of [0, end - start).

megatron's GPTModel builds the rotary table from the length of its *input* (`_preprocess` calls
`self.rotary_pos_emb(rotary_seq_len, ...)`), so a span of tokens [start, end) would be rotated as
if it began at position 0. `RotaryEmbedding.forward(max_seq_len, offset)` returns the rows of
positions `offset .. offset + max_seq_len - 1`, so inside a span it suffices to add `start` to the
offset. Learned absolute positions need nothing here: the data slicer passes the span's absolute
`position_ids`, which index the embedding table directly.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from seq1f1b.runtime.kv_cache import current_span


class SpanRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose table, inside a span, holds the span's absolute positions."""

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Optional[torch.distributed.ProcessGroup] = None) -> torch.Tensor:
        ctx = current_span()
        if ctx is not None:
            if packed_seq:
                raise NotImplementedError("packed (THD) sequences cannot be split into spans")
            if max_seq_len != ctx.length:
                raise RuntimeError(f"rotary table asked for {max_seq_len} positions inside span "
                                   f"{ctx.span} of {ctx.length} tokens [{ctx.start}, {ctx.end})")
            offset += ctx.start
        return super().forward(max_seq_len, offset, packed_seq, cp_group)


def make_span_aware(rotary: RotaryEmbedding) -> SpanRotaryEmbedding:
    """Turn the RotaryEmbedding a GPTModel built into a SpanRotaryEmbedding, in place.

    GPTModel constructs its rotary module itself from a dozen arguments; switching the instance's
    class to the subclass (which adds no state, only the offset in `forward`) keeps every attribute
    exactly as megatron set it instead of rebuilding it from copied arguments.
    """
    if isinstance(rotary, SpanRotaryEmbedding):
        return rotary
    if type(rotary) is not RotaryEmbedding:
        raise TypeError(f"span offsets support megatron's RotaryEmbedding ('rope'), got "
                        f"{type(rotary).__name__}")
    rotary.__class__ = SpanRotaryEmbedding
    return rotary
