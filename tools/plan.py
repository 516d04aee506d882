#!/usr/bin/env python3
"""Inspect pipeline plans without running a model.

  plan.py show      --schedule seq1f1b --pp 4 --microbatches 8 --splits 2
  plan.py partition --seq-length 65536 --splits 4 --method compute --model 7b --tp 2 \\
                    --sequence-parallel
  plan.py simulate  --schedule seq1f1b --pp 4 --microbatches 8 --splits 4 --uniform-cost 1 2 \\
                    --plot timeline.png --trace trace.json
  plan.py memory    --schedule seq1f1b --pp 4 --microbatches 32 --splits 4 --model 7b \\
                    --seq-length 65536 --tp 8 --sequence-parallel --partition compute \\
                    --distributed-optimizer --gpu-memory 79.25 --recompute-granularity full
  plan.py comm      --schedule seq1f1b --pp 4 --microbatches 8 --splits 2
  plan.py show      --schedule seq1f1b-zbv --pp 4 --microbatches 8 --splits 2 --chunks 2 \
                    --csv > mine.csv      (edit it, then: plan.py simulate|comm|show
                                           --pipeline-schedule-file mine.csv ...)
  plan.py search    --pp 4 --microbatches 8 --splits 2 --uniform-cost 1 1.5 0.5 --exact \
                    --save-schedule best.csv      (train it: --pipeline-schedule-file best.csv)
  plan.py compare   --pp 4 --microbatches 8 --model 7b --seq-length 65536 --tp 8 \
                    --sequence-parallel --partition compute
  plan.py tune      --model 7b --seq-length 131072 --gpus 32 --gpu-memory 80GiB --top 10 \
                    --emit-sbatch tuned.sbatch      (which layout to launch: docs/planner.md)

Every subcommand takes --json for other tools. Bad arguments print one line on stderr and exit 2;
`comm` exits 1 when the communication would deadlock or mismatch under NCCL's rules.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from typing import NamedTuple, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from seq1f1b.writable import check_output_file  # noqa: E402
from seq1f1b.model_flags import (COST_FLAGS, LOSS_BACKWARD_IN_FORWARD_HELP,  # noqa: E402
                                 add_model_shape_args, model_of_flags, sizes_error)
from seq1f1b.plan import registry, schedule_file  # noqa: E402
from seq1f1b.plan.actions import Schedule, ScheduleError, placement_words  # noqa: E402
from seq1f1b.plan.budget import (NOMINAL_FLOPS_PER_SECOND, MemoryCap, ScheduleBudget,  # noqa: E402
                                 model_budget, resolve_budget, searched_lower_bound,
                                 searched_placements, with_output_spread)
from seq1f1b.plan.calibration import CalibrationError, read_device_check  # noqa: E402
from seq1f1b.plan.costs import (PRESETS, RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS,  # noqa: E402
                                ModelConfig)
from seq1f1b.plan.communication import SEND, communication_plan  # noqa: E402
from seq1f1b.plan.context_parallel import check_heads, span_alignment  # noqa: E402
from seq1f1b.plan.memory import (FRAMEWORK_OVERHEAD_GIB, GIB, MEGATRON_PLANS,  # noqa: E402
                                 PRECISIONS, MemoryEstimate, TrainingSetup, estimate_memory)
from seq1f1b.plan.nccl import MODES, validate_modes  # noqa: E402
from seq1f1b.plan.partition import imbalance, partition, span_bounds, span_flops  # noqa: E402
from seq1f1b.plan.span_fit import SpanTimeFit, fit_span_times, read_span_timings  # noqa: E402
from seq1f1b.plan.projection import A100  # noqa: E402
from seq1f1b.plan.tune.space import LOSS_IN_FORWARD_CHOICES  # noqa: E402
from seq1f1b.plan.stage_layers import (FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG,  # noqa: E402
                                       StageLayers)
from seq1f1b.plan.layout_search import LayoutSearch, search_layout  # noqa: E402
from seq1f1b.plan.simulate import (SimulationReport, SpanCosts, model_costs,  # noqa: E402
                                   simulate, uniform_costs)
from seq1f1b.plan.schedules.greedy import Problem, unit_costs  # noqa: E402
from seq1f1b.plan.schedules.zero_bubble_v import searched_cap  # noqa: E402
from seq1f1b.plan.search_progress import shown  # noqa: E402
from seq1f1b.plan.bounds import gap_to_bound, lower_bound  # noqa: E402
from seq1f1b.plan.exact import solve  # noqa: E402
from seq1f1b.plan.rank_bound import rank_bound  # noqa: E402
from seq1f1b.schedule_compare import UNIT, CostModel, compare  # noqa: E402

A100_BF16_TFLOPS = NOMINAL_FLOPS_PER_SECOND / 1e12
"""The default rate: an A100's bf16 peak, the one pretrain_gpt.py searches on (budget.py)."""


