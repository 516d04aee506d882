"""Span boundaries: how a sequence of L tokens is cut into k spans.

- "even": equal lengths. Later spans attend to longer prefixes, so they cost more.
- "compute": FLOP-balanced (the paper's "uniform_comp"). With the model's cumulative forward cost
  C(x) = a*x + b*x^2/2 of the prefix [0, x) (costs.model_forward_flops telescopes to exactly this),
  the boundary before span j is the root of C(x) = C(L) - (k - j) * C(L)/k, solved in closed form
  from the end of the sequence backwards: the last k-1 spans each get C(L)/k, the first span takes
  the remainder. Each boundary is rounded to the nearest alignment multiple on its own, so rounding
  errors do not accumulate into the first span. Spans shrink towards the end of the sequence.
- "fit": balanced in measured time (span_fit.py): the same closed form with the per-token and
  per-pair seconds of F + B fitted to a calibration run instead of FLOPs.
- "explicit": lengths given by the user, checked.

Alignment: every span is a multiple of `unit = lcm(align, tp)` when sequence parallelism is on
(each span is scattered over the TP ranks along the sequence) and of `align` otherwise. `align`
defaults to 1; kernels prefer 64 or 128 on GPUs, which the caller may ask for.

Packed documents (--reset-attention-mask): these costs, and the simulator's, are those of full
causal attention over the whole prefix. That is what eager and sdpa compute (a masked entry costs
as much as a seen one), so for them "compute" stays balanced. flash and flex skip the masked
blocks: a span then costs its tokens times their own documents' prefixes, so "compute" gives the
later spans too little, the more so the shorter the documents; with documents much shorter than a
span every token costs about the same and "even" is the balanced cut.
"""
from __future__ import annotations

import math
from itertools import accumulate

from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.context_parallel import span_alignment
from seq1f1b.plan.costs import ModelConfig, model_forward_flops
from seq1f1b.plan.span_fit import SpanTimeFit

METHODS = ("even", "compute", "fit", "explicit")


