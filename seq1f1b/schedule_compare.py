"""Our schedules beside the peers' (torch's ZB-V, DualPipeV, interleaved zero bubble) on the
same costs: makespan, bubble, each rank's peak held memory and the gap to a lower bound
(plan.bounds). `plan.py compare` prints one problem; `peer_violations` checks the search's claim
over a grid (the unit test on a small one, tools/plan.py compare --grid on the full one).

Costs come from a `CostModel`: "unit" (F = B = W = 1 per micro-batch on a rank's share of the
layers), "skewed" (F 1, B 1.5, W 0.5) or a model (costs.py through simulate.model_costs). Unit
and skewed costs are per micro-batch and stage (a chunk of a V or an interleaved rank holds half
a rank's layers and costs half), split evenly over the k spans; a micro-batch's activations on
one rank weigh 1 and there is no K/V. So schedules of any k and V are priced alike.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from seq1f1b.plan import registry
from seq1f1b.plan.actions import Schedule, ScheduleError
from seq1f1b.plan.bounds import gap_to_bound, lower_bound
from seq1f1b.plan.budget import ScheduleBudget, searched_lower_bound, searched_placements
from seq1f1b.plan.context_parallel import span_alignment
from seq1f1b.plan.costs import ModelConfig
from seq1f1b.plan.partition import partition
from seq1f1b.plan.schedules.zero_bubble_v import searched_cap
from seq1f1b.plan.simulate import SpanCosts, Table, model_costs, simulate
from seq1f1b.torch_peers import PEERS, peer_schedule

SKEWED = (1.0, 1.5, 0.5)
UNIT = (1.0, 1.0, 1.0)


@dataclass(frozen=True)
class CostModel:
    """Per-action costs for any schedule: `weights` (F, B, W per micro-batch and rank) or a
    model with its sequence and parallel layout."""

    weights: Optional[tuple[float, float, float]] = None
    model: Optional[ModelConfig] = None
    seq_length: int = 0
    tp: int = 1
    sequence_parallel: bool = False
    flops_per_second: float = 312e12
    partition: str = "compute"
    cp: int = 1                     # context-parallel size: spans are multiples of it
    align: int = 1                  # spans are multiples of this too
    spread_output: bool = False     # a model's output layer as O actions (for every schedule)

    def costs(self, schedule: Schedule) -> SpanCosts:
        if self.model is not None:
            spans = partition(self.seq_length, schedule.splits, self.partition, self.model,
                              tp=self.tp, sequence_parallel=self.sequence_parallel,
                              align=span_alignment(self.cp, self.tp, self.sequence_parallel,
                                                   self.align))
            return model_costs(schedule, self.model, spans,
                               flops_per_second=self.flops_per_second, tp=self.tp,
                               sequence_parallel=self.sequence_parallel, cp=self.cp,
                               spread_output=self.spread_output or schedule.spread_output)
        share = 1.0 / (schedule.chunks * schedule.splits)

        def table(value: float) -> Table:
            return tuple((value * share,) * schedule.splits for _ in range(schedule.num_stages))

        f, b, w = self.weights
        zero = table(0.0)
        if not schedule.split_backward:
            return SpanCosts(table(f), table(b + w), None, table(1.0), zero, zero, zero)
        return SpanCosts(table(f), table(b), table(w), table(1.0), zero, zero, zero)


@dataclass(frozen=True)
class Row:
    """One schedule of a comparison."""

    name: str
    splits: int
    chunks: int
    placement: str
    makespan: float
    bubble: float
    peaks: tuple[float, ...]
    lower_bound: float

    @property
    def peak(self) -> float:
        return max(self.peaks)

    @property
    def gap(self) -> float:
        """How far the makespan is above the lower bound, as a fraction of it."""
        return gap_to_bound(self.makespan, self.lower_bound)


def row(schedule: Schedule, costs: CostModel, label: Optional[str] = None,
        bound: Optional[float] = None) -> Row:
    """`schedule` replayed on `costs`, its gap taken to `bound` (None: the lower bound of its
    own placement)."""
    span_costs = costs.costs(schedule)
    report = simulate(schedule, span_costs)
    return Row(label or schedule.name, schedule.splits, schedule.chunks, schedule.placement,
               report.makespan,
               report.bubble_ratio, tuple(r.peak_held_bytes for r in report.ranks),
               lower_bound(schedule, span_costs) if bound is None else bound)


def peer_rows(pp: int, microbatches: int, costs: CostModel) -> list[Row]:
    """The peers torch has a generator for at (P, m), k = 1."""
    schedules = [peer_schedule(name, pp, microbatches) for name in PEERS]
    return [row(s, costs) for s in schedules if s is not None]


def ours(pp: int, microbatches: int, splits: int) -> list[Schedule]:
    """Every fixed schedule of the registry at (P, m, k), V = 2 where it interleaves."""
    out = []
    for name in registry.names():
        info = registry.get(name)
        if info.searched:
            continue
        try:
            out.append(registry.build(name, pp, microbatches, splits, 2 if info.chunked else 1))
        except ScheduleError:
            continue          # a shape this family does not build (e.g. interleaving's m)
    return out


def searched(pp: int, microbatches: int, splits: int, costs: CostModel,
             cap: Optional[float] = None, label: Optional[str] = None, chunks: int = 2) -> Row:
    """seq1f1b-zb-auto searched on `costs` under `cap` (None: its default) with V = `chunks`:
    on two chunks it chooses a V or a loop, on one it places a loop. Its gap is to the least
    bound of the placements it chose among, under the same cap."""
    budget = _budget(pp, microbatches, splits, costs, cap, chunks)
    schedule = registry.build("seq1f1b-zb-auto", pp, microbatches, splits, chunks, budget=budget)
    limit = searched_cap(pp, microbatches, splits, chunks, budget)
    return row(schedule, costs, label, searched_lower_bound(schedule, budget, limit))


def searched_schedule(pp: int, microbatches: int, splits: int, costs: CostModel,
                      cap: Optional[float] = None, chunks: int = 2) -> Schedule:
    """seq1f1b-zb-auto as `searched` builds it, each placement it may take priced by `costs`."""
    return registry.build("seq1f1b-zb-auto", pp, microbatches, splits, chunks,
                          budget=_budget(pp, microbatches, splits, costs, cap, chunks))


def _budget(pp: int, microbatches: int, splits: int, costs: CostModel, cap: Optional[float],
            chunks: int) -> ScheduleBudget:
    shape = registry.build("seq1f1b-zb-auto", pp, microbatches, splits, chunks)
    alternatives = tuple((placement, costs.costs(replace(shape, placement=placement)))
                         for placement in searched_placements("seq1f1b-zb-auto", chunks)
                         if placement != shape.placement)
    return ScheduleBudget(costs.costs(shape), cap, shape.placement, alternatives)


def best_searched(pp: int, microbatches: int, splits: int, costs: CostModel, cap: float,
                  label: Optional[str] = None) -> Row:
    """The shorter of seq1f1b-zb-auto on two chunks and on one, both under `cap`, its gap
    taken to the least bound of all three placements (a V, a loop of two, a loop of one)."""
    rows = [searched(pp, microbatches, splits, costs, cap, label, chunks) for chunks in (2, 1)]
    return replace(min(rows, key=lambda r: r.makespan),
                   lower_bound=min(r.lower_bound for r in rows))


def compare(pp: int, microbatches: int, splits: int, costs: CostModel,
            spread_output: bool = False) -> list[Row]:
    """Our fixed schedules at k, the peers at k = 1, and the search under its default cap on
    two chunks and on one, and capped at each peer's peak (with k spans, the better of two
    chunks and one); with `spread_output` (a model's costs), also the search on two chunks with
    the output layer as O actions on any rank, under the default cap of the search without."""
    rows = [row(s, costs) for s in ours(pp, microbatches, splits)]
    peers = peer_rows(pp, microbatches, costs)
    rows += peers
    rows += [searched(pp, microbatches, splits, costs, chunks=chunks) for chunks in (2, 1)]
    if spread_output:
        cap = searched_cap(pp, microbatches, splits, 2,
                           _budget(pp, microbatches, splits, costs, None, 2))
        rows.append(searched(pp, microbatches, splits, replace(costs, spread_output=True), cap,
                             "seq1f1b-zb-auto, output layer spread"))
    for peer in peers:
        rows.append(best_searched(pp, microbatches, splits, costs, peer.peak,
                                  f"seq1f1b-zb-auto @ {peer.name} peak"))
    return rows


def peer_violations(pp: int, microbatches: int, splits: int, costs: CostModel,
                    rivals: Callable[[], list[Row]]) -> tuple[list[str], list[Row]]:
    """Each rival the search loses to: capped at the rival's peak, seq1f1b-zb-auto (k spans)
    must hold no more and finish no later. Returns (violations, the searched rows: one per
    rival, in the rivals' order)."""
    violations, rows, by_cap = [], [], {}
    for rival in rivals():
        if rival.peak not in by_cap:
            by_cap[rival.peak] = best_searched(pp, microbatches, splits, costs, rival.peak,
                                               f"seq1f1b-zb-auto @ {rival.name}")
        found = by_cap[rival.peak]
        rows.append(found)
        if found.peak > rival.peak * (1 + 1e-9) or \
                found.makespan > rival.makespan * (1 + 1e-9):
            violations.append(f"P={pp} m={microbatches} k={splits}: {found.name} "
                              f"{found.makespan:.6g} (peak {found.peak:.6g}) vs {rival.name} "
                              f"{rival.makespan:.6g} (peak {rival.peak:.6g})")
    return violations, rows
