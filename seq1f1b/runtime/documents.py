"""Document masking for packed samples: which keys a span's queries may see, per backend.

A packed sample holds several documents, each closed by an EOD token (megatron-core's rule in
`_get_ltor_masks_and_position_ids`: the EOD belongs to the document it ends, the token after it
starts a new one). With `--reset-attention-mask` a token attends only to earlier tokens of its own
document; with `--reset-position-ids` its position restarts at 0 with each document.

What travels with the data is one small tensor per micro-batch, the **document ids**: int32
[b, 1, 1, s], the index of each token's document within its sample (the number of EODs before
it). It is the micro-batch's `attention_mask`, so it reaches every layer of every stage the way
megatron's mask does (users' forward steps pass it unchanged; megatron's full recompute saves it
as a tensor), and the span slicer passes it whole: span [start, end) needs the ids of its queries
[start, end) and of its keys [0, end). megatron's own form, a [b, 1, s, s] bool mask, is never
built: per span at most a (span x prefix) mask, and none for flash.

`span_document_mask` and friends derive each backend's form for span [start, end); inside a span
they are memoised in the micro-batch's KV cache (`MicrobatchKVCache.derived`), so every layer of
the chunk reuses one per span (and a recomputed forward or the backward finds it again).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional

import torch
from torch import Tensor

from seq1f1b.runtime.kv_cache import current_span


def document_ids(tokens: Tensor, eod: int) -> Tensor:
    """[b, s] tokens -> [b, 1, 1, s] int32 document index of each token (EODs before it)."""
    ends = (tokens == eod).to(torch.int32)
    return (ends.cumsum(-1, dtype=torch.int32) - ends)[:, None, None, :]


def document_positions(ids: Tensor) -> Tensor:
    """[b, 1, 1, s] document ids -> [b, s] int64 positions restarting at 0 with each document
    (megatron-core's reset position ids)."""
    ids = ids[:, 0, 0, :]
    index = torch.arange(ids.size(-1), device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


def is_document_ids(mask: Optional[Tensor]) -> bool:
    """Whether an attention mask is the compact document-id form (integer [b, 1, 1, s]) rather
    than megatron's bool [b or 1, 1, sq, sk] mask."""
    return (isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[1:3] == (1, 1)
            and not mask.dtype.is_floating_point and mask.dtype != torch.bool)


def check_document_ids(ids: Tensor, num_keys: int) -> None:
    """Document ids must cover at least the keys a call sees (the whole sample's tokens)."""
    if ids.size(-1) < num_keys:
        raise ValueError(f"document ids hold {ids.size(-1)} tokens, attention sees {num_keys} "
                         f"keys: pass the whole sample's ids, not a span's")


def memoised(key: Hashable, build: Callable[[], object]) -> object:
    """`build()` once per running span (kept in its micro-batch's KV cache), every call outside
    a span (the unsplit model)."""
    ctx = current_span()
    if ctx is None or ctx.cache is None:
        return build()
    derived = ctx.cache.derived
    if key not in derived:
        derived[key] = build()
    return derived[key]


def span_document_mask(ids: Tensor, start: int, end: int) -> Tensor:
    """[b, 1, end - start, end] bool, True = masked: query start + t sees key u iff u <= start + t
    and both lie in the same document."""
    keys = ids[..., :end]                                   # [b, 1, 1, end]
    queries = ids[..., start:end].transpose(-1, -2)         # [b, 1, span, 1]
    query_pos = torch.arange(start, end, device=ids.device)[:, None]
    key_pos = torch.arange(end, device=ids.device)[None, :]
    return (keys != queries) | (key_pos > query_pos)


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True = masked) -> 0 / -inf of `dtype`: what CPU SDPA would build from a bool
    mask on every call; built once per span, the layers save one storage."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask,
                                                                                float("-inf"))


def document_block_mask(ids: Tensor, start: int, end: int):
    """FlexAttention BlockMask of span [start, end) over keys [0, end) with documents: evaluated
    per span ([b, span, end] bools once, not per layer), batch rows separate."""
    from torch.nn.attention.flex_attention import create_block_mask

    length = ids.size(-1)
    flat = ids.reshape(-1)          # one dimension: inductor's CPU flex template needs it
    offset = torch.tensor(start, device=ids.device)   # an input of compiled flex, not a constant

    def same_document_causal(batch, head, q_idx, kv_idx):
        query = q_idx + offset
        row = batch * length
        return (kv_idx <= query) & (flat[row + kv_idx] == flat[row + query])

    return create_block_mask(same_document_causal, ids.size(0), None, end - start, end,
                             device=ids.device)


@dataclass(frozen=True)
class VarlenLayout:
    """flash-attn varlen form of span [start, end): the span's queries of all rows packed
    ([b * span] in row order), keys of row r packed from `key_from[r]` (the start of the first
    document the span's queries belong to) to `end`, and per (row, document) segment
    cumulative lengths. Each query segment ends where its key segment ends, so flash's
    bottom-right causal mask is exactly document-causal."""

    cu_seqlens_q: Tensor            # int32 [segments + 1]
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    key_index: Tensor               # int64 [packed keys]: row * end + key position


def varlen_layout(ids: Tensor, start: int, end: int) -> VarlenLayout:
    """Segments of span [start, end) from the document ids, read on the host once per span
    (flash-attn's varlen API takes host max lengths; the ids are tiny)."""
    rows = ids[:, 0, 0, :end].cpu()
    cu_q, cu_k, keys = [0], [0], []
    max_q = max_k = 0
    for r, row in enumerate(rows):
        first = int((row < row[start]).sum())       # ids never decrease: the document's start
        inside = torch.nonzero(row[start + 1:] != row[start:-1]).flatten() + start + 1
        bounds = [first, *inside.tolist(), end]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            q_len, k_len = hi - max(lo, start), hi - lo
            cu_q.append(cu_q[-1] + q_len)
            cu_k.append(cu_k[-1] + k_len)
            max_q, max_k = max(max_q, q_len), max(max_k, k_len)
        keys.append(torch.arange(first, end) + r * end)
    def on_device(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32, device=ids.device)

    return VarlenLayout(on_device(cu_q), on_device(cu_k), max_q, max_k,
                        torch.cat(keys).to(ids.device))
