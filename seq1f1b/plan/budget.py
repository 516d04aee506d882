"""What a searched schedule optimises against: per-action costs and a per-rank memory cap.

The registry's builders take (P, m, k, V); a searched one (`seq1f1b-zb-auto`) also takes a
`ScheduleBudget`, which `registry.build(..., budget=...)` hands to it and to no other. The cap is
given on the command line as `--schedule-memory-cap`: bytes ("17GiB", "512MiB", "18253611008") or
a fraction of 1F1B's rank-0 peak of held activations and K/V ("0.5x"). A fraction needs that peak,
so `resolve_budget` turns a `MemoryCap` into bytes with the same cost model the simulator uses:
1F1B with one span per micro-batch on the same model, or P*k units under unit costs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Optional

from seq1f1b.plan.actions import Schedule, ScheduleError
from seq1f1b.plan.bounds import lower_bound
from seq1f1b.plan.costs import ModelConfig, Recompute
from seq1f1b.plan.partition import span_bounds
from seq1f1b.plan.simulate import OUTPUT_FORWARD_SHARE, SpanCosts, model_costs
from seq1f1b.plan.span_fit import SpanTimeFit
from seq1f1b.plan.stage_layers import EVEN, StageLayers

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6,
          "gb": 10**9}


@dataclass(frozen=True)
class MemoryCap:
    """A per-rank cap on held activations and K/V: `value` bytes, or `value` times 1F1B's rank-0
    peak when `relative`."""

    value: float
    relative: bool

    @classmethod
    def parse(cls, text: str) -> "MemoryCap":
        """"0.5x" (a fraction of 1F1B's rank-0 peak) or bytes with an optional unit ("17GiB")."""
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(x|[kmg]i?b|b)?\s*",
                             text.lower())
        if not match:
            raise ScheduleError(f"--schedule-memory-cap {text!r}: give bytes (e.g. 17GiB) or a "
                                "fraction of 1F1B's rank-0 peak (e.g. 0.5x)")
        number, unit = float(match.group(1)), match.group(2) or ""
        if number <= 0:
            raise ScheduleError(f"--schedule-memory-cap {text!r} must be positive")
        if unit == "x":
            return cls(number, True)
        return cls(number * _UNITS[unit], False)


@dataclass(frozen=True)
class ScheduleBudget:
    """Costs (None: unit costs) and a cap in the costs' memory unit (None: the schedule's
    default). A searched schedule built with a model's costs should be given them whether or
    not a cap is: model_budget does.

    `costs` are those of `placement` (None: the schedule's own at its chunk count); the search
    may also place on each of `alternatives`, (placement, its costs): a placement puts other
    stages on a rank, and with uneven first and last stages other layers in a stage. `only`
    restricts the search to one of them: a run pins the placement it chose at start-up
    (`pinned`), since its model chunks are built for it; the default cap still comes from the
    schedule's own placement's costs. An alternative whose costs spread the output layer (O
    actions, `SpanCosts.output`) is searched with it spread; `only_spread` pins that choice
    too. `anneal`: whether the search ends with its annealing walk (seconds a placement,
    schedules/anneal.py); a search over many candidates (plan.py --search-layout) compares
    them without it and anneals the one it keeps."""

    costs: Optional[SpanCosts] = None
    cap: Optional[float] = None
    placement: Optional[str] = None
    alternatives: tuple[tuple[str, SpanCosts], ...] = ()
    only: Optional[str] = None
    only_spread: Optional[bool] = None
    anneal: bool = True

    def options(self, restricted: bool = True) -> list[tuple[Optional[str], Optional[SpanCosts]]]:
        """Every (placement, costs) the search may take, this budget's own first; all of them
        when not `restricted` by `only`."""
        found = [(self.placement, self.costs)] + list(self.alternatives)
        if restricted and self.only is not None:
            found = [option for option in found if option[0] == self.only and (
                self.only_spread is None or spreads_output(option[1]) == self.only_spread)]
            if not found:
                raise ScheduleError(f"placement {self.only!r}: the budget has no costs for it")
        return found

    def costs_for(self, placement: str, spread_output: bool = False) -> Optional[SpanCosts]:
        """The costs of `placement` (a built schedule's), with the output layer spread or not
        as the schedule has it (this budget's own when none match)."""
        return next((costs for option, costs in self.options(restricted=False)
                     if option in (placement, None) and spreads_output(costs) == spread_output),
                    self.costs)

    def pinned(self, placement: str, spread_output: Optional[bool] = None) -> "ScheduleBudget":
        """This budget with the search restricted to `placement` (and to the output layer
        spread or kept, when `spread_output` is given)."""
        return replace(self, only=placement, only_spread=spread_output)


