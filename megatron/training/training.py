"""`pretrain`: Megatron's training loop, with every pipeline schedule of the registry.

One iteration: zero megatron DDP's grad buffers, run the forward-backward function of
`--pipeline-schedule` (spans cut by `--seq1f1b-*`; schedule_function, which also traces the
iterations that calibrate `--seq1f1b-partition fit` or draw `--timeline-path`) over
`num_micro_batches` micro-batches of this DP rank, let megatron's optimizer step (grad
finalisation over DP/TP/PP happened inside the schedule; clipping and, with --fp16, loss scaling
happen in `optimizer.step()`), advance the LR schedule by one global batch. Around it: log
every --log-interval, evaluate every --eval-interval (forward only, same schedule and spans), save
every --save-interval and at the end (with --async-save in the background: async_checkpoint),
stop at --exit-interval, on --exit-signal-handler's signal or after --exit-duration-in-mins
(saving first). With --manual-gc Python's collector runs only at fixed points, the same on
every rank (garbage_collection), and --empty-unused-memory-level empties the CUDA cache after
the forward-backward, evaluation steps and (2) the optimizer step, as Megatron-LM.
--skip-train loads the checkpoint and only evaluates. The flow follows
Megatron-LM's `pretrain()`; the user supplies the same three functions a Megatron
`pretrain_gpt.py` does.

Observability, as in Megatron-LM: the log line (logging_utils) and, after it with
--timing-log-level 1 or 2, megatron's timers (min/max over ranks, ms per iteration); the same
scalars to TensorBoard and W&B (writers); torch.profiler traces and CUDA memory snapshots
(profiling). With --overlap-param-gather, evaluation and checkpoint saving first gather the
parameters the optimizer step left sharded (model_setup.parameters_gathered).
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import (OptimizerParamScheduler,
                                                     get_canonical_lr_for_logging)
from megatron.core.timers import Timers
from megatron.core.utils import get_model_config

from megatron.training import checkpointing, model_setup, numerics
from megatron.training.async_checkpoint import AsyncSaves
from megatron.training.checkpoint_common import starting_point
from megatron.training.data import MicroBatchIterator, train_valid_test_num_samples
from megatron.training.exit_conditions import ExitConditions
from megatron.training.garbage_collection import ManualCollection
from megatron.training.global_vars import get_args, get_tokenizer, set_global_variables
from megatron.training.initialize import finish_megatron, initialize_megatron
from megatron.training.logging_utils import (IntervalReport, PeakMemory, params_l2_norm,
                                             throughput, validation_lines)
from megatron.training.profiling import Profiler
from megatron.training.schedule_budget import starting_span_lengths
from megatron.training.schedule_function import ScheduleFunction
from megatron.training.writers import IterationScalars, ScalarWriters
from seq1f1b import platform
from seq1f1b.plan.actions import virtual_stage
from seq1f1b.plan.costs import ModelConfig

DatasetsProvider = Callable[[Sequence[int]], Sequence[Optional[object]]]
"""`provider([train, valid, test] sample counts) -> (train, valid, test) datasets (or None)`."""
ForwardStep = Callable[..., tuple]
"""Megatron's `forward_step(data_iterator, model) -> (output, loss_func)`."""


@dataclass
class IterationRecord:
    """One training iteration as the last pipeline stage saw it (losses empty elsewhere)."""

    iteration: int
    losses: dict[str, float]
    grad_norm: Optional[float]
    learning_rate: float        # the LR the iteration's update used
    skipped: bool
    num_zeros_in_grad: Optional[int] = None      # with --log-num-zeros-in-grad
    logged_learning_rate: Optional[float] = None
    """The LR Megatron-LM logs for the iteration: the optimizer's after the scheduler stepped
    (get_canonical_lr_for_logging after train_step), which is the next iteration's."""

    @property
    def nan(self) -> bool:
        """Megatron's nan iteration: skipped, with a NaN or infinite loss."""
        return self.skipped and any(not math.isfinite(v) for v in self.losses.values())


