"""Communication under NCCL's rules: every registry schedule's plan finishes on the whole grid, the
checker finds the deadlock of the runtime's old prefetch order, and each rule of the replay
(stream FIFO, rendezvous, communicators, in-order matching, collectives on a second communicator
beside the pipeline's p2p) is enforced on small hand-made programs."""
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
from prefetch_order import prefetch_plan

from seq1f1b.plan import registry, schedule_file
from seq1f1b.plan.actions import Schedule, ScheduleError
from seq1f1b.plan.communication import (RECV, SEND, Compute, Group, HostProgram, Issue, Message,
                                        Op, Wait, channel_order, collective, communication_plan,
                                        incoming, outgoing)
from seq1f1b.plan.nccl import MODES, CommunicationError, validate_communication, validate_modes


def prefetch_programs(schedule) -> tuple[HostProgram, ...]:
    return prefetch_plan(schedule).host_programs


def _grid_failures(name: str, pp: int) -> tuple[int, list]:
    """Every problem of schedule `name` at P=pp: m from the smallest it accepts to 2P+1, k 1-8,
    V 2-3 when it interleaves. Schedules placed by a replay in time (a V: zbv, seq1f1b-zbv,
    seq1f1b-zb-auto) cost far more to build: k 1-4 and m 1-P+2 for them. Returns (schedules
    checked, failures)."""
    info = registry.get(name)
    placed = info.placement == "vshape"
    checked, failures = 0, []
    for k in range(1, 5 if placed else 9):
        for v in ((2, 3) if info.chunked else (1,)):
            for m in range(1, (pp + 3) if placed else (2 * pp + 2)):
                try:
                    schedule = registry.build(name, pp, m, k, v)
                except ScheduleError:
                    continue
                for mode, verdict in validate_modes(communication_plan(schedule)).items():
                    if not verdict.ok:
                        failures.append((name, pp, m, k, v, mode, verdict.problems[0]))
                checked += 1
    return checked, failures


def test_every_registry_plan_finishes_under_nccl_rules_on_the_grid():
    """Every registry schedule family, P 1-8, in both NCCL modes; the (schedule, P) slices run
    on every core (forked workers: the slices are independent and the grid is ~4300 plans).
    A schedule read from a file (`file:PATH`, registered by an earlier test in this process)
    has one shape only and is checked when it is read (schedule_file.read), not here."""
    families = [name for name in registry.names() if not name.startswith(schedule_file.PREFIX)]
    slices = sorted(((name, pp) for name in families for pp in range(1, 9)),
                    key=lambda item: -item[1])
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=context) as pool:
        results = list(pool.map(_grid_failures, *zip(*slices)))
    failures = [failure for _, found in results for failure in found]
    assert failures == []
    assert sum(checked for checked, _ in results) > 4000
    assert all(checked > 0 for checked, _ in results)


def test_old_prefetch_order_deadlocks_as_seen_on_the_cluster():
    """--pp 2 --schedule 1f1b --num-microbatches 4: rank 0 queued "recv grad 0" before "send
    act 1", rank 1 "recv act 1" before "send grad 0"."""
    schedule = registry.build("1f1b", 2, 4, 1)
    for mode in MODES:
        verdict = validate_communication(prefetch_programs(schedule), mode)
        assert not verdict.ok
        (problem,) = verdict.problems
        assert problem.startswith("deadlock among ranks 0, 1: ")
        assert "recv gradient of micro-batch 0 span 0 for stage 0 from rank 1" in problem
        assert "send activation of micro-batch 1 span 0 for stage 1 to rank 1" in problem
        assert "recv activation of micro-batch 1 span 0 for stage 1 from rank 0" in problem
        assert "queued behind" in problem
        with pytest.raises(CommunicationError, match=f"^{mode} mode: deadlock"):
            verdict.raise_if_bad()
    assert validate_communication(communication_plan(schedule)).ok


@pytest.mark.parametrize("name, pp, m, k, v", [
    ("gpipe", 2, 4, 2, 1), ("seq1f1b", 2, 4, 2, 1), ("seq1f1b", 3, 4, 3, 1),
    ("interleaved-1f1b", 2, 4, 1, 2), ("seq1f1b-interleaved", 2, 4, 2, 2),
    ("seq1f1b-zb-h1", 4, 4, 2, 1), ("zb-h1", 3, 4, 1, 1)])
