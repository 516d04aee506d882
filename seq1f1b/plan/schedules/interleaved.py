"""Interleaved 1F1B (megatron-core 0.16.1's order) and Seq1F1B-I (spans replace micro-batches).

Each rank holds V model chunks; chunk c of rank r is virtual stage c*P + r. Megatron's order
(forward_backward_pipelining_with_interleaving, get_schedule_table, get_pp_rank_microbatches):
- units are cut into groups of G consecutive units (microbatch_group_size_per_vp_stage, default
  P); forward visits group by group, and inside a group chunk 0's units, then chunk 1's, ...;
- backward walks the same table with chunks reversed (chunk V-1 first) and, per chunk, pops
  units first-in first-out;
- warm-up 2(P - r - 1) + (V - 1)G units, then one forward / one backward, then cool-down;
- it refuses G > m and a last group of 0 < (m mod G) < P units (dependency bubbles).

Seq1F1B-I keeps all of this with single spans as units. Per chunk the forward units are spans in
(i asc, j asc) order and the backward units (i asc, j desc). A group holds whole micro-batches:
G = k * ceil(P/k) spans, the fewest whole micro-batches holding at least P spans (>= P spans so
that a chunk switch never waits on the previous chunk, as in Megatron). Whole micro-batches keep
every span a group's backward needs inside the same group: B(i,k-1), the first backward of a
micro-batch, needs F(i,k-1), at most k-1 units after the position it occupies in the forward
table. (Groups of P spans would cut micro-batches when k does not divide P, and the backward of
a cut micro-batch would need forwards a whole group later: a longer warm-up, e.g. 10 spans
instead of 8 on the last rank for P=4, k=3, V=2.)

Warm-up on rank r, in units: 2(P - r - 1) + lead, where lead is derived, not typed in
(one_f_one_b.own_forward_lead): the fewest forwards that put every backward after its own
forward. For these tables lead = (V - 1)G + (k - 1) with spans, (V - 1)P with micro-batches.
2(P - r - 1) is Megatron's depth term: warm-up forwards run back to back on every rank, so the
first gradient, which passes P - r - 1 later ranks, reaches rank r 2(P - r - 1) units after
rank P-1 started its 1F1B phase. With unit-cost spans the bubble stays at Megatron's 2(P - 1)
units (tested). With k = 1 both names give Megatron's order exactly.

`interleaved-1f1b` with splits k > 1 runs Megatron's order at micro-batch granularity, each
micro-batch span by span (the interleaved baseline for seq1f1b-interleaved).
"""
from __future__ import annotations

from seq1f1b.plan.actions import Action, ScheduleError
from seq1f1b.plan.registry import register
from seq1f1b.plan.schedules.gpipe import backward_order, forward_order
from seq1f1b.plan.schedules.one_f_one_b import Unit, group_units, one_f_one_b_programs


def microbatches_per_group(pp: int, splits: int, unit_size: int) -> int:
    """Micro-batches per chunk-switching group: P for micro-batch units (Megatron's default),
    ceil(P/k) for span units (the fewest whole micro-batches holding at least P spans)."""
    units_per_microbatch = splits // unit_size
    return -(-pp // units_per_microbatch)


def check_groups(name: str, pp: int, microbatches: int, splits: int, unit_size: int) -> None:
    """Megatron's constraints on the groups, in units: at least one full group, and a last group
    that is either full or holds at least P units."""
    per_group = microbatches_per_group(pp, splits, unit_size)
    units_per_microbatch = splits // unit_size
    units = "micro-batches" if units_per_microbatch == 1 else "spans"
    group = (f"{per_group} micro-batches" if units_per_microbatch == 1 else
             f"{per_group} micro-batches ({per_group * splits} spans: the fewest whole "
             f"micro-batches holding at least pp={pp} spans)")
    prefix = f"--microbatches: {name} switches model chunks every {group}; m={microbatches}"
    advice = f"use a multiple of {per_group} micro-batches"
    if microbatches < per_group:
        raise ScheduleError(f"{prefix} is less than one group; {advice}")
    last = (microbatches % per_group) * units_per_microbatch
    if 0 < last < pp:
        raise ScheduleError(f"{prefix} leaves a last group of {last} {units}, fewer than pp={pp} "
                            f"(megatron-core refuses it: dependency bubbles); {advice}")


def interleaved_unit_orders(microbatches: int, splits: int, chunks: int, unit_size: int,
                            group: int) -> tuple[list[Unit], list[Unit]]:
    """Megatron's schedule table over units: (forward units, backward units) of one rank."""
    forward_per_chunk = [group_units(forward_order(microbatches, splits, c), unit_size)
                         for c in range(chunks)]
    backward_per_chunk = [group_units(backward_order(microbatches, splits, c), unit_size)
                          for c in range(chunks)]
    total = len(forward_per_chunk[0])
    forward: list[Unit] = []
    backward: list[Unit] = []
    for start in range(0, total, group):
        end = min(start + group, total)
        for chunk in range(chunks):
            forward.extend(forward_per_chunk[chunk][start:end])
        for chunk in reversed(range(chunks)):
            backward.extend(backward_per_chunk[chunk][start:end])
    return forward, backward


def _interleaved(name: str, pp: int, microbatches: int, splits: int, chunks: int,
                 unit_size: int) -> list[list[Action]]:
    check_groups(name, pp, microbatches, splits, unit_size)
    group = microbatches_per_group(pp, splits, unit_size) * (splits // unit_size)
    forward, backward = interleaved_unit_orders(microbatches, splits, chunks, unit_size, group)
    return one_f_one_b_programs(pp, forward, backward, depth_per_rank=2)


@register("interleaved-1f1b", chunked=True,
          description="megatron-core's interleaved 1F1B (chunk c of rank r = stage c*P+r); with "
                      "splits > 1 each micro-batch runs span by span")
def interleaved_1f1b(pp: int, microbatches: int, splits: int, chunks: int) -> list[list[Action]]:
    return _interleaved("interleaved-1f1b", pp, microbatches, splits, chunks, unit_size=splits)


@register("seq1f1b-interleaved", chunked=True,
          description="Seq1F1B-I: interleaved 1F1B over spans, chunks switch every "
                      "k*ceil(P/k) spans, correct for every k and P")
def seq1f1b_interleaved(pp: int, microbatches: int, splits: int, chunks: int
                        ) -> list[list[Action]]:
    return _interleaved("seq1f1b-interleaved", pp, microbatches, splits, chunks, unit_size=1)
