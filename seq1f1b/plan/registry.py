"""Name -> schedule builder. The one list that CLI choices, tools and the runtime read.

A builder is `(pp, microbatches, splits, chunks) -> list of per-rank action lists`; `build` checks
the arguments every family shares, calls it and wraps the result in a `Schedule`. A `searched`
builder also takes a `ScheduleBudget` (costs and a memory cap, budget.py) as a fifth argument:
`build(..., budget=...)` hands it over (None: the builder's default), other builders refuse one.
A searched builder also chooses its placement and returns `(programs, placement)`; it runs on
one chunk per rank or on two (`any_chunks`: as the run's model is built), its registered
`placement` being what it places on without a budget at two chunks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

from seq1f1b.plan.actions import Action, Schedule, ScheduleError
from seq1f1b.plan.budget import ScheduleBudget

Builder = Callable[[int, int, int, int], list[list[Action]]]


@dataclass(frozen=True)
class ScheduleInfo:
    """What the registry knows of one schedule name."""

    name: str
    builder: Builder
    description: str
    chunked: bool = False      # uses V >= 2 model chunks per rank (interleaving)
    placement: str = "loop"    # how (rank, chunk) maps to a virtual stage
    splits_backward: bool = False  # B is input-grad only and W actions carry the weight grads
    searched: bool = False     # takes a ScheduleBudget (costs, memory cap) as its fifth argument
    any_chunks: bool = False   # runs on V = 1 or V = 2 chunks per rank, as the model is built
    stand_in: Optional[Builder] = None  # a searched one's cheap order of the same kind (`shape`)


_REGISTRY: dict[str, ScheduleInfo] = {}


def register(name: str, *, description: str, chunked: bool = False, placement: str = "loop",
             splits_backward: bool = False, searched: bool = False, any_chunks: bool = False,
             stand_in: Optional[Builder] = None) -> Callable[[Builder], Builder]:
    """Decorator: register `builder` under `name`; a searched one's `stand_in` builds, without
    searching, an order of the same stages, placement and backward split (`shape`)."""

    def wrap(builder: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"schedule {name!r} registered twice")
        _REGISTRY[name] = ScheduleInfo(name, builder, description, chunked, placement,
                                       splits_backward, searched, any_chunks, stand_in)
        return builder

    return wrap


def _load_families() -> None:
    # Imported for their registration side effect; deferred so that families may import us.
    import seq1f1b.plan.schedules  # noqa: F401


def names() -> list[str]:
    """Registered schedule names, in registration order (used for CLI choices)."""
    _load_families()
    return list(_REGISTRY)


def get(name: str) -> ScheduleInfo:
    _load_families()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ScheduleError(
            f"--schedule: unknown schedule {name!r}; choose from {', '.join(_REGISTRY)}") from None


def check_sizes(pp: int, microbatches: int, splits: int = 1, chunks: int = 1) -> None:
    """Refuses a problem size that is not a positive integer, naming its flag."""
    for flag, value in (("--pp", pp), ("--microbatches", microbatches), ("--splits", splits),
                        ("--chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{flag} must be a positive integer, got {value!r}")


def build(name: str, pp: int, microbatches: int, splits: int = 1, chunks: int = 1, *,
          budget: Optional[ScheduleBudget] = None) -> Schedule:
    """The schedule `name` for P=pp ranks, m micro-batches, k=splits spans, V=chunks chunks;
    `budget` only for a searched schedule."""
    info = get(name)
    if budget is not None and not info.searched:
        raise ScheduleError(f"--schedule-memory-cap: schedule {name!r} is not searched; it takes "
                            "no memory cap (seq1f1b-zb-auto does)")
    _check_arguments(info, pp, microbatches, splits, chunks)
    if info.searched:
        programs, placement = _searched(info.builder, pp, microbatches, splits, chunks, budget)
    else:
        programs, placement = info.builder(pp, microbatches, splits, chunks), info.placement
    return Schedule(name=name, pp=pp, microbatches=microbatches, splits=splits, chunks=chunks,
                    programs=tuple(tuple(p) for p in programs), placement=placement)


def shape(name: str, pp: int, microbatches: int, splits: int = 1, chunks: int = 1) -> Schedule:
    """A schedule with what `name`'s costs and bytes depend on (P, m, k, V, the stages'
    placement, whether backwards are split into B and W) for callers that need only those:
    `name` itself, or for a searched one its `stand_in`'s order on the placement it searches
    without a budget, named "`name` (shape)". Its own build would be a search (about 6 s under
    unit costs at P = 16, m = 32, k = 4 on a V) whose order nobody reads."""
    info = get(name)
    if not info.searched or info.stand_in is None:
        return build(name, pp, microbatches, splits, chunks)
    _check_arguments(info, pp, microbatches, splits, chunks)
    programs, placement = info.stand_in(pp, microbatches, splits, chunks)
    return Schedule(name=f"{name} (shape)", pp=pp, microbatches=microbatches, splits=splits,
                    chunks=chunks, programs=tuple(tuple(p) for p in programs),
                    placement=placement)


def _check_arguments(info: ScheduleInfo, pp: int, microbatches: int, splits: int, chunks: int
                     ) -> None:
    """Refuses sizes and chunk counts that schedule `info` does not run, naming the flag."""
    name = info.name
    check_sizes(pp, microbatches, splits, chunks)
    if info.any_chunks:
        if chunks > 2:
            raise ScheduleError(f"--chunks: schedule {name!r} runs one or two model chunks per "
                                f"rank, got {chunks}")
    elif not info.chunked and chunks != 1:
        raise ScheduleError(f"--chunks: schedule {name!r} runs one model chunk per rank, "
                            f"got {chunks}; use an interleaved schedule for chunks > 1")
    elif info.chunked and chunks < 2:
        raise ScheduleError(f"--chunks: schedule {name!r} interleaves model chunks and needs "
                            f"chunks >= 2, got {chunks}")


@functools.lru_cache(maxsize=32)
def _searched(builder, pp: int, microbatches: int, splits: int, chunks: int,
              budget: Optional[ScheduleBudget]) -> tuple[tuple[tuple[Action, ...], ...], str]:
    """A search's (programs, placement), kept: a run asks for the same one when it validates
    its flags, builds its model chunks for the placement and runs (a search takes seconds)."""
    programs, placement = builder(pp, microbatches, splits, chunks, budget)
    return tuple(tuple(p) for p in programs), placement