def test_old_prefetch_order_deadlocks_every_family(name, pp, m, k, v):
    schedule = registry.build(name, pp, m, k, v)
    verdicts = [validate_communication(prefetch_programs(schedule), mode) for mode in MODES]
    assert all(v.problems and v.problems[0].startswith("deadlock") for v in verdicts)
    assert all(validate_communication(communication_plan(schedule), mode).ok for mode in MODES)


# -- the plan's shape ----------------------------------------------------------------------------
def test_p2p_messages_follow_the_sender_program_order():
    sched = Schedule.from_text("rank 0: F0.0 F0.1 B0.1 B0.0\nrank 1: F0.0 F0.1 B0.1 B0.0")
    assert [(m.kind, m.span) for m in channel_order(sched, 0, 1)] == [
        ("activation", 0), ("activation", 1)]
    assert [(m.kind, m.span) for m in channel_order(sched, 1, 0)] == [
        ("gradient", 1), ("gradient", 0)]
    first = sched.programs[0][0]
    assert incoming(sched, 0, first) is None and outgoing(sched, 0, first)[0] == 1


def test_one_f_one_b_pairs_each_send_with_the_next_receive_as_megatron():
    plan = communication_plan(registry.build("1f1b", 2, 4, 1))
    after_f1 = [g.group for g in plan.ranks[0].groups if g.point == 1]
    assert [[(op.kind, str(op.payload)) for op in g.ops] for g in after_f1] == [[
        (SEND, "activation of micro-batch 1 span 0 for stage 1"),
        (RECV, "gradient of micro-batch 0 span 0 for stage 0")]]
    assert all(g.group.batched for rank in plan.ranks for g in rank.groups)


@pytest.mark.parametrize("name, pp, m, k, v", [
    ("seq1f1b", 4, 5, 3, 1), ("seq1f1b-interleaved", 2, 4, 3, 2), ("seq1f1b-zb-h1", 3, 4, 2, 1),
    ("interleaved-1f1b", 3, 6, 2, 3), ("gpipe", 3, 2, 2, 1)])
def test_plan_sends_after_the_action_and_receives_in_the_senders_order(name, pp, m, k, v):
    schedule = registry.build(name, pp, m, k, v)
    plan = communication_plan(schedule)
    for rank in plan.ranks:
        received = {}
        for index, planned in enumerate(rank.groups):
            for op in planned.group.ops:
                if op.kind == SEND:
                    action = rank.actions[planned.point]
                    assert outgoing(schedule, rank.rank, action) == (op.peer, op.payload)
                else:
                    received.setdefault(op.peer, []).append(op.payload)
                    consumer = next(n for n, a in enumerate(rank.actions)
                                    if incoming(schedule, rank.rank, a) == (op.peer, op.payload))
                    assert planned.point < consumer
                    assert rank.waits[consumer] == (index,)
        for peer, messages in received.items():
            assert messages == list(channel_order(schedule, peer, rank.rank))
        points = [g.point for g in rank.groups]
        assert points == sorted(points)


def test_interleaved_with_one_rank_hands_chunks_over_in_memory():
    plan = communication_plan(registry.build("seq1f1b-interleaved", 1, 2, 2, 2))
    assert plan.ranks[0].groups == ()


# -- the rules, one by one -----------------------------------------------------------------------
ACT = Message("activation", 0, 0, 1)
GRAD = Message("gradient", 0, 0, 0)


def _send(peer, payload, batched=True):
    return Issue(Group((Op(SEND, peer, payload),), batched))


def _recv(peer, payload, batched=True):
    return Issue(Group((Op(RECV, peer, payload),), batched))


def _exchange(first_a, second_a, first_b, second_b):
    """Ranks 0 and 1, each: two groups, then wait for both."""
    return [HostProgram(0, (Compute("F"), first_a, second_a, Wait(0), Wait(1))),
            HostProgram(1, (Compute("F"), first_b, second_b, Wait(0), Wait(1)))]


@pytest.mark.parametrize("mode", MODES)
def test_send_then_receive_on_both_sides_hangs_by_rendezvous(mode):
    programs = _exchange(_send(1, ACT), _recv(1, GRAD), _send(0, GRAD), _recv(0, ACT))
    verdict = validate_communication(programs, mode)
    assert verdict.problems and "deadlock among ranks 0, 1" in verdict.problems[0]
    assert "queued behind" in verdict.problems[0]


