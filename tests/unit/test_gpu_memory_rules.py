"""What a GPU would hold or do on the document and SDPA paths, checked on the CPU (issue 24).

- flash's varlen path saves views of the KV cache, not a gathered copy of the prefix per layer
  and span: its saved-tensor peak (stand-in kernels that save their inputs, as flash-attn's
  autograd functions do) is no larger than the dense flash path's at the same shape;
- the document paths run in strict CUDA mode inside the executor's hot loop without a host sync:
  no read-back of the ids when the data loader's host copy is in the cache, no blocking
  host-to-device copy; a blocking copy there raises (strict mode's new rule);
- SDPA: the kernel CUDA would choose (flash refuses masks, memory-efficient refuses GQA, math
  materialises the scores); with documents and GQA on a GPU, `auto` takes flex, not sdpa's math
  fallback; strict mode raises when only math would run above the size it is given;
- the sdpa document mask is stored with rows padded to 8, so CUDA's memory-efficient kernel
  takes it without a padded copy whatever the span's end;
- the flex document BlockMask is built from tile arithmetic: it equals `create_block_mask`'s,
  and building it allocates nothing of the (span x prefix) size.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from seq1f1b import platform
from seq1f1b.runtime import attention, sdpa_dispatch
from seq1f1b.runtime.documents import (
    additive_mask,
    document_block_mask,
    document_ids,
    span_document_mask,
)
from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context, tensors_of
from seq1f1b.runtime.memory import SavedTensorMeter
from test_attention import HEAD_DIM, HEADS, SEQ, make_attention, random_qkv, span_bounds
from test_documents import EOD, packed_tokens

pytestmark = [
    pytest.mark.usefixtures("megatron_world"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="strict mode emulates CUDA on the CPU"),
]


# ----------------------------------------------------------------------------- flash varlen

class _SavesInputs(torch.autograd.Function):
    """A stand-in kernel that saves q, k, v and its output for backward, as flash-attn's
    autograd functions do (`compute` is the exact attention, eager)."""

    @staticmethod
    def forward(ctx, compute, q, k, v):
        with torch.no_grad():
            out = compute(q, k, v)
        ctx.compute = compute
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _ = ctx.saved_tensors
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            out = ctx.compute(*leaves)
        return (None, *torch.autograd.grad(out, leaves, grad))


def _flash_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_func's semantics on [b, s, heads, d]: bottom-right causal, GQA by groups."""
    def compute(q, k, v):
        out = attention._eager(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), None,
                               softmax_scale, 0.0)
        return out.view(q.size(1), q.size(0), q.size(2), -1).transpose(0, 1)
    return _SavesInputs.apply(compute, q, k, v)


def _flash_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None,
                       causal=False):
    """flash_attn_varlen_func's semantics: sequence i is rows cu[i]:cu[i+1] of q / k / v
    ([tokens, heads, d], any row stride)."""
    def compute(q, k, v):
        outs = [attention._eager(q[a:b][:, None], k[c:d][:, None], v[c:d][:, None], None,
                                 softmax_scale, 0.0)[:, 0]
                for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]
        return torch.cat(outs).view(q.shape)
    return _SavesInputs.apply(compute, q, k, v)


def _saved_peak(ids, layers: int = 3) -> tuple[int, int]:
    """Saved-tensor peak of k spans forward through `layers` flash attention layers (with
    documents when `ids` is given), the KV cache counted as the executor counts it; and the
    bytes of the spans' varlen layouts (their cumulative lengths) among them."""
    (q, k, v), _ = random_qkv(2)
    attns = [make_attention("sdpa", 2) for _ in range(layers)]
    for attn in attns:
        attn.backend = "flash"
    cache = MicrobatchKVCache(0, SEQ)
    outs = []
    with SavedTensorMeter(cache.tensors) as meter:
        for j, (start, end) in enumerate(span_bounds([10, 14])):
            with span_context(SpanContext(0, j, start, end, cache)):
                for attn in attns:
                    outs.append(attn(q[start:end], k[start:end], v[start:end], ids))
                meter.sample()
    layouts = sum(t.numel() * t.element_size() for form in cache.derived.values()
                  for t in tensors_of(form))
    return meter.peak_bytes, layouts


