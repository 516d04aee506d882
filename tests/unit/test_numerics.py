"""--check-for-nan-in-loss-and-grad (on by default, as in Megatron): a NaN or inf loss or gradient
norm stops the run, naming the iteration, the stage and (for a loss) the micro-batch."""
import math

import pytest
import torch

from megatron.training.arguments import build_parser
from megatron.training.numerics import NonFiniteError, check_gradients, check_losses


def _losses(*values):
    return [{"lm loss": torch.tensor([value, 12.0])} for value in values]


def test_finite_losses_and_gradients_pass():
    check_losses(_losses(3.5, 2.0), iteration=7, stage=3)
    model = torch.nn.Linear(4, 2)
    model(torch.ones(1, 4)).sum().backward()
    check_gradients([model], [0], iteration=7)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_names_iteration_stage_and_micro_batch(bad):
    with pytest.raises(NonFiniteError, match=r"^iteration 7: lm loss of micro-batch 2 on pipeline "
                                             r"stage 3 is \[(nan|inf|-inf), 12.0\]"):
        check_losses(_losses(1.0, 2.0, bad), iteration=7, stage=3)


def test_a_non_finite_gradient_names_the_stage_and_reads_main_grad():
    chunks = [torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)]
    for chunk in chunks:
        for param in chunk.parameters():
            param.main_grad = torch.zeros_like(param)      # megatron DDP's buffer
    chunks[1].bias.main_grad[0] = math.nan
    with pytest.raises(NonFiniteError, match=r"^iteration 4: the gradient norm of pipeline stage "
                                             r"6 is nan"):
        check_gradients(chunks, [2, 6], iteration=4)


def test_the_check_is_on_by_default_and_megatrons_flag_turns_it_off():
    parser = build_parser()
    assert parser.parse_args([]).check_for_nan_in_loss_and_grad is True
    assert parser.parse_args(["--no-check-for-nan-in-loss-and-grad"]) \
        .check_for_nan_in_loss_and_grad is False