class UsageError(Exception):
    """Bad command line: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:      # argparse prints usage + message; we want one line
        raise UsageError(message)


def _add_schedule_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", choices=registry.names(), metavar="NAME",
                        help=f"one of: {', '.join(registry.names())}")
    parser.add_argument("--pipeline-schedule-file", metavar="FILE.csv",
                        help="instead of --schedule: the schedule in this file (one row per "
                             "rank; seq1f1b/plan/schedule_file.py), checked before use; P, m, k "
                             "and V are the file's")
    parser.add_argument("--pp", type=int, help="pipeline stages P (required with --schedule)")
    parser.add_argument("--microbatches", type=int,
                        help="micro-batches m (required with --schedule)")
    parser.add_argument("--splits", type=int, help="spans per micro-batch k (default 1)")
    parser.add_argument("--chunks", type=int, help="model chunks per rank V (default 1)")
    _add_cap_arg(parser)


def _add_cap_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule-memory-cap", metavar="CAP",
                        help="searched schedules (seq1f1b-zb-auto): per-rank cap on held "
                             "activations and K/V, bytes (17GiB) or a fraction of 1F1B's rank-0 "
                             "peak (0.5x); needs a model for bytes")


def _add_problem_args(parser: argparse.ArgumentParser, cost_help: str) -> None:
    """What search and compare share: the problem, its costs (uniform or a model), --json."""
    parser.add_argument("--pp", type=int, required=True, help="pipeline stages P")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches m")
    parser.add_argument("--splits", type=int, default=1, help="spans per micro-batch k")
    parser.add_argument("--uniform-cost", type=float, nargs=3, metavar=("F", "B", "W"),
                        help=cost_help)
    parser.add_argument("--device-tflops", type=float, default=A100_BF16_TFLOPS)
    _add_span_args(parser, "--partition")
    _add_model_args(parser)
    parser.add_argument("--json", action="store_true")


def _add_spread_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--spread-output", action="store_true",
                        help=what + ": the layer need not load the last stage's rank alone "
                                    "(pretrain_gpt.py trains it: --pipeline-schedule "
                                    "seq1f1b-zb-auto --spread-output, or the saved order)")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (a preset or its dimensions)")
    group.add_argument("--model", type=str.lower, choices=list(PRESETS), metavar="NAME",
                       help=f"the paper's configs: {', '.join(PRESETS)}")
    add_model_shape_args(group, COST_FLAGS, required=" (without --model)",
                         **{name: None for name in COST_FLAGS})
    group.add_argument("--vocab-size", type=int)


def _add_stage_layer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("uneven stages (seq1f1b/plan/stage_layers.py)")
    group.add_argument(FIRST_FLAG, type=int, metavar="N", dest="first_stage_layers",
                       help="decoder layers of the first stage (a loop: of pipeline rank 0; a "
                            "V: of virtual stage 0, the embedding's); the others share the rest")
    group.add_argument(LAST_FLAG, type=int, metavar="N", dest="last_stage_layers",
                       help="decoder layers of the last stage (a loop: of pipeline rank P-1; a "
                            "V: of virtual stage 2P-1, the output layer's, on rank 0)")
    group.add_argument(LAYOUT_FLAG, metavar="LAYOUT", dest="layout",
                       help="every virtual stage's layers, megatron's string form in stage "
                            "order (a V: stage 2P-1 is rank 0's chunk 1), e.g. "
                            "'Et*3|t*5|t*5|t*3L'")


def _stage_layers(args: argparse.Namespace) -> StageLayers:
    return StageLayers.of_flags(argparse.Namespace(
        decoder_first_pipeline_num_layers=args.first_stage_layers,
        decoder_last_pipeline_num_layers=args.last_stage_layers,
        pipeline_model_parallel_layout=args.layout))


def _add_span_args(parser: argparse.ArgumentParser, method_flag: str) -> None:
    parser.add_argument("--seq-length", type=int, required=method_flag == "--method")
    parser.add_argument(method_flag, dest="method", default="even",
                        choices=["even", "compute", "fit", "explicit"],
                        help="even lengths, equal FLOPs, equal measured time (fit: with "
                             "--calibration), or --span-lengths")
    parser.add_argument("--span-lengths", type=int, nargs="+", help="with the explicit method")
    parser.add_argument("--calibration", metavar="FILE.json",
                        help="measured span times for the fit method: device_check.py's "
                             "device_check.json or benchmark.py --json output")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="spans must then be multiples of --tp")
    parser.add_argument("--align", type=int, default=1, help="spans are multiples of this")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel size C (Ulysses all-to-all around the span "
                             "attention): spans are multiples of C, each rank holds 1/C of them")


def _model(args: argparse.Namespace) -> ModelConfig | None:
    try:
        model = model_of_flags(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if model is not None and getattr(args, "cp", 1) != 1:
        check_heads(model.num_attention_heads, model.num_query_groups, args.tp, args.cp, "--cp")
    return model


def _time_fit(args: argparse.Namespace) -> SpanTimeFit | None:
    """The fit method's span costs (a --calibration without it: check_common_flags)."""
    if args.method != "fit":
        return None
    if args.calibration is None:
        raise UsageError("the fit method needs --calibration FILE (measured span times)")
    return fit_span_times(read_span_timings(args.calibration))


def _spans(args: argparse.Namespace, model: ModelConfig | None, splits: int) -> list[int]:
    return partition(args.seq_length, splits, args.method, model, tp=args.tp,
                     sequence_parallel=args.sequence_parallel,
                     align=span_alignment(args.cp, args.tp, args.sequence_parallel, args.align),
                     lengths=args.span_lengths, fit=_time_fit(args))


def _schedule(args: argparse.Namespace, costs_of=None, uniform=None):
    """The schedule of the command line (--schedule, or --pipeline-schedule-file's). A searched
    one is searched on the run's costs: the model's (`costs_of(schedule, whole)`), else
    --uniform-cost's (`uniform`: F B W, bytes as unit costs count them), else unit costs; under
    --schedule-memory-cap or its default cap. Which costs and cap it used goes to stderr
    (stdout may be JSON)."""
    loaded = _loaded_or_named(args)
    if loaded is not None:
        return loaded
    if not registry.get(args.schedule).searched:
        if args.schedule_memory_cap:
            raise UsageError(f"--schedule-memory-cap: schedule {args.schedule} is not searched")
        return registry.build(args.schedule, args.pp, args.microbatches, args.splits,
                              args.chunks)
    return registry.build(args.schedule, args.pp, args.microbatches, args.splits, args.chunks,
                          budget=_search_budget(args, costs_of, uniform))


def _loaded_or_named(args: argparse.Namespace):
    """--pipeline-schedule-file's checked schedule (its P, m, k and V become the command
    line's), or None for --schedule NAME once its --pp and --microbatches are given (k and V
    default to 1)."""
    if args.pipeline_schedule_file is not None:
        return _file_schedule(args)
    if args.schedule is None:
        raise UsageError("--schedule NAME or --pipeline-schedule-file FILE is required")
    for flag in ("pp", "microbatches"):
        if getattr(args, flag) is None:
            raise UsageError(f"--{flag} is required with --schedule")
    args.splits = 1 if args.splits is None else args.splits
    args.chunks = 1 if args.chunks is None else args.chunks
    return None


def _search_budget(args: argparse.Namespace, costs_of, uniform) -> ScheduleBudget:
    """The searched schedule's costs and cap (see _schedule), said on stderr."""
    registry.check_sizes(args.pp, args.microbatches, args.splits, args.chunks)
    cap = MemoryCap.parse(args.schedule_memory_cap) if args.schedule_memory_cap else None
    if costs_of is not None:
        budget = model_budget(args.schedule, args.pp, args.microbatches, args.splits,
                              args.chunks, cap, costs_of)
        source = "the model's costs"
    else:
        budget = resolve_budget(cap, None, None, args.pp, args.splits)
        source = "unit costs"
        if uniform is not None:
            shape = registry.shape(args.schedule, args.pp, args.microbatches, args.splits,
                                   args.chunks)
            budget = ScheduleBudget(_uniform_with_bytes(shape, uniform), budget.cap)
            source = "the --uniform-cost costs"
    own = "seq1f1b-zbv's" if args.chunks == 2 else "seq1f1b's"
    limit = (f"{own} peak on them" if budget.cap is None
             else f"{budget.cap / GIB:.2f} GiB" if costs_of is not None
             else f"{budget.cap:g} units")
    print(f"plan.py: {args.schedule} searched on {source}, memory cap {limit}, on "
          f"{' or '.join(searched_placements(args.schedule, args.chunks))}", file=sys.stderr)
    if budget.costs is None:
        shape = registry.shape(args.schedule, args.pp, args.microbatches, args.splits,
                               args.chunks)
        budget = ScheduleBudget(unit_costs(Problem(shape.pp, shape.microbatches, shape.splits,
                                                   shape.chunks, shape.placement)), budget.cap)
    if costs_of is None:     # unit and uniform costs are alike on every stage, so any placement
        budget = replace(budget, alternatives=tuple(
            (placement, budget.costs) for placement in
            searched_placements(args.schedule, args.chunks)[1:]))
    return budget