@pytest.mark.parametrize("mode", MODES)
def test_receive_then_send_on_both_sides_hangs(mode):
    programs = _exchange(_recv(1, GRAD), _send(1, ACT), _recv(0, ACT), _send(0, GRAD))
    assert not validate_communication(programs, mode).ok


@pytest.mark.parametrize("mode", MODES)
def test_the_same_exchange_in_one_batch_finishes(mode):
    pair = [HostProgram(0, (Compute("F"), Issue(Group((Op(SEND, 1, ACT), Op(RECV, 1, GRAD)))),
                            Wait(0))),
            HostProgram(1, (Compute("F"), Issue(Group((Op(RECV, 0, ACT), Op(SEND, 0, GRAD)))),
                            Wait(0)))]
    assert validate_communication(pair, mode).ok


def test_consistent_order_finishes_and_counts():
    programs = _exchange(_send(1, ACT), _recv(1, GRAD), _recv(0, ACT), _send(0, GRAD))
    verdict = validate_communication(programs)
    assert verdict.ok and verdict.groups == 4 and verdict.messages == 2


def test_lone_and_batched_ends_never_meet_in_lazy_mode_only():
    programs = [HostProgram(0, (Compute("F"), _send(1, ACT, batched=False), Wait(0))),
                HostProgram(1, (_recv(0, ACT, batched=True), Wait(0), Compute("F")))]
    lazy = validate_communication(programs, "lazy")
    assert any("which no rank matches" in p for p in lazy.problems)
    assert any("issue no batched group" in p for p in lazy.problems)
    assert validate_communication(programs, "eager").ok


def test_lazy_mode_gives_each_peer_its_own_stream():
    """Rank 0 sends Y to rank 1, then Z to rank 2; rank 1 sends X to rank 2, then receives Y;
    rank 2 receives X only after computing on Z. On one device stream (eager) each rank's first
    op waits for a second op queued behind another first op: a cycle of three. With lone ops in
    lazy mode every peer has its own stream and all of it finishes."""
    x, y, z = (Message("activation", mb, 0, 1) for mb in range(3))
    programs = [
        HostProgram(0, (Compute("F"), _send(1, y, False), _send(2, z, False), Wait(0), Wait(1))),
        HostProgram(1, (Compute("F"), _send(2, x, False), _recv(0, y, False), Wait(1), Wait(0))),
        HostProgram(2, (_recv(0, z, False), Wait(0), Compute("F"), _recv(1, x, False),
                        Wait(1))),
    ]
    assert validate_communication(programs, "lazy").ok
    verdict = validate_communication(programs, "eager")
    assert verdict.problems[0].startswith("deadlock among ranks 0, 1, 2")


def test_a_group_waits_for_the_compute_issued_before_it():
    """A ring of three, each rank: receive from the previous, compute, send to the next. Lone ops
    in lazy mode put each receive and send on different streams, so the only cycle is the one
    through the compute streams: each send goes out after a compute that waits for a receive."""
    programs = [HostProgram(r, (_recv((r - 1) % 3, Message("activation", 0, 0, r), False),
                                Wait(0), Compute(f"F{r}"),
                                _send((r + 1) % 3, Message("activation", 0, 0, (r + 1) % 3),
                                      False), Wait(1)))
                for r in range(3)]
    (problem,) = validate_communication(programs, "lazy").problems
    assert problem.startswith("deadlock among ranks 0, 1, 2")
    assert "rank 2's group 1 goes out after its F2" in problem


def test_in_order_matching_catches_swapped_messages():
    act1 = Message("activation", 1, 0, 1)
    programs = [HostProgram(0, (Compute("F"), _send(1, ACT), _send(1, act1), Wait(0), Wait(1))),
                HostProgram(1, (_recv(0, act1), _recv(0, ACT), Wait(0), Wait(1), Compute("F")))]
    verdict = validate_communication(programs)
    assert any("send number 1 to rank 1 carries activation of micro-batch 0" in p and
               "receives it as activation of micro-batch 1" in p for p in verdict.problems)


def test_a_message_nobody_receives_is_a_hang():
    programs = [HostProgram(0, (Compute("F"), _send(1, ACT), Wait(0))),
                HostProgram(1, (Compute("F"),))]
    (problem,) = validate_communication(programs).problems
    assert "which no rank matches" in problem and "Stuck: rank 0 at the wait for its group 0" \
        in problem


