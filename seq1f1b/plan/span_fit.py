"""Span costs fitted to measured time: what `--seq1f1b-partition fit` balances.

The compute partition balances FLOPs by a GPU's cost model, where a span's backward costs twice its
forward. Where real costs differ (on a CPU the attention backward dominates: a run of the
README's benchmark measured forward 0.095-0.108 s but backward 0.26-0.74 s over four compute-
balanced spans), spans balanced in FLOPs are unbalanced in time and most of the bubble's gain is
lost. So this module fits, per op (F and B; B includes W when the backward is not split), a time
per token and a time per causal query-key pair,

    t(span) = per_token * s + per_pair * (E^2 - S^2) / 2      (span [S, E), s = E - S tokens)

by least squares on relative error over measured spans, and the fit partition cuts where F + B
is balanced (`partition.partition(..., method="fit")`, the compute partition's closed form with
these coefficients). Spans of one cut sequence mix the two terms in different proportions, the
first mostly per-token work, the last mostly attention, which separates them; a fixed cost per
span (launches, p2p latency) cannot be told apart from the per-token term when the measured
spans are equally long, and it moves no boundary (every span pays it once).

Timings come from any JSON holding span records `{"start", "end", "forward_s", "backward_s"}`:
`tools/device_check.py`'s stage runs, `tools/benchmark.py --json` output, or the trainer's
calibration iterations.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from seq1f1b.plan.actions import ScheduleError

_KEYS = ("start", "end", "forward_s", "backward_s")


@dataclass(frozen=True)
class SpanTiming:
    """Measured seconds of one span's F and B (summed over the stages it ran on)."""

    start: int
    end: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class OpFit:
    """Seconds per token and per causal query-key pair of one op."""

    per_token: float
    per_pair: float

    def seconds(self, start: int, end: int) -> float:
        return self.per_token * (end - start) + self.per_pair * (end * end - start * start) / 2


@dataclass(frozen=True)
class SpanTimeFit:
    """F and B fitted to measured spans, and how well they fit."""

    forward: OpFit
    backward: OpFit
    worst_error: float          # largest |fitted - measured| / measured over all F and B times
    samples: int

    @property
    def per_token(self) -> float:
        """Seconds per token of F + B: the balanced cost's linear coefficient."""
        return self.forward.per_token + self.backward.per_token

    @property
    def per_pair(self) -> float:
        """Seconds per causal query-key pair of F + B: the quadratic coefficient."""
        return self.forward.per_pair + self.backward.per_pair

    def span_seconds(self, start: int, end: int) -> tuple[float, float]:
        """(F, B) seconds the fit predicts for span [start, end)."""
        return self.forward.seconds(start, end), self.backward.seconds(start, end)

    def describe(self) -> str:
        return (f"F {self.forward.per_token:.3g} s/token + {self.forward.per_pair:.3g} s/pair, "
                f"B {self.backward.per_token:.3g} s/token + {self.backward.per_pair:.3g} s/pair, "
                f"fitted to {self.samples} spans within {self.worst_error:.0%}")


def _fit_op(features: np.ndarray, times: np.ndarray) -> tuple[OpFit, float]:
    """Non-negative least squares on relative error (two unknowns: a clipped coefficient is
    dropped and the other refitted alone)."""
    scaled = features / times[:, None]
    coefficients, *_ = np.linalg.lstsq(scaled, np.ones_like(times), rcond=None)
    if (coefficients < 0).any():
        keep = int(np.argmax(coefficients))
        column = scaled[:, keep]
        coefficients = np.zeros(2)
        coefficients[keep] = column.sum() / (column @ column)
    worst = float(np.max(np.abs(features @ coefficients - times) / times))
    return OpFit(float(coefficients[0]), float(coefficients[1])), worst


def fit_span_times(timings: Iterable[SpanTiming]) -> SpanTimeFit:
    """The fit of F and B over `timings` (ScheduleError when they cannot determine it)."""
    timings = list(timings)
    if len(timings) < 2:
        raise ScheduleError(f"a time fit needs at least 2 measured spans, got {len(timings)}")
    bad = [t for t in timings if not (0 <= t.start < t.end) or t.forward_s <= 0
           or t.backward_s <= 0]
    if bad:
        raise ScheduleError(f"measured span {bad[0]} has no tokens or no positive time")
    features = np.array([[t.end - t.start, (t.end ** 2 - t.start ** 2) / 2] for t in timings],
                        dtype=float)
    forward, forward_error = _fit_op(features, np.array([t.forward_s for t in timings]))
    backward, backward_error = _fit_op(features, np.array([t.backward_s for t in timings]))
    if forward.per_token + backward.per_token + forward.per_pair + backward.per_pair <= 0:
        raise ScheduleError("the measured span times give no positive cost")
    return SpanTimeFit(forward, backward, max(forward_error, backward_error), len(timings))


def _records(node: object) -> Iterator[dict]:
    if isinstance(node, dict):
        if all(key in node for key in _KEYS):
            yield node
        else:
            for value in node.values():
                yield from _records(value)
    elif isinstance(node, list):
        for value in node:
            yield from _records(value)


def read_span_timings(path: str | Path, flag: str = "--calibration") -> list[SpanTiming]:
    """Every span record in the JSON file at `path` (ScheduleError naming `flag` and the file
    when it is unreadable or holds none)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ScheduleError(f"{flag} {path}: not a readable JSON file ({err})") from None
    timings = [SpanTiming(int(r["start"]), int(r["end"]), float(r["forward_s"]),
                          float(r["backward_s"])) for r in _records(data)]
    if not timings:
        raise ScheduleError(f"{flag} {path}: no measured spans (records with "
                            f"{', '.join(_KEYS)}: device_check.py's stage runs or benchmark.py "
                            "--json output)")
    return timings
