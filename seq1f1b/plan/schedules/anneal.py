"""Simulated annealing on a placed order: the step of `seq1f1b-zb-auto`'s search after the
refinement (refine.py), for the caps where the refinement stops in a local optimum.

The refinement keeps a move only when it shortens the order (or ends its actions sooner in sum),
so it stops where every single move on the critical path makes things worse before a second one
could make them better. Under a tight cap that is where it stops: at 7B/64K (TP 8, SP), P = 4,
m = 4, k = 2 on a V under Seq1F1B's peak the search ended 2.2% above CP-SAT's best order
(2.7085 s against 2.6509), and with even spans 7.8% above (3.136 against 2.9087). This walks on
from the refined order:

- a move takes one action of one rank 1..`REACH` places earlier or later: a random action of a
  random rank, or (one move in `CRITICAL_SHARE`) one that waited for its rank on the critical
  path (refine.py's moves, drawn at random); in a second walk, in one move of `SWAP_SHARE`
  it trades places with the action it lands on instead of shifting those between;
- a move that holds more than the cap on its rank, or deadlocks, is not taken; one that ends no
  later is; one that ends later by d is taken when d < T * u, u uniform in [0, 1), T falling
  from `START_TEMPERATURE` of the makespan to 0 as the budget is spent (quadratically): a
  linear acceptance, not exp(-d/T), so that nothing but IEEE arithmetic decides and every
  rank of a run builds the same order;
- the shortest order seen is kept; a walk that reaches the lower bound it is given stops there;
- where the first walk (shifts only) ends more than the caller's margin above that bound, a
  second walk (shifts and swaps) goes on from its shortest order: the two move sets end in
  different local optima, and neither is always the better (`SWAP_SHARE`);
- the shortest order is refined once more.

The random numbers come from `random.Random(SEED)`, so the search stays
deterministic: the same problem gives the same order on every rank and every run. Timing a move
times only what starts after it (refine.py's `Orders.timing`).
"""
from __future__ import annotations

import random
from typing import Optional

from seq1f1b.plan.schedules.greedy import Placed, Placer
from seq1f1b.plan.schedules.refine import Held, Orders, _Timed, refine

SEED = 0
"""The walk's random numbers: `random.Random(SEED)`. Over 88 capped cases at 7B/64K (TP 8, SP;
compute spans; P, m, k from (2, 2, 2) to (8, 8, 2), capped at every rival's peak) walking twice,
with seeds 0 and 1 (and from more placements), ended shorter in 6 (by 0.02-0.89%) at 1.7 times
the time."""

TIMED_ACTIONS_PER_ACTION = 50_000
"""The first walk's budget in actions timed, per action of the problem: about 90 000 moves tried
whatever the size (a move times about half of the actions), 2 s of Python at P = 4, m = 4,
k = 2 on a V (192 actions)."""

MOST_TIMED_ACTIONS = 20_000_000
"""The first walk times no more than this (about 5 s of Python): large problems get fewer moves
per action rather than minutes."""

REACH = 12
"""How many places a move shifts an action at most (refine.py's moves go 8)."""

CRITICAL_SHARE = 0.3
"""The share of moves drawn from the critical path's waits; the rest move any action. The best
of four walks (seeds 0-3, 10^7 actions timed each) from the search's order at 7B/64K under
Seq1F1B's peak (P = 4, k = 2; compute spans: m = 4 and 8 on a V; even spans: m = 4 on a V and
on a loop of two) was 2.6513, 5.3659, 3.0432 and 3.154 s with 0.3 against 2.675, 5.4003, 3.062
and 3.154 with none; 0.6 did no better than 0.3."""

START_TEMPERATURE = 0.003
"""The first temperature, as a share of the makespan: in the four cases above 0.01 did as well;
at 0.03 (accepting with exp(-d/T), no critical moves) none of four walks on the even-span V
ended shorter than it started."""

