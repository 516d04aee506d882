"""Pure pieces of the runtime: span slicing of batches, exact span-loss normalisation and the
saved-tensor meter."""
import pytest
import torch

from seq1f1b.runtime.loss import MicrobatchLoss
from seq1f1b.runtime.memory import SavedTensorMeter
from seq1f1b.runtime.span_data import SpanDataSource, slice_span


def test_slice_span_cuts_sequence_dims_and_the_mask_bottom_right():
    L = 6
    batch = {"tokens": torch.arange(12).view(2, L), "mask": torch.ones(2, 1, L, L),
             "scalar": 3, "other": torch.zeros(5)}
    part = slice_span(batch, L, 2, 5)
    assert part["tokens"].tolist() == [[2, 3, 4], [8, 9, 10]]
    assert part["mask"].shape == (2, 1, 3, 5)
    assert part["scalar"] == 3 and part["other"].shape == (5,)


def test_span_source_pulls_each_microbatch_once_in_order():
    source = SpanDataSource(iter([torch.arange(4).view(1, 4), torch.arange(4, 8).view(1, 4)]), 4)
    spans = [next(source.span_iterator(i, s, e, e == 4)).tolist()
             for i in range(2) for s, e in [(0, 1), (1, 4)]]
    assert spans == [[[0]], [[1, 2, 3]], [[4]], [[5, 6, 7]]]


def test_span_source_serves_a_later_microbatch_first_and_holds_the_earlier_ones():
    """A searched order or a schedule file may start micro-batch 2 before 0 and 1: Megatron's
    iterator is still read in order, once each, and every micro-batch gets its own data."""
    source = SpanDataSource(iter([torch.full((1, 2), n) for n in range(3)]), 2)
    served = {i: next(source.span_iterator(i, 0, 2, True)).tolist() for i in (2, 0, 1)}
    assert served == {0: [[0, 0]], 1: [[1, 1]], 2: [[2, 2]]}
    with pytest.raises(RuntimeError, match="micro-batch 1 requested again"):
        source.span_iterator(1, 0, 2, True)


def _mean_of_token_losses(lengths, token_losses, mask):
    """Run MicrobatchLoss as the executor does and return sum_j scale_j * loss_j."""
    record = MicrobatchLoss(lengths)
    start = 0
    for j, n in enumerate(lengths):
        part, m = token_losses[start:start + n], mask[start:start + n]
        record.add(j, ((part * m).sum(), m.sum().to(torch.int), {"lm": torch.stack(
            [(part * m).sum(), m.sum()])}))
        start += n
    total = sum(record.backward_scale(j, 1, False) * record.losses[j] for j in range(len(lengths)))
    return total, record.combined_reduced()


def test_span_losses_scale_to_the_exact_token_mean_of_the_microbatch():
    gen = torch.Generator().manual_seed(0)
    losses = torch.rand(20, generator=gen)
    mask = (torch.rand(20, generator=gen) > 0.4).float()
    exact = (losses * mask).sum() / mask.sum()
    total, reduced = _mean_of_token_losses([3, 11, 6], losses, mask)
    assert torch.allclose(total, exact, rtol=1e-6, atol=0)
    assert torch.allclose(reduced["lm"][0] / reduced["lm"][1], exact, rtol=1e-6)
    # The biased alternative (mean of span means) differs here: the test can tell them apart.
    biased = sum((losses[a:b] * mask[a:b]).sum() / mask[a:b].sum()
                 for a, b in [(0, 3), (3, 14), (14, 20)]) / 3
    assert not torch.allclose(biased, exact, rtol=1e-3)


def test_mean_form_losses_are_weighted_by_span_length():
    record = MicrobatchLoss([2, 6])
    record.add(0, (torch.tensor(1.0), {"lm": torch.tensor(1.0)}))
    record.add(1, (torch.tensor(3.0), {"lm": torch.tensor(3.0)}))
    total = sum(record.backward_scale(j, 2, False) * record.losses[j] for j in range(2))
    assert abs(float(total) - (0.25 * 1 + 0.75 * 3) / 2) < 1e-7
    assert abs(float(record.combined_reduced()["lm"]) - 2.5) < 1e-7


def test_saved_tensor_meter_counts_each_storage_once_and_frees_with_the_graph():
    x = torch.randn(256, requires_grad=True)
    with SavedTensorMeter() as meter:
        y = (x * x).sum() + (x * 2).sum()    # x saved twice: counted once
        assert meter.live_bytes == 256 * 4
        y.backward()
    assert meter.live_bytes == 0 and meter.peak_bytes == 256 * 4


def test_the_meter_sees_the_accumulators_a_first_backward_makes_between_its_samples():
    """A micro-batch's first backward makes each layer's dK/dV accumulators in the middle of
    the action, where nothing is saved: the cache samples every active meter there, so the
    meter sees them at the moment the runtime holds them (the CPU meter otherwise sampled only
    at saved tensors and action ends, and saw the accumulators after the span had freed more)."""
    from seq1f1b.runtime.kv_cache import LayerKV

    layer = LayerKV(torch.zeros(8, 1, 2, 4), torch.zeros(8, 1, 2, 4))
    grad = torch.ones(8, 1, 2, 4)
    buffers = 2 * 8 * 2 * 4 * 4
    with SavedTensorMeter(extra_tensors=layer.tensors) as meter:
        meter.sample()
        assert meter.peak_bytes == buffers
        layer.route_grads(6, 8, grad, grad)           # the last span: accumulators of rows 0..5
        peak = meter.peak_bytes
        layer.key_grad = layer.value_grad = None      # freed before the action ends
        meter.sample()
    assert peak == meter.peak_bytes == buffers + 2 * 6 * 2 * 4 * 4
