"""torch.distributed.pipelining's CSV action format, read into and written from our IR.

torch (and torchtitan) write a schedule as one CSV row per rank, one compute action per cell:
`{stage}{op}{microbatch}` with op F (forward), I (input-grad backward), W (weight grad) or B (a
full backward), e.g. `3F0,3I0,3W0`; an overlapped pair is `(0F4;7B2)OVERLAP_F_B`. Each
micro-batch is one unit (k = 1). In our IR the stage becomes (rank, chunk) through a placement
(loop: chunk c of rank r is stage cP+r; V: chunk 1 of rank r is stage 2P-1-r), I becomes B with
its unit's W present and a full B becomes B without W (actions.OPS): so a schedule that splits
the backward of some micro-batches only (DualPipeV) keeps its meaning.

Reading takes compute actions only: empty cells (idle slots) are skipped, and so are the
communication and resharding actions of torch's "compute_comms" form (SEND_F, RECV_B, UNSHARD,
RESHARD, REDUCE_GRAD...): here the communication plan is derived from the compute order
(communication.py). The result is not validated: callers run `validate.validate` on it.
"""
from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Union

from seq1f1b.plan.actions import (PLACEMENTS, Action, Schedule, ScheduleError,
                                  require_output_in_last_stage, virtual_stage)

_COMPUTE = re.compile(r"^(\d+)([FIBW])(\d+)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_SKIPPED = re.compile(r"^\d*(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*$")


def read_torch_csv(source: Union[str, Path], *, name: str = "torch-csv") -> Schedule:
    """A Schedule from torch's CSV: a path (Path, or a string naming an existing file) or the
    text itself. The placement (loop or V) and V are inferred from which stages each rank runs.
    ScheduleError names the row and cell of the first action it cannot read."""
    label, text = _source_text(source)
    rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text))]
    while rows and not any(rows[-1]):
        rows.pop()
    if not rows:
        raise ScheduleError(f"{label}: no rows (one row of actions per rank)")
    parsed = [[(stage, op, mb) for col, cell in enumerate(row)
               for stage, op, mb in _cell_actions(label, rank, col, cell)]
              for rank, row in enumerate(rows)]
    pp = len(parsed)
    placement, chunks = _placement(label, parsed)
    shape = Schedule("shape", pp, 1, 1, chunks, ((),) * pp, placement)
    programs = []
    for rank, actions in enumerate(parsed):
        split = {(stage, mb) for stage, op, mb in actions if op in "IW"}
        program = []
        for stage, op, mb in actions:
            chunk = shape.owner_of(stage)[1]
            if op == "B" and (stage, mb) in split:
                raise ScheduleError(f"{label}: rank {rank} runs a full backward {stage}B{mb} "
                                    "and also an I or W of that micro-batch")
            program.append(Action("B" if op == "I" else op, mb, 0, chunk))
        for stage, mb in sorted(split):
            ops = {op for s, op, m in actions if (s, m) == (stage, mb)}
            if not {"I", "W"} <= ops:
                missing = "W" if "I" in ops else "I"
                raise ScheduleError(f"{label}: rank {rank} splits the backward of stage {stage} "
                                    f"micro-batch {mb} but never runs its {stage}{missing}{mb}")
        programs.append(tuple(program))
    every = [a for program in programs for a in program]
    if not every:
        raise ScheduleError(f"{label}: no compute actions")
    return Schedule(name, pp, 1 + max(a.microbatch for a in every), 1, chunks, tuple(programs),
                    placement)


def write_torch_csv(schedule: Schedule) -> str:
    """torch's compute-only CSV of `schedule` (k = 1 only: torch's unit is a micro-batch)."""
    require_output_in_last_stage(schedule, "torch's CSV")
    if schedule.splits != 1:
        raise ScheduleError(f"torch's CSV has one unit per micro-batch; schedule "
                            f"{schedule.name!r} has {schedule.splits} spans (use --splits 1)")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank, program in enumerate(schedule.programs):
        cells = []
        for action in program:
            op = action.op
            if op == "B" and not schedule.full_backward(rank, action):
                op = "I"
            cells.append(f"{schedule.stage_of(rank, action.chunk)}{op}{action.microbatch}")
        writer.writerow(cells)
    return out.getvalue()


def _source_text(source: Union[str, Path]) -> tuple[str, str]:
    if isinstance(source, Path) or ("\n" not in source and "," not in source
                                    and Path(source).is_file()):
        path = Path(source)
        try:
            return str(path), path.read_text()
        except OSError as error:
            raise ScheduleError(f"{path}: cannot read ({error.strerror})") from None
    return "schedule CSV", source


def _cell_actions(label: str, rank: int, col: int, cell: str) -> list[tuple[int, str, int]]:
    if not cell or cell == "None" or _SKIPPED.match(cell):
        return []
    overlap = _OVERLAP.match(cell)
    parts = overlap.group(1).split(";") if overlap else [cell]
    actions = []
    for part in parts:
        match = _COMPUTE.match(part.strip())
        if not match:
            raise ScheduleError(f"{label}: row {rank + 1} cell {col + 1}: cannot read {cell!r}; "
                                "expected {stage}{F|I|W|B}{micro-batch}, e.g. 3F0")
        actions.append((int(match.group(1)), match.group(2), int(match.group(3))))
    return actions


def _placement(label: str, parsed: list[list[tuple[int, str, int]]]) -> tuple[str, int]:
    """(placement, V) under which rank r holds exactly the stages it runs."""
    pp = len(parsed)
    stages = [{stage for stage, _, _ in actions} for actions in parsed]
    top = max((max(held) for held in stages if held), default=0)
    chunks = max(1, -(-(top + 1) // pp))
    for placement in PLACEMENTS:
        if placement == "vshape" and chunks != 2:
            continue
        if all(held <= {virtual_stage(placement, pp, rank, c) for c in range(chunks)}
               for rank, held in enumerate(stages)):
            return placement, chunks
    raise ScheduleError(f"{label}: the stages each rank runs ({stages}) are neither a loop "
                        "(stage c*P + r) nor a V (stages r and 2P-1-r) placement")

