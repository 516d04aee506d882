"""SpanAttention: spans through the KV cache reproduce the unsplit causal attention exactly."""
from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from seq1f1b.megatron_adapter import make_transformer_config
from seq1f1b.runtime.attention import SpanAttention, bottom_right_causal_mask, resolve_backend
from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context

pytestmark = pytest.mark.usefixtures("megatron_world")

SEQ, BATCH, HEADS, HEAD_DIM = 24, 2, 4, 8
SPLITS = [[24], [10, 14], [5, 11, 8], [1, 6, 9, 8]]


def make_attention(backend: str, groups: int = HEADS, dropout: float = 0.0) -> SpanAttention:
    config = make_transformer_config(num_layers=1, hidden_size=HEADS * HEAD_DIM,
                                     num_attention_heads=HEADS, num_query_groups=groups,
                                     attention_dropout=dropout)
    return SpanAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                         attention_type="self", backend=backend)


def random_qkv(groups: int = HEADS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=gen)
    v = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=gen)
    grad_out = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=gen)
    return [t.requires_grad_() for t in (q, k, v)], grad_out


def span_bounds(lengths):
    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    return [(s, s + n) for s, n in zip(starts, lengths)]


def run_unsplit(attn, qkv, grad_out, mask=None):
    out = attn(*qkv, mask)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in qkv]


