#!/usr/bin/env python3
"""Issue 26's claim over a grid: capped at any rival's peak, seq1f1b-zb-auto finishes no later.

  peer_grid.py --pp 2 4 8 16 --microbatches-per-rank 1 2 4 --splits 1 2 4 8 \\
               --costs unit skewed model model-even

For every (P, m = P x factor, k) and cost model (unit, skewed, 7B at 64K with TP 8 and SP on
spans of equal compute or of equal length): the rivals are torch's ZB-V, DualPipeV and
interleaved zero bubble (k = 1) and our fixed schedules at k, on a V or a loop. Capped at a
rival's peak, the search runs on two chunks per rank (a V or a loop, its choice) and on one (a
loop), and the shorter must finish no later. One line per case: the violations, the default
search's and the worst capped search's gap to the lower bound, and seconds; a summary line at
the end. Exit 1 when any case is violated.

`--exact SECONDS` also solves each case of at most `--exact-actions` actions exactly (CP-SAT,
plan/exact.py, started from the search's order on each placement) and prints how far the search
is from the proven optimum: the default search (two chunks, its cap) against the better of a V
and a loop of two, and the worst capped one (at that rival's peak) against the best of a V, a
loop of two and a loop of one (unproven: from the best order CP-SAT found in the time, and at
most how far above the optimum, from the least over those placements of the larger of CP-SAT's
bound and the one-rank bound, plan/rank_bound.py, given as much time again). The lower bound
sees memory only in the warm-up; under a tight cap the optimum is what says whether the search
or the memory is to blame. The summary gives the worst of those gaps, proven or at most.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.arguments import ArgumentParser  # noqa: E402
from seq1f1b.model_flags import positive_error  # noqa: E402
from seq1f1b.plan.budget import ScheduleBudget, searched_placements  # noqa: E402
from seq1f1b.plan.costs import preset  # noqa: E402
from seq1f1b.plan.exact import solve  # noqa: E402
from seq1f1b.plan.rank_bound import rank_bound  # noqa: E402
from seq1f1b.plan.registry import build  # noqa: E402
from seq1f1b.plan.schedules.greedy import Problem  # noqa: E402
from seq1f1b.plan.schedules.zero_bubble_v import default_cap  # noqa: E402
from seq1f1b.plan.simulate import simulate  # noqa: E402
from seq1f1b.schedule_compare import (SKEWED, UNIT, CostModel, ours, peer_rows,  # noqa: E402
                                      peer_violations, row, searched)

_7B_64K = CostModel(model=preset("7b"), seq_length=65536, tp=8, sequence_parallel=True)
COSTS = {"unit": CostModel(UNIT), "skewed": CostModel(SKEWED), "model": _7B_64K,
         "model-even": replace(_7B_64K, partition="even")}
"""The grid's costs: "model" cuts the sequence into spans of equal compute (the partition the
paper tunes), "model-even" into spans of equal length (plan.py's and the trainer's default)."""


PROG = "peer_grid.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The grid, refused (one line naming the flag on stderr, exit code 2) before any case
    runs when a parse fails or a number cannot make a case."""
    # megatron's parser: a parse error is one line, not the usage block
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=True)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--microbatches-per-rank", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--costs", nargs="+", choices=list(COSTS), default=list(COSTS))
    parser.add_argument("--exact", type=float, metavar="SECONDS",
                        help="also solve small cases exactly, each within SECONDS")
    parser.add_argument("--exact-actions", type=int, default=400,
                        help="largest case (F, B and W actions in all) solved exactly")
    args = parser.parse_args(argv)
    error = grid_error(args)
    if error is not None:
        parser.error(error)
    return args


