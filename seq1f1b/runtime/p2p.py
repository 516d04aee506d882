"""Point-to-point transfers between pipeline ranks, planned from the schedule.

Every message is known before the iteration starts: which action sends it, which action receives
it, its shape (from the span length) and its place in the order of its (sender, receiver) channel.
So nothing is exchanged at run time (Megatron's variable-shape exchange is where its p2p bugs live),
receives are posted ahead in channel order (what NCCL's in-order matching needs), sends never block,
and a receive that does not arrive in time fails with the rank, action and peer in the message.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from seq1f1b.plan.actions import Action, Schedule

ACTIVATION = "activation"
GRADIENT = "gradient"


@dataclass(frozen=True)
class Message:
    """A tensor for virtual stage `stage`: the activation into F(i,j) or the grad into B(i,j)."""

    kind: str
    microbatch: int
    span: int
    stage: int

    def describe(self) -> str:
        return f"{self.kind} of micro-batch {self.microbatch} span {self.span} for stage {self.stage}"


def outgoing(schedule: Schedule, rank: int, action: Action) -> Optional[tuple[int, Message]]:
    """(receiving rank, message) that `action` on `rank` sends, or None."""
    stage = schedule.stage_of(rank, action.chunk)
    if action.op == "F" and stage < schedule.num_stages - 1:
        target = stage + 1
        kind = ACTIVATION
    elif action.op == "B" and stage > 0:
        target = stage - 1
        kind = GRADIENT
    else:
        return None
    return schedule.owner_of(target)[0], Message(kind, action.microbatch, action.span, target)


def incoming(schedule: Schedule, rank: int, action: Action) -> Optional[tuple[int, Message]]:
    """(sending rank, message) that `action` on `rank` must receive before it runs, or None."""
    stage = schedule.stage_of(rank, action.chunk)
    if action.op == "F" and stage > 0:
        source, kind = stage - 1, ACTIVATION
    elif action.op == "B" and stage < schedule.num_stages - 1:
        source, kind = stage + 1, GRADIENT
    else:
        return None
    return schedule.owner_of(source)[0], Message(kind, action.microbatch, action.span, stage)


@functools.lru_cache(maxsize=256)
def channel_order(schedule: Schedule, src: int, dst: int) -> tuple[Message, ...]:
    """Messages from rank `src` to rank `dst` in the order `src` sends them (once per plan: the
    executor of every iteration asks again)."""
    order = []
    for action in schedule.programs[src]:
        sent = outgoing(schedule, src, action)
        if sent is not None and sent[0] == dst:
            order.append(sent[1])
    return tuple(order)


class PipelineChannels:
    """This rank's planned sends and receives over the pipeline process group.

    `shape_of(span)` gives the tensor shape of span `span` (the same for activations and their
    grads); a message between two chunks of the same rank is handed over in memory.
    """

    def __init__(self, schedule: Schedule, rank: int, group: Optional[dist.ProcessGroup],
                 shape_of: Callable[[int], tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device, timeout_s: float = 600.0) -> None:
        self.schedule = schedule
        self.rank = rank
        self.group = group
        self.shape_of = shape_of
        self.dtype = dtype
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        peers = {incoming(schedule, rank, a)[0] for a in schedule.programs[rank]
                 if incoming(schedule, rank, a) is not None}
        # Per peer: messages still to post in channel order, and the tags by message.
        self._to_post = {p: list(channel_order(schedule, p, rank)) for p in peers if p != rank}
        self._tags = {p: {m: n for n, m in enumerate(order)} for p, order in self._to_post.items()}
        self._send_tags = {p: {m: n for n, m in enumerate(channel_order(schedule, rank, p))}
                           for p in range(schedule.pp) if p != rank}
        self._posted: dict[Message, tuple[dist.Work, torch.Tensor, int]] = {}
        self._local: dict[Message, torch.Tensor] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def _post_until(self, peer: int, message: Message) -> None:
        queue = self._to_post[peer]
        while message not in self._posted:
            nxt = queue.pop(0)
            buffer = torch.empty(self.shape_of(nxt.span), dtype=self.dtype, device=self.device)
            work = dist.irecv(buffer, group=self.group, group_src=peer,
                              tag=self._tags[peer][nxt])
            self._posted[nxt] = (work, buffer, peer)

    def prefetch(self, action: Action) -> None:
        """Post the receive `action` will need (and those before it on its channel) now."""
        need = incoming(self.schedule, self.rank, action)
        if need is not None and need[0] != self.rank:
            self._post_until(*need)

    def receive(self, action: Action) -> Optional[torch.Tensor]:
        """The tensor `action` needs from its neighbour stage, or None when it needs none."""
        need = incoming(self.schedule, self.rank, action)
        if need is None:
            return None
        peer, message = need
        if peer == self.rank:
            return self._local.pop(message)
        self._post_until(peer, message)
        work, buffer, _ = self._posted.pop(message)
        try:
            finished = work.wait(self.timeout)
        except RuntimeError as err:
            raise RuntimeError(self._timeout_text(action, peer, message, err)) from None
        if finished is False:
            raise RuntimeError(self._timeout_text(action, peer, message, None))
        return buffer

    def _timeout_text(self, action: Action, peer: int, message: Message, err) -> str:
        cause = f": {str(err).splitlines()[0]}" if err else ""
        return (f"pipeline rank {self.rank}: {action.format(self.schedule.chunks > 1)} waited "
                f"more than {self.timeout.total_seconds():g} s for the {message.describe()} from "
                f"pipeline rank {peer} (--p2p-timeout){cause}")

    def send(self, action: Action, tensor: torch.Tensor) -> None:
        """Send what `action` produced to the stage that needs it (never blocks)."""
        target = outgoing(self.schedule, self.rank, action)
        if target is None:
            return
        peer, message = target
        tensor = tensor.detach()
        expected = self.shape_of(message.span)
        if tuple(tensor.shape) != tuple(expected):
            raise RuntimeError(f"pipeline rank {self.rank}: {action} produced shape "
                               f"{tuple(tensor.shape)}, the plan expects {tuple(expected)}")
        if peer == self.rank:
            self._local[message] = tensor
            return
        tensor = tensor.contiguous()
        work = dist.isend(tensor, group=self.group, group_dst=peer,
                          tag=self._send_tags[peer][message])
        self._sends.append((work, tensor))
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def finish(self) -> None:
        """Wait for every send; check that every planned receive was consumed."""
        for work, _ in self._sends:
            work.wait(self.timeout)
        self._sends.clear()
        leftover = [m.describe() for m in self._posted] + [m.describe() for m in self._local]
        leftover += [m.describe() for queue in self._to_post.values() for m in queue]
        if leftover:
            raise RuntimeError(f"pipeline rank {self.rank}: unconsumed messages {leftover}")
