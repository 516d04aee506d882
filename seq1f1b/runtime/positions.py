"""Absolute positions for a span: RoPE rows [start, end) instead of [0, end - start).

megatron's GPTModel builds the rotary table from the length of its *input* (`_preprocess` calls
`self.rotary_pos_emb(rotary_seq_len, ...)`), so a span of tokens [start, end) would be rotated as
if it began at position 0. `RotaryEmbedding.forward(max_seq_len, offset)` returns the rows of
positions `offset .. offset + max_seq_len - 1`, so inside a span it suffices to add `start` to the
offset. Under context parallelism (span tokens split contiguously over the C ranks of the CP
group) the rows are this rank's part of the span, [start + r * L / C, start + (r + 1) * L / C),
not megatron's load-balanced slicing of the table. Learned absolute positions need nothing
here: the data slicer passes the span's absolute `position_ids`, which index the embedding table
directly.

With `--reset-position-ids` (packed documents, positions restarting with each document) the rows
come from the per-token `position_ids` instead of a span offset: `use_position_ids` makes a
GPTModel gather its RoPE rows per token into a [s, b, 1, dim] table, which megatron's unfused
`apply_rotary_pos_emb` broadcasts over heads as it does [s, 1, 1, dim] (its mRoPE tables have
this shape too); batch rows may differ. Inside a span the slicer already cut position_ids to the
span's tokens, so no offset is added.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel

from seq1f1b import platform
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
            group = cp_group if cp_group is not None else self.cp_group
            cp = group.size() if group is not None else 1
            if cp > 1:      # this rank's contiguous 1/C of the span (runtime/context_parallel.py)
                local = max_seq_len // cp
                return self.get_emb(local, offset + group.rank() * local)
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
    # megatron moves the inverse frequencies to the GPU at the first forward, a blocking
    # host-to-device copy inside the first iteration's hot loop: done here, at build time.
    rotary.inv_freq = rotary.inv_freq.to(platform.compute_device())
    return rotary


def per_token_rotary(rotary: RotaryEmbedding, position_ids: torch.Tensor,
                     max_positions: int) -> torch.Tensor:
    """[b, s] positions (< max_positions) -> the RoPE table's rows per token, [s, b, 1, dim].

    Gathered from the table of positions 0 .. max_positions - 1 (megatron's own, cached), so a
    token gets bit for bit the row the offset table would give it at that position."""
    table = rotary.get_emb(max_positions)        # [max, 1, 1, dim], never CP-sliced
    return table[:, 0, 0][position_ids.t()].unsqueeze(2)


class PositionIdsGPTModel(GPTModel):
    """GPTModel whose RoPE rows are the per-token `position_ids` (--reset-position-ids): every
    stage's forward needs them, not only the first stage's."""

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        output = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        if self.position_embedding_type != "rope":
            return output
        if position_ids is None:
            raise RuntimeError("--reset-position-ids: this model chunk got no position_ids; "
                               "with per-token RoPE every pipeline stage must read them")
        rotary = per_token_rotary(self.rotary_pos_emb, position_ids, self.max_sequence_length)
        return (output[0], rotary, *output[2:])


def use_position_ids(model: GPTModel) -> PositionIdsGPTModel:
    """Turn a built GPTModel into a PositionIdsGPTModel in place (a subclass without state of
    its own, as make_span_aware does for the rotary module)."""
    if model.config.apply_rope_fusion:
        raise ValueError("--reset-position-ids needs per-token RoPE tables, which the fused RoPE "
                         "kernel does not take: drop --apply-rope-fusion")
    if type(model) is not GPTModel and not isinstance(model, PositionIdsGPTModel):
        raise TypeError(f"per-token positions support megatron's GPTModel, got "
                        f"{type(model).__name__}")
    model.__class__ = PositionIdsGPTModel
    return model