@dataclass
class TrainingSummary:
    """What `pretrain` did, for callers and tests."""

    start_iteration: int
    iteration: int
    history: list[IterationRecord] = field(default_factory=list)
    validation: list[tuple[object, dict[str, float]]] = field(default_factory=list)
    """(iteration, or "end/valid" / "end/test", reduced losses) of each evaluation."""
    checkpoints: list[str] = field(default_factory=list)
    stopped_by: Optional[str] = None
    """Why training stopped before --train-iters (--exit-interval, a signal, the duration)."""


def print_rank_0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: str) -> None:
    if is_last_rank():
        print(message, flush=True)


def is_dataset_built_on_rank() -> bool:
    """Whether this rank feeds data to any of its model chunks (first or last pipeline stage;
    every stage with packed documents)."""
    args = get_args()
    return any(model_setup.chunks_reading_data(args.pipeline_placement,
                                               model_setup.reads_data_on_every_stage(args)))


class _Run:
    """The state one call of `pretrain` carries through its loop."""

    def __init__(self, args: argparse.Namespace, forward_step_func: ForwardStep,
                 model: list, optimizer: Optional[MegatronOptimizer],
                 scheduler: Optional[OptimizerParamScheduler],
                 position: checkpointing.RunPosition, timers: Timers,
                 exits: ExitConditions) -> None:
        self.args = args
        self.exits = exits
        self.forward_step_func = forward_step_func
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.iteration = position.iteration
        self.consumed_train_samples = position.consumed_train_samples
        self.consumed_valid_samples = position.consumed_valid_samples
        self.schedule = ScheduleFunction(args, position.iteration, is_last_rank())
        self.memory = PeakMemory()
        self.timers = timers
        self.writers = ScalarWriters(args, enabled=is_last_rank())
        self.saves = AsyncSaves() if args.async_save else None
        self.profiler = Profiler(args, dist.get_rank(), is_last_rank())
        self.collection = ManualCollection(args)
        self.cost_model = ModelConfig.of_transformer_config(get_model_config(model[0]),
                                                            vocab_size=args.padded_vocab_size)
        self.summary = TrainingSummary(position.iteration, position.iteration)
        self._interval: list[tuple[IterationRecord, float]] = []

    # -- data --------------------------------------------------------------------------------
    def iterators(self, dataset: Optional[object], consumed_samples: int) -> list:
        """One MicroBatchIterator per model chunk that reads data, None for the others."""
        args = self.args
        eod = get_tokenizer().eod if args.reset_attention_mask else None
        return [MicroBatchIterator(dataset, args.micro_batch_size,
                                   parallel_state.get_data_parallel_rank(),
                                   parallel_state.get_data_parallel_world_size(),
                                   consumed_samples, eod) if reads else None
                for reads in model_setup.chunks_reading_data(
                    args.pipeline_placement, model_setup.reads_data_on_every_stage(args))]

    # -- one iteration -----------------------------------------------------------------------
    def _run_schedule(self, function: Callable, iterators: list, forward_only: bool) -> list:
        args = self.args
        return function(
            forward_step_func=self.forward_step_func, data_iterator=iterators,
            model=self.model, num_microbatches=args.num_micro_batches,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            forward_only=forward_only)

    def train_step(self, iterators: list) -> IterationRecord:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        learning_rate = self.optimizer.param_groups[0]["lr"]
        function = self.schedule.for_iteration(self.iteration + 1)
        with self.memory.measure():
            losses = self._run_schedule(function, iterators, forward_only=False)
        self._empty_unused_memory(1)
        if self.args.check_for_nan_in_loss_and_grad:
            self._check_numerics(losses)
        self.timers("optimizer", log_level=1).start(barrier=self.args.barrier_with_L1_time)
        update_successful, grad_norm, num_zeros = self.optimizer.step()
        self.timers("optimizer").stop()
        if update_successful:
            self.scheduler.step(increment=self.args.global_batch_size)
        self._empty_unused_memory(2)
        self.iteration += 1
        self.consumed_train_samples += self.args.global_batch_size
        return IterationRecord(self.iteration,
                               reduce_losses(losses, self.args.pipeline_placement),
                               None if grad_norm is None else float(grad_norm),
                               learning_rate, not update_successful,
                               None if num_zeros is None else int(num_zeros),
                               get_canonical_lr_for_logging(self.optimizer.param_groups))

    def _empty_unused_memory(self, level: int) -> None:
        """--empty-unused-memory-level at `level` or above: the caching allocator's unused
        blocks back to the device, at Megatron-LM's points (a no-op before CUDA is in use)."""
        if self.args.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()

    def _check_numerics(self, losses: list) -> None:
        """--check-for-nan-in-loss-and-grad, before the update (megatron/training/numerics.py)."""
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        rank = parallel_state.get_pipeline_model_parallel_rank()
        placement = self.args.pipeline_placement
        stages = [virtual_stage(placement, pp, rank, chunk) for chunk in range(len(self.model))]
        numerics.check_losses(losses, self.iteration + 1, max(stages))
        if not self.args.fp16:
            numerics.check_gradients(self.model, stages, self.iteration + 1)

    # -- reporting ---------------------------------------------------------------------------
    def record(self, record: IterationRecord, seconds: float) -> None:
        """Keep the iteration; write its scalars every --tensorboard-log-interval and the log
        line every --log-interval (collective: the params norm, the memory peaks, the timers)."""
        args = self.args
        self.summary.history.append(record)
        self.summary.iteration = record.iteration
        self._interval.append((record, seconds))
        scalars_due = self.writers.wanted and record.iteration % args.tensorboard_log_interval == 0
        line_due = record.iteration % args.log_interval == 0
        params_norm = params_l2_norm(self.model) if args.log_params_norm and (
            scalars_due or line_due) else None
        if scalars_due:
            self.writers.iteration(IterationScalars(
                record.logged_learning_rate, args.global_batch_size, record.losses,
                float(self.optimizer.get_loss_scale()) if args.log_loss_scale_to_tensorboard
                else None, record.grad_norm, record.num_zeros_in_grad, params_norm,
                args.world_size if args.log_world_size_to_tensorboard else None,
                torch.cuda.memory_stats() if args.log_memory_to_tensorboard and
                torch.cuda.is_available() else None), record.iteration)
        if line_due:
            self.log_interval(params_norm)

    def log_interval(self, params_norm: Optional[float]) -> None:
        """Emit one log line for the iterations since the last one (collective: gathers the
        per-stage memory peaks)."""
        args = self.args
        records = [r for r, _ in self._interval]
        seconds = sum(s for _, s in self._interval) / len(self._interval)
        stage_peaks = _peaks_per_stage(self.memory.take_bytes())
        self._interval = []
        counted = [r for r in records if not r.skipped and "lm loss" in r.losses]
        report = IntervalReport(
            iteration=self.iteration, train_iters=args.train_iters,
            consumed_samples=self.consumed_train_samples, seconds_per_iteration=seconds,
            learning_rate=records[-1].logged_learning_rate,
            global_batch_size=args.global_batch_size,
            lm_loss=(sum(r.losses["lm loss"] for r in counted) / len(counted)) if counted
            else None,
            loss_scale=float(self.optimizer.get_loss_scale()),
            grad_norm=records[-1].grad_norm, num_zeros_in_grad=records[-1].num_zeros_in_grad,
            params_norm=params_norm,
            skipped_iterations=sum(r.skipped for r in records),
            nan_iterations=sum(r.nan for r in records),
            throughput=throughput(self.cost_model, args.seq_length, args.global_batch_size,
                                  args.world_size, seconds),
            peak_memory_mb=[peak / 2**20 for peak in stage_peaks],
            memory_source=self.memory.source, log_throughput=args.log_throughput)
        print_rank_last(report.line())
        if args.log_timers_to_tensorboard:
            self.writers.timers(self.timers, LOGGED_TIMERS, self.iteration, len(records),
                                args.barrier_with_L1_time, bool(args.wandb_project))
        if args.timing_log_level > 0:   # collective: every rank's times, printed on the last
            timing = self.timers.get_all_timers_string(LOGGED_TIMERS, normalizer=len(records),
                                                       barrier=args.barrier_with_L1_time)
            if timing is not None:
                print_rank_last(timing)
        self.writers.training(report, args.log_throughput and args.log_timers_to_tensorboard)
        self.profiler.log_interval()

    # -- evaluation --------------------------------------------------------------------------
    def evaluate(self, iterators: list, where: str, split: str = "validation"
                 ) -> dict[str, float]:
        """--eval-iters global batches of `split`, forward only; prints Megatron's validation box
        and writes the TensorBoard scalars."""
        for chunk in self.model:
            chunk.eval()
        totals: list = []
        with torch.no_grad(), model_setup.parameters_gathered(self.model):
            for _ in range(self.args.eval_iters):
                totals.append(self._run_schedule(self.schedule.function, iterators,
                                                 forward_only=True))
                self._empty_unused_memory(1)
        for chunk in self.model:
            chunk.train()
        losses = reduce_losses([entry for batch in totals for entry in batch],
                               self.args.pipeline_placement)
        if "lm loss" in losses:
            for line in validation_lines(where, losses["lm loss"]):
                print_rank_last(line)
            if not self.args.skip_train:     # as Megatron-LM: an evaluation-only run writes none
                self.writers.evaluation(split, self.iteration, losses["lm loss"],
                                        self.args.log_validation_ppl_to_tensorboard)
        return losses

    # -- checkpoints -------------------------------------------------------------------------
    def save(self) -> None:
        """Save at this iteration; with --async-save, schedule the write (after publishing the
        pending one) and go on."""
        start, iteration = time.perf_counter(), self.iteration

        def published(folder: str) -> None:
            self.summary.checkpoints.append(folder)
            if self.saves is not None:
                print_rank_0(f"  saved checkpoint at iteration {iteration:7d} to {folder} "
                             f"(written in the background, published at iteration "
                             f"{self.iteration})")

        with model_setup.parameters_gathered(self.model):
            folder = checkpointing.save_checkpoint(
                self.args.save, self.model, self.optimizer, self.scheduler,
                checkpointing.RunPosition(iteration, self.consumed_train_samples,
                                          self.consumed_valid_samples), self.args,
                self.saves, published)
        seconds = time.perf_counter() - start
        print_rank_0(f"  saved checkpoint at iteration {iteration:7d} to {folder} in "
                     f"{seconds:.2f} s" if self.saves is None else
                     f"  scheduled an async checkpoint save at iteration {iteration:7d} to "
                     f"{self.args.save} in {seconds:.2f} s")

    def publish_saves(self, blocking: bool) -> None:
        """--async-save: publish the checkpoints every rank has written (collective)."""
        if self.saves is not None:
            self.saves.finalize(blocking)