def _uniform_with_bytes(shape, uniform: list[float]) -> SpanCosts:
    """--uniform-cost's durations with unit costs' bytes (a span holds 1/V unit on a chunk)."""
    if len(uniform) != 3:
        raise UsageError(f"--uniform-cost: {shape.name} splits the backward; give F B W")
    costs = unit_costs(Problem(shape.pp, shape.microbatches, shape.splits, shape.chunks,
                               shape.placement))
    timed = uniform_costs(shape, *uniform)
    return replace(costs, forward=timed.forward, backward=timed.backward, weight=timed.weight)


def _file_schedule(args: argparse.Namespace):
    """--pipeline-schedule-file: the file's checked schedule; the shape flags, when given, must
    be the file's."""
    if args.schedule is not None:
        raise UsageError("--pipeline-schedule-file replaces --schedule: give one of them")
    if args.schedule_memory_cap is not None:
        raise UsageError("--schedule-memory-cap: a schedule file is not searched")
    schedule = schedule_file.load(args.pipeline_schedule_file)
    schedule_file.check_shape(schedule, {"--pp": args.pp, "--microbatches": args.microbatches,
                                         "--splits": args.splits, "--chunks": args.chunks})
    args.schedule, args.pp, args.microbatches, args.splits, args.chunks = (
        schedule.name, schedule.pp, schedule.microbatches, schedule.splits, schedule.chunks)
    return schedule


def cmd_show(args: argparse.Namespace) -> None:
    schedule = _schedule(args)
    if args.csv:
        print(schedule_file.write(schedule), end="")
    elif args.json:
        print(json.dumps({"schedule": schedule.name, "pp": schedule.pp,
                          "microbatches": schedule.microbatches, "splits": schedule.splits,
                          "chunks": schedule.chunks,
                          "ranks": [schedule.format_rank(r) for r in range(schedule.pp)]}))
    else:
        print(schedule.to_text())


def cmd_partition(args: argparse.Namespace) -> None:
    model = _model(args)
    spans = _spans(args, model, args.splits)
    out: dict = {"spans": spans}
    if model is not None:
        flops = span_flops(model, spans)
        out.update(flops=flops, imbalance=imbalance(flops))
    fit = _time_fit(args)
    if fit is not None:
        seconds = [sum(fit.span_seconds(start, end)) for start, end in span_bounds(spans)]
        out.update(fit=fit.describe(), fitted_seconds=seconds, time_imbalance=imbalance(seconds))
    if args.json:
        print(json.dumps(out))
        return
    print("spans: " + " ".join(map(str, spans)))
    if model is not None:
        total = sum(out["flops"])
        print("FLOP shares: " + " ".join(f"{f / total:.3f}" for f in out["flops"]))
        print(f"imbalance (max/mean): {out['imbalance']:.4f}")
    if fit is not None:
        print(f"fit: {out['fit']}")
        print("fitted F+B seconds: " + " ".join(f"{t:.4g}" for t in seconds))
        print(f"time imbalance (max/mean): {out['time_imbalance']:.4f}")


def cmd_simulate(args: argparse.Namespace) -> None:
    model = _model(args)
    if (args.uniform_cost is None) == (model is None):
        raise UsageError("--uniform-cost F B [W] or a model (--model or its dimensions) is "
                         "required, not both")
    if model is not None and args.seq_length is None:
        raise UsageError("--seq-length is required with a model")
    if model is None and args.loss_backward_in_forward:
        raise UsageError("--loss-backward-in-forward needs a model (--model or its dimensions): "
                         "uniform costs have no output layer to move")

    def costs_of(schedule, whole: bool):
        spans = [args.seq_length] if whole else _spans(args, model, schedule.splits)
        return model_costs(schedule, model, spans, flops_per_second=args.device_tflops * 1e12,
                           tp=args.tp, sequence_parallel=args.sequence_parallel,
                           stage_layers=_stage_layers(args).for_reference() if whole
                           else _stage_layers(args), cp=args.cp,
                           loss_backward_in_forward=args.loss_backward_in_forward and not whole,
                           spread_output=schedule.spread_output and not whole)

    if args.uniform_cost is not None and len(args.uniform_cost) not in (2, 3):
        raise UsageError("--uniform-cost takes two or three numbers: F B [W]")
    schedule = _schedule(args, costs_of if model is not None else None, args.uniform_cost)
    if model is None and _stage_layers(args).uneven:
        raise UsageError(f"{FIRST_FLAG} / {LAST_FLAG} / {LAYOUT_FLAG} need a model (--model or "
                         "its dimensions)")
    if args.output_cost is not None and (args.uniform_cost is None
                                         or not schedule.spread_output):
        raise UsageError("--output-cost: only with --uniform-cost, for a schedule with O actions "
                         "(a model prices them itself)")
    if args.uniform_cost is not None:
        costs = uniform_costs(schedule, *args.uniform_cost, output=args.output_cost)
        unit, microseconds = "", 1.0
    else:
        if args.seq_length is None:
            raise UsageError("--seq-length is required with a model")
        costs = costs_of(schedule, False)
        unit, microseconds = "s", 1e6
    report = simulate(schedule, costs, args.p2p_latency)
    if args.plot or args.trace:
        from seq1f1b.plan import render     # matplotlib only when a picture is asked for
        if args.plot:
            render.plot_timeline(report, args.plot, unit)
        if args.trace:
            render.write_chrome_trace(report, args.trace, microseconds)
    if args.json:
        print(json.dumps(report.to_dict(timeline=args.timeline)))
    else:
        _print_report(report, unit)


def _print_report(report: SimulationReport, unit: str) -> None:
    suffix = f" {unit}" if unit else ""
    print(f"{report.schedule}: P={report.pp} m={report.microbatches} k={report.splits} "
          f"V={report.chunks}  makespan {report.makespan:.6g}{suffix}  "
          f"bubble {report.bubble_ratio:.2%}")
    with_bytes = report.ranks and report.ranks[0].peak_activation_bytes is not None
    header = f"{'rank':>4} {'busy':>10} {'idle':>10} {'live spans':>10}"
    print(header + (f" {'act GiB':>9} {'KV GiB':>8}" if with_bytes else ""))
    for rank in report.ranks:
        line = (f"{rank.rank:>4} {rank.busy:>10.4g} {rank.idle:>10.4g} "
                f"{rank.peak_live_spans:>10}")
        if with_bytes:
            line += (f" {rank.peak_activation_bytes / 2**30:>9.2f}"
                     f" {rank.peak_kv_cache_bytes / 2**30:>8.2f}")
        print(line)


