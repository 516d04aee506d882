"""Items 1 and 2 of issue 26 on a representative grid (the full grid: `tools/peer_grid.py`): torch's ZB-V, DualPipeV and interleaved zero bubble orders, built by
torch's own generators, replayed beside ours on the same costs. Capped at any rival's peak,
seq1f1b-zb-auto holds no more and finishes no later; zbv is torch's ZB-V; the exact solver
never finds worse than the search it starts from, and its proven bound is below both."""
from dataclasses import replace

import pytest

from seq1f1b.plan.bounds import lower_bound
from seq1f1b.plan.costs import preset
from seq1f1b.plan.communication import communication_plan
from seq1f1b.plan.nccl import MODES, validate_modes
from seq1f1b.plan.registry import build
from seq1f1b.plan.budget import ScheduleBudget
from seq1f1b.plan.validate import find_problems
from seq1f1b.schedule_compare import (SKEWED, UNIT, CostModel, ours, peer_rows,
                                      peer_violations, row, searched)

COSTS = {
    "unit": CostModel(UNIT),
    "skewed": CostModel(SKEWED),
    "model": CostModel(model=preset("7b"), seq_length=65536, tp=8, sequence_parallel=True),
}
GRID = [(2, 4, 1), (4, 8, 1), (4, 6, 2), (2, 4, 4)]


def rivals(pp, m, k, costs):
    """The peers (k = 1) and our fixed schedules at k, on a V or a loop. Under 7B costs the
    loop ones were ahead of the V-placed search (P = 2, m = 4, k = 1: zb-h1 5.710 against
    6.171; the V's rank 0 also runs the output layer): the search now also places a loop, on
    two chunks and on one."""
    def build_rows():
        return peer_rows(pp, m, costs) + [row(s, costs) for s in ours(pp, m, k)]
    return build_rows


@pytest.mark.parametrize("kind", sorted(COSTS))
@pytest.mark.parametrize("pp, m, k", GRID)
def test_the_search_never_loses_at_equal_or_lower_peak(kind, pp, m, k):
    costs = COSTS[kind]
    violations, rows = peer_violations(pp, m, k, costs, rivals(pp, m, k, costs))
    assert violations == []
    assert rows and all(r.makespan >= r.lower_bound * (1 - 1e-9) for r in rows)


@pytest.mark.parametrize("kind", sorted(COSTS))
def test_zbv_is_the_published_construction_under_any_costs(kind):
    """Same order as torch's ZB-V, so the same makespan and peak on any costs."""
    costs = COSTS[kind]
    for pp, m in ((2, 4), (4, 8), (4, 3)):
        torch_zbv = next(r for r in peer_rows(pp, m, costs) if r.name == "torch-zbv")
        ours_zbv = row(build("zbv", pp, m, 1, 2), costs)
        assert (ours_zbv.makespan, ours_zbv.peaks) == (torch_zbv.makespan, torch_zbv.peaks)


@pytest.mark.parametrize("name", ["zbv", "seq1f1b-zbv", "seq1f1b-zb-auto", "loop:1", "loop:2"])
@pytest.mark.parametrize("pp, m, k", [(2, 4, 2), (3, 5, 3), (4, 8, 2)])
def test_new_schedules_pass_the_nccl_checker(name, pp, m, k):
    """The V schedules, and the search on a V and on a loop of one and of two chunks."""
    if name.startswith("loop:"):
        chunks = int(name[5:])
        shape = build("seq1f1b-zb-auto", pp, m, k, chunks)
        kind = "model" if 32 % (pp * chunks) == 0 else "skewed"   # 7B's 32 layers
        costs = COSTS[kind].costs(replace(shape, placement="loop"))
        schedule = build("seq1f1b-zb-auto", pp, m, k, chunks,
                         budget=ScheduleBudget(costs, None, "loop"))
        assert schedule.placement == "loop"
    elif name == "seq1f1b-zb-auto":
        shape = build("seq1f1b-zbv", pp, m, k, 2)
        schedule = build(name, pp, m, k, 2,
                         budget=ScheduleBudget(COSTS["skewed"].costs(shape), None))
    else:
        schedule = build(name, pp, m, k, 2)
    assert find_problems(schedule) == []
    verdicts = validate_modes(communication_plan(schedule), MODES)
    assert all(v.ok for v in verdicts.values()), {k: v.problems for k, v in verdicts.items()}


