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


def dualpipev_tokens(pp: int, rank: int, units: int) -> list[Token]:
    """Rank `rank`'s DualPipeV program (DeepSeek-V3's DualPipe folded onto a V, as
    torch.distributed.pipelining ships it) as tokens, for `units` >= 2P units per chunk. Besides
    F and I it runs full backwards ("B", chunk) and ("W", None): the oldest weight grad owed.
    Phases: 2(P-r-1) F0; r+1 (F0, F1); P-r-1 (I1, W, F1); m-2P+r+1 (F0, B1, F1, B0); P-r-1
    (B1, F1, B0); r+1 (backward 1, backward 0), the second half split (I) from the middle on;
    P-r-1 (W, backward 0); r+1 W."""
    tokens: list[Token] = []
    for _ in range(2 * (pp - rank - 1)):
        tokens.append(("F", 0))
    for _ in range(rank + 1):
        tokens += [("F", 0), ("F", 1)]
    for _ in range(pp - rank - 1):
        tokens += [("I", 1), ("W", None), ("F", 1)]
    for _ in range(units - 2 * pp + rank + 1):
        tokens += [("F", 0), ("B", 1), ("F", 1), ("B", 0)]
    for _ in range(pp - rank - 1):
        tokens += [("B", 1), ("F", 1), ("B", 0)]
    split = False
    middle = (rank + 1) // 2
    for n in range(rank + 1):
        split = split or (n == middle and rank % 2 == 1)
        tokens.append(("I" if split else "B", 1))
        split = split or (n == middle and rank % 2 == 0)
        tokens.append(("I" if split else "B", 0))
    for _ in range(pp - rank - 1):
        tokens += [("W", None), ("I" if split else "B", 0)]
    tokens += [("W", None)] * (rank + 1)
    return tokens


def zbv_programs(pp: int, microbatches: int, splits: int, unit_size: int) -> list[list[Action]]:
    """ZB-V programs whose unit is `unit_size` spans: `splits` (whole micro-batches, run span by
    span) or 1 (single spans, lead k-1)."""
    lead = splits - 1 if unit_size == 1 else 0
    # Enough micro-batches for every rank's warm-up (rank 0 asks the most), absent ones dropped.
    padded = max(microbatches, -(-(2 * pp - 1 + lead) // (splits // unit_size)))
    return _expand(pp, padded, splits, unit_size,
                   lambda rank, units: rank_tokens(pp, rank, units, lead), microbatches)


def dualpipev_programs(pp: int, microbatches: int, splits: int) -> list[list[Action]] | None:
    """DualPipeV programs over whole micro-batches (run span by span); None when m < 2P."""
    if microbatches < 2 * pp:
        return None
    return _expand(pp, microbatches, splits, splits,
                   lambda rank, units: dualpipev_tokens(pp, rank, units), microbatches)


def _expand(pp: int, padded: int, splits: int, unit_size: int, tokens_of, microbatches: int
            ) -> list[list[Action]]:
    """Tokens -> actions: the n-th F (I or B) token of a chunk runs its n-th forward (backward)
    unit; a W token runs the oldest weight-grad unit owed (of its chunk, or of either when the
    chunk is None). Actions of micro-batches >= `microbatches` (padding) are dropped."""
    forward = {c: group_units(forward_order(padded, splits, c), unit_size) for c in (0, 1)}
    backward = {c: group_units(backward_order(padded, splits, c), unit_size) for c in (0, 1)}
    units = padded * (splits // unit_size)
    programs = []
    for rank in range(pp):
        seen = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
        owed: list[tuple[int, tuple[Action, ...]]] = []
        program = []
        for op, chunk in tokens_of(rank, units):
            if op == "W":
                unit = next(u for u in owed if chunk is None or u[0] == chunk)
                owed.remove(unit)
                run = tuple(a.with_op("W") for a in unit[1])
            else:
                kind = "F" if op == "F" else "B"
                run = (forward if kind == "F" else backward)[chunk][seen[kind, chunk]]
                seen[kind, chunk] += 1
                if op == "I":
                    owed.append((chunk, run))
            program.extend(a for a in run if a.microbatch < microbatches)
        programs.append(program)
    return programs
