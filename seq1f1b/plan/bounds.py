"""A lower bound on the makespan of any schedule of one problem (P, m, k, V, placement) under
given costs, whatever its memory: the yardstick the search and `plan.py compare` report gaps to.

Three bounds, the largest is kept:
- per rank, forwards first: none of a stage's work can start before span 0 of the first
  micro-batch has come down to it (the forwards of span 0 on every earlier stage). Taking the
  rank's stages in the order the data reaches them, before the j-th one is reached the rank can
  only run forwards of the earlier ones; everything else (the rest of its F, B and W of every
  unit; a full backward costs B + W, so splitting or not changes nothing) runs after. On a V
  rank r's chunk 1 (stage 2P-1-r) is reached late, and the forwards of chunk 0 rarely fill the
  wait;
- per rank, backwards after the turn: no backward runs on a stage before the last span of some
  micro-batch has gone through the last stage (span 0 down every stage before it, then every
  span on the last one: each waits for the one before on that stage) and come back up to it
  (the B of that last span on every later stage: the last span's backward runs first, since a
  span's B waits for the later spans'). The rank's highest stage gets one first; every B and W
  of the rank runs after that;
- per micro-batch: one micro-batch's dependency chain, span 0's forward down every stage, then
  span 0's backward back up every stage (B(i,0) on a stage waits for B(i,0) on the next one and
  for its own forward).
Memory caps, p2p latency and most dependencies between micro-batches are ignored: the bound is
reached only when no rank ever idles past these waits.
"""
from __future__ import annotations

from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.simulate import SpanCosts


def lower_bound(shape: Schedule, costs: SpanCosts) -> float:
    """Makespan no valid schedule of `shape`'s problem can beat under `costs` (module doc)."""
    spans, stages = range(shape.splits), range(shape.num_stages)
    last, m = shape.num_stages - 1, shape.microbatches
    weight = costs.weight if costs.weight is not None else \
        tuple((0.0,) * shape.splits for _ in stages)

    def forwards(stage: int) -> float:
        return m * sum(costs.forward[stage][j] for j in spans)

    def after_forward(stage: int) -> float:
        return m * sum(costs.backward[stage][j] + weight[stage][j] for j in spans)

    def reached(stage: int) -> float:
        return sum(costs.forward[v][0] for v in range(stage))

    turned = reached(last) + sum(costs.forward[last][j] for j in spans)

    def first_backward(stage: int) -> float:
        return turned + sum(costs.backward[v][shape.splits - 1] for v in range(stage + 1, last + 1))

    def rank_bound(rank: int) -> float:
        own = sorted((shape.stage_of(rank, c) for c in range(shape.chunks)), key=reached)
        total = sum(forwards(s) + after_forward(s) for s in own)
        by_forwards = max(reached(s) + total - sum(forwards(t) for t in own[:j])
                          for j, s in enumerate(own))
        return max(by_forwards, first_backward(max(own)) + sum(after_forward(s) for s in own))

    chain = sum(costs.forward[v][0] + costs.backward[v][0] for v in stages)
    return max(max(rank_bound(rank) for rank in range(shape.pp)), chain)
