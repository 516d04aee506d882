"""Findings 1 and 3 of issue 14 under strict CUDA mode, in one process: batches reach the device
on the stages that use them, and the span loss's backward scale never syncs the host."""
import pytest
import torch

import pretrain_gpt
from seq1f1b import platform
from seq1f1b.equivalence import EquivalenceCase, global_batch
from seq1f1b.runtime.loss import MicrobatchLoss

pytestmark = [
    pytest.mark.usefixtures("megatron_world"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="strict mode emulates CUDA on the CPU"),
]


@pytest.fixture
def strict():
    with platform.strict_mode():
        yield


def on_device(tensor: torch.Tensor) -> bool:
    """Whether strict mode has `tensor` on the device: a host one cannot meet a device one."""
    try:
        torch.zeros(tensor.shape, device="cuda") + tensor
    except RuntimeError as err:
        if "Expected all tensors to be on the same device" not in str(err):
            raise
        return False
    return True


def _collated() -> dict:
    """What megatron/training/data.collate hands the forward step: host tensors."""
    tokens = torch.arange(8).reshape(2, 4)
    return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, 4),
            "attention_mask": None, "position_ids": torch.arange(4).expand(2, 4)}


@pytest.mark.parametrize("pre_process, post_process",
                         [(True, False), (False, True), (True, True), (False, False)])
def test_get_batch_moves_what_the_stage_uses(strict, pre_process, post_process):
    batch = _collated()
    tokens, labels, loss_mask, attention_mask, position_ids = pretrain_gpt.get_batch(
        iter([batch]), pre_process, post_process)
    assert [on_device(t) for t in (tokens, position_ids)] == [pre_process] * 2
    assert [on_device(t) for t in (labels, loss_mask)] == [post_process] * 2
    assert attention_mask is None
    assert torch.equal(tokens.cpu(), batch["tokens"]) and torch.equal(labels.cpu(), batch["labels"])


def test_get_batch_on_a_stage_without_data():
    assert pretrain_gpt.get_batch(None) == (None,) * 5


def test_the_equivalence_batch_is_on_the_device(strict):
    batches = global_batch(EquivalenceCase(num_microbatches=2), dp=1)
    assert len(batches) == 2
    assert all(on_device(t) for batch in batches for t in batch.values())


def _span_losses(device: str) -> MicrobatchLoss:
    record = MicrobatchLoss([3, 5])
    for span, count in enumerate((2, 3)):
        loss = torch.tensor(float(span + 1), device=device, requires_grad=True)
        record.add(span, (loss, torch.tensor(count, device=device, dtype=torch.int), {}))
    return record


def test_the_backward_scale_stays_on_the_device(strict):
    record = _span_losses("cuda")
    with platform.host_sync_forbidden():          # as inside the executor's run
        scales = [record.backward_scale(span, 4, per_token_loss=False) for span in (0, 1)]
    assert all(on_device(scale.reshape(1)) and scale.dtype == torch.float32 for scale in scales)
    exact = 1.0 / (5 * 4)
    assert [float(s) for s in scales] == [torch.tensor(exact, dtype=torch.float32).item()] * 2
    scaled = record.losses[1] * scales[1]
    assert torch.equal(scaled, record.losses[1] * exact)     # what the Python float gave
