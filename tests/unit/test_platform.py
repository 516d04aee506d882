"""The CPU platform layer: megatron-core's CUDA placements, RNG and type checks on the CPU."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import mappings

from seq1f1b import platform

pytestmark = [
    pytest.mark.usefixtures("megatron_world"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer stays off where CUDA is"),
]


def test_activate_is_idempotent():
    assert platform.activate() and platform.activate() and platform.is_active()


def test_denormals_flush_to_zero_as_a_gpu_costs_them():
    # A GPU computes with fp32 denormals at full speed; the CPU layer flushes them, or the CPU
    # times microcode assists (10x in the attention backward of a small-init model).
    assert platform.activate()
    tiny = torch.tensor([3e-39, 1e-30])
    assert (tiny * 1.0).tolist() == [0.0, pytest.approx(1e-30)]


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


def _ops_run(work) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        work()
    return [event.name for event in prof.events()]


def test_a_linears_products_run_on_onednn_and_its_weight_gradient_on_addmm():
    # megatron's linear, fused into main_grad: forward X W^T and input gradient dY W by oneDNN
    # (MKL's sgemm loses per row at span sizes on this CPU), dW still MKL's addmm_ into main_grad.
    assert platform.activate()
    torch.manual_seed(0)
    x = torch.randn(256, 1, 512, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(1024, 512) * 0.05)
    weight.main_grad = torch.zeros_like(weight)
    grad = torch.randn(256, 1, 1024)

    def step():
        out = tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False,
            sequence_parallel=False)
        out.backward(grad)
        step.out = out

    ops = _ops_run(step)
    assert ops.count("mkldnn::_linear_pointwise") == 2, "forward and input gradient"
    assert "aten::addmm_" in ops, "the weight gradient accumulates into main_grad"
    x64, w64, g64 = x.double(), weight.double(), grad.double()
    assert torch.allclose(step.out.double(), x64 @ w64.t(), rtol=0, atol=1e-5)
    assert torch.allclose(x.grad.double(), g64 @ w64, rtol=0, atol=1e-5)
    assert torch.allclose(weight.main_grad.double(), g64.flatten(0, 1).t() @ x64.flatten(0, 1),
                          rtol=0, atol=1e-4)
    assert not step.out._is_view()


@pytest.mark.parametrize("case", ["small", "transposed rows", "float64", "to differentiate",
                                  "out="])
def test_other_products_stay_with_torchs_matmul(case):
    assert platform.activate()
    a, b = torch.randn(256, 512), torch.randn(512, 1024)
    kwargs = {}
    if case == "small":
        a, b = torch.randn(16, 64), torch.randn(64, 256)
    elif case == "transposed rows":                 # the weight gradient's dY^T X
        a = torch.randn(512, 256).t()
    elif case == "float64":
        a, b = a.double(), b.double()
    elif case == "to differentiate":
        b.requires_grad_()
    else:
        kwargs = {"out": torch.empty(256, 1024)}
    ops = _ops_run(lambda: torch.matmul(a, b, **kwargs))
    assert "mkldnn::_linear_pointwise" not in ops and "aten::mm" in ops


# -- strict mode: CUDA's rules on the CPU ----------------------------------------------------------
MIXED = "Expected all tensors to be on the same device"
NCCL = "Tensors must be CUDA and dense"
SYNC = "host sync in the hot loop"


@pytest.fixture
def strict():
    with platform.strict_mode():
        yield


def on_device(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, device="cuda")


DEVICE_MADE = {
    "device=cuda": lambda: torch.ones(3, device="cuda"),
    "device=cuda:0": lambda: torch.ones(3, device="cuda:0"),
    "device=torch.device": lambda: torch.ones(3, device=torch.device("cuda", 0)),
    "device=ordinal": lambda: torch.ones(3, device=torch.cuda.current_device()),
    "device=x.device": lambda: torch.ones(3, device=on_device(1).device),
    ".cuda()": lambda: torch.ones(3).cuda(),
    ".to('cuda')": lambda: torch.ones(3).to("cuda"),
    ".to(device=)": lambda: torch.ones(3).to(device=torch.device("cuda")),
    ".to(tensor)": lambda: torch.ones(3).to(on_device(1)),
    "computed": lambda: on_device(3) * 2,
    "_like": lambda: torch.empty_like(on_device(3)).zero_(),     # uninitialised: may hold NaN
    "new_": lambda: on_device(1).new_zeros(3),
    "cat": lambda: torch.cat([on_device(1), on_device(2)]),
    "Parameter": lambda: torch.nn.Parameter(on_device(3)),
}
HOST_MADE = {
    "plain": lambda: torch.ones(3),
    "device=cpu": lambda: torch.ones(3, device="cpu"),
    ".cpu()": lambda: on_device(3).cpu(),
    ".to('cpu')": lambda: on_device(3).to("cpu"),
    "device=cpu from device": lambda: torch.zeros_like(on_device(3), device="cpu"),
}


@pytest.mark.parametrize("make", DEVICE_MADE.values(), ids=list(DEVICE_MADE))
def test_strict_tensors_made_for_cuda_live_on_the_device(strict, make):
    tensor = make()
    assert torch.equal(tensor * 0 + on_device(3), on_device(3))       # device with device
    assert torch.equal(tensor * 0 + torch.tensor(1.0), on_device(3))   # a host scalar is fine
    with pytest.raises(RuntimeError, match=MIXED):
        tensor + torch.ones(3)


@pytest.mark.parametrize("make", HOST_MADE.values(), ids=list(HOST_MADE))
def test_strict_other_tensors_live_on_the_host(strict, make):
    tensor = make()
    assert torch.equal(tensor * 0 + torch.ones(3), torch.ones(3))
    with pytest.raises(RuntimeError, match=MIXED):
        tensor + on_device(3)


def test_strict_moving_makes_a_new_tensor_as_on_a_gpu(strict):
    host = torch.ones(3)
    moved = host.cuda()
    assert moved is not host and moved.cuda() is moved
    host + torch.ones(3)                     # the original stays on the host
    with pytest.raises(RuntimeError, match=MIXED):
        moved + host


def test_strict_device_tensors_pick_cpu_kernels(strict):
    assert on_device(3).device.type == "cpu" and not on_device(3).is_cuda


def test_strict_products_on_onednn_stay_device_tensors(strict):
    a, b = on_device(256, 512), on_device(1024, 512)
    out = []
    assert "mkldnn::_linear_pointwise" in _ops_run(lambda: out.append(a.matmul(b.t())))
    assert platform.seen_on_device(out[0])


def test_strict_in_place_ops_do_not_write_device_values_into_host_scalars(strict):
    device = on_device(3)
    device.add_(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match=MIXED):
        torch.tensor(0.0).add_(on_device(()))
    with pytest.raises(RuntimeError, match=MIXED):
        total = torch.zeros(())
        total += on_device(())


def test_strict_transfers_and_host_indices_are_allowed(strict):
    device = on_device(3)
    device.copy_(torch.arange(3.0))
    host = torch.zeros(3).copy_(device)
    assert host.tolist() == [0.0, 1.0, 2.0]
    assert device[torch.tensor([0, 2])].tolist() == [0.0, 2.0]
    device[torch.tensor([1])] = torch.full((1,), 5.0)
    with pytest.raises(RuntimeError, match=MIXED):
        torch.ones(3)[torch.tensor([0], device="cuda")]


def test_strict_numpy_and_grad_follow_cuda(strict):
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
        on_device(3).numpy()
    assert torch.ones(3).numpy().tolist() == [1.0, 1.0, 1.0]
    param = torch.nn.Parameter(on_device(3))
    param.grad = on_device(3)
    with pytest.raises(RuntimeError, match="different device"):
        param.grad = torch.ones(3)


def test_strict_module_cuda_moves_parameters_and_their_grads(strict):
    layer = torch.nn.Linear(3, 3)
    with pytest.raises(RuntimeError, match=MIXED):
        layer(on_device(2, 3))
    layer.cuda()
    layer(on_device(2, 3)).sum().backward()
    assert torch.equal(layer.weight.grad * 0, torch.zeros(3, 3, device="cuda"))
    with pytest.raises(RuntimeError, match=MIXED):
        layer.weight.grad + torch.ones(3, 3)


class _DoubleInBackward(torch.autograd.Function):
    """Its backward multiplies the incoming gradient by a tensor it makes on the host or on
    the gradient's device."""

    @staticmethod
    def forward(ctx, x, factor_on_host: bool):
        ctx.factor_on_host = factor_on_host
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        device = "cpu" if ctx.factor_on_host else grad.device
        return grad * torch.full(grad.shape, 2.0, device=device), None


