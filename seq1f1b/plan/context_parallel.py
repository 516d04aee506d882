"""What context parallelism (Ulysses all-to-all around the span attention) does to a rank's costs.

The runtime (seq1f1b/runtime/context_parallel.py) splits each span's tokens contiguously over the
C ranks of the CP group for everything but core attention, and all-to-alls q, k, v to head-sharded
(each rank: the whole span, H / C heads) and the output back. Per rank, therefore:
- every FLOP divides by C: GEMMs see span / C tokens, attention the whole span for 1/C of the heads;
- activations, logits and stage outputs hold span / C tokens; the K/V cache holds the whole
  sequence for the rank's K/V groups, 1/C of them, or one group when there are fewer groups per
  TP rank than C (replicated: `kv_replication`);
- each layer's forward moves q, k, v and the output through four all-to-alls, its backward their
  gradients through four more (`all_to_all_bytes`), and the KV prefix is never re-sent.
"""
from __future__ import annotations

import math

from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.costs import ModelConfig


def check_heads(num_attention_heads: int, num_query_groups: int, tp: int, cp: int,
                flag: str = "--context-parallel-size") -> None:
    """Refuse (ScheduleError, one line naming `flag`) heads C cannot shard: query heads per TP
    rank must divide by C, K/V groups per TP rank must divide by C or divide C."""
    if not isinstance(cp, int) or cp < 1:
        raise ScheduleError(f"{flag} must be a positive integer, got {cp!r}")
    heads, groups = num_attention_heads // tp, num_query_groups // tp
    if heads % cp:
        raise ScheduleError(f"{flag} {cp} must divide the attention heads per tensor-parallel "
                            f"rank ({num_attention_heads} / TP {tp} = {heads})")
    if groups % cp and cp % groups:
        raise ScheduleError(f"{flag} {cp}: the K/V groups per tensor-parallel rank "
                            f"({num_query_groups} / TP {tp} = {groups}) must divide by it or "
                            "divide it")


def span_alignment(cp: int, tp: int, sequence_parallel: bool, align: int = 1) -> int:
    """The multiple every span must be: under context parallelism C, so each CP rank holds an
    equal contiguous part, times TP under sequence parallelism (each part is cut over TP); with
    the alignment asked for (--seq1f1b-span-alignment, the tools' --span-alignment, plan.py's
    --align) their lcm."""
    return math.lcm(align, cp * tp if sequence_parallel else cp)


def kv_replication(model: ModelConfig, tp: int, cp: int) -> float:
    """A CP rank's K/V cache over 1/C of the whole TP rank's cache: 1 when the groups per TP rank
    divide by C, C / groups when each rank keeps one (replicated) group."""
    groups = model.num_query_groups // tp
    return max(groups // cp, 1) * cp / groups


def all_to_all_bytes(model: ModelConfig, span_length: int, batch: int, tp: int, cp: int,
                     bytes_per_element: int = 2) -> float:
    """Bytes one CP rank sends (and receives) in one layer's forward all-to-alls of a span: q,
    k, v and the output of its span / C tokens, (C - 1) / C of each leaving the rank. The
    backward moves as much again."""
    if cp == 1:
        return 0.0
    d = model.kv_channels
    kv_heads = model.num_query_groups * kv_replication(model, tp, cp)
    per_token = (2 * model.num_attention_heads + 2 * kv_heads) * d / tp
    return span_length / cp * batch * per_token * bytes_per_element * (cp - 1) / cp