def cmd_memory(args: argparse.Namespace) -> None:
    model = _model(args)
    if model is None:
        raise UsageError("a model is required: --model or its dimensions")
    if args.seq_length is None:
        raise UsageError("--seq-length is required")
    if not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        raise UsageError(f"--gpu-memory must be a finite positive number, got {args.gpu_memory}")
    if args.align != 1:
        raise UsageError("--align: memory cuts spans as pretrain_gpt.py does (multiples of --tp "
                         "with --sequence-parallel and of --cp), which takes no --align")
    schedule = _loaded_or_named(args)
    if args.spread_output and schedule is not None:
        raise UsageError("--spread-output: a --pipeline-schedule-file has its O actions or not; "
                         "drop the flag")
    setup = TrainingSetup(
        model=model, seq_length=args.seq_length, schedule=args.schedule, pp=args.pp,
        microbatches=args.microbatches, splits=args.splits, chunks=args.chunks, tp=args.tp,
        dp=args.dp, cp=args.cp, micro_batch_size=args.micro_batch_size,
        sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.distributed_optimizer,
        # fit: the measured cut, handed over as explicit lengths
        partition="explicit" if args.method == "fit" else args.method,
        span_lengths=(tuple(_spans(args, model, args.splits)) if args.method == "fit"
                      else tuple(args.span_lengths) if args.span_lengths else None),
        precision=args.precision, overhead_gib=args.overhead_gb,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        schedule_memory_cap=args.schedule_memory_cap,
        decoder_first_pipeline_num_layers=args.first_stage_layers,
        decoder_last_pipeline_num_layers=args.last_stage_layers,
        pipeline_model_parallel_layout=args.layout,
        loss_backward_in_forward=args.loss_backward_in_forward,
        spread_output=args.spread_output)
    calibration = read_device_check(args.device_check) if args.device_check else None
    reserve = calibration.reserve_ratio if calibration and calibration.reserve_ratio else 1.0
    estimate = estimate_memory(setup, schedule=schedule)
    if args.json:
        print(json.dumps(estimate.to_dict(args.gpu_memory, reserve)))
    else:
        _print_memory(estimate, args.gpu_memory, reserve)


_MEMORY_COLUMNS = (("params", lambda s: s.parameter_bytes), ("grads", lambda s: s.gradient_bytes),
                   ("optim", lambda s: s.optimizer_bytes_replicated),
                   ("optim/DP", lambda s: s.optimizer_bytes_sharded),
                   ("activ", lambda s: s.activation_bytes), ("KV", lambda s: s.kv_cache_bytes),
                   ("logits", lambda s: s.logits_bytes), ("workspace", lambda s: s.workspace_bytes),
                   ("overhead", lambda s: s.overhead_bytes), ("TOTAL", lambda s: s.total_bytes))


def _print_memory(estimate: MemoryEstimate, gpu_memory_gib: float, reserve: float) -> None:
    setup = estimate.setup
    print(f"{setup.schedule}: P={setup.pp} m={setup.microbatches} k={setup.splits} "
          f"V={setup.chunks} TP={setup.tp}{' (SP)' if setup.sequence_parallel else ''} "
          f"CP={setup.cp} DP={setup.dp} L={setup.seq_length} spans {' '.join(map(str, estimate.span_lengths))} "
          f"{setup.precision}, distributed optimizer "
          f"{'on' if setup.distributed_optimizer else 'off'}, "
          f"{setup.recompute.describe() if setup.recompute else 'no activation recompute'}; "
          "GiB per GPU")
    print(f"{'rank':>4} {'spans':>5} " + " ".join(f"{name:>9}" for name, _ in _MEMORY_COLUMNS))
    for stage in estimate.stages:
        print(f"{stage.rank:>4} {stage.peak_live_spans:>5} "
              + " ".join(f"{get(stage) / GIB:>9.2f}" for _, get in _MEMORY_COLUMNS))
    verdict = "fits" if estimate.fits(gpu_memory_gib, reserve) else "OOM"
    reserved = ("" if reserve == 1.0 else f", {estimate.reserved_peak_bytes(reserve) / GIB:.2f} "
                f"GiB reserved at the measured reserved/allocated {reserve:.3f}")
    print(f"peak {estimate.peak_bytes / GIB:.2f} GiB{reserved} of {gpu_memory_gib:g} GiB: "
          f"{verdict} (TOTAL counts optim/DP only with --distributed-optimizer)")


def cmd_comm(args: argparse.Namespace) -> int:
    schedule = _schedule(args)
    plan = communication_plan(schedule)
    modes = MODES if args.mode == "both" else (args.mode,)
    verdicts = validate_modes(plan, modes)
    show = schedule.chunks > 1

    ranks = [[{"after": None if g.point < 0 else rank.actions[g.point].format(show),
               "ops": [{"op": op.kind, "peer": op.peer, "message": str(op.payload)}
                       for op in g.group.ops]} for g in rank.groups] for rank in plan.ranks]
    if args.json:
        print(json.dumps({"schedule": schedule.name, "pp": schedule.pp,
                          "microbatches": schedule.microbatches, "splits": schedule.splits,
                          "chunks": schedule.chunks, "ranks": ranks,
                          "verdicts": {mode: {"ok": v.ok, "groups": v.groups,
                                              "messages": v.messages, "problems": v.problems}
                                       for mode, v in verdicts.items()}}))
    else:
        print(f"{schedule.name}: P={schedule.pp} m={schedule.microbatches} k={schedule.splits} "
              f"V={schedule.chunks}; each line is one batch_isend_irecv, issued after the action "
              "named (or before the first)")
        for rank, groups in enumerate(ranks):
            print(f"rank {rank}:")
            for group in groups:
                ops = "; ".join(f"{op['op']} {op['message']} "
                                f"{'to' if op['op'] == SEND else 'from'} rank {op['peer']}"
                                for op in group["ops"])
                print(f"  {'after ' + group['after'] if group['after'] else 'start':<14} {ops}")
        for mode, verdict in verdicts.items():
            result = "ok" if verdict.ok else "FAILS: " + "; ".join(verdict.problems)
            print(f"NCCL {mode} mode: {verdict.groups} groups, {verdict.messages} messages: "
                  f"{result}")
    return 0 if all(v.ok for v in verdicts.values()) else 1


def _run_costs(args: argparse.Namespace, split: StageLayers | None = None,
               spread_output: bool = False):
    """(model costs_of or None, --uniform-cost or None) of a search or comparison; the model's
    costs with `split`'s layers (None: the command line's), the output layer spread over the
    ranks (O actions) when `spread_output` (not for the cap's reference, 1F1B's whole
    sequence)."""
    model = _model(args)
    if model is not None and args.uniform_cost is not None:
        raise UsageError("--uniform-cost and a model (--model or its dimensions): give one")
    if args.uniform_cost is not None and len(args.uniform_cost) != 3:
        raise UsageError("--uniform-cost takes three numbers here: F B W")
    if model is None:
        return None, args.uniform_cost
    if args.seq_length is None:
        raise UsageError("--seq-length is required with a model")

    def costs_of(schedule, whole: bool):
        spans = [args.seq_length] if whole else _spans(args, model, schedule.splits)
        layers = split if split is not None else _stage_layers(args)
        return model_costs(schedule, model, spans, flops_per_second=args.device_tflops * 1e12,
                           tp=args.tp, sequence_parallel=args.sequence_parallel,
                           stage_layers=layers.for_reference() if whole else layers,
                           cp=args.cp, spread_output=spread_output and not whole)
    return costs_of, None


