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
from dataclasses import dataclass
from typing import Callable, Optional

from seq1f1b.plan.actions import Schedule, ScheduleError
from seq1f1b.plan.simulate import SpanCosts

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
    not a cap is: model_budget does."""

    costs: Optional[SpanCosts] = None
    cap: Optional[float] = None


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
    the whole sequence when `whole`. The searched schedule's own costs are those of
    its default build (same stages, same W split); a fraction is taken of 1F1B's rank-0 peak with
    one span per micro-batch on the same model. Without a cap the costs are still the model's
    and the cap is the schedule's default (seq1f1b-zb-auto: seq1f1b-zbv's peak on them); None
    for a schedule that is not searched and has no cap (a cap there is refused by build)."""
    from seq1f1b.plan import registry          # registry imports this module
    from seq1f1b.plan.simulate import simulate
    if cap is None and not registry.get(name).searched:
        return None
    shape = registry.build(name, pp, microbatches, splits, chunks)
    costs = costs_of(shape, False)
    if cap is None:
        return ScheduleBudget(costs, None)
    reference = None
    if cap.relative:
        one_f_one_b = registry.build("1f1b", pp, microbatches, 1, 1)
        report = simulate(one_f_one_b, costs_of(one_f_one_b, True))
        reference = report.ranks[0].peak_held_bytes
    return resolve_budget(cap, costs, reference, pp, splits)
