"""torch.distributed.pipelining's CSV format (plan/torch_format.py), the peers' orders from torch
(seq1f1b/torch_peers.py) and the IR's mixed full/split backward they need (DualPipeV)."""
import pytest

from seq1f1b.plan.actions import Action, Schedule, ScheduleError
from seq1f1b.plan.communication import communication_plan
from seq1f1b.plan.nccl import MODES, validate_modes
from seq1f1b.plan.registry import build
from seq1f1b.plan.simulate import simulate, uniform_costs
from seq1f1b.plan.torch_format import read_torch_csv, write_torch_csv
from seq1f1b.plan.validate import find_problems
from seq1f1b.torch_peers import PEERS, peer_schedule, torch_csv


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
def test_zbv_is_torchs_zbv_action_for_action(pp):
    """The published ZB-V construction: torch's generator and ours agree on every m, including
    fewer micro-batches than the warm-up asks for (2P-1)."""
    for m in range(1, 3 * pp + 2):
        assert build("zbv", pp, m, 1, 2).programs == peer_schedule("torch-zbv", pp, m).programs


@pytest.mark.parametrize("name", sorted(PEERS))
@pytest.mark.parametrize("pp, m", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_peers_read_valid_round_trip_and_pass_the_nccl_checker(name, pp, m):
    schedule = peer_schedule(name, pp, m)
    assert find_problems(schedule) == []
    assert read_torch_csv(write_torch_csv(schedule), name=name).programs == schedule.programs
    if name != "torch-dualpipev":      # DualPipeV's overlapped pairs come back as two cells
        assert write_torch_csv(schedule) == torch_csv(name, pp, m)
    verdicts = validate_modes(communication_plan(schedule), MODES)
    assert all(v.ok for v in verdicts.values()), {k: v.problems for k, v in verdicts.items()}


def test_dualpipev_mixes_full_and_split_backwards_and_the_simulator_prices_each():
    """A unit without W has a full backward: it lasts B + W and frees the span's activations
    itself; a unit with W lasts B, and W frees them."""
    schedule = peer_schedule("torch-dualpipev", 4, 8)
    full = [(r, a) for r, a in schedule.iter_actions() if schedule.full_backward(r, a)]
    split = [(r, a) for r, a in schedule.iter_actions()
             if a.op == "B" and not schedule.full_backward(r, a)]
    assert full and split and schedule.split_backward
    report = simulate(schedule, uniform_costs(schedule, 1.0, 1.5, 0.5))
    durations = {(rank.rank, t.action): t.end - t.start for rank in report.ranks
                 for t in rank.timeline}
    assert {durations[step] for step in full} == {2.0}
    assert {durations[step] for step in split} == {1.5}
    # Held units: F +1, freed by W or by the full B, so every rank ends at zero and the live
    # counter matches a direct count.
    for rank, program in enumerate(schedule.programs):
        live = peak = 0
        for action in program:
            live += action.op == "F"
            peak = max(peak, live)
            live -= schedule.frees_activations(rank, action)
        assert live == 0 and peak == report.ranks[rank].peak_live_spans


def test_a_missing_w_makes_that_backward_full_and_a_second_w_is_refused():
    mixed = Schedule.from_text("rank 0: F0.0 F1.0 B0.0 B1.0 W1.0")
    assert find_problems(mixed) == []
    assert mixed.full_backward(0, Action("B", 0, 0)) and not mixed.full_backward(
        0, Action("B", 1, 0))
    twice = Schedule.from_text("rank 0: F0.0 B0.0 W0.0 W0.0")
    assert find_problems(twice) == ["rank 0 runs more than once: W0.0"]


def test_reads_files_overlaps_and_skips_communication(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,1F0,RECV_B0,(0F1;1B0)OVERLAP_F_B,0B0,1F1,,1I1,1W1,0I1,0W1\n")
    schedule = read_torch_csv(str(path))
    assert find_problems(schedule) == [] and read_torch_csv(path).programs == schedule.programs
    assert [a.format(True) for a in schedule.programs[0]] == [
        "F0.0@0", "F0.0@1", "F1.0@0", "B0.0@1", "B0.0@0", "F1.0@1", "B1.0@1", "W1.0@1",
        "B1.0@0", "W1.0@0"]
    assert schedule.full_backward(0, Action("B", 0, 0, 1))
    assert not schedule.full_backward(0, Action("B", 1, 0, 1))


@pytest.mark.parametrize("text, message", [
    ("0F0,0X0\n", r"row 1 cell 2: cannot read '0X0'"),
    ("0F0,0I0\n", r"never runs its 0W0"),
    ("0F0,0I0,0W0,0B0\n", r"full backward 0B0 and also an I or W"),
    ("0F0\n0F0\n", r"neither a loop"),
    ("\n", r"no rows"),
])
def test_refuses_what_it_cannot_read_in_one_line(text, message):
    with pytest.raises(ScheduleError, match=message):
        read_torch_csv(text)


def test_write_refuses_spans():
    with pytest.raises(ScheduleError, match="one unit per micro-batch"):
        write_torch_csv(build("seq1f1b-zbv", 2, 4, 2, 2))