def spread_output_refusal(schedule: str, loss_backward_in_forward: bool,
                          schedule_flag: str) -> Optional[str]:
    """Why --spread-output cannot run with `schedule` (named by `schedule_flag`), or None: one
    rule for pretrain_gpt.py and the tools. Only a search chooses where the output layer runs;
    an O runs the layer's backward at once, so the loss's backward at F has nothing to do."""
    from seq1f1b.plan import registry          # registry imports this module
    if schedule not in registry.names() or not registry.get(schedule).searched:
        return (f"--spread-output: {schedule_flag} {schedule} is not searched; seq1f1b-zb-auto "
                "chooses where the output layer runs")
    if loss_backward_in_forward:
        return ("--loss-backward-in-forward with --spread-output: an O action runs the output "
                "layer's backward at once already")
    return None


def spreads_output(costs: Optional[SpanCosts]) -> bool:
    """Whether `costs` price the output layer as O actions (the layer spread over the ranks)."""
    return costs is not None and costs.output is not None


def resolve_budget(cap: Optional[MemoryCap], costs: Optional[SpanCosts],
                   reference_peak: Optional[float], pp: int, splits: int) -> ScheduleBudget:
    """The budget for `cap`: a fraction is taken of `reference_peak` (1F1B's rank-0 peak in the
    costs' bytes) or, under unit costs, of P*k units."""
    if cap is None:
        return ScheduleBudget(costs, None)
    if not cap.relative:
        if costs is None:
            raise ScheduleError("--schedule-memory-cap in bytes needs a model (--model or its "
                                "dimensions) to count bytes; give a fraction such as 0.5x")
        return ScheduleBudget(costs, cap.value)
    base = float(pp * splits) if costs is None else reference_peak
    if base is None:
        raise ScheduleError("--schedule-memory-cap: 1F1B's rank-0 peak is unknown")
    return ScheduleBudget(costs, cap.value * base)


def model_budget(name: str, pp: int, microbatches: int, splits: int, chunks: int,
                 cap: Optional[MemoryCap], costs_of: Callable[[Schedule, bool], SpanCosts]
                 ) -> Optional[ScheduleBudget]:
    """The budget of searched schedule `name` on a model: `costs_of(schedule, whole)` gives a
    schedule's SpanCosts (durations and bytes) with the spans of this run, or with one span of
    the whole sequence when `whole`. The searched schedule's own costs are those of its shape
    (registry.shape: same stages, same W split); a fraction is taken of 1F1B's rank-0 peak with
    one span per micro-batch on the same model. Without a cap the costs are still the model's
    and the cap is the schedule's default (seq1f1b-zb-auto: seq1f1b-zbv's peak on them); None
    for a schedule that is not searched and has no cap (a cap there is refused by build)."""
    from seq1f1b.plan import registry          # registry imports this module
    from seq1f1b.plan.simulate import simulate
    if cap is None and not registry.get(name).searched:
        return None
    shape = registry.shape(name, pp, microbatches, splits, chunks)
    costs = costs_of(shape, False)
    alternatives = []
    for placement in searched_placements(name, chunks):
        if placement != shape.placement:
            try:
                alternatives.append((placement,
                                     costs_of(replace(shape, placement=placement), False)))
            except ScheduleError:
                continue        # stages this placement cannot deal (uneven first/last flags)
    alternatives = tuple(alternatives)
    if cap is None:
        return ScheduleBudget(costs, None, shape.placement, alternatives)
    reference = None
    if cap.relative:
        one_f_one_b = registry.build("1f1b", pp, microbatches, 1, 1)
        report = simulate(one_f_one_b, costs_of(one_f_one_b, True))
        reference = report.ranks[0].peak_held_bytes
    return replace(resolve_budget(cap, costs, reference, pp, splits),
                   placement=shape.placement, alternatives=alternatives)


