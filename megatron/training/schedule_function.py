"""The run's forward-backward function, and the training iterations it runs with a trace.

Built once from --pipeline-schedule and the --seq1f1b-* flags. Two flags have iterations traced
(every rank records its executor's actions, seconds from the iteration's start, with a barrier
before the iteration so that the ranks' clocks line up; seq1f1b/runtime/traced_iterations.py
gathers them):

- `--seq1f1b-partition fit`: this run's first --seq1f1b-fit-iterations iterations run the compute
  cut; then every rank gathers their traces and fits each span's measured F and B per token and
  per causal query-key pair (seq1f1b/plan/span_fit.py), the same fit everywhere, and the function
  switches to the cut balanced in that time for the rest of the run, evaluations included. The
  last rank logs the fit and the new boundaries in one line. A resumed run calibrates again over
  its own first iterations: the fit is not in the checkpoint, because times belong to the
  machines and the load that measured them (the cut changes the losses only by rounding). A run
  that stops before its calibration ends keeps the compute cut. A searched schedule under
  --schedule-memory-cap is placed with the model's FLOP durations first and re-placed with the
  fit's measured ones (schedule_budget.py) when the fitted cut takes over.
- `--timeline-path FILE.png`: iteration --timeline-iteration (default --train-iters, the last) is
  drawn from every pipeline rank's measured actions, in seconds of this run, with the actions as
  JSON beside it (FILE.json; seq1f1b/plan/render.py's `write_measured_timeline`), by the last
  rank. An iteration this run does not train (before a resume's start, after an early stop) is
  not drawn.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from megatron.training.schedule_budget import (cost_model, schedule_budget, searched,
                                              span_multiple)
from seq1f1b.plan import registry
from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.partition import span_bounds
from seq1f1b.runtime.forward_backward import SpanSettings, get_forward_backward_func
from seq1f1b.runtime.trace import ExecutionTrace
from seq1f1b.runtime.traced_iterations import calibrate_fit, gather_pipeline_actions


def span_settings(args: argparse.Namespace) -> SpanSettings:
    """The runtime's settings for the run's first iteration: its cut is `starting_span_lengths`
    (the log line's, the estimate's and a searched schedule's budget's), since it balances the
    same model, padded vocabulary included."""
    return SpanSettings(
        splits=args.seq1f1b_splits,
        partition="compute" if args.seq1f1b_partition == "fit" else args.seq1f1b_partition,
        span_lengths=tuple(args.seq1f1b_span_lengths) if args.seq1f1b_span_lengths else None,
        align=args.seq1f1b_span_alignment,
        p2p_timeout_s=args.p2p_timeout,
        budget=schedule_budget(args),
        loss_backward_in_forward=args.loss_backward_in_forward,
        cost_model=cost_model(args))


class ScheduleFunction:
    """This rank's forward-backward function through one run, and its traced iterations."""

    def __init__(self, args: argparse.Namespace, start_iteration: int, reports: bool) -> None:
        """`reports`: this rank prints the fit and writes the timeline (the last rank)."""
        self._args = args
        self._reports = reports
        fit = args.seq1f1b_partition == "fit"
        self._settings = span_settings(args)
        self.function: Callable = get_forward_backward_func(args.pipeline_schedule,
                                                            self._settings)
        self._check_placement()
        first = start_iteration + 1
        self._calibrating = range(first, first + args.seq1f1b_fit_iterations) if fit else range(0)
        self._calibration: list[ExecutionTrace] = []
        self._trace: Optional[ExecutionTrace] = None      # of the iteration running now
        self._timeline = args.timeline_iteration if args.timeline_path else None
        if self._timeline is not None and self._timeline <= start_iteration and reports:
            print(f" --timeline-iteration {self._timeline}: this run starts after it (at "
                  f"iteration {start_iteration}); no timeline is drawn", flush=True)

    def for_iteration(self, iteration: int) -> Callable:
        """The function training iteration `iteration` runs. Call it just before running the
        iteration: a traced one starts with a barrier (collective)."""
        if iteration not in self._calibrating and iteration != self._timeline:
            self._trace = None
            return self.function
        self._trace = ExecutionTrace()
        dist.barrier()
        return get_forward_backward_func(self._args.pipeline_schedule,
                                         replace(self._settings, trace=self._trace))

    def finished(self, iteration: int) -> None:
        """After training iteration `iteration` (collective when it was traced: the fit, the
        timeline)."""
        trace, self._trace = self._trace, None
        if trace is None:
            return
        if iteration in self._calibrating:
            self._calibration.append(trace)
            if iteration == self._calibrating[-1]:
                self._switch_to_fit()
        if iteration == self._timeline:
            self._draw(iteration, trace)

    def _plan(self) -> Schedule:
        """The plan this rank's function runs now (a searched one with its budget)."""
        args = self._args
        return registry.build(args.pipeline_schedule, args.pipeline_model_parallel_size,
                              args.num_micro_batches, args.seq1f1b_splits,
                              args.virtual_pipeline_model_parallel_size or 1,
                              budget=self._settings.budget)

    def _check_placement(self) -> None:
        """The model chunks were laid out for args.pipeline_placement (chosen at validation), with
        copies of the output layer when it chose to spread it: a searched plan must be placed so
        (pinned to it when re-placed); the others' placement is their name's."""
        if not searched(self._args.pipeline_schedule):
            return
        plan = self._plan()
        if plan.placement != self._args.pipeline_placement:
            raise RuntimeError(f"--pipeline-schedule {self._args.pipeline_schedule}: the plan "
                               f"is placed {plan.placement}, the model chunks "
                               f"{self._args.pipeline_placement}")
        if plan.spread_output != self._args.pipeline_spread_output:
            raise RuntimeError(f"--pipeline-schedule {self._args.pipeline_schedule}: the plan "
                               f"{'spreads' if plan.spread_output else 'keeps'} the output "
                               "layer, the model chunks were built the other way")

    def _switch_to_fit(self) -> None:
        args = self._args
        lengths, fit = calibrate_fit(self._plan(), self._calibration, args.seq_length,
                                     args.tensor_model_parallel_size, args.sequence_parallel,
                                     span_multiple(args))
        self._calibration = []
        self._settings = replace(self._settings, partition="explicit", span_lengths=lengths,
                                 budget=schedule_budget(args, lengths, fit))
        self.function = get_forward_backward_func(args.pipeline_schedule, self._settings)
        self._check_placement()
        if self._reports:
            spans = " ".join(f"[{start}, {end})" for start, end in span_bounds(list(lengths)))
            print(f" fit partition from iterations {self._calibrating[0]}-"
                  f"{self._calibrating[-1]}: {fit.describe()}; span lengths "
                  f"{' '.join(map(str, lengths))}: {spans}", flush=True)

    def _draw(self, iteration: int, trace: ExecutionTrace) -> None:
        ranks = gather_pipeline_actions([trace])[0]
        if not self._reports:
            return
        from seq1f1b.plan.render import write_measured_timeline   # matplotlib: only when drawing

        path = Path(self._args.timeline_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        png, actions = write_measured_timeline(self._plan(), ranks, list(trace.span_bounds),
                                               iteration, path)
        print(f" measured timeline of iteration {iteration} written to {png} (actions: "
              f"{actions})", flush=True)
