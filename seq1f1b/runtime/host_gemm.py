"""The CPU's fp32 product of activations and a weight: oneDNN's matmul where it beats MKL's sgemm.

A linear's forward (`X @ W^T`) and its input gradient (`dY @ W`) are megatron-core's
`torch.matmul` calls. On the CPU torch sends them to MKL's sgemm, which on the AMD EPYC hosts
this project's benchmarks ran on (Zen 4, AVX-512) loses per row as the rows get fewer:
the benchmark's layer shapes (h 1024, four weights of a layer) take 3.7% (forward) and 4.8%
(input gradient) more time as four 256-row products than as one of 1024 rows. That is the
spans' largest remaining compute cost on the CPU, and it is the BLAS's, not the schedule's: a
GPU at the paper's shapes runs spans of thousands of rows. oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, the kernel torch's own CPU compiler emits for a linear)
takes 1.2% and 1.1% there, and is 10-15% faster than MKL at both row counts; below about
8M multiply-adds per call its fixed cost per call makes it the slower one (a 32 x 128 by
128 x 512 product: 63 against 54 us).

`product(a, b)` therefore computes `a @ b` with oneDNN when it is such a product:
- fp32 on both sides, `b` a matrix and `a` a contiguous matrix or batch of rows (X or dY, as
  megatron passes them); a transposed `a` is the weight gradient `dY^T X`, where MKL's `addmm_`
  into `main_grad` stays faster (oneDNN took 1.21x at 256 rows);
- at least `MIN_MULTIPLY_ADDS`;
- nothing to differentiate: oneDNN's op has no autograd formula, and megatron's linears call it
  inside their autograd Functions, where grad mode is off.
Anything else returns None and the caller runs torch's own matmul. The results are fp32 products
with fp32 accumulation in another order (against a float64 product at the benchmark's shapes:
2.3e-6 and 4.6e-6 largest absolute error, MKL's 1.5e-6 and 1.6e-6); the equivalence matrix holds
both sides of its comparison to the same tolerances as before. The platform layer
(seq1f1b/platform.py) routes `torch.matmul` and `Tensor.matmul` here; on a GPU nothing changes.
"""
from __future__ import annotations

from typing import Optional

import torch

MIN_MULTIPLY_ADDS = 1 << 23
_ONEDNN = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if (
    torch.backends.mkldnn.is_available()) else None


def product(a: torch.Tensor, b: torch.Tensor) -> Optional[torch.Tensor]:
    """`a @ b` by oneDNN, or None where torch's matmul is the better (or the only right) one."""
    if (_ONEDNN is None or b.dim() != 2 or a.dim() not in (2, 3)
            or a.dtype is not torch.float32 or b.dtype is not torch.float32
            or a.device.type != "cpu" or b.device.type != "cpu" or not a.is_contiguous()
            or a.size(-1) != b.size(0)
            or a.numel() * b.size(1) < MIN_MULTIPLY_ADDS
            or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))):
        return None
    rows = _ONEDNN(a.reshape(-1, a.size(-1)), b.t(), None, "none", [], "")
    # As torch's matmul does for a batch of rows: a result, not a view of one (megatron's autograd
    # Functions return it, and autograd forbids a Function's output to be a view modified later).
    return torch.ops.aten._unsafe_view(rows, (*a.shape[:-1], b.size(1)))
