"""Activation recompute with the span KV cache: exact.

Megatron re-runs a layer's (full) or core attention's (selective) forward during the backward. The
recomputed forward of span j must see exactly the K/V prefix the original saw and must route the
later spans' dK/dV into span j's K/V; with dropout, it must draw the original masks.
"""
import pytest
import torch
from megatron.core import tensor_parallel

from seq1f1b.runtime import attention
from seq1f1b.megatron_adapter import build_model_chunk, make_transformer_config
from test_span_model import (assert_same_loss_and_grads, span_loss_and_grads,
                             unsplit_loss_and_grads, SEQ, VOCAB)

pytestmark = pytest.mark.usefixtures("megatron_world")

RECOMPUTE = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "full-block-2": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=2),
    "selective-core-attn": dict(recompute_granularity="selective",
                                recompute_modules=["core_attn"]),
}


def build(position_embedding_type="rope", dropout=0.0, **recompute):
    config = make_transformer_config(num_layers=3, hidden_size=32, num_attention_heads=4,
                                     ffn_hidden_size=64, init_method_std=0.2,
                                     hidden_dropout=dropout, attention_dropout=dropout,
                                     **recompute)
    torch.manual_seed(0)
    return build_model_chunk(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                             position_embedding_type=position_embedding_type,
                             attention_backend="sdpa")


def _reseed():
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7)


@pytest.mark.parametrize("recompute", RECOMPUTE, ids=list(RECOMPUTE))
@pytest.mark.parametrize("position_embedding_type", ["rope", "learned_absolute"])
def test_recomputed_spans_equal_unsplit_model(recompute, position_embedding_type):
    plain = build(position_embedding_type)
    reference = unsplit_loss_and_grads(plain)
    model = build(position_embedding_type, **RECOMPUTE[recompute])
    model.load_state_dict(plain.state_dict())
    assert_same_loss_and_grads(span_loss_and_grads(model, [5, 11, 8]), reference)


@pytest.mark.parametrize("recompute", RECOMPUTE, ids=list(RECOMPUTE))
def test_recompute_with_dropout_equals_no_recompute(recompute):
    plain = build(dropout=0.2)
    model = build(dropout=0.2, **RECOMPUTE[recompute])
    model.load_state_dict(plain.state_dict())
    _reseed()
    reference = span_loss_and_grads(plain, [5, 11, 8])
    _reseed()
    result = span_loss_and_grads(model, [5, 11, 8])
    assert_same_loss_and_grads(result, reference)
    no_dropout = build()
    no_dropout.load_state_dict(plain.state_dict())
    loss_without_dropout = span_loss_and_grads(no_dropout, [5, 11, 8])[0]
    assert abs(loss_without_dropout - reference[0]) / abs(reference[0]) > 1e-3, \
        "dropout had no effect: the comparison above would not see wrong masks"


@pytest.mark.parametrize("recompute,recomputed_layers",
                         [(None, 0), ("full-uniform-1", 3), ("full-block-2", 2),
                          ("selective-core-attn", 3)])
def test_attention_kernel_runs_again_in_backward_only_when_recomputing(
        recompute, recomputed_layers, monkeypatch):
    """3 layers x 3 spans of forward kernel calls, plus one per recomputed layer and span."""
    model = build(**RECOMPUTE.get(recompute, {}))
    calls = []
    kernel = attention._KERNELS["sdpa"]

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setitem(attention._KERNELS, "sdpa", counted)
    span_loss_and_grads(model, [5, 11, 8])
    assert len(calls) == 3 * 3 + recomputed_layers * 3
