"""Point-to-point transfers between pipeline ranks: this rank's part of the communication plan.

`seq1f1b.plan.communication` decides, before the iteration, which sends and receives go out
together and where; this module issues exactly those groups, each one `batch_isend_irecv`, on
every backend, and nothing else. Shapes come from the plan's spans (no shape exchange: Megatron's
variable-shape exchange is where its p2p bugs live). Tags are 0: NCCL ignores them, and gloo with
one tag matches in issue order as NCCL does, so a wrong order shows on the CPU as a wrong tensor
or a hang instead of being forgiven.

How groups run (`make_transport`):
- NCCL: issued at once; `work.wait()` without a timeout makes the compute stream wait for the
  group and lets the host run ahead. A stuck transfer is reported by the process group's own
  watchdog, whose timeout `--p2p-timeout` sets (a wait with a timeout would busy-wait the host).
- gloo, "stream" (default): one worker thread runs the groups one at a time in issue order, each
  to completion, as the CUDA stream runs NCCL kernels: an order that would hang on a GPU hangs
  here too, and fails after `--p2p-timeout` naming the ranks and the messages.
- gloo, "direct" (`SEQ1F1B_GLOO_P2P=direct`): issued and waited exactly as on NCCL, and left to
  gloo, which runs them concurrently (a wait is bounded by the process group's timeout); the host
  calls are then those a GPU run makes (the recorded-call test replays them under NCCL's rules).
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from seq1f1b.plan.actions import Action, Schedule
from seq1f1b.plan.communication import (SEND, Group, Message, RankPlan, communication_plan,
                                        incoming, outgoing)

GLOO_MODES = ("stream", "direct")
GLOO_MODE_VARIABLE = "SEQ1F1B_GLOO_P2P"
_PEER = "pipeline rank"     # how errors name a peer: its rank in the pipeline group


class Transport(Protocol):
    """Issues a group's P2POps and waits for them; `describe` words a timeout; `done` asks,
    without blocking, whether a group has finished (so its tensors can be let go)."""

    def issue(self, ops: list[dist.P2POp], batched: bool) -> object: ...

    def wait(self, handle: object, describe: Callable[[], str]) -> None: ...

    def done(self, handle: object) -> bool: ...

    def close(self) -> None: ...


def _start(ops: list[dist.P2POp], batched: bool) -> list:
    """One batch_isend_irecv; or, for a plan's lone group (test fixtures only: every planned
    group is batched), its one isend or irecv."""
    if batched:
        return dist.batch_isend_irecv(ops)
    (op,) = ops
    key = "group_dst" if op.op is dist.isend else "group_src"
    return [op.op(op.tensor, group=op.group, **{key: op.group_peer})]


class ImmediateTransport:
    """Issued at once; `wait()` without a timeout: on NCCL a stream wait (see the module doc), on
    gloo a host wait bounded by the process group's timeout (`--p2p-timeout`)."""

    def issue(self, ops: list[dist.P2POp], batched: bool) -> object:
        return _start(ops, batched)

    def wait(self, handle: object, describe: Callable[[], str]) -> None:
        for work in handle:
            work.wait()

    def done(self, handle: object) -> bool:
        """`Work.is_completed()`: on NCCL a query of the work's CUDA event, no host sync."""
        return all(work.is_completed() for work in handle)

    def close(self) -> None:
        pass


@dataclass
class _Queued:
    ops: list
    batched: bool
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None


