"""The lower bound (seq1f1b/plan/bounds.py): below every schedule, ours and torch's, on every
cost model, with and without p2p hops; reached where the optimum is known (GPipe on a loop
without a memory limit, one micro-batch's chain); hops counted between ranks only. A bound that
is too high fails the first test, one that is too low the second."""
import math
from dataclasses import replace

import pytest

from seq1f1b.plan.bounds import gap_to_bound, lower_bound
from seq1f1b.plan.costs import preset
from seq1f1b.plan.registry import build
from seq1f1b.plan.simulate import SpanCosts, simulate
from seq1f1b.plan.actions import ScheduleError
from seq1f1b.schedule_compare import SKEWED, UNIT, CostModel, ours, searched, searched_schedule
from seq1f1b.torch_peers import PEERS, peer_schedule

COSTS = {
    "unit": CostModel(UNIT),
    "skewed": CostModel(SKEWED),
    "model": CostModel(model=preset("7b"), seq_length=65536, tp=8, sequence_parallel=True),
}
SHAPES = [(2, 4, 1), (4, 8, 1), (4, 4, 2), (2, 3, 4)]


def peak(schedule, costs: CostModel) -> float:
    return max(r.peak_held_bytes for r in simulate(schedule, costs.costs(schedule)).ranks)


def with_hops(costs: SpanCosts, schedule, seconds: float) -> SpanCosts:
    return replace(costs, hop=tuple((seconds,) * schedule.splits
                                    for _ in range(schedule.num_stages - 1)))


@pytest.mark.parametrize("kind", sorted(COSTS))
@pytest.mark.parametrize("pp, m, k", SHAPES)
def test_no_schedule_beats_the_bound(kind, pp, m, k):
    schedules = ours(pp, m, k) + [s for s in (peer_schedule(name, pp, m) for name in PEERS)
                                  if s is not None and k == 1]
    assert len(schedules) >= 8
    for schedule in schedules:
        for hop in (0.0, 0.05):
            costs = with_hops(COSTS[kind].costs(schedule), schedule, hop)
            assert simulate(schedule, costs).makespan >= lower_bound(schedule, costs) * (1 - 1e-9), \
                (schedule.name, schedule.chunks, hop)


@pytest.mark.parametrize("kind", sorted(COSTS))
@pytest.mark.parametrize("pp, m, k", SHAPES + [(8, 8, 4)])
def test_gpipe_reaches_the_bound_of_a_loop(kind, pp, m, k):
    """Without a memory limit GPipe (every forward, then every backward) is optimal on a loop,
    hops or not, and the bound says so: it sees the stream of micro-batches through each stage,
    not only one micro-batch's chain (the earlier bound was 5-21% below it)."""
    gpipe = build("gpipe", pp, m, k, 1)
    for hop in (0.0, 0.05):
        costs = with_hops(COSTS[kind].costs(gpipe), gpipe, hop)
        assert gap_to_bound(simulate(gpipe, costs).makespan, lower_bound(gpipe, costs)) == 0.0


@pytest.mark.parametrize("name, chunks, hops", [("zbv", 2, 4), ("zb-h1", 1, 2)])
def test_hops_are_counted_between_ranks_only(name, chunks, hops):
    """P=2, m=1, unit costs: one micro-batch's chain, F down every stage and B back up (4 x 0.5
    on a V's chunks, 2 x 1 on a loop's stages, each way), then stage 0's W. On a V, stages 1 and
    2 are rank 1's two chunks: 4 of its 6 hops cross ranks; on a loop both of its 2 do."""
    schedule = build(name, 2, 1, 1, chunks)
    plain = lower_bound(schedule, COSTS["unit"].costs(schedule))
    assert plain == pytest.approx(4.0 + 1.0 / chunks)
    hopped = lower_bound(schedule, with_hops(COSTS["unit"].costs(schedule), schedule, 0.1))
    assert hopped == pytest.approx(plain + hops * 0.1)


@pytest.mark.parametrize("kind, pp, m, k", [("skewed", 4, 8, 1), ("model", 4, 8, 1),
                                            ("model", 4, 8, 2)])
def test_the_search_without_a_cap_reaches_the_bound(kind, pp, m, k):
    """Memory free, the searched schedule is optimal on these shapes: the bound is reached, so
    what separates the search from the bound under a cap is the memory."""
    assert searched(pp, m, k, COSTS[kind], cap=math.inf).gap == 0.0


@pytest.mark.parametrize("kind", sorted(COSTS))
@pytest.mark.parametrize("pp, m, k", SHAPES)
def test_no_schedule_beats_the_bound_at_its_own_peak(kind, pp, m, k):
    """Under a cap, the warm-up it forces counts too; every schedule, ours (the search under
    its default cap and under 0.8 of it, on two chunks and on one) and torch's, is held to the
    bound at the memory it holds, where the warm-up bound is at its tightest."""
    costs = COSTS[kind]
    schedules = ours(pp, m, k) + [s for s in (peer_schedule(name, pp, m) for name in PEERS)
                                  if s is not None and k == 1]
    for chunks in (2, 1):
        default = searched_schedule(pp, m, k, costs, None, chunks)
        schedules.append(default)
        try:
            schedules.append(searched_schedule(pp, m, k, costs, 0.8 * peak(default, costs),
                                               chunks))
        except ScheduleError:
            pass             # no order fits 0.8 of it
    for schedule in schedules:
        span_costs, held = costs.costs(schedule), peak(schedule, costs)
        bound = lower_bound(schedule, span_costs, held)
        assert simulate(schedule, span_costs).makespan >= bound * (1 - 1e-9), schedule.name


def test_a_cap_raises_the_bound_below_the_optimum():
    """7B costs, P = 2, m = 4, k = 1 on a V at 1F1B's rank-0 peak: rank 0 cannot start all
    four micro-batches' forwards before its first W, so it idles in the warm-up. The bound
    rises from 4.950 (memory free) to 5.085, below 5.211, the optimum CP-SAT proves there
    (tests/unit/test_schedule_peers.py)."""
    costs = COSTS["model"]
    cap = peak(build("1f1b", 2, 4, 1, 1), costs)
    shape = build("seq1f1b-zbv", 2, 4, 1, 2)
    span_costs = costs.costs(shape)
    assert lower_bound(shape, span_costs) == pytest.approx(4.9502, abs=1e-4)
    assert lower_bound(shape, span_costs, cap) == pytest.approx(5.0853, abs=1e-4)