def searched_placements(name: str, chunks: int) -> tuple[str, ...]:
    """The placements searched schedule `name` chooses among at V = `chunks`: a loop on one
    chunk per rank; on two, its registered placement and a loop (interleaved)."""
    from seq1f1b.plan import registry
    info = registry.get(name)
    if not info.searched:
        return (info.placement,)
    return ("loop",) if chunks == 1 else tuple(dict.fromkeys((info.placement, "loop")))


def searched_lower_bound(schedule: Schedule, budget: ScheduleBudget, cap: float) -> float:
    """The least lower bound under `cap` (the cap the search placed under) over every placement
    (and the output layer kept or spread) the search of `schedule` could take under `budget`
    (the pinned one only, when pinned): its gap then says how far it is from the best schedule
    of any of them at that memory, not only of the one it chose."""
    own = searched_placements(schedule.name, schedule.chunks)[0]   # a budget's placement None
    return min(lower_bound(replace(schedule, placement=placement or own), costs, cap)
               for placement, costs in budget.options())


@dataclass(frozen=True)
class RunShape:
    """What a searched schedule's costs depend on in a run (trainer, benchmark): the model, how
    its sequence is cut and sharded (TP with SP, and CP: a cap in bytes is per GPU), and the
    bytes of one activation element."""

    model: ModelConfig
    seq_length: int
    span_lengths: tuple[int, ...]
    tp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    bytes_per_element: int = 2
    recompute: Optional[Recompute] = None
    stage_layers: StageLayers = EVEN
    cp: int = 1                 # context-parallel ranks per span: each holds 1/C of the bytes
    loss_backward_in_forward: bool = False   # the output layer's backward at F (early_loss)
    spread_output: bool = False     # also search with the output layer as O actions


NOMINAL_FLOPS_PER_SECOND = 312e12
"""The rate the model's FLOPs become durations at for a searched schedule: an A100's bf16 peak,
also `plan.py simulate`'s and `plan.py search`'s default and the estimator's. Only the
durations' proportions steer the search, but in floating point its ties (two orders of the
same makespan) break by rounding, which depends on the rate: every tool that shows or prices
the order pretrain_gpt.py will search must compute its durations at this one rate."""


