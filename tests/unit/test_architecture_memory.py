"""The memory estimator against the saved-tensor meter for Llama-shaped layers.

What a GPT stage keeps for backward depends on the layer's shape: SwiGLU keeps its 2f-wide FC1
output, the SiLU of its gate and the gated product (4f per token instead of GeLU's 2f), and
grouped-query attention caches g instead of n K/V heads. A GPipe iteration of 4 unsplit
micro-batches holds all four at its peak, as 1F1B's first stage does at P = 4, and seq1f1b with
k = 4 holds its span activations and the micro-batch's K/V: the meter's peak must match the
estimator's held-for-backward bytes for each shape, and the shapes must differ where they should.
"""
from __future__ import annotations

import pytest
import torch

from seq1f1b.equivalence import forward_step
from seq1f1b.megatron_adapter import Architecture, build_model_chunk, make_transformer_config
from seq1f1b.plan.costs import ModelConfig
from seq1f1b.plan.memory import TrainingSetup, estimate_memory
from seq1f1b.runtime.forward_backward import SpanSettings, get_forward_backward_func
from seq1f1b.runtime.trace import ExecutionTrace

pytestmark = pytest.mark.usefixtures("megatron_world")

LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 64, 4, 128, 128
SHAPES = {
    "gpt": dict(ffn=256, architecture=Architecture()),
    "llama": dict(ffn=160, architecture=Architecture(
        num_query_groups=1, swiglu=True, normalization="RMSNorm", add_bias_linear=False)),
}


def _peak_and_estimate(shape: str, schedule: str, splits: int, early: bool = False,
                       seq: int = SEQ) -> tuple[int, float]:
    ffn, architecture = SHAPES[shape]["ffn"], SHAPES[shape]["architecture"]
    torch.manual_seed(0)
    config = make_transformer_config(num_layers=LAYERS, hidden_size=HIDDEN,
                                     num_attention_heads=HEADS, ffn_hidden_size=ffn,
                                     architecture=architecture)
    model = build_model_chunk(config, vocab_size=VOCAB, max_sequence_length=seq,
                              attention_backend="sdpa", architecture=architecture)
    tokens = torch.randint(0, VOCAB, (1, seq + 1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, seq),
             "position_ids": torch.arange(seq).unsqueeze(0)}
    trace = ExecutionTrace(measure_memory=True)
    run = get_forward_backward_func(schedule, SpanSettings(splits, "compute", trace=trace,
                                                           loss_backward_in_forward=early))
    run(forward_step_func=forward_step, data_iterator=iter([batch] * 4), model=model,
        num_microbatches=4, seq_length=seq, micro_batch_size=1)
    estimate = estimate_memory(TrainingSetup(
        model=ModelConfig.of_transformer_config(config, vocab_size=VOCAB), seq_length=seq,
        schedule=schedule, pp=1, microbatches=4, splits=splits, partition="compute",
        precision="fp32", make_vocab_size_divisible_by=1, loss_backward_in_forward=early))
    return trace.peak_saved_bytes, estimate.stages[0].held_for_backward_bytes


@pytest.mark.parametrize("schedule, splits", [("gpipe", 1), ("seq1f1b", 4)])
def test_held_bytes_match_the_meter_for_gpt_and_llama_layers(schedule, splits):
    measured = {shape: _peak_and_estimate(shape, schedule, splits) for shape in SHAPES}
    for shape, (peak, estimated) in measured.items():
        assert peak / estimated == pytest.approx(1, abs=0.1), shape
    # The shapes differ in what they keep: a test of the SwiGLU/GQA terms, not of a constant.
    assert measured["llama"][1] != pytest.approx(measured["gpt"][1], rel=0.05)


def test_the_loss_backward_at_forward_holds_what_the_estimator_says():
    """--loss-backward-in-forward: F back-propagates each span's loss through the output layer
    and keeps its input gradient (and the micro-batch's output-weight gradient) instead of the
    loss's fp32 softmax. seq1f1b's one stage runs all four spans forward before their backward,
    so it held four softmaxes (at least: 512 tokens x VOCAB fp32 = 256 KiB), against the weight
    gradient's VOCAB x HIDDEN fp32 = 32 KiB. The meter and the estimator see the same peak, and
    the meter sees it fall by at least half the estimator's fall (its peak also holds the softmax
    of the span whose F is running, which the estimator counts as workspace)."""
    seq = 4 * SEQ
    softmax, weight_gradient = seq * VOCAB * 4, VOCAB * HIDDEN * 4
    for shape in SHAPES:
        peak, estimated = _peak_and_estimate(shape, "seq1f1b", 4, early=True, seq=seq)
        before, estimated_before = _peak_and_estimate(shape, "seq1f1b", 4, seq=seq)
        assert peak / estimated == pytest.approx(1, abs=0.1), shape
        assert estimated_before - estimated >= softmax - weight_gradient, shape
        assert before - peak >= (estimated_before - estimated) / 2, shape