class StreamGlooTransport:
    """One worker runs the groups in issue order, each to completion before the next starts: the
    FIFO of a CUDA stream. The host waits for a group's completion, not for its own turn.

    The host's wait (`--p2p-timeout`) is the one that reports a stuck group, naming its
    messages; the worker's own gloo wait is bounded at twice that only so the thread is freed.
    Were both bounded alike, the worker (whose wait starts earlier) could win the race on a
    loaded machine and the report would be gloo's "Timed out waiting" instead of ours."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.running: Optional[_Queued] = None     # what the stream is on now (for reports)
        self._worker = threading.Thread(target=self._run, name="p2p-stream", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        failed: Optional[BaseException] = None
        while True:
            item = self._queue.get()
            if item is None:
                return
            self.running = item
            if failed is None:
                try:
                    for work in _start(item.ops, item.batched):
                        work.wait(timedelta(seconds=2 * self.timeout_s))
                except BaseException as err:   # reported to the host by the group's waiter
                    failed = err
            item.error = failed
            item.done.set()

    def issue(self, ops: list[dist.P2POp], batched: bool) -> object:
        item = _Queued(ops, batched)
        self._queue.put(item)
        return item

    def wait(self, handle: object, describe: Callable[[], str]) -> None:
        if not handle.done.wait(self.timeout_s):
            raise RuntimeError(describe())
        if handle.error is not None:
            first = str(handle.error).splitlines()[0] if str(handle.error) else ""
            raise RuntimeError(f"{describe()}: {type(handle.error).__name__} {first}")

    def done(self, handle: object) -> bool:
        """Finished without an error (a failed group is left for `wait` to report)."""
        return handle.done.is_set() and handle.error is None

    def close(self) -> None:
        self._queue.put(None)


def gloo_mode() -> str:
    mode = os.environ.get(GLOO_MODE_VARIABLE, "stream")
    if mode not in GLOO_MODES:
        raise ValueError(f"{GLOO_MODE_VARIABLE}={mode!r}: choose one of {', '.join(GLOO_MODES)}")
    return mode


def make_transport(group: Optional[dist.ProcessGroup], timeout_s: float) -> Transport:
    if dist.get_backend(group) == "nccl" or gloo_mode() == "direct":
        return ImmediateTransport()
    return StreamGlooTransport(timeout_s)


@dataclass
class _Issued:
    """A group this rank has issued: its handle, its receive buffers and the tensors it sends,
    both let go as soon as the group is known to have finished."""

    index: int
    handle: object
    buffers: dict[Message, torch.Tensor]
    sent: list[torch.Tensor]
    finished: bool = False


class PipelineChannels:
    """This rank's planned sends and receives over the pipeline process group, one iteration.

    The executor calls `start()`, then for action n: `receive(action)` (waits for the group
    holding its tensor), `send(action, tensor)` (hands its output over), `after(action)` (issues
    the groups planned right after it), and `finish()` at the end. `shape_of(span)` gives the
    tensor shape of span `span`; a message between two chunks of this rank goes through memory.

    What the channels hold, and for how long (`held_tensors()`, which the memory meter counts):
    a sent tensor and its group's handle until the group is known to have finished, a received
    buffer until its action takes it, an output until its group is issued. Groups nobody waits
    for before the iteration's end (an input gradient sent upstream, an activation sent
    downstream) are asked `Transport.done` after every action, without blocking, and let go the
    moment they have run: otherwise a middle rank would keep every gradient it sent until
    `finish()` (ProcessGroupNCCL keeps a tensor alive until its kernel has run by itself, and
    gloo's works hold theirs for their own lifetime, so nothing needs a reference beyond that).
    """

    def __init__(self, schedule: Schedule, rank: int, group: Optional[dist.ProcessGroup],
                 shape_of: Callable[[int], tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device, timeout_s: float = 600.0,
                 plan: Optional[RankPlan] = None) -> None:
        self.schedule = schedule
        self.rank = rank
        self.group = group
        self.shape_of = shape_of
        self.dtype = dtype
        self.device = device
        self.timeout_s = timeout_s
        self.plan = plan if plan is not None else communication_plan(schedule).ranks[rank]
        self._transport: Optional[Transport] = None
        self._running: list[_Issued] = []           # issued, not known to have finished
        self._holder: dict[Message, _Issued] = {}
        self._outputs: dict[Message, torch.Tensor] = {}
        self._local: dict[Message, torch.Tensor] = {}

    def start(self) -> None:
        if self.plan.groups:
            self._transport = make_transport(self.group, self.timeout_s)
        self._issue_at(-1)

    def _issue_at(self, point: int) -> None:
        for index in self.plan.issued_at.get(point, ()):
            self._issue(index, self.plan.groups[index].group)

    def _issue(self, index: int, group: Group) -> None:
        ops, buffers, sent = [], {}, []
        for op in group.ops:
            if op.kind == SEND:
                tensor = self._outputs.pop(op.payload)
                sent.append(tensor)
                ops.append(dist.P2POp(dist.isend, tensor, group=self.group, group_peer=op.peer))
            else:
                buffer = torch.empty(self.shape_of(op.payload.span), dtype=self.dtype,
                                     device=self.device)
                buffers[op.payload] = buffer
                ops.append(dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=op.peer))
        issued = _Issued(index, self._transport.issue(ops, group.batched), buffers, sent)
        self._running.append(issued)
        for message in buffers:
            self._holder[message] = issued

    def receive(self, action: Action) -> Optional[torch.Tensor]:
        """The tensor `action` needs from its neighbour stage, or None when it needs none."""
        need = incoming(self.schedule, self.rank, action)
        if need is None:
            return None
        peer, message = need
        if peer == self.rank:
            return self._local.pop(message)
        issued = self._holder.pop(message)
        self._wait(issued, action)
        return issued.buffers.pop(message)

    def _wait(self, issued: _Issued, action: Optional[Action]) -> None:
        if issued.finished:
            return
        self._transport.wait(issued.handle, lambda: self._timeout_text(issued, action))
        self._let_go(issued)

    def _let_go(self, issued: _Issued) -> None:
        """The group has run: drop its handle and sent tensors (its buffers go with receive)."""
        issued.finished = True
        issued.handle = None
        issued.sent.clear()
        self._running.remove(issued)

    def _let_go_finished(self) -> None:
        """Let go of every group that has finished, asking without blocking."""
        for issued in [i for i in self._running if self._transport.done(i.handle)]:
            self._let_go(issued)

    def _timeout_text(self, issued: _Issued, action: Optional[Action]) -> str:
        show = self.schedule.chunks > 1
        who = f"{action.format(show)} waited" if action is not None else "the iteration's end " \
                                                                          "waited"
        group = self.plan.groups[issued.index].group
        text = (f"pipeline rank {self.rank}: {who} more than {self.timeout_s:g} s for its p2p "
                f"group {issued.index} {group.describe(_PEER)}")
        running = getattr(self._transport, "running", None)
        stuck = next((i for i in self._running if i.handle is running), None)
        if stuck is not None and stuck is not issued:
            text += (f"; its stream is stuck at group {stuck.index} "
                     f"{self.plan.groups[stuck.index].group.describe(_PEER)}")
        return text + " (--p2p-timeout)"

    def send(self, action: Action, tensor: torch.Tensor) -> None:
        """Hand what `action` produced to the stage that needs it; it goes out with `after`."""
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
        else:
            self._outputs[message] = tensor.contiguous()

    def after(self, action: Action) -> None:
        """Issue the groups planned right after `action`; let go of those that have run."""
        self._issue_at(self.schedule.position(self.rank, action))
        if self._running:
            self._let_go_finished()

    def held_tensors(self) -> list[torch.Tensor]:
        """What the channels keep alive now: tensors of groups still running, received buffers
        not yet taken, outputs not yet issued, messages between this rank's chunks."""
        buffers = {id(i): i for i in self._holder.values()}
        return ([t for i in self._running for t in i.sent]
                + [b for i in buffers.values() for b in i.buffers.values()]
                + list(self._outputs.values()) + list(self._local.values()))

    def finish(self) -> None:
        """Wait for every group still running (the sends); check that every planned message
        was used."""
        try:
            for issued in list(self._running):
                self._wait(issued, None)
        finally:
            if self._transport is not None:
                self._transport.close()
        leftover = [str(m) for m in self._holder] + [str(m) for m in self._local]
        leftover += [str(m) for m in self._outputs]
        if leftover:
            raise RuntimeError(f"pipeline rank {self.rank}: unconsumed messages {leftover}")
