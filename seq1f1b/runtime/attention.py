"""Span-aware causal core attention for megatron-core, with interchangeable kernels.

`SpanAttention` plugs into a layer spec as
`spec.submodules.self_attention.submodules.core_attention` (megatron's `Attention` builds it with
the keyword arguments of `DotProductAttention` and calls it after RoPE with query/key/value as
[seq, batch, heads (or query groups) per TP partition, head_dim]); it returns [seq, batch,
heads * head_dim] like `DotProductAttention`.

Outside a span (`current_span()` is None) it is plain causal attention over the given sequence.
Inside span j of a micro-batch (tokens [start, end)), it writes the span's K/V into rows
[start, end) of its layer's cache buffers (kv_cache.py) and attends over rows [0, end), i.e. the
earlier spans' K/V followed by its own, with the *bottom-right* aligned causal mask (query row t
sees keys <= start + t).

Exact gradients without a second copy of K/V and without re-running the forward:
`_CachedSpanAttention` runs the kernel on detached leaves (q and the buffer views) and keeps that
inner graph, so the kernel saves what it needs (the K/V views share the cache's storage) and its
own backward runs; the dK/dV of rows [0, start) go to the cache's accumulators for the earlier
spans, rows [start, end) plus what the later spans left there are span j's K/V gradient. Under
selective recompute of core attention (`SpanSelfAttention`) it keeps q alone and re-runs the
kernel in the backward, dropout replayed from the saved RNG states.

Kernels (`--attention-backend`): eager (explicit mask, the reference), sdpa (torch SDPA with
`causal_lower_right`; `is_causal=True` would be top-left aligned, wrong for spans; on sm90+ GPUs
a span with a cached prefix runs as two cuDNN calls merged by log-sum-exp instead,
merged_attention.py: 11.7 -> 7.9 ms for a 4K span of 16K on an H200), flash
(flash-attn >= 2.1, whose causal=True is bottom-right aligned; public `flash_attn_func` only),
te (Transformer Engine, attn_mask_type "causal_bottom_right"), flex (FlexAttention, compiled once
for every span shape; trains on GPUs only: torch has no CPU backward for it), and auto (flash > te >
sdpa, the first available). The CPU CI trains with eager and sdpa and runs flex's compiled forward;
flash, te and flex's backward are written against their public APIs and checked on a GPU by
tools/device_check.py. Optional packages are looked up at run time, never imported at import time.

An explicit `attention_mask` (megatron's convention: bool, True = masked out) replaces the causal
mask, as in `DotProductAttention`. Its shape is [b or 1, 1, sq, sk] with sk = the number of keys
seen: inside span [start, end) that is the full-sequence mask sliced to [..., start:end, :end].
Only eager and sdpa take one (auto falls back to sdpa for such calls).

Document masking (`--reset-attention-mask`, runtime/documents.py): the attention mask may instead be
the micro-batch's document ids (integer [b, 1, 1, s], the whole sample's). Span [start, end)'s
queries then see only the keys of their own document, in the cache and in the span: eager gets a
(span x prefix) bool mask, sdpa the same as an additive float mask, flex a document BlockMask,
flash its varlen kernel over the span's documents (`flash_attn_varlen_func`, one call per row on
views of the cache, cu_seqlens per document from the host copy of the ids: untested without a
GPU), each built once per span and shared by the layers. TE refuses them (auto then takes flex
on a GPU, sdpa on the CPU). The cache keeps the keys of
documents that ended before the span (its buffers are the whole sequence's); only flash skips
them in compute.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import importlib.metadata
import importlib.util
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from packaging.version import Version
from torch import Tensor

from seq1f1b.runtime.documents import (
    _FLEX_BLOCK,
    additive_mask,
    check_document_ids,
    document_block_mask,
    host_document_ids,
    is_document_ids,
    memoised,
    span_document_mask,
    tile_block_mask,
    varlen_layout,
)
from seq1f1b.runtime.kv_cache import SpanContext, current_span, tensors_of
from seq1f1b.runtime.merged_attention import cudnn_merge_refusal, merged_span_attention
from seq1f1b.runtime.sdpa_dispatch import check_sdpa_kernel

BACKENDS = ("auto", "eager", "sdpa", "flex", "flash", "te")
_MEGATRON_BACKEND_NAMES = {"local": "eager", "unfused": "eager", "fused": "te"}
_AUTO_ORDER = ("flash", "te", "sdpa")
_MASKED_BACKENDS = ("eager", "sdpa")
DOCUMENT_BACKENDS = ("eager", "sdpa", "flex", "flash")
"""The backends that mask documents (--reset-attention-mask); TE is refused."""
_MIN_FLASH_ATTN = Version("2.1")

# A kernel: (q, k, v as [s, b, heads, d]; mask or None = bottom-right causal; scale; dropout)
# -> [sq, b, heads * d]. Differentiable with plain autograd. The mask is the backend's own form:
# bool True = masked (eager), bool or additive float (sdpa), BlockMask (flex), VarlenLayout (flash).
Kernel = Callable[[Tensor, Tensor, Tensor, Optional[object], float, float], Tensor]


# ----------------------------------------------------------------------------- backend choice

def backend_unavailable_reason(name: str, config: TransformerConfig) -> Optional[str]:
    """Why backend `name` cannot run here with `config`, or None when it can."""
    if name in ("eager", "sdpa"):
        return None
    if name == "flex":
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            return f"torch {torch.__version__} has no FlexAttention"
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if name == "flash":
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed"
        try:
            version = Version(importlib.metadata.version("flash-attn"))
        except importlib.metadata.PackageNotFoundError:
            return "flash-attn is importable but has no package metadata (version unknown)"
        if version < _MIN_FLASH_ATTN:
            return f"needs flash-attn >= {_MIN_FLASH_ATTN} (bottom-right causal), found {version}"
        if not (config.fp16 or config.bf16):
            return "flash-attn kernels need --fp16 or --bf16"
        return None
    if name == "te":
        if importlib.util.find_spec("transformer_engine") is None:
            return "transformer-engine is not installed"
        return None
    raise ValueError(f"--attention-backend {name!r} is not one of {', '.join(BACKENDS)}")


def resolve_backend(name: str, config: TransformerConfig) -> str:
    """The concrete backend for `--attention-backend name` (auto: the fastest available).

    Megatron's own names are accepted too: local/unfused -> eager, fused -> te.
    """
    name = _MEGATRON_BACKEND_NAMES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name == "auto":
        return next(n for n in _AUTO_ORDER if backend_unavailable_reason(n, config) is None)
    reason = backend_unavailable_reason(name, config)
    if reason is not None:
        raise ValueError(f"--attention-backend {name} is unavailable: {reason}")
    return name


# ----------------------------------------------------------------------------- mask caches

class _ShapeCache:
    """Masks kept across iterations, one per span shape (least recently used dropped past
    `size`): an lru_cache whose contents the memory meter can see (`cached_mask_tensors`)."""

    def __init__(self, build: Callable, size: int) -> None:
        self.build, self.size = build, size
        self.entries: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
        functools.update_wrapper(self, build)
        _SHAPE_CACHES.append(self)

    def __call__(self, *key):
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        value = self.entries[key] = self.build(*key)
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


_SHAPE_CACHES: list[_ShapeCache] = []


def _shape_cached(size: int) -> Callable[[Callable], _ShapeCache]:
    return lambda build: _ShapeCache(build, size)


def cached_mask_tensors() -> list[Tensor]:
    """Every tensor the shape-keyed mask caches hold now (the memory meter counts them)."""
    return [t for cache in _SHAPE_CACHES for form in cache.entries.values()
            for t in tensors_of(form)]


# ----------------------------------------------------------------------------- kernels

def bottom_right_causal_mask(sq: int, sk: int, device: torch.device | str = "cpu") -> Tensor:
    """[sq, sk] bool mask, True = masked out: query row t sees keys <= (sk - sq) + t."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


