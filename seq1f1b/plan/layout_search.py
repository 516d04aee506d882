"""Choosing every virtual stage's layer count for a searched schedule (a layout,
stage_layers.py), so the stage with the output layer need not be the bottleneck.

On a V rank 0 holds the first stage and the last, which also runs the output layer and the loss:
with even stages rank 0 is the busiest, and megatron's first / last rule (the middle stages even)
can move only whole multiples of the middle stages' count. A layout may move single layers. The
search starts from the even split (or the nearest one: the remainder on the middle stages) and
tries every layout one or two single-layer moves away (each stage keeps >= 1 layer); it ranks them
by the lower bound on their costs (bounds.py, cheap; ties: fewer layers on the output layer's
stage first), then runs the schedule search itself on the
`tries` best and on the start, and keeps the shortest simulated makespan (ties: the start, then
the earlier candidate). Each candidate is searched under the same cap in bytes, so the layout
chosen never holds more than the cap asked for. Each candidate's result is reported to
search_progress's logger (its searches, seconds each, are too short to say anything themselves,
and the whole takes the even split's search and then up to `LAYOUT_TRIES` + 1 more).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional

from seq1f1b.plan.actions import Schedule, ScheduleError
from seq1f1b.plan.bounds import lower_bound
from seq1f1b.plan.budget import ScheduleBudget
from seq1f1b.plan.search_progress import Progress
from seq1f1b.plan.simulate import simulate
from seq1f1b.plan.stage_layers import LAYOUT_FLAG, StageLayers

LAYOUT_TRIES = 6
"""Candidates (besides the start) the schedule search is run on."""


@dataclass(frozen=True)
class LayoutChoice:
    """The layout kept, its schedule and makespan, and the start's makespan beside it."""

    stage_layers: StageLayers
    schedule: Schedule
    makespan: float
    start_makespan: float
    tried: int


def near_even(num_layers: int, stages: int) -> tuple[int, ...]:
    """N / S layers a stage; the remainder one more each on the middle stages (not the first,
    which holds the embedding, nor the last, the output layer's)."""
    if num_layers < stages:
        raise ScheduleError(f"the model's {num_layers} layers cannot fill {stages} virtual "
                            "stages of >= 1 layer")
    base, extra = divmod(num_layers, stages)
    counts = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    for index in middle[:extra]:
        counts[index] += 1
    return tuple(counts)


def neighbours(counts: tuple[int, ...], moves: int = 2) -> list[tuple[int, ...]]:
    """Every layout `moves` or fewer single-layer moves from `counts`, each stage >= 1 layer, in
    a fixed order, without `counts` itself."""
    seen, frontier, out = {counts}, [counts], []
    for _ in range(moves):
        following = []
        for layout in frontier:
            for source in range(len(layout)):
                if layout[source] < 2:
                    continue
                for target in range(len(layout)):
                    if target == source:
                        continue
                    moved = list(layout)
                    moved[source] -= 1
                    moved[target] += 1
                    candidate = tuple(moved)
                    if candidate not in seen:
                        seen.add(candidate)
                        following.append(candidate)
        out.extend(following)
        frontier = following
    return out


Searched = Callable[[int, int, StageLayers, float, float], None]
"""Told after each layout's search: (its number, how many are searched, the layout, its
makespan, the shortest so far)."""


def choose_layout(num_layers: int, stages: int, bound: Callable[[StageLayers], float],
                  search: Callable[[StageLayers], tuple[Schedule, float]],
                  tries: int = LAYOUT_TRIES,
                  searched: Searched = lambda *_: None) -> LayoutChoice:
    """The layout of the shortest searched schedule among the start and the `tries` candidates
    of lowest `bound` (module doc). `bound(split)`: a lower bound on any schedule's makespan
    with `split`'s costs; `search(split)`: the searched schedule on them and its makespan;
    `searched` hears each result as it comes."""
    start = StageLayers(counts=near_even(num_layers, stages))
    # Ties of the bound (it often sees only rank 0's work) go to fewer layers on the output
    # layer's stage, the last.
    ranked = sorted(neighbours(start.counts),
                    key=lambda c: (bound(StageLayers(counts=c)), c[-1]))
    count = 1 + min(tries, len(ranked))
    schedule, start_makespan = search(start)
    best = LayoutChoice(start, schedule, start_makespan, start_makespan, count)
    searched(1, count, start, start_makespan, start_makespan)
    for number, counts in enumerate(ranked[:tries], 2):
        split = StageLayers(counts=counts)
        schedule, makespan = search(split)
        if makespan < best.makespan:
            best = LayoutChoice(split, schedule, makespan, start_makespan, count)
        searched(number, count, split, makespan, best.makespan)
    return best