def _run_backward(entry: str, root: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if entry == "tensor.backward":
        root.backward()
    elif entry == "engine":     # as the executor and megatron's custom_backward call it
        torch.autograd.Variable._execution_engine.run_backward(
            tensors=(root,), grad_tensors=(torch.ones_like(root),), keep_graph=False,
            create_graph=False, inputs=(), allow_unreachable=True, accumulate_grad=True)
    else:
        (grad,) = torch.autograd.grad(root, x)
        return grad
    return x.grad


@pytest.mark.parametrize("entry", ["tensor.backward", "engine", "autograd.grad"])
def test_strict_gradients_of_a_device_backward_are_device_tensors(strict, entry):
    x = on_device(3).requires_grad_()
    grad = _run_backward(entry, _DoubleInBackward.apply(x, False).sum(), x)
    assert torch.equal(grad, torch.full((3,), 2.0, device="cuda"))
    with pytest.raises(RuntimeError, match=MIXED):
        grad + torch.ones(3)
    x = on_device(3).requires_grad_()
    with pytest.raises(RuntimeError, match=MIXED):      # a host tensor made in that backward
        _run_backward(entry, _DoubleInBackward.apply(x, True).sum(), x)


class _KeepGrad(torch.autograd.Function):
    """Keeps its incoming gradient without computing on it (as a deferred weight grad does)."""

    kept: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _KeepGrad.kept.append(grad)
        return grad


def test_strict_gradients_a_function_only_keeps_are_device_tensors(strict):
    _KeepGrad.kept.clear()
    _KeepGrad.apply(on_device(3).requires_grad_()).sum().backward()
    assert torch.equal(_KeepGrad.kept[0] + on_device(3), torch.full((3,), 2.0, device="cuda"))
    with pytest.raises(RuntimeError, match=MIXED):
        _KeepGrad.kept[0] + torch.ones(3)


def test_strict_a_host_backward_stays_on_the_host(strict):
    x = torch.ones(3, requires_grad=True)
    _DoubleInBackward.apply(x, True).sum().backward()
    assert torch.equal(x.grad + torch.ones(3), torch.full((3,), 3.0))


COLLECTIVES = {
    "all_reduce": lambda t: dist.all_reduce(t),
    "all_gather": lambda t: dist.all_gather([torch.empty_like(t)], t),
    "all_gather_into_tensor": lambda t: dist.all_gather_into_tensor(torch.empty_like(t), t),
    "broadcast": lambda t: dist.broadcast(t, 0),
    "megatron's alias": lambda t: mappings.dist_all_gather_func(torch.empty_like(t), t),
}


@pytest.mark.parametrize("collective", COLLECTIVES.values(), ids=list(COLLECTIVES))
def test_strict_collectives_take_device_tensors_only(strict, collective):
    collective(on_device(2))
    with pytest.raises(RuntimeError, match=NCCL):
        collective(torch.ones(2))
    with pytest.raises(RuntimeError, match=NCCL):   # a 0-dim host tensor too
        collective(torch.zeros(()))


def test_strict_p2p_ops_take_device_tensors_only(strict):
    op = dist.P2POp(dist.isend, torch.ones(2), 0)     # dist.isend is still the op P2POp takes
    with pytest.raises(RuntimeError, match=NCCL):
        dist.batch_isend_irecv([op])
    with pytest.raises(RuntimeError, match=NCCL):
        dist.irecv(torch.ones(2), 0)


def test_strict_collective_check_holds_in_other_threads(strict):
    errors = []

    def reduce_host_tensor():
        try:
            dist.all_reduce(torch.ones(2))
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=reduce_host_tensor)
    thread.start()
    thread.join()
    assert len(errors) == 1 and NCCL in str(errors[0])


