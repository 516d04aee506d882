"""The log line: Megatron's fields and formats in Megatron's order (0.16's timestamp, with
microseconds, first, the
nan-iteration count after the skipped one), then the paper's metrics (tokens/s, TFLOPS/GPU by the
paper's formula, peak memory per stage) and an ETA."""
import math
import re
from datetime import datetime

import pytest

from megatron.training.logging_utils import (IntervalReport, Throughput, format_eta, throughput,
                                             validation_lines)
from seq1f1b.plan.costs import ModelConfig


def _report(**changes) -> IntervalReport:
    fields = dict(iteration=20, train_iters=100, consumed_samples=640,
                  seconds_per_iteration=0.5, learning_rate=3e-4, global_batch_size=32,
                  lm_loss=4.25, loss_scale=1.0, grad_norm=1.5, skipped_iterations=0,
                  throughput=Throughput(8192.0, 0.0123), peak_memory_mb=[12.5, 9.75],
                  memory_source="MB held for backward", nan_iterations=0,
                  time=datetime(2026, 1, 31, 9, 5, 7))
    fields.update(changes)
    return IntervalReport(**fields)


def test_fields_follow_megatrons_order_and_formats():
    line = _report().line()
    names = [part.split(":")[0].strip() for part in line.split("|")[:-1]]
    assert names == ["[2026-01-31 09", "consumed samples",
                     "elapsed time per iteration (ms)", "learning rate", "global batch size",
                     "lm loss", "loss scale", "grad norm", "number of skipped iterations",
                     "number of nan iterations", "tokens/s", "TFLOPS/GPU",
                     "peak mem per stage (MB held for backward)", "ETA 0"]
    assert line.startswith(" [2026-01-31 09:05:07.000000] iteration       20/     100 | consumed "
                           "samples:          640 |")
    assert " number of skipped iterations:   0 | number of nan iterations:   0 |" in line
    assert " elapsed time per iteration (ms): 500.0 |" in line
    assert " learning rate: 3.000000E-04 |" in line
    assert " lm loss: 4.250000E+00 |" in line
    assert " grad norm: 1.500 |" in line
    assert " tokens/s: 8192 | TFLOPS/GPU: 0.0123 |" in line
    assert " peak mem per stage (MB held for backward): 12.5, 9.8 |" in line
    assert line.endswith(" ETA 0:00:40 |")        # 80 iterations left x 0.5 s
    assert "\n" not in line


def test_the_loss_parses_back_to_seven_significant_digits():
    loss = 3.14159265
    match = re.search(r"lm loss: (\S+) \|", _report(lm_loss=loss).line())
    assert float(match.group(1)) == pytest.approx(loss, rel=5e-7)


def test_megatrons_optional_fields_go_where_megatron_puts_them():
    line = _report(log_throughput=True, num_zeros_in_grad=7, params_norm=12.25).line()
    assert " elapsed time per iteration (ms): 500.0 | throughput per GPU (TFLOP/s/GPU): 0.0 | " \
           "learning rate:" in line
    assert " grad norm: 1.500 | num zeros: 7 | params norm: 12.250 | number of skipped " \
           "iterations:" in line


def test_fields_without_a_value_are_left_out():
    line = _report(lm_loss=None, grad_norm=None).line()
    assert "lm loss" not in line and "grad norm" not in line


def test_throughput_is_the_papers_formula():
    """3 x forward FLOPs, by hand: per sequence and layer 24*s*h^2 for the GEMMs (FFN = 4h) and
    (4h + 3n) * s^2 / 2 for causal attention, plus 4*s*h*V for logits and the embedding."""
    layers, s, h, n, vocab, batch, seconds, gpus = 2, 128, 64, 4, 512, 8, 0.25, 4
    model = ModelConfig(num_layers=layers, hidden_size=h, num_attention_heads=n,
                        vocab_size=vocab)
    forward = layers * (24 * s * h * h + (4 * h + 3 * n) * s * s / 2) + 4 * s * h * vocab
    result = throughput(model, s, batch, gpus, seconds)
    assert result.tokens_per_second == batch * s / seconds
    assert result.tflops_per_gpu == pytest.approx(3 * forward * batch / seconds / gpus / 1e12,
                                                  rel=1e-12)


@pytest.mark.parametrize("seconds, text", [(0, "0:00:00"), (59.6, "0:01:00"), (3661, "1:01:01"),
                                           (90000, "25:00:00"), (-5, "0:00:00")])
def test_eta(seconds, text):
    assert format_eta(seconds) == text


def test_validation_box_has_loss_and_perplexity():
    rule, text, closing = validation_lines("iteration 10", 2.0)
    assert text == (f" validation loss at iteration 10 | lm loss value: 2.000000E+00 | "
                    f"lm loss PPL: {math.exp(2.0):.6E} | ")
    assert rule == closing == "-" * (len(text) + 1)


def test_the_timestamp_is_now_unless_given():
    before = datetime.now()
    stamp = re.match(r" \[(.{26})\] iteration", _report(time=None).line()).group(1)
    assert before <= datetime.fromisoformat(stamp) <= datetime.now()
    assert " number of nan iterations:   3 |" in _report(nan_iterations=3).line()


@pytest.mark.parametrize("skipped, loss, nan", [
    (True, float("nan"), True), (True, float("inf"), True), (True, 2.5, False),
    (False, float("nan"), False),     # an applied update is not a nan iteration (Megatron's rule)
])
def test_a_nan_iteration_is_a_skipped_one_with_a_non_finite_loss(skipped, loss, nan):
    from megatron.training.training import IterationRecord
    record = IterationRecord(3, {"lm loss": loss}, None, 1e-3, skipped)
    assert record.nan is nan
