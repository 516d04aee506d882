"""The schedule IR: an `Action` is one unit of pipeline work, a `Schedule` is one program per rank.

A schedule is pure data so that the validator, the simulator, the renderer and the runtime all
read the same thing. The dependency rules between actions live here, once, in `dependencies`.
"""
from __future__ import annotations

import csv
import functools
import io
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator

OPS = ("F", "B", "W", "O")
"""F: forward of one span; B: backward of one span: the input grad only when the rank also runs
that unit's W, else the full backward (input and weight grads); W: the deferred weight-gradient
part of a backward. So one schedule may split the backward of some units and not of others
(DualPipeV does): a unit's backward is split exactly when its W occurs.

O: the output layer and the loss of one span, forward and backward at once, as an action of its
own that any one rank may run (every rank then holds the output weights; `Schedule.spread_output`).
A schedule either has an O for every unit (micro-batch, span), on chunk 0 of whichever rank runs
it, or none: then the last virtual stage's F and B run the output layer, as Megatron's do. The
O's take the output layer off the last stage's rank, whose extra work otherwise sets a floor
under the bubble (about 0.44 of a layer at 7B/64K: docs/schedules.md)."""

PLACEMENTS = ("loop", "vshape")
"""How (rank, chunk) maps to a virtual stage. "loop": chunk c of rank r is stage c*P + r (Megatron's
interleaving). "vshape": chunk 0 of rank r is stage r, chunk 1 is stage 2P-1-r (zero-bubble ZBV)."""


def placement_words(placement: str) -> str:
    """How a line for users names a placement: "a V" or "a loop"."""
    return "a V" if placement == "vshape" else "a loop"


def virtual_stage(placement: str, pp: int, rank: int, chunk: int) -> int:
    """The virtual stage that model chunk `chunk` of pipeline rank `rank` holds (PLACEMENTS);
    model building reads it too, so a chunk gets the layers of the stage the plan runs it as."""
    if placement == "vshape" and chunk == 1:
        return 2 * pp - 1 - rank
    return chunk * pp + rank


class ScheduleError(ValueError):
    """A schedule cannot be built or is not valid; the message names the offending argument."""