LOGGED_TIMERS = [
    "forward-backward", "forward-compute", "backward-compute", "weight-grad-compute",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
    "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
    "optimizer-copy-main-to-model-params", "optimizer"]
"""megatron's timers printed after each log line with --timing-log-level 1 or 2 (level 2 adds the
executor's per-op compute timers); milliseconds per iteration, min and max over the ranks."""


def reduce_losses(losses: list, placement: str = "loop") -> dict[str, float]:
    """Megatron's report of the loss dicts one iteration returned on the last stage.

    Per-token entries (`[sum, count]`) are summed over micro-batches and DP x CP ranks (each CP
    rank holds 1/C of every span's tokens) and divided: the token mean of the global batch.
    Scalar entries are averaged over micro-batches and DP x CP ranks, as megatron does.
    Returns {} off the last pipeline rank. In a V (`placement` "vshape") the last stage is
    a chunk of pipeline rank 0: its figures are sent on to the last pipeline rank (collective
    over the pipeline group), which reports every run's losses (log line, writers, results).
    """
    if placement == "vshape":
        return _on_last_pipeline_rank(_reduced(losses)
                                      if parallel_state.is_pipeline_first_stage(
                                          ignore_virtual=True) else {})
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    return _reduced(losses)


def _on_last_pipeline_rank(reduced: dict[str, float]) -> dict[str, float]:
    """Pipeline rank 0's `reduced`, on pipeline rank 0 and the last one ({} on the others)."""
    group = parallel_state.get_pipeline_model_parallel_group()
    carried = [reduced]
    dist.broadcast_object_list(carried, group_src=0, group=group,
                               device=_collective_device())
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    return carried[0] if first or last else {}


