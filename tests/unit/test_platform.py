"""The CPU platform layer: megatron-core's CUDA placements, RNG and type checks on the CPU."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel

from seq1f1b import platform

pytestmark = [
    pytest.mark.usefixtures("megatron_world"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer stays off where CUDA is"),
]


def test_activate_is_idempotent():
    assert platform.activate() and platform.activate() and platform.is_active()


def test_cuda_placements_land_on_cpu():
    t = torch.ones(3, device="cuda")
    placed = [t, t.cuda(), t.to("cuda:0"), t.to(0), t.to(device=torch.device("cuda")),
              torch.empty(2, device=torch.cuda.current_device()), t.pin_memory(),
              parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "test")]
    assert all(p.device.type == "cpu" for p in placed)
    torch.cuda.synchronize()
    torch.cuda.set_device(0)
    torch.cuda.nvtx.range_push("x")
    torch.cuda.nvtx.range_pop()


def test_tensor_type_answers_cuda_names():
    t = torch.ones(2)
    assert t.type() == "torch.cuda.FloatTensor"  # what megatron's clip_grads / optimizers assert
    assert t.type("torch.cuda.DoubleTensor").dtype == torch.float64
    assert t.type(torch.cuda.HalfTensor).dtype == torch.float16


def test_patched_functions_are_distinct_objects():
    names = ["current_device", "set_device", "synchronize", "get_rng_state", "set_rng_state",
             "manual_seed", "manual_seed_all", "get_rng_state_all", "set_rng_state_all"]
    objects = [getattr(torch.cuda, n) for n in names] + [torch.cuda.random.get_rng_state,
                                                         torch.cuda.random.set_rng_state]
    assert len({id(o) for o in objects}) == len(objects)


def dropout_under_fork(x: torch.Tensor) -> torch.Tensor:
    with tensor_parallel.get_cuda_rng_tracker().fork():
        return F.dropout(x, 0.5)


def test_rng_tracker_fork_is_reproducible_and_separate(caplog):
    x = torch.ones(64)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    with caplog.at_level(logging.WARNING):
        first = dropout_under_fork(x)
        after_fork = torch.rand(4)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    second = dropout_under_fork(x)
    assert torch.equal(first, second)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    assert torch.equal(torch.rand(4), after_fork), "fork() must leave the default stream as it was"
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    assert not torch.equal(F.dropout(x, 0.5), first), "tracker stream equals the default stream"
    assert "CPU RNG state changed" not in caplog.text


def test_checkpoint_recompute_replays_dropout():
    weight = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)  # megatron's checkpoint tracks tensor args only

    def block(inp):
        return dropout_under_fork(inp @ weight)

    grads = []
    for run in (block, lambda inp: tensor_parallel.checkpoint(block, False, inp)):
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        weight.grad = None
        run(x).square().sum().backward()
        grads.append(weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


class _AllocatesOnCudaInBackward(torch.autograd.Function):
    """Like megatron's sequence-parallel linear: its backward allocates on the current device."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape, device=torch.cuda.current_device())
        return out.copy_(grad * 2)


@pytest.mark.parametrize("entry", ["tensor.backward", "autograd.backward", "autograd.grad"])
def test_backward_pass_runs_under_the_cpu_layer(entry):
    x = torch.ones(3, requires_grad=True)
    y = _AllocatesOnCudaInBackward.apply(x).sum()
    if entry == "tensor.backward":
        y.backward()
        grad = x.grad
    elif entry == "autograd.backward":
        torch.autograd.backward([y], [torch.ones(())])
        grad = x.grad
    else:
        (grad,) = torch.autograd.grad(y, x)
    assert torch.equal(grad, torch.full((3,), 2.0))
