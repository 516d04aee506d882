"""A searched schedule's budget (`--pipeline-schedule seq1f1b-zb-auto --schedule-memory-cap`)
from the run's flags.

Torch-free on purpose: validation places the schedule once, so that a cap no order of F, B and W
fits is refused in one line before any process group starts; the schedule function places it
for the run with the same inputs (and re-places it with the fit partition's measured times once
they are in, schedule_function.py). Every rank computes the same budget from the same flags.
"""
from __future__ import annotations

import argparse
from typing import Optional

from seq1f1b.plan import registry
from seq1f1b.plan.actions import Schedule, ScheduleError
from seq1f1b.plan.bounds import gap_to_bound
from seq1f1b.plan.budget import (MemoryCap, RunShape, ScheduleBudget, run_budget,
                                 searched_lower_bound, spreads_output)
from seq1f1b.plan.context_parallel import span_alignment
from seq1f1b.plan.costs import ModelConfig, Recompute
from seq1f1b.plan.layout_search import LayoutSearch, search_layout
from seq1f1b.plan.partition import partition
from seq1f1b.plan.schedules.zero_bubble_v import searched_cap
from seq1f1b.plan.simulate import simulate
from seq1f1b.plan.span_fit import SpanTimeFit
from seq1f1b.plan.stage_layers import StageLayers


def cost_model(args: argparse.Namespace) -> ModelConfig:
    """The run's model as the cost model sees it (validated args, padded vocabulary)."""
    return ModelConfig.of_flags(args, vocab_size=args.padded_vocab_size)


def starting_span_lengths(args: argparse.Namespace) -> tuple[int, ...]:
    """The cut the run starts with (a fit partition starts with the compute cut), as the runtime
    makes it: this model's FLOPs, every span a multiple of --seq1f1b-span-alignment and of CP
    (of CP x TP under sequence parallelism)."""
    method = "compute" if args.seq1f1b_partition == "fit" else args.seq1f1b_partition
    return tuple(partition(args.seq_length, args.seq1f1b_splits, method, cost_model(args),
                           tp=args.tensor_model_parallel_size,
                           sequence_parallel=args.sequence_parallel,
                           align=span_multiple(args), lengths=args.seq1f1b_span_lengths))


def span_multiple(args: argparse.Namespace) -> int:
    """What every span of the run is a multiple of: --seq1f1b-span-alignment and CP (CP x TP
    under sequence parallelism), for the cut it starts with and the cut a fit makes."""
    return span_alignment(getattr(args, "context_parallel_size", 1) or 1,
                          args.tensor_model_parallel_size, args.sequence_parallel,
                          args.seq1f1b_span_alignment)


def schedule_budget(args: argparse.Namespace, lengths: Optional[tuple[int, ...]] = None,
                    fit: Optional[SpanTimeFit] = None,
                    stage_layers: Optional[StageLayers] = None,
                    cap: Optional[MemoryCap] = None) -> Optional[ScheduleBudget]:
    """A searched schedule's budget with the spans `lengths` (default: the cut the run starts
    with): the model's FLOP durations and bytes, durations from `fit` when given, under `cap`,
    --schedule-memory-cap or the schedule's default cap (None for a schedule that is not
    searched); the stages' layers `stage_layers` (default: the flags')."""
    if not searched(args.pipeline_schedule):
        return None
    shape = RunShape(cost_model(args), args.seq_length, lengths or starting_span_lengths(args),
                     tp=args.tensor_model_parallel_size,
                     sequence_parallel=args.sequence_parallel,
                     micro_batch_size=args.micro_batch_size,
                     bytes_per_element=4 if args.params_dtype == "float32" else 2,
                     recompute=Recompute.from_flags(args.recompute_granularity,
                                                    args.recompute_method,
                                                    args.recompute_num_layers),
                     stage_layers=stage_layers or StageLayers.of_flags(args),
                     cp=getattr(args, "context_parallel_size", 1) or 1,
                     loss_backward_in_forward=args.loss_backward_in_forward,
                     spread_output=getattr(args, "spread_output", False))
    budget = run_budget(args.pipeline_schedule, args.pipeline_model_parallel_size,
                        args.num_micro_batches, args.virtual_pipeline_model_parallel_size or 1,
                        cap or (MemoryCap.parse(args.schedule_memory_cap)
                                if args.schedule_memory_cap else None), shape, fit)
    if lengths is not None and getattr(args, "pipeline_placement", None):
        # the model chunks are laid out for it (with copies of the output layer, or without)
        return budget.pinned(args.pipeline_placement, args.pipeline_spread_output)
    return budget


def searched_layout(args: argparse.Namespace) -> LayoutSearch:
    """--search-layout: every virtual stage's decoder layers chosen with seq1f1b-zb-auto on two
    chunks per rank, by the procedure `plan.py search --search-layout` runs
    (layout_search.search_layout) on this run's budgets: the flags' cap for the even split,
    the cap in bytes the even split's search placed under for every other layout.
    ScheduleError where no order fits."""

    def budget_of(split: Optional[StageLayers], cap: Optional[float]) -> ScheduleBudget:
        return schedule_budget(args, stage_layers=split,
                               cap=None if cap is None else MemoryCap(cap, False))

    return search_layout(args.pipeline_schedule, args.pipeline_model_parallel_size,
                         args.num_micro_batches, args.seq1f1b_splits, args.num_layers, budget_of)


def placement_report(schedule: Schedule, budget: ScheduleBudget) -> str:
    """What a searched schedule chose, in one line: its placement, simulated bubble, how far
    its makespan is above the lower bound of every placement it could take (plan.py search's
    "gap"), and the fullest rank's held bytes against the cap."""
    report = simulate(schedule, budget.costs_for(schedule.placement, schedule.spread_output))
    cap = searched_cap(schedule.pp, schedule.microbatches, schedule.splits, schedule.chunks,
                       budget)
    layout = {"vshape": "a V of two chunks per rank", "loop": "a loop of "
              f"{schedule.chunks} chunk{'s' if schedule.chunks > 1 else ''} per rank"}
    peak = max(rank.peak_held_bytes for rank in report.ranks)
    output = ("" if not any(spreads_output(costs) for _, costs in budget.options()) else
              ", the output layer spread over the ranks" if schedule.spread_output else
              ", the output layer kept in the last stage (shorter here)")
    gap = gap_to_bound(report.makespan, searched_lower_bound(schedule, budget, cap))
    return (f"placed on {layout[schedule.placement]}{output}, simulated bubble "
            f"{report.bubble_ratio:.1%} on the model's FLOPs ({gap:.1%} above the lower bound), "
            f"peak held {_size(peak)} per rank under a cap of {_size(cap)}")


def _size(count: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count:.0f} B"


def searched(name: str) -> bool:
    """Whether --pipeline-schedule `name` is placed by a search (megatron's own are not)."""
    try:
        return registry.get(name).searched
    except ScheduleError:           # megatron-core's own schedules: not in the registry
        return False