def test_exact_solver_starts_from_the_search_and_bounds_it():
    """P=2, m=4, k=1, skewed costs, seq1f1b-zbv's peak: CP-SAT's order is valid, within the cap
    and no longer than the search's (its hint); its proven bound is below it. When it proves
    optimality (a second or two on an idle core) the search's order is that optimum."""
    from seq1f1b.plan.exact import solve
    from seq1f1b.plan.schedules.greedy import Problem
    from seq1f1b.plan.schedules.zero_bubble_v import default_cap
    shape = build("seq1f1b-zbv", 2, 4, 1, 2)
    costs = COSTS["skewed"].costs(shape)
    cap = default_cap(Problem(2, 4, 1, 2, "vshape"), costs)
    found = searched(2, 4, 1, COSTS["skewed"])
    auto = build("seq1f1b-zb-auto", 2, 4, 1, 2, budget=ScheduleBudget(costs, None))
    exact = solve(shape, costs, cap, time_limit_s=10, hint=auto, workers=2)
    assert find_problems(exact.schedule) == [] and exact.peak <= cap * (1 + 1e-9)
    assert found.lower_bound <= exact.makespan <= found.makespan * (1 + 1e-9)
    assert exact.bound <= exact.makespan * (1 + 1e-4)   # the bound of the problem in ticks
    if exact.optimal:
        assert exact.makespan == pytest.approx(found.makespan, rel=1e-9)


def test_the_lower_bound_waits_for_the_v_to_turn_and_holds_for_every_schedule():
    """P=8, m=8, k=1, skewed costs (per chunk F 0.5, B 0.75, W 0.25): rank 7 holds stages 7 and
    8, so its first backward waits for micro-batch 0 to go down all 16 stages (16 x 0.5) and
    back up stages 15..9 (7 x 0.75); all 16 of its B (16 x 0.75) come after, and the last of
    them still goes down stages 6..0 (7 x 0.75) before stage 0's W (0.25), longer than every W
    the rank could keep for its end (16 x 0.25). No schedule on a V, ours or the peers', beats
    that, and the search reaches it: there it is the optimum of a V. (A loop of two chunks
    per rank has a lower bound of 29.25, which no schedule here reaches: torch's interleaved
    zero bubble takes 31.0.)"""
    costs = COSTS["skewed"]
    bound = 16 * 0.5 + 7 * 0.75 + 16 * 0.75 + 7 * 0.75 + 0.25
    shape = build("seq1f1b-zbv", 8, 8, 1, 2)
    assert lower_bound(shape, costs.costs(shape)) == pytest.approx(bound)
    rows = [row(s, costs) for s in ours(8, 8, 1)] + peer_rows(8, 8, costs)
    found = searched(8, 8, 1, costs)
    on_a_v = [r for r in rows + [found] if r.placement == "vshape"]
    assert len(on_a_v) >= 4 and all(r.makespan >= bound * (1 - 1e-9) for r in on_a_v)
    assert found.placement == "vshape" and found.makespan == pytest.approx(bound)


