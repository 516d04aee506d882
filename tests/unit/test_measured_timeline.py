"""Measured iterations in the simulator's terms: waits inside actions count as idle, per-action
costs calibrated from measurements reproduce the timeline and sum into span timings, the
comparison plot, and a measured iteration's picture with its actions as JSON beside it."""
import json

import pytest

from seq1f1b.plan import registry
from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.simulate import (SpanCosts, calibrated_costs, measured_report, simulate,
                                   span_timings, uniform_costs)
from seq1f1b.plan.span_fit import read_span_timings


def _as_measured(report):
    """A report's timeline as the runtime records it: the clock of an action starts when the
    previous one on its rank ends (at 0 for the first), before the blocking receive."""
    measured = []
    for rank in report.ranks:
        ends = [0.0] + [t.end for t in rank.timeline]
        measured.append([(t.action.format(report.chunks > 1), ends[n], t.end)
                         for n, t in enumerate(rank.timeline)])
    return measured


def _flat(table):
    return [value for row in table for value in row]


def _uneven_costs(schedule) -> SpanCosts:
    """Different F and B per stage and span, so a wrong calibration shows."""
    def table(scale):
        return tuple(tuple(scale * (1 + 0.1 * stage + 0.3 * span)
                           for span in range(schedule.splits))
                     for stage in range(schedule.num_stages))
    return SpanCosts(table(1.0), table(2.0), None)


@pytest.mark.parametrize("name, pp, m, k, chunks", [("1f1b", 2, 2, 1, 1), ("seq1f1b", 2, 2, 4, 1),
                                                    ("seq1f1b", 4, 4, 4, 1),
                                                    ("seq1f1b-interleaved", 2, 4, 2, 2)])
def test_simulated_timeline_measured_back_is_the_same(name, pp, m, k, chunks):
    schedule = registry.build(name, pp, m, k, chunks)
    simulated = simulate(schedule, _uneven_costs(schedule))
    measured = measured_report(schedule, _as_measured(simulated))
    assert measured.makespan == pytest.approx(simulated.makespan)
    assert measured.bubble_ratio == pytest.approx(simulated.bubble_ratio)
    for got, want in zip(measured.ranks, simulated.ranks):
        assert _flat((t.start, t.end) for t in got.timeline) == \
            pytest.approx(_flat((t.start, t.end) for t in want.timeline))


def test_waiting_for_a_neighbour_inside_an_action_is_idle():
    schedule = registry.build("1f1b", 2, 1)
    # Rank 1's F0.0 was entered at 0 but its input arrived when rank 0's F0.0 ended (1.0).
    ranks = [[("F0.0", 0.0, 1.0), ("B0.0", 1.0, 5.0)],
             [("F0.0", 0.0, 2.0), ("B0.0", 2.0, 4.0)]]
    report = measured_report(schedule, ranks)
    assert [(t.start, t.end) for t in report.ranks[1].timeline] == [(1.0, 2.0), (2.0, 4.0)]
    assert [(t.start, t.end) for t in report.ranks[0].timeline] == [(0.0, 1.0), (4.0, 5.0)]
    assert report.ranks[1].idle == pytest.approx(2.0)       # 0-1 and 4-5
    assert report.bubble_ratio == pytest.approx((3.0 + 2.0) / 10.0)


def test_calibration_recovers_per_stage_per_span_costs_and_the_makespan():
    schedule = registry.build("seq1f1b", 3, 4, 3)
    costs = _uneven_costs(schedule)
    simulated = simulate(schedule, costs)
    measured = measured_report(schedule, _as_measured(simulated))
    calibrated = calibrated_costs(schedule, [measured, measured])
    assert _flat(calibrated.forward) == pytest.approx(_flat(costs.forward))
    assert _flat(calibrated.backward) == pytest.approx(_flat(costs.backward))
    assert simulate(schedule, calibrated).makespan == pytest.approx(simulated.makespan)


def test_calibration_takes_the_median_over_microbatches():
    schedule = registry.build("1f1b", 1, 3)
    ranks = [[("F0.0", 0, 1), ("B0.0", 1, 3), ("F1.0", 3, 4.5), ("B1.0", 4.5, 6.5),
              ("F2.0", 6.5, 16.5), ("B2.0", 16.5, 19.5)]]
    costs = calibrated_costs(schedule, [measured_report(schedule, ranks)])
    assert costs.forward == ((1.5,),) and costs.backward == ((2.0,),)


def test_measured_actions_must_follow_the_program():
    schedule = registry.build("1f1b", 2, 2)
    good = _as_measured(simulate(schedule, uniform_costs(schedule)))
    swapped = [good[0][::-1], good[1]]
    with pytest.raises(ScheduleError, match="rank 0.*program"):
        measured_report(schedule, swapped)
    with pytest.raises(ScheduleError, match="2 ranks"):
        measured_report(registry.build("1f1b", 3, 2), good)
    with pytest.raises(ScheduleError, match="at least one"):
        calibrated_costs(schedule, [])


def test_measured_vs_simulated_plot(tmp_path):
    from seq1f1b.plan.render import plot_measured_vs_simulated

    schedule = registry.build("seq1f1b-interleaved", 2, 2, 2, 2)
    simulated = simulate(schedule, _uneven_costs(schedule))
    measured = measured_report(schedule, _as_measured(simulated))
    path = plot_measured_vs_simulated([(measured, simulated), (measured, simulated)],
                                      tmp_path / "cmp.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_measured_vs_simulated([], tmp_path / "none.png")


def test_span_timings_sum_each_spans_costs_over_the_stages():
    schedule = registry.build("seq1f1b-interleaved", 2, 2, 2, 2)
    costs = _uneven_costs(schedule)
    measured = measured_report(schedule, _as_measured(simulate(schedule, costs)))
    timings = span_timings(schedule, [measured], [(0, 40), (40, 64)])
    stages = range(schedule.num_stages)
    assert [(t.start, t.end) for t in timings] == [(0, 40), (40, 64)]
    assert [t.forward_s for t in timings] == pytest.approx(
        [sum(costs.forward[v][j] for v in stages) for j in range(2)])
    assert [t.backward_s for t in timings] == pytest.approx(
        [sum(costs.backward[v][j] for v in stages) for j in range(2)])


def test_a_measured_iteration_is_drawn_with_its_actions_beside_it(tmp_path):
    from seq1f1b.plan.render import write_measured_timeline

    schedule = registry.build("seq1f1b", 2, 2, 2)
    simulated = simulate(schedule, _uneven_costs(schedule))
    bounds = [(0, 40), (40, 64)]
    png, actions = write_measured_timeline(schedule, _as_measured(simulated), bounds, 7,
                                           tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and actions == tmp_path / "timeline.json"
    record = json.loads(actions.read_text())
    assert (record["iteration"], record["span_bounds"]) == (7, [[0, 40], [40, 64]])
    assert record["makespan"] == pytest.approx(simulated.makespan)
    assert record["bubble_ratio"] == pytest.approx(simulated.bubble_ratio)
    for got, want in zip(record["ranks"], simulated.ranks):
        assert [a["action"] for a in got["actions"]] == [t.action.format() for t in want.timeline]
        assert _flat((a["start"], a["end"]) for a in got["actions"]) == \
            pytest.approx(_flat((t.start, t.end) for t in want.timeline))
    # the JSON is a calibration file for plan.py partition --method fit
    assert read_span_timings(actions) == span_timings(
        schedule, [measured_report(schedule, _as_measured(simulated))], bounds)
