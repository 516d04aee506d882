"""Which kernel CUDA's scaled_dot_product_attention would pick for a call, and what it costs.

On the CPU, SDPA runs one kernel for any input, so the suite cannot see CUDA refusing its fused
kernels and falling back to the math kernel, which materialises the [b, heads, sq, sk] scores
(16 GiB per layer for Llama-3-8B at 32K with k=4 spans and documents). This module replays
torch 2.13's choice (`select_sdp_backend`, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)
for the inputs our attention passes, on an A100 (sm80, the paper's GPU):

- order: flash, then memory-efficient, then math; cuDNN comes after math there, so it is never
  reached (torch moves cuDNN first only on sm90/sm100 with cuDNN newer than 9.15, which
  `CudaDevice.cudnn_first` models);
- flash: no attention mask; fp16 or bf16; q, k and v of one head dimension, at most 256;
  `is_causal` only with as many queries as keys; grouped-query attention accepted;
- memory-efficient: a mask accepted (one whose strides but the last are not multiples of 8 it
  pads: a copy per call, saved for backward); fp16, bf16 or fp32; a head dimension divisible by
  8 (16-bit) or 4 (fp32); q, k, v storage offsets aligned alike; no grouped-query attention (as
  reviewed for torch 2.13; later torch accepts it here);
- cuDNN: fp16 or bf16, head dimension a multiple of 8 and at most 128, masks and GQA accepted;
- math: anything.

`check_sdpa_kernel` runs before every SDPA call of our attention. On a GPU it warns once when
the math kernel would run above `math_limit_bytes()` of scores; in strict CUDA mode on the CPU
(tensors the mode sees on the device) it raises instead, and it also raises when the efficient
kernel would pad a float mask of that size: what strict mode now sees of CUDA's dispatch.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from seq1f1b import platform

MATH_LIMIT_VARIABLE = "SEQ1F1B_SDPA_MATH_LIMIT_MIB"
DEFAULT_MATH_LIMIT_MIB = 64
MASK_ROW_ALIGNMENT = 8
"""CUDA's memory-efficient kernel reads an attention mask only when every stride but the last is
a multiple of 8 elements (torch's `preprocess_mask`); any other mask it pads, a copy per call
that its backward saves."""
_LOG = logging.getLogger(__name__)
_warned: set[str] = set()


@dataclass(frozen=True)
class CudaDevice:
    """What torch's choice depends on beyond the inputs."""

    capability: tuple[int, int] = (8, 0)
    cudnn_first: bool = False


A100 = CudaDevice()


@dataclass(frozen=True)
class SdpaChoice:
    """The kernel CUDA would run, why each fused kernel before it refused, and whether a mask
    would be padded (copied) on the way."""

    kernel: str
    refusals: tuple[str, ...]
    pads_mask: bool = False


def _half(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def _flash_refusal(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                   is_causal: bool) -> Optional[str]:
    if mask is not None:
        return "flash takes no attention mask"
    if not _half(q.dtype):
        return f"flash needs fp16 or bf16, got {q.dtype}"
    if not (q.size(-1) == k.size(-1) == v.size(-1) <= 256):
        return "flash needs one head dimension of at most 256"
    if is_causal and q.size(-2) != k.size(-2):
        return "flash takes is_causal only with as many queries as keys"
    return None


def _alignment(dtype: torch.dtype) -> int:
    return 8 if _half(dtype) else 4


def _efficient_refusal(q: Tensor, k: Tensor, v: Tensor) -> Optional[str]:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"memory-efficient needs fp16, bf16 or fp32, got {q.dtype}"
    if q.size(1) != k.size(1):
        return "memory-efficient takes no grouped-query attention (fewer K/V heads)"
    align = _alignment(q.dtype)
    if q.size(-1) % align or v.size(-1) % align or q.size(-1) != k.size(-1):
        return f"memory-efficient needs head dimensions divisible by {align}"
    if any(t.storage_offset() % align for t in (q, k, v)):
        return f"memory-efficient needs storage offsets aligned to {align} elements"
    return None


def _cudnn_refusal(q: Tensor, v: Tensor) -> Optional[str]:
    if not _half(q.dtype):
        return f"cuDNN needs fp16 or bf16, got {q.dtype}"
    if q.size(-1) % 8 or q.size(-1) > 128 or v.size(-1) % 8 or v.size(-1) > 128:
        return "cuDNN needs head dimensions that are multiples of 8, at most 128"
    return None


def mask_is_padded(mask: Optional[Tensor]) -> bool:
    """Whether the memory-efficient kernel would pad (copy) `mask`: a stride other than the
    last's not a multiple of 8 elements (a broadcast dimension of size 1 is read as it is)."""
    if mask is None or not isinstance(mask, Tensor):
        return False
    return any(stride % MASK_ROW_ALIGNMENT for size, stride in
               zip(mask.shape[:-1], mask.stride()[:-1]) if size > 1)


def sdpa_cuda_kernel(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                     is_causal: bool = False, device: CudaDevice = A100) -> SdpaChoice:
    """The kernel torch 2.13 would choose on `device` for q, k, v as [b, heads, s, d] and an
    attn_mask (None, bool or float); see the module docstring."""
    refusals = []
    order = ("cudnn", "flash", "efficient", "math") if device.cudnn_first else \
        ("flash", "efficient", "math")
    float_mask = mask if isinstance(mask, Tensor) and mask.is_floating_point() else None
    for kernel in order:
        if kernel == "math":
            return SdpaChoice("math", tuple(refusals))
        reason = (_flash_refusal(q, k, v, mask, is_causal) if kernel == "flash" else
                  _efficient_refusal(q, k, v) if kernel == "efficient" else
                  _cudnn_refusal(q, v))
        if reason is None:
            return SdpaChoice(kernel, tuple(refusals),
                              kernel == "efficient" and mask_is_padded(float_mask))
        refusals.append(reason)
    raise AssertionError("math is always last")


def math_limit_bytes() -> int:
    """Scores (or a padded mask) above this size make a math fallback an error in strict mode
    and a warning on a GPU: `SEQ1F1B_SDPA_MATH_LIMIT_MIB` (default 64 MiB)."""
    return int(float(os.environ.get(MATH_LIMIT_VARIABLE, DEFAULT_MATH_LIMIT_MIB)) * 2 ** 20)


def check_sdpa_kernel(q: Tensor, k: Tensor, v: Tensor, mask: Optional[object],
                      is_causal: bool = False) -> None:
    """Before an SDPA call of ours: see the module docstring. Costs nothing off the GPU path."""
    strict = platform.is_strict() and platform.seen_on_device(q)
    if not (q.is_cuda or strict):
        return
    mask = mask if isinstance(mask, Tensor) else None    # causal_lower_right: no tensor
    choice = sdpa_cuda_kernel(q, k, v, mask, is_causal)
    limit = math_limit_bytes()
    scores = q.size(0) * q.size(1) * q.size(2) * k.size(2) * q.element_size()
    problem = None
    if choice.kernel == "math" and scores > limit:
        problem = (f"scaled_dot_product_attention would run CUDA's math kernel "
                   f"({'; '.join(choice.refusals)}), materialising {scores / 2 ** 20:.0f} MiB of "
                   f"scores per layer: use --attention-backend flex or flash")
    elif choice.pads_mask and mask.numel() * mask.element_size() > limit:
        problem = (f"scaled_dot_product_attention would pad (copy) its {tuple(mask.shape)} mask "
                   f"per call: its row stride {mask.stride(-2)} is not a multiple of "
                   f"{MASK_ROW_ALIGNMENT}")
    if problem is None:
        return
    if strict:
        raise RuntimeError(f"{problem} (strict CUDA mode; {MATH_LIMIT_VARIABLE} sets the size)")
    if problem not in _warned:
        _warned.add(problem)
        _LOG.warning(problem)
