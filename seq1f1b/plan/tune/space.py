"""Every layout of a model on a number of GPUs: the candidates the planner ranks.

A layout is a `TrainingSetup` (memory.py), the flags of one training run: TP within a node
(dividing the heads, K/V groups and FFN), CP that the heads allow (`check_heads`), PP dividing
the layers (with V chunks per rank for the interleaved schedules and a V for the zero-bubble V
ones), DP the rest of the GPUs, the micro-batch count that makes the global batch, a schedule of
the registry, k spans (Seq1F1B schedules; the others run whole sequences) cut evenly or by
compute, activation recompute (none, selective, full), and uneven first and last stages
(stage_layers.py) one layer lighter per chunk where the rest still deals evenly. The loss's
backward runs at B, or at the last stage's F (`--loss-backward-in-forward`: less memory on the
rank of the last stage, its F longer by the output layer's backward) when the query says "yes";
with "both" the search adds that twin where a layout runs out of memory on that rank
(search.py). Always: bf16,
sequence parallelism when TP > 1, the distributed optimizer (as the paper's runs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

from seq1f1b.plan import registry
from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.context_parallel import check_heads
from seq1f1b.plan.costs import ModelConfig
from seq1f1b.plan.memory import TrainingSetup
from seq1f1b.plan.stage_layers import StageLayers, layers_per_virtual_stage

RECOMPUTES = (None, "selective", "full")
ONE_RANK_TWINS = {"gpipe": "1f1b", "zb-h1": "1f1b", "seq1f1b-zb-h1": "seq1f1b"}
"""On one pipeline rank these run as their twin does (no neighbour to wait for, a split W
right after its B): the planner keeps only the twin there."""
PARTITIONS = ("even", "compute")
LOSS_IN_FORWARD_CHOICES = ("no", "yes", "both")
"""plan.py tune --loss-backward-in-forward: every layout without the flag, every one with it, or
the flag where only it makes a layout fit (Query.loss_backward_in_forward)."""


def default_schedules() -> tuple[str, ...]:
    """The registry's schedules but the searched ones (a search per layout is not a lookup)."""
    return tuple(name for name in registry.names() if not registry.get(name).searched)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Query:
    """What the user asks the planner (tools/plan.py tune's flags)."""

    model: ModelConfig
    seq_length: int
    gpus: int
    gpus_per_node: int = 8
    global_batch_size: Optional[int] = None     # None: default_global_batch
    micro_batch_size: int = 1
    schedules: tuple[str, ...] = field(default_factory=default_schedules)
    max_splits: int = 32
    min_span: int = 1024            # tokens: no span shorter (k is capped by L / min_span)
    chunks: tuple[int, ...] = (2, 4)     # V of the loop-interleaved schedules (a V has 2)
    partitions: tuple[str, ...] = PARTITIONS
    recomputes: tuple[Optional[str], ...] = RECOMPUTES
    uneven: bool = True
    loss_backward_in_forward: str = "both"     # one of LOSS_IN_FORWARD_CHOICES

    def __post_init__(self) -> None:
        for flag, value in (("--seq-length", self.seq_length), ("--gpus", self.gpus),
                            ("--gpus-per-node", self.gpus_per_node),
                            ("--micro-batch-size", self.micro_batch_size),
                            ("--max-splits", self.max_splits), ("--min-span", self.min_span)):
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{flag} must be a positive integer, got {value!r}")
        if self.gpus % self.gpus_per_node and self.gpus_per_node % self.gpus:
            raise ScheduleError(f"--gpus {self.gpus} is neither a multiple nor a divisor of "
                                f"--gpus-per-node {self.gpus_per_node}")
        if self.global_batch_size is None:
            object.__setattr__(self, "global_batch_size", default_global_batch(self.gpus))
        if self.global_batch_size < 1 or self.global_batch_size % self.micro_batch_size:
            raise ScheduleError(f"--global-batch-size {self.global_batch_size} must be a "
                                f"positive multiple of --micro-batch-size "
                                f"{self.micro_batch_size}")
        for name in self.schedules:
            if registry.get(name).searched:
                raise ScheduleError(f"--schedules: {name} is searched per layout; the planner "
                                    "ranks the registry's fixed schedules")
        for value in self.chunks:
            if value < 2:
                raise ScheduleError(f"--chunks: V of an interleaved schedule is >= 2, got "
                                    f"{value}")
        if self.loss_backward_in_forward not in LOSS_IN_FORWARD_CHOICES:
            raise ScheduleError(f"--loss-backward-in-forward {self.loss_backward_in_forward!r}: "
                                f"choose from {', '.join(LOSS_IN_FORWARD_CHOICES)}")
        for name in self.partitions:
            if name not in PARTITIONS:
                raise ScheduleError(f"--partitions: {name!r}; choose from "
                                    f"{', '.join(PARTITIONS)}")


