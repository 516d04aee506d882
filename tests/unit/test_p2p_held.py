"""What the pipeline channels keep alive: a sent tensor only until its group has run.

Every rank's `PipelineChannels` of one schedule run in this process on meta tensors, down the
NCCL path (`ImmediateTransport`), against a fake network with NCCL's completion rule: a message
completes once both of its ends have been issued (a rendezvous, as large messages do), a group
once all of its messages have. The ranks' actions run in the order of a unit-cost replay of the
schedule, so each rank's host issues what it would issue by then. The tensors handed to `send`
are watched through their storages' use counts: a storage used by more than the watcher is one
somebody still holds. Before this rule the
input gradients of the middle ranks (send-only groups, waited only at the iteration's end) were
all kept until `finish()`: 28 of 32 on a 3-rank gloo run, 7.7 GiB per middle rank at 7B, 32K,
m=32. The bound checked here does not grow with m.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from seq1f1b.plan import registry
from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.simulate import timelines, uniform_costs
from seq1f1b.runtime.p2p import PipelineChannels


@dataclass
class Network:
    """Groups issued by every rank; NCCL's matching: the n-th send a -> b meets the n-th
    receive at b from a."""

    rank: int = 0                                   # the rank whose host is calling now
    ends: dict = field(default_factory=lambda: defaultdict(lambda: [[], []]))
    groups: list = field(default_factory=list)      # per group: its (channel, n, side) ends
    waited: set = field(default_factory=set)

    def issue(self, ops) -> list:
        index = len(self.groups)
        mine = []
        for op in ops:
            send = op.op is dist.isend
            channel = (self.rank, op.group_peer) if send else (op.group_peer, self.rank)
            side = self.ends[channel][0 if send else 1]
            mine.append((channel, len(side), 1 if send else 0))
            side.append(index)
        self.groups.append(mine)
        return [FakeWork(self, index)]

    def done(self, index: int) -> bool:
        return index in self.waited or all(
            len(self.ends[channel][other]) > n for channel, n, other in self.groups[index])


class FakeWork:
    def __init__(self, network: Network, index: int) -> None:
        self.network, self.index = network, index

    def is_completed(self) -> bool:
        return self.network.done(self.index)

    def wait(self) -> bool:      # a stream wait: the group runs once its peers have issued
        self.network.waited.add(self.index)
        return True


class FakeP2POp:
    def __init__(self, op, tensor, group=None, group_peer=None):
        self.op, self.tensor, self.group_peer = op, tensor, group_peer


@dataclass
class Held:
    """Bytes of sent tensors still alive per rank: the most at any point, and at `finish()`."""

    peak: list[int]
    at_finish: list[int]


def held_sent_bytes(schedule: Schedule, shape_of, dtype=torch.bfloat16,
                    check_meter: bool = True) -> Held:
    """Drive every rank's channels through `schedule` (see the module docstring)."""
    network = Network()
    real = dist.P2POp, dist.batch_isend_irecv, dist.get_backend
    dist.P2POp, dist.batch_isend_irecv = FakeP2POp, network.issue
    dist.get_backend = lambda group=None: "nccl"
    try:
        channels = [PipelineChannels(schedule, r, None, shape_of, dtype, torch.device("meta"))
                    for r in range(schedule.pp)]
        sent: list[list[tuple[torch.UntypedStorage, int]]] = [[] for _ in channels]

        def held(rank: int) -> list[tuple[torch.UntypedStorage, int]]:
            return [(storage, size) for storage, size in sent[rank]
                    if torch._C._storage_Use_Count(storage._cdata) > 1]

        order = sorted((timed.start, rank, n) for rank, timeline in
                       enumerate(timelines(schedule, uniform_costs(schedule, 1.0, 2.0, 1.0
                                                                   if schedule.split_backward
                                                                   else None)))
                       for n, timed in enumerate(timeline))
        for rank, channel in enumerate(channels):
            network.rank = rank
            channel.start()
        peak = [0] * schedule.pp
        for _, rank, n in order:
            network.rank = rank
            action = schedule.programs[rank][n]
            channel = channels[rank]
            channel.receive(action)
            output = torch.empty(shape_of(action.span), dtype=dtype, device="meta")
            channel.send(action, output)
            sent[rank].append((output.untyped_storage(), output.numel() * output.element_size()))
            del output
            channel.after(action)
            alive = held(rank)
            peak[rank] = max(peak[rank], sum(size for _, size in alive))
            if check_meter:      # the meter sees every sent tensor that is still alive
                metered = {t.untyped_storage()._cdata for t in channel.held_tensors()}
                assert all(storage._cdata in metered for storage, _ in alive)
        at_finish = [sum(size for _, size in held(rank)) for rank in range(schedule.pp)]
        for rank, channel in enumerate(channels):
            network.rank = rank
            channel.finish()
        return Held(peak, at_finish)
    finally:
        dist.P2POp, dist.batch_isend_irecv, dist.get_backend = real


def _shape(span: int) -> tuple[int, int, int]:
    return (64, 1, 32)


MESSAGE = 64 * 32 * 2


@pytest.mark.parametrize("name", registry.names())
def test_sent_tensors_are_let_go_once_their_group_has_run(name):
    info = registry.get(name)
    chunks, splits = (2, 2) if info.chunked else (1, 2)
    held = {m: held_sent_bytes(registry.build(name, 4, m, splits, chunks), _shape)
            for m in (8, 32)}
    # Bounded whatever the number of micro-batches: nothing piles up until the iteration's end.
    assert held[32].peak == held[8].peak, name
    assert max(held[32].peak) <= 4 * splits * chunks * MESSAGE, name
    assert max(held[32].at_finish) <= 2 * MESSAGE, name