def _reduced(losses: list) -> dict[str, float]:
    if not losses:
        return {}
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    reduced = {}
    for key in losses[0]:
        values = [torch.as_tensor(entry[key]).detach().float().view(-1) for entry in losses]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0)
            dist.all_reduce(total, group=group)
            reduced[key] = float(total[0] / total[1].clamp(min=1))
        else:
            total = torch.stack(values).mean(dim=0)
            dist.all_reduce(total, group=group)
            reduced[key] = float(total[0]) / dist.get_world_size(group)
    return reduced


def _collective_device() -> torch.device:
    """Where small tensors for collectives live: the device (NCCL refuses host tensors; under
    the CPU platform layer that device is the CPU, and strict mode checks it is asked for)."""
    return platform.compute_device()


def _peaks_per_stage(local_bytes: int) -> list[int]:
    """Every rank's peak gathered; the maximum over the ranks of each pipeline stage."""
    mine = torch.tensor([parallel_state.get_pipeline_model_parallel_rank(), local_bytes],
                        dtype=torch.int64, device=_collective_device())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    peaks = [0] * parallel_state.get_pipeline_model_parallel_world_size()
    for stage, peak in (tuple(int(v) for v in t.tolist()) for t in gathered):
        peaks[stage] = max(peaks[stage], peak)
    return peaks


