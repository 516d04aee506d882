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
  path (refine.py's moves, drawn at random);
- a move that holds more than the cap on its rank, or deadlocks, is not taken; one that ends no
  later is; one that ends later by d is taken when d < T * u, u uniform in [0, 1), T falling
  from `START_TEMPERATURE` of the makespan to 0 as the budget is spent (quadratically): a
  linear acceptance, not exp(-d/T), so that nothing but IEEE arithmetic decides and every
  rank of a run builds the same order;
- the shortest order seen is kept, and refined once more.

The random numbers come from `random.Random(SEED)`, so the search stays
deterministic: the same problem gives the same order on every rank and every run. Timing a move
times only what starts after it (refine.py's `Orders.timing`).
"""
from __future__ import annotations

import random

from seq1f1b.plan.schedules.greedy import Placed, Placer
from seq1f1b.plan.schedules.refine import Orders, refine

SEED = 0
"""The walk's random numbers: `random.Random(SEED)`. Over 88 capped cases at 7B/64K (TP 8, SP;
compute spans; P, m, k from (2, 2, 2) to (8, 8, 2), capped at every rival's peak) walking twice,
with seeds 0 and 1 (and from more placements), ended shorter in 6 (by 0.02-0.89%) at 1.7 times
the time."""

TIMED_ACTIONS_PER_ACTION = 50_000
"""Each walk's budget in actions timed, per action of the problem: about 90 000 moves tried
whatever the size (a move times about half of the actions), 2 s of Python at P = 4, m = 4,
k = 2 on a V (192 actions)."""

MOST_TIMED_ACTIONS = 20_000_000
"""No walk times more than this (about 5 s of Python): large problems get fewer moves per
action rather than minutes."""

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

_TIE = 1e-12


def anneal(placer: Placer, placed: Placed, cap: float, seed: int = SEED) -> Placed:
    """`placed` improved by an annealing walk (module doc) with every rank's held bytes at most
    `cap`, then refined; never longer than `placed`."""
    orders_of = Orders(placer)
    budget = min(TIMED_ACTIONS_PER_ACTION * orders_of.size, MOST_TIMED_ACTIONS)
    walked = _walk(orders_of, placed, cap, random.Random(seed), budget)
    return placed if walked is placed else refine(placer, walked, cap)


def _walk(orders_of: Orders, placed: Placed, cap: float, rng: random.Random, budget: int
          ) -> Placed:
    """One walk of `budget` actions timed from `placed`: the shortest order it passed."""
    orders = orders_of.steps(placed.programs)
    timing = orders_of.timing(orders)
    if timing is None:
        return placed
    current = shortest = timing.makespan
    kept = orders
    spent = orders_of.timed
    waits, helds = None, [None] * len(orders)
    while orders_of.timed - spent < budget:
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
        if helds[rank] is None:
            helds[rank] = orders_of.held(orders[rank])
        trial = orders_of.moved(orders[rank], helds[rank], source, target, cap)
        if trial is None:
            continue
        candidate = orders[:rank] + [trial] + orders[rank + 1:]
        timed = orders_of.timing(candidate, timing, rank, min(source, target))
        if timed is None:
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
