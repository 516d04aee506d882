"""The validator catches each way a schedule can be wrong, with a message that says where."""
import pytest

from seq1f1b.plan.actions import Action, Schedule, ScheduleError, dependencies
from seq1f1b.plan.registry import build
from seq1f1b.plan.validate import _StepGraph, find_problems, topological_order, validate

GOOD = """rank 0: F0.0 F0.1 F1.0 B0.1 F1.1 B0.0 B1.1 B1.0
rank 1: F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 B1.0"""


def _sched(text: str, **kw) -> Schedule:
    return Schedule.from_text(text, "hand-made", **kw)


def _problem(text: str, **kw) -> str:
    problems = find_problems(_sched(text, **kw))
    assert len(problems) == 1, problems
    return problems[0]


def test_a_correct_schedule_passes():
    assert find_problems(_sched(GOOD)) == []
    assert validate(_sched(GOOD)) is None


def test_missing_action():
    text = GOOD.replace(" B1.0\nrank 1", "\nrank 1")
    assert _problem(text) == "rank 0 never runs: B1.0"


def test_duplicate_action():
    text = GOOD.replace("rank 1: F0.0 F0.1", "rank 1: F0.0 F0.1 F0.1")
    assert _problem(text) == "rank 1 runs more than once: F0.1"


def test_foreign_actions_outside_the_problem():
    rows = [[Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("B", 0, 0)]]
    sched = Schedule("m-too-small", pp=1, microbatches=1, splits=1, chunks=1, programs=rows)
    assert find_problems(sched) == ["rank 0 runs actions outside m=1, k=1, V=1: F1.0 B1.0"]
    rows = [[Action("F", 0, 0, 0), Action("F", 0, 0, 1), Action("B", 0, 0, 1), Action("B", 0, 0)]]
    sched = Schedule("chunk-out-of-range", pp=1, microbatches=1, splits=1, chunks=1,
                     programs=rows)
    assert find_problems(sched) == ["rank 0 runs actions outside m=1, k=1, V=1: F0.0@1 B0.0@1"]


def test_kv_rule_forward_spans_in_order():
    text = GOOD.replace("rank 0: F0.0 F0.1", "rank 0: F0.1 F0.0")
    assert _problem(text) == ("rank 0 runs F0.1 (step 0) before F0.0 (step 1), which it needs "
                              "(K/V of the previous span)")


def test_kv_rule_backward_spans_in_reverse():
    text = GOOD.replace("rank 1: F0.0 F0.1 B0.1 F1.0 B0.0", "rank 1: F0.0 F0.1 B0.0 F1.0 B0.1")
    assert _problem(text) == ("rank 1 runs B0.0 (step 2) before B0.1 (step 4), which it needs "
                              "(dK/dV from the later span's backward)")


def test_backward_before_its_own_forward():
    text = GOOD.replace("rank 1: F0.0 F0.1 B0.1", "rank 1: F0.0 B0.1 F0.1")
    assert _problem(text) == ("rank 1 runs B0.1 (step 1) before F0.1 (step 2), which it needs "
                              "(its own forward)")


def test_weight_grad_before_its_backward():
    text = "rank 0: F0.0 W0.0 B0.0"
    assert _problem(text) == ("rank 0 runs W0.0 (step 1) before B0.0 (step 2), which it needs "
                              "(a weight grad follows its input-grad backward)")


def test_cross_rank_deadlock_names_each_stuck_rank():
    # Rank 0 waits for micro-batch 0's gradient before forwarding micro-batch 1, rank 1 insists
    # on micro-batch 1 first: each waits for the other.
    text = "rank 0: F0.0 B0.0 F1.0 B1.0\nrank 1: F1.0 B1.0 F0.0 B0.0"
    assert _problem(text) == ("deadlock: rank 0 at B0.0 (step 1) waits for B0.0 on rank 1; "
                              "rank 1 at F1.0 (step 0) waits for F1.0 on rank 0")


def test_deadlock_on_a_dependency_nobody_runs():
    sched = _sched("rank 0: F0.0 B0.0\nrank 1: B0.0")
    with pytest.raises(ScheduleError, match=r"rank 1 at B0.0 \(step 0\) waits for F0.0 on "
                                            r"rank 1 \(never run there\)"):
        topological_order(sched)


def test_validate_raises_with_the_schedule_and_every_problem():
    text = GOOD.replace("rank 0: F0.0 F0.1", "rank 0: F0.1 F0.1")
    with pytest.raises(ScheduleError) as error:
        validate(_sched(text))
    message = str(error.value)
    assert message.startswith("schedule 'hand-made' (pp=2, m=2, k=2, V=1) is invalid: ")
    assert "rank 0 runs more than once: F0.1" in message
    assert "rank 0 never runs: F0.0" in message


def test_topological_order_respects_program_order_and_dependencies():
    sched = build("seq1f1b-interleaved", 3, 4, 2, 2)
    order = topological_order(sched)
    assert sorted(order) == sorted(sched.iter_actions())
    position = {step: n for n, step in enumerate(order)}
    for rank, program in enumerate(sched.programs):
        assert [position[(rank, a)] for a in program] == sorted(position[(rank, a)]
                                                               for a in program)
        for action in program:
            for dep in dependencies(sched, rank, action):
                assert position[dep] < position[(rank, action)]


@pytest.mark.parametrize("name, pp, m, k, v", [
    ("gpipe", 3, 4, 3, 1), ("1f1b", 4, 5, 2, 1), ("seq1f1b", 2, 3, 4, 1),
    ("interleaved-1f1b", 2, 4, 3, 3), ("seq1f1b-interleaved", 3, 2, 4, 2)])
def test_step_graph_matches_dependencies_of_every_action(name, pp, m, k, v):
    # The graph asks dependencies() once per (rank, op, span, chunk) and shifts the answer to
    # every micro-batch; that must equal asking for every action.
    check_graph(build(name, pp, m, k, v))


def test_step_graph_matches_for_vshape_and_split_backward():
    rank0 = "F0.0@0 F0.1@0 F0.0@1 F0.1@1 B0.1@1 W0.1@1 B0.0@1 W0.0@1 B0.1@0 B0.0@0 W0.1@0 W0.0@0"
    rank1 = "F0.0@0 F0.1@0 F0.0@1 F0.1@1 B0.1@1 B0.0@1 B0.1@0 B0.0@0 W0.1@1 W0.0@1 W0.1@0 W0.0@0"
    sched = _sched(f"rank 0: {rank0}\nrank 1: {rank1}", placement="vshape")
    check_graph(sched)
    assert find_problems(sched) == []


def check_graph(sched: Schedule) -> None:
    graph = _StepGraph.of(sched)
    steps = list(sched.iter_actions())
    first = {}
    for n, step in enumerate(steps):
        first.setdefault(step, n)
    for n, (rank, action) in enumerate(steps):
        direct = [first.get(dep, graph.never) for dep in dependencies(sched, rank, action)]
        assert [need for need in graph.needs[n] if need != graph.never + 1] == direct, action
