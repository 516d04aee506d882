"""bf16 dK/dV of spans against an fp64 reference: the cache's fp32 accumulators keep the split's
error at the unsplit kernel's level, bf16 accumulators would not.

The bound: the unsplit kernel's own error and one bf16 rounding of the result, added in
quadrature (each span's contribution to an earlier span's dK/dV leaves its bf16 kernel rounded
once; no accumulator can undo that, and it does not grow with k). The rounding's size is measured,
not assumed: the error of the fp64 reference rounded to bf16.
"""
from __future__ import annotations

import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from seq1f1b.megatron_adapter import make_transformer_config
from seq1f1b.runtime import kv_cache
from seq1f1b.runtime.attention import SpanAttention
from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context

pytestmark = pytest.mark.usefixtures("megatron_world")

LENGTH, HEADS, HEAD_DIM, SPLITS = 1024, 4, 64, 8
SLACK = 1.03
"""Measured split/bound ratios: fp32 accumulators 0.99-1.005, bf16 accumulators 1.06-1.08."""


def _inputs() -> list[torch.Tensor]:
    """bf16 q, k, v [L, 1, n, d] and the output's gradient [L, 1, n*d]."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(LENGTH, 1, HEADS, HEAD_DIM)] * 3 + [(LENGTH, 1, HEADS * HEAD_DIM)]
    return [torch.randn(shape, generator=gen).bfloat16() for shape in shapes]


def _key_value_grads(attention: SpanAttention, inputs: list[torch.Tensor], dtype: torch.dtype,
                     splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV of the sequence in `dtype`, run as `splits` even spans the way the executor runs
    them (forward 0..k-1, backward k-1..0) or, with splits=1, unsplit outside any span."""
    *qkv, grad_out = [t.to(dtype) for t in inputs]
    leaves = [t.clone().requires_grad_() for t in qkv]
    if splits == 1:
        attention(*leaves, None).backward(grad_out)
        return leaves[1].grad, leaves[2].grad
    cache = MicrobatchKVCache(microbatch=0, seq_length=LENGTH)
    bounds = [(j * LENGTH // splits, (j + 1) * LENGTH // splits) for j in range(splits)]
    outputs = []
    for j, (start, end) in enumerate(bounds):
        with span_context(SpanContext(0, j, start, end, cache)):
            outputs.append(attention(*(t[start:end] for t in leaves), None))
    for j, (start, end) in reversed(list(enumerate(bounds))):
        with span_context(SpanContext(0, j, start, end, cache)):
            outputs[j].backward(grad_out[start:end])
    return leaves[1].grad, leaves[2].grad


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


@pytest.fixture(scope="module")
def errors() -> dict:
    """Relative errors of dK and dV against fp64: the unsplit bf16 kernel, the fp64 reference
    rounded to bf16, and the k-span split with fp32 and with bf16 accumulators."""
    config = make_transformer_config(num_layers=1, hidden_size=HEADS * HEAD_DIM,
                                     num_attention_heads=HEADS)
    attention = SpanAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                              attention_type="self", backend="eager")
    inputs = _inputs()
    reference = _key_value_grads(attention, inputs, torch.float64, 1)
    result = {"unsplit": _key_value_grads(attention, inputs, torch.bfloat16, 1),
              "rounded": tuple(r.bfloat16() for r in reference)}
    for accumulator in (torch.float32, torch.bfloat16):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kv_cache, "MIN_ACCUMULATOR_DTYPE", accumulator)
            result[accumulator] = _key_value_grads(attention, inputs, torch.bfloat16, SPLITS)
    return {name: [_relative_error(g, r) for g, r in zip(grads, reference)]
            for name, grads in result.items()}


def _bound(errors: dict) -> list[float]:
    return [SLACK * math.hypot(unsplit, rounded)
            for unsplit, rounded in zip(errors["unsplit"], errors["rounded"])]


def test_fp32_accumulators_keep_the_split_at_the_unsplit_level(errors):
    for name, split, bound in zip(("dK", "dV"), errors[torch.float32], _bound(errors)):
        assert split <= bound, f"{name}: split {split:.4%} above {bound:.4%} ({errors})"


def test_bf16_accumulators_would_exceed_it(errors):
    for name, split, bound in zip(("dK", "dV"), errors[torch.bfloat16], _bound(errors)):
        assert split > bound, f"{name}: bf16 accumulation {split:.4%} within {bound:.4%}"
