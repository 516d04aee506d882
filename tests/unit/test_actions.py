"""The IR's text forms round-trip and the dependency rules say what ARCHITECTURE.md says."""
import pytest

from seq1f1b.plan.actions import Action, Schedule, ScheduleError, dependencies, parse_action


def test_action_text_round_trip():
    for text in ["F3.1", "B0.0", "W12.7", "F3.1@1", "B0.2@3"]:
        assert parse_action(text).format("@" in text) == text
    assert str(Action("F", 3, 1)) == "F3.1"
    assert Action("B", 0, 2, 1).format() == "B0.2@1"
    assert Action("F", 0, 0).format(show_chunk=True) == "F0.0@0"


@pytest.mark.parametrize("bad", ["X1.0", "F1", "F-1.0", "F1.0@", ""])
def test_bad_action_text_is_rejected(bad):
    with pytest.raises(ScheduleError):
        parse_action(bad)


def _toy() -> Schedule:
    return Schedule.from_text("rank 0: F0.0 F0.1 B0.1 B0.0\nrank 1: F0.0 F0.1 B0.1 B0.0", "toy")


def test_schedule_text_and_csv_round_trip():
    sched = _toy()
    assert (sched.pp, sched.microbatches, sched.splits, sched.chunks) == (2, 1, 2, 1)
    assert Schedule.from_text(sched.to_text(), "toy") == sched
    assert Schedule.from_csv(sched.to_csv(), "toy") == sched


def test_dependencies_follow_the_span_rules():
    sched = _toy()
    assert dependencies(sched, 1, Action("F", 0, 1)) == [(0, Action("F", 0, 1)),
                                                         (1, Action("F", 0, 0))]
    assert dependencies(sched, 0, Action("B", 0, 0)) == [(1, Action("B", 0, 0)),
                                                         (0, Action("F", 0, 0)),
                                                         (0, Action("B", 0, 1))]
    assert dependencies(sched, 1, Action("B", 0, 1)) == [(1, Action("F", 0, 1))]


def test_vshape_placement_maps_chunk_one_backwards():
    sched = Schedule("v", 2, 1, 1, 2, ((), ()), placement="vshape")
    assert [sched.stage_of(r, c) for r in range(2) for c in range(2)] == [0, 3, 1, 2]
    assert all(sched.owner_of(sched.stage_of(r, c)) == (r, c) for r in range(2) for c in range(2))
