#!/usr/bin/env python3
"""Side by side: one model, one batch, several pipeline schedules, in the same processes.

    torchrun --nproc-per-node 2 tools/benchmark.py --pp 2 --num-microbatches 2 --splits 4 \\
        --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \\
        --schedules 1f1b seq1f1b --partition compute --plot timelines.png

Schedules with the same chunk count and placement share one set of model chunks and are timed
round-robin (each round runs every schedule once, so load changes on a shared machine hit all
alike): --warmup untimed rounds, then --iterations timed ones (a barrier before each iteration;
its time is the slowest rank's forward-backward, grad finalisation included, no optimizer step),
then one iteration each with the saved-tensor meter on (memory is measured apart so that the
meter's hooks do not slow the timed iterations). Per schedule it reports: median iteration time, tokens/s, the
ratio to the first schedule (of medians; paired: the median of per-round ratios, which a slow
drift of the machine's speed does not move; of the fastest iterations), the measured bubble
(idle / (P x makespan) from the per-action timeline, waits for a neighbour counted as idle), the
simulator's bubble, makespan and ratio for the same plan with per-action costs calibrated from
the measured ones (median F and B per stage and span), what uniform span costs would predict
(ratio and the ideal bubble, with the bubble's gap to it split into what the measured costs
explain and what the runtime adds), the work per rank against the first schedule's and the
ceiling it leaves (uniform-cost ratio / work), and per rank the measured peak bytes held for
backward beside the memory estimator's figure.

Work is compute, not wall time: each action's main-thread CPU time (time.thread_time; on a GPU
the actions' CUDA-event time), summed per rank. Its wall time also holds what the machine took:
an action descheduled while another process held a core grows without doing more, so
`descheduled` reports that share of the actions' busy wall time, and `wall work` the old,
wall-clock ratio. The CPU the machine's other processes used during the timed rounds
(/proc/stat minus our processes and their launcher, seq1f1b/machine_load.py) is printed, per
round as the rounds run (one line each on stderr, warm-up included) and for the whole run,
which is marked noisy above --noise-threshold cores.

A schedule takes --splits when its name starts with "seq1f1b" and k=1 otherwise; "NAME:K" sets k
for one entry (e.g. `--schedules megatron-1f1b seq1f1b:1`), and "NAME[:K]@PARTITION" its span
boundaries (even, compute or fit; default --partition, which applies to the entries with k >= 2
only: one span is the whole sequence; not fit for seq1f1b-zb-auto, placed before any warm-up),
so one run can set cuts side by side:
`--schedules 1f1b seq1f1b@even seq1f1b@compute seq1f1b@fit`. A fit entry calibrates from its own
warm-up iterations (at least one): they run with the compute cut and the trace on, every span's
median F and B summed over the pipeline stages are fitted (seq1f1b/plan/span_fit.py), and the
timed iterations run the cut balanced in that measured time, which the output reports. Each
traced entry's JSON carries its measured spans (`spans`: start, end, forward_s, backward_s), so
the output is itself a calibration file for `plan.py partition --method fit --calibration`.
A --pipeline-schedule-file with O actions (the output layer spread over the ranks) runs too: its
entry also gives each span's O (`calibrated_output_s`), and its spans count a third of the O in
forward_s and two thirds in backward_s, as the last stage's F and B hold the layer elsewhere.
megatron-core's own schedules (megatron-*) run without a trace: they are timed as a whole.
V-shaped schedules (zbv, seq1f1b-zbv) need --chunks 2.
The searched seq1f1b-zb-auto runs on --chunks 1 or 2 and chooses a V or a loop, placed with
its default budget or under --schedule-memory-cap, with this model's FLOP and byte costs; with
--spread-output it is also searched with the output layer as O actions on any rank, as
pretrain_gpt.py --spread-output does, and runs the shorter. Runs whose output layer is spread
(a searched one that chose it, a file with O actions) get model chunks of their own.
Output: a markdown table on rank 0; --json prints JSON instead; --output FILE also writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROG = "benchmark.py"


class UsageError(Exception):
    """Bad command line: one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


@dataclass(frozen=True)
class Run:
    """One entry of --schedules."""

    schedule: str
    splits: int
    chunks: int
    partition: str = "even"        # even | compute | explicit (--span-lengths) | fit
    placement: Optional[str] = None   # a searched schedule's choice, once placed (parse_args)
    spread: bool = False           # its plan runs the output layer as O actions (any rank's)

    @property
    def group(self) -> tuple[int, str, bool]:
        """Runs of one group share model chunks: the same count, placed the same way (a V
        puts the last stage on rank 0), the output layer spread or not (spread, every rank's
        last chunk holds a copy and the last stage's ends before it: megatron's own schedules
        would run without the layer, ours with a gradient sum of the copies they do not use)."""
        from seq1f1b.runtime.forward_backward import placement_of

        return self.chunks, self.placement or placement_of(self.schedule), self.spread

    @property
    def label(self) -> str:
        return self.schedule if self.splits == 1 else f"{self.schedule}@{self.partition}"


