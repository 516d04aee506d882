"""The memory estimator: what it counts per stage, where its peaks come from, its CLI."""
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from seq1f1b.plan import registry
from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.costs import (ModelConfig, Recompute, activation_bytes,
                                backward_workspace_bytes, kv_cache_bytes, layer_input_bytes,
                                logits_bytes, preset, stage_parameters)
from seq1f1b.plan.memory import GIB, TrainingSetup, estimate_memory
from seq1f1b.plan.simulate import SpanCosts, simulate
from seq1f1b.plan.tune.held import HeldProfile

REPO = Path(__file__).resolve().parents[2]
MODEL = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, vocab_size=1000)


def _setup(**kwargs) -> TrainingSetup:
    base = dict(model=MODEL, seq_length=4096, schedule="1f1b", pp=4, microbatches=8)
    return TrainingSetup(**{**base, **kwargs})


def test_parameters_of_all_stages_add_up_to_the_model():
    for schedule, chunks in (("1f1b", 1), ("interleaved-1f1b", 2)):
        estimate = estimate_memory(_setup(schedule=schedule, chunks=chunks, tp=2))
        vocab = estimate.setup.padded_vocab_size
        whole = stage_parameters(replace(MODEL, vocab_size=vocab), 8, first=True, last=True,
                                 tp=2)
        assert sum(s.parameters for s in estimate.stages) == pytest.approx(whole)


def test_bytes_per_parameter_and_the_distributed_optimizer():
    bf16 = estimate_memory(_setup(dp=4, distributed_optimizer=True)).stages[1]
    assert bf16.parameter_bytes == 2 * bf16.parameters
    assert bf16.gradient_bytes == 4 * bf16.parameters          # fp32 grad accumulation
    assert bf16.optimizer_bytes_replicated == 12 * bf16.parameters
    assert bf16.optimizer_bytes == bf16.optimizer_bytes_sharded == 12 * bf16.parameters / 4
    fp32 = estimate_memory(_setup(precision="fp32")).stages[1]
    assert (fp32.parameter_bytes, fp32.optimizer_bytes) == (4 * fp32.parameters,
                                                           8 * fp32.parameters)


def test_vocabulary_is_padded_as_megatron_pads_it():
    assert TrainingSetup(model=preset("7b"), seq_length=8, tp=8).padded_vocab_size == 51200
    assert TrainingSetup(model=preset("7b"), seq_length=8).padded_vocab_size == 50304


def test_1f1b_rank0_holds_p_whole_sequences():
    estimate = estimate_memory(_setup(tp=2, sequence_parallel=True))
    rank0 = estimate.stages[0]
    per_sequence = 2 * (activation_bytes(MODEL, 4096, tp=2, sequence_parallel=True)
                        + kv_cache_bytes(MODEL, 4096, tp=2))        # 2 layers per stage
    assert rank0.peak_live_spans == 4
    assert rank0.held_for_backward_bytes == pytest.approx(4 * per_sequence)
    assert rank0.logits_bytes == 0