def test_strict_gloo_groups_take_host_tensors(strict):
    group = dist.new_group(backend="gloo")
    dist.all_reduce(torch.ones(2), group=group)
    with pytest.raises(RuntimeError, match=NCCL):
        dist.all_reduce(torch.ones(2), group=dist.new_group())


SYNCS = {
    "item": lambda t: t.item(),
    "int": int, "float": float, "bool": bool,
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "to cpu": lambda t: t.to("cpu"),
    "copy_ to host": lambda t: torch.zeros(()).copy_(t),
    "equal": lambda t: torch.equal(t, t),
    "nonzero": lambda t: t.reshape(1).nonzero(),
    "mask index": lambda t: t.reshape(1)[t.reshape(1) > 0],
    "repr": repr,
}


@pytest.mark.parametrize("sync", SYNCS.values(), ids=list(SYNCS))
def test_strict_host_syncs_raise_in_the_hot_loop_only(strict, sync):
    sync(on_device(()))
    with platform.host_sync_forbidden():
        sync(torch.ones(()))                    # host tensors: no sync
        with platform.host_sync_allowed():
            sync(on_device(()))
        with pytest.raises(RuntimeError, match=SYNC):
            sync(on_device(()))


def test_strict_asynchronous_transfers_and_masked_fills_are_no_syncs(strict):
    device = on_device(3)
    with platform.host_sync_forbidden():
        device.to("cpu", non_blocking=True)
        device[device > 0] = 0.0                 # a masked_fill_ on CUDA
        with pytest.raises(RuntimeError, match=SYNC):
            device[device > 0] = on_device(())     # a device value: index_put_, nonzero


def test_strict_a_wait_with_timeout_is_a_host_sync(strict):
    work = dist.all_reduce(on_device(1), async_op=True)
    with platform.host_sync_forbidden():
        work.wait()
        with pytest.raises(RuntimeError, match=SYNC):
            work.wait(timedelta(seconds=30))


def test_rules_are_off_outside_strict_mode():
    assert not platform.is_strict()
    torch.ones(3, device="cuda") + torch.ones(3)
    dist.all_reduce(torch.zeros(()))
    with platform.host_sync_forbidden():
        int(torch.ones((), device="cuda"))
    with platform.strict_mode():
        assert platform.is_strict()
    assert not platform.is_strict()


def test_the_environment_turns_strict_mode_on_for_the_process():
    code = ("from seq1f1b import platform; import torch; platform.activate(); "
            "print(platform.is_strict()); torch.ones(2, device='cuda') + torch.ones(2)")
    env = {**os.environ, platform.STRICT_ENV: "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.startswith("True") and MIXED in proc.stderr
