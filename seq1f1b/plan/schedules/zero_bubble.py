"""Zero-bubble pipelining: ZB-H1 over micro-batches (`zb-h1`) and over spans (`seq1f1b-zb-h1`).

Backward splits into B (the gradient w.r.t. the stage input: the previous stage waits for it)
and W (the gradient w.r.t. the weights: nobody waits for it). ZB-H1 (Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024) keeps 1F1B's order of forwards and backwards and its peak
activation memory, and moves W out of the critical path into what would be bubbles: with equal
F, B, W costs the idle time per rank drops from 1F1B's (P-1)(F+B+W) to (P-1)(F+B-W).

No per-rank table is typed in. Each rank's program is its base program (`1f1b` for `zb-h1`,
`seq1f1b` for `seq1f1b-zb-h1`, so warm-ups and the reverse-span order of B are theirs) with W
units placed by replaying all ranks at one time unit per span-action:
- an action starts once everything it depends on has finished (`actions.dependencies`, the one
  place the rules live; W(i,j) needs B(i,j) on its stage);
- the memory bound: a span is live from the start of its F to the end of its W, and no rank may
  hold more live spans than the base schedule's peak (rank 0's: P micro-batches for 1F1B,
  P + k - 1 spans for Seq1F1B), the activation memory a device must have anyway;
- a free rank starts its next F/B unit when it can run; when it cannot (not ready yet, or a
  forward that would exceed the memory bound) it runs its oldest owed W unit instead; the W
  units still owed at the end close the program.
So a rank's W runs as late as memory allows unless a bubble comes first; warm-ups, the delay of
each rank's first W and the W that fill the cool-down are consequences. With k = 1 this gives the
paper's handcrafted ZB-H1 (rank r's W trail its B by r steps) once m >= P. The programs are a
valid order (the replay executed them), so they run under any costs; unit costs only chose them.

`zb-h1` alternates whole micro-batches (each run span by span: the baseline of the span
schedule), `seq1f1b-zb-h1` single spans; with k = 1 both are the same schedule.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from seq1f1b.plan.actions import Action, Schedule, ScheduleError, dependencies
from seq1f1b.plan.registry import register
from seq1f1b.plan.schedules.gpipe import backward_order, forward_order
from seq1f1b.plan.schedules.one_f_one_b import group_units, one_f_one_b_programs


def peak_live_spans(program: Sequence[Action]) -> int:
    """Most spans held at once by a program without W: each lives from its F to its B."""
    live = peak = 0
    for action in program:
        live += 1 if action.op == "F" else -1 if action.op == "B" else 0
        peak = max(peak, live)
    return peak


Steps = tuple[int, ...]
"""Actions of one unit as step ids (see `_Replay`)."""


@dataclass
class _Rank:
    """One rank during the replay: the F/B units still to run, the W units owed, the unit being
    run, and the spans live (F started, W not finished)."""

    base: deque[Steps]
    limit: int
    owed: deque[Steps] = field(default_factory=deque)
    current: deque[int] = field(default_factory=deque)
    live: int = 0
    program: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return not (self.base or self.owed or self.current)


@dataclass
class _Replay:
    """Every (rank, action) as an integer step; the dependencies of each step as steps; when
    each step finished (`never` until it has)."""

    actions: list[tuple[int, Action]]
    needs: list[list[int]]
    finished: list[int]
    never: int

    @classmethod
    def of(cls, pp: int, microbatches: int, splits: int, programs: list[list[Action]]
           ) -> "_Replay":
        problem = Schedule("zero-bubble", pp, microbatches, splits, 1, ((),) * pp)
        actions = []
        for rank, program in enumerate(programs):
            for a in program:
                actions.append((rank, a))
                if a.op == "B":
                    actions.append((rank, a.with_op("W")))
        step = {(rank, a.op, a.microbatch, a.span): n for n, (rank, a) in enumerate(actions)}
        # The rules tie actions of one micro-batch alike for every micro-batch: ask them once
        # per (rank, op, span) at micro-batch 0.
        rules: dict[tuple[int, str, int], list[tuple[int, str, int]]] = {}
        needs = []
        for rank, a in actions:
            shape = (rank, a.op, a.span)
            if shape not in rules:
                rules[shape] = [(r, dep.op, dep.span) for r, dep in
                                dependencies(problem, rank, Action(a.op, 0, a.span))]
            needs.append([step[(r, op, a.microbatch, span)] for r, op, span in rules[shape]])
        never = 3 * microbatches * splits * pp + 2 * pp + 1
        return cls(actions, needs, [never] * len(actions), never)

    def ready(self, step: int, now: int) -> bool:
        finished = self.finished
        return all(finished[need] <= now for need in self.needs[step])


def zero_bubble_programs(pp: int, microbatches: int, splits: int, unit_size: int
                         ) -> list[list[Action]]:
    """ZB-H1 programs whose one-forward-one-backward unit is `unit_size` spans (k or 1)."""
    forward = group_units(forward_order(microbatches, splits), unit_size)
    backward = group_units(backward_order(microbatches, splits), unit_size)
    bases = one_f_one_b_programs(pp, forward, backward, depth_per_rank=1)
    limit = max(peak_live_spans(program) for program in bases)
    replay = _Replay.of(pp, microbatches, splits, bases)
    ops = [action.op for _, action in replay.actions]
    # Steps are numbered rank by rank in program order, each B followed by its W.
    ranks, first = [], 0
    for program in bases:
        ids = [first + n for n in range(len(program) + len(program) // 2)]
        fb = [n for n in ids if ops[n] != "W"]
        ranks.append(_Rank(deque(group_units(fb, unit_size)), limit))
        first += len(ids)
    weight_of = {n: n + 1 for n in range(len(ops)) if ops[n] == "B"}

    # A rank's free when its last action has finished: one time unit per action.
    now = 0
    while not all(state.finished for state in ranks):
        if now >= replay.never:        # every rank does 3*m*k actions: this one is stuck
            raise ScheduleError(f"zero-bubble: no valid order found for pp={pp}, "
                                f"m={microbatches}, k={splits}")
        for state in ranks:
            if state.program and replay.finished[state.program[-1]] > now:
                continue
            if not state.current:
                unit = _choose(state, replay, ops, now)
                if unit is None:
                    continue
                state.current.extend(unit)
            step = state.current[0]
            if not replay.ready(step, now):
                continue
            state.current.popleft()
            state.program.append(step)
            replay.finished[step] = now + 1
            state.live += {"F": 1, "B": 0, "W": -1}[ops[step]]
            if ops[step] == "B" and not state.current:     # a B unit done: its W unit is owed
                state.owed.append(tuple(weight_of[n] for n in state.program[-unit_size:]))
        now += 1
    return [[replay.actions[step][1] for step in state.program] for state in ranks]


def _choose(state: _Rank, replay: _Replay, ops: list[str], now: int) -> Optional[Steps]:
    """The unit a free rank starts now, or None to wait: its next F/B unit when that can run, an
    owed W unit when it cannot (not ready yet, or a forward that would exceed the memory bound)."""
    if state.base:
        unit = state.base[0]
        fits = ops[unit[0]] != "F" or state.live + len(unit) <= state.limit
        if fits and replay.ready(unit[0], now):
            return state.base.popleft()
    if state.owed:
        return state.owed.popleft()
    return None


@register("zb-h1", description="zero-bubble ZB-H1: 1F1B's memory, backward split into B (input "
                               "grad) and W (weight grad) deferred into the bubbles; micro-batch "
                               "units, each run span by span", splits_backward=True)
def zb_h1(pp: int, microbatches: int, splits: int, chunks: int) -> list[list[Action]]:
    return zero_bubble_programs(pp, microbatches, splits, unit_size=splits)


@register("seq1f1b-zb-h1", description="Seq1F1B with ZB-H1: seq1f1b's memory, B in reverse span "
                                       "order, W deferred into the bubbles",
          splits_backward=True)
def seq1f1b_zb_h1(pp: int, microbatches: int, splits: int, chunks: int) -> list[list[Action]]:
    return zero_bubble_programs(pp, microbatches, splits, unit_size=1)
