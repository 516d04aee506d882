"""Deferred weight gradients: megatron's tensor-parallel linears with backward split into B and W.

Zero-bubble schedules run a span's backward as two actions. B computes the gradient w.r.t. the
stage input (the previous stage waits for it); W computes the weight gradients (nobody waits).
`SplitBackwardColumnParallelLinear` / `SplitBackwardRowParallelLinear` are megatron's
ColumnParallelLinear / RowParallelLinear (the layer spec's QKV, projection, FC1 and FC2;
`make_split_backward` converts GPTModel's output layer) whose autograd function, when a backward
runs inside `WeightGradStore.begin(key)`, does only the B half: the input-gradient GEMM with
megatron's tensor-parallel reduction (all-reduce, or the sequence-parallel reduce-scatter), and
the bias gradient (a cheap sum). The weight-gradient GEMM is queued under `key` with the tensors
it needs, which autograd saved anyway (the layer input and the output gradient), and runs at
`WeightGradStore.flush(key)`. Nothing is recomputed: B + W is the same work as one backward.

Outside `begin` the backward is megatron's own code, so schedules without W and forward-only
runs are unaffected; with gradient accumulation fusion every model uses these linears, whose
autograd function keeps the weight Parameter on ctx (see `_SplitBackwardLinear`).

Where the gradient goes: `flush` hands each weight its gradient through autograd's own
accumulation (`torch.autograd.backward` on the parameter), exactly where a normal backward puts
it: `weight.grad` without DDP. With megatron's DistributedDataParallel the weight's gradient hook
must run at W, not at B (with `overlap_grad_reduce` it reports the gradient ready for the bucket's
reduction, and asserts that there is one): megatron's own mechanism for deferred weight
gradients does this. The split-backward linears mark their weight `skip_backward_post_hook`;
megatron's DDP, built with `delay_wgrad_compute=True`, then hands the weight's hook to the
linear (`register_wgrad_accumulation_and_reduce_hooks`) instead of the weight's gradient
accumulator. The linear runs that hook after each accumulation that brought a gradient: at W
(and at an ordinary backward outside `begin`), never at B, whose accumulation brings none. The
hook adds the gradient to `main_grad` (and clears `.grad`), as after any backward, so
`finalize_model_grads` sees it. (A DDP built without `delay_wgrad_compute` ignores the mark and
keeps its hook on the accumulator: the same sum, with a gradient-less call at B that only
`overlap_grad_reduce` refuses.) With `gradient_accumulation_fusion` the deferred GEMM adds into
`main_grad` itself, as megatron's linear does at a full backward (runtime/wgrad_fusion.py), and
autograd carries megatron's dummy gradient to the same hook, which then adds nothing.

Under sequence parallelism the layer input is a sequence shard; the deferred GEMM needs the
whole sequence and all-gathers it at W (all TP ranks run the same program, so the collective
matches). Keeping the shard, not the gathered copy, holds between B and W only what autograd
already held for the backward.

One store per executor. The layers find it through a module-level slot that `begin` sets: a
plain global, not thread-local, because on CUDA the autograd engine runs backward functions on
its own device threads.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    LinearWithGradAccumulationAndAsyncCommunication,
    RowParallelLinear,
    custom_bwd,
    custom_fwd,
)
from megatron.core.utils import (
    get_tensor_model_parallel_group_if_none,
    prepare_input_tensors_for_wgrad_compute,
)

from seq1f1b.runtime import wgrad_fusion


@dataclass
class _DeferredGemm:
    """One weight-gradient GEMM of one linear, with the tensors B left for it."""

    weight: torch.nn.Parameter
    input: torch.Tensor               # the layer input as autograd saved it (SP: a shard)
    grad_output: torch.Tensor
    sequence_parallel: bool
    tp_group: Optional[dist.ProcessGroup]
    fused: bool                       # gradient_accumulation_fusion: the GEMM adds into main_grad

    def compute(self) -> Optional[torch.Tensor]:
        """The weight's gradient for autograd: dW, or with the fusion megatron's dummy after dW
        went into `main_grad` (None where no DDP hook expects one)."""
        total_input = self.input
        if self.sequence_parallel:
            shape = list(self.input.shape)
            shape[0] *= self.tp_group.size()
            total_input = torch.empty(shape, dtype=self.input.dtype, device=self.input.device)
            dist.all_gather_into_tensor(total_input, self.input.contiguous(),
                                        group=self.tp_group)
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(
            self.grad_output, total_input)
        if self.fused:
            return wgrad_fusion.accumulate(self.weight, total_input, grad_output)
        return grad_output.t().matmul(total_input).to(self.weight.dtype)


_active: Optional[tuple["WeightGradStore", Hashable]] = None
"""(store, key) that split-backward linears defer to while a B runs; None: full backward."""


class WeightGradStore:
    """Weight-gradient GEMMs deferred by B actions, by key, until their W action.

    The executor owns one: at B(i,j,c) it runs the backward inside `begin((i, j, c))`, at W(i,j,c)
    it calls `flush((i, j, c))`. After an iteration `pending()` is empty.
    """

    def __init__(self) -> None:
        self._gemms: dict[Hashable, list[_DeferredGemm]] = {}

    @contextlib.contextmanager
    def begin(self, key: Hashable) -> Iterator[None]:
        """Backwards run inside defer their weight gradients under `key`."""
        global _active
        previous, _active = _active, (self, key)
        try:
            yield
        finally:
            _active = previous

    def defer(self, key: Hashable, gemm: _DeferredGemm) -> None:
        self._gemms.setdefault(key, []).append(gemm)

    def flush(self, key: Hashable) -> None:
        """Run the GEMMs deferred under `key` and accumulate each weight's gradient the way
        autograd does (DDP's hooks included). A key nothing was deferred under is a no-op."""
        grads: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        with torch.no_grad():
            for gemm in self._gemms.pop(key, []):
                grad = gemm.compute()
                if grad is None:
                    continue
                weight_id = id(gemm.weight)
                if weight_id in grads:
                    grad = grads[weight_id][1] + grad
                grads[weight_id] = (gemm.weight, grad)
        if grads:
            weights, values = zip(*grads.values())
            torch.autograd.backward(list(weights), grad_tensors=list(values))

    def pending(self) -> list[Hashable]:
        """Keys whose weight gradients are still deferred."""
        return list(self._gemms)

    def held_tensors(self) -> list[torch.Tensor]:
        """What the deferred GEMMs keep alive: the layer inputs, which a full backward would have
        freed at its end, and the output gradients, which it would never have kept."""
        return [tensor for gemms in self._gemms.values() for gemm in gemms
                for tensor in (gemm.input, gemm.grad_output)]


class _SplitBackwardLinear(LinearWithGradAccumulationAndAsyncCommunication):
    """megatron's linear autograd function; inside `WeightGradStore.begin`, backward is B only.

    It also keeps the weight Parameter itself on ctx. Under saved-tensor hooks (the CPU
    trainer's and the benchmark's saved-tensor meter) `ctx.saved_tensors` hands back an alias of
    the weight without its Python attributes, and the fused path reads them: megatron's backward
    then gives autograd no dummy gradient (`grad_added_to_main_grad` seems absent), DDP's hook
    sees none and, with `overlap_grad_reduce`, refuses. The dummy is made here for the
    Parameter instead, and W defers its GEMM against the Parameter.
    """

    @staticmethod
    @custom_fwd
    def forward(ctx, input, weight, *args):
        ctx.weight_param = weight
        return LinearWithGradAccumulationAndAsyncCommunication.forward.__wrapped__(
            ctx, input, weight, *args)

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output):
        target = _active
        weight = ctx.weight_param
        if target is None or ctx.grad_output_buffer is not None:
            grads = LinearWithGradAccumulationAndAsyncCommunication.backward.__wrapped__(
                ctx, grad_output)
            if ctx.gradient_accumulation_fusion and grads[1] is None:   # see the docstring
                grads = (grads[0], wgrad_fusion.dummy_gradient(weight), *grads[2:])
            return grads
        store, key = target
        input, _ = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.sequence_parallel:
            grad_shard = torch.empty(input.shape, dtype=input.dtype, device=grad_input.device)
            dist.reduce_scatter_tensor(grad_shard, grad_input.contiguous(), group=ctx.tp_group)
            grad_input = grad_shard
        elif ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=ctx.tp_group)
        if ctx.gradient_accumulation_fusion:
            weight.main_grad = ctx.main_grad    # as megatron's backward: the forward's buffer
        store.defer(key, _DeferredGemm(weight, input, grad_output, ctx.sequence_parallel,
                                       ctx.tp_group, ctx.gradient_accumulation_fusion))
        grad_bias = (grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
                     if ctx.use_bias else None)
        return grad_input, None, grad_bias, None, None, None, None, None, None


