"""A span's causal attention as two fused calls merged by their log-sum-exp.

A span of sq queries attends its cached prefix (keys [0, sk - sq), every query sees every key)
and its own keys (the square [sk - sq, sk), plain causal). torch's SDPA takes the bottom-right
causal mask of the whole (sq x sk) rectangle only through `causal_lower_right`, which on CUDA
runs the flash-attention-2 kernel. On Hopper and newer, torch's default for square causal
attention is cuDNN's kernel instead, and an H200 measured what that choice is worth (bf16, 32
heads x 128, a 4K span at the end of 16K, forward+backward): full causal with as many
query-key pairs 6.4 ms under cuDNN, 11.5 ms under flash-2; the span under `causal_lower_right`
11.3 ms. Two cuDNN calls, the prefix without a mask and the square with `is_causal`, merged by
log-sum-exp, took 6.4 ms on contiguous tensors, and 7.9 ms (against 11.7) through SpanAttention
on the cache's views (tools/device_check.py's attention part, docs/measuring.md).

The merge is exact softmax algebra: with (o1, lse1) and (o2, lse2) the two calls' outputs and
row log-sum-exps, lse = logaddexp(lse1, lse2) and out = o1 exp(lse1 - lse) + o2 exp(lse2 - lse).
The backward needs no merge of its own: each call's fused backward, given the merged `out` and
`lse` (the row statistics of the whole softmax), returns exactly that block's share of dQ and
the block's dK, dV (the rule ring attention rests on). It saves q, k, v (views, no copy), out
and lse, as one fused call does.

`merged_span_attention` runs on CUDA through cuDNN's ops and on the CPU through torch's CPU
flash ops (`_scaled_dot_product_flash_attention_for_cpu`), so the CPU suite checks the same
merge and backward that the GPU runs; the trainer's CPU path keeps SDPA with its additive mask.
`cudnn_merge_refusal` says when CUDA takes the merge: sm90 or newer (where torch itself puts
cuDNN first; on an A100 flash-2 is the faster kernel and `causal_lower_right` already uses it),
cuDNN SDPA enabled, fp16/bf16, head dimensions cuDNN takes, as many K/V heads as query heads,
no dropout and no mask; any other call keeps `causal_lower_right`. The merge itself takes
grouped-query attention (fewer K/V heads; exact on the CPU), but cuDNN's ops with fewer K/V heads
have not run on a GPU yet: device_check's attention part measures them (`merge_gqa`) before CUDA
takes them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_ATEN = torch.ops.aten
MIN_CAPABILITY = (9, 0)


def cudnn_merge_refusal(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Optional[str]:
    """Why a CUDA call of heads-first q [b, h, sq, d], k, v [b, hk, sk, d] keeps
    `causal_lower_right` instead of the cuDNN merge, or None when it takes the merge."""
    if not q.is_cuda:
        return "not on CUDA"
    if torch.cuda.get_device_capability(q.device) < MIN_CAPABILITY:
        return "before sm90 flash-2 (causal_lower_right) is CUDA's fastest kernel"
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "cuDNN SDPA is disabled"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN needs fp16 or bf16, got {q.dtype}"
    if any(t.size(-1) % 8 or t.size(-1) > 128 for t in (q, v)) or q.size(-1) != k.size(-1):
        return "cuDNN needs one head dimension, a multiple of 8 of at most 128"
    if q.size(1) != k.size(1):
        return "grouped-query attention (cuDNN's ops with fewer K/V heads are not yet checked)"
    if dropout_p:
        return "dropout (two calls would draw two dropout streams)"
    if k.size(2) <= q.size(2):
        return "no cached prefix"
    return None


def _cudnn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = \
        _ATEN._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                  scale=scale)
    return out, lse.reshape(q.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    causal: bool, scale: float, state) -> tuple[Tensor, Tensor, Tensor]:
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return _ATEN._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, cum_q, cum_k, max_q, max_k,
        0.0, causal, scale=scale)


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                 scale=scale)
    return out, lse, None


def _cpu_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  causal: bool, scale: float, state) -> tuple[Tensor, Tensor, Tensor]:
    return _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale)


class _MergedSpanAttention(torch.autograd.Function):
    """out of heads-first q [b, h, sq, d] over k, v [b, hk, sk, d], bottom-right causal."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        forward, ctx.backward_op = ((_cudnn_forward, _cudnn_backward) if q.is_cuda
                                    else (_cpu_forward, _cpu_backward))
        prefix = k.size(2) - q.size(2)
        out_p, lse_p, state_p = forward(q, k[:, :, :prefix], v[:, :, :prefix], False, scale)
        out_s, lse_s, state_s = forward(q, k[:, :, prefix:], v[:, :, prefix:], True, scale)
        lse = torch.logaddexp(lse_p, lse_s)
        out = (out_p * (lse_p - lse).exp_().unsqueeze(-1)
               + out_s * (lse_s - lse).exp_().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.prefix, ctx.states = scale, prefix, (state_p, state_s)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        prefix, scale, (state_p, state_s) = ctx.prefix, ctx.scale, ctx.states
        if grad.stride() != out.stride():        # the fused backwards read them alike
            grad = torch.empty_like(out).copy_(grad)
        dq_p, dk_p, dv_p = ctx.backward_op(grad, q, k[:, :, :prefix], v[:, :, :prefix], out,
                                           lse, False, scale, state_p)
        dq_s, dk_s, dv_s = ctx.backward_op(grad, q, k[:, :, prefix:], v[:, :, prefix:], out,
                                           lse, True, scale, state_s)
        return dq_p.add_(dq_s), torch.cat((dk_p, dk_s), 2), torch.cat((dv_p, dv_s), 2), None


def merged_span_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Bottom-right causal attention of heads-first q [b, h, sq, d] over k, v [b, hk, sk, d]
    (sk > sq: a cached prefix of sk - sq keys; hk divides h), as two fused calls merged by
    log-sum-exp; differentiable. cuDNN's kernels on CUDA (see `cudnn_merge_refusal`), the CPU
    flash kernels on the CPU."""
    if k.size(2) <= q.size(2) or q.size(1) % k.size(1):
        raise ValueError(f"merged span attention needs a cached prefix and K/V heads that divide "
                         f"the query heads: q {tuple(q.shape)}, k {tuple(k.shape)}")
    return _MergedSpanAttention.apply(q, k, v, scale)
