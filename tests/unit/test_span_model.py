"""A GPTModel run span by span equals the unsplit model: same loss, same gradient of every param.

This is the numerical heart of Seq1F1B: spans see the cached K/V of earlier spans, RoPE / learned
positions use absolute positions, each span's loss is its token-loss sum over the micro-batch's
token count, and backward runs the spans in reverse injecting the dK/dV later spans left behind.
"""
from __future__ import annotations

import pytest
import torch

from seq1f1b.megatron_adapter import (
    SequenceParallelNorm,
    build_model_chunk,
    make_transformer_config,
)
from seq1f1b.runtime.attention import SpanAttention
from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context
from seq1f1b.runtime.positions import SpanRotaryEmbedding

pytestmark = pytest.mark.usefixtures("megatron_world")

SEQ, BATCH, VOCAB = 24, 2, 100
SPLITS = [[24], [10, 14], [5, 11, 8]]


def build_tiny_gpt(position_embedding_type: str, backend: str = "sdpa", groups: int = 4):
    """3 layers, hidden 32, 4 heads. init std 0.2 (not 0.02) gives sharp attention, so a wrong
    position or a missing cache entry moves the loss by ~1e-2 instead of hiding below 1e-6."""
    torch.manual_seed(0)
    config = make_transformer_config(num_layers=3, hidden_size=32, num_attention_heads=4,
                                     num_query_groups=groups, ffn_hidden_size=64,
                                     init_method_std=0.2)
    return build_model_chunk(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                             position_embedding_type=position_embedding_type,
                             attention_backend=backend)


def tiny_batch():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return tokens[:, :-1], positions, tokens[:, 1:]


def span_bounds(lengths):
    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    return [(s, s + n) for s, n in zip(starts, lengths)]


def unsplit_loss_and_grads(model):
    tokens, positions, labels = tiny_batch()
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, None, labels=labels).sum() / labels.numel()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def span_loss_and_grads(model, lengths):
    """Forward spans 0..k-1 in their span context, backward k-1..0 as the executor does."""
    tokens, positions, labels = tiny_batch()
    model.zero_grad(set_to_none=True)
    cache = MicrobatchKVCache(microbatch=0, seq_length=SEQ)
    losses = []
    for j, (start, end) in enumerate(span_bounds(lengths)):
        with span_context(SpanContext(0, j, start, end, cache)):
            token_losses = model(tokens[:, start:end], positions[:, start:end], None,
                                 labels=labels[:, start:end])
        losses.append(token_losses.sum() / labels.numel())
    for j, (start, end) in reversed(list(enumerate(span_bounds(lengths)))):
        with span_context(SpanContext(0, j, start, end, cache)):
            losses[j].backward()
    return sum(loss.detach() for loss in losses), {n: p.grad.clone()
                                                  for n, p in model.named_parameters()}


def assert_same_loss_and_grads(result, reference):
    (loss, grads), (ref_loss, ref_grads) = result, reference
    assert abs(loss - ref_loss) / abs(ref_loss) <= 1e-6, f"loss {loss} != {ref_loss}"
    assert grads.keys() == ref_grads.keys()
    bad = {}
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, f"{name} has no gradient in the reference"
        err = ((grads[name] - ref).abs().max() / ref.abs().max()).item()
        if err > 1e-5:
            bad[name] = f"{err:.2e}"
    assert not bad, f"gradients differ (max|g-g_ref|/max|g_ref|): {bad}"


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned_absolute"])
@pytest.mark.parametrize("lengths", SPLITS, ids=lambda ls: "-".join(map(str, ls)))
def test_spans_equal_unsplit_model(position_embedding_type, lengths):
    model = build_tiny_gpt(position_embedding_type)
    reference = unsplit_loss_and_grads(model)
    assert_same_loss_and_grads(span_loss_and_grads(model, lengths), reference)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_spans_equal_unsplit_model_gqa(backend):
    model = build_tiny_gpt("rope", backend=backend, groups=2)
    reference = unsplit_loss_and_grads(model)
    assert_same_loss_and_grads(span_loss_and_grads(model, [5, 11, 8]), reference)


def test_forward_only_spans_equal_unsplit():
    """Evaluation (no grad) through spans gives the unsplit loss."""
    model = build_tiny_gpt("rope").eval()
    tokens, positions, labels = tiny_batch()
    with torch.no_grad():
        reference = model(tokens, positions, None, labels=labels).sum()
        cache = MicrobatchKVCache(microbatch=0, seq_length=SEQ)
        total = torch.zeros(())
        for j, (start, end) in enumerate(span_bounds([5, 11, 8])):
            with span_context(SpanContext(0, j, start, end, cache)):
                total += model(tokens[:, start:end], positions[:, start:end], None,
                               labels=labels[:, start:end]).sum()
    assert abs(total - reference) / abs(reference) <= 1e-6


def test_rotary_table_inside_span_is_the_absolute_rows():
    model = build_tiny_gpt("rope")
    rotary = model.rotary_pos_emb
    assert isinstance(rotary, SpanRotaryEmbedding)
    full = rotary(SEQ)
    with span_context(SpanContext(0, 1, 5, 16, MicrobatchKVCache(microbatch=0, seq_length=SEQ))):
        assert torch.equal(rotary(11), full[5:16])
        with pytest.raises(RuntimeError, match="11 tokens"):
            rotary(12)


def test_model_uses_span_modules():
    model = build_tiny_gpt("rope")
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.core_attention, SpanAttention)
    assert layer.self_attention.core_attention.backend == "sdpa"
    norms = [m for m in model.modules() if isinstance(m, SequenceParallelNorm)]
    assert len(norms) == 3 * 2 + 1  # two per layer plus the final norm
    assert all(hasattr(p, "sequence_parallel") for n in norms for p in n.parameters())


def test_unsupported_position_embedding_is_refused():
    config = make_transformer_config(num_layers=1, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ValueError, match="--position-embedding-type 'yarn'"):
        build_model_chunk(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                          position_embedding_type="yarn")