def test_flash_varlen_saves_no_more_than_dense_flash(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_func=_flash_func, flash_attn_varlen_func=_flash_varlen_func))
    dense, _ = _saved_peak(None)
    documents, layouts = _saved_peak(document_ids(packed_tokens()[:, :-1], EOD))
    assert 0 < layouts < 200
    assert documents - layouts <= dense, (documents, layouts, dense)


# ----------------------------------------------------------------------------- strict runs

def _document_spans_in_hot_loop(backend: str, host_ids: bool) -> torch.Tensor:
    """The document path of `backend` for every span, on device tensors, inside the executor's
    hot loop; the host copy of the ids in the cache as the executor puts it there."""
    ids_host = document_ids(packed_tokens()[:, :-1], EOD)
    device = platform.compute_device()
    (q, k, v), _ = random_qkv(2)
    q, k, v, ids = (t.detach().to(device) for t in (q, k, v, ids_host))
    attn = make_attention("sdpa", 2)
    attn.backend = backend
    cache = MicrobatchKVCache(0, SEQ, requires_grad=False)
    cache.host_document_ids = ids_host if host_ids else None
    outs = []
    with platform.host_sync_forbidden(), torch.no_grad():
        for j, (start, end) in enumerate(span_bounds([10, 14])):
            with span_context(SpanContext(0, j, start, end, cache)):
                outs.append(attn(q[start:end], k[start:end], v[start:end], ids))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["flash", "flex", "sdpa", "eager"])
def test_document_paths_make_no_host_sync_in_strict_mode(monkeypatch, backend):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_func=_flash_func, flash_attn_varlen_func=_flash_varlen_func))
    allowed = []
    real = platform.host_sync_allowed
    monkeypatch.setattr("seq1f1b.runtime.documents.host_sync_allowed",
                        lambda: (allowed.append(1), real())[1])
    with platform.strict_mode():
        out = _document_spans_in_hot_loop(backend, host_ids=True)
    assert out.shape == (SEQ, 2, HEADS * HEAD_DIM)
    assert not allowed      # not even a deliberate sync: the ids came from the host copy


def test_flash_without_the_host_copy_reads_the_ids_back_once_per_microbatch(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_varlen_func=_flash_varlen_func))
    reads = []

    class CountReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.cpu:
                reads.append(1)
            return func(*args, **(kwargs or {}))

    with platform.strict_mode(), CountReads():
        _document_spans_in_hot_loop("flash", host_ids=False)
    assert len(reads) == 1


def test_a_blocking_host_to_device_copy_in_the_hot_loop_raises():
    with platform.strict_mode():
        device = platform.compute_device()
        target, host = torch.zeros(4, device=device), torch.ones(4)
        with platform.host_sync_forbidden():
            for copy in (lambda: host.to(device), lambda: target.copy_(host),
                         lambda: torch.tensor([1, 2], device=device), lambda: host.cuda(),
                         lambda: target.__setitem__(slice(None), host)):
                with pytest.raises(RuntimeError, match="blocking host-to-device copy"):
                    copy()
            host.to(device, non_blocking=True)          # what get_batch does: no sync
            target.copy_(host, non_blocking=True)
            torch.full((), 3, device=device)            # a fill, not a copy
        host.to(device)                                 # outside the hot loop: allowed


# ----------------------------------------------------------------------------- SDPA on CUDA

def _meta(b, heads, s, d=128, dtype=torch.bfloat16):
    return torch.empty(b, heads, s, d, dtype=dtype, device="meta")


def test_the_kernel_cuda_would_choose():
    q, k32, k8 = _meta(1, 32, 8192), _meta(1, 32, 32768), _meta(1, 8, 32768)
    mask = torch.empty(1, 1, 8192, 32768, dtype=torch.bfloat16, device="meta")
    choose = sdpa_dispatch.sdpa_cuda_kernel
    assert choose(q, k32, k32, None).kernel == "flash"
    assert choose(q, k32, k32, None, is_causal=True).kernel == "efficient"  # non-square causal
    assert choose(q, k32, k32, mask).kernel == "efficient"
    gqa = choose(q, k8, k8, mask)
    assert gqa.kernel == "math" and "grouped-query" in gqa.refusals[1]
    fp32 = [_meta(1, 32, 512, dtype=torch.float32) for _ in range(3)]
    assert choose(*fp32, None).kernel == "efficient"       # flash takes 16-bit only
    on_h100 = sdpa_dispatch.CudaDevice((9, 0), cudnn_first=True)
    assert choose(q, k8, k8, mask, device=on_h100).kernel == "cudnn"