def grid_error(args: argparse.Namespace) -> str | None:
    """The one-line error of a grid no case can be built from (None: fine): a count below 1
    fails deep in the schedule builders, a time limit of 0 s or less proves nothing (a gap of
    -100%) and one without end never returns, and an --exact-actions below 1 would quietly
    solve nothing."""
    for flag, values in (("--pp", args.pp), ("--microbatches-per-rank", args.microbatches_per_rank),
                         ("--splits", args.splits), ("--exact-actions", [args.exact_actions])):
        error = next(filter(None, (positive_error(flag, value) for value in values)), None)
        if error is not None:
            return error
    if args.exact is not None and not 0 < args.exact < math.inf:
        return f"--exact must be a positive number of seconds, got {args.exact:g}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    failed, worst, worst_exact = 0, (0.0, ""), (-1.0, "none")
    for kind in args.costs:
        costs = COSTS[kind]
        for pp in args.pp:
            for factor in args.microbatches_per_rank:
                for k in args.splits:
                    m, began = pp * factor, time.monotonic()

                    def rivals():
                        return peer_rows(pp, m, costs) + [row(s, costs) for s in ours(pp, m, k)]

                    violations, rows = peer_violations(pp, m, k, costs, rivals)
                    default = searched(pp, m, k, costs)
                    gap = max(r.gap for r in rows + [default])
                    if gap > worst[0]:
                        worst = (gap, f"{kind} P={pp} m={m} k={k}")
                    failed += bool(violations)
                    exact = ""
                    if args.exact is not None and 3 * 2 * pp * m * k <= args.exact_actions:
                        # rows[n] is the search capped at rival n's peak
                        capped, rival = max(zip(rows, rivals()), key=lambda pair: pair[0].gap)
                        cap = rival.peak
                        for label, found, limit, chunk_counts in (
                                ("default", default, None, (2,)),
                                ("worst capped", capped, cap, (2, 1))):
                            optimum = optimum_gap(pp, m, k, costs, found.makespan, limit,
                                                  chunk_counts, args.exact)
                            exact += f"; {label}: {optimum[1]}"
                            if optimum[0] > worst_exact[0]:
                                worst_exact = (optimum[0], f"{kind} P={pp} m={m} k={k} {label}")
                    print(f"{kind:6} P={pp:<2} m={m:<3} k={k}: {len(violations)} violations"
                          f"{' ' + '; '.join(violations) if violations else ''}"
                          f"; default gap {default.gap:.2%}, worst capped gap {gap:.2%}{exact}, "
                          f"{time.monotonic() - began:.1f} s", flush=True)
    print(f"{failed} violated cases; worst lower-bound gap {worst[0]:.2%} ({worst[1]})"
          + (f"; the search at most {max(worst_exact[0], 0.0):.2%} above the optimum in every "
             f"case solved (worst: {worst_exact[1]})"
             if args.exact is not None else ""))
    return 1 if failed else 0


def optimum_gap(pp: int, m: int, k: int, costs: CostModel, makespan: float,
                cap: float | None, chunk_counts: tuple[int, ...], seconds: float
                ) -> tuple[float, str]:
    """(how far `makespan` is above CP-SAT's proven optimum over every placement the search
    takes on `chunk_counts` chunks per rank under `cap` (None: the default of two chunks), or,
    when one of them is not proven in `seconds`, at most how far above the optimum it is (the
    bounds); the words to print). Unproven, the words also give how far the search is above the
    best order CP-SAT found: a search that a time-limited solver beats is weak there, whatever
    the bound says."""
    found = []
    for chunks in chunk_counts:
        for placement in searched_placements("seq1f1b-zb-auto", chunks):
            shape = replace(build("seq1f1b-zb-auto", pp, m, k, chunks), placement=placement)
            span_costs = costs.costs(shape)
            limit = cap if cap is not None else default_cap(
                Problem(pp, m, k, chunks, placement), span_costs)
            hint = build("seq1f1b-zb-auto", pp, m, k, chunks,
                         budget=ScheduleBudget(span_costs, limit, placement, (), placement))
            result = solve(shape, span_costs, limit, seconds, hint=hint)
            bound = result.bound if result.optimal else max(
                result.bound, rank_bound(shape, span_costs, limit, seconds, hint=hint).bound)
            # CP-SAT may find no order in the time (a large case on a busy machine): the
            # search's own on that placement is then the best known
            known = min(result.makespan, simulate(hint, span_costs).makespan)
            found.append((result, bound, known, f"{placement}, V={chunks}"))
    gap = makespan / min(known for _, _, known, _ in found) - 1.0
    unproven = [where for result, _, _, where in found if not result.optimal]
    if unproven:
        most = makespan / min(bound for _, bound, _, _ in found) - 1.0
        return most, (f"search {gap:+.2%} over CP-SAT's best in {seconds:g} s (not proven: "
                      f"{'; '.join(unproven)}), at most {most:+.2%} over the optimum (the "
                      f"bounds, one rank at a time)")
    return gap, f"search {gap:+.2%} over the optimum"


if __name__ == "__main__":
    sys.exit(main())