def run_spans(attn, qkv, grad_out, lengths, mask=None):
    """Forward spans 0..k-1, then backward k-1..0 in each span's context, as the executor does."""
    q, k, v = qkv
    cache = MicrobatchKVCache(microbatch=0, seq_length=SEQ)
    outs = []
    for j, (start, end) in enumerate(span_bounds(lengths)):
        span_mask = None if mask is None else mask[..., start:end, :end]
        with span_context(SpanContext(0, j, start, end, cache)):
            outs.append(attn(q[start:end], k[start:end], v[start:end], span_mask))
    for j, (start, end) in reversed(list(enumerate(span_bounds(lengths)))):
        with span_context(SpanContext(0, j, start, end, cache)):
            outs[j].backward(grad_out[start:end])
    return torch.cat([o.detach() for o in outs]), [t.grad for t in qkv]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_same(result, reference, tol=2e-6):
    (out, grads), (ref_out, ref_grads) = result, reference
    assert rel_err(out, ref_out) <= tol, f"output differs: {rel_err(out, ref_out):.2e}"
    for name, g, ref in zip("qkv", grads, ref_grads):
        assert rel_err(g, ref) <= tol, f"d{name} differs: {rel_err(g, ref):.2e}"


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("groups", [HEADS, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("lengths", SPLITS, ids=lambda ls: "-".join(map(str, ls)))
def test_spans_equal_unsplit_attention(backend, groups, lengths):
    attn = make_attention(backend, groups)
    qkv, grad_out = random_qkv(groups)
    reference = run_unsplit(attn, qkv, grad_out)
    fresh, _ = random_qkv(groups)
    assert_same(run_spans(attn, fresh, grad_out, lengths), reference)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_explicit_causal_mask_equals_implicit(backend):
    attn = make_attention(backend, groups=2)
    qkv, grad_out = random_qkv(2)
    reference = run_unsplit(attn, qkv, grad_out)
    causal = bottom_right_causal_mask(SEQ, SEQ)[None, None]
    qkv, _ = random_qkv(2)
    assert_same(run_unsplit(attn, qkv, grad_out, causal), reference)
    qkv, _ = random_qkv(2)
    assert_same(run_spans(attn, qkv, grad_out, [5, 11, 8], causal), reference)


def test_explicit_mask_is_honoured():
    """A document mask (two documents) changes the result, identically for eager and sdpa."""
    doc = torch.zeros(SEQ, dtype=torch.long)
    doc[10:] = 1
    mask = (bottom_right_causal_mask(SEQ, SEQ) | (doc[:, None] != doc[None, :]))[None, None]
    results = {}
    for backend in ("eager", "sdpa"):
        qkv, grad_out = random_qkv()
        results[backend] = run_spans(make_attention(backend), qkv, grad_out, [5, 11, 8], mask)
    assert_same(results["sdpa"], results["eager"])
    qkv, grad_out = random_qkv()
    causal_only = run_unsplit(make_attention("eager"), qkv, grad_out)
    assert rel_err(results["eager"][0], causal_only[0]) > 1e-2
    qkv, grad_out = random_qkv()
    second_doc_alone = make_attention("eager")(*(t[10:] for t in qkv), None)
    assert rel_err(results["eager"][0][10:], second_doc_alone.detach()) <= 1e-6


def test_bottom_right_mask_alignment():
    expected = torch.tensor([[0, 0, 0, 0, 0, 1, 1],
                             [0, 0, 0, 0, 0, 0, 1],
                             [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(bottom_right_causal_mask(3, 7), expected)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_span_query_row_sees_exactly_its_past(backend):
    """Row t of span [start, end) depends on keys <= start + t and on no later key."""
    attn = make_attention(backend)
    (q, k, v), _ = random_qkv()
    start, end = 5, 16
    with torch.no_grad():
        base = run_forward(attn, q, k, v, [start, end - start])
        for t in range(end - start):
            later = k.clone()
            later[start + t + 1:] += 1.0
            changed = run_forward(attn, q, later, v, [start, end - start])
            assert torch.equal(changed[:t + 1], base[:t + 1])
            if start + t + 1 < end:
                assert not torch.allclose(changed[t + 1], base[t + 1])


def run_forward(attn, q, k, v, lengths):
    """Outputs of the last span after running every span forward (no backward)."""
    cache = MicrobatchKVCache(microbatch=0, seq_length=SEQ)
    for j, (start, end) in enumerate(span_bounds(lengths)):
        with span_context(SpanContext(0, j, start, end, cache)):
            out = attn(q[start:end], k[start:end], v[start:end], None)
    return out


def test_eager_and_sdpa_agree():
    results = []
    for backend in ("eager", "sdpa"):
        qkv, grad_out = random_qkv(2)
        results.append(run_spans(make_attention(backend, 2), qkv, grad_out, [5, 11, 8]))
    assert_same(results[1], results[0])


@pytest.mark.parametrize("recompute", [False, True], ids=["kept-graph", "recomputed"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_dropout_masks_of_forward_reach_backward(backend, recompute):
    """The backward uses the forward's dropout mask: from the kept kernel graph, or replayed when
    the kernel re-runs in the backward (selective recompute).

    out = P_dropped @ V and dV = P_dropped^T dOut, so sum(out * dOut) == sum(V * dV) holds exactly
    only when forward and backward dropped the same entries.
    """
    attn = make_attention(backend, groups=2, dropout=0.5).train()
    attn.recompute_in_backward = recompute
    (q, k, v), grad_out = random_qkv(2)
    cache = MicrobatchKVCache(microbatch=0, seq_length=SEQ)
    prefix_v = v[:8].detach().requires_grad_()
    with span_context(SpanContext(0, 0, 0, 8, cache)):
        first = attn(q[:8], k[:8], prefix_v, None)
    current_v = v[8:].detach().requires_grad_()
    with span_context(SpanContext(0, 1, 8, SEQ, cache)):
        out = attn(q[8:], k[8:], current_v, None)
    with torch.no_grad():
        no_dropout = make_attention(backend, groups=2)(q, k, v, None)[8:]
    assert rel_err(out.detach(), no_dropout) > 0.1, "dropout had no effect"
    out.backward(grad_out[8:])
    with span_context(SpanContext(0, 0, 0, 8, cache)):   # span 0 receives span 1's dV only
        first.backward(torch.zeros_like(first))
    through_values = (current_v * current_v.grad).sum() + (prefix_v * prefix_v.grad).sum()
    assert torch.allclose((out * grad_out[8:]).sum(), through_values, rtol=1e-5)


def test_backend_resolution():
    config = make_transformer_config(num_layers=1, hidden_size=32, num_attention_heads=4)
    assert resolve_backend("local", config) == "eager"  # megatron's name for its own kernel
    with pytest.raises(ValueError, match="--attention-backend 'magic'"):
        resolve_backend("magic", config)
    if not torch.cuda.is_available():
        assert resolve_backend("auto", config) == "sdpa"
        for name in ("flash", "te"):
            with pytest.raises(ValueError, match=f"--attention-backend {name} is unavailable"):
                make_attention(name)


def test_gpu_only_backends_refuse_masks_and_cpu_training():
    mask = bottom_right_causal_mask(SEQ, SEQ)[None, None]
    (q, k, v), _ = random_qkv()
    flex = make_attention("flex")
    with pytest.raises(RuntimeError, match="flex trains on GPUs only"):
        flex(q, k, v, None)
    with pytest.raises(ValueError, match="takes no explicit attention mask"):
        flex(q.detach(), k.detach(), v.detach(), mask)
    with pytest.raises(ValueError, match="attention_mask must be a bool tensor"):
        make_attention("eager")(q, k, v, mask[..., :5, :])


FLEX_SPANS = [300, 260, 200, 180, 150]
"""k=5 spans, each a different (sq, sk) and at least two 128-token tiles (a dimension of one tile
would be a shape of its own to dynamo)."""


def test_flex_compiles_one_graph_for_every_span_shape():
    """The compiled flex path, forward only (torch's FlexAttention has no CPU backward): k=5
    span shapes run on at most 2 graphs (span 0 is square, dynamo specialises sq == sk; every
    other shape shares the second), else dynamo fails instead of falling back to eager flex.
    Outputs equal eager's."""
    length = sum(FLEX_SPANS)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(length, 1, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(length, 1, 2, HEAD_DIM, generator=gen) for _ in range(2))
    outputs = {}
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True), \
            torch.no_grad():
        for name in ("flex", "eager"):
            attn, cache, outputs[name] = make_attention(name, 2), MicrobatchKVCache(0, length), []
            for j, (start, end) in enumerate(span_bounds(FLEX_SPANS)):
                with span_context(SpanContext(0, j, start, end, cache)):
                    outputs[name].append(attn(q[start:end], k[start:end], v[start:end], None))
    assert rel_err(torch.cat(outputs["flex"]), torch.cat(outputs["eager"])) <= 1e-5


@pytest.mark.parametrize("sq, sk", [(24, 24), (300, 300), (130, 700), (256, 512), (100, 1000),
                                    (129, 257), (1, 385)])
def test_flex_block_mask_equals_create_block_mask(sq, sk):
    """The tile-arithmetic BlockMask is the one `create_block_mask` evaluates densely."""
    from torch.nn.attention.flex_attention import create_block_mask

    from seq1f1b.runtime.attention import _flex_block_mask

    def bottom_right(batch, head, q_idx, kv_idx):
        return kv_idx <= q_idx + (sk - sq)

    ours = _flex_block_mask(sq, sk, torch.device("cpu"))
    dense = create_block_mask(bottom_right, None, None, sq, sk, device="cpu")
    assert ours.seq_lengths == dense.seq_lengths
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                  "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, field), getattr(dense, field)), field
    assert torch.equal(ours.to_dense(), dense.to_dense())


@pytest.mark.parametrize("batch", [1, 2])
def test_cache_prefix_views_are_what_te_reads_in_place(batch):
    """TE's cuDNN sub-backend reads sbhd with the canonical strides of the shape: the cache's
    prefix views are contiguous. Its flash sub-backend makes them batch-first with
    `x.transpose(0, 1).contiguous()`: no copy with one sequence per micro-batch, a copy of the
    prefix with more (see `_build_te_attention`)."""
    cache = MicrobatchKVCache(microbatch=0, seq_length=SEQ)
    key, value = (torch.randn(10, batch, 2, HEAD_DIM) for _ in range(2))
    layer_kv = cache.layer("layer", key, value)
    layer_kv.write(0, 10, key, value)
    for view in layer_kv.views(10):
        assert view.is_contiguous()
        batch_first = view.transpose(0, 1).contiguous()
        assert (batch_first.data_ptr() == view.data_ptr()) == (batch == 1)


def test_span_needs_its_cache():
    attn = make_attention("eager")
    (q, k, v), _ = random_qkv()
    with span_context(SpanContext(0, 1, 5, 10, None)), pytest.raises(RuntimeError, match="cache"):
        attn(q[5:10], k[5:10], v[5:10], None)
    cache = MicrobatchKVCache(microbatch=0, seq_length=SEQ)
    with span_context(SpanContext(0, 0, 0, 5, cache)):
        attn(q[:5], k[:5], v[:5], None)
    with span_context(SpanContext(0, 1, 6, 10, cache)), pytest.raises(RuntimeError, match="hold 5"):
        attn(q[6:10], k[6:10], v[6:10], None)