class SearchedOrder(NamedTuple):
    """A searched schedule, the budget it was placed under and its simulated makespan."""

    schedule: Schedule
    budget: ScheduleBudget
    makespan: float


@dataclass(frozen=True)
class LayoutSearch:
    """What `search_layout` found: the even split's whole search, the candidates' choice (on a
    V, without the walk), the chosen layout's whole search (None where the choice is the even
    split) and the cap in bytes every layout was searched under. The order kept is the chosen
    layout's where shorter than the even split's."""

    even: SearchedOrder
    choice: LayoutChoice
    chosen: Optional[SearchedOrder]
    cap: float

    @property
    def layout(self) -> Optional[StageLayers]:
        """The layout kept; None: the even split."""
        if self.chosen is not None and self.chosen.makespan < self.even.makespan:
            return self.choice.stage_layers
        return None

    @property
    def kept(self) -> SearchedOrder:
        """The order kept."""
        return self.chosen if self.layout is not None else self.even

    def report(self) -> str:
        """One line: the layout kept (a --pipeline-model-parallel-layout) against the even
        split, both searched in full."""
        kept = (f"chose {LAYOUT_FLAG} '{self.layout.layout}'" if self.layout is not None
                else "kept the even split")
        return (f"--search-layout {kept}: simulated makespan {self.kept.makespan:.6g} against "
                f"{self.even.makespan:.6g} for the even split ({self.choice.tried} layouts "
                f"searched under a cap of {self.cap:.6g} bytes)")


def search_layout(name: str, pp: int, microbatches: int, splits: int, num_layers: int,
                  budget_of: Callable[[Optional[StageLayers], Optional[float]], ScheduleBudget]
                  ) -> LayoutSearch:
    """Every virtual stage's layers for searched schedule `name` on two chunks per rank (module
    doc). `budget_of(split, cap)`: the run's whole budget (every placement; the output layer
    spread too where the run offers it) with `split`'s layers under `cap` in bytes; (None,
    None) is the run's own (the even split, its cap as given). ScheduleError where no order
    fits or the model has too few layers."""
    from seq1f1b.plan import registry               # registry's schedules import budget.py
    from seq1f1b.plan.schedules.zero_bubble_v import searched_cap
    chunks = 2
    # each candidate's budget is asked for twice (its bound, its search): priced once
    budget_of = functools.lru_cache(maxsize=None)(budget_of)

    def searched(budget: ScheduleBudget) -> SearchedOrder:
        schedule = registry.build(name, pp, microbatches, splits, chunks, budget=budget)
        costs = budget.costs_for(schedule.placement, schedule.spread_output)
        return SearchedOrder(schedule, budget, simulate(schedule, costs).makespan)

    progress = Progress()
    even = searched(budget_of(None, None))
    cap = searched_cap(pp, microbatches, splits, chunks, even.budget)
    shape = registry.build("seq1f1b-zbv", pp, microbatches, splits, chunks)

    def candidate(split: StageLayers) -> tuple[Schedule, float]:
        # Candidates are compared on a V without the annealing walk; the one kept is then
        # searched in full.
        order = searched(replace(budget_of(split, cap).pinned("vshape"), anneal=False))
        return order.schedule, order.makespan

    def say(number: int, count: int, split: StageLayers, makespan: float,
            shortest: float) -> None:
        progress.done(f"--search-layout: layout {number} of {count} ('{split.layout}'): "
                      f"makespan {makespan:.6g} on a V without the walk, the shortest so far "
                      f"{shortest:.6g}")

    choice = choose_layout(num_layers, shape.num_stages,
                           lambda split: lower_bound(shape,
                                                     budget_of(split, cap).costs_for("vshape")),
                           candidate, searched=say)
    chosen = (None if choice.stage_layers.counts == near_even(num_layers, shape.num_stages)
              else searched(budget_of(choice.stage_layers, cap)))
    return LayoutSearch(even, choice, chosen, cap)