def _heads_first(t: Tensor) -> Tensor:
    return t.permute(1, 2, 0, 3)  # [s, b, n, d] -> [b, n, s, d]


def _merge_heads(out: Tensor) -> Tensor:
    b, n, s, d = out.shape  # [b, n, s, d] -> [s, b, n * d]
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _eager(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
           dropout_p: float) -> Tensor:
    q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
    groups = q.size(1) // k.size(1)
    if groups > 1:  # GQA: query head h reads key/value group h // groups, as in megatron
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if mask is None:
        mask = bottom_right_causal_mask(q.size(2), k.size(2), q.device)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    probs = torch.softmax(scores.float().masked_fill(mask, float("-inf")), dim=-1).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return _merge_heads(torch.matmul(probs, v))


@_shape_cached(32)
def _additive_causal_mask(sq: int, sk: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[sq, sk] additive bottom-right causal mask (0 = seen, -inf = masked), one per span shape.

    On the CPU, SDPA turns any boolean or `causal_lower_right` mask into such a float tensor on
    every call and its kernel saves it for backward: a quadratic sq x sk tensor per layer and
    span. Shared, the layers of a span save one storage (kept here across iterations)."""
    mask = torch.zeros(sq, sk, dtype=dtype, device=device)
    return mask.masked_fill_(bottom_right_causal_mask(sq, sk, device), float("-inf"))


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
          dropout_p: float) -> Tensor:
    sq, sk = q.size(0), k.size(0)
    gqa = q.size(2) != k.size(2)
    q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
    if mask is not None:
            allowed = mask if mask.is_floating_point() else ~mask
    elif sq == sk:      # square: bottom-right and top-left alignment agree
        check_sdpa_kernel(q, k, v, None, is_causal=True)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                             scale=scale, enable_gqa=gqa)
        return _merge_heads(out)
    elif q.device.type == "cpu":
        allowed = _additive_causal_mask(sq, sk, q.dtype, q.device)
    elif cudnn_merge_refusal(q, k, v, dropout_p) is None:     # sm90+: two cuDNN calls
        return _merge_heads(merged_span_attention(q, k, v, scale))
    else:               # CUDA: flash-2 applies it without a materialised mask
        from torch.nn.attention.bias import causal_lower_right   # imports dynamo: CUDA only
        allowed = causal_lower_right(sq, sk)
    # On CUDA the causal case passes causal_lower_right, which holds no mask tensor.
    check_sdpa_kernel(q, k, v, allowed if mask is not None else None)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                         scale=scale, enable_gqa=gqa)
    return _merge_heads(out)


def _flash(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
           dropout_p: float) -> Tensor:
    from flash_attn import flash_attn_func  # >= 2.1: causal=True is bottom-right aligned

    sq, b = q.shape[:2]
    out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                          dropout_p=dropout_p, softmax_scale=scale, causal=True)
    return out.transpose(0, 1).reshape(sq, b, -1)


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, layout, scale: float,
                  dropout_p: float) -> Tensor:
    """flash-attn's varlen kernel over the document segments of a span, one call per batch row
    (documents.py's VarlenLayout): the row's queries, and its keys from its first document on
    as a view of the KV cache. flash-attn takes any row stride (only the last dimension must be
    contiguous), so the kernel saves views of the cache for its backward, not a gathered copy of
    the prefix per layer and span."""
    from flash_attn import flash_attn_varlen_func

    sq, b = q.shape[:2]
    outs = [flash_attn_varlen_func(
        q[:, r], k[row.first:, r], v[row.first:, r], row.cu_seqlens_q, row.cu_seqlens_k,
        row.max_seqlen_q, row.max_seqlen_k, dropout_p=dropout_p, softmax_scale=scale,
        causal=True) for r, row in enumerate(layout.rows)]
    return torch.stack(outs, dim=1).reshape(sq, b, -1)


def _bottom_right_mask_mod(shift: Tensor):
    """Query row t sees keys <= t + shift; `shift` (sk - sq) is a 0-d tensor, so the function is
    the same for every span shape and compiled flex takes the shift as an input, not a constant
    to specialise (and recompile) on."""
    def bottom_right_causal(batch, head, q_idx, kv_idx):
        return kv_idx <= q_idx + shift

    return bottom_right_causal


@_shape_cached(64)
def _flex_block_mask(sq: int, sk: int, device: torch.device):
    """The bottom-right causal BlockMask of sq queries over sk keys, one per span shape.

    Built from tile arithmetic: `create_block_mask` without compilation would evaluate the mask
    densely, at least [sq, sk] bools per span shape (1 GiB for an unsplit 32K sequence). Tiles are
    classed as `create_block_mask` classes them: full when every entry is seen and the tile lies
    inside [sq, sk] (the mask is not evaluated there), partial when some entry is seen.
    """
    shift = sk - sq
    first_q = torch.arange(0, sq, _FLEX_BLOCK, device=device)[:, None]
    first_k = torch.arange(0, sk, _FLEX_BLOCK, device=device)[None, :]
    last_q = (first_q + _FLEX_BLOCK).clamp(max=sq) - 1
    seen = (first_k <= last_q + shift)[None]
    full = ((first_k + _FLEX_BLOCK - 1 <= first_q + shift)
            & (first_q + _FLEX_BLOCK <= sq) & (first_k + _FLEX_BLOCK <= sk))[None]
    return tile_block_mask(seen, full, _bottom_right_mask_mod(torch.full((), shift,
                                                                         device=device)),
                           (sq, sk))


@functools.lru_cache(maxsize=1)
def _compiled_flex_attention():
    """flex_attention compiled for every span shape at once.

    Uncompiled (or past dynamo's recompile limit, 8, where torch falls back to it) flex runs its
    reference path, which materialises the [sq, sk] score matrix: out of memory at 32K. With
    dynamic shapes and a mask function that is the same for every shape, the k span shapes
    share one graph per grad mode (the square span 0 a second: dynamo's duck sizing specialises
    sq == sk), so training plus evaluation stay within 4 graphs whatever k.
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def _flex(q: Tensor, k: Tensor, v: Tensor, mask, scale: float, dropout_p: float) -> Tensor:
    q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
    block_mask = mask if mask is not None else _flex_block_mask(q.size(2), k.size(2), q.device)
    attend = _compiled_flex_attention()
    if mask is not None and q.device.type == "cpu":
        # A document mask reads the ids tensor, and inductor's CPU flex template miscompiles such
        # mask functions (torch 2.13: C++ errors, or wrong rows); the CPU runs flex forward only
        # anyway, so it takes flex's reference path here (span x prefix scores).
        from torch.nn.attention.flex_attention import flex_attention as attend
    out = attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.size(1) != k.size(1))
    return _merge_heads(out)


_KERNELS: dict[str, Kernel] = {"eager": _eager, "sdpa": _sdpa, "flash": _flash, "flex": _flex}
_DOCUMENT_KERNELS: dict[str, Kernel] = {**_KERNELS, "flash": _flash_varlen}


def attention_kernel(backend: str) -> Kernel:
    """The bare kernel of `backend` (not te, a module): q [sq, b, h, d] against k, v
    [sk, b, hk, d], bottom-right causal when given no mask, output [sq, b, h*d]; what a span's
    attention calls once it holds the span's keys (the device check's baseline without a cache)."""
    return _KERNELS[backend]


def _document_form(backend: str, ids: Tensor, start: int, end: int, dtype: torch.dtype):
    """Span [start, end)'s document mask in `backend`'s form, once per span (documents.py)."""
    if backend == "eager":
        return memoised(("eager", start, end), lambda: span_document_mask(ids, start, end))
    if backend == "sdpa":
        return memoised(("sdpa", start, end, dtype),
                        lambda: additive_mask(span_document_mask(ids, start, end), dtype))
    if backend == "flex":
        return memoised(("flex", start, end), lambda: document_block_mask(ids, start, end))
    return memoised(("flash", start, end),
                    lambda: varlen_layout(host_document_ids(ids), start, end, ids.device))


def _build_te_attention(config: TransformerConfig, layer_number: int, dropout_p: float,
                        softmax_scale: float, tp_group) -> torch.nn.Module:
    """TE's DotProductAttention on the cache's own layout, sbhd, whose prefix views K/V[0:end]
    each of TE's sub-backends reads in place with one sequence per micro-batch (the paper's
    setting). Its cuDNN sub-backend derives the strides from the declared layout and the shape
    (so it needs exactly the contiguous views the cache hands out); its flash sub-backend turns
    sbhd into bshd with `x.transpose(0, 1).contiguous()`, which is the same storage when b = 1.
    With b > 1 that is a copy of the prefix, saved for backward (about (k+1)/2 x L of K/V per
    layer): no layout avoids it for both sub-backends, since a bshd buffer's prefix view has
    the whole sequence's batch stride, which cuDNN's canonical strides would misread."""
    import transformer_engine.pytorch as te_pytorch

    tracker = tensor_parallel.get_cuda_rng_tracker
    return te_pytorch.DotProductAttention(
        num_attention_heads=config.num_attention_heads, kv_channels=config.kv_channels,
        num_gqa_groups=config.num_query_groups, attention_dropout=dropout_p,
        qkv_format="sbhd", attn_mask_type="causal_bottom_right",
        sequence_parallel=config.sequence_parallel, tp_size=config.tensor_model_parallel_size,
        get_rng_state_tracker=tracker if tracker().is_initialized() else None,
        tp_group=tp_group, layer_number=layer_number, softmax_scale=softmax_scale)


# ----------------------------------------------------------------------------- RNG replay

@dataclass
class _RngStates:
    """The generator states dropout reads: CPU, CUDA (when present) and megatron's tracker."""

    cpu: Tensor
    cuda: Optional[Tensor]
    tracker: dict

    @classmethod
    def capture(cls) -> "_RngStates":
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return cls(torch.get_rng_state(), cuda,
                   tensor_parallel.get_cuda_rng_tracker().get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(self.tracker))


@contextlib.contextmanager
def _replaying(states: Optional[_RngStates]) -> Iterator[None]:
    """Run the block with the RNG as it was at `states`, then put the current RNG back."""
    if states is None:
        yield
        return
    now = _RngStates.capture()
    states.restore()
    try:
        yield
    finally:
        now.restore()


# ----------------------------------------------------------------------------- span attention

class _CachedSpanAttention(torch.autograd.Function):
    """Attention of span [start, end) over rows [0, end) of its layer's K/V buffers.

    Inputs: attend (q, K, V -> out), the layer's `LayerKV`, start, end, replay RNG states (None,
    or the states to replay when `recompute`), recompute, then q, k, v of the span. Forward writes
    k/v into the buffers. Without `recompute` it runs the kernel with grad on detached leaves (q and
    the buffer views) and keeps that inner graph: the kernel saves what it needs (q, the K/V views,
    which share the cache's storage, its output and softmax statistics) and the backward is the
    kernel's own. With `recompute` (selective recompute of core attention) it keeps only q and
    re-runs the kernel in backward, RNG replayed for dropout. Backward returns the span's complete
    dK/dV through `LayerKV.route_grads`.
    """

    @staticmethod
    def forward(ctx, attend, layer_kv, start, end, rng_states, recompute, query, key, value):
        layer_kv.write(start, end, key, value)
        ctx.layer_kv, ctx.start, ctx.end = layer_kv, start, end
        ctx.attend, ctx.rng_states = attend, rng_states
        if recompute:
            ctx.save_for_backward(query)
            ctx.inner = None
            return attend(query, *layer_kv.views(end))
        ctx.inner = _leaves_and_output(attend, query, *layer_kv.views(end),
                                       ctx.needs_input_grad[6])
        return ctx.inner[-1].detach()

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.inner is None:
            (query,) = ctx.saved_tensors
            with _replaying(ctx.rng_states):
                inner = _leaves_and_output(ctx.attend, query, *ctx.layer_kv.views(ctx.end),
                                           ctx.needs_input_grad[6])
        else:
            inner, ctx.inner = ctx.inner, None
        *leaves, output = inner
        wanted = [t for t in leaves if t.requires_grad]
        grads = dict(zip(map(id, wanted), torch.autograd.grad(output, wanted, grad_output)))
        query, key, value = leaves
        grad_key, grad_value = ctx.layer_kv.route_grads(ctx.start, ctx.end, grads[id(key)],
                                                        grads[id(value)])
        return None, None, None, None, None, None, grads.get(id(query)), grad_key, grad_value


def _leaves_and_output(attend, query: Tensor, keys: Tensor, values: Tensor,
                       query_needs_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, K, V leaves, attend's output with its graph over them)."""
    leaves = (query.detach().requires_grad_(query_needs_grad),
              keys.detach().requires_grad_(), values.detach().requires_grad_())
    with torch.enable_grad():
        return (*leaves, attend(*leaves))


def _check_config(config: TransformerConfig, attn_mask_type: AttnMaskType,
                  attention_type: str) -> None:
    unsupported = {
        "cross attention": attention_type != "self",
        f"attn_mask_type {attn_mask_type.name} (causal only)":
            attn_mask_type != AttnMaskType.causal,
        "context parallelism": config.context_parallel_size != 1,
        "sliding-window attention": config.window_size is not None,
        f"softmax_type {config.softmax_type}": config.softmax_type != "vanilla",
    }
    found = [what for what, bad in unsupported.items() if bad]
    if found:
        raise NotImplementedError(f"SpanAttention does not support {', '.join(found)}")


class SpanAttention(MegatronModule):
    """Causal core attention that understands Seq1F1B spans (see the module docstring).

    The constructor takes what megatron's `Attention` passes to `core_attention` plus `backend`;
    put `functools.partial(SpanAttention, backend=name)` in a spec to choose the kernel.
    `apply_query_key_layer_scaling` needs nothing here: it divides the scale by the layer number
    and multiplies the scores back inside megatron's softmax, the same product.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None,
                 backend: str = "auto") -> None:
        super().__init__(config=config)
        _check_config(config, attn_mask_type, attention_type)
        self.layer_number = max(1, layer_number)
        self.requested_backend = backend
        self.backend = resolve_backend(backend, config)
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else softmax_scale)
        self.dropout_p = (config.attention_dropout if attention_dropout is None
                          else attention_dropout)
        if self.backend == "flex" and self.dropout_p > 0:
            raise ValueError("--attention-backend flex has no attention dropout: "
                             "set --attention-dropout 0")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        # Set by `SpanSelfAttention` under selective recompute of core attention: inside a span,
        # keep q only and re-run the kernel in backward (see _CachedSpanAttention).
        self.recompute_in_backward = False
        self.te_attention = (
            _build_te_attention(config, self.layer_number, self.dropout_p, self.softmax_scale,
                                pg_collection.tp)
            if self.backend == "te" else None)

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Optional[Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params=None) -> Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SpanAttention takes neither packed sequences nor an "
                                      "attention bias")
        ctx = current_span()
        if ctx is not None and ctx.cache is not None:
            return self._span_forward(ctx, query, key, value, attention_mask)
        if ctx is not None and ctx.start != 0:
            raise RuntimeError(f"span {ctx.span} starts at token {ctx.start} but has no KV cache: "
                               f"only a span starting at 0 can attend without one")
        return self._attend_fn(attention_mask, query, key.size(0))(query, key, value)

    def _span_forward(self, ctx: SpanContext, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor]) -> Tensor:
        if query.size(0) != ctx.length:
            raise RuntimeError(f"span {ctx.span} holds {ctx.length} tokens, attention got "
                               f"{query.size(0)} queries")
        layer_kv = ctx.cache.layer(self, key, value)
        attend = self._attend_fn(attention_mask, query, ctx.end)
        if not (torch.is_grad_enabled() and ctx.cache.requires_grad):
            layer_kv.write(ctx.start, ctx.end, key, value)
            return attend(query, *layer_kv.views(ctx.end))
        recompute = self.recompute_in_backward
        rng_states = _RngStates.capture() if recompute and self._dropout_p() > 0 else None
        return _CachedSpanAttention.apply(attend, layer_kv, ctx.start, ctx.end, rng_states,
                                          recompute, query, key, value)

    def _dropout_p(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _attend_fn(self, mask: Optional[Tensor], query: Tensor,
                   num_keys: int) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """(q, K, V) -> attention output, with this call's mask, kernel and dropout RNG."""
        backend, kernels = self.backend, _KERNELS
        if is_document_ids(mask):
            check_document_ids(mask, num_keys)
            backend = self._document_backend()
            mask = _document_form(backend, mask, num_keys - query.size(0), num_keys, query.dtype)
            kernels = _DOCUMENT_KERNELS
        elif mask is not None:
            _check_mask(mask, query.size(0), num_keys)
            backend = self._backend_among(_MASKED_BACKENDS, "takes no explicit attention mask")
        if backend == "flex" and query.device.type == "cpu" and torch.is_grad_enabled() \
                and query.requires_grad:
            raise RuntimeError("--attention-backend flex trains on GPUs only (torch's "
                               "FlexAttention has no CPU backward); use sdpa or eager")
        dropout_p = self._dropout_p()
        if backend == "te":  # TE applies dropout itself, forking megatron's RNG tracker
            return lambda q, k, v: self.te_attention(q, k, v, attn_mask_type="causal_bottom_right")
        kernel = kernels[backend]

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            with self._dropout_rng(dropout_p):
                return kernel(q, k, v, mask, self.softmax_scale, dropout_p)

        return attend

    def _document_backend(self) -> str:
        """The backend that masks documents for this layer: its own when it can; under auto on
        a GPU flex (tile tables, no (span x prefix) mask, and no math fallback: CUDA's SDPA
        runs a float mask with grouped-query attention on its math kernel), unless attention
        dropout is on, which flex lacks; sdpa otherwise."""
        if self.backend in DOCUMENT_BACKENDS or self.requested_backend != "auto":
            return self._backend_among(DOCUMENT_BACKENDS, "cannot mask documents "
                                                          "(--reset-attention-mask)")
        if torch.cuda.is_available() and self.dropout_p == 0 \
                and backend_unavailable_reason("flex", self.config) is None:
            return "flex"
        return "sdpa"

    def _backend_among(self, supported: tuple[str, ...], refusal: str) -> str:
        """This layer's backend if it is one of `supported`, else sdpa under auto; a backend the
        user named that cannot do it is refused in one line."""
        if self.backend in supported:
            return self.backend
        if self.requested_backend != "auto":
            raise ValueError(f"--attention-backend {self.backend} {refusal}; use "
                             f"{', '.join(supported)}")
        return "sdpa"

    def _dropout_rng(self, dropout_p: float):
        # As DotProductAttention: the tensor-parallel RNG stream unless sequence parallel is on.
        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


class SpanSelfAttention(SelfAttention):
    """megatron's `SelfAttention`, whose selective recompute of core attention inside a span is
    done by `SpanAttention` itself.

    megatron's checkpoint would save q, k and v (v a view that keeps the whole fused QKV output
    alive) although the span's K/V are in the cache anyway; `SpanAttention` with
    `recompute_in_backward` keeps only q and re-runs its kernel in the backward, RNG replayed.
    Outside spans (a whole-sequence forward) megatron's own checkpoint runs.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.core_attention, SpanAttention):
            self.core_attention.recompute_in_backward = self.checkpoint_core_attention

    def _checkpointed_attention_forward(self, query, key, value, attention_mask,
                                        rotary_pos_emb=None, attn_mask_type=None,
                                        attention_bias=None, packed_seq_params=None):
        ctx = current_span()
        if ctx is None or ctx.cache is None or not isinstance(self.core_attention, SpanAttention):
            return super()._checkpointed_attention_forward(
                query, key, value, attention_mask, rotary_pos_emb=rotary_pos_emb,
                attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                packed_seq_params=packed_seq_params)
        return self.core_attention(query, key, value, attention_mask,
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params)


def _check_mask(mask: Tensor, sq: int, sk: int) -> None:
    if mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape[-2:]) != (sq, sk):
        raise ValueError(f"attention_mask must be a bool tensor [b or 1, 1, {sq}, {sk}] (True = "
                         f"masked out; inside a span the full mask sliced to [..., start:end, :end]"
                         f"), got {mask.dtype} {tuple(mask.shape)}")
