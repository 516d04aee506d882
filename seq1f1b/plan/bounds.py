"""A lower bound on the makespan of any schedule of one problem (P, m, k, V, placement) under
given costs, whatever its memory: the yardstick the search and `plan.py compare` report gaps to.

Two bounds, the larger is kept:
- per rank: the rank cannot start before the first span has come down to its first stage (the
  forwards of span 0 of micro-batch 0 on every earlier stage: stage r is the earliest a rank
  holds in both placements) and then has all its own work to do (F, B and W of every unit on
  each of its stages; a full backward costs B + W, so splitting or not changes nothing);
- per micro-batch: one micro-batch's dependency chain, span 0's forward down every stage, then
  span 0's backward back up every stage (B(i,0) on a stage waits for B(i,0) on the next one and
  for its own forward).
Memory caps, p2p latency and the dependencies between micro-batches are ignored: the bound is
reached only when no rank ever idles after its first action.
"""
from __future__ import annotations

from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.simulate import SpanCosts


def lower_bound(shape: Schedule, costs: SpanCosts) -> float:
    """Makespan no valid schedule of `shape`'s problem can beat under `costs` (module doc)."""
    spans, stages = range(shape.splits), range(shape.num_stages)

    def work(stage: int) -> float:
        weight = costs.weight[stage] if costs.weight is not None else (0.0,) * shape.splits
        return shape.microbatches * sum(costs.forward[stage][j] + costs.backward[stage][j]
                                        + weight[j] for j in spans)

    busy = max(sum(costs.forward[v][0] for v in range(rank))
               + sum(work(shape.stage_of(rank, c)) for c in range(shape.chunks))
               for rank in range(shape.pp))
    chain = sum(costs.forward[v][0] + costs.backward[v][0] for v in stages)
    return max(busy, chain)
