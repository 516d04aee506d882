"""Any pipeline schedule from a file: `--pipeline-schedule-file FILE.csv` of pretrain_gpt.py,
tools/benchmark.py, tools/check_equivalence.py and tools/plan.py, all through `load`.

The file is our CSV (`Schedule.to_csv`, `write`): one row per pipeline rank, one action per cell
in our text form ("F3.1", "B0.2@1", "W1.0@0"), so any schedule `plan.py show` prints can be
edited and run. P, m, k and V are read from the actions. A leading comment line
`# placement: vshape` says that chunk 1 of rank r is stage 2P-1-r (a V); without it chunks loop
(chunk c of rank r is stage cP + r). Blank lines and other `#` lines are skipped.

A file may spread the output layer over the ranks (O actions, actions.OPS): `plan.py simulate`,
`comm` and `memory` read it, `pretrain_gpt.py`, `check_equivalence.py` and `benchmark.py` run it
(every rank then holds a copy of the output layer, megatron_adapter.OutputHead).

Before anything runs, the schedule is checked as the registry's are: every action parses, the
dependency rules hold and it cannot deadlock (validate.py), and the communication it implies
finishes under NCCL's rules in both modes (nccl.py). The first problem is reported in one line
naming the file and the action (`ScheduleError`; the tools exit 2 on it).

A loaded schedule is registered under `file:PATH` (registry.py), so every part that reads a
schedule by name (placement, W split, chunk count, the executor's plan) reads this one; its
builder refuses any (P, m, k, V) other than the file's.

Torch's `{stage}{op}{mb}` format (torch.distributed.pipelining's CSV, k=1, as torchtitan's
`pipeline_parallel_schedule_csv` reads it) is read too, by seq1f1b/plan/torch_format.py, when the
first action is in that form. A schedule whose backward is full for some units and split into B
and W for others (DualPipeV's) runs each full backward as its B then its W
(`actions.split_full_backwards`: the same work at the same moment, never slower, never more
memory), so the runtime sees one kind of backward.
"""
from __future__ import annotations

import csv
import io
import re
from dataclasses import replace
from pathlib import Path

from seq1f1b.plan import registry
from seq1f1b.plan.actions import (PLACEMENTS, Action, Schedule, ScheduleError, parse_action,
                                  split_full_backwards)
from seq1f1b.plan.communication import communication_plan
from seq1f1b.plan.nccl import validate_modes
from seq1f1b.plan.torch_format import read_torch_csv
from seq1f1b.plan.validate import find_problems

FLAG = "--pipeline-schedule-file"
PREFIX = "file:"
_PLACEMENT_LINE = re.compile(r"#\s*placement\s*:\s*(\S+)\s*$")
_TORCH_ACTION = re.compile(r"^\d+(F|B|W|I|FULL_BACKWARD)\d+$")


def load(path: str | Path) -> Schedule:
    """Read, check and register the schedule in `path`; its name is the registry's
    (`file:PATH`). ScheduleError (one line naming the file and the first bad action) when it is
    not valid."""
    schedule = read(path)
    name = schedule.name
    if name in registry.names():
        if registry.build(name, schedule.pp, schedule.microbatches, schedule.splits,
                          schedule.chunks).programs != schedule.programs:
            raise ScheduleError(f"{FLAG} {path}: changed since this process loaded it")
        return schedule
    registry.register(name, description=f"read from {path}", chunked=schedule.chunks > 1,
                      placement=schedule.placement,
                      splits_backward=schedule.split_backward)(_builder(schedule, path))
    return schedule


def check_shape(schedule: Schedule, given: dict[str, int | None]) -> None:
    """`given`: the command line's flag -> value (None: not given) for P, m, k and V, in that
    order (each tool names them its own way); ScheduleError naming the first that is not the
    file's."""
    actual = {"pp": schedule.pp, "microbatches": schedule.microbatches,
              "splits": schedule.splits, "chunks": schedule.chunks}
    for (flag, value), key in zip(given.items(), actual):
        if value is not None and value != actual[key]:
            raise ScheduleError(f"{flag} {value}: {FLAG} {schedule.name[len(PREFIX):]} has "
                                f"{actual[key]}")


def read(path: str | Path) -> Schedule:
    """The checked schedule of `path` (not registered)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ScheduleError(f"{FLAG} {path}: cannot read it ({err})") from None
    schedule = _parse(text, path)
    problems = find_problems(schedule)
    if problems:
        raise ScheduleError(f"{FLAG} {path}: {problems[0]}")
    for mode, verdict in validate_modes(communication_plan(schedule)).items():
        if not verdict.ok:
            raise ScheduleError(f"{FLAG} {path}: under NCCL's rules ({mode} mode): "
                                f"{verdict.problems[0]}")
    return schedule


def write(schedule: Schedule) -> str:
    """The file `load` reads back as `schedule` (its placement line when it is a V)."""
    header = "" if schedule.placement == "loop" else f"# placement: {schedule.placement}\n"
    return header + schedule.to_csv()


def _parse(text: str, path: str | Path) -> Schedule:
    placement, rows = "loop", []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            found = _PLACEMENT_LINE.match(stripped)
            if found and not rows:
                placement = found.group(1)
            continue
        if stripped:
            rows.append([cell.strip() for cell in next(csv.reader(io.StringIO(line)))])
    if placement not in PLACEMENTS:
        raise ScheduleError(f"{FLAG} {path}: placement {placement!r}; choose from "
                            f"{', '.join(PLACEMENTS)}")
    cells = [cell for row in rows for cell in row if cell]
    if not cells:
        raise ScheduleError(f"{FLAG} {path}: no actions")
    try:
        if _TORCH_ACTION.match(cells[0]):
            schedule = read_torch_csv(text, name=f"{PREFIX}{path}")
        else:
            programs = [[_action(cell, path, rank, index) for index, cell in enumerate(row)
                         if cell] for rank, row in enumerate(rows)]
            actions = [action for program in programs for action in program]
            schedule = Schedule(name=f"{PREFIX}{path}", pp=len(programs),
                                microbatches=1 + max(a.microbatch for a in actions),
                                splits=1 + max(a.span for a in actions),
                                chunks=1 + max(a.chunk for a in actions),
                                programs=tuple(map(tuple, programs)), placement=placement)
    except ScheduleError as err:
        text = str(err)
        raise ScheduleError(text if text.startswith(FLAG) else f"{FLAG} {path}: {text}") from None
    if schedule.split_backward and any(schedule.full_backward(rank, action)
                                       for rank, program in enumerate(schedule.programs)
                                       for action in program):
        schedule = replace(schedule, programs=tuple(
            map(tuple, split_full_backwards(schedule.programs))))
    return schedule


def _action(cell: str, path: str | Path, rank: int, index: int) -> Action:
    try:
        return parse_action(cell)
    except ScheduleError:
        raise ScheduleError(f"{FLAG} {path}: rank {rank}, action {index + 1}: {cell!r} is not "
                            "an action (e.g. F3.1, B0.2@1, W1.0)") from None


def _builder(schedule: Schedule, path: str | Path):
    shape = (schedule.pp, schedule.microbatches, schedule.splits, schedule.chunks)

    def build(pp: int, microbatches: int, splits: int, chunks: int) -> list[list[Action]]:
        if (pp, microbatches, splits, chunks) != shape:
            raise ScheduleError(
                f"{FLAG} {path} is written for P={shape[0]} m={shape[1]} k={shape[2]} "
                f"V={shape[3]}; this run has P={pp} m={microbatches} k={splits} V={chunks}")
        return [list(program) for program in schedule.programs]

    return build