def build_parser() -> Parser:
    from seq1f1b.equivalence import add_model_flags

    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--schedules", nargs="+", default=[], metavar="NAME[:K][@PARTITION]",
        help="schedules to compare; the first is the baseline of the ratios")
    add("--pipeline-schedule-file", metavar="FILE.csv",
        help="also run the schedule in this file, after --schedules (seq1f1b/plan/"
             "schedule_file.py; checked before any work): its P and micro-batches must be --pp "
             "and --num-microbatches, its k and V are its own")
    add_model_flags(parser, partitions=("even", "compute", "fit", "explicit"), hidden_size=256,
                    vocab_size=1024, seq_length=512, micro_batch_size=1, num_microbatches=2,
                    chunks=2)
    add("--seed", type=int, default=1234)
    add("--warmup", type=int, default=1, help="untimed iterations per schedule")
    add("--iterations", type=int, default=3, help="timed iterations per schedule")
    add("--threads", type=int, default=1, help="torch intra-op threads per process")
    add("--noise-threshold", type=float, default=0.2, metavar="CORES",
        help="mark the run noisy when the machine's other processes used more than this many "
             "cores during the timed rounds (from /proc; default 0.2)")
    add("--json", action="store_true", help="print JSON instead of the markdown table")
    add("--schedule-memory-cap", metavar="CAP", default=None,
        help="searched schedules (seq1f1b-zb-auto): per-rank cap on held activations and K/V, "
             "bytes (e.g. 512MiB) or a fraction of 1F1B's rank-0 peak (e.g. 0.5x), placed with "
             "this model's FLOP and byte costs; default: the schedule's own budget")
    add("--output", metavar="FILE.json", help="also write the JSON here")
    add("--plot", metavar="FILE.png", help="measured vs simulated timelines of traced schedules")
    return parser


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, list[Run]]:
    """Parse and check everything that can be checked before the processes meet."""
    from seq1f1b.writable import check_output_file
    from seq1f1b.equivalence import check_spread_output, settle_shape_flags
    from seq1f1b.plan.actions import ScheduleError
    from seq1f1b.plan.budget import MemoryCap
    from seq1f1b.model_flags import sizes_error
    from seq1f1b.runtime.forward_backward import MEGATRON_SCHEDULES, schedule_names

    args = build_parser().parse_args(argv)
    try:      # the results are written after the whole run: a bad path is refused before it
        settle_shape_flags(args)
        for flag, path, suffix in (("--output", args.output, None), ("--plot", args.plot, ".png")):
            if path is not None:
                check_output_file(path, flag, suffix)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.schedule_memory_cap is not None:
        try:
            MemoryCap.parse(args.schedule_memory_cap)
        except ScheduleError as err:
            raise UsageError(str(err)) from None
    if args.span_lengths:
        args.partition = "explicit"
    error = sizes_error(args, ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                               "seq_length", "micro_batch_size", "num_microbatches", "tp", "pp",
                               "chunks", "splits", "iterations", "threads", "span_alignment"))
    if error is not None:
        raise UsageError(error)
    try:
        _check_model(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.warmup < 0:
        raise UsageError("--warmup must be >= 0")
    if args.noise_threshold < 0:
        raise UsageError("--noise-threshold must be >= 0")
    uneven = (args.decoder_first_pipeline_num_layers is not None
              or args.decoder_last_pipeline_num_layers is not None
              or args.pipeline_model_parallel_layout is not None)
    if args.num_layers % args.pp and not uneven:
        raise UsageError(f"--num-layers {args.num_layers} is not divisible by --pp {args.pp}")
    runs = []
    for entry in args.schedules:
        spec, _, cut = entry.partition("@")
        name, _, k_text = spec.partition(":")
        if cut and cut not in ("even", "compute", "fit"):
            raise UsageError(f"--schedules {entry}: PARTITION must be even, compute or fit")
        if cut and args.span_lengths:
            raise UsageError(f"--schedules {entry}: @{cut} and --span-lengths both set the "
                             "span boundaries")
        if name not in schedule_names():
            raise UsageError(f"--schedules: unknown schedule {name!r}; choose from "
                             f"{', '.join(schedule_names())}")
        if k_text and not (k_text.isdigit() and int(k_text) >= 1):
            raise UsageError(f"--schedules {entry}: K must be a positive integer")
        k = int(k_text) if k_text else (args.splits if name.startswith("seq1f1b") else 1)
        if name in MEGATRON_SCHEDULES and k != 1:
            raise UsageError(f"--schedules {entry}: megatron's schedules run whole sequences "
                             "(k = 1)")
        if args.span_lengths and k == 1:
            raise UsageError(f"--schedules {entry}: k = 1 runs the whole sequence; "
                             "--span-lengths cuts entries of k >= 2")
        if args.span_lengths and k != len(args.span_lengths):
            raise UsageError(f"--schedules {entry}: k = {k} but --span-lengths gives "
                             f"{len(args.span_lengths)} spans")
        try:
            if args.spread_output and is_searched(name):
                check_spread_output(name, args.loss_backward_in_forward, "--schedules")
        except ValueError as err:
            raise UsageError(f"--schedules {entry}: {err}") from None
        if k == 1 and cut == "fit":
            raise UsageError(f"--schedules {entry}: one span per micro-batch has no boundary to "
                             "fit; @fit needs k >= 2")
        if (cut or (args.partition if k > 1 else "")) == "fit" and is_searched(name):
            raise UsageError(f"--schedules {entry}: a searched schedule is placed before the "
                             "warm-up, with the compute or even cut's costs: use "
                             f"{spec}@compute")
        chunks = args.chunks if is_chunked(name) is not False else 1
        if is_chunked(name) and (chunks < 2 or (args.num_layers % (args.pp * chunks)
                                                and not uneven)):
            raise UsageError(f"--chunks {chunks}: {name} needs >= 2 chunks that divide the "
                             f"{args.num_layers} layers over --pp {args.pp}")
        if k > args.seq_length:
            raise UsageError(f"--schedules {entry}: k = {k} exceeds --seq-length")
        # --partition cuts the span schedules; one span per micro-batch is the whole sequence
        runs.append(Run(name, k, chunks, cut or (args.partition if k > 1 else "even")))
    if args.pipeline_schedule_file is not None:
        runs.append(_file_run(args))
    from seq1f1b.equivalence import check_stage_layers

    for run in runs:
        try:
            check_stage_layers(_case(args, run))
        except ValueError as err:
            raise UsageError(f"--schedules {run.label}: {err}") from None
    if not runs:
        raise UsageError("--schedules or --pipeline-schedule-file is required")
    if args.schedule_memory_cap is not None and not any(is_searched(run.schedule)
                                                          for run in runs):
        raise UsageError("--schedule-memory-cap: no searched schedule (seq1f1b-zb-auto) in "
                         "--schedules")
    if args.spread_output and not any(is_searched(run.schedule) for run in runs):
        raise UsageError("--spread-output: no searched schedule (seq1f1b-zb-auto) in "
                         "--schedules; a --pipeline-schedule-file has its O actions or not")
    for n, run in enumerate(runs):
        if is_searched(run.schedule):
            if run.chunks > 2:
                raise UsageError(f"--chunks {run.chunks}: {run.schedule} runs one or two chunks "
                                 "per rank")
            try:            # placed here: a cap no order fits is refused before any work
                plan = _plan(args, run)
                runs[n] = replace(run, placement=plan.placement, spread=plan.spread_output)
            except ScheduleError as err:
                raise UsageError(f"--schedules {run.label}: {err}") from None
    if any(run.partition == "fit" for run in runs) and args.warmup < 1:
        raise UsageError("a fit partition calibrates from the warm-up: --warmup must be >= 1")
    _check_runs(args, runs)
    return args, runs


def _check_model(args: argparse.Namespace) -> None:
    """The model flags pretrain_gpt.py refuses (megatron/training/arguments.py), refused alike
    before any process starts: RoPE and norm values, heads and widths tensor parallelism does
    not divide, activation recompute (seq1f1b.plan.costs.Recompute). settle_shape_flags has
    refused sizes below 1 and a hidden size the heads do not divide. Raises ValueError, one
    line naming the flag."""
    from megatron.training.arguments import check_range, check_rotary_percent
    from seq1f1b.plan.costs import Recompute

    for name in ("norm_epsilon", "rope_scaling_factor"):
        check_range(args, name, 0, low_inclusive=False)
    check_rotary_percent(args)
    for flag, value in (("--num-attention-heads", args.num_attention_heads),
                        ("--num-query-groups", args.num_query_groups),
                        ("--ffn-hidden-size", args.ffn_hidden_size)):
        if value is not None and value % args.tp:
            raise ValueError(f"{flag} {value} is not divisible by --tp {args.tp}")
    Recompute.from_flags(args.recompute_granularity, args.recompute_method,
                         args.recompute_num_layers)


def _check_runs(args: argparse.Namespace, runs: list[Run]) -> None:
    """What the runs' processes would refuse only after they start, refused before: the
    documents (seq1f1b.equivalence.check_documents, as check_equivalence.py), every span cut
    (seq1f1b/plan/partition.py, as the runtime cuts it) and uniform full recompute groups that
    do not divide a model chunk's layers (megatron-core would index past its last layer)."""
    from seq1f1b.equivalence import (check_documents, check_span_alignment, cost_model,
                                     stage_layers)
    from seq1f1b.plan import partition as span_partition
    from seq1f1b.plan.costs import Recompute
    from seq1f1b.plan.stage_layers import layers_per_virtual_stage
    from seq1f1b.runtime.forward_backward import MEGATRON_SCHEDULES

    try:
        check_documents(_case(args, runs[0]))
    except ValueError as err:
        raise UsageError(str(err)) from None
    model = cost_model(args)
    for run in runs:
        if run.schedule in MEGATRON_SCHEDULES:      # whole sequences, not cut by our runtime
            continue
        explicit = run.partition == "explicit"
        try:        # a fit entry's warm-up runs the compute cut
            check_span_alignment(_case(args, run))
            span_partition.partition(
                args.seq_length, run.splits, "compute" if run.partition == "fit" else
                run.partition, model, tp=args.tp, sequence_parallel=args.sequence_parallel,
                align=args.span_alignment,
                lengths=list(args.span_lengths) if explicit else None)
        except ValueError as err:
            raise UsageError(str(err) if explicit else f"--schedules {run.label}: {err}") from None
    recompute = Recompute.from_flags(args.recompute_granularity, args.recompute_method,
                                     args.recompute_num_layers)
    if recompute is None:
        return
    for run in runs:
        counts = layers_per_virtual_stage(args.num_layers, args.pp, run.chunks, run.group[1],
                                          stage_layers(_case(args, run)))
        try:
            recompute.check_chunk_layers(counts)
        except ValueError as err:
            raise UsageError(f"{err} (--schedules {run.label})") from None


def _file_run(args: argparse.Namespace) -> Run:
    """The entry of --pipeline-schedule-file (loaded: checked and registered)."""
    from seq1f1b.plan import registry, schedule_file

    try:
        schedule = schedule_file.load(args.pipeline_schedule_file)
        registry.build(schedule.name, args.pp, args.num_microbatches, schedule.splits,
                       schedule.chunks)
    except ValueError as err:           # ScheduleError too
        raise UsageError(str(err)) from None
    if args.num_layers % (args.pp * schedule.chunks) and not (
            args.decoder_first_pipeline_num_layers or args.decoder_last_pipeline_num_layers
            or args.pipeline_model_parallel_layout):
        raise UsageError(f"--num-layers {args.num_layers}: --pipeline-schedule-file "
                         f"{args.pipeline_schedule_file} needs a multiple of P x V = "
                         f"{args.pp * schedule.chunks}")
    if args.span_lengths and schedule.splits != len(args.span_lengths):
        raise UsageError(f"--pipeline-schedule-file {args.pipeline_schedule_file}: k = "
                         f"{schedule.splits} but --span-lengths gives {len(args.span_lengths)} "
                         "spans")
    return Run(schedule.name, schedule.splits, schedule.chunks,
               args.partition if schedule.splits > 1 else "even", spread=schedule.spread_output)


def is_searched(name: str) -> bool:
    """Whether schedule `name` is placed by a search under a memory budget."""
    from seq1f1b.plan import registry
    from seq1f1b.runtime.forward_backward import MEGATRON_SCHEDULES

    return name not in MEGATRON_SCHEDULES and registry.get(name).searched


def is_chunked(name: str) -> bool:
    from seq1f1b.equivalence import is_chunked as chunked

    return chunked(name)


# -- running ------------------------------------------------------------------------------------
def _case(args: argparse.Namespace, run: Run):
    from seq1f1b.equivalence import EquivalenceCase, case_fields

    return EquivalenceCase(**{**case_fields(args), "schedule": run.schedule,
                              "chunks": run.chunks, "splits": run.splits,
                              "partition": run.partition})


@dataclass
class Measured:
    """What one rank measured for one schedule."""

    pp_rank: int
    representative: bool          # DP rank 0 and TP rank 0: the one reported for its pp rank
    seconds: list[float]
    traces: list[list[tuple[str, float, float]]]     # per timed iteration, this rank's actions
    peak_saved_bytes: Optional[int]
    peak_device_bytes: Optional[int]
    span_bounds: tuple[tuple[int, int], ...] = ()     # the cut the timed iterations ran
    fit: Optional[str] = None                         # a fit entry: the fit it was cut by
    compute_s: list[float] = field(default_factory=list)  # per timed iteration: main-thread
    #                                                   CPU seconds of this rank's actions
    on_cuda: bool = False                             # the trace's clock is the GPU's


@dataclass(frozen=True)
class Round:
    """One round of a group (every schedule once): its iteration times and what the machine's
    other processes took meanwhile (rank 0's view)."""

    timed: bool
    labels: tuple[str, ...]
    seconds: tuple[float, ...]
    wall_s: float
    others_cpu_s: Optional[float]     # CPU seconds of other processes during the round


def _progress(index: int, count: int, round_: Round) -> None:
    """One line on stderr per round, as it ends (stdout keeps the table or the JSON)."""
    kind = "round" if round_.timed else "warm-up"
    times = ", ".join(f"{label} {seconds * 1e3:.0f} ms"
                      for label, seconds in zip(round_.labels, round_.seconds))
    others = ("" if round_.others_cpu_s is None else
              f"; others {round_.others_cpu_s / round_.wall_s:.2f} cores")
    print(f"{PROG}: {kind} {index}/{count}: {times}{others}", file=sys.stderr, flush=True)


def _fitted_cut(args: argparse.Namespace, run: Run, traces: list) -> tuple[tuple[int, ...], str]:
    """The fit partition from a fit entry's traced warm-up iterations on every rank (collective:
    the same result on all ranks)."""
    from seq1f1b.runtime.traced_iterations import calibrate_fit

    lengths, fit = calibrate_fit(_plan(args, run), traces, args.seq_length, args.tp,
                                 args.sequence_parallel, args.span_alignment)
    return lengths, fit.describe()


def _run_group(args: argparse.Namespace, runs: list[Run], weights: dict,
               batches: list) -> tuple[list[Measured], list[Round]]:
    """Time `runs` (all with the same chunk count) on one set of model chunks, round-robin: each
    round runs every schedule once, so a change of load on a shared machine hits all of them
    alike. Then one memory-metered iteration each. Rank 0 prints each round as it ends and
    returns the rounds (others' CPU from every process's /proc sample)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from seq1f1b import machine_load, platform
    from seq1f1b.equivalence import forward_step, ParallelLayout
    from seq1f1b.runtime.forward_backward import (MEGATRON_SCHEDULES, SpanSettings,
                                                  get_forward_backward_func, splits_backward)
    from seq1f1b.runtime.trace import ExecutionTrace

    # Split-backward linears when any schedule defers W: without a W key they back-propagate
    # exactly like megatron's, so the other schedules run unchanged on the same chunks.
    splitting = [run for run in runs if splits_backward(run.schedule)]
    case = _case(args, (splitting or runs)[0])
    chunked = case.chunks > 1
    layout = ParallelLayout(case, chunked, weights)
    dp_rank = parallel_state.get_data_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    representative = dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
    mine = batches[dp_rank * case.num_microbatches:(dp_rank + 1) * case.num_microbatches]

    cuts: dict[Run, tuple[tuple[int, ...], str]] = {}     # fit entries, after the warm-up
    budgets = {run: _budget(args, run) for run in runs}

    def settings_of(run: Run, trace: Optional[ExecutionTrace]) -> SpanSettings:
        if run.partition == "fit":          # compute until the warm-up has been fitted
            lengths = cuts[run][0] if run in cuts else None
            return SpanSettings(run.splits, "explicit" if lengths else "compute", lengths,
                                align=case.span_alignment, trace=trace, budget=budgets[run],
                                loss_backward_in_forward=case.loss_backward_in_forward)
        return SpanSettings(run.splits, run.partition,
                            tuple(case.span_lengths) if case.span_lengths else None,
                            align=case.span_alignment, trace=trace, budget=budgets[run],
                            loss_backward_in_forward=case.loss_backward_in_forward)

    def iteration(run: Run, trace: Optional[ExecutionTrace]) -> float:
        settings = settings_of(run, trace)
        for model in layout.chunks:
            model.zero_grad_buffer()
        iterators = [iter(mine) for _ in layout.chunks]
        function = get_forward_backward_func(run.schedule, settings)
        dist.barrier()
        start = time.perf_counter()
        function(forward_step_func=forward_step,
                 data_iterator=iterators if chunked else iterators[0],
                 model=layout.chunks if chunked else layout.chunks[0],
                 num_microbatches=case.num_microbatches, seq_length=case.seq_length,
                 micro_batch_size=case.micro_batch_size)
        torch.cuda.synchronize()        # a GPU may still be running what the host queued
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64,
                               device=platform.compute_device())     # NCCL: device tensors only
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    rounds: list[Round] = []

    def run_round(timed: bool, index: int, count: int, one) -> None:
        start = machine_load.sample()
        seconds = tuple(one(run, result) for run, result in zip(runs, measured))
        samples = [None] * dist.get_world_size()
        dist.all_gather_object(samples, (start, machine_load.sample()))
        if dist.get_rank() == 0:
            starts, ends = zip(*samples)
            cores = machine_load.others_cores(starts, ends)
            wall = ends[0].wall - starts[0].wall
            rounds.append(Round(timed, tuple(run.label for run in runs), seconds, wall,
                                None if cores is None else cores * wall))
            _progress(index, count, rounds[-1])

    measured = [Measured(pp_rank, representative, [], [], None, None,
                         on_cuda=torch.cuda.is_available()) for _ in runs]
    warm: dict[Run, list[ExecutionTrace]] = {run: [] for run in runs if run.partition == "fit"}

    def warm_up(run: Run, result: Measured) -> float:
        trace = ExecutionTrace() if run in warm else None
        seconds = iteration(run, trace)
        if trace is not None:
            warm[run].append(trace)
        return seconds

    def timed(run: Run, result: Measured) -> float:
        trace = None if run.schedule in MEGATRON_SCHEDULES else ExecutionTrace()
        seconds = iteration(run, trace)
        result.seconds.append(seconds)
        if trace is not None:
            result.traces.append([(a.action, a.start, a.end) for a in trace.actions])
            result.compute_s.append(sum(a.cpu for a in trace.actions))
            result.span_bounds = trace.span_bounds
        if run in cuts:
            result.fit = cuts[run][1]
        return seconds

    for n in range(args.warmup):
        run_round(False, n + 1, args.warmup, warm_up)
    for run, traces in warm.items():
        cuts[run] = _fitted_cut(args, run, traces)
    for n in range(args.iterations):
        run_round(True, n + 1, args.iterations, timed)
    for run, result in zip(runs, measured):
        if run.schedule not in MEGATRON_SCHEDULES:
            trace = ExecutionTrace(measure_memory=True)
            iteration(run, trace)
            result.peak_saved_bytes, result.peak_device_bytes = (trace.peak_saved_bytes,
                                                                 trace.peak_device_bytes)
    parallel_state.destroy_model_parallel()
    return measured, rounds


# -- analysis (rank 0) ---------------------------------------------------------------------------
def _plan_name(schedule: str) -> str:
    from seq1f1b.plan.memory import MEGATRON_PLANS

    return MEGATRON_PLANS.get(schedule, schedule)


def _cost_model(args: argparse.Namespace):
    """The benchmark's model as the cost model sees it."""
    from seq1f1b.equivalence import cost_model

    return cost_model(args)


def _budget(args: argparse.Namespace, run: Run):
    """A searched schedule's budget: this model's FLOPs as durations (at a nominal rate: only
    their proportions steer the search) and its fp32 bytes, with the run's cut (parse_args
    refuses a fit cut here), under --schedule-memory-cap or the schedule's default cap. None for
    a schedule that is not searched."""
    if not is_searched(run.schedule):
        return None
    from seq1f1b.equivalence import case_budget

    return case_budget(_case(args, run))


def _plan(args: argparse.Namespace, run: Run):
    """The plan `run` executes (its budget included), as the analysis replays it."""
    from seq1f1b.plan import registry

    return registry.build(_plan_name(run.schedule), args.pp, args.num_microbatches, run.splits,
                          run.chunks, budget=_budget(args, run))


def _memory_estimate(args: argparse.Namespace, run: Run, dp: int, lengths: tuple[int, ...]):
    """The estimator's figures for `run` with the spans it ran (`lengths`)."""
    from seq1f1b.plan.memory import TrainingSetup, estimate_memory
    from seq1f1b.runtime.forward_backward import MEGATRON_SCHEDULES

    setup = TrainingSetup(
        model=_cost_model(args), seq_length=args.seq_length, schedule=run.schedule, pp=args.pp,
        microbatches=args.num_microbatches, splits=run.splits, chunks=run.chunks, tp=args.tp,
        dp=dp, micro_batch_size=args.micro_batch_size,
        sequence_parallel=args.sequence_parallel, partition="explicit",
        span_lengths=lengths,
        precision="fp32", make_vocab_size_divisible_by=1,   # the benchmark's model: unpadded
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        schedule_memory_cap=args.schedule_memory_cap if is_searched(run.schedule) else None,
        spread_output=args.spread_output and is_searched(run.schedule),
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        loss_backward_in_forward=args.loss_backward_in_forward
        and run.schedule not in MEGATRON_SCHEDULES)
    return estimate_memory(setup)


def _uniform_replay(schedule):
    """The plan replayed with every span costing its share of a micro-batch on a rank (F 1, B 2
    per micro-batch and rank; a split backward is B 1 + W 1; an O nothing, as the output layer
    costs nothing extra in the last stage's F and B here): the ideal makespan and bubble the
    measured ones are held against."""
    from seq1f1b.plan.simulate import simulate, uniform_costs

    share = schedule.splits * schedule.chunks
    output = 0.0 if schedule.spread_output else None
    if schedule.split_backward:
        costs = uniform_costs(schedule, 1 / share, 1 / share, 1 / share, output)
    else:
        costs = uniform_costs(schedule, 1 / share, 2 / share, output=output)
    return simulate(schedule, costs)


def analyse(args: argparse.Namespace, runs: list[Run], measured: list[list[Measured]],
            dp: int, rounds: Optional[list[Round]] = None) -> tuple[dict, list]:
    """Rank 0: the per-schedule figures (JSON-ready) and (measured, simulated) report pairs.

    `measured[n][pp_rank]` is what pipeline rank `pp_rank` measured for run n; `rounds` what
    the machine's other processes took during each round (the noise figures).

    Work is compute: each rank's main-thread CPU seconds inside its actions (on a GPU the
    actions' CUDA-event time), the median over iterations, averaged over ranks. The busy wall
    time of the actions (waits for a neighbour excluded) also holds what the machine took from
    us: `descheduled` is that share. The bubble's gap to the ideal (every span its share of the
    micro-batch) splits into what the measured per-span costs explain (their replay) and what
    the runtime adds (measured minus that replay).
    """
    from seq1f1b import machine_load
    from seq1f1b.plan.simulate import (calibrated_costs, measured_report, simulate,
                                       span_timings)

    tokens = args.num_microbatches * args.micro_batch_size * args.seq_length * dp
    rows, pairs, plans = [], [], []
    for run, ranks in zip(runs, measured):
        schedule = _plan(args, run)
        plans.append(schedule)
        seconds = ranks[0].seconds
        median = statistics.median(seconds)
        row = {"schedule": run.schedule, "splits": run.splits, "chunks": run.chunks,
               "partition": run.partition, "label": run.label,
               "iteration_s": median, "iterations_s": seconds, "tokens_per_s": tokens / median,
               "best_iteration_s": min(seconds)}
        ideal = _uniform_replay(schedule)
        row.update(uniform_cost_makespan=ideal.makespan, uniform_cost_bubble=ideal.bubble_ratio)
        if ranks[0].traces:
            reports = [measured_report(schedule, [r.traces[n] for r in ranks])
                       for n in range(len(ranks[0].traces))]
            costs = calibrated_costs(schedule, reports)
            predicted = simulate(schedule, costs)
            bubble = statistics.median(r.bubble_ratio for r in reports)
            estimate = _memory_estimate(args, run, dp, tuple(
                end - start for start, end in ranks[0].span_bounds))
            peaks = [r.peak_saved_bytes for r in ranks]
            held = [s.metered_bytes for s in estimate.stages]
            row.update(
                measured_makespan_s=statistics.median(r.makespan for r in reports),
                measured_bubble=bubble, simulated_makespan_s=predicted.makespan,
                simulated_bubble=predicted.bubble_ratio,
                bubble_rel_diff=(bubble - predicted.bubble_ratio) / predicted.bubble_ratio
                if predicted.bubble_ratio else None,
                calibrated_forward_s=[list(r) for r in costs.forward],
                calibrated_backward_s=[list(r) for r in costs.backward],
                calibrated_output_s=list(costs.output) if costs.output is not None else None,
                peak_saved_bytes=peaks, peak_device_bytes=[r.peak_device_bytes for r in ranks],
                estimated_held_bytes=held,
                measured_over_estimated=[p / e if e else None for p, e in zip(peaks, held)],
                span_lengths=[end - start for start, end in ranks[0].span_bounds],
                spans=[vars(t) for t in span_timings(schedule, reports, ranks[0].span_bounds)])
            if ranks[0].fit is not None:
                row["fit"] = ranks[0].fit
            # Busy seconds of the average rank: what the spans' own cost grows (idle excluded).
            row["busy_per_rank_s"] = row["measured_makespan_s"] * (1 - bubble)
            if ranks[0].on_cuda:
                row["compute_per_rank_s"], row["descheduled"] = row["busy_per_rank_s"], None
            else:
                row["compute_s"] = [list(r.compute_s) for r in ranks]
                row["compute_per_rank_s"] = statistics.mean(
                    statistics.median(r.compute_s) for r in ranks)
                row["descheduled"] = max(0.0, 1 - row["compute_per_rank_s"]
                                         / row["busy_per_rank_s"])
            row["bubble_gap_from_costs"] = predicted.bubble_ratio - ideal.bubble_ratio
            row["bubble_gap_from_runtime"] = bubble - predicted.bubble_ratio
            pairs.append((reports[len(reports) // 2], predicted))
        rows.append(row)
    base = rows[0]
    for run, row in zip(runs, rows):
        # paired: per round, over the first schedule's figure in the same round (only runs of
        # its group share its rounds), the median over rounds
        same_rounds = run.group == runs[0].group
        row["ratio_to_first"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["best_ratio_to_first"] = base["best_iteration_s"] / row["best_iteration_s"]
        row["paired_ratio_to_first"] = (_paired(base["iterations_s"], row["iterations_s"])
                                        if same_rounds else None)
        if "simulated_makespan_s" in row and "simulated_makespan_s" in base:
            row["simulated_ratio_to_first"] = (base["simulated_makespan_s"]
                                               / row["simulated_makespan_s"])
        row["uniform_cost_ratio"] = base["uniform_cost_makespan"] / row["uniform_cost_makespan"]
        if "busy_per_rank_s" in row and "busy_per_rank_s" in base:
            row["wall_work_ratio_to_first"] = row["busy_per_rank_s"] / base["busy_per_rank_s"]
            row["work_ratio_to_first"] = row["compute_per_rank_s"] / base["compute_per_rank_s"]
            # the best ratio this work allows: the schedule's own gain over the work's growth
            row["ceiling"] = row["uniform_cost_ratio"] / row["work_ratio_to_first"]
        row["paired_work_ratio_to_first"] = (statistics.mean(
            _paired(mines, firsts) for firsts, mines in zip(base["compute_s"], row["compute_s"]))
            if same_rounds and "compute_s" in row and "compute_s" in base else None)
    control = _control(runs, plans)
    if control is not None:
        control = {"label": rows[control]["label"], "ratio": rows[control]["ratio_to_first"],
                   "work": rows[control].get("work_ratio_to_first")}
    config = {k: v for k, v in vars(args).items() if k not in ("json", "output", "plot")}
    return {"config": {**config, "dp": dp, "tokens_per_iteration": tokens,
                       "processor": machine_load.processor(), "control": control,
                       **_noise(args, rounds or [])}, "runs": rows}, pairs


def _paired(numerators: list[float], denominators: list[float]) -> float:
    """The median over rounds of numerator / denominator of the same round."""
    return statistics.median(n / d for n, d in zip(numerators, denominators))


def _control(runs: list[Run], plans: list) -> Optional[int]:
    """The first entry after the first that runs the first's plan (`plans[n]` is run n's) on
    the same chunks and code (e.g. seq1f1b:1 beside 1f1b; megatron-core's 1f1b beside ours is
    other code): the same computation, so its distance from 1.000 is the run's noise floor,
    what the machine's variation alone makes of a ratio (a shared host's neighbours slow a
    virtual machine's memory without showing in /proc). None where there is none."""
    from seq1f1b.plan.memory import MEGATRON_PLANS

    def executor(run: Run) -> bool:
        return run.schedule in MEGATRON_PLANS      # megatron-core's code, not our executor

    first = plans[0]
    for n, (run, plan) in enumerate(zip(runs[1:], plans[1:]), 1):
        if (run.group == runs[0].group and executor(run) == executor(runs[0])
                and plan.splits == first.splits and plan.programs == first.programs):
            return n
    return None


def _noise(args: argparse.Namespace, rounds: list[Round]) -> dict:
    """Cores the machine's other processes used over the timed rounds (and per round), and
    whether that is more than --noise-threshold: a noisy run."""
    timed = [r for r in rounds if r.timed]
    if not timed or any(r.others_cpu_s is None for r in timed):
        return {"others_cores": None, "others_cores_per_round": None, "noisy": None}
    cores = sum(r.others_cpu_s for r in timed) / sum(r.wall_s for r in timed)
    return {"others_cores": cores,
            "others_cores_per_round": [r.others_cpu_s / r.wall_s for r in timed],
            "noisy": cores > args.noise_threshold}


def _recompute_text(config: dict) -> str:
    granularity = config.get("recompute_granularity")
    if granularity != "full":
        return granularity or "none"
    layers = config.get("recompute_num_layers")      # None: the default, 1 layer
    return (f"full/{config.get('recompute_method') or 'uniform'}/"
            f"{1 if layers is None else layers}")


def _noise_text(config: dict) -> str:
    cores = config.get("others_cores")
    if cores is None:
        return "others' CPU: unknown (no /proc)"
    verdict = "NOISY" if config["noisy"] else "quiet"
    return (f"others' CPU during the timed rounds: {cores:.2f} cores ({verdict}; threshold "
            f"{config['noise_threshold']:.2f})")


def _control_text(config: dict) -> str:
    control = config.get("control")
    if not control:
        return ""
    work = "" if control["work"] is None else f", work {control['work']:.3f}"
    return (f"; noise floor: {control['label']} computes what {config['schedules'][0]} does, "
            f"yet its ratio is {control['ratio']:.3f}{work}: smaller differences from 1.000 "
            "are not measured")


def markdown(result: dict) -> str:
    def pct(value):
        return "-" if value is None else f"{value:.1%}"

    def mib(values):
        return "-" if not values or values[0] is None else f"{values[0] / 2**20:.1f}"

    def ratio(value):
        return "-" if value is None else f"{value:.3f}"

    def gap(row):
        if "bubble_gap_from_costs" not in row:
            return "-"
        return (f"{row['bubble_gap_from_costs'] * 100:+.1f}/"
                f"{row['bubble_gap_from_runtime'] * 100:+.1f}")

    c = result["config"]
    lines = [f"P={c['pp']} TP={c['tp']} DP={c['dp']} m={c['num_microbatches']} "
             f"b={c['micro_batch_size']} L={c['seq_length']} layers={c['num_layers']} "
             f"h={c['hidden_size']} heads={c['num_attention_heads']} vocab={c['vocab_size']} "
             f"partition={c['partition']} recompute={_recompute_text(c)} threads={c['threads']} "
             f"warmup={c['warmup']} "
             f"iterations={c['iterations']}; cpu: {c.get('processor', 'unknown')}; "
             f"{_noise_text(c)}{_control_text(c)}. iter ms, tokens/s, ratio: "
             "medians; ceiling: uniform-cost ratio / work, the ratio this work allows; paired "
             "ratio: median over rounds of the first schedule's time over this one's in the same "
             "round (same V and placement only: each such group runs its own rounds); best-of "
             "ratio: of the fastest iterations (interference only adds time); work: compute per "
             "rank (main-thread CPU time of the actions; on a GPU their CUDA-event time) over "
             "the first schedule's; paired work: per rank the median over rounds of that ratio "
             "in the same round, averaged over ranks (CPU only; a slow stretch of the machine "
             "then weighs on both); wall work: the same of the actions' busy wall time; "
             "descheduled: the share of that wall time that was not our compute (the machine's "
             "other processes); bubble ideal: every span its share of the micro-batch; bubble "
             "sim: the measured per-span costs replayed; gap pp: (sim - ideal) from the costs / "
             "(meas - sim) from the runtime", "",
             "| schedule | k | V | iter ms | tokens/s | ratio | ceiling | paired ratio | "
             "best-of ratio | sim ratio | uniform-cost ratio | work | paired work | wall work | "
             "descheduled | bubble ideal | bubble sim | bubble meas | gap pp costs/runtime | "
             "makespan meas/sim | rank-0 peak MiB | rank-0 est MiB |",
             "|" + "---|" * 22]
    for r in result["runs"]:
        makespans = (f"{r['measured_makespan_s'] * 1e3:.0f}/{r['simulated_makespan_s'] * 1e3:.0f}"
                     if "measured_makespan_s" in r else "-")
        lines.append(
            f"| {r['label']} | {r['splits']} | {r['chunks']} | {r['iteration_s'] * 1e3:.1f} | "
            f"{r['tokens_per_s']:.0f} | {r['ratio_to_first']:.3f} | {ratio(r.get('ceiling'))} | "
            f"{ratio(r.get('paired_ratio_to_first'))} | {r['best_ratio_to_first']:.3f} | "
            f"{ratio(r.get('simulated_ratio_to_first'))} | {r['uniform_cost_ratio']:.3f} | "
            f"{ratio(r.get('work_ratio_to_first'))} | "
            f"{ratio(r.get('paired_work_ratio_to_first'))} | "
            f"{ratio(r.get('wall_work_ratio_to_first'))} | {pct(r.get('descheduled'))} | "
            f"{pct(r.get('uniform_cost_bubble'))} | {pct(r.get('simulated_bubble'))} | "
            f"{pct(r.get('measured_bubble'))} | {gap(r)} | {makespans} | "
            f"{mib(r.get('peak_saved_bytes'))} | {mib(r.get('estimated_held_bytes'))} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    from seq1f1b.import_notices import hide_import_notices

    hide_import_notices()          # a refusal's one line would come after a dozen of them
    first_rank = os.environ.get("RANK", "0") == "0"
    try:
        args, runs = parse_args(argv)
    except UsageError as err:
        if first_rank:
            print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    from seq1f1b.distributed import init_distributed
    from seq1f1b.equivalence import global_batch, whole_model_weights

    torch.set_num_threads(args.threads)
    init_distributed()
    world = dist.get_world_size()
    if world % (args.tp * args.pp):
        if first_rank:
            print(f"{PROG}: error: world size {world} is not divisible by --tp {args.tp} x "
                  f"--pp {args.pp}", file=sys.stderr)
        return 2
    dp = world // (args.tp * args.pp)
    weights = whole_model_weights(_case(args, runs[0]))
    batches = global_batch(_case(args, runs[0]), dp)
    mine: list[Optional[Measured]] = [None] * len(runs)
    rounds: list[Round] = []
    for group in dict.fromkeys(run.group for run in runs):          # in order of appearance
        members = [n for n, run in enumerate(runs) if run.group == group]
        results, group_rounds = _run_group(args, [runs[n] for n in members], weights, batches)
        rounds += group_rounds
        for n, result in zip(members, results):
            mine[n] = result
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        measured = [sorted((process[n] for process in gathered if process[n].representative),
                           key=lambda m: m.pp_rank) for n in range(len(runs))]
        result, pairs = analyse(args, runs, measured, dp, rounds)
        text = json.dumps(result)
        if args.output:
            with open(args.output, "w") as out:
                out.write(text)
        print(text if args.json else markdown(result))
        if args.plot and pairs:
            from seq1f1b.plan import render

            render.plot_measured_vs_simulated(pairs, args.plot)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
