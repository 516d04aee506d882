"""NCCL's point-to-point rules, replayed: would these host programs hang on a GPU?

`validate_communication` takes host programs (a communication plan's, or ones recorded from real
torch.distributed calls) and runs them under the semantics ProcessGroupNCCL gives them
(shared/reference/NCCL_P2P.md):
- each rank's compute stream runs its Compute and Wait steps in host order; a Wait holds it until
  the waited group has finished (`work.wait()` makes the current stream wait; the host goes on);
- a group starts once the compute stream has run everything it held when the group was issued
  (ProcessGroupNCCL makes the NCCL stream wait for the current stream) and once the group before
  it on its NCCL stream has finished. Streams: "eager" mode (init with device_id) has one per
  device; "lazy" mode (the default) runs a batched group on the process group's stream and a lone
  op on its pair's stream (one per peer, both directions);
- messages match per communicator and direction in issue order, tags ignored (batched groups use
  the process group's communicator, lone ops in lazy mode their pair's); matched ends must carry
  the same payload, or NCCL hands the receiver another tensor;
- a message completes once the groups of both its ends have started (a rendezvous, as large
  messages do); a group finishes when all of its messages have completed;
- lazy mode: the first batched call on a process group creates its communicator, a collective
  every rank of the group must join, so all ranks that communicate must batch.
Everything that can run, runs; what is left is a deadlock, reported as its cycle of waits (ranks,
actions, groups and messages), or as the chain that ends at a message no rank matches.

The replay advances per-rank pointers (compute step, stream head) and touches every step and op
a bounded number of times: linear in the size of the programs, as the grid test needs.

Several communicators (`Group.communicator`, global ranks as peers: the pipeline's p2p beside the
context-parallel group's all-to-alls, `communication.collective`): messages match within one
communicator only. In lazy mode each process group's groups run on its own stream (torch's
assignment, the streams progressing independently); in eager mode every group of a rank, of
every communicator, runs on one device stream in issue order: the strict reading of "CUDA gives
no guarantee that two streams progress independently", under which two communicators' kernels
issued in inconsistent orders across ranks hang. A program set must finish in both.

Not modelled: tensor-parallel collectives (the TP ranks of a stage run the same program and add
no cycle between stages) and messages small enough for NCCL to send eagerly (a rendezvous for
every send is the safe side).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.communication import (SEND, CommunicationPlan, Compute, Group, HostProgram,
                                        Issue, Wait)

MODES = ("lazy", "eager")


class CommunicationError(ScheduleError):
    """The communication would hang or deliver a wrong tensor under NCCL's rules."""


@dataclass(frozen=True)
class CommunicationVerdict:
    """What a replay found: `ok`, or its problems (a deadlock is one, with its cycle)."""

    mode: str
    problems: tuple[str, ...]
    groups: int
    messages: int

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_bad(self) -> None:
        if self.problems:
            raise CommunicationError(f"{self.mode} mode: " + "; ".join(self.problems))


def validate_communication(plan: Union[CommunicationPlan, Sequence[HostProgram]],
                           mode: str = "lazy") -> CommunicationVerdict:
    """Replay host programs (a plan's, or recorded ones) under NCCL's rules in `mode`."""
    return validate_modes(plan, (mode,))[mode]