_ACTION_RE = re.compile(r"^([FBWO])(\d+)\.(\d+)(?:@(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: `op` of span `span` of micro-batch `microbatch` on model chunk `chunk`."""

    op: str
    microbatch: int
    span: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ScheduleError(f"unknown action op {self.op!r}; expected one of {OPS}")
        if min(self.microbatch, self.span, self.chunk) < 0:
            raise ScheduleError(f"negative index in action {self!r}")
        if self.op == "O" and self.chunk:
            raise ScheduleError(f"{self.format()}: an O action has no model chunk")

    def format(self, show_chunk: bool = False) -> str:
        """Text form "F3.1" (micro-batch 3, span 1), with "@c" when the schedule has chunks."""
        text = f"{self.op}{self.microbatch}.{self.span}"
        return f"{text}@{self.chunk}" if show_chunk or self.chunk else text

    def __str__(self) -> str:
        return self.format()

    def key(self) -> tuple[int, int, int]:
        """(microbatch, span, chunk): identifies the unit of data this action works on."""
        return (self.microbatch, self.span, self.chunk)

    def with_op(self, op: str) -> "Action":
        return Action(op, self.microbatch, self.span, self.chunk)


def parse_action(text: str) -> Action:
    """Inverse of `Action.format`: "F3.1" or "F3.1@1"."""
    match = _ACTION_RE.match(text.strip())
    if not match:
        raise ScheduleError(f"cannot parse action {text!r}; expected e.g. F3.1 or B0.2@1")
    op, mb, span, chunk = match.groups()
    return Action(op, int(mb), int(span), int(chunk or 0))


@dataclass(frozen=True)
class Schedule:
    """Per-rank programs for P ranks, m micro-batches, k spans each, V model chunks per rank."""

    name: str
    pp: int
    microbatches: int
    splits: int
    chunks: int
    programs: tuple[tuple[Action, ...], ...]
    placement: str = "loop"
    _index: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ScheduleError(f"unknown placement {self.placement!r}")
        if self.placement == "vshape" and self.chunks != 2:
            raise ScheduleError("a vshape placement needs exactly 2 chunks per rank")
        if len(self.programs) != self.pp:
            raise ScheduleError(f"{len(self.programs)} programs for pp={self.pp}")
        object.__setattr__(self, "programs", tuple(tuple(p) for p in self.programs))

    # -- placement ------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Number of virtual stages: P x V."""
        return self.pp * self.chunks

    def stage_of(self, rank: int, chunk: int) -> int:
        """The virtual stage that model chunk `chunk` of `rank` holds."""
        return virtual_stage(self.placement, self.pp, rank, chunk)

    def owner_of(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage `stage`."""
        chunk, rank = divmod(stage, self.pp)
        if self.placement == "vshape" and chunk == 1:
            rank = self.pp - 1 - rank
        return rank, chunk

    @functools.cached_property
    def output_ranks(self) -> dict[tuple[int, int], int]:
        """(micro-batch, span) -> the rank whose program runs that unit's O (the first, when
        several do: the validator names those); empty when the last stage runs the output layer."""
        ranks: dict[tuple[int, int], int] = {}
        for rank, program in enumerate(self.programs):
            for action in program:
                if action.op == "O":
                    ranks.setdefault((action.microbatch, action.span), rank)
        return ranks

    @property
    def spread_output(self) -> bool:
        """True when the output layer runs as O actions (OPS) rather than in the last stage."""
        return bool(self.output_ranks)

    def output_rank(self, microbatch: int, span: int) -> int:
        """The rank running O(microbatch, span); the last stage's rank when no program has it."""
        return self.output_ranks.get((microbatch, span), self.owner_of(self.num_stages - 1)[0])

    @functools.cached_property
    def split_backward(self) -> bool:
        """True when some backward is split into B (input grad) and W (weight grad) actions."""
        return any(self.deferred_weights)

    @functools.cached_property
    def deferred_weights(self) -> tuple[frozenset[tuple[int, int, int]], ...]:
        """Per rank, the units (Action.key) whose weight grads run as a W action of their own."""
        return tuple(frozenset(a.key() for a in program if a.op == "W")
                     for program in self.programs)

    def full_backward(self, rank: int, action: Action) -> bool:
        """Whether `action` (a B) computes the weight grads too: its rank runs no W of its unit."""
        return action.op == "B" and action.key() not in self.deferred_weights[rank]

    def frees_activations(self, rank: int, action: Action) -> bool:
        """Whether `action` is the last backward action of its unit (W, or a full B): the span's
        activations are freed after it."""
        return action.op == "W" or self.full_backward(rank, action)

    # -- text forms ---------------------------------------------------------------------------
    def format_rank(self, rank: int) -> list[str]:
        show = self.chunks > 1
        return [a.format(show) for a in self.programs[rank]]

    def to_text(self) -> str:
        """One line per rank: "rank R: F0.0 F0.1 ..."."""
        return "\n".join(f"rank {r}: " + " ".join(self.format_rank(r)) for r in range(self.pp))

    def to_csv(self) -> str:
        """One row per rank, one action per cell (PyTorch pipelining's CSV layout)."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for rank in range(self.pp):
            writer.writerow(self.format_rank(rank))
        return out.getvalue()

    @classmethod
    def from_programs(cls, name: str, rows: list[list[str]], *, placement: str = "loop"
                      ) -> "Schedule":
        """Build a schedule from action strings, inferring m, k and V from the actions."""
        programs = [[parse_action(cell) for cell in row if cell.strip()] for row in rows]
        actions = [a for program in programs for a in program]
        if not actions:
            raise ScheduleError("a schedule needs at least one action")
        return cls(name=name, pp=len(programs),
                   microbatches=1 + max(a.microbatch for a in actions),
                   splits=1 + max(a.span for a in actions),
                   chunks=1 + max(a.chunk for a in actions),
                   programs=tuple(tuple(p) for p in programs), placement=placement)

    @classmethod
    def from_text(cls, text: str, name: str = "custom", *, placement: str = "loop") -> "Schedule":
        rows = []
        for line in text.strip().splitlines():
            _, _, body = line.partition(":")
            rows.append(body.split())
        return cls.from_programs(name, rows, placement=placement)

    @classmethod
    def from_csv(cls, text: str, name: str = "custom", *, placement: str = "loop") -> "Schedule":
        return cls.from_programs(name, list(csv.reader(io.StringIO(text))), placement=placement)

    # -- lookup ---------------------------------------------------------------------------------
    def position(self, rank: int, action: Action) -> int | None:
        """Index of `action` in `rank`'s program, or None when the rank does not run it."""
        if self._index is None:
            object.__setattr__(self, "_index", [
                {a: n for n, a in enumerate(program)} for program in self.programs])
        return self._index[rank].get(action)

    def iter_actions(self) -> Iterator[tuple[int, Action]]:
        for rank, program in enumerate(self.programs):
            for action in program:
                yield rank, action


def dependencies(schedule: Schedule, rank: int, action: Action) -> list[tuple[int, Action]]:
    """The (rank, action) pairs that must finish before `action` on `rank` may start.

    Stage v = the virtual stage of (rank, action.chunk); i, j = micro-batch, span:
    - F(i,j)@v needs F(i,j)@v-1 (its input activation) and F(i,j-1)@v (the K/V of the prefix);
    - B(i,j)@v needs B(i,j)@v+1 (its output grad), F(i,j)@v, and B(i,j+1)@v (the dK/dV of span j
      is complete only after every later span's backward has run);
    - W(i,j)@v needs B(i,j)@v;
    - with the output layer spread (OPS' O), O(i,j) needs F(i,j) of the last stage (its input),
      and B(i,j) of the last stage needs O(i,j) (its output grad), on whichever rank runs it.
    Program order on the same rank is implied and not listed.
    """
    stage = schedule.stage_of(rank, action.chunk)
    i, j = action.microbatch, action.span
    needs: list[tuple[int, Action]] = []

    def at(op: str, st: int, span: int) -> tuple[int, Action]:
        owner, chunk = schedule.owner_of(st)
        return owner, Action(op, i, span, chunk)

    last = schedule.num_stages - 1
    if action.op == "O":
        return [at("F", last, j)]
    if action.op == "F":
        if stage > 0:
            needs.append(at("F", stage - 1, j))
        if j > 0:
            needs.append(at("F", stage, j - 1))
    elif action.op == "B":
        if stage < last:
            needs.append(at("B", stage + 1, j))
        elif schedule.spread_output:
            needs.append((schedule.output_rank(i, j), Action("O", i, j)))
        needs.append(at("F", stage, j))
        if j < schedule.splits - 1:
            needs.append(at("B", stage, j + 1))
    else:
        needs.append(at("B", stage, j))
    return needs


def require_output_in_last_stage(schedule: Schedule, what: str) -> None:
    """Refuse a schedule with O actions (the output layer spread over the ranks) where `what`
    does not handle them (torch's CSV has no such action): the plan layer validates,
    simulates, searches, bounds and plans their communication, the runtime runs them
    (`pretrain_gpt.py`, `check_equivalence.py` and `benchmark.py` with a schedule file)."""
    if schedule.spread_output:
        raise ScheduleError(f"{what}: schedule {schedule.name!r} spreads the output layer over the "
                            "ranks (O actions), which this does not handle (plan.py, "
                            "check_equivalence.py, benchmark.py and pretrain_gpt.py do)")


def split_full_backwards(programs: Iterable[Iterable[Action]]) -> list[list[Action]]:
    """Each full backward (a B whose unit has no W on its rank) as its B then its W, back to
    back: the same work at the same time on that rank, the input grad sent sooner, the
    activations freed at the same moment, so never slower and never more memory; and every
    unit's weight grad then runs as a W of its own."""
    out = []
    for program in programs:
        program = list(program)
        weights = {a.key() for a in program if a.op == "W"}
        split = []
        for action in program:
            split.append(action)
            if action.op == "B" and action.key() not in weights:
                split.append(action.with_op("W"))
        out.append(split)
    return out


def expected_actions(schedule: Schedule, rank: int) -> frozenset[Action]:
    """Every action `rank` must run exactly once: F and B of every unit. W of a unit is optional
    (at most once): without it, that unit's B is the full backward. O actions are owed by the
    schedule as a whole, not by a rank (`validate` checks them)."""
    return _all_actions(schedule.microbatches, schedule.splits, schedule.chunks, False)


def allowed_actions(schedule: Schedule, rank: int) -> frozenset[Action]:
    """Every action `rank` may run: F, B and W of every unit, and O of every (micro-batch, span)."""
    return _all_actions(schedule.microbatches, schedule.splits, schedule.chunks, True)


@functools.lru_cache(maxsize=16)
def _all_actions(microbatches: int, splits: int, chunks: int, allowed: bool) -> frozenset[Action]:
    ops: Iterable[str] = ("F", "B", "W") if allowed else ("F", "B")
    units = frozenset(Action(op, i, j, c) for op in ops for i in range(microbatches)
                      for j in range(splits) for c in range(chunks))
    if not allowed:
        return units
    return units | frozenset(Action("O", i, j) for i in range(microbatches) for j in range(splits))
