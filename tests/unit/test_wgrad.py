"""Split backward: B gives megatron's input gradient at once, W megatron's weight gradients later.

A tiny GPT stage built with `split_backward=True` runs two micro-batches' B inside
`WeightGradStore.begin(key)`, then W (`flush(key)`); every gradient must equal megatron's own
stage's (fp32), with and without megatron's DDP, at TP=1 here and at TP=2 with and without
sequence parallelism in one torchrun launch.
"""
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from seq1f1b.megatron_adapter import build_model_chunk, make_transformer_config, span_layer_spec
from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context
from seq1f1b.runtime.wgrad import (
    SplitBackwardColumnParallelLinear,
    SplitBackwardRowParallelLinear,
    WeightGradStore,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from launch import run_cases  # noqa: E402
from wgrad_worker import compare_split_backward  # noqa: E402

TOLERANCE = 1e-6


def assert_exact_split(result: dict, case: str = "tp=1", fusion: bool = False) -> None:
    assert result["deferred"] > 0, case
    assert result["fused"] == fusion, f"{case}: fused {result['fused']}"
    assert result["pending_after_b"] == [[0, 1, 0], [1, 0, 0]], case
    assert result["pending_after_w"] == 0, case
    assert result["deferred_absent_after_b"], f"{case}: a deferred weight got its grad during B"
    for name in ("input_after_b", "others_after_b", "all_after_w", "plain_input", "plain_all"):
        assert result[name] <= TOLERANCE, (case, name, result)


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("ddp,fusion", [(False, False), (True, False), (True, True)],
                         ids=["plain", "ddp", "ddp-fused"])
def test_b_then_w_equals_megatrons_backward(ddp, fusion):
    """`fusion`: gradient accumulation fusion (the GEMM into main_grad), exact against
    megatron's unfused stage."""
    result = compare_split_backward(tp=1, sequence_parallel=False, ddp=ddp, fusion=fusion)
    assert result["deferred"] == 2 * 4 + 1    # QKV, projection, FC1, FC2 of 2 layers; output
    assert_exact_split(result, fusion=fusion)


def test_b_then_w_equals_megatrons_backward_at_tp2():
    cases = [{"tp": 2, "sequence_parallel": sp, "ddp": ddp}
             for sp in (False, True) for ddp in (False, True)]
    cases += [{"tp": 2, "sequence_parallel": sp, "ddp": True, "fusion": True}
              for sp in (False, True)]
    for case, result in zip(cases, run_cases(2, "wgrad_worker.py", cases, timeout_s=300)):
        assert_exact_split(result, str(case), fusion=case.get("fusion", False))


@pytest.mark.usefixtures("megatron_world")
def test_split_backward_is_opt_in():
    config = make_transformer_config(num_layers=1, hidden_size=16, num_attention_heads=2)
    plain, split = span_layer_spec(config).submodules, span_layer_spec(
        config, split_backward=True).submodules
    assert plain.self_attention.submodules.linear_qkv is ColumnParallelLinear
    assert plain.mlp.submodules.linear_fc2 is RowParallelLinear
    assert split.self_attention.submodules.linear_qkv is SplitBackwardColumnParallelLinear
    assert split.self_attention.submodules.linear_proj is SplitBackwardRowParallelLinear
    assert split.mlp.submodules.linear_fc1 is SplitBackwardColumnParallelLinear
    assert split.mlp.submodules.linear_fc2 is SplitBackwardRowParallelLinear
    model = build_model_chunk(config, vocab_size=32, max_sequence_length=8)
    assert not any(isinstance(m, (SplitBackwardColumnParallelLinear,
                                  SplitBackwardRowParallelLinear)) for m in model.modules())


@pytest.mark.usefixtures("megatron_world")
def held_bytes(store: WeightGradStore) -> int:
    """Bytes of the distinct storages the store holds."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in store.held_tensors()}
    return sum(storages.values())


def test_w_reuses_what_b_saved_and_an_empty_key_is_a_no_op():
    """W runs after autograd freed B's graph (so it recomputes nothing), keys stay apart, and a
    key nothing was deferred under (a stage without split linears) flushes to nothing."""
    config = make_transformer_config(num_layers=1, hidden_size=16, num_attention_heads=2)
    torch.manual_seed(0)
    layer = SplitBackwardColumnParallelLinear(16, 8, config=config, init_method=torch.nn.init.ones_,
                                              bias=False, gather_output=False)
    store = WeightGradStore()
    inputs = [torch.randn(4, 1, 16, requires_grad=True) for _ in range(2)]
    for key, x in enumerate(inputs):
        out, _ = layer(x)
        with store.begin(key):
            out.square().sum().backward()
        assert x.grad is not None and layer.weight.grad is None
    per_key = (4 * 16 + 4 * 8) * 4      # the fp32 input (4x1x16) and output grad (4x1x8)
    assert held_bytes(store) == 2 * per_key
    store.flush("nothing")
    store.flush(1)
    assert store.pending() == [0] and held_bytes(store) == per_key
    first = layer.weight.grad.clone()
    out, _ = layer(inputs[1])
    expected_1 = torch.autograd.grad(out.square().sum(), layer.weight)[0]
    torch.testing.assert_close(first, expected_1, rtol=1e-6, atol=0)
    store.flush(0)
    out, _ = layer(inputs[0])
    expected_0 = torch.autograd.grad(out.square().sum(), layer.weight)[0]
    torch.testing.assert_close(layer.weight.grad, expected_0 + expected_1, rtol=1e-6, atol=0)


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_spans_b_in_reverse_then_w_in_any_order_equal_the_unsplit_model(tied):
    """The KV-cache routing of dK/dV survives the split: B(0,j) for j = k-1..0 each inside
    begin((0, j, 0)), then the W in forward order (any order after their B is valid). With tied
    embeddings the output layer's deferred part joins the embedding's own gradient."""
    config = make_transformer_config(num_layers=2, hidden_size=32, num_attention_heads=4,
                                     ffn_hidden_size=64, init_method_std=0.2)
    torch.manual_seed(0)
    model = build_model_chunk(config, vocab_size=64, max_sequence_length=24,
                              share_embeddings_and_output_weights=tied, split_backward=True)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 25), generator=gen)
    inputs, labels, positions = tokens[:, :-1], tokens[:, 1:], torch.arange(24).expand(2, 24)
    (model(inputs, positions, None, labels=labels).sum() / labels.numel()).backward()
    expected = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    bounds = [(0, 5), (5, 16), (16, 24)]
    cache, store, losses = MicrobatchKVCache(microbatch=0, seq_length=24), WeightGradStore(), []
    for j, (start, end) in enumerate(bounds):
        with span_context(SpanContext(0, j, start, end, cache)):
            losses.append(model(inputs[:, start:end], positions[:, start:end], None,
                                labels=labels[:, start:end]).sum() / labels.numel())
    for j, (start, end) in reversed(list(enumerate(bounds))):
        with span_context(SpanContext(0, j, start, end, cache)), store.begin((0, j, 0)):
            losses[j].backward()
    assert store.pending() == [(0, 2, 0), (0, 1, 0), (0, 0, 0)]
    for j in range(len(bounds)):
        store.flush((0, j, 0))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