def test_malformed_programs_are_refused():
    with pytest.raises(ValueError, match="before issuing it"):
        validate_communication([HostProgram(0, (Wait(0),))])
    with pytest.raises(ValueError, match="mode"):
        validate_communication([], "greedy")


# -- several communicators: the pipeline's p2p beside context-parallel collectives --------------
PP_A, PP_B, CP_A, CP_B = (0, 1), (2, 3), (0, 2), (1, 3)
"""Four ranks as megatron lays out PP 2 x CP 2 (tp-cp-dp-pp): pipeline groups {0, 1} and {2, 3},
context-parallel groups {0, 2} and {1, 3}."""


def _p2p(kind, peer, payload, communicator):
    return Issue(Group((Op(kind, peer, payload),), True, communicator))


def _all_to_all(rank, members, n=0):
    return Issue(collective("all_to_all_single", f"float32 [{n}]", members, rank))


@pytest.mark.parametrize("mode", MODES)
def test_collectives_in_opposite_orders_on_two_communicators_hang(mode):
    """Ranks 0 and 1 share two communicators; each waits for its first collective, and they
    issue them in opposite orders: a hang in either mode."""
    x, y = (0, 1), ("y", 0, 1)
    programs = [HostProgram(0, (Issue(Group(collective("all_reduce", "a", x, 0).ops, True, x)),
                                Wait(0), Issue(Group(collective("all_reduce", "b", x, 0).ops,
                                                     True, y)), Wait(1))),
                HostProgram(1, (Issue(Group(collective("all_reduce", "b", x, 1).ops, True, y)),
                                Wait(0), Issue(Group(collective("all_reduce", "a", x, 1).ops,
                                                     True, x)), Wait(1)))]
    verdict = validate_communication(programs, mode)
    assert verdict.problems and "deadlock among ranks 0, 1" in verdict.problems[0]


@pytest.mark.parametrize("mode", MODES)
def test_one_communicator_matches_collectives_in_issue_order(mode):
    """CP ranks 0 and 2 issue two all-to-alls of different shapes in opposite orders: NCCL
    would pair the wrong tensors."""
    programs = [HostProgram(0, (_all_to_all(0, CP_A, 1), Wait(0), _all_to_all(0, CP_A, 2),
                                Wait(1))),
                HostProgram(2, (_all_to_all(2, CP_A, 2), Wait(0), _all_to_all(2, CP_A, 1),
                                Wait(1)))]
    assert any("all_to_all_single float32 [1]" in p and "receives it as" in p
               for p in validate_communication(programs, mode).problems)


def _cross_order(consistent: bool) -> list[HostProgram]:
    """Rank 0 sends to rank 1 without waiting, then all-to-alls with rank 2; rank 2 all-to-alls
    with rank 0, then sends to rank 3; rank 3 receives from rank 2 before its all-to-all with
    rank 1, which receives from rank 0 only after it. With `consistent`, rank 1 receives first,
    like rank 3 (every CP rank the same program): the orders agree across the CP groups."""
    rank1 = ((_p2p(RECV, 0, ACT, PP_A), _all_to_all(1, CP_B), Wait(1), Wait(0)) if consistent
             else (_all_to_all(1, CP_B), Wait(0), _p2p(RECV, 0, ACT, PP_A), Wait(1)))
    return [HostProgram(0, (_p2p(SEND, 1, ACT, PP_A), _all_to_all(0, CP_A), Wait(1), Wait(0))),
            HostProgram(1, rank1),
            HostProgram(2, (_all_to_all(2, CP_A), Wait(0), _p2p(SEND, 3, ACT, PP_B), Wait(1))),
            HostProgram(3, (_p2p(RECV, 2, ACT, PP_B), _all_to_all(3, CP_B), Wait(1), Wait(0)))]


def test_eager_mode_serialises_communicators_and_catches_an_inconsistent_order():
    """Lazy mode (each process group its own stream, progressing independently) finishes the
    inconsistent order; eager mode, every communicator on one device stream, finds the cycle
    through both communicators that two streams with no progress guarantee can hang on. The
    consistent order, which the runtime's CP ranks issue, finishes in both."""
    assert validate_communication(_cross_order(False), "lazy").ok
    eager = validate_communication(_cross_order(False), "eager")
    assert eager.problems and eager.problems[0].startswith("deadlock among ranks 0, 1, 2, 3")
    assert all(v.ok for v in validate_modes(_cross_order(True)).values())
