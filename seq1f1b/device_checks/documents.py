"""device_check's documents part: packed documents' memory beside the dense case, per backend.

One attention layer runs the last span of a micro-batch, L/4 query tokens at the end of L,
over the K/V of the prefix in the micro-batch's cache (as the executor runs the last span),
forward and backward in bf16: once with packed documents (document ids as the attention mask,
documents that cross the span's start), once dense (causal, no documents), at the same shape
and backend. Per backend (sdpa, flex, flash; each that cannot run here says why) and per head
layout (MHA, and GQA with a quarter of the K/V heads) it reports the peak memory above what was
allocated before (torch.cuda.max_memory_allocated; on a CPU the saved-tensor meter's peak, the
cache counted) and documents over dense: the memory a packed-document run pays for its masks,
which issue 24 brought down to views of the cache (flash), tile tables (flex) and a padded
(span x prefix) mask that CUDA's efficient kernel reads in place (sdpa). sdpa with GQA and a
mask would run CUDA's math kernel (seq1f1b/runtime/sdpa_dispatch.py): recorded, not run.
"""
from __future__ import annotations

from typing import Optional

DOCUMENT_BACKENDS = ("sdpa", "flex", "flash")


def _peak(run, device) -> int:
    """Peak bytes `run()` adds: CUDA's allocator statistics on a GPU, the saved-tensor meter's
    peak on a CPU (`run` returns the tensors to count beside what autograd saves)."""
    import torch

    from seq1f1b.runtime.memory import SavedTensorMeter

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    held: list = []
    with SavedTensorMeter(lambda: held) as meter:
        held.extend(run())
        meter.sample()
    return meter.peak_bytes


def _last_span(module, q, k, v, ids, start: int, backward: bool) -> list:
    """The span [start, L) over the cached prefix, forward and (with `backward`) backward;
    returns what the meter should count beside autograd (the cache and its derived masks)."""
    import torch

    from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context

    length = q.size(0)
    cache = MicrobatchKVCache(0, length, requires_grad=backward)
    cache.layer(module, k, v).write(0, start, k[:start], v[:start])
    leaves = [t[start:].detach().requires_grad_(backward) for t in (q, k, v)]
    with span_context(SpanContext(0, 1, start, length, cache)), \
            torch.set_grad_enabled(backward):
        out = module(*leaves, ids)
        if backward:
            out.backward(torch.ones_like(out))
    return cache.tensors()


def _document_ids(length: int, document: int, device):
    import torch

    from seq1f1b.runtime.documents import document_ids

    tokens = torch.ones(1, length, dtype=torch.int64)
    tokens[0, document - 1::document] = 0          # EOD closes each document
    return document_ids(tokens, 0).to(device)


def check_documents(length: int, heads: int, head_dim: int, deadline) -> dict:
    """The documents part (see the module docstring) at L = `length`."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from seq1f1b.megatron_adapter import Architecture, make_transformer_config
    from seq1f1b.runtime.attention import SpanAttention, backend_unavailable_reason
    from seq1f1b.runtime.sdpa_dispatch import sdpa_cuda_kernel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = length - length // 4
    document = max(8, (length // 12) | 1)      # odd: documents cross the span's start
    ids = _document_ids(length, document, device)
    result = {"length": length, "span": [start, length], "document_length": document,
              "backends": {}}
    for name in DOCUMENT_BACKENDS:
        for layout, groups in (("mha", heads), ("gqa", max(1, heads // 4))):
            key = f"{name}_{layout}"
            config = make_transformer_config(
                num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                architecture=Architecture(num_query_groups=groups), fp32=device.type != "cuda")
            reason = backend_unavailable_reason(name, config)
            if reason is None and deadline.passed():
                reason = "the part's time budget ran out"
            backward = device.type == "cuda" or name != "flex"   # flex: no CPU backward
            q = torch.randn(length, 1, heads, head_dim, device=device, dtype=config.params_dtype)
            k, v = (torch.randn(length, 1, groups, head_dim, device=device,
                                dtype=config.params_dtype) for _ in range(2))
            if reason is None and name == "sdpa" and device.type == "cuda":
                shape = (1, 1, length - start, length)
                mask = torch.empty(shape, dtype=config.params_dtype, device="meta")
                if sdpa_cuda_kernel(q.permute(1, 2, 0, 3)[:, :, start:], k.permute(1, 2, 0, 3),
                                    v.permute(1, 2, 0, 3), mask).kernel == "math":
                    reason = "CUDA would run the math kernel (a mask with GQA): not run"
            if reason is not None:
                result["backends"][key] = {"skipped": reason}
                continue
            module = SpanAttention(config, 1, AttnMaskType.causal, "self", backend=name)
            peaks: dict[str, Optional[int]] = {}
            for case, mask in (("documents", ids), ("dense", None)):
                peaks[case] = _peak(lambda: _last_span(module, q, k, v, mask, start, backward),
                                    device)
            result["backends"][key] = {
                "backward": backward, "peak_bytes": peaks,
                "documents_over_dense": peaks["documents"] / peaks["dense"]}
    return result