def alignment_unit(tp: int = 1, sequence_parallel: bool = False, align: int = 1) -> int:
    """The multiple every span length must be (context_parallel.span_alignment without CP)."""
    for flag, value in (("--tp", tp), ("--align", align)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{flag} must be a positive integer, got {value!r}")
    return span_alignment(1, tp, sequence_parallel, align)


def span_multiple_error(seq_length: int, splits: int, lengths, unit: int, why: str,
                        prefix: str) -> str | None:
    """The one-line error where explicit span `lengths` are not multiples of `unit`, or where
    (without them) the sequence cannot hold `splits` spans of its multiples; None where fine.
    `why` names what asks for the multiple; `prefix` is how the caller spells its span flags
    (the trainer's "--seq1f1b-", the tools' "--")."""
    if lengths and any(length % unit for length in lengths):
        return (f"{prefix}span-lengths {' '.join(map(str, lengths))}: {why} must divide every "
                "span")
    if not lengths and (seq_length % unit or seq_length // unit < splits):
        return (f"--seq-length {seq_length}: {why} must divide it into at least {prefix}splits "
                f"{splits} spans of multiples of {unit} tokens")
    return None


def span_bounds(lengths: list[int]) -> list[tuple[int, int]]:
    """[(start, end), ...] of consecutive spans of the given lengths, starting at token 0."""
    ends = list(accumulate(lengths))
    return [(end - length, end) for length, end in zip(lengths, ends)]


def span_flops(model: ModelConfig, lengths: list[int]) -> list[float]:
    """Whole-model forward FLOPs of each span of a sequence cut into `lengths`."""
    return [model_forward_flops(model, end - start, end) for start, end in span_bounds(lengths)]


def imbalance(values: list[float]) -> float:
    """max / mean: 1.0 is perfect balance."""
    return max(values) * len(values) / sum(values)


def partition(seq_length: int, splits: int, method: str, model: ModelConfig | None = None,
              tp: int = 1, sequence_parallel: bool = False, align: int = 1,
              lengths: list[int] | None = None, fit: SpanTimeFit | None = None) -> list[int]:
    """Span lengths for a sequence of `seq_length` tokens cut into `splits` spans by `method`
    ("fit" needs `fit`, the span costs fitted to measured time)."""
    unit = alignment_unit(tp, sequence_parallel, align)
    if not isinstance(seq_length, int) or seq_length < 1:
        raise ScheduleError(f"--seq-length must be a positive integer, got {seq_length!r}")
    if not isinstance(splits, int) or splits < 1:
        raise ScheduleError(f"--splits must be a positive integer, got {splits!r}")
    if method == "explicit":
        return _explicit(seq_length, splits, unit, lengths)
    if lengths is not None:
        raise ScheduleError(f"--span-lengths is only used with the explicit method, not {method!r}")
    if seq_length % unit:
        raise ScheduleError(f"--seq-length {seq_length} is not a multiple of the span alignment "
                            f"{unit} ({_unit_reason(tp, sequence_parallel, align)})")
    units = seq_length // unit
    if splits > units:
        raise ScheduleError(f"--splits {splits} is more than the {units} spans of {unit} tokens "
                            f"that --seq-length {seq_length} holds")
    if method == "even":
        return _even(units, splits, unit)
    if method == "compute":
        if model is None:
            raise ScheduleError("--method compute needs a model (--model or its dimensions)")
        # C(x) = a*x + b*x^2/2: a the per-token FLOPs (GEMMs and logits), b per causal pair.
        b = model_forward_flops(model, 2, 2) - 2 * model_forward_flops(model, 1, 1)
        return _balanced(seq_length, splits, unit, model_forward_flops(model, 1, 1) - b / 2, b)
    if method == "fit":
        if fit is None:
            raise ScheduleError("--method fit needs measured span times (--calibration FILE)")
        return _balanced(seq_length, splits, unit, fit.per_token, fit.per_pair)
    raise ScheduleError(f"--method: unknown partition method {method!r}; "
                        f"choose from {', '.join(METHODS)}")


def _unit_reason(tp: int, sequence_parallel: bool, align: int) -> str:
    if sequence_parallel and tp > 1:
        return f"lcm of --align {align} and --tp {tp} under sequence parallelism"
    return f"--align {align}"


def _even(units: int, splits: int, unit: int) -> list[int]:
    """Equal spans; when units do not divide evenly the earlier (cheaper) spans get the extra."""
    base, extra = divmod(units, splits)
    return [(base + (j < extra)) * unit for j in range(splits)]


def _balanced(seq_length: int, splits: int, unit: int, a: float, b: float) -> list[int]:
    """Spans of equal cost under C(x) = a*x + b*x^2/2, the cost of the prefix [0, x)."""
    total = a * seq_length + b * seq_length ** 2 / 2
    target = total / splits

    def prefix_with_cost(cost: float) -> float:
        """The x with C(x) = cost: the positive root, in a form without cancellation."""
        return 2 * cost / (a + math.sqrt(a * a + 2 * b * cost))

    bounds = [seq_length]
    for remaining in range(splits - 1, 0, -1):      # boundary before span `remaining`
        ideal = prefix_with_cost(total - (splits - remaining) * target)
        rounded = round(ideal / unit) * unit
        # Keep at least one unit in this span and in each of the spans before it.
        bounds.append(min(max(rounded, remaining * unit), bounds[-1] - unit))
    bounds.append(0)
    bounds.reverse()
    return [end - start for start, end in zip(bounds, bounds[1:])]


def _explicit(seq_length: int, splits: int, unit: int, lengths: list[int] | None) -> list[int]:
    if not lengths:
        raise ScheduleError("--span-lengths is required with the explicit method")
    lengths = list(lengths)
    if len(lengths) != splits:
        raise ScheduleError(f"--span-lengths gives {len(lengths)} spans but --splits is {splits}")
    if sum(lengths) != seq_length:
        raise ScheduleError(f"--span-lengths sum to {sum(lengths)}, not --seq-length {seq_length}")
    bad = [n for n in lengths if not isinstance(n, int) or n < unit or n % unit]
    if bad:
        raise ScheduleError(f"--span-lengths {bad} are not positive multiples of the span "
                            f"alignment {unit}")
    return lengths
