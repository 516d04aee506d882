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
chosen never holds more than the cap asked for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from seq1f1b.plan.actions import Schedule, ScheduleError
from seq1f1b.plan.stage_layers import StageLayers

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


def choose_layout(num_layers: int, stages: int, bound: Callable[[StageLayers], float],
                  search: Callable[[StageLayers], tuple[Schedule, float]],
                  tries: int = LAYOUT_TRIES) -> LayoutChoice:
    """The layout of the shortest searched schedule among the start and the `tries` candidates
    of lowest `bound` (module doc). `bound(split)`: a lower bound on any schedule's makespan
    with `split`'s costs; `search(split)`: the searched schedule on them and its makespan."""
    start = StageLayers(counts=near_even(num_layers, stages))
    # Ties of the bound (it often sees only rank 0's work) go to fewer layers on the output
    # layer's stage, the last.
    ranked = sorted(neighbours(start.counts),
                    key=lambda c: (bound(StageLayers(counts=c)), c[-1]))
    schedule, start_makespan = search(start)
    best = LayoutChoice(start, schedule, start_makespan, start_makespan, 1)
    for counts in ranked[:tries]:
        split = StageLayers(counts=counts)
        schedule, makespan = search(split)
        if makespan < best.makespan:
            best = LayoutChoice(split, schedule, makespan, start_makespan, 0)
    return LayoutChoice(best.stage_layers, best.schedule, best.makespan, start_makespan,
                        1 + min(tries, len(ranked)))