def test_documents_with_gqa_on_a_gpu_take_flex_under_auto(monkeypatch):
    attn = make_attention("sdpa", 2)
    attn.backend, attn.requested_backend = "te", "auto"   # TE installed, flash-attn not
    assert attn._document_backend() == "sdpa"              # the CPU: flex cannot train here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert attn._document_backend() == "flex"
    attn.dropout_p = 0.1                                    # flex has no attention dropout
    assert attn._document_backend() == "sdpa"


def test_strict_mode_raises_where_cuda_would_run_the_math_kernel(monkeypatch):
    monkeypatch.setenv(sdpa_dispatch.MATH_LIMIT_VARIABLE, "0")
    ids_host = document_ids(packed_tokens()[:, :-1], EOD)
    with platform.strict_mode():
        device = platform.compute_device()
        (q, k, v), _ = random_qkv(2)
        q, k, v, ids = (t.detach().to(device) for t in (q, k, v, ids_host))
        with pytest.raises(RuntimeError, match="math kernel .*grouped-query"):
            make_attention("sdpa", 2)(q, k, v, ids)
        make_attention("sdpa")(*(t.detach().to(device) for t in random_qkv()[0]), ids)  # MHA
    make_attention("sdpa", 2)(q, k, v, ids)       # the CPU itself has no such rule


@pytest.mark.parametrize("start, end", [(0, 10), (10, 24), (5, 19), (3, 23)])
def test_the_sdpa_document_mask_is_read_in_place_by_the_efficient_kernel(start, end):
    ids = document_ids(packed_tokens()[:, :-1], EOD)
    bool_mask = span_document_mask(ids, start, end)
    naive = torch.zeros(bool_mask.shape).masked_fill_(bool_mask, float("-inf"))
    assert sdpa_dispatch.mask_is_padded(naive) == (end % 8 != 0)    # what we had: a copy
    ours = additive_mask(bool_mask, torch.float32)
    assert not sdpa_dispatch.mask_is_padded(ours)
    assert torch.equal(ours, naive)


# ----------------------------------------------------------------------------- flex documents

PACKS = {"crossing": [300, 700, 200, 900, 60], "one": [2160], "short": [5] * 432}


@pytest.mark.parametrize("pack", PACKS)
@pytest.mark.parametrize("start, end", [(0, 2160), (1024, 2160), (640, 1400), (1000, 1129)])
def test_flex_document_block_mask_equals_create_block_mask(pack, start, end):
    from torch.nn.attention.flex_attention import create_block_mask

    tokens = torch.randint(1, 50, (2, 2160))
    tokens[0, torch.tensor(PACKS[pack]).cumsum(0) - 1] = EOD
    tokens[1, torch.tensor(PACKS["crossing"][::-1]).cumsum(0) - 1] = EOD
    ids = document_ids(tokens, EOD)
    docs = ids[:, 0, 0]

    def same_document_causal(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx + start) & (docs[batch, kv_idx] == docs[batch, q_idx + start])

    ours = document_block_mask(ids, start, end)
    dense = create_block_mask(same_document_causal, 2, None, end - start, end, device="cpu")
    for field in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, field).expand_as(getattr(dense, field)),
                           getattr(dense, field)), field
    assert torch.equal(ours.to_dense().expand_as(dense.to_dense()), dense.to_dense())


class _LargestAllocation(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel() * tensor.element_size())
        return out


def test_building_the_flex_document_mask_allocates_no_span_by_prefix_tensor():
    tokens = torch.randint(1, 50, (1, 8192))
    tokens[0, ::700] = EOD
    ids = document_ids(tokens, EOD)
    with _LargestAllocation() as mode:
        document_block_mask(ids, 6144, 8192)
    assert mode.largest <= ids.numel() * ids.element_size()   # 32 KiB; span x prefix: 16 MiB