def _train(run: _Run, train_iterators: list, valid_iterators: Optional[list]) -> bool:
    """The loop; returns whether it reached --train-iters (False: stopped early, saved with
    --save, the reason in run.summary.stopped_by)."""
    args = run.args
    saved_at = run.iteration       # a resumed run's starting point is saved already
    while run.iteration < args.train_iters:
        run.publish_saves(blocking=False)
        run.profiler.step()
        start = time.perf_counter()
        record = run.train_step(train_iterators)
        run.record(record, time.perf_counter() - start)
        run.schedule.finished(run.iteration)     # after the log line, outside the iteration's time
        iteration = run.iteration
        if valid_iterators is not None and args.eval_iters and iteration % args.eval_interval == 0:
            with run.collection.evaluation():
                run.summary.validation.append(
                    (iteration, run.evaluate(valid_iterators, f"iteration {iteration}")))
            run.consumed_valid_samples += args.eval_iters * args.global_batch_size
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            run.save()
            saved_at = iteration
        stop = run.exits.check()
        if stop is None and args.exit_interval and iteration % args.exit_interval == 0:
            stop = "--exit-interval"
        if stop is not None and iteration < args.train_iters:
            if args.save and saved_at != iteration:
                run.save()
            print_rank_0(f" exiting program at iteration {iteration} ({stop})")
            run.summary.stopped_by = stop
            return False
        run.collection.after_iteration(iteration)
    if args.save and saved_at != run.iteration:
        run.save()
    return True


def pretrain(args: argparse.Namespace, train_valid_test_datasets_provider: DatasetsProvider,
             model_provider: model_setup.ModelProvider,
             forward_step_func: ForwardStep) -> TrainingSummary:
    """Train a model from validated `args` (megatron.training.arguments.parse_and_validate_args).

    Collective: every rank of the torchrun / srun world calls it. Callable again in the same
    process (the process group is reused, parallel_state rebuilt).
    """
    exits = ExitConditions(args.exit_signal if args.exit_signal_handler else None,
                           args.exit_duration_in_mins)    # the signal is caught from here on
    try:
        set_global_variables(args)
        initialize_megatron(args)
        return _pretrain(args, train_valid_test_datasets_provider, model_provider,
                         forward_step_func, exits)
    finally:
        exits.release()
        finish_megatron()


