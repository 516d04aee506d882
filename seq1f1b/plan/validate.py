"""Is a schedule runnable and correct? Completeness, the dependency rules, and deadlocks.

Three checks, each reporting what is wrong in words a reader can act on:
1. every rank runs exactly `expected_actions` (nothing missing, twice, or foreign), and W of a
   unit at most once (a unit without its W has a full backward: actions.OPS); with the output
   layer spread (O actions), each (micro-batch, span) has its O on exactly one rank;
2. every dependency of `actions.dependencies` that lies on the same rank comes earlier in that
   rank's program (e.g. F0.1 before F0.0 breaks the KV-cache rule);
3. a replay of all programs finishes: each rank walks its program in order, an action runs once
   its dependencies have run (sends never block, receives are posted early, so program order and
   the dependency rules are the only constraints). If no rank can move before all are done, the
   schedule deadlocks; the report names each stuck rank's next action and what it waits for.
The replay is public as `topological_order`: a valid global execution order for the simulator.

Cost: O(total actions x dependencies per action). The checks run on integer codes, vectorised
with numpy, and ask actions.py once per problem rather than once per action: the unit tests
validate every family on a grid of ~4700 problems (2.4 million actions).
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Iterable
from operator import attrgetter

import numpy as np

from seq1f1b.plan.actions import (OPS, Action, Schedule, ScheduleError, allowed_actions,
                                  dependencies, expected_actions)

Step = tuple[int, Action]
"""(rank, action): one action of one rank's program."""

_LISTED = 6  # actions named per message before "... (N in all)"
_REPORTED = 10  # problems named by `validate` before "... and N more"


def topological_order(schedule: Schedule) -> list[Step]:
    """Every (rank, action) in an order that respects program order and the dependency rules.

    Raises ScheduleError naming each stuck rank's next action and its unmet dependencies when
    the programs deadlock (which includes waiting for an action that no rank runs).
    """
    steps = list(schedule.iter_actions())
    return [steps[step] for step in _replay(schedule, _StepGraph.of(schedule))]


@dataclass(frozen=True)
class ExecutionGraph:
    """The schedule's steps (every (rank, action), rank by rank in program order), an order that
    runs them, and each step's dependencies as step indices (program order not listed): what a
    replay with costs needs, computed once with the vectorised rule table."""

    steps: list[Step]
    order: list[int]
    needs: list[list[int]]


def execution_graph(schedule: Schedule) -> ExecutionGraph:
    """`topological_order` with the dependency steps of each step; raises like it."""
    graph = _StepGraph.of(schedule)
    order = _replay(schedule, graph)
    never = graph.never
    return ExecutionGraph(list(schedule.iter_actions()), order,
                          [[need for need in needs if need < never] for needs in graph.needs])


