"""Megatron's `--check-for-nan-in-loss-and-grad` (on by default): a NaN or inf stops the run.

A non-finite loss or gradient poisons every later update, and a run that goes on training on it
burns a cluster allocation for nothing. The checks run once per iteration, after the schedule
(never inside it: the executor must not read device values on the host) and before the optimizer
step, so a poisoned update is never applied, and the message says where to look: the iteration,
the pipeline stage and, for a loss, the micro-batch.

- Loss: each micro-batch's reported loss on the last stage.
- Gradients: the norm of each local model chunk's gradients (after the data-parallel reduction),
  per virtual pipeline stage. Not with `--fp16`: there the dynamic loss scaler expects overflows
  and skips those steps itself (the log's "number of skipped iterations").
"""
from __future__ import annotations

from typing import Sequence

import torch


class NonFiniteError(RuntimeError):
    """A NaN or inf in the loss or the gradients (--check-for-nan-in-loss-and-grad)."""


def check_losses(losses: Sequence[dict], iteration: int, stage: int) -> None:
    """Raise when a micro-batch's reported loss (megatron's loss dicts) is not finite."""
    for microbatch, entry in enumerate(losses):
        for key, value in entry.items():
            tensor = torch.as_tensor(value).detach().float()
            if not torch.isfinite(tensor).all():
                raise NonFiniteError(
                    f"iteration {iteration}: {key} of micro-batch {microbatch} on pipeline stage "
                    f"{stage} is {tensor.tolist()} (--check-for-nan-in-loss-and-grad; "
                    "--no-check-for-nan-in-loss-and-grad turns this check off)")


def check_gradients(chunks: Sequence[torch.nn.Module], stages: Sequence[int],
                    iteration: int) -> None:
    """Raise when the gradients of a local model chunk (virtual stage `stages[c]`) have a NaN or
    inf norm. Reads megatron DDP's `main_grad` where there is one."""
    for chunk, stage in zip(chunks, stages):
        grads = [getattr(p, "main_grad", p.grad) for p in chunk.parameters() if p.requires_grad]
        grads = [g for g in grads if g is not None]
        if not grads:
            continue
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float())
                                                     for g in grads]))
        if not torch.isfinite(norm):
            raise NonFiniteError(
                f"iteration {iteration}: the gradient norm of pipeline stage {stage} is "
                f"{float(norm)} (--check-for-nan-in-loss-and-grad; "
                "--no-check-for-nan-in-loss-and-grad turns this check off)")