@pytest.mark.parametrize("pp, k", [(4, 4), (4, 2), (2, 4), (8, 3)])
def test_seq1f1b_rank0_holds_p_plus_k_minus_1_spans(pp, k):
    """SEQ1F1B.md: with equal spans rank 0 holds (P + k - 1)/(k P) of 1F1B's activations.

    K/V go by micro-batch (the whole sequence's, from F(i,0) to B(i,0)). In the steady state
    every F brings rank 0 to P + k - 1 live spans; right after an F(i,0) they are span 0 of i,
    whole micro-batches, and r >= 1 remaining spans of the oldest: P + k - 2 = k * whole + r, so
    2 + ceil((P - 2) / k) micro-batches are in flight, and never more. The oldest has begun its
    backward, so its dK/dV accumulators hold the rows of its first k - 1 spans, in fp32: twice
    their bf16 K/V bytes.
    """
    model = replace(MODEL, num_layers=8 * 3)
    seq_length = 4096 * 3
    one = estimate_memory(_setup(model=model, pp=pp, seq_length=seq_length))
    seq = estimate_memory(_setup(model=model, pp=pp, seq_length=seq_length, schedule="seq1f1b",
                                 splits=k))
    ratio = seq.stages[0].activation_bytes / one.stages[0].activation_bytes
    assert ratio == pytest.approx((pp + k - 1) / (k * pp))
    layers = model.num_layers // pp
    in_flight = 2 + -(-(pp - 2) // k)
    assert seq.stages[0].kv_cache_bytes == pytest.approx(
        (in_flight + 2 * (k - 1) / k) * layers * kv_cache_bytes(model, seq_length))
    assert one.stages[0].kv_cache_bytes == pytest.approx(
        pp * layers * kv_cache_bytes(model, seq_length))


@pytest.mark.parametrize("groups, accumulators, peak", [
    (1, 4.0, 26.5),      # one group: all the accumulators on top of both spans' activations
    (4, 4.0, 23.5),      # the first group's share of them
    (4, 40.0, 55.0),     # larger than the span: the last group's moment is the peak
])
def test_a_first_backward_makes_its_accumulators_as_its_groups_free_the_span(groups,
                                                                             accumulators, peak):
    """One stage, one micro-batch of two spans (F0 F1 B1 B0): activations 10 per span, K/V 1,
    logits 0.5, dK/dV accumulators of span 0's rows `accumulators`. Held after F1: 2 x 10 + 2
    + 2 x 0.5 = 23. B1 runs the loss's backward (its 0.5 of logits go), then the groups last
    to first, each making its accumulators and freeing its share of span 1's activations:
    22.5 + acc/G at the first group, 22.5 + acc - 10 (G-1)/G at the last. (The rule before
    counted 23 + acc for any G: 27 and 63.)"""
    schedule = registry.build("1f1b", 1, 1, splits=2)
    row = (10.0, 10.0)
    costs = SpanCosts((row,), (row,), None, activation_bytes=(row,), kv_cache_bytes=((1.0, 1.0),),
                      logits_bytes=((0.5, 0.5),), kv_accumulator_bytes=((accumulators, 0.0),),
                      layer_groups=(groups,))
    rank = simulate(schedule, costs).ranks[0]
    assert rank.peak_held_bytes == max(23.0, peak)
    assert HeldProfile.of(schedule).peaks(costs)[0].peak_held_bytes == rank.peak_held_bytes


def test_last_stage_keeps_the_fp32_logits_of_its_live_spans():
    """... and the head's inputs: the final norm's and the output layer's (2h per token, bf16,
    replicated over TP without sequence parallelism)."""
    estimate = estimate_memory(_setup(schedule="seq1f1b", splits=4, tp=2))
    last = estimate.stages[-1]
    vocab_model = replace(MODEL, vocab_size=estimate.setup.padded_vocab_size)
    assert last.peak_live_spans == 4       # P - r + k - 1 with r = P - 1
    head_inputs = 2 * 1024 * MODEL.hidden_size * 2
    assert last.logits_bytes == pytest.approx(
        4 * (logits_bytes(vocab_model, 1024, tp=2) + head_inputs))
    assert all(s.logits_bytes == 0 for s in estimate.stages[:-1])


def test_the_loss_backward_at_forward_keeps_the_input_gradient_instead_of_the_softmax():
    """--loss-backward-in-forward on the README's 7B/1M-token setup: the last stage held the
    fp32 softmax of its 32 live spans (13.5 GiB, the run's peak); it keeps the output layer's
    input gradient instead (the sizes of the head's inputs stay: the input itself goes) and one
    micro-batch's fp32 output-weight gradient, so rank 0 holds the peak."""
    setup = TrainingSetup(model=preset("7b"), seq_length=1048576, schedule="seq1f1b", pp=4,
                          microbatches=8, splits=32, tp=8, sequence_parallel=True, cp=2,
                          distributed_optimizer=True, recompute_granularity="full")
    plain, early = (estimate_memory(replace(setup, loss_backward_in_forward=flag))
                    for flag in (False, True))
    vocab = replace(preset("7b"), vocab_size=setup.padded_vocab_size)
    softmax = logits_bytes(vocab, 32768 // 2, tp=8)
    weight_gradient = vocab.vocab_size * vocab.hidden_size / 8 * 4
    assert plain.stages[-1].peak_live_spans == 32
    assert plain.stages[-1].logits_bytes - early.stages[-1].logits_bytes == \
        pytest.approx(32 * softmax - weight_gradient)
    assert [s.logits_bytes for s in early.stages[:-1]] == [0, 0, 0]
    assert plain.peak_stage.rank == 3 and early.peak_stage.rank == 0
    assert early.peak_bytes == plain.stages[0].total_bytes
    assert early.peak_bytes / GIB == pytest.approx(48.59, abs=0.005)


def test_megatron_schedules_hold_what_our_plans_of_their_order_hold():
    for megatron, ours, chunks in (("megatron-1f1b", "1f1b", 1),
                                   ("megatron-interleaved-1f1b", "interleaved-1f1b", 2)):
        a = estimate_memory(_setup(schedule=megatron, chunks=chunks))
        b = estimate_memory(_setup(schedule=ours, chunks=chunks))
        assert [s.total_bytes for s in a.stages] == [s.total_bytes for s in b.stages]


def test_total_and_verdict():
    estimate = estimate_memory(_setup(overhead_gib=0.5))
    stage = estimate.stages[0]
    assert stage.total_bytes == pytest.approx(
        stage.parameter_bytes + stage.gradient_bytes + stage.optimizer_bytes_replicated
        + stage.held_for_backward_bytes + stage.workspace_bytes + 0.5 * GIB)
    peak = estimate.peak_bytes / GIB
    assert estimate.fits(peak * 1.001) and not estimate.fits(peak * 0.999)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(tp=3), "--tp"), (dict(dp=0), "--dp"), (dict(precision="fp8"), "--precision"),
    (dict(overhead_gib=-1.0), "--overhead-gb"), (dict(pp=3), "--pp"),
])
def test_bad_setups_name_the_flag(kwargs, flag):
    with pytest.raises(ScheduleError, match=flag):
        estimate_memory(_setup(**kwargs))