def find_problems(schedule: Schedule) -> list[str]:
    """Everything wrong with `schedule`, one sentence each; empty when it is valid."""
    graph = _StepGraph.of(schedule)
    problems = _completeness_problems(schedule, graph) + _program_order_problems(schedule, graph)
    if problems:  # a replay of an incomplete or misordered schedule only restates them
        return problems
    try:
        _replay(schedule, graph)
    except ScheduleError as deadlock:
        return [str(deadlock)]
    return []


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError listing the problems of `schedule`; return None when it is valid."""
    problems = find_problems(schedule)
    if problems:
        more = len(problems) - _REPORTED
        tail = f"; ... and {more} more" if more > 0 else ""
        raise ScheduleError(
            f"schedule {schedule.name!r} (pp={schedule.pp}, m={schedule.microbatches}, "
            f"k={schedule.splits}, V={schedule.chunks}) is invalid: "
            + "; ".join(problems[:_REPORTED]) + tail)


# -- actions as integer codes ----------------------------------------------------------------------
_OP, _MB, _SPAN, _CHUNK = map(attrgetter, ("op", "microbatch", "span", "chunk"))
_OP_INDEX = {name: index for index, name in enumerate(OPS)}
_RULE, _OUTSIDE, _UNUSED = 0, 1, 2  # a dependency slot: a rule, beyond every index, no dependency


_O = _OP_INDEX["O"]


@dataclass(frozen=True)
class _Layout:
    """(rank, action) -> one integer, micro-batch outermost: the code of micro-batch i is the
    code of micro-batch 0 (the action's *shape*) plus i * stride. `spans` and `chunks` bound every
    span and chunk that occurs (foreign actions widen them). An O action is coded as if rank 0
    ran it, whichever rank does: it is the schedule's to run once, and a B of the last stage
    needs it wherever it runs, the same way for every micro-batch."""

    pp: int
    spans: int
    chunks: int

    @property
    def stride(self) -> int:
        return self.pp * len(OPS) * self.spans * self.chunks

    def shape(self, rank, op, span, chunk):  # works on ints and on numpy arrays alike
        return ((rank * len(OPS) + op) * self.spans + span) * self.chunks + chunk

    def code(self, rank, op, microbatch, span, chunk):
        return microbatch * self.stride + self.shape(rank, op, span, chunk)

    def unshape(self, code: int) -> tuple[int, str, int, int]:
        """(rank, op, span, chunk) of a shape code."""
        rest, chunk = divmod(code, self.chunks)
        rest, span = divmod(rest, self.spans)
        rank, op = divmod(rest, len(OPS))
        return rank, OPS[op], span, chunk


_KEPT = 8  # problems whose answers are kept (tools and tests check several families on one)


def _kept(store: OrderedDict, key: tuple, make):
    """store[key], made on first use; only the _KEPT most recently used keys are kept."""
    if key not in store:
        store[key] = make()
        if len(store) > _KEPT:
            store.popitem(last=False)
    store.move_to_end(key)
    return store[key]


@dataclass
class _RuleTable:
    """dependencies() of each action shape at micro-batch 0, asked once per shape and kept.

    The rules relate actions of one micro-batch, the same way for every micro-batch and whatever
    m is, so the dependencies of micro-batch i are those of micro-batch 0 shifted by i (a test
    checks this against asking dependencies() for every action). slots[shape, n] = (code at
    micro-batch 0, micro-batch offset, kind) of the n-th dependency.
    """

    known: np.ndarray
    slots: np.ndarray

    @classmethod
    def empty(cls, layout: _Layout) -> "_RuleTable":
        return cls(np.zeros(layout.stride, dtype=bool),
                   np.full((layout.stride, 0, 3), _UNUSED, dtype=np.int64))

    def lookup(self, schedule: Schedule, layout: _Layout, shapes: np.ndarray) -> np.ndarray:
        for shape in np.unique(shapes[~self.known[shapes]]).tolist():
            rank, op, span, chunk = layout.unshape(shape)
            row = [(layout.shape(0 if dep.op == "O" else dep_rank, _OP_INDEX[dep.op], dep.span,
                                 dep.chunk),
                    dep.microbatch, _RULE) if dep.span < layout.spans and dep.chunk < layout.chunks
                   else (0, 0, _OUTSIDE)
                   for dep_rank, dep in dependencies(schedule, rank, Action(op, 0, span, chunk))]
            if len(row) > self.slots.shape[1]:
                grown = np.full((layout.stride, len(row), 3), _UNUSED, dtype=np.int64)
                grown[:, :self.slots.shape[1]] = self.slots
                self.slots = grown
            if row:
                self.slots[shape, :len(row)] = row
            self.known[shape] = True
        return self.slots[shapes]


_rule_tables: OrderedDict[tuple, _RuleTable] = OrderedDict()
_owed_codes: OrderedDict[tuple, dict[int, np.ndarray]] = OrderedDict()


def _owed(schedule: Schedule, layout: _Layout) -> dict[int, np.ndarray]:
    """rank -> sorted codes of expected_actions(schedule, rank), filled on first use. What a rank
    owes depends on the problem (P, m, k, V, placement), never on the programs, so it is asked
    once per problem."""
    return _kept(_owed_codes, (layout, schedule.microbatches, schedule.splits, schedule.chunks,
                               schedule.placement), dict)


def _fields(actions: Iterable[Action]) -> tuple[np.ndarray, ...]:
    """(op index, micro-batch, span, chunk) of each action, as arrays."""
    actions = list(actions)
    ops = map(_OP_INDEX.__getitem__, map(_OP, actions))
    return tuple(np.fromiter(values, np.int64, len(actions))
                 for values in (ops, *(map(get, actions) for get in (_MB, _SPAN, _CHUNK))))


# -- the schedule as a graph of integer steps ------------------------------------------------------
@dataclass(frozen=True)
class _StepGraph:
    """Step id = offsets[rank] + index in that rank's program. needs[id] = the step ids it waits
    for besides program order, in the order dependencies() lists them: a dependency no rank runs
    gets id `never`; unused slots get `never + 1`, a step that counts as done."""

    layout: _Layout
    offsets: list[int]
    codes: np.ndarray  # code of each step
    fields: tuple[np.ndarray, ...]  # (op index, micro-batch, span, chunk) of each step
    need_ids: np.ndarray  # (steps, slots) step ids, as `needs`
    needs: list[list[int]]

    @property
    def never(self) -> int:
        return self.offsets[-1]

    @classmethod
    def of(cls, schedule: Schedule) -> "_StepGraph":
        """dependencies() of every action as step ids, vectorised over micro-batches."""
        programs = schedule.programs
        lengths = [len(program) for program in programs]
        offsets = [0, *accumulate(lengths)]
        never = offsets[-1]
        op, mb, span, chunk = _fields(chain.from_iterable(programs))
        rank = np.repeat(np.arange(schedule.pp), lengths)
        last_mb, last_span, last_chunk = (int(a.max()) if never else 0 for a in (mb, span, chunk))
        layout = _Layout(schedule.pp, max(schedule.splits, last_span + 1),
                         max(schedule.chunks, last_chunk + 1))
        shapes = layout.shape(np.where(op == _O, 0, rank), op, span, chunk)
        codes = mb * layout.stride + shapes
        step_of = np.full((last_mb + 1) * layout.stride, never)
        step_of[codes[::-1]] = np.arange(never)[::-1]  # the first occurrence wins

        rules = _kept(_rule_tables, (layout, schedule.placement, schedule.splits,
                                     schedule.chunks, schedule.spread_output),
                      lambda: _RuleTable.empty(layout))
        slots = rules.lookup(schedule, layout, shapes)
        base, kind = slots[..., 0], slots[..., 2]
        shifted = slots[..., 1] + mb[:, None]
        runs = (kind == _RULE) & (shifted <= last_mb)
        need_ids = np.where(runs, step_of[base + np.where(runs, shifted, 0) * layout.stride],
                            never)
        need_ids = np.where(kind == _UNUSED, never + 1, need_ids)
        return cls(layout, offsets, codes, (op, mb, span, chunk), need_ids, need_ids.tolist())


# -- checks ----------------------------------------------------------------------------------------
def _listing(actions: list[Action], show_chunk: bool) -> str:
    ordered = sorted(actions, key=lambda a: (a.microbatch, a.span, a.chunk, _OP_INDEX[a.op]))
    names = [a.format(show_chunk) for a in ordered]
    extra = f" ... ({len(names)} in all)" if len(names) > _LISTED else ""
    return " ".join(names[:_LISTED]) + extra


def _completeness_problems(schedule: Schedule, graph: _StepGraph) -> list[str]:
    problems = []
    show = schedule.chunks > 1
    owed = _owed(schedule, graph.layout)
    for rank, program in enumerate(schedule.programs):
        if rank not in owed:
            expected_fields = _fields(expected_actions(schedule, rank))
            owed[rank] = np.sort(graph.layout.code(rank, *expected_fields))
        mine = slice(graph.offsets[rank], graph.offsets[rank + 1])
        op, mb, span, chunk = (values[mine] for values in graph.fields)
        weights = op == _OP_INDEX["W"]
        codes = graph.codes[mine]
        if np.array_equal(np.sort(codes[~weights & (op != _O)]), owed[rank]) and \
                len(np.unique(codes[weights])) == int(weights.sum()) and \
                not np.any(weights & ((mb >= schedule.microbatches) | (span >= schedule.splits)
                                      | (chunk >= schedule.chunks))):
            continue
        present = set(program)
        twice = [a for a, n in Counter(program).items() if n > 1]
        missing = list(expected_actions(schedule, rank) - present)
        foreign = list(present - allowed_actions(schedule, rank))
        if twice:
            problems.append(f"rank {rank} runs more than once: {_listing(twice, show)}")
        if missing:
            problems.append(f"rank {rank} never runs: {_listing(missing, show)}")
        if foreign:
            problems.append(
                f"rank {rank} runs actions outside m={schedule.microbatches}, "
                f"k={schedule.splits}, V={schedule.chunks}: {_listing(foreign, show)}")
    return problems + _output_problems(schedule)


def _output_problems(schedule: Schedule) -> list[str]:
    """With O actions, each (micro-batch, span) has its O on exactly one rank (actions.OPS)."""
    if not schedule.spread_output:
        return []
    runs: dict[tuple[int, int], list[int]] = {}
    for rank, program in enumerate(schedule.programs):
        for action in program:
            if action.op == "O":
                runs.setdefault((action.microbatch, action.span), []).append(rank)
    problems = [f"O{i}.{j} runs on ranks {' and '.join(map(str, ranks))}, once is the rule"
                for (i, j), ranks in sorted(runs.items()) if len(ranks) > 1]
    missing = [Action("O", i, j) for i in range(schedule.microbatches)
               for j in range(schedule.splits) if (i, j) not in runs]
    if missing:
        problems.append(f"no rank runs {_listing(missing, False)} (an O for every unit, or none)")
    return problems


def _program_order_problems(schedule: Schedule, graph: _StepGraph) -> list[str]:
    """Same-rank dependencies that come later in the program than the action needing them:
    a step id between the action's own and the end of its rank's program."""
    steps = np.arange(graph.never)
    rank_of = np.repeat(np.arange(schedule.pp), np.diff(graph.offsets))
    end = np.array(graph.offsets[1:])[rank_of]
    later = (graph.need_ids > steps[:, None]) & (graph.need_ids < end[:, None])
    problems = []
    show = schedule.chunks > 1
    for step, slot in zip(*np.nonzero(later)):
        rank = int(rank_of[step])
        first = graph.offsets[rank]
        need = int(graph.need_ids[step, slot])
        action, dep = schedule.programs[rank][step - first], schedule.programs[rank][need - first]
        problems.append(f"rank {rank} runs {action.format(show)} (step {step - first}) before "
                        f"{dep.format(show)} (step {need - first}), which it needs "
                        f"({_reason(action, dep)})")
    return problems


def _reason(action: Action, dep: Action) -> str:
    """Which dependency rule ties `action` to `dep` (same micro-batch by construction)."""
    if action.op == "W":
        return "a weight grad follows its input-grad backward"
    if action.op == "O":
        return "the output layer's input, from the last stage"
    if action.op == "F":
        return "K/V of the previous span" if dep.span != action.span else "input activation"
    if dep.op == "F":
        return "its own forward"
    return "dK/dV from the later span's backward" if dep.span != action.span else "output gradient"


# -- replay ----------------------------------------------------------------------------------------
def _replay(schedule: Schedule, graph: _StepGraph) -> list[int]:
    """Step ids in the order a replay runs them: every rank runs as far as it can, a blocked rank
    waits on its first unmet dependency. Raises ScheduleError when they deadlock."""
    offsets, needs = graph.offsets, graph.needs
    done = bytearray(graph.never + 2)
    done[graph.never + 1] = 1  # padding
    waiting: list[list[int] | None] = [None] * (graph.never + 2)  # step id -> ranks blocked on it
    cursor = offsets[:-1]
    finished: list[int] = []
    runnable = deque(range(schedule.pp))
    while runnable:
        rank = runnable.popleft()
        step, end = cursor[rank], offsets[rank + 1]
        while step < end:
            for need in needs[step]:
                if not done[need]:
                    break
            else:
                done[step] = 1
                finished.append(step)
                if waiting[step]:
                    runnable.extend(waiting[step])
                step += 1
                continue
            if waiting[need] is None:
                waiting[need] = []
            waiting[need].append(rank)
            break
        cursor[rank] = step
    if len(finished) < graph.never:
        raise ScheduleError(_deadlock_report(schedule, graph, cursor, done))
    return finished


def _deadlock_report(schedule: Schedule, graph: _StepGraph, cursor: list[int],
                     done: bytearray) -> str:
    show = schedule.chunks > 1
    stuck = []
    for rank, step in enumerate(cursor):
        if step == graph.offsets[rank + 1]:
            continue
        action = schedule.programs[rank][step - graph.offsets[rank]]
        waits = []
        for (dep_rank, dep), need in zip(dependencies(schedule, rank, action), graph.needs[step]):
            if not done[need]:
                never = " (never run there)" if need == graph.never else ""
                waits.append(f"{dep.format(show)} on rank {dep_rank}{never}")
        stuck.append(f"rank {rank} at {action.format(show)} (step {step - graph.offsets[rank]}) "
                     f"waits for {' and '.join(waits)}")
    return "deadlock: " + "; ".join(stuck)
