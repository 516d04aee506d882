"""Schedule families: valid everywhere, the paper's and Megatron's orders exactly, warm-ups
derived from the dependency rules."""
from types import SimpleNamespace

import pytest

from seq1f1b.plan.actions import Action, Schedule, ScheduleError, dependencies
from seq1f1b.plan.registry import build, names
from seq1f1b.plan.schedules.gpipe import backward_order, forward_order
from seq1f1b.plan.schedules.interleaved import interleaved_unit_orders
from seq1f1b.plan.schedules.one_f_one_b import group_units, one_f_one_b_program, own_forward_lead
from seq1f1b.plan.validate import find_problems, topological_order, validate

OURS = ["gpipe", "1f1b", "seq1f1b", "interleaved-1f1b", "seq1f1b-interleaved"]
CHUNKED = {"interleaved-1f1b", "seq1f1b-interleaved"}


def allowed(name: str, pp: int, m: int, k: int, v: int) -> bool:
    """The documented constraints, stated here independently of the builders."""
    if (name in CHUNKED) != (v > 1):
        return False
    if name == "interleaved-1f1b":  # megatron-core: chunks switch every pp micro-batches
        return m % pp == 0
    if name == "seq1f1b-interleaved":  # groups of ceil(pp/k) whole micro-batches (>= pp spans)
        group = -(-pp // k)
        return m >= group and (m % group == 0 or (m % group) * k >= pp)
    return True


def texts(sched: Schedule) -> list[list[str]]:
    return [sched.format_rank(rank) for rank in range(sched.pp)]


def test_registration_order():
    assert [name for name in names() if name in OURS] == OURS


def test_every_schedule_is_valid_on_the_whole_grid():
    """P 1..8, m 1..12, k 1..8, V 1..4: valid, or refused with a ScheduleError naming a flag."""
    # Families innermost, m inside (k, V): the validator's per-problem answers stay warm.
    failures, checked, refused = [], 0, 0
    for pp in range(1, 9):
        for k in range(1, 9):
            for v in range(1, 5):
                for m in range(1, 13):
                    for name in OURS:
                        if not allowed(name, pp, m, k, v):
                            with pytest.raises(ScheduleError, match=r"^--(chunks|microbatches): "):
                                build(name, pp, m, k, v)
                            refused += 1
                            continue
                        problems = find_problems(build(name, pp, m, k, v))
                        if problems:
                            failures.append((name, pp, m, k, v, problems[0]))
                        checked += 1
    assert failures == []
    assert checked + refused == 5 * 8 * 12 * 8 * 4
    assert checked > 4000


def test_actions_carry_spans_and_chunks_in_range():
    for name, v in [("gpipe", 1), ("1f1b", 1), ("seq1f1b", 1), ("interleaved-1f1b", 3),
                    ("seq1f1b-interleaved", 3)]:
        sched = build(name, 3, 6, 4, v)
        assert {(a.span, a.chunk) for _, a in sched.iter_actions()} == {
            (j, c) for j in range(4) for c in range(v)}


def test_seq1f1b_reproduces_the_paper_example():
    sched = build("seq1f1b", 4, 8, 2)
    paper = {
        0: "F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 F2.1 B0.0 F3.0 B1.1 F3.1 B1.0",
        1: "F0.0 F0.1 F1.0 F1.1 B0.1 F2.0 B0.0 F2.1 B1.1",
        2: "F0.0 F0.1 F1.0 B0.1 F1.1 B0.0 F2.0 B1.1",
        3: "F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 F2.0 B1.0",
    }
    for rank, prefix in paper.items():
        assert sched.format_rank(rank)[:len(prefix.split())] == prefix.split()


def test_seq1f1b_with_one_split_is_1f1b():
    for pp in range(1, 9):
        for m in range(1, 13):
            assert build("seq1f1b", pp, m, 1).programs == build("1f1b", pp, m, 1).programs


def test_seq1f1b_interleaved_with_one_split_is_interleaved_1f1b():
    for pp in range(1, 9):
        for m in range(1, 13):
            for v in range(2, 5):
                if not allowed("interleaved-1f1b", pp, m, 1, v):
                    for name in ("interleaved-1f1b", "seq1f1b-interleaved"):
                        with pytest.raises(ScheduleError, match="^--microbatches: "):
                            build(name, pp, m, 1, v)
                    continue
                assert (build("seq1f1b-interleaved", pp, m, 1, v).programs
                        == build("interleaved-1f1b", pp, m, 1, v).programs)


def _span_by_span(program: tuple[Action, ...], splits: int) -> list[Action]:
    """A k=1 program with each micro-batch run as k spans: forwards ascending, backwards not."""
    spans = {"F": range(splits), "B": range(splits - 1, -1, -1)}
    return [Action(a.op, a.microbatch, j, a.chunk) for a in program for j in spans[a.op]]


@pytest.mark.parametrize("name, chunks", [("1f1b", [1]), ("interleaved-1f1b", [2, 3])])
def test_micro_batch_granular_schedules_run_each_micro_batch_span_by_span(name, chunks):
    for pp in range(1, 7):
        for m in range(pp, 9, pp):
            for k in range(2, 5):
                for v in chunks:
                    whole = build(name, pp, m, 1, v)
                    spans = build(name, pp, m, k, v)
                    assert [list(p) for p in spans.programs] == [
                        _span_by_span(p, k) for p in whole.programs]


def test_gpipe_runs_all_forwards_then_backwards_fifo():
    sched = build("gpipe", 3, 2, 2)
    assert texts(sched) == [["F0.0", "F0.1", "F1.0", "F1.1", "B0.1", "B0.0", "B1.1", "B1.0"]] * 3


def _peak_live(program: tuple[Action, ...]) -> int:
    live = peak = 0
    for action in program:
        live += 1 if action.op == "F" else -1
        peak = max(peak, live)
    return peak


def test_seq1f1b_peak_live_spans_and_warmup():
    for pp in range(1, 9):
        for m in range(1, 13):
            for k in range(1, 9):
                sched = build("seq1f1b", pp, m, k)
                for rank, program in enumerate(sched.programs):
                    formula = min(pp - rank + k - 1, m * k)
                    assert _peak_live(program) == formula, (pp, m, k, rank)
                    forwards_first = next((n for n, a in enumerate(program) if a.op == "B"))
                    assert forwards_first == formula


def _unit_time_makespan(sched: Schedule) -> int:
    """Every action takes one time unit; each starts when its rank and its dependencies are free."""
    finish, free = {}, [0] * sched.pp
    for rank, action in topological_order(sched):
        start = max([free[rank]] + [finish[dep] for dep in dependencies(sched, rank, action)])
        finish[(rank, action)] = free[rank] = start + 1
    return max(free)


def _programs(pp, m, k, v, forward, backward, warmups):
    programs = tuple(tuple(one_f_one_b_program(forward, backward, w)) for w in warmups)
    return Schedule("trial", pp, m, k, v, programs)


def test_seq1f1b_warmup_is_the_least_that_keeps_the_bubble_at_p_minus_1_spans():
    """P-r-1+k-1 is derived, not typed: with unit-cost spans the makespan is 2(mk + P - 1), and one
    forward less on any rank either breaks a dependency rule or lengthens the makespan."""
    for pp in range(1, 6):
        for m in range(1, 6):
            for k in range(1, 5):
                forward = group_units(forward_order(m, k), 1)
                backward = group_units(backward_order(m, k), 1)
                assert own_forward_lead(forward, backward) == k - 1
                warmups = [min(pp - r - 1 + k - 1, m * k) for r in range(pp)]
                sched = build("seq1f1b", pp, m, k)
                assert sched.programs == _programs(pp, m, k, 1, forward, backward, warmups).programs
                best = 2 * (m * k + pp - 1)
                assert _unit_time_makespan(sched) == best
                for rank in range(pp):
                    if 0 < warmups[rank] < m * k:
                        fewer = list(warmups)
                        fewer[rank] -= 1
                        trial = _programs(pp, m, k, 1, forward, backward, fewer)
                        assert find_problems(trial) or _unit_time_makespan(trial) > best


def _group_spans(pp: int, k: int) -> int:
    return k * -(-pp // k)


def test_seq1f1b_interleaved_warmup_formula():
    """Forwards before the first backward on rank r: 2(P-r-1) + (V-1)G + (k-1) + 1 spans (capped),
    G = k*ceil(P/k) spans per chunk-switching group."""
    for pp in range(1, 9):
        for k in range(1, 9):
            for v in range(2, 5):
                for m in range(1, 13):
                    if not allowed("seq1f1b-interleaved", pp, m, k, v):
                        continue
                    sched = build("seq1f1b-interleaved", pp, m, k, v)
                    total = m * k * v
                    for rank, program in enumerate(sched.programs):
                        warmup = 2 * (pp - rank - 1) + (v - 1) * _group_spans(pp, k) + k - 1
                        forwards_first = next(n for n, a in enumerate(program) if a.op == "B")
                        assert forwards_first == min(warmup + 1, total), (pp, m, k, v, rank)


def test_seq1f1b_interleaved_has_no_extra_bubble_and_its_lead_is_tight():
    """Unit-cost spans: makespan 2(mkV + P - 1), the interleaved bubble. The last rank's warm-up,
    (V-1)G + k-1, is the least that runs each backward after its own forward."""
    for pp in range(1, 6):
        for k in range(1, 5):
            for v in (2, 3):
                for m in range(1, 7):
                    if not allowed("seq1f1b-interleaved", pp, m, k, v):
                        continue
                    sched = build("seq1f1b-interleaved", pp, m, k, v)
                    total = m * k * v
                    assert _unit_time_makespan(sched) == 2 * (total + pp - 1)
                    forward, backward = interleaved_unit_orders(m, k, v, 1, _group_spans(pp, k))
                    lead = own_forward_lead(forward, backward)
                    assert lead == (v - 1) * _group_spans(pp, k) + k - 1
                    if lead < total:
                        warmups = [min(2 * (pp - r - 1) + lead, total) for r in range(pp)]
                        rebuilt = _programs(pp, m, k, v, forward, backward, warmups)
                        assert rebuilt.programs == sched.programs
                        warmups[-1] = lead - 1
                        trial = _programs(pp, m, k, v, forward, backward, warmups)
                        problems = find_problems(trial)
                        assert problems and "(its own forward)" in problems[0]


def test_interleaved_constraints_name_the_flag():
    with pytest.raises(ScheduleError, match=r"^--microbatches: interleaved-1f1b switches model "
                                            r"chunks every 4 micro-batches; m=6 leaves a last "
                                            r"group of 2 micro-batches, fewer than pp=4"):
        build("interleaved-1f1b", 4, 6, 1, 2)
    with pytest.raises(ScheduleError, match=r"^--microbatches: .*m=1 is less than one group"):
        build("seq1f1b-interleaved", 4, 1, 3, 2)
    with pytest.raises(ScheduleError, match=r"last group of 3 spans, fewer than pp=4"):
        build("seq1f1b-interleaved", 4, 3, 3, 2)
    with pytest.raises(ScheduleError, match=r"^--chunks: "):
        build("seq1f1b-interleaved", 4, 4, 2, 1)
    validate(build("seq1f1b-interleaved", 4, 1, 4, 2))  # one micro-batch of 4 spans suffices


def _fake_communicator(pp: int, rank: int, chunks: int) -> SimpleNamespace:
    group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=chunks)


def test_interleaved_1f1b_is_megatrons_order():
    """megatron-core 0.16.1's own tables: get_schedule_table (micro-batch groups of pp),
    get_pp_rank_microbatches (warm-up), convert_schedule_table_to_order (F/B interleaving);
    backward pops each chunk's micro-batches first-in first-out, as its backward_step_helper."""
    from megatron.core.pipeline_parallel.schedules import (get_pp_rank_microbatches,
                                                           get_schedule_table)
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    for pp in range(2, 9):
        for v in range(2, 5):
            for m in range(pp, 25, pp):
                table = get_schedule_table(m, v, pp)
                sched = build("interleaved-1f1b", pp, m, 1, v)
                for rank in range(pp):
                    _, _, warmup, _ = get_pp_rank_microbatches(
                        m, v, pp, p2p_communicator=_fake_communicator(pp, rank, v))
                    forwards, popped, expected = iter(table), [0] * v, []
                    for entry in convert_schedule_table_to_order(warmup, v, table):
                        if entry > 0:
                            microbatch, chunk = next(forwards)
                            expected.append(Action("F", microbatch, 0, chunk))
                        else:
                            chunk = -entry - 1
                            expected.append(Action("B", popped[chunk], 0, chunk))
                            popped[chunk] += 1
                    assert list(sched.programs[rank]) == expected, (pp, v, m, rank)


def test_1f1b_is_megatrons_order():
    """forward_backward_pipelining_without_interleaving: P-r-1 warm-up forwards, then one
    forward / one backward, then the remaining backwards."""
    for pp in range(1, 9):
        for m in range(1, 13):
            sched = build("1f1b", pp, m, 1)
            for rank in range(pp):
                warmup = min(pp - rank - 1, m)
                expected = [f"F{i}.0" for i in range(warmup)]
                for i in range(m - warmup):
                    expected += [f"F{warmup + i}.0", f"B{i}.0"]
                expected += [f"B{i}.0" for i in range(m - warmup, m)]
                assert sched.format_rank(rank) == expected
