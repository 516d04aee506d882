"""Exact loss over spans: each span's loss is normalised by the whole micro-batch's token count.

Megatron's `loss_func(output)` returns `(loss, num_tokens, reduced)` (per-token form) or
`(loss, reduced)` (a mean). Megatron divides a micro-batch's summed loss by its token count and by
the number of micro-batches. A span only knows its own tokens, and dividing each span by its own
count (a mean of span means) is biased whenever spans hold different numbers of loss tokens. So the
scale is applied at backward time, when every span of the micro-batch has run its forward on the
last stage (B(i,j) always follows F(i,k-1) there):
- per-token form: d loss_j = C / (max(N_i, 1) * m), N_i = sum of the spans' num_tokens, under
  context parallelism also over the C ranks of the CP group (1 with `calculate_per_token_loss`,
  where megatron divides by the global token count later);
- mean form: d loss_j = (span length / sequence length) * cp / m: exact for an unmasked mean.
Reported values are combined the same way: per-token results are summed over spans (megatron's
`[loss sum, token count]` pairs), means are weighted by span length.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from seq1f1b import platform


def _combine(values: list[Any], weights: list[float] | None) -> Any:
    """Sum (weights None) or weighted sum of equally structured values: dicts, tensors, numbers."""
    first = values[0]
    if isinstance(first, dict):
        return {key: _combine([v[key] for v in values], weights) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_combine(list(items), weights) for items in zip(*values))
    if weights is None:
        total = first
        for value in values[1:]:
            total = total + value
        return total
    total = first * weights[0]
    for value, weight in zip(values[1:], weights[1:]):
        total = total + value * weight
    return total


def span_scale(per_token_form: bool, span_share: float, num_microbatches: int,
               per_token_loss: bool, cp_size: int, loss: Any,
               tokens: Optional[torch.Tensor] = None) -> float | torch.Tensor:
    """d(iteration loss)/d(loss of one span) (module doc): `span_share` is the span's length over
    the sequence's (mean form), `tokens` the micro-batch's loss tokens over every span and CP
    rank (per-token form, not needed with `per_token_loss`). In the per-token form the factor
    stays on the tokens' device (reading the count on the host would stall the GPU at every
    span's backward), computed in float64 and cast to the loss's dtype, which is what the
    multiplication by the same Python float would round it to. Megatron's DDP averages
    gradients over DP x CP: the CP ranks' parts of the micro-batch's loss add up only once
    multiplied back by C."""
    if not per_token_form:
        return span_share * cp_size / num_microbatches
    if per_token_loss:
        return 1.0
    dtype = loss.dtype if isinstance(loss, torch.Tensor) and loss.is_floating_point() \
        else torch.float64
    return (cp_size / (tokens.clamp(min=1).double() * num_microbatches)).to(dtype)


@dataclass
class MicrobatchLoss:
    """Loss outputs of the spans of one micro-batch on the last stage."""

    span_lengths: list[int]
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    num_tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    reduced: dict[int, Any] = field(default_factory=dict)
    per_token_form: bool = True
    # Under context parallelism: the micro-batch's loss tokens summed over the CP group (each CP
    # rank's spans hold 1/C of its tokens), set by `reduce_tokens`.
    cp_tokens: Optional[torch.Tensor] = None
    _scales: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def add(self, span: int, outputs: tuple) -> None:
        """Record `loss_func`'s result for span `span`."""
        if len(outputs) == 3:
            loss, num_tokens, reduced = outputs
            self.num_tokens[span] = torch.as_tensor(num_tokens).detach().to(torch.int64)
        elif len(outputs) == 2:
            loss, reduced = outputs
            self.per_token_form = False
        else:
            raise ValueError("loss_func must return (loss, reduced) or (loss, num_tokens, "
                             f"reduced); got {len(outputs)} values")
        self.losses[span] = loss
        self.reduced[span] = reduced

    @property
    def complete(self) -> bool:
        return len(self.losses) == len(self.span_lengths)

    def total_tokens(self) -> torch.Tensor:
        """Loss tokens of the whole micro-batch (per-token form), summed over its spans."""
        if not self.num_tokens:
            return torch.zeros((), dtype=torch.int64)
        return torch.stack(list(self.num_tokens.values())).sum()

    def reduce_tokens(self, cp_group) -> None:
        """Sum the micro-batch's token count over `cp_group` (one all-reduce per micro-batch on
        the last stage, issued by every CP rank at the same action)."""
        self.cp_tokens = self.total_tokens().to(platform.compute_device())
        dist.all_reduce(self.cp_tokens, group=cp_group)

    def _weights(self) -> list[float]:
        total = sum(self.span_lengths)
        return [length / total for length in self.span_lengths]

    def backward_scale(self, span: int, num_microbatches: int, per_token_loss: bool,
                       cp_size: int = 1) -> float | torch.Tensor:
        """The factor d(iteration loss)/d(loss of span `span`) (span_scale), the same for every
        span of the micro-batch in the per-token form: computed at its first backward."""
        if not self.complete:
            raise RuntimeError("backward of a span before every span of its micro-batch has a loss")
        loss = self.losses[span]
        if not self.per_token_form or per_token_loss:
            return span_scale(self.per_token_form, self._weights()[span], num_microbatches,
                              per_token_loss, cp_size, loss)
        key = (getattr(loss, "dtype", None), num_microbatches, cp_size)
        if key not in self._scales:
            tokens = self.total_tokens() if self.cp_tokens is None else self.cp_tokens
            self._scales[key] = span_scale(True, 1.0, num_microbatches, False, cp_size, loss,
                                           tokens)
        return self._scales[key]

    def combined_reduced(self) -> Any:
        """One reported value for the micro-batch, as megatron would report it unsplit."""
        values = [self.reduced[s] for s in range(len(self.span_lengths))]
        if len(values) == 1:
            return values[0]
        return _combine(values, None if self.per_token_form else self._weights())