@pytest.mark.parametrize("pp", [2, 4])
def test_the_search_reaches_cp_sats_optimum_on_small_model_problems(pp):
    """7B costs at m = P, k = 1, seq1f1b-zbv's peak: the greedy replays alone stopped 9-10%
    above the optimum CP-SAT proves (a rank ran a W just before the backward the pipeline waited
    for); the moves on the critical path (refine.py) reach it."""
    from seq1f1b.plan.exact import solve
    from seq1f1b.plan.schedules.greedy import Problem
    from seq1f1b.plan.schedules.zero_bubble_v import default_cap
    costs = COSTS["model"]
    shape = build("seq1f1b-zbv", pp, pp, 1, 2)
    span_costs = costs.costs(shape)
    found = searched(pp, pp, 1, costs)
    auto = build("seq1f1b-zb-auto", pp, pp, 1, 2, budget=ScheduleBudget(span_costs, None))
    exact = solve(shape, span_costs, default_cap(Problem(pp, pp, 1, 2, "vshape"), span_costs),
                  time_limit_s=60, hint=auto, workers=2)
    assert exact.optimal, exact.status
    assert found.makespan <= exact.makespan * (1 + 1e-4)


def test_a_v_under_zbvs_peak_reaches_cp_sats_optimum():
    """7B costs, P = 2, m = 4, k = 1, a V capped at 1F1B's rank-0 peak (34.03 GiB, under ZB-V's
    35.69: rank 0 also holds the loss's logits). Keeping room for every admitted micro-batch's
    twin at once, the V search gave 6.171; keeping it in turn (Policy.promises = "in turn") it
    gives 5.211, the optimum CP-SAT proves, ahead of the best loop (5.381)."""
    from seq1f1b.plan.exact import solve
    costs = COSTS["model"]
    cap = row(build("1f1b", 2, 4, 1, 1), costs).peak
    shape = build("seq1f1b-zbv", 2, 4, 1, 2)
    span_costs = costs.costs(shape)
    auto = build("seq1f1b-zb-auto", 2, 4, 1, 2,
                 budget=ScheduleBudget(span_costs, cap, "vshape", (), "vshape"))
    exact = solve(shape, span_costs, cap, time_limit_s=60, hint=auto, workers=2)
    assert exact.optimal, exact.status
    assert row(auto, costs).makespan <= exact.makespan * (1 + 1e-4)
    assert row(auto, costs).peak <= cap


def test_the_search_beats_torchs_interleaved_zero_bubble_at_p16():
    """P = 16, m = 16, k = 1, skewed costs, capped at torch's ZB-V peak: torch's interleaved zero
    bubble takes 63.0, the search without waiting for due backwards 63.5, with it 62.75 (the
    optimum CP-SAT proves in four minutes)."""
    costs = COSTS["skewed"]
    violations, rows = peer_violations(16, 16, 1, costs, rivals(16, 16, 1, costs))
    assert violations == []
    assert min(r.makespan for r in rows) == pytest.approx(62.75)


def test_under_seq1f1bs_peak_a_v_that_keeps_no_promises_gets_near_cp_sats_order():
    """7B costs, P = 4, m = 4, k = 2, capped at seq1f1b's peak. Keeping room for what admitted
    micro-batches will allocate later, no replay on the V did better than 3.08 and the search
    ended at 2.920 (2.892 on a loop), while CP-SAT found a V order of 2.651 in 300 s (two
    workers; its own bound 2.524, the one-rank bound 2.6353: within 0.6% of the optimum) that
    holds each rank near the cap. Keeping none
    (Policy.promises = "none"), the replays get closer and the V search ended at 2.744, with
    the depth search also from the replays near the best (DEPTH_SEARCH_REACH) at 2.7085, and
    annealing on from there (anneal.py) at 2.675: within issue 26's 2% of the proven bound,
    inside the cap."""
    from seq1f1b.plan.actions import ScheduleError
    from seq1f1b.plan.schedules.greedy import Placer, Policy, Problem
    costs = COSTS["model"]
    cap = row(build("seq1f1b", 4, 4, 2, 1), costs).peak
    problem = Problem(4, 4, 2, 2, "vshape")
    span_costs = costs.costs(build("seq1f1b-zbv", 4, 4, 2, 2))
    placer = Placer(problem, span_costs)

    def best_replay(promises):
        found = []
        for first in (True, False):
            for wait in (True, False):
                try:
                    found.append(placer.place(cap, Policy(first, None, True, True, wait,
                                                          promises)).makespan)
                except ScheduleError:     # a replay that gets stuck is refused
                    continue
        return min(found)

    assert best_replay("none") < min(best_replay("at once"), best_replay("in turn"))
    auto = build("seq1f1b-zb-auto", 4, 4, 2, 2,
                 budget=ScheduleBudget(span_costs, cap, "vshape", (), "vshape"))
    assert row(auto, costs).peak <= cap
    assert row(auto, costs).makespan <= 2.6353 * 1.02


