"""The one cost formula: FLOPs telescope over spans, bytes match Korthikanti et al., presets."""
import functools
import random

import pytest

from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.costs import (PRESETS, ModelConfig, Recompute, activation_bytes,
                                backward_workspace_bytes, chunk_activation_bytes,
                                iteration_flops, kv_cache_bytes, layer_flops, logits_flops,
                                model_forward_flops, preset, stage_parameters)

PAPER_TABLE = {  # PAPER.md: layers, hidden, heads (FFN 4h)
    "1.3b": (24, 2048, 16), "2.7b": (32, 2560, 32), "7b": (32, 4096, 32),
    "13b": (40, 5120, 40), "30b": (64, 6144, 64)}


def test_presets_are_the_papers_configs():
    assert set(PRESETS) == set(PAPER_TABLE)
    for name, (layers, hidden, heads) in PAPER_TABLE.items():
        model = preset(name.upper())
        assert (model.num_layers, model.hidden_size, model.num_attention_heads) == \
            (layers, hidden, heads)
        assert model.ffn_hidden_size == 4 * hidden
        assert model.num_query_groups == heads
        assert model.vocab_size == 50257


def test_unknown_preset_names_the_flag_and_the_choices():
    with pytest.raises(ScheduleError, match=r"--model.*1\.3b, 2\.7b, 7b, 13b, 30b"):
        preset("8b")


@pytest.mark.parametrize("kwargs, flag", [
    (dict(num_layers=0, hidden_size=64, num_attention_heads=4), "--num-layers"),
    (dict(num_layers=2, hidden_size=66, num_attention_heads=4), "--hidden-size"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=3),
     "--num-query-groups"),
])
def test_bad_model_config_names_the_flag(kwargs, flag):
    with pytest.raises(ScheduleError, match=flag):
        ModelConfig(**kwargs)


def test_layer_flops_are_the_papers_formula_without_gqa():
    model = preset("7b")
    h, n, d, f = 4096, 32, 128, 4 * 4096
    s, end = 3000, 10000
    got = layer_flops(model, s, end)
    assert got.linear == 8 * s * h * (n * d) + 4 * s * h * f
    assert got.attention == (4 * d + 3) * n * (s * end - s * s / 2)


def test_gqa_shrinks_only_the_kv_projection():
    full = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8)
    gqa = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2)
    s, d = 100, 32
    # K and V projections: 2 GEMMs of h x (g*d) each, 2 FLOPs per multiply-add.
    assert full.num_query_groups == 8
    assert layer_flops(full, s, s).linear - layer_flops(gqa, s, s).linear == \
        2 * 2 * s * 256 * (8 - 2) * d
    assert layer_flops(full, s, s).attention == layer_flops(gqa, s, s).attention


@pytest.mark.parametrize("model", [preset("7b"), preset("30b"),
                                   ModelConfig(num_layers=3, hidden_size=35, num_attention_heads=5,
                                               vocab_size=101)])
def test_span_costs_sum_exactly_to_the_whole_sequence(model):
    rng = random.Random(0)
    seq_length = 131072
    whole = model_forward_flops(model, seq_length, seq_length)
    for splits in (2, 3, 7):
        cuts = sorted(rng.sample(range(1, seq_length), splits - 1))
        bounds = list(zip([0] + cuts, cuts + [seq_length]))
        parts = sum(model_forward_flops(model, end - start, end) for start, end in bounds)
        assert parts == whole


def test_backward_is_twice_forward_and_w_holds_no_attention():
    flops = layer_flops(preset("2.7b"), 4096, 8192)
    assert flops.backward == 2 * flops.forward
    assert flops.input_grad + flops.weight_grad == flops.backward
    assert flops.weight_grad == flops.linear
    assert flops.input_grad - flops.weight_grad == 2 * flops.attention


def test_logits_and_embedding_gemm():
    model = preset("1.3b")
    assert logits_flops(model, 10).forward == 2 * 10 * 2048 * 50257
    assert logits_flops(model, 10, embedding_as_gemm=True).forward == 2 * 2 * 10 * 2048 * 50257
    L = 8192
    assert iteration_flops(model, L, global_batch_size=4) == \
        3 * 4 * model_forward_flops(model, L, L, embedding_as_gemm=True)


