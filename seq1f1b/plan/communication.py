"""Pipeline communication, planned from the schedule so that it cannot deadlock under NCCL.

gloo matches messages by tag and runs them concurrently, so on a CPU almost any order of
isend/irecv works. NCCL does not forgive (shared/reference/NCCL_P2P.md): each rank's p2p calls
run in FIFO order on a CUDA stream, tags are ignored (the n-th send a->b matches the n-th receive
at b from a), a receive finishes only once its send runs and a large send only once its receive
runs. An order that passes on gloo can hang on a GPU's first iteration. So the order is data:
derived here once per schedule, issued as it is by the runtime on every backend, and replayed
under those rules by `seq1f1b.plan.nccl.validate_communication`.

An action may need one tensor from a neighbour stage (F: its input activation, B: its output
grad) and may produce one (F: its output, B: its input grad); tensors between two chunks of one
rank are handed over in memory and are not planned. With the output layer spread (O actions,
actions.OPS), the last stage's F sends its output to the rank running that span's O, as the
activation "for stage P*V" (one past the last), and the O sends the gradient back for the last
stage's B; an O on the last stage's own rank hands both over in memory. A rank's communication is a list of groups,
each one `batch_isend_irecv`, issued at a *point* of its program: before its first action
(point -1) or right after action n (point n). Action n waits for the group holding its receive.

**One order for every stream.** Every message gets a key: when its producer ends in a unit-cost
replay of the schedule (F 1, B 2; F, B, W 1 when backward is split), then the producer's rank
and place. Each rank issues its sends and receives in key order. Both ends of a message see the
same key, so no two ranks disagree on which of two messages comes first, which is what makes a
cycle of stream waits impossible: the message with the smallest key still outstanding is at the
head of both its ends' streams, and everything its producer needed has a smaller key. (Megatron
gets the same effect for 1F1B by pairing send_forward with recv_backward; keys give it for every
schedule, spans and W actions included, and keep each channel in the sender's order, which
NCCL's matching needs.)

**Groups.** A send goes out right after its action. A receive joins the group before it in key
order (posted as early as the order allows, so the transfer overlaps compute) unless that group
is already waited for by an action that starts, in the replay, before this message exists:
waiting for a group waits for all of it, and no action may wait for a message that could depend
on it. Then it opens a group of its own at the same point. Every group is batched, even a single
op: with torch's lazy NCCL init a lone op runs on its pair's communicator and a batched one on the
group's, and two ends on different communicators never match.

The keys come from unit costs; real costs may make a rank wait for a message earlier than the
replay did, but never deadlock: the argument above holds for any costs.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

from seq1f1b.plan.actions import Action, Schedule
from seq1f1b.plan.simulate import timelines, uniform_costs

ACTIVATION = "activation"
GRADIENT = "gradient"
SEND, RECV = "send", "recv"


class Message(NamedTuple):
    """A tensor for virtual stage `stage`: the activation into F(i,j) or the grad into B(i,j)."""

    kind: str
    microbatch: int
    span: int
    stage: int

    def describe(self) -> str:
        return f"{self.kind} of micro-batch {self.microbatch} span {self.span} for stage {self.stage}"

    __str__ = describe


def outgoing(schedule: Schedule, rank: int, action: Action) -> Optional[tuple[int, Message]]:
    """(receiving rank, message) that `action` on `rank` sends, or None."""
    last = schedule.num_stages - 1
    if action.op == "O":
        return (schedule.owner_of(last)[0],
                Message(GRADIENT, action.microbatch, action.span, last))
    stage = schedule.stage_of(rank, action.chunk)
    if action.op == "F" and stage == last and schedule.spread_output:
        return (schedule.output_rank(action.microbatch, action.span),
                Message(ACTIVATION, action.microbatch, action.span, last + 1))
    if action.op == "F" and stage < last:
        target, kind = stage + 1, ACTIVATION
    elif action.op == "B" and stage > 0:
        target, kind = stage - 1, GRADIENT
    else:
        return None
    return schedule.owner_of(target)[0], Message(kind, action.microbatch, action.span, target)


def incoming(schedule: Schedule, rank: int, action: Action) -> Optional[tuple[int, Message]]:
    """(sending rank, message) that `action` on `rank` must receive before it runs, or None."""
    last = schedule.num_stages - 1
    if action.op == "O":
        return (schedule.owner_of(last)[0],
                Message(ACTIVATION, action.microbatch, action.span, last + 1))
    stage = schedule.stage_of(rank, action.chunk)
    if action.op == "B" and stage == last and schedule.spread_output:
        return (schedule.output_rank(action.microbatch, action.span),
                Message(GRADIENT, action.microbatch, action.span, last))
    if action.op == "F" and stage > 0:
        source, kind = stage - 1, ACTIVATION
    elif action.op == "B" and stage < schedule.num_stages - 1:
        source, kind = stage + 1, GRADIENT
    else:
        return None
    return schedule.owner_of(source)[0], Message(kind, action.microbatch, action.span, stage)


@functools.lru_cache(maxsize=256)
def channel_order(schedule: Schedule, src: int, dst: int) -> tuple[Message, ...]:
    """Messages from rank `src` to rank `dst` in the order `src` sends them."""
    order = []
    for action in schedule.programs[src]:
        sent = outgoing(schedule, src, action)
        if sent is not None and sent[0] == dst:
            order.append(sent[1])
    return tuple(order)


# -- host programs: what a rank's host does, as the checker reads it -------------------------------
# Small immutable records made by the hundred thousand in the grid test: NamedTuples, whose
# construction is a C call (frozen dataclasses set each field through object.__setattr__).
class Op(NamedTuple):
    """One send or receive of a group. `payload` is what both ends must agree on: the planned
    Message, or a tensor's dtype and shape for recorded calls."""

    kind: str
    peer: int
    payload: Union[Message, str]

    def describe(self, rank: str = "rank") -> str:
        """In words; `rank` names the peer's rank ("pipeline rank" in the runtime's errors)."""
        return f"{self.kind} {self.payload} {'to' if self.kind == SEND else 'from'} {rank} " \
               f"{self.peer}"