def _searched_layout(args: argparse.Namespace, budget: ScheduleBudget) -> LayoutSearch:
    """--search-layout: every stage's layers chosen with the schedule, by the procedure
    pretrain_gpt.py --search-layout runs (layout_search.search_layout), on this command's
    budgets (`budget`: the even split's, the flags' cap); with --spread-output every layout is
    also searched with the output layer spread, and counts with the shorter. The candidates'
    choice goes to stderr as a layout string."""

    def budget_of(split: Optional[StageLayers], cap: Optional[float]) -> ScheduleBudget:
        found = budget if split is None else model_budget(
            args.schedule, args.pp, args.microbatches, args.splits, args.chunks,
            MemoryCap(cap, False), _run_costs(args, split)[0])
        return _offer_spread(args, found, split) if args.spread_output else found

    found = search_layout(args.schedule, args.pp, args.microbatches, args.splits,
                          _model(args).num_layers, budget_of)
    choice = found.choice
    where = " (the output layer spread or kept, the shorter)" if args.spread_output else ""
    print(f"plan.py: --search-layout chose {LAYOUT_FLAG} '{choice.stage_layers.layout}': "
          f"makespan {choice.makespan:.6g} on a V{where} against {choice.start_makespan:.6g} "
          f"for the even split ({choice.tried} layouts searched, each without the annealing "
          "walk the final search adds)", file=sys.stderr)
    if found.chosen is not None and found.layout is None:
        print(f"plan.py: --search-layout: with the walk and every placement the even split "
              f"is as short ({found.even.makespan:.6g} against {found.chosen.makespan:.6g}): "
              "its order is kept", file=sys.stderr)
    return found


def _offer_spread(args: argparse.Namespace, budget: ScheduleBudget,
                  split: Optional[StageLayers]) -> ScheduleBudget:
    """`budget` with each of its placements offered again with the output layer as O actions
    (`split`: the stages' layers, None for the command line's), under the same cap: the
    trainer's --spread-output (budget.with_output_spread)."""
    spread_costs = _run_costs(args, split, spread_output=True)[0]
    return with_output_spread(budget, args.schedule, args.pp, args.microbatches, args.splits,
                              args.chunks, lambda schedule: spread_costs(schedule, False))


class _Searched(NamedTuple):
    """A search's order, its costs and replay, the least lower bound of what it chose among,
    and the cap it placed under."""

    schedule: Schedule
    costs: SpanCosts
    report: SimulationReport
    bound: float
    cap: float


def _searched(args: argparse.Namespace, budget: ScheduleBudget) -> _Searched:
    """seq1f1b-zb-auto under `budget`; with --spread-output every placement is offered again
    with the output layer as O actions under the same cap, through the function the trainer's
    --spread-output uses (budget.with_output_spread), so both search the same order and the
    shorter is kept."""
    if args.spread_output:
        budget = _offer_spread(args, budget, None)
    schedule = registry.build(args.schedule, args.pp, args.microbatches, args.splits,
                              args.chunks, budget=budget)
    return _described(schedule, budget, searched_cap(args.pp, args.microbatches, args.splits,
                                                     args.chunks, budget))


def _described(schedule: Schedule, budget: ScheduleBudget, cap: float) -> _Searched:
    """A searched order with its costs, replay and least lower bound under `budget` and `cap`."""
    costs = budget.costs_for(schedule.placement, schedule.spread_output)
    return _Searched(schedule, costs, simulate(schedule, costs),
                     searched_lower_bound(schedule, budget, cap), cap)


def cmd_search(args: argparse.Namespace) -> None:
    if args.time_limit <= 0:
        raise UsageError("--time-limit must be positive (seconds)")
    if args.save_schedule:
        _check_writable("--save-schedule", args.save_schedule)
    args.schedule = "seq1f1b-zb-auto"
    if args.search_layout and _model(args) is None:
        raise UsageError("--search-layout needs a model (--model or its dimensions)")
    if args.spread_output and _model(args) is None:
        raise UsageError("--spread-output needs a model (--model or its dimensions): unit "
                         "costs have no output layer to spread")
    if args.search_layout and args.chunks != 2:
        raise UsageError("--search-layout chooses the layers of the 2P stages of two chunks per "
                         "rank: give --chunks 2")
    if args.search_layout and _stage_layers(args).uneven:
        raise UsageError(f"--search-layout chooses every stage's layers: drop {FIRST_FLAG} / "
                         f"{LAST_FLAG} / {LAYOUT_FLAG}")
    costs_of, uniform = _run_costs(args)
    budget = _search_budget(args, costs_of, uniform)
    layout = None
    if args.spread_output:
        print("plan.py: --spread-output: every placement searched again with the output layer "
              "as O actions on any rank, under the same cap; the shorter is kept",
              file=sys.stderr)
    if args.search_layout:
        found = _searched_layout(args, budget)
        searched = _described(found.kept.schedule, found.kept.budget, found.cap)
        # the least bound of the even split's and the layout's: the gap is to any of them
        searched = searched._replace(bound=min(searched.bound, searched_lower_bound(
            found.even.schedule, found.even.budget, found.cap)))
        layout = found.layout.layout if found.layout is not None else None
    else:
        searched = _searched(args, budget)
    schedule, costs, report, bound, cap = searched
    out = {"placement": schedule.placement, "chunks": schedule.chunks,
           "makespan": report.makespan, "bubble": report.bubble_ratio, "cap": cap,
           "peak": max(r.peak_held_bytes for r in report.ranks),
           "lower_bound": bound, "layout": layout,
           "output_layer": "spread" if schedule.spread_output else "last stage"}
    out["lower_bound_gap"] = gap_to_bound(out["makespan"], out["lower_bound"])
    # what --save-schedule writes: the search's order, or CP-SAT's where it is shorter
    best = ("seq1f1b-zb-auto", schedule, out["makespan"])
    if args.exact:
        found = solve(schedule, costs, cap, args.time_limit, hint=schedule)
        if found.schedule is not None and found.makespan < out["makespan"]:
            best = ("cp-sat", found.schedule, found.makespan)
        out["exact"] = {"status": found.status, "optimal": found.optimal,
                        "makespan": _finite(found.makespan), "peak": _finite(found.peak),
                        "whole_bound": found.bound, "rank_bound": None, "rank_bounds": None}
        if not found.optimal:
            # one rank at a time, each exactly with its memory: often far above the whole
            # problem's bound under a cap (seq1f1b/plan/rank_bound.py)
            relaxed = rank_bound(schedule, costs, cap, args.time_limit, hint=best[1])
            out["exact"].update(rank_bound=relaxed.bound, rank_bounds=list(relaxed.per_rank))
        bound = max(found.bound, out["exact"]["rank_bound"] or 0.0)
        out["exact"].update(
            bound=bound,
            search_over_exact=out["makespan"] / found.makespan - 1
            if math.isfinite(found.makespan) else None,
            search_over_bound=out["makespan"] / bound - 1 if bound > 0 else None)
    if args.save_schedule:
        order, saved, makespan = best
        with open(args.save_schedule, "w") as file:
            file.write(schedule_file.write(saved))
        out["saved"] = {"path": args.save_schedule, "order": order, "makespan": makespan}
    if args.json:
        print(json.dumps(out))
        return
    if layout is not None:
        print(f"layout {layout}")
    where = ("" if not args.spread_output else ", output layer spread over the ranks"
             if schedule.spread_output else ", output layer kept in the last stage (no order "
             "with it spread is shorter under the cap)")
    print(f"seq1f1b-zb-auto P={args.pp} m={args.microbatches} k={args.splits} V={args.chunks} "
          f"on {placement_words(schedule.placement)}{where}: makespan "
          f"{out['makespan']:.6g}, bubble {out['bubble']:.1%}, peak {out['peak']:.6g} of cap "
          f"{cap:.6g}; lower bound {out['lower_bound']:.6g} (gap {out['lower_bound_gap']:.2%})")
    if args.exact:
        exact = out["exact"]
        bound = (f"{exact['bound']:.6g} (search {exact['search_over_bound']:+.2%})"
                 if exact["search_over_bound"] is not None else "none")
        found = (f"makespan {exact['makespan']:.6g} (search {exact['search_over_exact']:+.2%})"
                 if exact["makespan"] is not None else "no order found in the time")
        parts = "" if exact["rank_bound"] is None else (
            f" (the larger of one rank at a time's {exact['rank_bound']:.6g} and the whole "
            f"problem's {exact['whole_bound']:.6g})")
        print(f"exact (CP-SAT, {args.time_limit:g} s): {exact['status']}, {found}, proven "
              f"bound {bound}{parts}")
    if args.save_schedule:
        saved = out["saved"]
        use = (f"train it: pretrain_gpt.py --pipeline-schedule-file {saved['path']}"
               + (f" --pipeline-model-parallel-layout '{layout}'" if layout is not None else ""))
        print(f"wrote {saved['path']}: {saved['order']}'s order, makespan "
              f"{saved['makespan']:.6g} ({use})")
    else:
        print("to train this order: --save-schedule FILE.csv writes it for pretrain_gpt.py "
              "--pipeline-schedule-file FILE.csv"
              + (f" --pipeline-model-parallel-layout '{layout}'" if layout is not None else ""))