def test_activation_bytes_match_korthikanti_with_flash_attention():
    """34*s*b*h bytes per layer (16-bit, dropout masks kept), the 5*a*s^2*b attention matrix
    replaced by fp32 softmax statistics (4*n*s*b); K/V counted in the KV cache; plus the cos and
    sin megatron's unfused RoPE saves (not in their count)."""
    model = preset("13b")
    h, n = 5120, 40
    s, b, t = 2048, 2, 4

    rope = s * b * 4 * (h // n) * 2     # cos and sin for Q and K, 16-bit, not split by TP

    def total(**kw):
        return activation_bytes(model, s, b, dropout=True, **kw) + \
            kv_cache_bytes(model, s, b, tp=kw.get("tp", 1)) - rope

    assert total() == s * b * (34 * h + 4 * n)
    # Tensor parallel only: 10*s*b*h stay replicated, 24*s*b*h are split (their table 2).
    assert total(tp=t) == s * b * (10 * h + 24 * h / t + 4 * n / t)
    # With sequence parallelism everything is split.
    assert total(tp=t, sequence_parallel=True) == s * b * (34 * h + 4 * n) / t
    # Dropout p = 0 keeps no masks: 2*s*b*h bytes less.
    assert activation_bytes(model, s, b) == \
        activation_bytes(model, s, b, dropout=True) - 2 * s * b * h


def test_kv_cache_bytes_follow_query_groups():
    model = ModelConfig(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=2)
    assert kv_cache_bytes(model, 1000, batch=3, tp=2) == 2 * 1000 * 3 * 2 * 64 * 2 / 2


@pytest.mark.parametrize("name, billions", [("1.3b", 1.3), ("2.7b", 2.7), ("7b", 7), ("13b", 13),
                                            ("30b", 30)])
def test_parameter_counts_match_the_model_names(name, billions):
    model = preset(name)
    whole = stage_parameters(model, model.num_layers, first=True, last=True)
    assert abs(whole / 1e9 - billions) / billions < 0.1


LLAMA = dict(normalization="RMSNorm", add_bias_linear=False, swiglu=True)


@pytest.mark.parametrize("shape, published", [
    # Llama-2-7B and Llama-3-8B: the parameter counts their model cards and HF checkpoints give.
    (dict(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
          vocab_size=32000), 6_738_415_616),
    (dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
          ffn_hidden_size=14336, vocab_size=128256), 8_030_261_248),
])
def test_llama_parameter_counts_are_exact(shape, published):
    model = ModelConfig(**shape, **LLAMA)
    assert stage_parameters(model, model.num_layers, first=True, last=True) == published


def test_swiglu_adds_a_third_mlp_gemm_and_qkv_bias_stays_without_linear_biases():
    gelu = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96)
    swiglu = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                         swiglu=True)
    s, h, f = 10, 64, 96
    assert layer_flops(swiglu, s, s).linear - layer_flops(gelu, s, s).linear == 2 * s * h * f
    no_bias = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                          add_bias_linear=False)
    qkv_bias = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                           add_bias_linear=False, add_qkv_bias=True)
    count = functools.partial(stage_parameters, num_layers=1, first=False, last=False)
    assert count(qkv_bias) - count(no_bias) == 3 * h


def test_stage_parameters_add_up_and_shard():
    model = preset("7b")
    pp = 4
    stages = [stage_parameters(model, model.num_layers // pp, first=r == 0, last=r == pp - 1)
              for r in range(pp)]
    assert sum(stages) == stage_parameters(model, model.num_layers, first=True, last=True)
    assert stages[0] > stages[1] == stages[2] < stages[3]
    sharded = stage_parameters(model, 8, first=False, last=False, tp=2)
    assert stages[1] / 2 < sharded < stages[1] / 2 * 1.001


# -- activation recompute ---------------------------------------------------------------------
SMALL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256)
TOKENS = 10 * 2               # a span of 10 tokens, micro-batch size 2
# Per token of one layer, bf16, TP=2 with sequence parallelism (h=64, n=4, d=16, f=256):
INPUT = 64 * 2 / 2                         # the layer's input hidden states
STATS = 4 * 4 / 2                          # fp32 softmax statistics of 4 heads
ROPE = 4 * 16 * 2                          # cos and sin for Q and K, not split by TP
PLAIN = 4 * INPUT + (2 * 4 * 16 + 2 * 256) * 2 / 2 + STATS + ROPE   # + Q, attn out, FC1, GeLU