class Group(NamedTuple):
    """Ops issued together: one batch_isend_irecv (`batched`) or one lone isend/irecv.

    `communicator` names the process group when programs of several are replayed together (the
    pipeline's and the context-parallel group's, with global ranks as peers): messages match only
    within one. A collective is a batched group of the same communicator that sends to and
    receives from every other member (it completes once all of them have started it), waited at
    once (`collective`)."""

    ops: tuple[Op, ...]
    batched: bool = True
    communicator: Optional[tuple] = None

    def describe(self, rank: str = "rank") -> str:
        return "{" + "; ".join(op.describe(rank) for op in self.ops) + "}"


def collective(name: str, payload: str, members: Sequence[int], rank: int) -> Group:
    """Rank `rank`'s part of a collective `name` over `members` (global ranks): one exchange
    with every other member, each end carrying `name payload`, so that members that issue
    collectives in different orders are matched against each other's other collective."""
    carried = f"{name} {payload}"
    ops = tuple(Op(kind, peer, carried) for peer in members if peer != rank
                for kind in (SEND, RECV))
    return Group(ops, True, tuple(members))


class Compute(NamedTuple):
    label: str


class Issue(NamedTuple):
    group: Group


class Wait(NamedTuple):
    group: int      # index of the waited group among this rank's Issue steps


HostStep = Union[Compute, Issue, Wait]


@dataclass(frozen=True)
class HostProgram:
    """What one rank's host runs, in order."""

    rank: int
    steps: tuple[HostStep, ...]

    def groups(self) -> list[Group]:
        return [step.group for step in self.steps if isinstance(step, Issue)]


# -- the plan ------------------------------------------------------------------------------------
class PlannedGroup(NamedTuple):
    """A group and where it goes out: before action 0 (point -1) or right after action `point`."""

    point: int
    group: Group