def _check_writable(flag: str, path: str, suffix: Optional[str] = None) -> None:
    """Before any work: `path` names a file this user can write, ending in `suffix` when given
    (writable.check_output_file)."""
    try:
        check_output_file(path, flag, suffix)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _finite(value: float) -> Optional[float]:
    """JSON has no infinity: None for a solve that found no order in its time."""
    return value if math.isfinite(value) else None


def cmd_compare(args: argparse.Namespace) -> None:
    registry.check_sizes(args.pp, args.microbatches, args.splits)
    model = _model(args)
    if model is not None and args.seq_length is None:
        raise UsageError("--seq-length is required with a model")
    if args.uniform_cost is not None and (model is not None or len(args.uniform_cost) != 3):
        raise UsageError("--uniform-cost F B W, or a model, not both")
    costs = CostModel(tuple(args.uniform_cost or UNIT)) if model is None else CostModel(
        model=model, seq_length=args.seq_length, tp=args.tp,
        sequence_parallel=args.sequence_parallel, flops_per_second=args.device_tflops * 1e12,
        partition=args.method, cp=args.cp, align=args.align)
    if args.method in ("fit", "explicit"):
        raise UsageError("--partition: compare cuts every k by the even or compute method")
    if args.spread_output and model is None:
        raise UsageError("--spread-output needs a model (--model or its dimensions): unit "
                         "costs have no output layer to spread")
    rows = compare(args.pp, args.microbatches, args.splits, costs, args.spread_output)
    if args.json:
        print(json.dumps([{"name": r.name, "splits": r.splits, "chunks": r.chunks,
                           "placement": r.placement, "makespan": r.makespan, "bubble": r.bubble, "peaks": list(r.peaks),
                           "lower_bound": r.lower_bound, "gap": r.gap} for r in rows]))
        return
    unit, scale = ("GiB", GIB) if model is not None else ("units", 1.0)
    print(f"P={args.pp} m={args.microbatches}, ours at k={args.splits}, torch's at k=1; "
          f"makespan{' (s)' if model else ''}, bubble, lower-bound gap, peak held per rank "
          f"({unit})")
    width = max(len(r.name) for r in rows)
    for r in rows:
        peaks = " ".join(f"{p / scale:6.2f}" for p in r.peaks)
        print(f"{r.name:<{width}} k={r.splits} V={r.chunks} {r.placement:<6} {r.makespan:9.4g} "
              f"{r.bubble:6.1%} {r.gap:6.1%}  {peaks}")


def _gpu_memory(text: str) -> float:
    """--gpu-memory: GiB, or a number with a unit (80GiB, 80GB = 80e9 bytes)."""
    units = {"": 1.0, "gib": 1.0, "gb": 1e9 / GIB, "mib": 1 / 1024}
    number = text.lower().rstrip("gibm")
    unit = text.lower()[len(number):]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise UsageError(f"--gpu-memory {text!r}: give GiB, e.g. 80GiB, 79.25 or 80GB") from None
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"--gpu-memory {text!r} must be a finite positive size")
    return value


def _names(flag: str, text: str) -> tuple[str, ...]:
    """A comma-separated list, refused when it names nothing (`--schedules ,` searched no
    schedule and then blamed the memory)."""
    names = tuple(name for name in text.split(",") if name)
    if not names:
        raise UsageError(f"{flag} {text!r} names nothing: give a comma-separated list or leave "
                         "the flag out")
    return names


def cmd_tune(args: argparse.Namespace) -> None:
    from seq1f1b.plan.tune import report
    from seq1f1b.plan.tune.devices import resolve_gpu
    from seq1f1b.plan.tune.launch import sbatch_script
    from seq1f1b.plan.tune.search import tune
    from seq1f1b.plan.tune.searched import search_top
    from seq1f1b.plan.tune.space import Query, default_schedules
    model = _model(args)
    if model is None:
        raise UsageError("a model is required: --model or its dimensions")
    if args.searched < 0:
        raise UsageError(f"--searched must not be negative, got {args.searched}")
    if args.emit_sbatch:
        _check_writable("--emit-sbatch", args.emit_sbatch)
    schedules = (_names("--schedules", args.schedules) if args.schedules is not None
                 else default_schedules())
    for name in schedules:
        registry.get(name)
    try:
        chunks = tuple(int(v) for v in _names("--chunks", args.chunks))
    except ValueError:
        raise UsageError(f"--chunks {args.chunks!r}: give integers, e.g. 2,4") from None
    recomputes = tuple(None if name == "none" else name
                       for name in _names("--recompute", args.recompute))
    for name in recomputes:
        if name not in (None, "selective", "full"):
            raise UsageError(f"--recompute: {name!r}; choose from none, selective, full")
    query = Query(model, args.seq_length, args.gpus, args.gpus_per_node,
                  args.global_batch_size, args.micro_batch_size, schedules, args.max_splits,
                  args.min_span, chunks, _names("--partitions", args.partitions), recomputes,
                  not args.even_stages, args.loss_backward_in_forward)
    gpu = resolve_gpu(args.gpu, _gpu_memory(args.gpu_memory) if args.gpu_memory is not None
                      else None,
                      args.gpus_per_node)
    result = tune(query, gpu, args.top)
    search_top(result, args.searched)
    if args.emit_sbatch and result.ranked:
        winner = result.winner
        with open(args.emit_sbatch, "w") as out:
            out.write(sbatch_script(winner.setup, query.gpus,
                                    query.gpus_per_node,
                                    f"{winner.name}: {winner.projection.tokens_per_s:.0f} "
                                    f"tokens/s projected on {gpu.device.name}"))
    if args.json:
        print(json.dumps(report.to_dict(result)))
    else:
        print("\n".join(report.text(result)))
        if args.emit_sbatch and result.ranked:
            print(f"wrote {args.emit_sbatch} (sbatch {args.emit_sbatch})")
    if not result.ranked:
        raise SystemExit(1)


