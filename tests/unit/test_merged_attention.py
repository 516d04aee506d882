"""The span attention merged from two fused calls (runtime/merged_attention.py) against the
explicit bottom-right causal softmax in fp64: output and every input gradient.

The CPU runs the same autograd Function as a GPU, through torch's CPU flash kernels instead of
cuDNN's, so a wrong merge or a backward fed the wrong row statistics fails here."""
import math

import pytest
import torch

from seq1f1b.runtime.merged_attention import cudnn_merge_refusal, merged_span_attention


def _reference(q, k, v, scale):
    sq, sk = q.size(2), k.size(2)
    groups = q.size(1) // k.size(1)     # GQA: query head h reads K/V head h // groups
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    masked = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
    return torch.softmax(scores.masked_fill(masked, float("-inf")), -1) @ v


def _cache_views(batch, heads, head_dim, span, prefix, generator, kv_heads=None):
    """q, k, v heads-first as the trainer passes them: views of [s, b, h, d] buffers, K/V the
    rows [0, end) of a cache longer than the span's end."""
    end = prefix + span
    k_cache, v_cache = (torch.randn(end + 5, batch, kv_heads or heads, head_dim,
                                    generator=generator) for _ in range(2))
    q = torch.randn(span, batch, heads, head_dim, generator=generator)
    first = lambda t: t.permute(1, 2, 0, 3)           # noqa: E731 -- [s, b, h, d] -> [b, h, s, d]
    return first(q), first(k_cache[:end]), first(v_cache[:end])


@pytest.mark.parametrize("batch,heads,head_dim,span,prefix,kv_heads",
                         [(1, 2, 16, 8, 24, 2), (2, 3, 8, 17, 5, 3), (1, 1, 32, 1, 40, 1),
                          (2, 2, 16, 33, 1, 2), (2, 4, 16, 9, 20, 2), (1, 6, 8, 5, 11, 1)])
def test_the_merge_equals_the_causal_softmax_forward_and_backward(batch, heads, head_dim, span,
                                                                   prefix, kv_heads):
    generator = torch.Generator().manual_seed(span * 31 + prefix)
    q, k, v = _cache_views(batch, heads, head_dim, span, prefix, generator, kv_heads)
    grad = torch.randn(batch, heads, span, head_dim, generator=generator)
    scale = 1 / math.sqrt(head_dim)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, scale)
        out.backward(grad.to(dtype))
        return [out.detach(), *(t.grad for t in leaves)]

    got = run(merged_span_attention, torch.float32)
    want = run(_reference, torch.float64)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        error = (g.double() - w).norm() / w.norm()
        assert error < 1e-5, f"{name}: relative error {error:.2e}"


def test_the_merge_refuses_what_it_cannot_compute():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="cached prefix"):
        merged_span_attention(q, q, q, 0.25)
    with pytest.raises(ValueError, match="divide the query heads"):
        merged_span_attention(q, torch.randn(1, 3, 16, 16), torch.randn(1, 3, 16, 16), 0.25)
    assert cudnn_merge_refusal(q, torch.randn(1, 4, 16, 16), q, 0.0) == "not on CUDA"
