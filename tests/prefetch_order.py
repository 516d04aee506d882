"""The runtime's p2p order before the communication plan, kept as a fixture (never a runtime mode).

Each rank posted the receive of action n+1 as a lone irecv before running action n (and the
receives before it on that channel, in channel order), sent each output with a lone isend right
after its action and waited for the sends at the end. On gloo that works; under NCCL's rules it
deadlocks for every schedule of the registry (tests/unit/test_communication.py), and on gloo's
NCCL-order stream it hangs (tests/distributed/test_p2p_timeout.py).
"""
from __future__ import annotations

from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.communication import (RECV, SEND, CommunicationPlan, Group, Op, PlannedGroup,
                                        RankPlan, channel_order, incoming, outgoing)


def prefetch_plan(schedule: Schedule) -> CommunicationPlan:
    return CommunicationPlan(schedule, tuple(_rank(schedule, r) for r in range(schedule.pp)))


def _rank(schedule: Schedule, rank: int) -> RankPlan:
    program = schedule.programs[rank]
    groups: list[PlannedGroup] = []
    holder = {}
    queues = {}

    def post_until(point: int, peer: int, message) -> None:
        queue = queues.setdefault(peer, list(channel_order(schedule, peer, rank)))
        while message not in holder:
            posted = queue.pop(0)
            holder[posted] = len(groups)
            groups.append(PlannedGroup(point, Group((Op(RECV, peer, posted),), batched=False)))

    for n, action in enumerate(program):
        for needy in program[n + 1:n + 2] + program[n:n + 1]:
            need = incoming(schedule, rank, needy)
            if need is not None and need[0] != rank:
                post_until(n - 1, *need)
        out = outgoing(schedule, rank, action)
        if out is not None and out[0] != rank:
            groups.append(PlannedGroup(n, Group((Op(SEND, *out),), batched=False)))
    waits = []
    for action in program:
        need = incoming(schedule, rank, action)
        waits.append((holder[need[1]],) if need is not None and need[0] != rank else ())
    return RankPlan(rank, tuple(program), tuple(groups), tuple(waits))