def _chunk(layers=4, recompute=None, sequence_parallel=True):
    return chunk_activation_bytes(SMALL, layers, 10, 2, tp=2,
                                  sequence_parallel=sequence_parallel, recompute=recompute)


def test_recompute_bytes_per_model_chunk_by_hand():
    assert activation_bytes(SMALL, 10, 2, tp=2, sequence_parallel=True) == TOKENS * PLAIN
    assert _chunk() == 4 * TOKENS * PLAIN
    assert _chunk(recompute=Recompute("selective")) == 4 * TOKENS * (PLAIN - STATS)
    # Full, uniform: one checkpointed input per group of N layers.
    for n, groups in ((1, 4), (2, 2), (4, 1)):
        assert _chunk(recompute=Recompute("full", "uniform", n)) == groups * TOKENS * INPUT
    # Full, block: the first N layers keep their input, the rest everything.
    assert _chunk(recompute=Recompute("full", "block", 1)) == TOKENS * (INPUT + 3 * PLAIN)
    assert _chunk(recompute=Recompute("full", "block", 3)) == TOKENS * (3 * INPUT + PLAIN)
    # Without sequence parallelism the checkpointed input is replicated over TP.
    assert _chunk(recompute=Recompute("full"), sequence_parallel=False) == 4 * TOKENS * 64 * 2


def test_block_of_every_layer_is_uniform_groups_of_one():
    uniform_one = _chunk(recompute=Recompute("full", "uniform", 1))
    assert _chunk(recompute=Recompute("full", "block", 4)) == uniform_one
    # megatron's block loop checkpoints every layer when N exceeds the chunk's layers.
    assert _chunk(recompute=Recompute("full", "block", 9)) == uniform_one


def test_full_recompute_keeps_less_than_selective_which_keeps_less_than_none():
    model, s = preset("7b"), 131072
    kept = [chunk_activation_bytes(model, 8, s, tp=8, sequence_parallel=True, recompute=r)
            for r in (Recompute("full"), Recompute("selective"), None)]
    assert kept == sorted(kept) and len(set(kept)) == 3


def test_uniform_groups_must_divide_the_chunk():
    """megatron-core 0.16's uniform loop would index past the chunk's last layer."""
    with pytest.raises(ScheduleError, match="--recompute-num-layers 3"):
        _chunk(recompute=Recompute("full", "uniform", 3))


def test_recompute_flags_defaults_and_refusals():
    assert Recompute.from_flags(None) is None
    full = Recompute.from_flags("full")
    assert (full.method, full.num_layers) == ("uniform", 1)       # as the training harness
    assert Recompute("full", "block").num_layers == 1
    selective = Recompute.from_flags("selective")
    assert (selective.method, selective.num_layers) == (None, None)
    for flags, flag in [(("partial",), "--recompute-granularity"),
                        (("full", "random"), "--recompute-method"),
                        (("full", "uniform", 0), "--recompute-num-layers"),
                        (("selective", "block"), "--recompute-method"),
                        (("selective", None, 2), "--recompute-num-layers"),
                        ((None, "uniform"), "--recompute-method"),
                        ((None, None, 1), "--recompute-num-layers")]:
        with pytest.raises(ScheduleError, match=flag):
            Recompute.from_flags(*flags)


def test_backward_workspace_holds_what_the_recompute_rebuilds():
    def workspace(recompute, last_stage=False):
        return backward_workspace_bytes(SMALL, 10, 2, tp=2, last_stage=last_stage,
                                        sequence_parallel=True, recompute=recompute)

    mlp = 2 * TOKENS * (256 / 2 + 64) * 2
    assert workspace(None) == mlp
    assert workspace(Recompute("full", "uniform", 2)) == mlp + 2 * TOKENS * PLAIN
    assert workspace(Recompute("full", "block", 3)) == mlp + TOKENS * PLAIN
    assert workspace(Recompute("selective")) == mlp
    # The logits' gradient comes before any layer's backward: the larger of the two.
    logits_grad = TOKENS * SMALL.vocab_size / 2 * 2
    assert workspace(Recompute("full"), last_stage=True) == max(logits_grad,
                                                                mlp + TOKENS * PLAIN)
