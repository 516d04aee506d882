"""Span partitions: even, FLOP-balanced (closed form) and explicit; alignment and errors."""
import pytest

from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.costs import ModelConfig, model_forward_flops, preset
from seq1f1b.plan.partition import imbalance, partition, span_bounds, span_flops

SEVEN_B = preset("7b")


def test_span_bounds():
    assert span_bounds([5, 3, 2]) == [(0, 5), (5, 8), (8, 10)]
    assert span_bounds([]) == []


def test_even_spans_give_the_remainder_to_the_cheaper_early_spans():
    assert partition(12, 4, "even") == [3, 3, 3, 3]
    assert partition(14, 4, "even") == [4, 4, 3, 3]
    assert partition(28, 4, "even", tp=2, sequence_parallel=True) == [8, 8, 6, 6]
    assert partition(28, 4, "even", tp=2) == [7, 7, 7, 7]       # no SP: no TP alignment
    assert partition(64, 2, "even", tp=4, sequence_parallel=True, align=8) == [32, 32]


def test_even_spans_flop_shares_of_the_reference():
    """SEQ1F1B.md: 7B at 64K with k=4 even spans costs 0.145/0.215/0.285/0.355 (the paper's
    formula, input embedding counted as a GEMM); at 128K the last span is 1.54x the mean."""
    def shares(seq_length):
        flops = [model_forward_flops(SEVEN_B, end - start, end, embedding_as_gemm=True)
                 for start, end in span_bounds(partition(seq_length, 4, "even"))]
        return [f / sum(flops) for f in flops]

    assert shares(65536) == pytest.approx([0.145, 0.215, 0.285, 0.355], abs=6e-4)
    assert 4 * shares(131072)[-1] == pytest.approx(1.54, abs=0.005)


def _rounding_bound(model, seq_length, flops, unit):
    """Boundaries move by at most unit/2 each, so a span's cost moves by at most `unit` tokens
    at the costliest marginal price, that of the sequence's last token."""
    last_token = model_forward_flops(model, 1, seq_length)
    return 1 + unit * last_token / (sum(flops) / len(flops))


@pytest.mark.parametrize("seq_length", [32768, 65536, 131072])
def test_compute_partition_of_the_7b_preset_with_tp2_sequence_parallel(seq_length):
    """The issue's check: k=4, TP=2 with sequence parallelism."""
    spans = partition(seq_length, 4, "compute", SEVEN_B, tp=2, sequence_parallel=True)
    flops = span_flops(SEVEN_B, spans)
    print(f"7b L={seq_length} k=4 tp=2 sp: spans {spans} imbalance {imbalance(flops):.6f}")
    assert sum(spans) == seq_length
    assert all(length % 2 == 0 and length > 0 for length in spans)
    assert spans == sorted(spans, reverse=True)            # later spans see longer prefixes
    assert imbalance(flops) <= min(1.01, _rounding_bound(SEVEN_B, seq_length, flops, 2))
    even = span_flops(SEVEN_B, partition(seq_length, 4, "even"))
    assert imbalance(even) > 1.25


@pytest.mark.parametrize("align", [1, 128, 1024])
@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_compute_partition_is_balanced_up_to_rounding(splits, align):
    model = preset("1.3b")
    seq_length = 32768
    spans = partition(seq_length, splits, "compute", model, align=align)
    flops = span_flops(model, spans)
    assert sum(spans) == seq_length and all(n % align == 0 and n > 0 for n in spans)
    assert imbalance(flops) <= _rounding_bound(model, seq_length, flops, align)


def test_compute_partition_keeps_one_unit_per_span_when_attention_dominates():
    # Tiny GEMMs, huge sequence: the ideal first boundary is far out; every span stays >= 1 unit.
    model = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, vocab_size=1)
    spans = partition(12, 6, "compute", model, align=2)
    assert sum(spans) == 12 and all(n >= 2 and n % 2 == 0 for n in spans)


def test_explicit_spans_are_checked():
    assert partition(10, 3, "explicit", lengths=[5, 3, 2]) == [5, 3, 2]
    assert partition(8, 2, "explicit", tp=2, sequence_parallel=True, lengths=[6, 2]) == [6, 2]


@pytest.mark.parametrize("kwargs, flag", [
    (dict(seq_length=3, splits=4, method="even"), "--splits"),
    (dict(seq_length=8, splits=0, method="even"), "--splits"),
    (dict(seq_length=0, splits=1, method="even"), "--seq-length"),
    (dict(seq_length=65535, splits=4, method="even", tp=2, sequence_parallel=True),
     "--seq-length"),
    (dict(seq_length=8, splits=4, method="even", tp=4, sequence_parallel=True), "--splits"),
    (dict(seq_length=8, splits=2, method="even", tp=0), "--tp"),
    (dict(seq_length=8, splits=2, method="compute"), "--method compute needs a model"),
    (dict(seq_length=8, splits=2, method="balanced"), "--method"),
    (dict(seq_length=8, splits=2, method="explicit"), "--span-lengths"),
    (dict(seq_length=8, splits=2, method="explicit", lengths=[4, 3]), "--span-lengths"),
    (dict(seq_length=8, splits=2, method="explicit", lengths=[8]), "--span-lengths"),
    (dict(seq_length=8, splits=2, method="explicit", lengths=[8, 0]), "--span-lengths"),
    (dict(seq_length=8, splits=2, method="explicit", lengths=[5, 3], tp=2,
          sequence_parallel=True), "--span-lengths"),
    (dict(seq_length=8, splits=2, method="even", lengths=[4, 4]), "--span-lengths"),
])
def test_bad_partitions_name_the_flag(kwargs, flag):
    with pytest.raises(ScheduleError, match=flag):
        partition(**kwargs)
