"""Local search on a placed order: the last step of `seq1f1b-zb-auto`'s search.

A greedy replay (greedy.py) decides one action at a time and never takes a decision back; small
instances showed what that costs: under 7B costs at m = P (P = 2 and 4, k = 1) its best order was
9-10% longer than CP-SAT's optimum (exact.py), because a rank ran a W or a forward just before
the backward the rest of the pipeline was waiting for. This takes the best order found and
improves it by moves on its critical path:

- time every action (an action starts when its rank is free and its dependencies have ended:
  the replay's and the simulator's timing), and walk back from the action that ends last along
  what made each action start when it did, its rank's previous action or a dependency;
- where an action waited for its rank (the previous action on the rank ended exactly when it
  started), try moving it 1..`REACH` places earlier, or the action it waited for 1..`REACH`
  places later; a move is kept when the rank's held bytes stay within the cap (the held bytes of
  a rank depend only on its program order, simulate.held_change), every rank can still run (no
  deadlock, no action before its same-rank dependency), and it shortens the makespan, or keeps
  it and ends the actions sooner in sum (which lets a run of equally long critical paths be
  shortened one at a time);
- repeat from the new order until no move helps or the budget (actions timed) is spent.

The search is deterministic (no clock, no random numbers), so every rank of a run builds the
same order. Its moves reorder micro-batches freely, as an exact solver does; the order it returns
is checked by the validator like any other.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Optional, Union

from seq1f1b.plan.actions import Action
from seq1f1b.plan.schedules.greedy import Placed, Placer

REACH = 8
"""How many places a move shifts an action at most."""

TIMED_ACTIONS = 2_000_000
"""Budget of the local search in actions timed, about a second of Python whatever the problem's
size (at least 20 times the problem's actions). A move times only the actions that start after
the place it changes (`Orders.timing`): 14-51% of them over six searched cases (7B costs, skewed
and unit; P 4 and 8; k 1-4), so the budget buys two to seven times the moves of a full timing."""

_TIE = 1e-12


class _TooLong:
    """What `Orders.timing` returns for orders that end after the limit it was given."""

    def __repr__(self) -> str:
        return "TOO_LONG"


TOO_LONG = _TooLong()


@dataclass
class _Timed:
    """The start and end of every step of `orders` (by step id)."""

    start: list[float]
    end: list[float]
    orders: list[list[int]] = field(repr=False)

    @cached_property
    def starts_by_rank(self) -> list[list[float]]:
        """Each rank's starts in program order (ascending: a rank runs one action at a time),
        built only for the timings a move is tried from."""
        return [[self.start[step] for step in order] for order in self.orders]

    @cached_property
    def makespan(self) -> float:
        """The latest end: each rank's last action's (a rank's ends rise along its program),
        read from P actions, not all."""
        return max(self.end[order[-1]] for order in self.orders if order)

    @property
    def score(self) -> tuple[float, float]:
        """What the search minimizes: the makespan, then the sum of the end times (refine sums
        them only where the makespans tie: max and sum over every action, for each move tried,
        were about a seventh of a large search's time)."""
        return self.makespan, sum(self.end)


class Held:
    """The bytes a rank's program holds place by place (allocated at a start, released after
    the end, in program order). A move changes them only between the two places it touches,
    so its peak is read from here outside them and summed inside: at P = 4, m = 8, k = 8 on a
    V (384 actions a rank) summing the whole program for every move tried was a fifth of the
    search's time."""

    def __init__(self, order: list[int], alloc: list[float], release: list[float]) -> None:
        before, tops = [], []
        held = 0.0
        for step in order:
            before.append(held)
            held += alloc[step]
            tops.append(held)
            held -= release[step]
        self.alloc, self.release = alloc, release
        self.before = before
        self.upto = list(accumulate(tops, max, initial=0.0))
        """upto[i]: the most held before place i (0 before any)."""
        self.onward = list(accumulate(reversed(tops), max, initial=0.0))[::-1]
        """onward[i]: the most held from place i on (0 past the end)."""

    def peak(self, trial: list[int], low: int, high: int) -> float:
        """The peak of `trial`, this program with places `low`..`high` reordered. After the
        reordered places the trial holds what the program held (its sum up to there may differ
        in the last bits, and the difference is carried on)."""
        alloc, release = self.alloc, self.release
        held, peak = self.before[low], self.upto[low]
        for step in trial[low:high + 1]:
            held += alloc[step]
            if held > peak:
                peak = held
            held -= release[step]
        if high + 1 < len(self.before):
            return max(peak, self.onward[high + 1] + held - self.before[high + 1])
        return peak


class Orders:
    """Per-rank programs as the placer's step ids, timed with the placer's durations."""

    def __init__(self, placer: Placer) -> None:
        self.plan = placer.plan
        self.size = len(self.plan.duration)
        self.timed = 0
        """Actions timed so far, over every call of `timing`: the search's budget."""

    def steps(self, programs: list[list[Action]]) -> list[list[int]]:
        plan = self.plan
        return [[plan.step(rank, a.chunk, a.op, a.span, a.microbatch) for a in program]
                for rank, program in enumerate(programs)]

    def timing(self, orders: list[list[int]], since: Optional[_Timed] = None,
               moved: int = 0, place: int = 0, limit: float = math.inf
               ) -> Union[_Timed, None, _TooLong]:
        """The start and end of every step; None when the orders deadlock; `TOO_LONG` as soon
        as an action ends after `limit` (their makespan is longer). `refine` passes the makespan
        it would keep, so a move that ends later is not timed to its end (the budget counts it
        whole: the same orders; `plan.py search` at 7B, P 8, m 8, k 2 on a V in 22 s against
        28, two runs each, and no change measured at P 2 and 4). The annealing walk does not
        pass one: there a deadlock and a longer order draw different random numbers, and an
        order stopped early is not known not to deadlock.

        With `since` (the timing of orders that differ from these only in rank `moved`'s
        program from `place` on), every action that started before its action at `place - 1`
        ended keeps its times and is not timed again: what changed starts no earlier than
        that, and such an action depends only on actions that started before it (each on its
        rank's previous action and its dependencies, which ended when or before it started).
        So a move late in the order times only the actions after it."""
        # The innermost loop runs once per action and dependency for every move the search
        # tries (most of the search's time): plain comparisons and list slots, no calls.
        needs, duration = self.plan.needs, self.plan.duration
        if since is None:
            start, end = [0.0] * self.size, [-1.0] * self.size
            cursor, free = [0] * len(orders), [0.0] * len(orders)
        else:
            start, end = list(since.start), list(since.end)
            after = since.end[orders[moved][place - 1]] if place > 0 else 0.0
            # the first place on each rank that started at or after `after` (on `moved` at most
            # `place`: the action there started when its previous one ended, or later)
            cursor = [bisect_left(starts, after) for starts in since.starts_by_rank]
            free = [end[order[at - 1]] if at > 0 else 0.0 for order, at in zip(orders, cursor)]
            for order, at in zip(orders, cursor):
                for step in order[at:]:
                    end[step] = -1.0
        self.timed += self.size - sum(cursor)
        waiting: list = [None] * self.size      # step -> ranks waiting for it to end
        pending = list(range(len(orders)))
        while pending:
            rank = pending.pop()
            order, at, clock = orders[rank], cursor[rank], free[rank]
            length = len(order)
            while at < length:
                step = order[at]
                begin, blocked = clock, -1
                for need in needs[step]:
                    finish = end[need]
                    if finish < 0:
                        blocked = need
                        break
                    if finish > begin:
                        begin = finish
                if blocked >= 0:
                    if waiting[blocked] is None:
                        waiting[blocked] = [rank]
                    else:
                        waiting[blocked].append(rank)
                    break
                start[step] = begin
                clock = end[step] = begin + duration[step]
                if clock > limit:
                    return TOO_LONG
                woken = waiting[step]
                if woken is not None:
                    pending.extend(woken)
                    waiting[step] = None
                at += 1
            cursor[rank], free[rank] = at, clock
        if sum(cursor) != self.size:
            return None
        return _Timed(start, end, orders)

    def held(self, order: list[int]) -> Held:
        return Held(order, self.plan.alloc, self.plan.release)

    @staticmethod
    def moved(order: list[int], held: Held, source: int, target: int, cap: float,
              swap: bool = False) -> Optional[list[int]]:
        """`order` with its action at `source` moved to `target` (with `swap`, the two actions
        there trade places), or None where the rank would then hold more than `cap` (`held`:
        `order`'s bytes)."""
        trial = list(order)
        if swap:
            trial[source], trial[target] = trial[target], trial[source]
        else:
            trial.insert(target, trial.pop(source))
        low, high = (source, target) if source < target else (target, source)
        return trial if held.peak(trial, low, high) <= cap * (1 + 1e-9) else None

    def waits_for_rank(self, orders: list[list[int]], start: list[float], end: list[float]
                       ) -> list[tuple[int, int]]:
        """(rank, place) of each action on a critical path that started when its rank's
        previous action ended, from the last action back. Times count as equal within a
        fraction of the makespan, whatever unit the durations are in (seconds at any rate)."""
        where = {step: (rank, place) for rank, order in enumerate(orders)
                 for place, step in enumerate(order)}
        step = max(range(self.size), key=end.__getitem__)
        tied = _TIE * end[step]
        found = []
        while start[step] > tied:
            rank, place = where[step]
            need = next((n for n in self.plan.needs[step] if abs(end[n] - start[step]) <= tied),
                        None)
            previous = orders[rank][place - 1] if place > 0 else None
            if previous is not None and abs(end[previous] - start[step]) <= tied:
                found.append((rank, place))
                if need is None:
                    step = previous
                    continue
            if need is None:
                break
            step = need
        return found


def refine(placer: Placer, placed: Placed, cap: float,
           timed_actions: int = TIMED_ACTIONS) -> Placed:
    """`placed` improved by moves on its critical path (module docstring) with every rank's held
    bytes at most `cap`; never longer than `placed`."""
    orders_of = Orders(placer)
    orders = orders_of.steps(placed.programs)
    timing = orders_of.timing(orders)
    if not isinstance(timing, _Timed):
        return placed
    score = timing.score
    budget = orders_of.timed + max(20 * orders_of.size, timed_actions)
    while orders_of.timed < budget:
        moved, helds = None, {}
        for rank, place in orders_of.waits_for_rank(orders, timing.start, timing.end):
            order = orders[rank]
            if rank not in helds:
                helds[rank] = orders_of.held(order)
            moves = [(place, place - d) for d in range(1, REACH + 1) if place - d >= 0]
            moves += [(place - 1, place - 1 + d) for d in range(1, REACH + 1)
                      if place - 1 + d < len(order)]
            for source, target in moves:
                trial = orders_of.moved(order, helds[rank], source, target, cap)
                if trial is None:
                    continue
                candidate = orders[:rank] + [trial] + orders[rank + 1:]
                # a move is kept only where it ends no later: stop timing one that does
                timed = orders_of.timing(candidate, timing, rank, min(source, target),
                                         limit=score[0])
                if isinstance(timed, _Timed):
                    if timed.makespan < score[0] * (1 - _TIE) or \
                            (timed.makespan <= score[0] and
                             sum(timed.end) < score[1] * (1 - _TIE)):
                        moved = candidate, timed, timed.score
                        break
                if orders_of.timed >= budget:
                    break
            if moved is not None or orders_of.timed >= budget:
                break
        if moved is None:
            break
        orders, timing, score = moved
    if score[0] >= placed.makespan:
        return placed
    plan = orders_of.plan
    return Placed([[plan.action(step) for step in order] for order in orders], score[0])
