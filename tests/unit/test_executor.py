"""The executor on one process: caches fill during the iteration and nothing is left after it;
forward-only frees caches at the last span; the trace records every action."""
import functools

import pytest
import torch

from seq1f1b import megatron_adapter
from seq1f1b.plan import registry
from seq1f1b.runtime.executor import Executor, StepInputs
from seq1f1b.runtime.trace import ExecutionTrace

pytestmark = pytest.mark.usefixtures("megatron_world")
L, MBS, M = 12, 2, 3


def _loss_func(mask, output):
    loss = (output.float() * mask).sum()
    return loss, mask.sum().to(torch.int), {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def _inputs(schedule_name, splits, forward_only=False, trace=None):
    config = megatron_adapter.make_transformer_config(num_layers=2, hidden_size=16,
                                                      num_attention_heads=4)
    torch.manual_seed(0)
    model = megatron_adapter.build_model_chunk(config, vocab_size=32, max_sequence_length=L)
    gen = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, 32, (MBS, L), generator=gen),
                "labels": torch.randint(0, 32, (MBS, L), generator=gen),
                "mask": torch.ones(MBS, L)} for _ in range(M)]
    seen = []

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        executor = seen[0]
        seen.append(sum(len(c) for c in executor.caches.values()))
        output = chunk(batch["tokens"], None, None, labels=batch["labels"])
        return output, functools.partial(_loss_func, batch["mask"])

    bounds = [(0, 3), (3, 10), (10, 12)][:splits] if splits == 3 else [(0, L)]
    inputs = StepInputs(
        schedule=registry.build(schedule_name, 1, M, splits), spans=bounds, rank=0,
        pp_group=None, forward_step_func=forward_step, data_iterators=[iter(batches)],
        model_chunks=[model], config=config, seq_length=L, micro_batch_size=MBS,
        forward_only=forward_only, trace=trace)
    return inputs, seen


@pytest.mark.parametrize("forward_only", [False, True])
def test_no_cache_entry_or_activation_is_left_after_an_iteration(forward_only):
    inputs, seen = _inputs("seq1f1b", 3, forward_only)
    executor = Executor(inputs)
    seen[:] = [executor]
    losses = executor.run()
    cache_sizes = seen[1:]
    assert len(losses) == M
    assert max(cache_sizes) > 0, "the KV cache never held anything: the check below is vacuous"
    assert executor.caches == {} and executor.saved == {} and executor.losses == {}


def test_trace_records_every_action_and_bytes_held():
    trace = ExecutionTrace(measure_memory=True)
    inputs, seen = _inputs("seq1f1b", 3, trace=trace)
    executor = Executor(inputs)
    seen[:] = [executor]
    executor.run()
    labels = [a.action for a in trace.actions]
    assert labels == [a.format() for a in inputs.schedule.programs[0]]
    assert all(a.end >= a.start for a in trace.actions)
    assert trace.peak_saved_bytes > 0


def test_trace_on_a_gpu_marks_actions_with_cuda_events_read_after_the_iteration(monkeypatch):
    """On CUDA the host only enqueues: an action is timed by events recorded on the stream, and
    reading them (one sync) waits until someone asks for the actions, after the iteration."""
    clock, synced = [0.0], []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            clock[0] += 1.5
            self.at = clock[0]

        def elapsed_time(self, other):          # milliseconds, as torch's
            return (other.at - self.at) * 1e3

        def synchronize(self):
            synced.append(self.at)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    trace = ExecutionTrace()
    trace.begin(list, [])                       # origin event at 1.5
    for label in ("F0.0", "B0.0"):
        trace.record(label, trace.mark(), trace.mark())
    trace.end()
    assert synced == []
    assert [(a.action, a.start, a.end) for a in trace.actions] == [
        ("F0.0", 1.5, 3.0), ("B0.0", 4.5, 6.0)]
    assert synced == [7.5]                      # the last event, once
    assert trace.busy == 3.0 and trace.makespan == 6.0


def test_forward_only_spans_report_the_training_losses():
    reported = {}
    for forward_only in (False, True):
        inputs, seen = _inputs("seq1f1b", 3, forward_only)
        executor = Executor(inputs)
        seen[:] = [executor]
        reported[forward_only] = [x["lm loss"] for x in executor.run()]
    for train, evaluate in zip(reported[False], reported[True]):
        assert torch.equal(train, evaluate)


def test_micro_batches_out_of_order_give_the_in_order_losses_and_gradients():
    """A schedule may run micro-batch 2 first (the search reorders them as an exact solver does):
    each still gets its own data, the losses come back in micro-batch order and the gradients
    are the in-order run's (up to the order they are summed in)."""
    from seq1f1b.plan.actions import Schedule, parse_action
    results = []
    for order in ("F0.0 B0.0 F1.0 B1.0 F2.0 B2.0", "F2.0 F0.0 B2.0 F1.0 B0.0 B1.0"):
        inputs, seen = _inputs("seq1f1b", 1)
        inputs.schedule = Schedule("ordered", 1, M, 1, 1,
                                   (tuple(parse_action(a) for a in order.split()),))
        executor = Executor(inputs)
        seen[:] = [executor]
        losses = [x["lm loss"] for x in executor.run()]
        grads = [p.grad.clone() for p in inputs.model_chunks[0].parameters()]
        results.append((losses, grads))
    (losses, grads), (reordered, regrads) = results
    assert all(torch.equal(a, b) for a, b in zip(losses, reordered))
    assert len(set(float(x[0]) for x in losses)) == M     # three different micro-batches
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(grads, regrads))
