"""Zero-bubble schedules: valid everywhere, 1F1B's F/B order with W placed by the rules, the
paper's ZB-H1 at k = 1, a third of seq1f1b's bubble with the same peak of live spans."""
import importlib.util
import json
from pathlib import Path

import pytest

from seq1f1b.plan.actions import Action, Schedule
from seq1f1b.plan.registry import build, names
from seq1f1b.plan.simulate import simulate, uniform_costs
from seq1f1b.plan.validate import find_problems

_spec = importlib.util.spec_from_file_location(
    "plan_cli", Path(__file__).resolve().parents[2] / "tools" / "plan.py")
plan_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_cli)

PAIRS = [("zb-h1", "1f1b"), ("seq1f1b-zb-h1", "seq1f1b")]
"""Each zero-bubble schedule and the schedule whose F/B order and memory it keeps."""


def test_registered():
    assert {"zb-h1", "seq1f1b-zb-h1"} <= set(names())
    assert build("seq1f1b-zb-h1", 2, 2, 2).split_backward


def test_valid_on_the_whole_grid():
    """P 1..8, m 1..12, k 1..8: complete (F, B and W of every span), dependency order, no
    deadlock."""
    failures = []
    for pp in range(1, 9):
        for k in range(1, 9):
            for m in range(1, 13):
                for name, _ in PAIRS:
                    problems = find_problems(build(name, pp, m, k))
                    if problems:
                        failures.append((name, pp, m, k, problems[0]))
    assert failures == []


@pytest.mark.parametrize("pp, m, k", [(1, 3, 2), (2, 5, 3), (4, 8, 4), (5, 3, 2), (8, 12, 3)])
def test_forwards_and_backwards_keep_the_base_order(pp, m, k):
    """Without its W actions each rank's program is the base schedule's: same warm-up, B in
    reverse span order within a micro-batch; each W comes after its B, in the same order."""
    for name, base in PAIRS:
        zero, plain = build(name, pp, m, k), build(base, pp, m, k)
        for rank in range(pp):
            program = zero.programs[rank]
            assert [a for a in program if a.op != "W"] == list(plain.programs[rank])
            backwards = [a.key() for a in program if a.op == "B"]
            assert [a.key() for a in program if a.op == "W"] == backwards


@pytest.mark.parametrize("pp, m", [(pp, m) for pp in range(1, 9) for m in range(1, 13)])
def test_one_split_is_zb_h1(pp, m):
    assert build("seq1f1b-zb-h1", pp, m, 1).programs == build("zb-h1", pp, m, 1).programs


def handcrafted_zb_h1(pp: int, m: int) -> list[list[str]]:
    """The paper's ZB-H1 as DeepSpeed implements it, stated independently of the builder: 1F1B's
    warm-up (P - r - 1 forwards), then forward / B pairs whose W trails by r steps on rank r,
    a cool-down of B, W pairs, and the W still owed at the end."""
    programs = []
    for rank in range(pp):
        warmup = min(m, pp - rank - 1)
        program = [f"F{i}.0" for i in range(warmup)]
        owed = []
        for step in range(m - warmup):
            program += [f"F{warmup + step}.0", f"B{step}.0"]
            owed.append(f"W{step}.0")
            if step >= rank:
                program.append(owed.pop(0))
        for i in range(m - warmup, m):
            program.append(f"B{i}.0")
            owed.append(f"W{i}.0")
            program.append(owed.pop(0))
        programs.append(program + owed)
    return programs


@pytest.mark.parametrize("pp, m", [(pp, m) for pp in range(1, 9) for m in range(pp, 13)])
def test_zb_h1_is_the_papers_handcrafted_schedule(pp, m):
    assert build("zb-h1", pp, m).programs == Schedule.from_programs(
        "zb-h1", handcrafted_zb_h1(pp, m)).programs


BUBBLE_GRID = [(pp, m, k) for pp in (2, 3, 5, 8) for m in (1, 2, 3, 8) for k in (1, 2, 3, 8)]


@pytest.mark.parametrize("pp, m, k", BUBBLE_GRID)
def test_seq1f1b_zb_h1_bubble_is_a_third_of_seq1f1bs_at_the_same_peak(pp, m, k):
    """F = B = W = 1 per span (seq1f1b's full backward costs B + W = 2).

    Rank 0 cannot idle less than P - 1 = (P-1)(F+B-W): its first B needs F(0,k-1) to reach the
    last rank and the gradient to come back (k + 2P - 2), the memory bound lets it run at most
    P + k - 1 forwards before, and it has no W to run yet. Every rank idles exactly that once
    earlier micro-batches leave enough W to fill the last micro-batch's cool-down,
    (m-1)k >= P-1; never more than twice it. seq1f1b idles (P-1)(F+B+W) per rank. The peak of
    live spans (F to W) over the ranks is seq1f1b's: the memory each device must have."""
    zero, plain = build("seq1f1b-zb-h1", pp, m, k), build("seq1f1b", pp, m, k)
    report = simulate(zero, uniform_costs(zero, 1, 1, 1))
    baseline = simulate(plain, uniform_costs(plain, 1, 2))
    idle = [rank.idle for rank in report.ranks]
    if (m - 1) * k >= pp - 1:
        assert idle == [pp - 1] * pp
    else:
        assert min(idle) >= pp - 1 and max(idle) <= 2 * (pp - 1)
    assert [rank.idle for rank in baseline.ranks] == [3 * (pp - 1)] * pp
    peak = max(rank.peak_live_spans for rank in baseline.ranks)
    assert max(rank.peak_live_spans for rank in report.ranks) == peak == min(pp + k - 1, m * k)


@pytest.mark.parametrize("pp, m, k", BUBBLE_GRID)
def test_zb_h1_bubble_and_peak_in_micro_batch_units(pp, m, k):
    """The same with micro-batch units (k spans each): idle <= (P-1)(F+B-W) micro-batch units
    once m >= P, and 1F1B's peak of P micro-batches."""
    zero, plain = build("zb-h1", pp, m, k), build("1f1b", pp, m, k)
    report = simulate(zero, uniform_costs(zero, 1, 1, 1))
    if m >= pp:
        assert max(rank.idle for rank in report.ranks) <= (pp - 1) * k
    peak = max(rank.peak_live_spans for rank in simulate(plain, uniform_costs(plain, 1, 2)).ranks)
    assert max(rank.peak_live_spans for rank in report.ranks) == peak == min(pp, m) * k


def test_plan_cli_shows_w(capsys, tmp_path):
    argv = ["--schedule", "seq1f1b-zb-h1", "--pp", "3", "--microbatches", "4", "--splits", "2"]
    assert plan_cli.main(["show", *argv]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) == 3 and all(" W0.1 " in line for line in shown)
    png = tmp_path / "zb.png"
    assert plan_cli.main(["simulate", *argv, "--uniform-cost", "1", "1", "1", "--json",
                          "--timeline", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    ops = {entry["action"][0] for rank in report["ranks"] for entry in rank["actions"]}
    assert ops == {"F", "B", "W"} and png.stat().st_size > 0


def test_w_is_placed_by_the_rules_not_per_rank():
    """The last rank defers its first W until the memory bound forces it: P = 4, k = 1, 1F1B's
    peak is 4 micro-batches, so W0 runs right before the fifth forward."""
    last = build("zb-h1", 4, 8).programs[3]
    assert last.index(Action("W", 0, 0)) == last.index(Action("F", 4, 0)) - 1
