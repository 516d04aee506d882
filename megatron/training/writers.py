"""Where a run's scalars go besides the log line: TensorBoard and Weights & Biases.

Both get the same scalars under Megatron's tag names, from the logging rank only (the last one,
which holds the losses): `training_scalars` of each log line at its iteration, and the
validation / test loss and perplexity of each evaluation. W&B is an optional dependency: the flags
are validated before anything is built (`--wandb-project` without the `wandb` package is refused),
and the package is imported only when a run asks for it. The W&B writer uses wandb's public API
only (`wandb.init(project, name, dir, config)`, `wandb.log(dict, step)`, `wandb.finish()`), so
`WANDB_MODE=offline` works as wandb documents it.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional, Protocol

from megatron.training.logging_utils import IntervalReport


def training_scalars(report: IntervalReport) -> dict[str, float]:
    """The figures of one log line, by Megatron's TensorBoard tag."""
    scalars = {"learning-rate": report.learning_rate,
               "batch-size": report.global_batch_size,
               "loss-scale": report.loss_scale,
               "iteration-time": report.seconds_per_iteration,
               "tokens-per-second": report.throughput.tokens_per_second,
               "tflops-per-gpu": report.throughput.tflops_per_gpu}
    if report.lm_loss is not None:
        scalars["lm loss"] = report.lm_loss
    if report.grad_norm is not None:
        scalars["grad-norm"] = report.grad_norm
    for stage, mb in enumerate(report.peak_memory_mb):
        scalars[f"peak-memory-mb/stage-{stage}"] = mb
    return scalars


def evaluation_scalars(split: str, lm_loss: float) -> dict[str, float]:
    """`lm loss validation` / `lm loss test` and their perplexities (Megatron's tags)."""
    return {f"lm loss {split}": lm_loss,
            f"lm loss {split} ppl": math.exp(min(20.0, lm_loss))}


class ScalarWriter(Protocol):
    def write(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """Scalars into an event file in `directory`."""

    def __init__(self, directory: str) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self._writer = SummaryWriter(log_dir=directory, max_queue=1000)

    def write(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """Scalars into a W&B run (Megatron's --wandb-project / --wandb-exp-name / --wandb-save-dir;
    the run's config is the validated flags)."""

    def __init__(self, project: str, name: Optional[str], directory: Optional[str],
                 config: dict) -> None:
        import wandb
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self._wandb = wandb
        wandb.init(project=project, name=name, dir=directory, config=config)

    def write(self, scalars: dict[str, float], step: int) -> None:
        self._wandb.log(dict(scalars), step=step)

    def close(self) -> None:
        self._wandb.finish()


class ScalarWriters:
    """Every writer the flags ask for; none off the logging rank."""

    def __init__(self, args: argparse.Namespace, enabled: bool) -> None:
        self._writers: list[ScalarWriter] = []
        if not enabled:
            return
        if args.tensorboard_dir:
            self._writers.append(TensorBoardWriter(args.tensorboard_dir))
        if args.wandb_project:
            self._writers.append(WandbWriter(args.wandb_project, args.wandb_exp_name,
                                             wandb_save_dir(args), config=vars(args)))

    def training(self, report: IntervalReport) -> None:
        self.write(training_scalars(report), report.iteration)

    def evaluation(self, split: str, iteration: int, lm_loss: float) -> None:
        self.write(evaluation_scalars(split, lm_loss), iteration)

    def write(self, scalars: dict[str, float], step: int) -> None:
        for writer in self._writers:
            writer.write(scalars, step)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers = []


def wandb_save_dir(args: argparse.Namespace) -> Optional[str]:
    """--wandb-save-dir, else Megatron's default `<--save>/wandb`, else wandb's own (./wandb)."""
    if args.wandb_save_dir:
        return args.wandb_save_dir
    return os.path.join(args.save, "wandb") if args.save else None
