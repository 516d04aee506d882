"""Where a run's scalars go besides the log line: TensorBoard and Weights & Biases.

Both get the same scalars under Megatron's tag names, from the logging rank only (the last one,
which holds the losses): `IterationScalars` every --tensorboard-log-interval iterations (the
iteration's loss, learning rate, batch size, loss scale, grad norm, and as the --log-* flags ask
the number of zeros, the params norm, the world size and the CUDA allocator's memory),
`interval_scalars` at each log line (iteration time, throughput, peak memory per stage; with
--log-timers-to-tensorboard megatron's timers), and the validation / test loss (and with
--log-validation-ppl-to-tensorboard the perplexity) of each evaluation. W&B is an optional
dependency: the flags are validated before anything is built (`--wandb-project` without the
`wandb` package is refused), and the package is imported only when a run asks for it. The W&B
writer uses wandb's public API only (`wandb.init(project, name, dir, config)`, `wandb.log(dict,
step)`, `wandb.finish()`), so `WANDB_MODE=offline` works as wandb documents it.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Optional, Protocol

from megatron.training.logging_utils import IntervalReport


@dataclass(frozen=True)
class IterationScalars:
    """What Megatron-LM writes every --tensorboard-log-interval iterations: that iteration's
    figures, by its tag names."""

    learning_rate: float
    batch_size: int
    losses: dict[str, float]                # empty off the last stage
    loss_scale: Optional[float]             # None with --no-log-loss-scale-to-tensorboard
    grad_norm: Optional[float] = None
    num_zeros_in_grad: Optional[int] = None     # with --log-num-zeros-in-grad
    params_norm: Optional[float] = None         # with --log-params-norm
    world_size: Optional[int] = None            # with --log-world-size-to-tensorboard
    memory_stats: Optional[dict] = None
    """`torch.cuda.memory_stats()` with --log-memory-to-tensorboard (GPU only)."""

    def scalars(self) -> dict[str, float]:
        scalars = {"learning-rate": self.learning_rate, "batch-size": self.batch_size,
                   **self.losses}
        optional = {"loss-scale": self.loss_scale, "world-size": self.world_size,
                    "grad-norm": self.grad_norm, "num-zeros": self.num_zeros_in_grad,
                    "params-norm": self.params_norm}
        scalars.update({tag: value for tag, value in optional.items() if value is not None})
        if self.memory_stats is not None:
            scalars.update(memory_scalars(self.memory_stats))
        return scalars


MEMORY_TAGS = {"mem-reserved-bytes": "reserved_bytes.all.current",
               "mem-allocated-bytes": "allocated_bytes.all.current",
               "mem-max-allocated-bytes": "allocated_bytes.all.peak",
               "mem-allocated-count": "allocation.all.current"}
"""--log-memory-to-tensorboard's tags and the CUDA allocator statistics they hold."""


def memory_scalars(stats: dict) -> dict[str, float]:
    return {tag: stats[key] for tag, key in MEMORY_TAGS.items()}


def interval_scalars(report: IntervalReport, throughput: bool = False) -> dict[str, float]:
    """What each log line adds: its timing and the paper's metrics (this harness's tags), and
    with `throughput` (--log-throughput and --log-timers-to-tensorboard) Megatron-LM's
    'throughput' (TFLOP/s/GPU)."""
    scalars = {"iteration-time": report.seconds_per_iteration,
               "tokens-per-second": report.throughput.tokens_per_second,
               "tflops-per-gpu": report.throughput.tflops_per_gpu}
    if throughput:
        scalars["throughput"] = report.throughput.tflops_per_gpu
    for stage, mb in enumerate(report.peak_memory_mb):
        scalars[f"peak-memory-mb/stage-{stage}"] = mb
    return scalars


def evaluation_scalars(split: str, lm_loss: float, ppl: bool = True) -> dict[str, float]:
    """`lm loss validation` / `lm loss test`, and with `ppl` (--log-validation-ppl-to-tensorboard)
    their perplexities (Megatron's tags)."""
    scalars = {f"lm loss {split}": lm_loss}
    if ppl:
        scalars[f"lm loss {split} ppl"] = math.exp(min(20.0, lm_loss))
    return scalars


class ScalarWriter(Protocol):
    def write(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """Scalars into an event file in `directory`."""

    def __init__(self, directory: str, queue_size: int = 1000) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.summary = SummaryWriter(log_dir=directory, max_queue=queue_size)

    def write(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.summary.add_scalar(tag, value, step)

    def close(self) -> None:
        self.summary.close()


class WandbWriter:
    """Scalars into a W&B run (Megatron's --wandb-project / --wandb-exp-name / --wandb-save-dir;
    the run's config is the validated flags)."""

    def __init__(self, project: str, name: Optional[str], directory: Optional[str],
                 config: dict) -> None:
        import wandb
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self.module = wandb
        wandb.init(project=project, name=name, dir=directory, config=config)

    def write(self, scalars: dict[str, float], step: int) -> None:
        self.module.log(dict(scalars), step=step)

    def close(self) -> None:
        self.module.finish()


class ScalarWriters:
    """Every writer the flags ask for; none off the logging rank."""

    def __init__(self, args: argparse.Namespace, enabled: bool) -> None:
        self.wanted = bool(args.tensorboard_dir or args.wandb_project)
        """Whether the flags ask for a writer (the same answer on every rank)."""
        self._writers: list[ScalarWriter] = []
        self._tensorboard: Optional[TensorBoardWriter] = None
        self._wandb = None
        if not enabled:
            return
        if args.tensorboard_dir:
            self._tensorboard = TensorBoardWriter(args.tensorboard_dir,
                                                  getattr(args, "tensorboard_queue_size", 1000))
            self._writers.append(self._tensorboard)
        if args.wandb_project:
            writer = WandbWriter(args.wandb_project, args.wandb_exp_name, wandb_save_dir(args),
                                 config=vars(args))
            self._wandb = writer.module
            self._writers.append(writer)

    def training(self, report: IntervalReport, throughput: bool = False) -> None:
        self.write(interval_scalars(report, throughput), report.iteration)

    def iteration(self, scalars: IterationScalars, iteration: int) -> None:
        self.write(scalars.scalars(), iteration)

    def evaluation(self, split: str, iteration: int, lm_loss: float, ppl: bool = True) -> None:
        self.write(evaluation_scalars(split, lm_loss, ppl), iteration)

    def timers(self, timers, names: list[str], iteration: int, normalizer: float,
               barrier: bool, wandb_wanted: bool) -> None:
        """--log-timers-to-tensorboard: megatron's `Timers.write` (`<name>-time`, the maximum
        over ranks), into TensorBoard and, when `wandb_wanted`, W&B. Collective: every rank
        calls it alike (the writers live on the logging rank); the timers are not reset, the
        log's timing block after it reads them too."""
        timers.write(names, self._tensorboard.summary if self._tensorboard else None,
                     iteration, normalizer=normalizer, reset=False, barrier=barrier)
        if wandb_wanted:
            timers.write(names, self._wandb, iteration, normalizer=normalizer, reset=False,
                         barrier=barrier)

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