def validate_modes(plan: Union[CommunicationPlan, Sequence[HostProgram]],
                   modes: Sequence[str] = MODES) -> dict[str, CommunicationVerdict]:
    """`validate_communication` for each mode. Programs of one communicator without a lone op
    run on the same streams and communicators in both modes, so one replay answers both (lazy
    mode adds only its check that every rank batches)."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    programs = plan.host_programs if isinstance(plan, CommunicationPlan) else tuple(plan)
    groups = [step.group for program in programs for step in program.steps
              if isinstance(step, Issue)]
    one_stream = all(group.batched for group in groups) and \
        len({group.communicator for group in groups}) <= 1
    if not one_stream:
        return {mode: _Replay(programs, mode).run() for mode in modes}
    verdict = _Replay(programs, "eager").run()
    return {mode: CommunicationVerdict(mode, verdict.problems, verdict.groups, verdict.messages)
            for mode in modes}


class _Replay:
    """Groups get global ids in (rank, issue) order; a rank's compute stream is the list of its
    Compute (-1) and Wait (group id) steps; `issue_at[g]` is how many of those had been issued
    before group g."""

    def __init__(self, programs: Sequence[HostProgram], mode: str) -> None:
        self.programs = list(programs)
        self.mode = mode
        self.problems: list[str] = []
        self.group_of: list[Group] = []
        self.group_rank: list[int] = []
        self.group_index: list[int] = []            # the group's index among its rank's issues
        self.issue_at: list[int] = []
        self.compute: list[list[int]] = []          # per rank position: -1 or a group id
        self.compute_step: list[list[int]] = []     # the host step index of each entry
        self.streams: list[dict[object, list[int]]] = []
        self.rank_at = {program.rank: n for n, program in enumerate(self.programs)}
        for program in self.programs:
            self._read(program)
        self.message_ends: list[tuple[tuple[int, int], Optional[tuple[int, int]]]] = []
        self.group_messages: list[list[int]] = [[] for _ in self.group_of]
        self._match()

    # -- reading the programs --------------------------------------------------------------------
    def _stream(self, group: Group) -> object:
        if self.mode == "eager":
            return "device"
        if group.batched:
            return ("device", group.communicator)
        if len(group.ops) != 1:
            raise ValueError("a lone (unbatched) group holds exactly one op")
        return ("pair", group.communicator, group.ops[0].peer)

    def _read(self, program: HostProgram) -> None:
        compute: list[int] = []
        steps: list[int] = []
        streams: dict[object, list[int]] = defaultdict(list)
        first = len(self.group_of)
        for index, step in enumerate(program.steps):
            if isinstance(step, Issue):
                if not step.group.ops:
                    raise ValueError(f"rank {program.rank} issues an empty group")
                gid = len(self.group_of)
                self.group_of.append(step.group)
                self.group_rank.append(program.rank)
                self.group_index.append(gid - first)
                self.issue_at.append(len(compute))
                streams[self._stream(step.group)].append(gid)
            elif isinstance(step, Wait):
                if not 0 <= step.group < len(self.group_of) - first:
                    raise ValueError(f"rank {program.rank} waits for its group {step.group} "
                                     "before issuing it")
                compute.append(first + step.group)
                steps.append(index)
            elif isinstance(step, Compute):
                compute.append(-1)
                steps.append(index)
            else:
                raise TypeError(f"not a host step: {step!r}")
        self.compute.append(compute)
        self.compute_step.append(steps)
        self.streams.append(dict(streams))

    def _comm(self, group: Group) -> tuple:
        return ("group" if self.mode == "eager" or group.batched else "pair", group.communicator)

    def _match(self) -> None:
        """Pair the n-th send a->b with the n-th receive at b from a, per communicator."""
        sends: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        receives: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        batching: dict[int, set[bool]] = defaultdict(set)
        for gid, group in enumerate(self.group_of):
            rank = self.group_rank[gid]
            batching[rank].add(group.batched)
            comm = self._comm(group)
            for n, op in enumerate(group.ops):
                if op.kind == SEND:
                    sends[(comm, rank, op.peer)].append((gid, n))
                else:
                    receives[(comm, op.peer, rank)].append((gid, n))
        ends, group_messages = self.message_ends, self.group_messages
        for key in sends.keys() | receives.keys():
            out, into = sends.get(key, ()), receives.get(key, ())
            for n in range(max(len(out), len(into))):
                send = out[n] if n < len(out) else None
                recv = into[n] if n < len(into) else None
                if send is not None and recv is not None:
                    sent, received = self._op(send).payload, self._op(recv).payload
                    if sent != received:
                        self.problems.append(
                            f"rank {key[1]}'s send number {n + 1} to rank {key[2]} carries "
                            f"{sent}, but rank {key[2]} receives it as {received} (NCCL matches "
                            "sends and receives in order)")
                    ends.append((send, recv))
                    group_messages[send[0]].append(len(ends) - 1)
                    group_messages[recv[0]].append(len(ends) - 1)
                else:
                    ends.append((send or recv, None))
                    group_messages[(send or recv)[0]].append(len(ends) - 1)
        if self.mode == "lazy" and any(True in kinds for kinds in batching.values()):
            lone = sorted(rank for rank, kinds in batching.items() if True not in kinds)
            if lone:
                self.problems.append(
                    f"ranks {lone} issue no batched group while others do: a group's first "
                    "batched call creates its communicator, which every rank must join")

    def _op(self, end: tuple[int, int]):
        return self.group_of[end[0]].ops[end[1]]

    # -- the replay ------------------------------------------------------------------------------
    def run(self) -> "CommunicationVerdict":
        self.started = [False] * len(self.group_of)
        self.pending = [len(messages) for messages in self.group_messages]
        self.ends_started = [0] * len(self.message_ends)
        self.position = [0] * len(self.programs)
        self.head = [{stream: 0 for stream in streams} for streams in self.streams]
        queue = deque(range(len(self.programs)))
        queued = [True] * len(self.programs)
        while queue:
            at = queue.popleft()
            queued[at] = False
            for woken in self._advance(at):
                if not queued[woken]:
                    queued[woken] = True
                    queue.append(woken)
        if any(self.position[at] < len(self.compute[at]) for at in range(len(self.programs))) \
                or not all(self.pending[gid] == 0 for gid in range(len(self.group_of))):
            self.problems.append(self._deadlock())
        return CommunicationVerdict(self.mode, tuple(self.problems), len(self.group_of),
                                    len(self.message_ends))

    def _advance(self, at: int) -> set[int]:
        """Run what rank position `at` can run; returns the rank positions that may move now."""
        woken: set[int] = set()
        moved = True
        while moved:
            moved = False
            for stream, order in self.streams[at].items():
                head = self.head[at][stream]
                while head < len(order):
                    gid = order[head]
                    if not self.started[gid]:
                        if self.issue_at[gid] > self.position[at]:
                            break
                        self._start(gid, woken)
                        moved = True
                    if self.pending[gid]:
                        break
                    head += 1
                self.head[at][stream] = head
            compute, position = self.compute[at], self.position[at]
            while position < len(compute) and (compute[position] < 0
                                               or self.pending[compute[position]] == 0):
                position += 1
            if position != self.position[at]:
                self.position[at] = position
                moved = True
        woken.discard(at)
        return woken

    def _start(self, gid: int, woken: set[int]) -> None:
        self.started[gid] = True
        for message in self.group_messages[gid]:
            self.ends_started[message] += 1
            first, second = self.message_ends[message]
            if second is not None and self.ends_started[message] == 2:
                for end in (first, second):
                    self.pending[end[0]] -= 1
                    woken.add(self.rank_at[self.group_rank[end[0]]])

    # -- the report ------------------------------------------------------------------------------
    def _deadlock(self) -> str:
        """Follow the waits from the first stuck rank until they close a cycle (or reach a
        message without another end), and say each one."""
        stuck = [at for at in range(len(self.programs))
                 if self.position[at] < len(self.compute[at])]
        node: tuple = ("c", stuck[0]) if stuck else \
            ("g", next(g for g in range(len(self.group_of)) if self.pending[g]))
        path: list[tuple] = []
        seen: dict[tuple, int] = {}
        words: list[str] = []
        while node not in seen and node[0] != "never":
            seen[node] = len(path)
            path.append(node)
            node, said = self._wait_of(node)
            words.append(said)
        if node[0] != "never":
            words = words[seen[node]:]
            path = path[seen[node]:]
        ranks = sorted({self.programs[n[1]].rank if n[0] == "c" else self.group_rank[n[1]]
                        for n in path})
        where = ", ".join(f"rank {self.programs[at].rank} at {self._label(at)}" for at in stuck)
        return (f"deadlock among ranks {', '.join(map(str, ranks))}: " + "; ".join(words)
                + (f". Stuck: {where}" if where else ""))

    def _label(self, at: int, position: Optional[int] = None) -> str:
        position = self.position[at] if position is None else position
        entry = self.compute[at][position]
        if entry >= 0:
            return f"the wait for its group {self.group_index[entry]}"
        step = self.programs[at].steps[self.compute_step[at][position]]
        return step.label

    def _group(self, gid: int) -> str:
        return (f"rank {self.group_rank[gid]}'s group {self.group_index[gid]} "
                f"{self.group_of[gid].describe()}")

    def _wait_of(self, node: tuple) -> tuple[tuple, str]:
        """What `node` (a stuck compute stream, or an unfinished group) waits for, and why."""
        if node[0] == "c":
            at = node[1]
            gid = self.compute[at][self.position[at]]
            return ("g", gid), (f"rank {self.programs[at].rank}'s {self._label(at)} waits for "
                                f"{self._group(gid)} to finish")
        gid = node[1]
        at = self.rank_at[self.group_rank[gid]]
        if not self.started[gid]:
            order = self.streams[at][self._stream(self.group_of[gid])]
            before = order[order.index(gid) - 1] if order.index(gid) else None
            if before is not None and self.pending[before]:
                return ("g", before), (f"{self._group(gid)} is queued behind its group "
                                       f"{self.group_index[before]} on the same stream")
            return ("c", at), (f"rank {self.group_rank[gid]}'s group {self.group_index[gid]} "
                               f"goes out after its {self._label(at, self.issue_at[gid] - 1)}")
        for message in self.group_messages[gid]:
            first, second = self.message_ends[message]
            mine, other = (first, second) if first[0] == gid else (second, first)
            if other is None:
                return ("never",), (f"{self._group(gid)} holds "
                                    f"{self._op(mine).describe()}, which no rank matches")
            if not self.started[other[0]]:
                return ("g", other[0]), (
                    f"rank {self.group_rank[gid]}'s group {self.group_index[gid]} needs rank "
                    f"{self.group_rank[other[0]]} to post the other end of its "
                    f"{self._op(mine).describe()}, in its group {self.group_index[other[0]]}")
        raise AssertionError("an unfinished group with every message's ends started")
