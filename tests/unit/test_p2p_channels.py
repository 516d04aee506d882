"""The runtime issues exactly the communication plan's groups, each one batch_isend_irecv; on
NCCL it waits without a timeout (a stream wait: the host runs on); gloo's stream transport runs
groups one at a time in issue order and says what it is stuck on. torch.distributed is faked:
these are the calls, not the transfers (the distributed tests do those)."""
import threading
import time

import pytest
import torch
import torch.distributed as dist

from seq1f1b.plan import registry
from seq1f1b.plan.communication import SEND, communication_plan, incoming
from seq1f1b.runtime import p2p
from seq1f1b.runtime.p2p import PipelineChannels


class FakeWork:
    def __init__(self, log, release=None):
        self.log, self.release = log, release

    def wait(self, *args, **kwargs):
        self.log.append(("wait", args, kwargs))
        if self.release is not None:
            self.release.wait()
        return True

    def is_completed(self):
        """Never seen done before a wait: every group here is waited (tests/unit/
        test_p2p_held.py drives groups that finish by themselves)."""
        return False


class FakeP2POp:
    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.kind = SEND if op is dist.isend else "recv"
        self.tensor, self.peer, self.tag = tensor, group_peer, tag


@pytest.fixture
def fake_dist(monkeypatch):
    """Records every batch and wait; `hold[n]`, when set, is an Event the n-th batch's works
    wait for."""
    log, hold = [], {}

    def batch_isend_irecv(ops):
        index = sum(entry[0] == "batch" for entry in log)
        log.append(("batch", [(op.kind, op.peer, tuple(op.tensor.shape), op.tag) for op in ops]))
        return [FakeWork(log, hold.get(index)) for _ in ops]

    monkeypatch.setattr(dist, "P2POp", FakeP2POp)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    return log, hold


def _shape(span):
    return (span + 3, 1, 4)


def _drive(channels, program, log):
    channels.start()
    for action in program:
        channels.receive(action)
        log.append(("action", str(action)))
        channels.send(action, torch.zeros(_shape(action.span)))
        channels.after(action)
    channels.finish()


@pytest.mark.parametrize("name, pp, m, k, v, rank", [
    ("seq1f1b", 3, 3, 2, 1, 1), ("seq1f1b-interleaved", 2, 2, 2, 2, 0),
    ("seq1f1b-zb-h1", 3, 3, 2, 1, 2)])
def test_nccl_path_issues_the_plans_groups_and_waits_without_timeout(fake_dist, monkeypatch,
                                                                      name, pp, m, k, v, rank):
    log, _ = fake_dist
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    schedule = registry.build(name, pp, m, k, v)
    _drive(PipelineChannels(schedule, rank, None, _shape, torch.float32, torch.device("cpu")),
           schedule.programs[rank], log)
    plan = communication_plan(schedule).ranks[rank]
    batches = [entry[1] for entry in log if entry[0] == "batch"]
    assert batches == [[(op.kind, op.peer, _shape(op.payload.span), 0) for op in g.group.ops]
                       for g in plan.groups]
    waits = [entry for entry in log if entry[0] == "wait"]
    assert waits and all(args == () and kwargs == {} for _, args, kwargs in waits)
    assert len(waits) == sum(len(g.group.ops) for g in plan.groups)
    # Each action that receives finds its group waited before it runs, issued after the action
    # named by the plan.
    for n, action in enumerate(plan.actions):
        at = log.index(("action", str(action)))
        need = incoming(schedule, rank, action)
        if need is not None and need[0] != rank:
            assert log[at - 1][0] == "wait"
        issued_after = plan.issued_at.get(n, ())
        following = [entry for entry in log[at + 1:] if entry[0] != "wait"][:len(issued_after)]
        assert all(entry[0] == "batch" for entry in following)


def test_a_send_of_the_wrong_shape_is_refused(fake_dist, monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    schedule = registry.build("seq1f1b", 2, 1, 2)
    channels = PipelineChannels(schedule, 0, None, _shape, torch.float32, torch.device("cpu"))
    channels.start()
    with pytest.raises(RuntimeError, match=r"F0.0 produced shape \(2, 1, 4\), the plan expects "
                                           r"\(3, 1, 4\)"):
        channels.send(schedule.programs[0][0], torch.zeros(2, 1, 4))


def test_gloo_stream_runs_one_group_at_a_time_and_names_what_it_is_stuck_on(fake_dist,
                                                                            monkeypatch):
    log, hold = fake_dist
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setenv(p2p.GLOO_MODE_VARIABLE, "stream")
    schedule = registry.build("1f1b", 2, 4, 1)
    plan = communication_plan(schedule).ranks[0]
    release = hold[0] = threading.Event()     # rank 0's first group never finishes by itself
    channels = PipelineChannels(schedule, 0, None, _shape, torch.float32, torch.device("cpu"),
                                timeout_s=0.5)
    channels.start()
    program = schedule.programs[0]
    started = time.time()
    with pytest.raises(RuntimeError) as failure:
        for action in program:
            channels.receive(action)
            channels.send(action, torch.zeros(_shape(action.span)))
            channels.after(action)
    assert time.time() - started < 5
    text = str(failure.value)
    assert text.startswith("pipeline rank 0: B0.0 waited more than 0.5 s for its p2p group 1 "
                           "{send activation of micro-batch 1 span 0 for stage 1 to pipeline rank "
                           "1; recv gradient of micro-batch 0 span 0 for stage 0 from pipeline "
                           "rank 1}; its stream is stuck at group 0 {send activation of "
                           "micro-batch 0 span 0 for stage 1 to pipeline rank 1} (--p2p-timeout)")
    # The second group was issued by the host but never started: the stream is FIFO.
    assert sum(entry[0] == "batch" for entry in log) == 1
    release.set()                             # the stream then runs what the host issued
    channels.finish()
    assert sum(entry[0] == "batch" for entry in log) == 2 < len(plan.groups)


def test_unknown_gloo_mode_is_refused(monkeypatch):
    monkeypatch.setenv(p2p.GLOO_MODE_VARIABLE, "fast")
    with pytest.raises(ValueError, match="SEQ1F1B_GLOO_P2P='fast': choose one of stream, direct"):
        p2p.gloo_mode()
