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
built: per span at most a (span x prefix) mask (eager, sdpa), tile tables (flex) or cumulative
lengths read from the host copy of the ids the executor keeps (flash), and no host sync.

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
from seq1f1b.runtime.sdpa_dispatch import MASK_ROW_ALIGNMENT
from seq1f1b.strict_cuda import host_sync_allowed


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
    """Bool mask (True = masked) -> 0 / -inf of `dtype`, built once per span so the layers save
    one storage (CPU SDPA would build it from a bool mask on every call). Its rows are padded to
    `MASK_ROW_ALIGNMENT`: the result is a view of [..., round_up(keys, 8)], so CUDA's
    memory-efficient kernel takes it as it is instead of padding a copy per layer whenever a
    span's end is not a multiple of 8, as the compute and fit cuts make it (7B at 32K, k=4:
    19494, 26558)."""
    keys = mask.size(-1)
    padded = -(-keys // MASK_ROW_ALIGNMENT) * MASK_ROW_ALIGNMENT
    storage = torch.zeros((*mask.shape[:-1], padded), dtype=dtype, device=mask.device)
    view = storage[..., :keys]
    return view.masked_fill_(mask, float("-inf"))


_FLEX_BLOCK = 128
"""FlexAttention's default tile of a BlockMask: 128 queries x 128 keys."""


def block_rows(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """[batch or 1, query tiles, key tiles] bool -> BlockMask's row form (int32, a head
    dimension of 1): per query tile the number of marked key tiles, and the key tile indices
    with the marked ones first."""
    marked = tiles.to(torch.int32)
    counts = marked.sum(-1, dtype=torch.int32)
    order = torch.argsort(marked, dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None].contiguous(), order[:, None].contiguous()


def tile_block_mask(seen: Tensor, full: Tensor, mask_mod: Callable,
                    seq_lengths: tuple[int, int]):
    """A FlexAttention BlockMask from its tiles ([batch or 1, query tiles, key tiles] bool: some
    entry of the tile is seen; every entry is), the key-side tables and the query-side ones the
    backward reads alike, in `create_block_mask`'s order. Neither the mask nor torch's vmap-based
    transposition (`BlockMask.from_kv_blocks`) runs."""
    from torch.nn.attention.flex_attention import BlockMask

    partial = seen & ~full
    return BlockMask(seq_lengths, *block_rows(partial), *block_rows(full),
                     *block_rows(partial.transpose(-1, -2)), *block_rows(full.transpose(-1, -2)),
                     BLOCK_SIZE=(_FLEX_BLOCK, _FLEX_BLOCK), mask_mod=mask_mod)


def document_block_mask(ids: Tensor, start: int, end: int):
    """FlexAttention BlockMask of span [start, end) over keys [0, end) with documents, batch
    rows separate, built from tile arithmetic: evaluating the mask densely (`create_block_mask`)
    would make [b, span, end] bools and a padded copy per span, about 1 GiB at 32K.

    Document ids never decrease along a row, so for a query tile [qa, qb] and a key tile
    [ka, kb] (absolute positions): some query sees some key iff ka <= qb and the document of
    key min(kb, qb) is at least the document of qa (every document between those of qa and qb
    has tokens in the query tile, and each sees its own earlier keys); every query sees every
    key iff kb <= qa and key ka and query qb share a document. Tiles are classed as
    `create_block_mask` classes them (full only inside [span, end])."""
    device = ids.device
    docs = ids[:, 0, 0, :end]
    span = end - start
    first_q = torch.arange(0, span, _FLEX_BLOCK, device=device)
    first_k = torch.arange(0, end, _FLEX_BLOCK, device=device)
    last_q = (first_q + _FLEX_BLOCK).clamp(max=span) - 1 + start
    last_k = (first_k + _FLEX_BLOCK).clamp(max=end) - 1
    first_q = first_q + start
    reach = torch.minimum(last_k[None, :], last_q[:, None])            # [q tiles, k tiles]
    seen = ((first_k[None, :] <= last_q[:, None])
            & (docs[:, reach] >= docs[:, first_q][:, :, None]))
    inside = ((first_q - start + _FLEX_BLOCK <= span)[:, None]
              & (first_k + _FLEX_BLOCK <= end)[None, :])
    full = (seen & inside & (last_k[None, :] <= first_q[:, None])
            & (docs[:, first_k][:, None, :] == docs[:, last_q][:, :, None]))
    length = ids.size(-1)
    flat = ids.reshape(-1)          # one dimension: inductor's CPU flex template needs it
    # An input of compiled flex, not a constant; a fill, not a host-to-device copy.
    offset = torch.full((), start, dtype=torch.int64, device=device)

    def same_document_causal(batch, head, q_idx, kv_idx):
        query = q_idx + offset
        row = batch * length
        return (kv_idx <= query) & (flat[row + kv_idx] == flat[row + query])

    return tile_block_mask(seen, full, same_document_causal, (span, end))


@dataclass(frozen=True)
class VarlenRow:
    """flash-attn varlen form of one batch row of span [start, end): the row's queries against
    its keys from `first` (the start of the document the span's first query belongs to) to
    `end`, cut into that row's documents. Each query segment ends where its key segment ends,
    so flash's bottom-right causal mask is exactly document-causal. The keys are a view of the
    row in the KV cache (no gathered copy for the kernel to save)."""

    first: int
    cu_seqlens_q: Tensor            # int32 [segments + 1], on the device
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class VarlenLayout:
    rows: tuple[VarlenRow, ...]


def varlen_layout(host_ids: Tensor, start: int, end: int, device: torch.device) -> VarlenLayout:
    """Segments of span [start, end), per batch row, from document ids in host memory (flash's
    varlen API takes host max lengths): no device value is read, and the cumulative lengths go
    to the device as non-blocking copies (from pinned memory on a GPU)."""
    rows = []
    for row in host_ids[:, 0, 0, :end]:
        first = int((row < row[start]).sum())       # ids never decrease: the document's start
        inside = torch.nonzero(row[start + 1:] != row[start:-1]).flatten() + start + 1
        bounds = [first, *inside.tolist(), end]
        cu_q, cu_k = [0], [0]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            cu_q.append(cu_q[-1] + hi - max(lo, start))
            cu_k.append(cu_k[-1] + hi - lo)
        lengths_q = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
        lengths_k = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
        rows.append(VarlenRow(first, _to_device(cu_q, device), _to_device(cu_k, device),
                              max(lengths_q), max(lengths_k)))
    return VarlenLayout(tuple(rows))


def _to_device(values: list[int], device: torch.device) -> Tensor:
    host = torch.tensor(values, dtype=torch.int32)
    if torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def host_document_ids(ids: Tensor) -> Tensor:
    """The running micro-batch's document ids in host memory: the copy the executor took from
    the data loader (no sync), else `ids` read back once per micro-batch and chunk (a deliberate
    host sync: data iterators that yield device tensors pay it) and kept in its KV cache;
    outside a span, `ids` read back."""
    ctx = current_span()
    cache = ctx.cache if ctx is not None else None
    if cache is not None and cache.host_document_ids is not None \
            and cache.host_document_ids.shape == ids.shape:
        return cache.host_document_ids
    with host_sync_allowed():           # ids on the device: one read-back per micro-batch
        host = ids.cpu()
    if cache is not None:
        cache.host_document_ids = host
    return host