# -- activation recompute ---------------------------------------------------------------------
FULL = dict(recompute_granularity="full")


def test_recompute_stage_activations_by_hand():
    """1F1B, P=4, 2 layers per stage, TP=2 with SP: rank 0 holds 4 whole sequences."""
    def rank0(**recompute):
        return estimate_memory(_setup(tp=2, sequence_parallel=True, **recompute)).stages[0]

    h, n, d, f, s = 256, 8, 32, 1024, 4096
    inputs = s * h * 2 / 2                                    # one layer's input, bf16, SP
    rope = s * 4 * d * 2                                       # cos/sin for Q and K
    plain = 4 * inputs + s * (2 * n * d + 2 * f) * 2 / 2 + s * 4 * n / 2 + rope
    assert rank0().activation_bytes == 4 * 2 * plain
    assert rank0(recompute_granularity="selective").activation_bytes == \
        4 * 2 * (plain - s * 4 * n / 2)
    assert rank0(**FULL).activation_bytes == 4 * 2 * inputs
    assert rank0(**FULL, recompute_num_layers=2).activation_bytes == 4 * 1 * inputs
    assert rank0(**FULL, recompute_method="block").activation_bytes == 4 * (inputs + plain)
    assert all(rank0(**kw).kv_cache_bytes == rank0().kv_cache_bytes
               for kw in (FULL, dict(recompute_granularity="selective")))


@pytest.mark.parametrize("model, tp", [(MODEL, 2), (preset("7b"), 8)])
def test_recompute_orders_the_peaks_and_leaves_the_states_alone(model, tp):
    def stages(**recompute):
        return estimate_memory(_setup(model=model, schedule="seq1f1b", splits=4,
                                      seq_length=65536, tp=tp, sequence_parallel=True,
                                      **recompute)).stages

    none, selective, full = stages(), stages(recompute_granularity="selective"), stages(**FULL)
    for a, b, c in zip(full, selective, none):
        assert a.held_for_backward_bytes < b.held_for_backward_bytes < c.held_for_backward_bytes
        assert (a.parameters, a.gradient_bytes, a.optimizer_bytes, a.kv_cache_bytes) == \
            (c.parameters, c.gradient_bytes, c.optimizer_bytes, c.kv_cache_bytes)
        if model.num_layers // 4 >= 8:
            # Enough layers per stage that full recompute's transient group (the workspace)
            # is small next to what it saves.
            assert a.total_bytes < b.total_bytes < c.total_bytes