@dataclass(frozen=True)
class RankPlan:
    """One rank's groups in issue order, and the groups each action waits for."""

    rank: int
    actions: tuple[Action, ...]
    groups: tuple[PlannedGroup, ...]
    waits: tuple[tuple[int, ...], ...]      # per action: indices into `groups`

    @functools.cached_property
    def issued_at(self) -> dict[int, tuple[int, ...]]:
        """point -> indices of the groups issued there."""
        at: dict[int, list[int]] = defaultdict(list)
        for index, planned in enumerate(self.groups):
            at[planned.point].append(index)
        return {point: tuple(indices) for point, indices in at.items()}

    def host_program(self, show_chunk: bool = False) -> HostProgram:
        steps: list[HostStep] = [Issue(self.groups[g].group) for g in self.issued_at.get(-1, ())]
        for n, action in enumerate(self.actions):
            steps += [Wait(g) for g in self.waits[n]]
            steps.append(Compute(action.format(show_chunk)))
            steps += [Issue(self.groups[g].group) for g in self.issued_at.get(n, ())]
        waited = {g for waits in self.waits for g in waits}
        steps += [Wait(g) for g in range(len(self.groups)) if g not in waited]   # the sends
        return HostProgram(self.rank, tuple(steps))


@dataclass(frozen=True)
class CommunicationPlan:
    schedule: Schedule
    ranks: tuple[RankPlan, ...]

    @functools.cached_property
    def host_programs(self) -> tuple[HostProgram, ...]:
        """Every rank's host program (made once: each NCCL mode replays the same)."""
        show = self.schedule.chunks > 1
        return tuple(rank.host_program(show) for rank in self.ranks)


@functools.lru_cache(maxsize=64)
def communication_plan(schedule: Schedule) -> CommunicationPlan:
    """Every rank's groups for `schedule` (see the module docstring); cached per schedule."""
    timeline = _unit_cost_timeline(schedule)
    sends: list[list[tuple]] = []
    receives: list[list[tuple]] = []
    produced: dict[Message, tuple] = {}          # message -> its key
    for rank, program in enumerate(schedule.programs):
        sends.append([])
        receives.append([])
        for n, action in enumerate(program):
            sent = outgoing(schedule, rank, action)
            if sent is not None and sent[0] != rank:
                key = (timeline[rank][n][1], rank, n)
                produced[sent[1]] = key
                sends[-1].append((key, SEND, n, sent[0], sent[1]))
            needed = incoming(schedule, rank, action)
            if needed is not None and needed[0] != rank:
                receives[-1].append((RECV, n, needed[0], needed[1]))
    ranks = []
    for rank, program in enumerate(schedule.programs):
        ops = sends[rank] + [(produced[message], kind, n, peer, message)
                             for kind, n, peer, message in receives[rank]]
        ranks.append(_group(rank, program, sorted(ops, key=lambda op: op[0]), timeline))
    return CommunicationPlan(schedule, tuple(ranks))


Timeline = list[list[tuple[float, float]]]
"""[rank][action index] -> (start, end) in a unit-cost replay of the schedule."""


def _unit_cost_timeline(schedule: Schedule) -> Timeline:
    output = 1.0 if schedule.spread_output else None
    costs = (uniform_costs(schedule, 1.0, 1.0, 1.0, output) if schedule.split_backward
             else uniform_costs(schedule, 1.0, 2.0, output=output))
    return [[(t.start, t.end) for t in rank] for rank in timelines(schedule, costs)]


def _group(rank: int, program: Sequence[Action], ops: list, timeline: Timeline) -> RankPlan:
    """Cut the rank's ops, in key order, into groups (see the module docstring)."""
    groups: list[tuple[int, list[Op]]] = []       # (point, ops)
    first_waiter: list[Optional[int]] = []        # earliest action waiting for each group
    waits: list[tuple[int, ...]] = [()] * len(program)
    for key, kind, n, peer, message in ops:
        op = Op(kind, peer, message)
        if kind == SEND:
            groups.append((n, [op]))
            first_waiter.append(None)
            continue
        waiter = first_waiter[-1] if groups else None
        if not groups or (waiter is not None and key[0] > timeline[rank][waiter][0]):
            groups.append((groups[-1][0] if groups else -1, []))
            first_waiter.append(None)
        groups[-1][1].append(op)
        first_waiter[-1] = n if first_waiter[-1] is None else min(first_waiter[-1], n)
        waits[n] = (len(groups) - 1,)
    planned = tuple(PlannedGroup(point, Group(tuple(group_ops))) for point, group_ops in groups)
    return RankPlan(rank, tuple(program), planned, tuple(waits))