def _add_tune_args(tune: argparse.ArgumentParser) -> None:
    _add_model_args(tune)
    tune.add_argument("--seq-length", type=int, required=True, help="tokens per sequence L")
    tune.add_argument("--gpus", type=int, required=True, help="GPUs of the run")
    tune.add_argument("--gpus-per-node", type=int, default=8,
                      help="GPUs per node: TP stays inside one (default 8)")
    tune.add_argument("--gpu", default="a100", metavar="a100|h100|FILE",
                      help="the device model: a100 (default), h100, or a device_check.json "
                           "of tools/device_check.py (its measured efficiencies and "
                           "reserved/allocated ratio)")
    tune.add_argument("--gpu-memory", metavar="SIZE",
                      help="memory per GPU for the OOM verdicts: 80GiB, 79.25 (GiB) or 80GB "
                           f"(default: the device's, {A100.memory_gib:g} GiB for an A100)")
    tune.add_argument("--global-batch-size", type=int,
                      help="sequences per iteration (default max(32, GPUs / 4)); with DP "
                           "it sets the micro-batch count")
    tune.add_argument("--micro-batch-size", type=int, default=1)
    tune.add_argument("--schedules", metavar="A,B",
                      help="registry schedules to consider (default: all but the searched)")
    tune.add_argument("--max-splits", type=int, default=32, help="largest k (default 32)")
    tune.add_argument("--min-span", type=int, default=1024,
                      help="shortest span in tokens: caps k at L / this (default 1024)")
    tune.add_argument("--chunks", default="2,4", metavar="V,V",
                      help="V of the loop-interleaved schedules (default 2,4; a V has 2)")
    tune.add_argument("--partitions", default="even,compute", metavar="A,B",
                      help="span cuts to consider for k > 1 (default even,compute)")
    tune.add_argument("--recompute", default="none,selective,full", metavar="A,B",
                      help="activation recompute to consider (default none,selective,full; "
                           "full is uniform, one layer per group)")
    tune.add_argument("--even-stages", action="store_true",
                      help="do not try uneven first/last stages")
    tune.add_argument("--loss-backward-in-forward", choices=LOSS_IN_FORWARD_CHOICES,
                      default="both",
                      help="the loss's backward at the last stage's forward (pretrain_gpt.py "
                           "--loss-backward-in-forward: less memory on that rank): never, "
                           "always, or both: where only it makes a layout fit (default)")
    tune.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    tune.add_argument("--searched", type=int, default=3, metavar="N",
                      help="also plan seq1f1b-zb-auto on the top N layouts, each under the "
                           "held bytes its ranks have room for; the winner is the fastest of "
                           "those and the top layout (default 3; 0: none)")
    tune.add_argument("--emit-sbatch", metavar="FILE",
                      help="write the winner as an sbatch script (examples/slurm's shape, "
                           "sourcing launch_pretrain.sh)")
    tune.add_argument("--json", action="store_true")
    tune.set_defaults(run=cmd_tune)