SWAP_SHARE = 0.5
"""The share of the second walk's moves that swap two actions of a rank rather than shift one.
A swap is two shifts at once, where either alone could break the cap or make the order longer:
with even spans (7B/64K, P = 4, m = 4, k = 2, a V under Seq1F1B's peak) eight walks from the
refined order (seeds 0-7) without swaps ended at 3.0716 s in seven, with half the moves swaps
at 2.963-3.043 (2.9937 in six); with compute spans the eight ended at 2.651-2.702 either way,
and over 65 capped 7B cases with compute spans a walk with swaps instead of one without ended
shorter in 3 and longer in 8 (by up to 1.9%): so swaps come second, not instead."""

SWAP_WALK_BUDGET = 0.5
"""The second walk's budget, as a share of the first's: from the first walk's 3.0716 s in the
even-span case above, walks with swaps of 0.1, 0.25, 0.5 and 1 times the budget ended at
3.0432, 3.0432, 2.9937 and 2.9937; in the compute-span case (2.675) none went shorter."""

_TIE = 1e-12


def anneal(placer: Placer, placed: Placed, cap: float, floor: float = 0.0,
           enough: float = 0.0, seed: int = SEED) -> Placed:
    """`placed` improved by annealing walks (module doc) with every rank's held bytes at most
    `cap`, then refined; never longer than `placed`. A walk stops early once it reaches
    `floor`, a lower bound of the problem (nothing shorter exists); the walk with swaps runs
    only where the one without ended above `enough`."""
    orders_of = Orders(placer)
    budget = min(TIMED_ACTIONS_PER_ACTION * orders_of.size, MOST_TIMED_ACTIONS)
    walked = _walk(orders_of, placed, cap, random.Random(seed), budget, floor, 0.0)
    if walked.makespan > enough:
        walked = _walk(orders_of, walked, cap, random.Random(seed),
                       int(budget * SWAP_WALK_BUDGET), floor, SWAP_SHARE)
    return placed if walked is placed else refine(placer, walked, cap)


def _walk(orders_of: Orders, placed: Placed, cap: float, rng: random.Random, budget: int,
          floor: float, swaps: float) -> Placed:
    """One walk of `budget` actions timed from `placed`, `swaps` of its moves swaps: the
    shortest order it passed."""
    orders = orders_of.steps(placed.programs)
    timing = orders_of.timing(orders)
    if not isinstance(timing, _Timed):
        return placed
    current = shortest = timing.makespan
    kept = orders
    spent = orders_of.timed
    waits: Optional[list[tuple[int, int]]] = None
    helds: list[Optional[Held]] = [None] * len(orders)
    while orders_of.timed - spent < budget and shortest > floor * (1 + _TIE):
        cooled = 1.0 - (orders_of.timed - spent) / budget
        temperature = START_TEMPERATURE * shortest * cooled * cooled
        if rng.random() < CRITICAL_SHARE:
            if waits is None:
                waits = orders_of.waits_for_rank(orders, timing.start, timing.end)
            if not waits:
                continue
            rank, source = waits[rng.randrange(len(waits))]
        else:
            rank = rng.randrange(len(orders))
            source = rng.randrange(len(orders[rank]))
        target = source + rng.randrange(1, REACH + 1) * (1 if rng.random() < 0.5 else -1)
        if not 0 <= target < len(orders[rank]):
            continue
        held = helds[rank]
        if held is None:
            held = helds[rank] = orders_of.held(orders[rank])
        trial = orders_of.moved(orders[rank], held, source, target, cap,
                                swap=swaps > 0 and rng.random() < swaps)
        if trial is None:
            continue
        candidate = orders[:rank] + [trial] + orders[rank + 1:]
        timed = orders_of.timing(candidate, timing, rank, min(source, target))
        if not isinstance(timed, _Timed):
            continue
        makespan = timed.makespan
        if makespan <= current or makespan - current < temperature * rng.random():
            orders, timing, current, waits = candidate, timed, makespan, None
            helds[rank] = None
            if makespan < shortest * (1 - _TIE):
                shortest, kept = makespan, orders
    if shortest >= placed.makespan * (1 - _TIE):
        return placed
    plan = orders_of.plan
    return Placed([[plan.action(step) for step in order] for order in kept], shortest)
