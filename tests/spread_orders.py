"""Orders with the output layer spread over the pipeline ranks (O actions on several of them),
for the tests that run them: the greedy search's, on costs where the output layer outweighs a
stage's layers, so that it hands O's to every rank."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from seq1f1b.plan import registry, schedule_file
from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.costs import ModelConfig
from seq1f1b.plan.partition import partition
from seq1f1b.plan.schedules.greedy import Placer, Policy, Problem
from seq1f1b.plan.simulate import model_costs

HEAVY_OUTPUT = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=4,
                           vocab_size=32000, ffn_hidden_size=1024)
"""A vocabulary as large as the layers."""


def spread_order(pp: int, m: int, k: int, chunks: int, placement: str) -> Schedule:
    """The greedy's order of P=pp, m, k, V=chunks on `placement`, the output layer spread."""
    shape = replace(registry.build("seq1f1b-zbv" if chunks == 2 else "seq1f1b-zb-h1", pp, m, k,
                                   chunks), placement=placement)
    costs = model_costs(shape, HEAVY_OUTPUT, partition(4096, k, "even"), flops_per_second=1e12,
                        spread_output=True)
    placed = Placer(Problem(pp, m, k, chunks, placement, spread_output=True),
                    costs).place(math.inf, Policy())
    schedule = Schedule(f"spread-{pp}-{m}-{k}-{chunks}-{placement}", pp, m, k, chunks,
                        tuple(map(tuple, placed.programs)), placement)
    if len(set(schedule.output_ranks.values())) < 2:
        raise AssertionError(f"{schedule.name}: the search kept every O on one rank")
    return schedule


def spread_cases(folder: Path, spread: list[tuple[int, tuple, dict]]
                 ) -> dict[int, list[tuple[tuple[str, int], dict]]]:
    """For each (world, (P, m, k, V, placement), other fields) of `spread`: its order written to
    a file in `folder` and the equivalence case that runs it, keyed ("spread", n), by world."""
    extra: dict[int, list] = {}
    for n, (world, (pp, m, k, chunks, placement), fields) in enumerate(spread):
        path = folder / f"spread{n}.csv"
        path.write_text(schedule_file.write(spread_order(pp, m, k, chunks, placement)))
        extra.setdefault(world, []).append((("spread", n), {
            "pipeline_schedule_file": str(path), "pp": pp, "num_microbatches": m, "splits": k,
            "chunks": chunks, "untie_embeddings": True, **fields}))
    return extra
