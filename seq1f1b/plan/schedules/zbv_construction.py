"""The published ZB-V order (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
the V-shape building block; section 6 of the zero-bubble paper), and the same order over spans.

Rank r of P holds stage r (chunk 0) and stage 2P-1-r (chunk 1). Its program is written in
*tokens* (op, chunk): the n-th F token of a chunk runs the n-th forward unit, the n-th I token the
n-th backward unit (our B: the input grad), the n-th W token the n-th weight-grad unit. The
phases, with `lead` extra warm-up units (0 for whole micro-batches):
1. 2(P-r)-1 forwards on chunk 0 (the trip down the V);
2. r + lead pairs (F1, F0): chunk 1 starts as its inputs come back up;
3. P-r triples (F1, I1, W1): the first backwards start at the bottom of the V;
4. steady state (F0, I0, W0, F1, I1, W1) until every forward has run;
5. cool-down: (I0, I1) while chunk 1 owes backwards, then (I0, W0), then the owed W of chunk 1
   and of chunk 0.
With lead = 0 and one span per micro-batch this is the published construction action for action
(the unit test compares it with torch.distributed.pipelining's ScheduleZBVZeroBubble). Fewer
micro-batches than the warm-up asks for (m < 2P-1) are handled as the paper does: the order is
built for enough micro-batches and the absent ones are dropped.

Over spans (`seq1f1b-zbv`) a unit is one span: forwards (micro-batch, span) ascending, backwards
micro-batches first-in first-out and spans last-in first-out (gpipe.py's orders). The first
backward of a micro-batch, B(i,k-1), needs all k of its spans' forwards, so every rank warms up
with lead = k-1 more (F1, F0) pairs, chunk 1 taking each span as it comes back up the V while
chunk 0 keeps the pipeline fed (extra chunk-0 forwards first would leave the V's far end idle):
rank 0's peak is P+k-1 spans (Seq1F1B's memory) where
whole micro-batches (`zbv`, k spans per unit, lead 0) hold P micro-batches (1F1B's memory).
"""
from __future__ import annotations

from seq1f1b.plan.actions import Action
from seq1f1b.plan.schedules.gpipe import backward_order, forward_order
from seq1f1b.plan.schedules.one_f_one_b import group_units

Token = tuple[str, int]
"""(op, chunk): op "F", "I" (input-grad backward, our B) or "W"."""


def rank_tokens(pp: int, rank: int, units: int, lead: int) -> list[Token]:
    """Rank `rank`'s ZB-V program as tokens for `units` units per chunk (enough for the
    warm-up: at least 2(P-r)-1 + lead + r)."""
    tokens: list[Token] = []
    count = {token: 0 for token in (("F", 0), ("F", 1), ("I", 0), ("I", 1), ("W", 0), ("W", 1))}

    def run(*ops: Token) -> None:
        for token in ops:
            tokens.append(token)
            count[token] += 1

    for _ in range(2 * (pp - rank) - 1):
        run(("F", 0))
    for _ in range(rank + lead):
        run(("F", 1), ("F", 0))
    for _ in range(pp - rank):
        run(("F", 1), ("I", 1), ("W", 1))
    while count["F", 1] < count["F", 0] or count["F", 0] < units:
        if count["F", 0] < units:
            run(("F", 0))
        run(("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1))
    while count["I", 1] < units:
        run(("I", 0), ("I", 1))
    while count["I", 0] < units:
        run(("I", 0), ("W", 0))
    for chunk in (1, 0):
        while count["W", chunk] < units:
            run(("W", chunk))
    return tokens


def zbv_programs(pp: int, microbatches: int, splits: int, unit_size: int) -> list[list[Action]]:
    """ZB-V programs whose unit is `unit_size` spans: `splits` (whole micro-batches, run span by
    span) or 1 (single spans, lead k-1)."""
    lead = splits - 1 if unit_size == 1 else 0
    units_per_microbatch = splits // unit_size
    # Enough micro-batches for every rank's warm-up (rank 0 asks the most), absent ones dropped.
    needed = 2 * pp - 1 + lead
    padded = max(microbatches, -(-needed // units_per_microbatch))
    orders = {}
    for chunk in (0, 1):
        forward = group_units(forward_order(padded, splits, chunk), unit_size)
        backward = group_units(backward_order(padded, splits, chunk), unit_size)
        orders["F", chunk] = forward
        orders["I", chunk] = backward
        orders["W", chunk] = [tuple(a.with_op("W") for a in unit) for unit in backward]
    units = padded * units_per_microbatch
    programs = []
    for rank in range(pp):
        seen = {token: 0 for token in orders}
        program = []
        for token in rank_tokens(pp, rank, units, lead):
            unit = orders[token][seen[token]]
            seen[token] += 1
            program.extend(a for a in unit if a.microbatch < microbatches)
        programs.append(program)
    return programs