def build_parser() -> Parser:
    parser = Parser(prog="plan.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    show = commands.add_parser("show", help="print each rank's action list")
    _add_schedule_args(show)
    show.add_argument("--json", action="store_true")
    show.add_argument("--csv", action="store_true",
                      help="print the schedule as a --pipeline-schedule-file")
    show.set_defaults(run=cmd_show)

    part = commands.add_parser("partition", help="cut a sequence into spans")
    part.add_argument("--splits", type=int, required=True, help="spans k")
    _add_span_args(part, "--method")
    _add_model_args(part)
    part.add_argument("--json", action="store_true")
    part.set_defaults(run=cmd_partition)

    sim = commands.add_parser("simulate", help="replay a schedule with per-action costs")
    _add_schedule_args(sim)
    sim.add_argument("--uniform-cost", type=float, nargs="+", metavar="COST",
                     help="durations F B [W] of every span")
    _add_model_args(sim)
    _add_stage_layer_args(sim)
    _add_span_args(sim, "--partition")
    sim.add_argument("--output-cost", type=float, metavar="O",
                     help="with --uniform-cost, each O action's (a schedule file that spreads "
                          "the output layer over the ranks)")
    sim.add_argument("--device-tflops", type=float, default=A100_BF16_TFLOPS,
                     help="FLOP rate of one GPU, in TFLOPS (default: A100 bf16 peak)")
    sim.add_argument("--p2p-latency", type=float, default=0.0,
                     help="added to every cross-rank dependency, in the costs' time unit")
    sim.add_argument("--loss-backward-in-forward", action="store_true",
                     help=LOSS_BACKWARD_IN_FORWARD_HELP + " (with a model)")
    sim.add_argument("--plot", metavar="FILE.png")
    sim.add_argument("--trace", metavar="FILE.json", help="chrome://tracing / Perfetto JSON")
    sim.add_argument("--json", action="store_true")
    sim.add_argument("--timeline", action="store_true",
                     help="with --json: include every action's start and end")
    sim.set_defaults(run=cmd_simulate)

    mem = commands.add_parser("memory", help="per-stage memory estimate and OOM verdict")
    mem.add_argument("--pipeline-schedule-file", metavar="FILE.csv",
                     help="a schedule written as a file (replaces --schedule; P, m, k and V are "
                          "the file's), e.g. one plan.py search --save-schedule wrote")
    mem.add_argument("--schedule",
                     choices=registry.names() + list(MEGATRON_PLANS), metavar="NAME",
                     help=f"one of: {', '.join(registry.names() + list(MEGATRON_PLANS))}")
    mem.add_argument("--pp", type=int, help="pipeline stages P (required with --schedule)")
    mem.add_argument("--microbatches", type=int,
                     help="micro-batches m (required with --schedule)")
    mem.add_argument("--splits", type=int, help="spans per micro-batch k (default 1)")
    mem.add_argument("--chunks", type=int, help="model chunks per rank V (default 1)")
    _add_cap_arg(mem)
    _add_model_args(mem)
    _add_stage_layer_args(mem)
    _add_span_args(mem, "--partition")
    mem.add_argument("--dp", type=int, default=1, help="data-parallel size")
    mem.add_argument("--micro-batch-size", type=int, default=1)
    mem.add_argument("--distributed-optimizer", action="store_true",
                     help="shard the optimizer states over DP")
    mem.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    mem.add_argument("--loss-backward-in-forward", action="store_true",
                     help=LOSS_BACKWARD_IN_FORWARD_HELP)
    _add_spread_arg(mem, "--schedule seq1f1b-zb-auto: its search also tries the output layer "
                         "and the loss of each span as an action of its own (O) on any rank, "
                         "every rank holding the output weights, and keeps the shorter")
    mem.add_argument("--recompute-granularity", choices=list(RECOMPUTE_GRANULARITIES),
                     help="checkpoint activations to allow for training with larger models, "
                          "sequences and batch sizes, at two granularities: full (the whole "
                          "transformer layer is recomputed) or selective (the core attention "
                          "part of the transformer layer is recomputed)")
    mem.add_argument("--recompute-method", choices=list(RECOMPUTE_METHODS),
                     help="with full: uniform (uniformly divide the transformer layers of each "
                          "model chunk and recompute the input activation of each divided "
                          "chunk) or block (recompute the input activations of only a set "
                          "number of individual transformer layers per model chunk and do the "
                          "rest without any recomputing); default uniform")
    mem.add_argument("--recompute-num-layers", type=int, metavar="N",
                     help="with full: uniform, the number of transformer layers in each "
                          "uniformly divided recompute unit; block, the number of individual "
                          "transformer layers to recompute within each model chunk; default 1")
    mem.add_argument("--overhead-gb", type=float, default=FRAMEWORK_OVERHEAD_GIB,
                     help=f"fixed per-GPU framework overhead in GiB "
                          f"(default {FRAMEWORK_OVERHEAD_GIB})")
    mem.add_argument("--gpu-memory", type=float, default=A100.memory_gib, metavar="GiB",
                     help=f"device memory for the OOM verdict (default {A100.memory_gib:g}: the "
                          "total capacity torch reports of an A100 80 GB)")
    mem.add_argument("--device-check", metavar="FILE",
                     help="device_check.json of tools/device_check.py: judge the verdict on "
                          "allocated bytes times its measured reserved/allocated ratio")
    mem.add_argument("--json", action="store_true")
    mem.set_defaults(run=cmd_memory)

    comm = commands.add_parser("comm", help="each rank's p2p groups and the NCCL-rules verdict")
    _add_schedule_args(comm)
    comm.add_argument("--mode", choices=list(MODES) + ["both"], default="both",
                      help="NCCL init: lazy (default of init_process_group), eager (device_id "
                           "given) or both")
    comm.add_argument("--json", action="store_true")
    comm.set_defaults(run=cmd_comm)

    search = commands.add_parser("search", help="seq1f1b-zb-auto's search, its lower-bound gap "
                                                "and (--exact) the CP-SAT optimum")
    _add_problem_args(search, "F B W per action")
    search.add_argument("--chunks", type=int, default=2, help="model chunks per rank V: 2 (a V or a loop, the search chooses) or 1 (a loop)")
    _add_cap_arg(search)
    _add_stage_layer_args(search)
    search.add_argument("--search-layout", action="store_true",
                        help="also choose every virtual stage's layers (with a model; with "
                             "--spread-output each layout searched with the output layer kept "
                             "and spread): the layout is printed, for "
                             "--pipeline-model-parallel-layout")
    _add_spread_arg(search, "search again with the output layer and the loss of each span as "
                            "an action of its own (O) on whichever rank the search puts it, "
                            "every rank holding the output weights, and keep the shorter")
    search.add_argument("--exact", action="store_true",
                        help="also solve the same problem exactly (CP-SAT) within --time-limit "
                             "(with --spread-output: the problem of the order kept, the layer "
                             "spread or in the last stage); where that proves nothing, bound it "
                             "from below one rank at a time, each exactly with its memory, "
                             "within as much time again")
    search.add_argument("--time-limit", type=float, default=60.0, metavar="SECONDS",
                        help="CP-SAT's time on the whole problem (and as much again on the "
                             "one-rank bounds)")
    search.add_argument("--save-schedule", metavar="FILE.csv",
                        help="write the shortest order found (with --exact, CP-SAT's where it is "
                             "shorter) as a schedule file, for pretrain_gpt.py "
                             "--pipeline-schedule-file")
    search.set_defaults(run=cmd_search)

    comp = commands.add_parser("compare", help="our schedules beside torch's ZB-V, DualPipeV "
                                               "and interleaved zero bubble on the same costs")
    _add_problem_args(comp, "F B W per micro-batch on a rank's layers (default 1 1 1)")
    _add_spread_arg(comp, "one more row: the search on two chunks with the output layer and the "
                          "loss of each span as an action of its own (O) on any rank, under the "
                          "default cap of the search without")
    comp.set_defaults(run=cmd_compare)

    _add_tune_args(commands.add_parser(
        "tune", help="the fastest layouts (TP, CP, PP, V, k, schedule, recompute) that fit, "
                     "and the winner's flags"))
    return parser


PATH_FLAGS = ("pipeline_schedule_file", "calibration", "device_check", "plot", "trace",
              "save_schedule", "emit_sbatch", "schedule_memory_cap", "gpu_memory")
"""Flags whose value is a name or a quantity: an empty one is a mistake, not "not given"."""

POSITIVE_INTS = ("tp", "cp", "align", "dp", "micro_batch_size")
NON_NEGATIVE_FLOATS = ("p2p_latency", "overhead_gb")
POSITIVE_FLOATS = ("device_tflops",)


def check_common_flags(args: argparse.Namespace) -> None:
    """What every subcommand's flags must be before any work, whichever subcommand has them:
    named values not empty, sizes positive integers (`--align -4` was taken as 4 and `--cp -1`
    gave a negative makespan), rates and sizes finite numbers of the right sign, and the
    picture and trace files writable, named as what is written (PNG, JSON)."""
    for name in PATH_FLAGS:
        if getattr(args, name, None) == "":
            raise UsageError(f"--{name.replace('_', '-')} is empty: give a value or leave the "
                             "flag out")
    error = sizes_error(args, POSITIVE_INTS)
    if error is not None:
        raise UsageError(error)
    for names, least, word in ((NON_NEGATIVE_FLOATS, 0.0, "non-negative"),
                               (POSITIVE_FLOATS, None, "positive")):
        for name in names:
            value = getattr(args, name, None)
            if value is not None and not (math.isfinite(value) and (
                    value > 0 if least is None else value >= least)):
                raise UsageError(f"--{name.replace('_', '-')} must be a finite {word} number, "
                                 f"got {value}")
    if getattr(args, "calibration", None) is not None and args.method != "fit":
        raise UsageError(f"--calibration is read by the fit method, not {args.method!r}")
    for flag, suffix in (("plot", ".png"), ("trace", ".json")):
        if getattr(args, flag, None) is not None:
            _check_writable(f"--{flag}", getattr(args, flag), suffix)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_common_flags(args)
        with shown(sys.stderr, "plan.py: "):      # a long search says how far it is
            return args.run(args) or 0
    except (UsageError, ScheduleError, CalibrationError) as err:
        print(f"plan.py: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
