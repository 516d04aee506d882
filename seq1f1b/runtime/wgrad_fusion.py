"""Weight-gradient accumulation fusion: the weight-gradient GEMM adds straight into `main_grad`.

Megatron's `--gradient-accumulation-fusion` (on by default in Megatron-LM): a linear's backward
computes dW = dY^T X and megatron's DistributedDataParallel then adds it to the weight's
`main_grad` (fp32 buffer) in its gradient hook, once per micro-batch, once per span with Seq1F1B.
With the fusion the GEMM accumulates into `main_grad` itself (`fused_weight_gradient_mlp_cuda`,
built by apex or Transformer Engine): no fresh dW tensor, no separate add. megatron-core's
`LinearWithGradAccumulationAndAsyncCommunication` does it when `config.gradient_accumulation_fusion`
is set and hands autograd a dummy gradient marked `grad_added_to_main_grad`, so DDP's hook still
runs (it reports the gradient ready for the bucket) but adds nothing; a weight shared with the
embedding on one stage is marked `zero_out_wgrad` and gets a zero dummy, so the embedding's own
gradient is still added.

On a GPU megatron's path runs with the extension when it is importable; when it is not,
`resolve()` turns the fusion off with one notice (megatron-core would refuse to build the layer).
On the CPU `HostWgradKernel` is the extension: the same contract, `main_grad += dY^T X` as one
`addmm_`. The platform layer (seq1f1b/platform.py) registers it as megatron-core's kernel, as it
stands in for the other CUDA pieces, so megatron's own backward runs unchanged. The split-backward
W path (runtime/wgrad.py) calls `accumulate()`, the same kernel and the same dummy gradient.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import layers

NOTICE = ("note: --gradient-accumulation-fusion needs the fused_weight_gradient_mlp_cuda "
          "extension (apex or Transformer Engine), which is not importable: weight gradients "
          "accumulate unfused (--no-gradient-accumulation-fusion silences this)")


class HostWgradKernel:
    """`fused_weight_gradient_mlp_cuda` on the host: `main_grad += grad_output^T @ input` in
    `main_grad`'s precision (as the CUDA kernel accumulates bf16/fp16 products in fp32)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def install_host_kernel() -> None:
    """Make `HostWgradKernel` megatron-core's fused kernel (CPU platform layer only)."""
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = HostWgradKernel
        layers._grad_accum_fusion_available = True


def available() -> bool:
    """Whether megatron-core's linears can fuse (its kernel, or the host one, is installed)."""
    return layers._grad_accum_fusion_available


_notified = False


def _print_on_first_rank(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def resolve(requested: bool, notify: Callable[[str], None] = _print_on_first_rank) -> bool:
    """The `gradient_accumulation_fusion` a TransformerConfig can take: `requested` when the kernel
    is there, else False, with the notice through `notify` (by default printed by the job's
    first rank) the first time in the process."""
    global _notified
    if requested and not available():
        if not _notified:
            notify(NOTICE)
            _notified = True
        return False
    return requested


def accumulate(weight: torch.nn.Parameter, total_input: torch.Tensor,
               grad_output: torch.Tensor) -> Optional[torch.Tensor]:
    """Add dW = grad_output^T total_input (2-D) into `weight.main_grad` with megatron's kernel, and
    return the gradient autograd should carry instead of dW, as megatron's linear does: a dummy
    (zeros for a `zero_out_wgrad` weight) that DDP's hook recognises by `grad_added_to_main_grad`,
    or None where nothing has that hook."""
    main_grad = weight.main_grad
    kernel = layers.fused_weight_gradient_mlp_cuda
    if main_grad.dtype == torch.float32:
        kernel.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernel.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise RuntimeError(f"gradient accumulation fusion: unsupported main_grad dtype "
                           f"{main_grad.dtype}")
    return dummy_gradient(weight)


def dummy_gradient(weight: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """After dW went into `weight.main_grad`: megatron's dummy gradient for autograd (zeros for a
    `zero_out_wgrad` weight), marked `grad_added_to_main_grad` so DDP's hook adds nothing, or
    None where nothing has that hook (no DDP)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros_like if getattr(weight, "zero_out_wgrad", False) else torch.empty_like
    weight.grad_added_to_main_grad = True
    return make(weight.main_grad, dtype=weight.dtype)


def report_ready(params) -> None:
    """Run each weight's gradient hook with megatron's dummy gradient (DDP adds nothing for it
    and counts the weight ready for its bucket's reduction, with `overlap_grad_reduce`); nothing
    for a weight without DDP. For gradients that went into `main_grad` outside autograd, or that
    a rank never computes (an output-layer copy that runs no O action)."""
    for param in params:
        if not hasattr(param, "grad_added_to_main_grad"):
            continue
        mark = param.grad_added_to_main_grad
        torch.autograd.backward([param], [dummy_gradient(param)])
        param.grad_added_to_main_grad = mark