def default_global_batch(gpus: int) -> int:
    """A global batch of one sequence per 4 GPUs, at least 32 (the paper's 7B runs: 32)."""
    return max(32, gpus // 4)


def splits_of(query: Query, schedule: str) -> list[int]:
    """k: 1 for the whole-sequence schedules; powers of two from 2 to --max-splits with spans
    of at least --min-span tokens for the Seq1F1B ones."""
    if not schedule.startswith("seq1f1b"):
        return [1]
    found, k = [], 2
    while k <= query.max_splits and query.seq_length // k >= query.min_span:
        found.append(k)
        k *= 2
    return found


def _stage_splits(layers: int, pp: int, chunks: int, placement: str, uneven: bool
                  ) -> list[StageLayers]:
    """Even, then the first and/or last stage one layer per chunk lighter where the others
    still share the rest evenly."""
    found = [StageLayers()]
    if not uneven or pp < 2:
        return found
    lighter = (layers // (pp * chunks) - 1) * (chunks if placement == "loop" else 1)
    if lighter < 1:
        return found
    for split in (StageLayers(lighter, None), StageLayers(None, lighter),
                  StageLayers(lighter, lighter)):
        try:
            layers_per_virtual_stage(layers, pp, chunks, placement, split)
        except ScheduleError:
            continue
        found.append(split)
    return found


def _tensor_parallel_sizes(query: Query) -> list[int]:
    model = query.model
    return [tp for tp in divisors(min(query.gpus_per_node, query.gpus))
            if query.gpus % tp == 0 and model.num_attention_heads % tp == 0
            and model.num_query_groups % tp == 0 and model.ffn_hidden_size % tp == 0]


def _context_parallel_sizes(query: Query, tp: int) -> list[int]:
    sizes = []
    for cp in divisors(query.gpus // tp):
        try:
            check_heads(query.model.num_attention_heads, query.model.num_query_groups, tp, cp)
        except ScheduleError:
            continue
        if query.seq_length % cp == 0:
            sizes.append(cp)
    return sizes


def candidates(query: Query) -> Iterator[TrainingSetup]:
    """Every layout of `query` (the module docstring says which)."""
    model = query.model
    for tp in _tensor_parallel_sizes(query):
        for cp in _context_parallel_sizes(query, tp):
            for pp in divisors(query.gpus // (tp * cp)):
                dp = query.gpus // (tp * cp * pp)
                if model.num_layers % pp or query.global_batch_size % (
                        dp * query.micro_batch_size):
                    continue
                microbatches = query.global_batch_size // (dp * query.micro_batch_size)
                for schedule in query.schedules:
                    yield from _layouts(query, schedule, tp, cp, pp, dp, microbatches)


def _layouts(query: Query, schedule: str, tp: int, cp: int, pp: int, dp: int,
             microbatches: int) -> Iterator[TrainingSetup]:
    info = registry.get(schedule)
    if pp == 1 and (info.chunked or schedule in ONE_RANK_TWINS):
        return
    chunk_choices = ((2,) if info.placement == "vshape" else query.chunks) if info.chunked \
        else (1,)
    layers = query.model.num_layers
    for chunks in chunk_choices:
        if layers % (pp * chunks):
            continue
        for splits in splits_of(query, schedule):
            for partition in (query.partitions if splits > 1 else ("even",)):
                for recompute in query.recomputes:
                    for split in _stage_splits(layers, pp, chunks, info.placement,
                                               query.uneven):
                        yield TrainingSetup(
                            model=query.model, seq_length=query.seq_length, schedule=schedule,
                            pp=pp, microbatches=microbatches, splits=splits, chunks=chunks,
                            tp=tp, dp=dp, cp=cp, micro_batch_size=query.micro_batch_size,
                            sequence_parallel=tp > 1, distributed_optimizer=True,
                            partition=partition, recompute_granularity=recompute,
                            decoder_first_pipeline_num_layers=split.first,
                            decoder_last_pipeline_num_layers=split.last,
                            loss_backward_in_forward=query.loss_backward_in_forward == "yes")
