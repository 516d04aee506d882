"""What each rank holds at its peak, found once per schedule shape and priced per layout.

The simulator replays a rank's program and adds up, action by action, the bytes it allocates
and frees (`simulate.held_change`, the one place those rules live). Those bytes are linear in the
byte tables of the costs: at every step a rank holds some count of each table entry (span j's
activations on its chunk c, chunk c's K/V cache, its dK/dV accumulators, the logits, the
output weights' gradient the loss's backward at F keeps). So the
replay is run once per schedule with symbolic tables, each entry a unit vector, giving per rank
the distinct held states as rows of counts; a layout's peak is then the largest row times its
byte table (`HeldProfile.peaks`), the figure `simulate` gives for the same costs, without a
replay. Only states right after an allocation, or a change while an action runs, are kept: a
peak is never reached by a release.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.simulate import RankReport, SpanCosts, held_change, held_tables

KINDS = ("activation", "logits", "kv_cache", "kv_accumulator", "head_gradient",
         "activation_per_group", "kv_accumulator_per_group")
"""The byte tables, in the order of a rank's basis: [kind][chunk][span]."""
_HELD_KIND = {"activation": "activation", "logits": "logits", "kv_cache": "kv_cache",
              "kv_accumulator": "kv_cache", "head_gradient": "logits",
              "activation_per_group": "activation", "kv_accumulator_per_group": "kv_cache"}
"""The held kind each table's bytes count under (simulate: accumulators under kv_cache)."""


@dataclass(frozen=True)
class RankProfile:
    rank: int
    stages: tuple[int, ...]          # the rank's virtual stage of each chunk
    states: np.ndarray               # [distinct states, basis] counts, in first-seen order
    peak_live_spans: int


@dataclass(frozen=True)
class HeldProfile:
    """Per rank, the held states of one schedule (see the module docstring)."""

    schedule: Schedule
    ranks: tuple[RankProfile, ...]

    @classmethod
    def of(cls, schedule: Schedule) -> "HeldProfile":
        return cls(schedule, tuple(_rank_profile(schedule, rank)
                                   for rank in range(schedule.pp)))

    def peaks(self, costs: SpanCosts) -> list[RankReport]:
        """Each rank's held_at_peak, peak_held_bytes and peak_live_spans for `costs` (what
        `simulate(schedule, costs).ranks` reports of them; busy and idle are not timed here)."""
        tables = held_tables(costs)
        reports = []
        for profile in self.ranks:
            weights = np.array([tables[kind][stage][span] for kind in KINDS
                                for stage in profile.stages
                                for span in range(self.schedule.splits)])
            held = dict.fromkeys(("activation", "kv_cache", "logits"), 0.0)
            totals = profile.states @ weights if len(profile.states) else np.zeros(0)
            if len(totals) and totals.max() > 0:
                row = profile.states[int(np.argmax(totals))] * weights
                width = len(profile.stages) * self.schedule.splits
                for index, kind in enumerate(KINDS):
                    held[_HELD_KIND[kind]] += float(row[index * width:(index + 1) * width].sum())
            reports.append(RankReport(profile.rank, 0.0, 0.0, profile.peak_live_spans, None,
                                      None, [], None, sum(held.values()), held))
        return reports


def _rank_profile(schedule: Schedule, rank: int) -> RankProfile:
    stages = tuple(schedule.stage_of(rank, chunk) for chunk in range(schedule.chunks))
    splits = schedule.splits
    width = len(stages) * splits
    size = len(KINDS) * width
    zero = np.zeros(size)
    basis = np.eye(size)

    def table(kind: int) -> list[list[np.ndarray]]:
        rows = [[zero] * splits for _ in range(schedule.num_stages)]
        for chunk, stage in enumerate(stages):
            rows[stage] = [basis[kind * width + chunk * splits + span] for span in range(splits)]
        return rows

    tables = {kind: table(index) for index, kind in enumerate(KINDS)}
    changes: dict[tuple, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}
    state = [0] * size
    seen: dict[tuple[int, ...], None] = {}
    live = peak_live = 0
    for action in schedule.programs[rank]:
        frees = schedule.frees_activations(rank, action)
        if action.op == "F":
            live += 1
            peak_live = max(peak_live, live)
        if frees:
            live -= 1
        stage = schedule.stage_of(rank, action.chunk)
        key = (stage, action.op, action.span, frees)
        if key not in changes:      # as sparse count changes: (basis index, count)
            changes[key] = tuple(_sparse(sum(change.values()) + zero)
                                 for change in held_change(tables, stage, action, frees))
        *rises, released = changes[key]
        for rise in rises:              # allocated at the start, then changed while it runs
            for index, count in rise:
                state[index] += count
            if rise:
                seen.setdefault(tuple(state))
        for index, count in released:
            state[index] -= count
    states = np.array(list(seen), dtype=float) if seen else np.zeros((0, size))
    return RankProfile(rank, stages, states, peak_live)


def _sparse(vector: np.ndarray) -> list[tuple[int, int]]:
    return [(int(index), int(round(vector[index]))) for index in np.flatnonzero(vector)]