def _split_backward_linear(input: torch.Tensor, weight: torch.Tensor,
                           bias: Optional[torch.Tensor], gradient_accumulation_fusion: bool,
                           allreduce_dgrad: bool, sequence_parallel: bool,
                           grad_output_buffer: Optional[list] = None,
                           wgrad_deferral_limit: Optional[int] = 0,
                           tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """megatron's linear_with_grad_accumulation_and_async_allreduce with our autograd function."""
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    return _SplitBackwardLinear.apply(input, weight, bias, gradient_accumulation_fusion,
                                      allreduce_dgrad, sequence_parallel, grad_output_buffer,
                                      wgrad_deferral_limit, tp_group)


class _SplitBackwardForward:
    """Mixin: megatron's tensor-parallel linear forward, through `_SplitBackwardLinear`, and the
    weight-gradient hook registration megatron's DDP asks of layers that defer weight gradients."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not weight.requires_grad:        # frozen weights have no weight gradient to defer
            return super()._forward_impl(input, weight, *args, **kwargs)
        return _split_backward_linear(input, weight, *args, **kwargs)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """megatron DDP (`delay_wgrad_compute`): run `hook` after each accumulation of this
        layer's weight gradient that brought one (W, or a backward outside `begin`)."""
        weight = self.weight
        accumulator = weight.expand_as(weight).grad_fn.next_functions[0][0]

        def after_accumulation(*unused) -> None:
            if weight.grad is not None:
                hook()

        accumulator.register_hook(after_accumulation)
        # autograd keeps a parameter's accumulator only while something references it
        self.__dict__.setdefault("_wgrad_accumulators", []).append(accumulator)


def _mark_deferred_weight(linear: torch.nn.Module) -> None:
    """Tell megatron's DDP (`delay_wgrad_compute`) that the layer runs the weight's hook."""
    if isinstance(getattr(linear, "weight", None), torch.nn.Parameter):
        linear.weight.skip_backward_post_hook = True


class SplitBackwardColumnParallelLinear(_SplitBackwardForward, ColumnParallelLinear):
    """ColumnParallelLinear whose weight gradient waits for `WeightGradStore.flush`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _mark_deferred_weight(self)


class SplitBackwardRowParallelLinear(_SplitBackwardForward, RowParallelLinear):
    """RowParallelLinear whose weight gradient waits for `WeightGradStore.flush`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _mark_deferred_weight(self)


def make_split_backward(linear: ColumnParallelLinear | RowParallelLinear
                        ) -> ColumnParallelLinear | RowParallelLinear:
    """Turn a linear megatron built itself (GPTModel's output layer) into its split-backward
    subclass, in place: the subclass adds no state, so every attribute stays megatron's."""
    for base, split in ((ColumnParallelLinear, SplitBackwardColumnParallelLinear),
                        (RowParallelLinear, SplitBackwardRowParallelLinear)):
        if isinstance(linear, split):
            return linear
        if type(linear) is base:
            linear.__class__ = split
            _mark_deferred_weight(linear)
            return linear
    raise TypeError(f"split backward supports megatron's ColumnParallelLinear and "
                    f"RowParallelLinear, got {type(linear).__name__}")


def has_split_backward(model: torch.nn.Module) -> bool:
    """Whether `model` holds any split-backward linear (else W actions would defer nothing)."""
    return any(isinstance(module, _SplitBackwardForward) for module in model.modules())
