"""device_check's `merge_gqa` probe: the span merge with grouped-query attention on cuDNN.

SpanAttention runs a span with a cached prefix as two cuDNN calls merged by log-sum-exp on sm90+
(seq1f1b/runtime/merged_attention.py), but not yet with fewer K/V heads than query heads: the CPU
shows the merge exact for GQA, while cuDNN's ops with GQA have not run on a GPU. This probe runs
the merge directly at a GQA shape (a quarter of the heads for K/V, the last quarter of the
sequence as the span, bf16) beside the path GQA takes today (`causal_lower_right`, flash-2), both
against an fp32 reference computed head by head: max relative error of out, dQ, dK, dV, whether
the merge stays within numerics.py's bound (2 x max(2^-8, today's path's error)), and the
forward+backward time of each. A merge that is within bound and faster is what lets
`cudnn_merge_refusal` take GQA.
"""
from __future__ import annotations

import math
import time

from seq1f1b.device_checks.numerics import _relative_error, bf16_bounds

TIMED_REPEATS = 5


def _inputs(length: int, heads: int, kv_heads: int, head_dim: int, device, dtype):
    """q, k, v heads-first as views of [s, b, h, d] buffers (the cache's layout), and dOut."""
    import torch

    span = length // 4
    generator = torch.Generator(device=device).manual_seed(0)
    make = lambda s, h: torch.randn(s, 1, h, head_dim, device=device, dtype=dtype,  # noqa: E731
                                    generator=generator).permute(1, 2, 0, 3)
    return make(span, heads), make(length, kv_heads), make(length, kv_heads), make(span, heads)


def _lower_right(q, k, v, scale):
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from seq1f1b.runtime.attention import bottom_right_causal_mask

    sq, sk = q.size(2), k.size(2)
    allowed = (~bottom_right_causal_mask(sq, sk, q.device) if q.device.type == "cpu"
               else causal_lower_right(sq, sk))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                          enable_gqa=True)


def _merged(q, k, v, scale):
    from seq1f1b.runtime.merged_attention import merged_span_attention

    return merged_span_attention(q, k, v, scale)


def _run(attend, q, k, v, grad):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, 1 / math.sqrt(q.size(-1)))
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _reference(q, k, v, grad) -> list:
    """fp32, one query head at a time (a [span, L] score matrix at a time)."""
    import torch

    from seq1f1b.runtime.attention import bottom_right_causal_mask

    groups = q.size(1) // k.size(1)
    masked = bottom_right_causal_mask(q.size(2), k.size(2), q.device)
    outs, dqs = [], []
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for head in range(q.size(1)):
        kv = head // groups
        leaves = [t.detach().float().requires_grad_() for t in
                  (q[:, head], k[:, kv], v[:, kv])]
        scores = leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(q.size(-1))
        out = torch.softmax(scores.masked_fill(masked, float("-inf")), -1) @ leaves[2]
        out.backward(grad[:, head].float())
        outs.append(out.detach())
        dqs.append(leaves[0].grad)
        dk[:, kv] += leaves[1].grad
        dv[:, kv] += leaves[2].grad
    return [torch.stack(outs, 1), torch.stack(dqs, 1), dk, dv]


def _errors(got: list, want: list) -> dict:
    return {name: _relative_error(g, w) for name, g, w in zip(("output", "dq", "dk", "dv"),
                                                                 got, want)}


def _seconds(attend, q, k, v, grad) -> float:
    import torch

    _run(attend, q, k, v, grad)                     # warm-up
    if q.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(TIMED_REPEATS):
        _run(attend, q, k, v, grad)
    if q.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / TIMED_REPEATS


def check_merge_gqa(length: int, heads: int, head_dim: int, deadline) -> dict:
    """The probe at a sequence of `length`, `heads` query heads and heads // 4 K/V heads."""
    import torch

    if deadline.passed():
        return {"skipped": "the time budget ran out"}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv_heads = max(1, heads // 4)
    q, k, v, grad = _inputs(length, heads, kv_heads, head_dim, device, dtype)
    reference = _reference(q, k, v, grad)
    result = {"length": length, "span": q.size(2), "heads": heads, "kv_heads": kv_heads,
              "head_dim": head_dim, "dtype": str(dtype).replace("torch.", "")}
    for name, attend in (("merged", _merged), ("lower_right", _lower_right)):
        try:
            result[name] = {"errors": _errors(_run(attend, q, k, v, grad), reference),
                            "forward_backward_s": _seconds(attend, q, k, v, grad)}
        except (RuntimeError, ValueError, NotImplementedError) as err:
            result[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    merged, today = result["merged"], result["lower_right"]
    if "errors" in merged and "errors" in today:
        bounds = bf16_bounds(merged["errors"], today["errors"])
        result.update(bounds=bounds,
                      within_bound=all(merged["errors"][t] <= bounds[t] for t in bounds),
                      merged_over_lower_right=merged["forward_backward_s"]
                      / today["forward_backward_s"])
    return result
