"""Ulysses-style context parallelism around the span core attention.

With `--context-parallel-size C --cp-comm-type a2a` every rank of megatron's context-parallel group
holds a contiguous 1/C of each span's tokens for everything but core attention (the executor cuts
the data so, `seq1f1b.runtime.span_data`): GEMMs, norms and stage activations shrink by C. Around
core attention an all-to-all on the CP group turns q, k, v from sequence-sharded ([span / C, b,
heads, d]) into head-sharded ([span, b, heads / C, d]); each rank then runs the span attention of
`SpanAttention` unchanged for its heads (the whole span, its cached prefix, bottom-right causal: the
kernel sees a full span, so no backend changes), and the all-to-all after it turns the output back.

Why an all-to-all and not a ring (`--cp-comm-type p2p`): the K/V cache of the earlier spans stays
where its heads are computed, local and head-sharded (1/C of it, and of its dK/dV accumulators, per
rank); a span sends only its own q, k, v and output. A ring keeps K/V sequence-sharded and passes
every K/V block around the ring for each query block, so every span would re-send the whole cached
prefix (O(k^2) traffic over a micro-batch instead of O(k)).

Heads: the query heads of a TP rank (H / TP) must divide by C. K/V groups (G / TP per TP rank)
either divide by C, or C divides by them: then each group is repeated C / (G / TP) times before
the all-to-all, so every CP rank receives the one group its query heads read (autograd sums the
repeats' gradients back into the group). Load balance is automatic: every rank computes the full
causal pattern of the span for its heads.

Every CP rank of a pipeline stage runs the same program, so all of them issue these all-to-alls in
the same order (forward: three before attention, one after; backward: the same four, mirrored;
a recomputed forward re-issues its forward's, inside the backward).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from seq1f1b.plan.context_parallel import check_heads
from seq1f1b.runtime.attention import SpanAttention

CP_COMM_TYPES = ("a2a",)
"""The --cp-comm-type values span schedules run: see the module docstring for why not p2p."""


def check_comm_type(cp_comm_type: Optional[str]) -> None:
    """Refuse a --cp-comm-type other than a2a (ValueError, one line)."""
    if cp_comm_type not in (None, *CP_COMM_TYPES):
        raise ValueError(f"--cp-comm-type {cp_comm_type}: span schedules run context "
                         "parallelism as a2a only (a ring would re-send the cached K/V prefix "
                         "for every span)")


class _AllToAll(torch.autograd.Function):
    """Split `x` into C chunks along `scatter_dim`, send chunk r to CP rank r, concatenate what
    the ranks sent along `gather_dim` (in rank order). The backward is the same exchange with the
    two dims swapped: the adjoint of a permutation of blocks."""

    @staticmethod
    def forward(ctx, x: Tensor, scatter_dim: int, gather_dim: int, group) -> Tensor:
        ctx.scatter_dim, ctx.gather_dim, ctx.group = scatter_dim, gather_dim, group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None, None


def _exchange(x: Tensor, scatter_dim: int, gather_dim: int, group) -> Tensor:
    size = group.size()
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group) -> Tensor:
    """Differentiable all-to-all over `group` (see _AllToAll)."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def head_sharded_config(config: TransformerConfig, cp: int) -> TransformerConfig:
    """The config the per-rank span attention sees: one CP rank, H / C heads and the K/V groups
    it holds after replication (what a TE backend sizes itself with)."""
    groups_per_tp = config.num_query_groups // config.tensor_model_parallel_size
    inner = copy.copy(config)
    inner.context_parallel_size = 1
    inner.num_attention_heads = config.num_attention_heads // cp
    inner.num_query_groups = config.tensor_model_parallel_size * max(groups_per_tp // cp, 1)
    return inner


class ContextParallelSpanAttention(SpanAttention):
    """`SpanAttention` for sequence-sharded q, k, v: all-to-all to head-sharded, the span
    attention of this rank's heads, all-to-all back (see the module docstring).

    Takes what `SpanAttention` takes (megatron passes them by keyword); `pg_collection.cp` (else
    megatron's context-parallel group from parallel_state) is the group the all-to-alls run on,
    and `cp_comm_type` must be a2a (or unset)."""

    def __init__(self, config: TransformerConfig, *args, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None, **kwargs) -> None:
        check_comm_type(cp_comm_type)
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group()
        cp = cp_group.size()
        check_heads(config.num_attention_heads, config.num_query_groups,
                    config.tensor_model_parallel_size, cp)
        super().__init__(head_sharded_config(config, cp), *args, pg_collection=pg_collection,
                         **kwargs)
        self.cp_group = cp_group
        groups = config.num_query_groups // config.tensor_model_parallel_size
        self.kv_repeats = max(cp // groups, 1)

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Optional[Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params=None) -> Tensor:
        if self.kv_repeats > 1:   # fewer K/V groups than CP ranks: each rank gets its group
            key = key.repeat_interleave(self.kv_repeats, dim=2)
            value = value.repeat_interleave(self.kv_repeats, dim=2)
        group = self.cp_group
        query, key, value = (all_to_all(t, 2, 0, group) for t in (query, key, value))
        output = super().forward(query, key, value, attention_mask, attn_mask_type,
                                 attention_bias, packed_seq_params)
        s, b = output.shape[:2]
        heads = output.view(s, b, query.size(2), query.size(3))
        return all_to_all(heads, 0, 2, group).reshape(s // group.size(), b, -1)
