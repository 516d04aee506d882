"""How the decoder layers are dealt to the virtual stages: evenly, with uneven first and last
stages (megatron-core 0.16's `num_layers_in_first_pipeline_stage` /
`num_layers_in_last_pipeline_stage`, Megatron-LM's `--decoder-first-pipeline-num-layers` /
`--decoder-last-pipeline-num-layers`), or with a count for every virtual stage (megatron-core's
`pipeline_model_parallel_layout`, Megatron-LM's `--pipeline-model-parallel-layout`).

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

A layout (`--pipeline-model-parallel-layout`, megatron's string form: stages split by `|`, `t` a
decoder layer, `E` the embedding, `L` the loss, `X*n` / `(...)*n` repeats, commas cosmetic, e.g.
"Et*4|(t*5|)*2(t*4|)*4t*2L": 32 layers on 8 stages) lists the virtual stages in the order the
data flows through them, E leading the first and L closing the last. On a loop that is
megatron's own order (entry cP + r is chunk c of rank r); on a V it is stage order, so entry
2P-1 is rank 0's chunk 1, the output layer's. Any counts of >= 1 layer may be given, so the output layer's stage can shed layers to
the middle ones, which the first / last rule (the middle stages even) cannot.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from seq1f1b.plan.actions import ScheduleError, virtual_stage

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"


@dataclass(frozen=True)
class StageLayers:
    """The uneven first / last counts (None: that end shares the even split), or every virtual
    stage's count in stage order (`counts`, a layout; then first and last are None)."""

    first: Optional[int] = None
    last: Optional[int] = None
    counts: Optional[tuple[int, ...]] = None

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None or self.counts is not None

    @classmethod
    def of_flags(cls, flags) -> "StageLayers":
        """From an object with the flags' dests (decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers, pipeline_model_parallel_layout; absent ones None): the
        trainer's arguments, an EquivalenceCase, a TrainingSetup. ScheduleError naming the flag
        for a layout that does not parse or comes with the first / last counts."""
        first = getattr(flags, "decoder_first_pipeline_num_layers", None)
        last = getattr(flags, "decoder_last_pipeline_num_layers", None)
        layout = getattr(flags, "pipeline_model_parallel_layout", None)
        if layout is None:
            return cls(first, last)
        if first is not None or last is not None:
            raise ScheduleError(f"{LAYOUT_FLAG} gives every stage's layers: drop {FIRST_FLAG} "
                                f"/ {LAST_FLAG}")
        return cls(counts=parse_layout(layout))

    def for_reference(self) -> "StageLayers":
        """What 1F1B's reference run (a cap's "0.5x" is of its rank-0 peak) keeps of this split:
        a layout counts this schedule's P x V stages, so the one-chunk 1F1B keeps the even split;
        first / last counts apply to it as they are."""
        return EVEN if self.counts is not None else self

    @property
    def layout(self) -> Optional[str]:
        """The counts in megatron's string form (None without counts)."""
        return format_layout(self.counts) if self.counts is not None else None


EVEN = StageLayers()


def layers_per_virtual_stage(num_layers: int, pp: int, chunks: int = 1, placement: str = "loop",
                             split: StageLayers = EVEN) -> tuple[int, ...]:
    """The decoder layers of each virtual stage, in stage order (P x V entries). ScheduleError
    naming the flag when the counts cannot be dealt so (every stage needs >= 1 layer)."""
    stages = pp * chunks
    if split.counts is not None:
        return _layout_stages(num_layers, stages, split.counts)
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


def _layout_stages(num_layers: int, stages: int, counts: tuple[int, ...]) -> tuple[int, ...]:
    if len(counts) != stages:
        raise ScheduleError(f"{LAYOUT_FLAG} lists {len(counts)} stages but the pipeline has "
                            f"pp*chunks = {stages} virtual stages")
    if sum(counts) != num_layers:
        raise ScheduleError(f"{LAYOUT_FLAG} holds {sum(counts)} decoder layers but the model "
                            f"has {num_layers}")
    if min(counts) < 1:
        raise ScheduleError(f"{LAYOUT_FLAG}: stage {counts.index(min(counts))} holds no decoder "
                            "layer (every stage needs >= 1)")
    return tuple(counts)


def _expand(text: str, start: int = 0) -> tuple[str, int]:
    """`text` from `start` with its repeats written out, up to an unmatched ')' (or the end);
    returns it and the index it stopped at."""
    out, index = [], start
    while index < len(text) and text[index] != ")":
        if text[index] == "(":
            atom, index = _expand(text, index + 1)
            if index >= len(text):
                raise ScheduleError(f"{LAYOUT_FLAG} {text!r}: '(' without ')'")
        else:
            atom = text[index]
        index += 1
        repeat = re.match(r"\*(\d+)", text[index:])
        if repeat:
            atom *= int(repeat.group(1))
            index += repeat.end()
        out.append(atom)
    return "".join(out), index


def parse_layout(text: str) -> tuple[int, ...]:
    """Decoder layers of every stage of a layout string (module doc), in stage order;
    ScheduleError naming the flag when it is not one: characters other than E, t, L, |, (, ),
    *n and commas, E anywhere but the start or L anywhere but the end, no E or no L."""
    cleaned = text.replace(",", "").replace(" ", "")
    flat, end = _expand(cleaned)
    if end < len(cleaned):
        raise ScheduleError(f"{LAYOUT_FLAG} {text!r}: ')' without '('")
    stray = set(flat) - set("EtL|")
    if stray:
        raise ScheduleError(f"{LAYOUT_FLAG} {text!r}: unknown layer {sorted(stray)[0]!r} (E "
                            "embedding, t decoder layer, L loss; stages split by |)")
    if not flat.startswith("E") or flat.count("E") != 1:
        raise ScheduleError(f"{LAYOUT_FLAG} {text!r}: the embedding E must open the first "
                            "stage, once")
    if not flat.endswith("L") or flat.count("L") != 1:
        raise ScheduleError(f"{LAYOUT_FLAG} {text!r}: the loss L must close the last stage, "
                            "once")
    return tuple(stage.count("t") for stage in flat.split("|"))


def format_layout(counts: tuple[int, ...]) -> str:
    """`counts` (decoder layers per stage, in stage order) as a layout string."""
    def stage(index: int, count: int) -> str:
        return ("E" * (index == 0) + ("t" if count == 1 else f"t*{count}")
                + "L" * (index == len(counts) - 1))

    return "|".join(stage(index, count) for index, count in enumerate(counts))
