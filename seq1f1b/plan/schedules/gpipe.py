"""GPipe: every forward, then every backward. Also home of the span orders all families share.

Forward order of one model chunk: micro-batch by micro-batch, spans ascending (span j needs the
K/V of spans 0..j-1). Backward order: micro-batches first-in first-out, spans last-in first-out
(the paper's "partially ordered queue": B(i,k-1) ... B(i,0), then micro-batch i+1), because the
dK/dV of span j is complete only once every later span of its micro-batch has run backward.

GPipe runs its backwards in that same FIFO micro-batch order: micro-batch 0's gradient leaves the
last stage first, so earlier stages start their backwards as early as possible, and all schedule
families read the same two orders.
"""
from __future__ import annotations

from seq1f1b.plan.actions import Action
from seq1f1b.plan.registry import register


def forward_order(microbatches: int, splits: int, chunk: int = 0) -> list[Action]:
    """F actions of one model chunk: (micro-batch ascending, span ascending)."""
    return [Action("F", i, j, chunk) for i in range(microbatches) for j in range(splits)]


def backward_order(microbatches: int, splits: int, chunk: int = 0) -> list[Action]:
    """B actions of one model chunk: micro-batches FIFO, spans of a micro-batch LIFO."""
    return [Action("B", i, j, chunk) for i in range(microbatches) for j in reversed(range(splits))]


@register("gpipe", description="GPipe: all forwards (span by span), then all backwards "
                               "(micro-batches FIFO, spans in reverse)")
def gpipe(pp: int, microbatches: int, splits: int, chunks: int) -> list[list[Action]]:
    program = forward_order(microbatches, splits) + backward_order(microbatches, splits)
    return [list(program) for _ in range(pp)]
