"""1F1B and Seq1F1B: one builder, parameterised by the unit that alternates.

Both walk the same two orders (see gpipe.py): forwards (micro-batch, span) ascending, backwards
micro-batches FIFO and spans LIFO. They differ only in the *unit* that one-forward-one-backward
alternates: a whole micro-batch (its k spans) for `1f1b`, a single span for `seq1f1b`.

Warm-up, in units, on rank r of P: (P - r - 1) + lead.
- P - r - 1: 1F1B's pipeline depth term. The first output gradient reaches rank r after
  travelling back through the P - r - 1 later ranks; rank r keeps that many units in flight.
- lead: the fewest extra forwards that put every backward unit's own forwards before it. In the
  steady phase backward unit b runs right after forward unit w + b, so w must cover the largest
  (position of the forward a backward unit needs) - b. With spans, B(i,k-1) comes first in its
  micro-batch but needs F(i,k-1), k-1 units after F(i,0): lead = k - 1, the paper's
  min(P - r - 1 + k - 1, m*k). With whole micro-batches, lead = 0: Megatron's P - r - 1.
So k = 1 gives Megatron's 1F1B for both names, action for action.
"""
from __future__ import annotations

from typing import Sequence

from seq1f1b.plan.actions import Action
from seq1f1b.plan.registry import register
from seq1f1b.plan.schedules.gpipe import backward_order, forward_order

Unit = tuple[Action, ...]
"""Actions that run back to back as one step of one-forward-one-backward."""


def group_units(actions: Sequence[Action], size: int) -> list[Unit]:
    """Consecutive runs of `size` actions (`size` divides len(actions))."""
    return [tuple(actions[n:n + size]) for n in range(0, len(actions), size)]


def own_forward_lead(forward_units: Sequence[Unit], backward_units: Sequence[Unit]) -> int:
    """Fewest warm-up forward units so that each backward unit follows its own forwards.

    Backward unit b runs after forward units 0..w+b; it needs the forward of each of its actions
    on this rank (the rule "B(i,j)@v needs F(i,j)@v"), so w >= position of that forward - b.
    """
    position = {action.key(): n for n, unit in enumerate(forward_units) for action in unit}
    return max([0] + [position[action.key()] - b
                      for b, unit in enumerate(backward_units) for action in unit])


def one_f_one_b_program(forward_units: Sequence[Unit], backward_units: Sequence[Unit],
                        warmup: int) -> list[Action]:
    """`warmup` forward units, then one forward unit / one backward unit, then the backwards."""
    total = len(forward_units)
    warmup = min(warmup, total)
    program = [action for unit in forward_units[:warmup] for action in unit]
    for step in range(total - warmup):
        program.extend(forward_units[warmup + step])
        program.extend(backward_units[step])
    for unit in backward_units[total - warmup:]:
        program.extend(unit)
    return program


def one_f_one_b_programs(pp: int, forward_units: Sequence[Unit], backward_units: Sequence[Unit],
                         depth_per_rank: int) -> list[list[Action]]:
    """Every rank walks the same unit orders; rank r warms up with
    depth_per_rank * (P - r - 1) + own_forward_lead units."""
    lead = own_forward_lead(forward_units, backward_units)
    return [one_f_one_b_program(forward_units, backward_units,
                                depth_per_rank * (pp - rank - 1) + lead)
            for rank in range(pp)]


def _non_interleaved(pp: int, microbatches: int, splits: int, unit_size: int
                     ) -> list[list[Action]]:
    forward = group_units(forward_order(microbatches, splits), unit_size)
    backward = group_units(backward_order(microbatches, splits), unit_size)
    return one_f_one_b_programs(pp, forward, backward, depth_per_rank=1)


@register("1f1b", description="Megatron's 1F1B at micro-batch granularity; with splits > 1 each "
                              "micro-batch runs span by span (1F1B memory, baseline for seq1f1b)")
def one_f_one_b(pp: int, microbatches: int, splits: int, chunks: int) -> list[list[Action]]:
    return _non_interleaved(pp, microbatches, splits, unit_size=splits)


@register("seq1f1b", description="Seq1F1B: 1F1B over spans, warm-up P-r-1+k-1 spans, backward "
                                 "FIFO over micro-batches and LIFO over spans")
def seq1f1b(pp: int, microbatches: int, splits: int, chunks: int) -> list[list[Action]]:
    return _non_interleaved(pp, microbatches, splits, unit_size=1)
