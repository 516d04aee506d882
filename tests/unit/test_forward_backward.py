"""The forward-backward functions keep megatron-core's contract: its keyword set, one reduced
entry per micro-batch on the last stage, toy models with plain-number losses, the exception
types megatron's interleaved schedule raises for micro-batch counts it refuses, and
`decoder_seq_length` as megatron reads it (tests/distributed/test_decoder_seq_length.py runs it
across two stages)."""
import pytest
import torch
from megatron.core.model_parallel_config import ModelParallelConfig

from seq1f1b.runtime.forward_backward import (_check_interleaving_like_megatron,
                                              SpanSettings, get_forward_backward_func,
                                              pipeline_sequence_length, schedule_names)

pytestmark = pytest.mark.usefixtures("megatron_world")


class ToyModel(torch.nn.Module):
    """What megatron's own schedule tests pass: a Linear with a config and set_input_tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.config = ModelParallelConfig(pipeline_model_parallel_size=1)
        self.model_type = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, x):
        return self.linear(x)


def _toy_step(data_iterator, model):
    def loss_func(output):
        return 7, {"loss_reduced": 7}

    return model(torch.ones(1, 4)), loss_func


@pytest.mark.parametrize("name,forward_only", [
    ("1f1b", True), ("seq1f1b", True), ("gpipe", True), ("megatron-1f1b", True),
    # megatron's own backward_step fails on a plain-number loss; ours skips its backward.
    ("1f1b", False), ("seq1f1b", False), ("gpipe", False)])
def test_toy_model_and_plain_number_losses(name, forward_only):
    func = get_forward_backward_func(name, SpanSettings(splits=1))
    losses = func(forward_step_func=_toy_step, data_iterator=None, model=[ToyModel()],
                  num_microbatches=3, seq_length=4, micro_batch_size=1,
                  decoder_seq_length=None, forward_only=forward_only,
                  collect_non_loss_data=False, first_val_step=None,
                  adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
                  force_all_reduce=False)
    assert losses == [{"loss_reduced": 7}] * 3


def test_every_registry_name_and_megatrons_own_are_offered():
    names = schedule_names()
    assert {"seq1f1b", "1f1b", "megatron-1f1b", "megatron-interleaved-1f1b"} <= set(names)


@pytest.mark.parametrize("microbatches,pp,error", [(1, 2, ValueError), (3, 2, RuntimeError),
                                                   (5, 4, RuntimeError), (2, 4, ValueError)])
def test_interleaving_refuses_what_megatron_refuses_with_its_exception_type(microbatches, pp,
                                                                            error):
    # megatron-core 0.16.1 schedules.py: group size > m -> ValueError; a final group smaller
    # than P -> RuntimeError.
    config = ModelParallelConfig(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    with pytest.raises(error):
        _check_interleaving_like_megatron(microbatches, pp, config)
    _check_interleaving_like_megatron(2 * pp, pp, config)


@pytest.mark.parametrize("chunked,splits,decoder,expected", [
    (False, 1, None, 512), (False, 4, 512, 512),
    # megatron's 1F1B sizes its p2p tensors with decoder_seq_length when given ...
    (False, 1, 256, 256), (False, 1, 600, 600),
    # ... its interleaved function ignores it.
    (True, 1, 256, 512), (True, 4, 256, 512)])
def test_pipeline_sequence_length_reads_decoder_seq_length_as_megatron(chunked, splits, decoder,
                                                                       expected):
    assert pipeline_sequence_length(chunked, splits, 512, decoder) == expected


def test_spans_cannot_cut_a_decoder_sequence_of_another_length():
    with pytest.raises(ValueError, match=r"^decoder_seq_length=256 differs from seq_length=512"):
        pipeline_sequence_length(False, 2, 512, 256)


class NextOnly:
    """Megatron's RerunDataIterator: __next__ without __iter__."""

    def __init__(self) -> None:
        self.pulled = 0

    def __next__(self):
        self.pulled += 1
        return torch.zeros(1, 4)


@pytest.mark.parametrize("decoder_seq_length", [4, 6])
def test_decoder_seq_length_and_any_iterable_as_data_at_k1(decoder_seq_length):
    # megatron's own tests pass a range as data_iterator and a decoder_seq_length of their own.
    func = get_forward_backward_func("seq1f1b", SpanSettings(splits=1))
    losses = func(forward_step_func=_toy_step, data_iterator=range(10), model=[ToyModel()],
                  num_microbatches=2, seq_length=4, micro_batch_size=1,
                  decoder_seq_length=decoder_seq_length, forward_only=True)
    assert losses == [{"loss_reduced": 7}] * 2


def test_an_iterator_without_iter_is_read_as_it_is():
    data = NextOnly()
    func = get_forward_backward_func("seq1f1b", SpanSettings(splits=1))
    func(forward_step_func=_toy_step, data_iterator=data, model=[ToyModel()], num_microbatches=3,
         seq_length=4, micro_batch_size=1, forward_only=True)
    assert data.pulled == 3