def test_block_over_every_layer_holds_what_uniform_groups_of_one_hold():
    for schedule, chunks in (("seq1f1b", 1), ("seq1f1b-interleaved", 2)):
        base = dict(schedule=schedule, chunks=chunks, splits=2, **FULL)
        block = estimate_memory(_setup(**base, recompute_method="block",
                                       recompute_num_layers=8 // (4 * chunks)))
        uniform = estimate_memory(_setup(**base, recompute_method="uniform"))
        assert [s.held_for_backward_bytes for s in block.stages] == \
            [s.held_for_backward_bytes for s in uniform.stages]


def test_full_recompute_workspace_holds_one_recomputed_group():
    estimate = estimate_memory(_setup(**FULL, recompute_num_layers=2))
    model = replace(MODEL, vocab_size=estimate.setup.padded_vocab_size)
    assert estimate.stages[1].workspace_bytes == backward_workspace_bytes(model, 4096) + \
        2 * activation_bytes(model, 4096)
    # Rank 1 holds P - 1 = 3 sequences, each one checkpointed input for its 2-layer group.
    assert estimate.stages[1].activation_bytes == 3 * layer_input_bytes(model, 4096)


def test_setup_resolves_full_recompute_as_the_harness_does():
    setup = _setup(**FULL)
    assert (setup.recompute_method, setup.recompute_num_layers) == ("uniform", 1)
    assert setup.recompute == Recompute("full", "uniform", 1)
    assert _setup().recompute is None


@pytest.mark.parametrize("kwargs, flag", [
    (dict(recompute_granularity="partial"), "--recompute-granularity"),
    (dict(recompute_method="block"), "--recompute-method"),
    (dict(recompute_granularity="selective", recompute_num_layers=1), "--recompute-num-layers"),
    (dict(recompute_granularity="full", recompute_method="blocks"), "--recompute-method"),
    (dict(recompute_granularity="full", recompute_num_layers=-1), "--recompute-num-layers"),
    (dict(recompute_granularity="full", recompute_num_layers=3), "--recompute-num-layers"),
])
def test_bad_recompute_setups_name_the_flag(kwargs, flag):
    with pytest.raises(ScheduleError, match=flag):
        estimate_memory(_setup(**kwargs))


# -- tools/plan.py memory ---------------------------------------------------------------------
_spec = importlib.util.spec_from_file_location("plan_cli_memory", REPO / "tools" / "plan.py")
plan_cli = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = plan_cli
_spec.loader.exec_module(plan_cli)

ARGS = ["memory", "--schedule", "seq1f1b", "--pp", "4", "--microbatches", "32", "--splits", "4",
        "--model", "7b", "--seq-length", "65536", "--tp", "8", "--sequence-parallel",
        "--partition", "compute", "--distributed-optimizer"]


def test_cli_json_matches_the_library(capsys):
    assert plan_cli.main(ARGS + ["--json", "--gpu-memory", "40"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["span_lengths"] == [25136, 16248, 13000, 11152]
    assert len(data["stages"]) == 4 and data["gpu_memory_gib"] == 40
    assert data["oom"] == (data["peak_bytes"] > 40 * GIB)
    assert data["peak_bytes"] == max(s["total_bytes"] for s in data["stages"])
    for stage in data["stages"]:
        assert stage["optimizer_bytes"] == stage["optimizer_bytes_sharded"]


def test_cli_text_table(capsys):
    assert plan_cli.main(ARGS) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:4] == ["rank", "spans", "params", "grads"]
    assert [line.split()[0] for line in out[2:6]] == ["0", "1", "2", "3"]
    assert out[-1].startswith("peak ") and "fits" in out[-1]


@pytest.mark.parametrize("extra, needle", [
    (["--gpu-memory", "0"], "--gpu-memory"), (["--tp", "3"], "--tp"),
    (["--precision", "fp8"], "--precision"),
])
def test_cli_errors_are_one_line(capsys, extra, needle):
    assert plan_cli.main(ARGS + extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_cli_loss_backward_in_forward_reaches_the_estimate(capsys):
    assert plan_cli.main(ARGS + ["--loss-backward-in-forward", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["loss_backward_in_forward"] is True
    assert plan_cli.main(ARGS + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert data["stages"][-1]["logits_bytes"] < plain["stages"][-1]["logits_bytes"]


def test_cli_recompute_flags_reach_the_estimate(capsys):
    flags = ["--recompute-granularity", "full", "--recompute-method", "block",
             "--recompute-num-layers", "2"]
    assert plan_cli.main(ARGS + flags + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["setup"]["recompute_granularity"], data["setup"]["recompute_method"],
            data["setup"]["recompute_num_layers"]) == ("full", "block", 2)
    setup = TrainingSetup(model=preset("7b"), seq_length=65536, pp=4, microbatches=32, splits=4,
                          tp=8, sequence_parallel=True, distributed_optimizer=True,
                          partition="compute", recompute_granularity="full",
                          recompute_method="block", recompute_num_layers=2)
    assert data["peak_bytes"] == estimate_memory(setup).peak_bytes
    assert plan_cli.main(ARGS + ["--recompute-granularity", "selective"]) == 0
    assert "selective recompute (core attention)" in capsys.readouterr().out.splitlines()[0]
    assert plan_cli.main(ARGS) == 0
    assert "no activation recompute" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize("extra, needle", [
    (["--recompute-granularity", "partial"], "--recompute-granularity"),
    (["--recompute-method", "block"], "--recompute-method"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
     "--recompute-num-layers"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "3"],
     "--recompute-num-layers"),
])
def test_cli_recompute_errors_are_one_line(capsys, extra, needle):
    assert plan_cli.main(ARGS + extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err
