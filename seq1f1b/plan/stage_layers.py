"""How the decoder layers are dealt to the virtual stages: evenly, or with uneven first and last
stages (megatron-core 0.16's `num_layers_in_first_pipeline_stage` /
`num_layers_in_last_pipeline_stage`, Megatron-LM's `--decoder-first-pipeline-num-layers` /
`--decoder-last-pipeline-num-layers`).

The first stage carries the embedding and the last the output layer and the loss, so giving them
fewer layers than the others evens the pipeline out. One function gives the count of every
virtual stage, read by the cost model (simulate.model_costs), the estimator (memory.py), the
projection and the model builders (the trainer, check_equivalence), so they cannot disagree.

- Loop placement (chunk c of rank r is stage cP + r): megatron's own meaning. The flags count
  the layers of pipeline rank 0 (first) and rank P-1 (last), each split evenly over the rank's
  V chunks; the other ranks share the rest evenly, V chunks each.
- V placement (chunk 0 of rank r is stage r, chunk 1 is stage 2P-1-r): rank 0 holds both the
  first stage and the last, so a count per rank would move nothing. Here the flags count the
  layers of virtual stage 0 (chunk 0 of rank 0: the embedding's) and of virtual stage 2P-1
  (chunk 1 of rank 0: the output layer's); the other 2P-2 stages share the rest evenly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from seq1f1b.plan.actions import ScheduleError, virtual_stage

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"


@dataclass(frozen=True)
class StageLayers:
    """The uneven first / last counts (None: that end shares the even split)."""

    first: Optional[int] = None
    last: Optional[int] = None

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None


EVEN = StageLayers()


def layers_per_virtual_stage(num_layers: int, pp: int, chunks: int = 1, placement: str = "loop",
                             split: StageLayers = EVEN) -> tuple[int, ...]:
    """The decoder layers of each virtual stage, in stage order (P x V entries). ScheduleError
    naming the flag when the counts cannot be dealt so (every stage needs >= 1 layer)."""
    stages = pp * chunks
    if not split.uneven:
        if num_layers % stages:
            raise ScheduleError(f"--pp/--chunks: the model's {num_layers} layers are not "
                                f"divisible by pp*chunks = {pp}*{chunks}")
        return (num_layers // stages,) * stages
    for flag, value in ((FIRST_FLAG, split.first), (LAST_FLAG, split.last)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ScheduleError(f"{flag} must be a positive integer, got {value!r}")
    if pp < 2:
        raise ScheduleError(f"{FIRST_FLAG} / {LAST_FLAG} need a pipeline of >= 2 ranks")
    if placement == "vshape":
        return _v_stages(num_layers, pp, split)
    return _loop_stages(num_layers, pp, chunks, split)


def _shared(rest: int, ways: int, what: str) -> int:
    if ways == 0:
        if rest:
            raise ScheduleError(f"{FIRST_FLAG} / {LAST_FLAG} leave {rest} layers but no other "
                                f"{what} to hold them")
        return 0
    if rest < ways or rest % ways:
        raise ScheduleError(f"{FIRST_FLAG} / {LAST_FLAG} leave {rest} layers, which do not "
                            f"divide into {ways} {what} of >= 1 layer")
    return rest // ways


def _loop_stages(num_layers: int, pp: int, chunks: int, split: StageLayers) -> tuple[int, ...]:
    per_rank = {}
    for rank, flag, value in ((0, FIRST_FLAG, split.first), (pp - 1, LAST_FLAG, split.last)):
        if value is not None:
            if value % chunks:
                raise ScheduleError(f"{flag} {value} is not divisible by the {chunks} model "
                                    "chunks of a rank")
            per_rank[rank] = value
    rest = num_layers - sum(per_rank.values())
    others = pp - len(per_rank)
    shared = _shared(rest, others * chunks, "model chunks") * chunks
    layers = [0] * (pp * chunks)
    for rank in range(pp):
        for chunk in range(chunks):
            layers[virtual_stage("loop", pp, rank, chunk)] = per_rank.get(rank, shared) // chunks
    return tuple(layers)


def _v_stages(num_layers: int, pp: int, split: StageLayers) -> tuple[int, ...]:
    ends = {stage: value for stage, value in ((0, split.first), (2 * pp - 1, split.last))
            if value is not None}
    rest = num_layers - sum(ends.values())
    shared = _shared(rest, 2 * pp - len(ends), "virtual stages")
    return tuple(ends.get(stage, shared) for stage in range(2 * pp))