def run_budget(name: str, pp: int, microbatches: int, chunks: int, cap: Optional[MemoryCap],
               shape: RunShape, fit: Optional[SpanTimeFit] = None
               ) -> Optional[ScheduleBudget]:
    """`model_budget` for a run of `shape`: the model's FLOP durations and bytes with the run's
    spans, or, with `fit` (the fit partition's measured times, span_fit.py), the measured
    durations: each span's F on the stages scaled so that they sum to the fit's F of that span,
    and B (with W) to its B, the model keeping each stage's share (the output layer's on the
    last). Without a cap the schedule's default cap on those costs (model_budget). With
    `shape.spread_output` every placement is offered again with the output layer as O actions
    on any rank (model_costs(spread_output=True)), under the same cap (the given one, or the
    default with the layer in the last stage): the search keeps the shorter, with `fit` too:
    an O is scaled with its span (_scaled_to_fit)."""

    def costs_of(schedule: Schedule, whole: bool, spread: bool = False) -> SpanCosts:
        costs = model_costs(schedule, shape.model,
                            [shape.seq_length] if whole else list(shape.span_lengths),
                            flops_per_second=NOMINAL_FLOPS_PER_SECOND, tp=shape.tp,
                            sequence_parallel=shape.sequence_parallel,
                            batch=shape.micro_batch_size,
                            bytes_per_element=shape.bytes_per_element, recompute=shape.recompute,
                            stage_layers=shape.stage_layers.for_reference() if whole
                            else shape.stage_layers, cp=shape.cp,
                            # the cap's reference is stock 1F1B's peak
                            loss_backward_in_forward=shape.loss_backward_in_forward and not whole,
                            spread_output=spread)
        if fit is None or whole:
            return costs
        return _scaled_to_fit(costs, fit, span_bounds(list(shape.span_lengths)))

    budget = model_budget(name, pp, microbatches, len(shape.span_lengths), chunks, cap, costs_of)
    if budget is not None and shape.spread_output:
        budget = with_output_spread(budget, name, pp, microbatches, len(shape.span_lengths),
                                    chunks, lambda schedule: costs_of(schedule, False, True))
    return budget


def with_output_spread(budget: ScheduleBudget, name: str, pp: int, microbatches: int,
                       splits: int, chunks: int, spread_costs: Callable[[Schedule], SpanCosts]
                       ) -> ScheduleBudget:
    """`budget` with every placement it offers offered again with the output layer as O actions
    on any rank (`spread_costs(schedule)`: a placement's costs so), under the same cap: the
    search keeps the shorter. One function for the trainer (run_budget) and the planner
    (memory.plan_schedule), so both search the same order."""
    from seq1f1b.plan import registry          # registry imports this module
    base = registry.shape(name, pp, microbatches, splits, chunks)
    return replace(budget, alternatives=budget.alternatives + tuple(
        (placement, spread_costs(replace(base, placement=placement)))
        for placement, _ in budget.options(restricted=False)))


def _scaled_to_fit(costs: SpanCosts, fit: SpanTimeFit, bounds: list[tuple[int, int]]
                   ) -> SpanCosts:
    """`costs` with each span's durations scaled to the fit's: its F on every stage by one
    factor, its B and W by another, so that they sum to the fit's F and B of the span. An O (the
    output layer spread) counts simulate.OUTPUT_FORWARD_SHARE to the span's F and the rest to
    its B, as measured spans count it, and is scaled by both in those shares: the span's F, B,
    W and O then sum to its measured F + B."""
    stages = range(len(costs.forward))
    weight = costs.weight
    output = costs.output or (0.0,) * len(bounds)
    share = OUTPUT_FORWARD_SHARE

    def column_scale(tables: list, span: int, extra: float, measured: float) -> float:
        modelled = sum(table[v][span] for table in tables for v in stages) + extra
        return measured / modelled if modelled > 0 else 0.0

    forward_scale, backward_scale = [], []
    for span, (start, end) in enumerate(bounds):
        measured_f, measured_b = fit.span_seconds(start, end)
        forward_scale.append(column_scale([costs.forward], span, output[span] * share,
                                          measured_f))
        backward_scale.append(column_scale([costs.backward] + ([weight] if weight else []),
                                           span, output[span] * (1 - share), measured_b))

    def scaled(table, scales: list[float]):
        return tuple(tuple(value * scales[span] for span, value in enumerate(row))
                     for row in table)

    return replace(costs, forward=scaled(costs.forward, forward_scale),
                   backward=scaled(costs.backward, backward_scale),
                   weight=scaled(weight, backward_scale) if weight else None,
                   output=None if costs.output is None else tuple(
                       value * (forward_scale[span] * share
                                + backward_scale[span] * (1 - share))
                       for span, value in enumerate(costs.output)))
