#!/usr/bin/env python3
"""Is my configuration exact? One iteration of a schedule against the unsplit model.

    torchrun --nproc-per-node 4 tools/check_equivalence.py --pp 2 --tp 2 --schedule seq1f1b \
        --splits 3 --partition compute
    torchrun --nproc-per-node 2 tools/check_equivalence.py --pp 2 --splits 3 \
        --reset-attention-mask --reset-position-ids --document-lengths 5 9 10
    torchrun --nproc-per-node 4 tools/check_equivalence.py --pp 2 --cp 2 --splits 3

prints JSON {"loss", "ref_loss", "max_rel_grad_diff", "params_compared", "passed", ...} on rank 0
and exits 1 when the loss or any gradient differs beyond the tolerances. DP = world / (TP x CP x PP).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROG = "check_equivalence.py"
COUNT_FLAGS = ("vocab_size", "micro_batch_size", "num_microbatches", "tp", "pp", "cp", "chunks",
               "splits", "recompute_num_layers", "span_alignment")
"""The layout and batch flags that count something (the model's own: model_flags.SIZE_FLAGS)."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    from megatron.training.arguments import ArgumentParser
    from seq1f1b.equivalence import add_model_flags
    from seq1f1b.runtime.forward_backward import schedule_names

    # megatron's parser: a parse error is one line and exit code 2, as the checks below
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            allow_abbrev=True)
    add = parser.add_argument
    add("--schedule", default=None, choices=schedule_names(),
        help="the schedule to check (default: seq1f1b)")
    add("--pipeline-schedule-file", metavar="FILE.csv", default=None,
        help="instead of --schedule: the schedule in this file (seq1f1b/plan/schedule_file.py), "
             "checked before any work; --pp, --num-microbatches, --splits and --chunks are the "
             "file's (given ones must agree)")
    add_model_flags(parser)
    add("--cp", type=int, default=1,
        help="context-parallel size (Ulysses all-to-all around the span attention)")
    add("--init-method-std", type=float, default=0.2,
        help="weight init std (0.2: sharp attention, so a wrong position or K/V shows)")
    add("--hidden-dropout", type=float, default=0.0)
    add("--attention-dropout", type=float, default=0.0)
    add("--against-no-recompute", action="store_true",
        help="compare with the same run without activation recompute (use with dropout > 0)")
    add("--seed", type=int, default=1234)
    add("--against", choices=schedule_names(), default=None,
        help="compare with this schedule on the same chunks and data instead of the unsplit "
             "model (e.g. --schedule 1f1b --against megatron-1f1b)")
    add("--schedule-memory-cap", metavar="CAP", default=None,
        help="searched schedules (seq1f1b-zb-auto): per-rank cap on held activations and K/V, "
             "bytes or a fraction of 1F1B's rank-0 peak (e.g. 0.5x), placed with this model's "
             "FLOP and byte costs")
    add("--loss-tolerance", type=float, default=1e-6)
    add("--grad-tolerance", type=float, default=1e-5)
    add("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args(argv)
    if args.span_lengths:
        args.partition = "explicit"
    from seq1f1b.equivalence import (check_budget, check_documents, check_layout,
                                     check_spread_output, settle_shape_flags)
    try:
        check_numbers(args)
        settle_shape_flags(args)
        if args.pipeline_schedule_file is not None:
            _take_schedule_file(args, parser)
        args.schedule = args.schedule or "seq1f1b"
        check_documents(case_from_args(args))
        if args.spread_output:
            check_spread_output(args.schedule, args.loss_backward_in_forward, "--schedule")
        check_layout(case_from_args(args))
        check_budget(case_from_args(args))
    except ValueError as err:      # one line, before any process group exists (ScheduleError too)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)
    return args


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse (ValueError, one line naming the flag) a number no case can run with, before any
    process group or reference run: a count below 1 would divide by zero or shape an empty
    tensor inside the ranks, a negative tolerance could never pass, an empty memory cap would
    read as none."""
    from megatron.training.arguments import check_range
    from seq1f1b.model_flags import sizes_error
    from seq1f1b.plan.budget import MemoryCap

    error = sizes_error(args, COUNT_FLAGS)
    if error is not None:
        raise ValueError(error)
    check_range(args, "init_method_std", 0, low_inclusive=False)
    for name in ("hidden_dropout", "attention_dropout"):
        check_range(args, name, 0, 1)
    for name in ("loss_tolerance", "grad_tolerance"):
        check_range(args, name, 0)
    if args.schedule_memory_cap is not None:
        MemoryCap.parse(args.schedule_memory_cap)


def _take_schedule_file(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--pipeline-schedule-file: load (check, register) it; its name and shape become the
    case's. A shape flag given other than its default must be the file's."""
    from seq1f1b.plan import schedule_file

    path = args.pipeline_schedule_file
    if args.schedule is not None:
        raise ValueError("--pipeline-schedule-file replaces --schedule: give one of them")
    if args.spread_output:
        raise ValueError("--spread-output: a --pipeline-schedule-file has its O actions or not; "
                         "drop the flag")
    schedule = schedule_file.load(path)
    dests = ("pp", "num_microbatches", "splits", "chunks")
    schedule_file.check_shape(schedule, {
        f"--{dest.replace('_', '-')}": None if getattr(args, dest) == parser.get_default(dest)
        else getattr(args, dest) for dest in dests})
    args.schedule, args.pp, args.num_microbatches, args.splits, args.chunks = (
        schedule.name, schedule.pp, schedule.microbatches, schedule.splits, schedule.chunks)


def case_from_args(args: argparse.Namespace):
    from seq1f1b.equivalence import EquivalenceCase, case_fields

    return EquivalenceCase(**case_fields(args))


def main(argv: Optional[list[str]] = None) -> int:
    from seq1f1b.import_notices import hide_import_notices

    hide_import_notices()          # a refusal's one line would come after a dozen of them
    args = parse_args(argv)
    from seq1f1b.distributed import init_distributed
    from seq1f1b.equivalence import run_case

    init_distributed()
    import torch.distributed as dist

    try:
        result = run_case(case_from_args(args))
    except ValueError as err:
        if dist.get_rank() == 0:
            print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if dist.get_rank() == 0:
        payload = {k: v for k, v in vars(result).items() if k != "case"}
        print(json.dumps(payload if args.json else {**payload, "case": result.case}))
    dist.destroy_process_group()
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