def _pretrain(args: argparse.Namespace, datasets_provider: DatasetsProvider,
              model_provider: model_setup.ModelProvider,
              forward_step_func: ForwardStep, exits: ExitConditions) -> TrainingSummary:
    config = model_setup.core_transformer_config_from_args(args)
    print_rank_0(f"> training with {args.world_size} processes: TP={args.tensor_model_parallel_size}"
                 f" PP={args.pipeline_model_parallel_size} CP={args.context_parallel_size}"
                 f" DP={args.data_parallel_size}"
                 f" V={args.virtual_pipeline_model_parallel_size or 1}, schedule "
                 f"{args.pipeline_schedule} k={args.seq1f1b_splits} ({args.seq1f1b_partition}),"
                 f" span lengths {_first_span_lengths(args)},"
                 f" {args.num_micro_batches} micro-batches of {args.micro_batch_size}")
    timers = Timers(args.timing_log_level, args.timing_log_option)
    config.timers = timers                     # megatron's schedules, finalize and optimizer
    config.barrier_with_L1_time = args.barrier_with_L1_time
    model = model_setup.build_model(args, config, model_provider)
    if parallel_state.get_data_parallel_rank() == 0:
        print(f" > number of parameters on (tensor, pipeline) model parallel rank "
              f"({parallel_state.get_tensor_model_parallel_rank()}, "
              f"{parallel_state.get_pipeline_model_parallel_rank()}): "
              f"{sum(p.numel() for chunk in model for p in chunk.parameters())}", flush=True)
    optimizer, scheduler = None, None       # --skip-train builds none, as Megatron-LM
    if not args.skip_train:
        optimizer = model_setup.build_optimizer(args, config, model)
        scheduler = model_setup.build_lr_scheduler(args, optimizer)

    position = checkpointing.RunPosition()
    start = starting_point(args)
    if start is not None:
        position = checkpointing.load_checkpoint(start, model, optimizer, scheduler)
        print_rank_0(f" loaded checkpoint from {start.flag} {start.folder}"
                     + (" for fine-tuning (weights only)" if start.finetune else "")
                     + f"; starting at iteration {position.iteration}")
    elif args.load:
        print_rank_0(f" no checkpoint in --load {args.load}; starting from iteration 0")

    samples = train_valid_test_num_samples(args.train_iters, args.global_batch_size,
                                           args.eval_interval, args.eval_iters)
    if args.skip_train:      # one evaluation of each split, from its start (Megatron-LM)
        samples = (samples[0], samples[2], samples[2])
    train_ds, valid_ds, test_ds = datasets_provider(samples)
    has_train, has_valid, has_test = _splits_present((train_ds, valid_ds, test_ds))
    if not has_train and not args.skip_train:
        raise RuntimeError("the datasets provider returned no training dataset")
    run = _Run(args, forward_step_func, model, optimizer, scheduler, position, timers, exits)
    valid_iterators = run.iterators(valid_ds, 0 if args.skip_train else
                                    position.consumed_valid_samples) \
        if has_valid and args.eval_iters else None
    with run.collection.running():      # --manual-gc: the collector off to the end
        try:
            if args.skip_train:
                print_rank_0(" skipping training (--skip-train is on) ...")
                finished = True
            else:
                finished = _train(run, run.iterators(train_ds, position.consumed_train_samples),
                                  valid_iterators)
                run.publish_saves(blocking=True)   # an error leaves the pending one unpublished
        finally:
            run.profiler.stop()
        # Megatron-LM's end-of-training prefixes ("validation loss at iteration N on test set" too)
        if finished and valid_iterators is not None:
            run.summary.validation.append(
                ("end/valid", run.evaluate(valid_iterators,
                                           f"iteration {run.iteration} on validation set")))
        if finished and has_test and args.eval_iters:
            run.summary.validation.append(
                ("end/test", run.evaluate(run.iterators(test_ds, 0),
                                          f"iteration {run.iteration} on test set", split="test")))
    run.writers.close()
    return run.summary


def _first_span_lengths(args: argparse.Namespace) -> str:
    """The span lengths the first iteration runs: the cut the schedule function hands the
    runtime (the fit partition starts from the compute cut and prints its own after
    calibrating)."""
    return " ".join(map(str, starting_span_lengths(args)))


def _splits_present(datasets: Sequence[Optional[object]]) -> list[bool]:
    """Whether each split has data on some rank (ranks that feed no chunk build none), agreed
    by every rank so that all of them run the same evaluations."""
    present = torch.tensor([dataset is not None for dataset in datasets], dtype=torch.int64,
                           device=_collective_device())
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    return [bool(flag) for flag in present.tolist()]