def test_annealing_walks_on_where_the_refinement_stops():
    """The same case: the search's refined order (2.7085) is 2.8% above the one-rank bound
    (2.6353), a local optimum of refine.py's moves; annealing from it (anneal.py) ends within
    issue 26's 2% of that bound (2.675), valid and inside the cap. Told a lower bound it
    reaches, a walk stops there, before its budget is spent."""
    from seq1f1b.plan.actions import Schedule
    from seq1f1b.plan.schedules.greedy import Problem
    from seq1f1b.plan.schedules.zero_bubble_v import annealed, search
    from seq1f1b.plan.simulate import simulate
    costs = COSTS["model"]
    cap = row(build("seq1f1b", 4, 4, 2, 1), costs).peak
    problem = Problem(4, 4, 2, 2, "vshape")
    span_costs = costs.costs(build("seq1f1b-zbv", 4, 4, 2, 2))
    refined = search(problem, span_costs, cap)
    walked = annealed(problem, span_costs, cap, refined)
    assert refined.makespan > 2.6353 * 1.02 >= walked.makespan
    schedule = Schedule("annealed", 4, 4, 2, 2, tuple(map(tuple, walked.programs)), "vshape")
    assert find_problems(schedule) == []
    report = simulate(schedule, span_costs)
    assert report.makespan == walked.makespan
    assert max(rank.peak_held_bytes for rank in report.ranks) <= cap

    import random

    from seq1f1b.plan.schedules import anneal
    from seq1f1b.plan.schedules.greedy import Placer
    from seq1f1b.plan.schedules.refine import Orders
    orders_of = Orders(Placer(problem, span_costs))
    budget = anneal.TIMED_ACTIONS_PER_ACTION * orders_of.size
    stopped = anneal._walk(orders_of, refined, cap, random.Random(anneal.SEED), budget,
                           floor=walked.makespan, swaps=0.0)
    assert stopped.makespan <= walked.makespan * (1 + 1e-12) and orders_of.timed < budget / 2


def test_a_way_of_keeping_promises_a_little_longer_is_searched_on_too():
    """7B costs with even spans, P = 4, m = 4, k = 2, a V capped at seq1f1b's peak: keeping
    promises in turn gives a best replay 1.9% longer than at once's (3.506 against 3.442), and
    only at once's was searched on (3.259). Searched on too (within DEPTH_SEARCH_REACH), keeping
    them in turn leads to 3.136: within 8% of the best order CP-SAT finds in 60 s (2.9087), which
    the old search was 12% above. With annealing (anneal.py) the search ends at 2.9937, 2.9%
    above (3.0716, 5.6% above, after the walk without swaps); the gap left is the search's
    weakest known (docs/schedules.md)."""
    costs = replace(COSTS["model"], partition="even")
    cap = row(build("seq1f1b", 4, 4, 2, 1), costs).peak
    span_costs = costs.costs(build("seq1f1b-zbv", 4, 4, 2, 2))
    auto = build("seq1f1b-zb-auto", 4, 4, 2, 2,
                 budget=ScheduleBudget(span_costs, cap, "vshape", (), "vshape"))
    assert row(auto, costs).peak <= cap
    assert row(auto, costs).makespan <= 2.9087 * 1.035
