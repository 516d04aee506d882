"""Walks this rank's program of a plan on its megatron-core model chunks.

One executor runs every schedule of the registry: F = receive the activation (or cut the span out
of the micro-batch on the first stage), run the chunk on the span with its KV context, send; B =
receive the output grad (or scale the span's loss on the last stage; with
`--loss-backward-in-forward` F already back-propagated it through the output layer and B scales
the gradient it kept, runtime/early_loss.py), back-propagate from the output and from this
span's K/V with the dK/dV later spans left, send the input grad. With O actions (the output
layer spread over the ranks, actions.OPS) the last stage's F sends its hidden states on and its B
waits for their gradient, as a middle stage's; O = receive them, run the rank's copy of the
output layer and the loss (megatron_adapter.OutputHead) through the user's forward step on the
span's labels, back-propagate at once at the span's final scale, send the gradient back. The
order is the plan's; the executor adds none of its own, so what the validator and simulator saw
is what runs.
Communication too: `PipelineChannels` issues the communication plan's groups right after the
actions they follow (`seq1f1b.plan.communication`, checked under NCCL's rules).

On a GPU (what the CPU cannot show, so it is written down here):
- **Receives.** A group is issued by the host after its action has been enqueued; ProcessGroupNCCL
  makes its NCCL stream wait for the compute stream at that moment (so the receive buffers, made
  on the compute stream, exist). Before an action that needs a received tensor, `work.wait()`
  without a timeout makes the compute stream wait for the group; the host never blocks and keeps
  enqueueing. Nothing in `run` reads a device value on the host (the loss scale stays a tensor;
  the trace uses CUDA events read after the iteration), so the host can run ahead of the GPU.
- **Sent tensors.** `send` keeps a detached view of the output; with
  `deallocate_pipeline_outputs` the output's `.data` is then swapped for a one-element tensor so
  its graph no longer pins the activation, but the view keeps the storage until the group is
  known to have run (`Work.is_completed()`, asked after every action without blocking;
  ProcessGroupNCCL also keeps the storage alive until its kernel has run, so the caching
  allocator cannot hand it out before the send ran). Backward then calls the autograd engine directly, as
  megatron's `custom_backward` does, to skip the shape check against the swapped `.data`.
- **Context parallelism.** The all-to-alls around each layer's core attention
  (runtime/context_parallel.py) and the last stage's token all-reduce per micro-batch are
  synchronous collectives on megatron's CP communicator: enqueued on its stream after the
  compute issued before them, the compute stream waiting for them. Every CP rank of a stage runs
  this same program, so all of them issue the same collectives in the same order between the
  same p2p groups (tests/distributed/test_p2p_recorded.py replays both communicators together).
- **dK/dV buffers.** The KV cache of a (micro-batch, chunk) and its dK/dV accumulators live on
  the compute stream only: they are written by F(i,j) and read by B(i,j') in program order on
  this rank, never sent, and freed after B(i,0); no cross-stream use, so no event is needed.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.utils import get_attr_wrapped_model

from seq1f1b import platform
from seq1f1b.plan.actions import Action, Schedule, ScheduleError
from seq1f1b.runtime.attention import cached_mask_tensors
from seq1f1b.runtime import tied_output, wgrad_fusion
from seq1f1b.runtime.early_loss import EarlyLoss
from seq1f1b.runtime.grad_sync import GradSync
from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context
from seq1f1b.runtime.loss import MicrobatchLoss, span_scale
from seq1f1b.runtime.p2p import PipelineChannels
from seq1f1b.runtime.span_data import SpanDataSource
from seq1f1b.runtime.trace import ExecutionTrace
from seq1f1b.runtime.wgrad import WeightGradStore, has_split_backward


@dataclass
class StepInputs:
    """Everything one call of a forward-backward function runs with, resolved by the adapter."""

    schedule: Schedule
    spans: Sequence[tuple[int, int]]       # [start, end) of each span of a micro-batch
    rank: int                               # this rank's index in the pipeline group
    pp_group: Optional[dist.ProcessGroup]
    forward_step_func: Callable
    data_iterators: Sequence[Optional[Iterator]]   # one per model chunk
    model_chunks: Sequence[torch.nn.Module]        # one per model chunk of this rank
    config: Any                                     # megatron ModelParallelConfig
    seq_length: int
    micro_batch_size: int
    tp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Optional[dist.ProcessGroup] = None    # megatron's context-parallel group
    forward_only: bool = False
    collect_non_loss_data: bool = False
    p2p_timeout_s: float = 600.0
    trace: Optional[ExecutionTrace] = None          # per-action times and bytes, when asked
    loss_backward_in_forward: bool = False          # runtime/early_loss.py


_TIMER_NAMES = {"F": "forward-compute", "B": "backward-compute", "W": "weight-grad-compute",
                "O": "forward-compute"}
"""megatron's level-2 timers (--timing-log-level 2) of each op; a timer includes the action's
wait for its received tensor."""


@contextlib.contextmanager
def _timed(timer) -> Iterator[None]:
    timer.start()
    try:
        yield
    finally:
        timer.stop()


def _backward(roots: list[torch.Tensor], grads: list[Optional[torch.Tensor]],
              deallocated: bool) -> None:
    if deallocated:
        # The output's data was freed after its send (megatron's deallocate_pipeline_outputs):
        # call the engine directly, as megatron's custom_backward does, to skip the shape check.
        torch.autograd.Variable._execution_engine.run_backward(
            tensors=tuple(roots), grad_tensors=tuple(grads), keep_graph=False,
            create_graph=False, inputs=tuple(), allow_unreachable=True, accumulate_grad=True)
    else:
        torch.autograd.backward(roots, grad_tensors=grads)


class Executor:
    """Runs one iteration of `inputs.schedule` on this rank; `run()` returns megatron's data."""

    def __init__(self, inputs: StepInputs) -> None:
        self.inp = inputs
        sched = inputs.schedule
        if len(inputs.model_chunks) != sched.chunks:
            raise ScheduleError(f"the schedule has {sched.chunks} model chunks per rank, the model "
                                f"has {len(inputs.model_chunks)}")
        if len(inputs.spans) != sched.splits:
            raise ScheduleError(f"{len(inputs.spans)} span boundaries for {sched.splits} splits")
        # The output layer as a module of its own on every rank (OutputHead), when the model was
        # built for a schedule with O actions; without O's (forward only) the last stage runs it.
        self.head = _output_head(inputs.model_chunks[-1])
        if sched.spread_output and self.head is None:
            raise ScheduleError(f"schedule {sched.name!r} runs the output layer as O actions on "
                                "any pipeline rank: build the model with spread_output=True")
        if self.head is not None and inputs.loss_backward_in_forward:
            raise ScheduleError("--loss-backward-in-forward: with the output layer spread over "
                                "the ranks an O action already runs its backward at once")
        program = sched.programs[inputs.rank]
        if inputs.forward_only:
            program = tuple(a for a in program if a.op == "F")
            programs = tuple(tuple(a for a in p if a.op == "F") for p in sched.programs)
            sched = Schedule(sched.name, sched.pp, sched.microbatches, sched.splits, sched.chunks,
                             programs, sched.placement)
        self.schedule = sched
        self.program = program
        self.head_in_forward = self.head is not None and not sched.spread_output
        config = inputs.config
        self.config = config
        self.device = platform.compute_device()
        dtype = config.pipeline_dtype or (torch.bfloat16 if config.bf16 else
                                          torch.float16 if config.fp16 else torch.float32)
        self.dtype = dtype
        self.channels = PipelineChannels(sched, inputs.rank, inputs.pp_group, self._shape_of,
                                         dtype, self.device, inputs.p2p_timeout_s)
        self.sources = [SpanDataSource(it, inputs.seq_length, inputs.cp_rank, inputs.cp_size)
                        for it in inputs.data_iterators]
        self._reads_left = self._data_reads()
        self.reports: dict[tuple[int, int], tuple] = {}   # O's (num_tokens, reduced) by unit
        self._loss_tokens: dict[int, torch.Tensor] = {}
        self.caches: dict[tuple[int, int], MicrobatchKVCache] = {}
        self.saved: dict[tuple[int, int, int], tuple[Optional[torch.Tensor], Any]] = {}
        self.losses: dict[int, MicrobatchLoss] = {}
        self.forward_data_store: dict[int, Any] = {}   # by micro-batch: returned in its order
        self.total_num_tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        self.grad_sync = GradSync(program, inputs.model_chunks, config)
        self.deallocate = bool(config.deallocate_pipeline_outputs)
        # Weight-gradient GEMMs that B defers to W (schedules that split backward): the model
        # must be built with split-backward linears (build_model_chunk(split_backward=True)).
        self.wgrad = WeightGradStore()
        # The output layer's backward at F (--loss-backward-in-forward), per last-stage chunk.
        self.early: dict[int, EarlyLoss] = {}
        if inputs.loss_backward_in_forward and not inputs.forward_only:
            last = sched.num_stages - 1
            owner, chunk = sched.owner_of(last)
            if owner == inputs.rank:
                self.early[chunk] = EarlyLoss(inputs.model_chunks[chunk])
        if sched.split_backward and not any(has_split_backward(m) for m in inputs.model_chunks):
            raise ScheduleError(f"--pipeline-schedule {sched.name} defers weight gradients to W "
                                "actions: build the model with split_backward=True")

    # -- helpers ---------------------------------------------------------------------------------
    def _data_reads(self) -> dict[tuple[int, int], int]:
        """(chunk, micro-batch) -> how many span reads of its data this rank's program makes:
        one per F, one more per run of the output layer (an O, or the last stage's F that runs
        it itself), which reads the last chunk's data; a micro-batch is dropped at its last."""
        reads: dict[tuple[int, int], int] = {}
        head_chunk = self.schedule.chunks - 1
        for action in self.program:
            chunk = head_chunk if action.op == "O" else action.chunk
            if action.op in ("F", "O"):
                reads[(chunk, action.microbatch)] = reads.get((chunk, action.microbatch), 0) + 1
            if action.op == "F" and self.head_in_forward and self._is_last_stage(action):
                reads[(chunk, action.microbatch)] += 1
        return reads

    def _read(self, chunk: int, microbatch: int, start: int, end: int) -> Optional[Iterator]:
        """Span [start, end) of the micro-batch from chunk `chunk`'s data, dropped at its last
        read."""
        key = (chunk, microbatch)
        self._reads_left[key] -= 1
        return self.sources[chunk].span_iterator(microbatch, start, end,
                                                 self._reads_left[key] == 0)

    def _loss_here(self, action: Action) -> bool:
        """Whether F `action` ends in the loss: the last stage's, unless O actions run it."""
        return self._is_last_stage(action) and not self.schedule.spread_output

    def _shape_of(self, span: int) -> tuple[int, int, int]:
        start, end = self.inp.spans[span]
        length = (end - start) // self.inp.cp_size
        if self.config.sequence_parallel:
            length //= self.inp.tp_size
        return (length, self.inp.micro_batch_size, self.config.hidden_size)

    def _stage(self, action: Action) -> int:
        return self.schedule.stage_of(self.inp.rank, action.chunk)

    def _is_last_stage(self, action: Action) -> bool:
        return self._stage(action) == self.schedule.num_stages - 1

    def _autocast(self):
        if self.config.enable_autocast:
            return torch.autocast("cuda" if torch.cuda.is_available() else "cpu",
                                  dtype=self.config.autocast_dtype)
        return contextlib.nullcontext()

    def timers(self, name: str):
        """megatron's timer `name` at log level 2 around a block (nothing without config.timers;
        megatron's own dummy below the run's --timing-log-level)."""
        timers = getattr(self.config, "timers", None)
        if timers is None:
            return contextlib.nullcontext()
        return _timed(timers(name, log_level=2))

    # -- actions ---------------------------------------------------------------------------------
    def forward(self, action: Action) -> None:
        i, j, c = action.microbatch, action.span, action.chunk
        start, end = self.inp.spans[j]
        last_span = j == self.schedule.splits - 1
        if j == 0:
            self.caches[(i, c)] = MicrobatchKVCache(
                i, self.inp.spans[-1][1], c, requires_grad=not self.inp.forward_only)
        cache = self.caches[(i, c)]
        input_tensor = self.channels.receive(action)
        if input_tensor is not None and not self.inp.forward_only:
            input_tensor.requires_grad_()
        model = self.inp.model_chunks[c]
        _set_input_tensor(model, input_tensor)
        data = self._read(c, i, start, end)
        if j == 0:      # flash's varlen layout reads the document ids here, with no host sync
            cache.host_document_ids = self.sources[c].host_document_ids(i)
        early = self.early.get(c) if self._is_last_stage(action) else None
        with early.forward(i, j) if early is not None else contextlib.nullcontext() as cut:
            with span_context(SpanContext(i, j, start, end, cache)), self._autocast():
                output, loss_func = self.inp.forward_step_func(data, model)
            if self.head is not None and self._is_last_stage(action):
                output = output.to(self.dtype)      # megatron's Float16Module made it fp32
                if self.head_in_forward:
                    output, loss_func = self._head_forward(i, j, output)
            if self._loss_here(action):
                output = self._record_loss(action, output, loss_func)
                if early is not None:
                    self._backward_loss_now(output)
            else:
                self.channels.send(action, output)
        if early is not None:
            output = cut["hidden"]
            if self.deallocate:     # its gradient is kept; B needs only its graph
                output.data = torch.empty((1,), device=output.device, dtype=output.dtype)
        if self.inp.forward_only:
            if last_span:
                del self.caches[(i, c)]
            return
        if not self._loss_here(action) and self.deallocate:
            output.data = torch.empty((1,), device=output.device, dtype=output.dtype)
        self.saved[action.key()] = (input_tensor, None if early is not None else output)

    def _head_forward(self, microbatch: int, span: int, hidden: torch.Tensor) -> tuple:
        """The output layer and loss of one span on `hidden` (OutputHead): the user's forward
        step on the head reads the span's labels from the last chunk's data; a half-precision
        loss becomes fp32, as megatron's Float16Module returns it from the last stage."""
        start, end = self.inp.spans[span]
        self.head.set_input_tensor(hidden)
        data = self._read(self.schedule.chunks - 1, microbatch, start, end)
        with self._autocast():
            output, loss_func = self.inp.forward_step_func(data, self.head)
        if isinstance(output, torch.Tensor) and output.dtype in (torch.float16, torch.bfloat16):
            output = output.float()
        return output, loss_func

    def output(self, action: Action) -> None:
        """O(i,j): the output layer and the loss of span j, forward and backward at once, on the
        last stage's hidden states, at the span's final scale (a micro-batch's scale needs only
        its loss tokens, which the data gives: SpanDataSource.loss_tokens); the input gradient
        goes back to the last stage, the weights' gradients into this rank's copy's (summed over
        the pipeline ranks after the iteration: reduce_output_grads)."""
        i, j = action.microbatch, action.span
        hidden = self.channels.receive(action)
        leaf = hidden.detach().requires_grad_()
        if i not in self._loss_tokens and not getattr(self.config, "calculate_per_token_loss",
                                                       False):
            self._loss_tokens[i] = self.sources[self.schedule.chunks - 1].loss_tokens(i)
        output, loss_func = self._head_forward(i, j, leaf)
        result = loss_func(output)
        if len(result) not in (2, 3):
            raise ValueError("loss_func must return (loss, reduced) or (loss, num_tokens, "
                             f"reduced); got {len(result)} values")
        self.reports[(i, j)] = _map_tensors(result[1:], torch.Tensor.detach)
        loss = result[0] * self._output_scale(i, j, len(result) == 3, result[0])
        if self.config.grad_scale_func is not None:
            loss = self.config.grad_scale_func(loss)
        torch.autograd.backward([loss], grad_tensors=[torch.ones_like(loss)])
        self.channels.send(action, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))

    def _output_scale(self, microbatch: int, span: int, per_token_form: bool,
                      loss: torch.Tensor) -> Any:
        """d(iteration loss)/d(span loss), as the last stage's MicrobatchLoss gives it."""
        start, end = self.inp.spans[span]
        per_token_loss = getattr(self.config, "calculate_per_token_loss", False)
        tokens = self._loss_tokens.get(microbatch)
        return span_scale(per_token_form, (end - start) / self.inp.spans[-1][1],
                          self.schedule.microbatches, per_token_loss, self.inp.cp_size, loss,
                          tokens.to(self.device) if tokens is not None else None)

    def _backward_loss_now(self, loss: torch.Tensor) -> None:
        """F's backward of the span's loss through the output layer alone, at unit scale (times
        the fp16 loss scale): early_loss.py."""
        if self.config.grad_scale_func is not None:
            loss = self.config.grad_scale_func(loss)
        torch.autograd.backward([loss], grad_tensors=[torch.ones_like(loss)])

    def _record_loss(self, action: Action, output: Any, loss_func: Optional[Callable]) -> Any:
        i, j = action.microbatch, action.span
        lengths = [e - s for s, e in self.inp.spans]
        if loss_func is None or self.inp.collect_non_loss_data:
            record = self.losses.setdefault(i, MicrobatchLoss(lengths))
            value = output if loss_func is None else loss_func(output, non_loss_data=True)
            record.reduced[j] = value
            if len(record.reduced) == len(lengths):
                spans = [record.reduced[s] for s in range(len(lengths))]
                self.forward_data_store[i] = spans[0] if len(spans) == 1 else spans
                del self.losses[i]
            return output
        record = self.losses.setdefault(i, MicrobatchLoss(lengths))
        record.add(j, loss_func(output))
        if record.complete and record.per_token_form and self.inp.cp_size > 1 \
                and not self.inp.forward_only \
                and not getattr(self.config, "calculate_per_token_loss", False):
            record.reduce_tokens(self.inp.cp_group)
        if record.complete:
            self.total_num_tokens += record.total_tokens().to(self.device)
            self.forward_data_store[i] = record.combined_reduced()
            if self.inp.forward_only:
                del self.losses[i]
        return record.losses[j]

    def backward(self, action: Action) -> None:
        i, j, c = action.microbatch, action.span, action.chunk
        input_tensor, output = self.saved.pop(action.key())
        cache = self.caches[(i, c)]
        if self._loss_here(action):
            record = self.losses[i]
            scale = record.backward_scale(j, self.schedule.microbatches,
                                          getattr(self.config, "calculate_per_token_loss", False),
                                          self.inp.cp_size)
            if c in self.early:
                output, grad = self.early[c].take(i, j, scale)
                deallocated = self.deallocate
            else:
                output = torch.as_tensor(output) * scale
                if self.config.grad_scale_func is not None:
                    output = self.config.grad_scale_func(output)
                grad = torch.ones_like(output)
                deallocated = False
            if j == 0:
                del self.losses[i]
        else:
            grad = self.channels.receive(action)
            deallocated = self.deallocate
        if isinstance(output, torch.Tensor) and output.requires_grad:
            # Inside the span's context: a recomputed forward (activation recompute) must find
            # the same span, offsets and KV cache as the original one.
            start, end = self.inp.spans[j]
            with span_context(SpanContext(i, j, start, end, cache)), self.wgrad.begin(
                    action.key()) if self.schedule.split_backward else contextlib.nullcontext():
                _backward([output], [grad], deallocated)
        if j == 0:
            del self.caches[(i, c)]
        if input_tensor is not None:
            input_grad = input_tensor.grad
            if input_grad is None:
                input_grad = torch.zeros_like(input_tensor)
            self.channels.send(action, input_grad)

    def weight_grad(self, action: Action) -> None:
        """W(i,j): the weight-gradient GEMMs that B(i,j) deferred."""
        self.wgrad.flush(action.key())

    # -- the iteration ---------------------------------------------------------------------------
    def run(self) -> list:
        """Run the whole program; returns one entry per micro-batch on the last stage, else []."""
        if not self.inp.forward_only:
            self.grad_sync.start()
        trace = self.inp.trace
        if trace is not None:
            trace.begin(self.held_tensors,
                        [p for m in self.inp.model_chunks for p in m.parameters()],
                        span_bounds=tuple(self.inp.spans))
        show_chunk = self.schedule.chunks > 1
        run_action = {"F": self.forward, "B": self.backward, "W": self.weight_grad,
                      "O": self.output}
        sync = not self.inp.forward_only
        timed = getattr(self.config, "timers", None) is not None
        self.channels.start()
        for n, action in enumerate(self.program):
            if sync:
                self.grad_sync.before(n)
            # The label, the profiler range and megatron's timers only when someone reads them:
            # each costs torch calls that every span would pay.
            profiled = torch.autograd._profiler_enabled()
            label = action.format(show_chunk) if trace is not None or profiled else None
            start = trace.mark() if trace is not None else None
            cpu = time.thread_time() if trace is not None else 0.0
            if profiled or timed:
                with torch.profiler.record_function(label) if profiled else \
                        contextlib.nullcontext(), self.timers(_TIMER_NAMES[action.op]):
                    run_action[action.op](action)
            else:
                run_action[action.op](action)
            if trace is not None:
                trace.record(label, start, trace.mark(), time.thread_time() - cpu)
            self.channels.after(action)
        self.channels.finish()
        if trace is not None:
            trace.end()
        if not self.inp.forward_only:
            self.grad_sync.finish()
            if self.schedule.spread_output:     # every copy counts in its bucket's reduction
                wgrad_fusion.report_ready(list(self.head.parameters()))
        early = sum(chunk.pending() for chunk in self.early.values())
        if self.saved or self.caches or self.losses or self.wgrad.pending() or early:
            raise RuntimeError(f"pipeline rank {self.inp.rank}: {len(self.saved)} activations, "
                               f"{len(self.caches)} KV caches, {len(self.wgrad.pending())} "
                               f"deferred weight gradients and {early} micro-batches' output-"
                               "layer gradients left after the iteration")
        if self.schedule.spread_output or not self._holds_last_stage():
            return []
        return [self.forward_data_store[i] for i in sorted(self.forward_data_store)]

    def gather_output_reports(self) -> list:
        """With O actions, after `run`: every O's reported loss gathered to the last stage's
        rank (one all_gather_object over the pipeline group, the only host sync; outside the
        hot loop), combined per micro-batch as the last stage combines its spans; returns
        megatron's loss entries there (and sets `total_num_tokens`), [] elsewhere."""
        local = {unit: _map_tensors(values, torch.Tensor.cpu)
                 for unit, values in self.reports.items()}
        gathered: list = [None] * dist.get_world_size(self.inp.pp_group)
        dist.all_gather_object(gathered, local, group=self.inp.pp_group)
        self.reports.clear()
        self._loss_tokens.clear()
        if not self._holds_last_stage():
            return []
        units = {unit: values for part in gathered for unit, values in part.items()}
        lengths = [end - start for start, end in self.inp.spans]
        store = []
        zero = torch.zeros((), device=self.device)
        for i in range(self.schedule.microbatches):
            record = MicrobatchLoss(lengths)
            for j in range(self.schedule.splits):
                record.add(j, (zero, *_map_tensors(units[(i, j)],
                                                   lambda t: t.to(self.device))))
            self.total_num_tokens += record.total_tokens().to(self.device)
            store.append(record.combined_reduced())
        return store

    def reduce_output_grads(self) -> None:
        """Sum the output layer's gradient copies over the pipeline group (after the
        data-parallel reduction: each copy holds what its rank's O's added, averaged over DP),
        so every rank steps its copy with the whole gradient; a copy of a tied embedding is
        summed with the embedding's gradient, by tied_output.sum_gradients)."""
        for param in self.head.parameters():
            if getattr(param, tied_output.TIED, False):
                continue
            grad = getattr(param, "main_grad", None)
            if grad is None:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
            dist.all_reduce(grad, group=self.inp.pp_group)

    def held_tensors(self) -> list[torch.Tensor]:
        """What the executor holds outside autograd's saved tensors: stage outputs, output grads
        deferred to W, the KV caches with their derived masks, the shape-keyed mask caches of
        the attention kernels, and what the p2p channels still hold (sends not yet run,
        receives not yet taken); the saved-tensor meter adds them."""
        outputs = [out for _, out in self.saved.values() if isinstance(out, torch.Tensor)]
        caches = [t for cache in self.caches.values() for t in cache.tensors()]
        early = [t for chunk in self.early.values() for t in chunk.held_tensors()]
        return (outputs + caches + self.wgrad.held_tensors() + cached_mask_tensors()
                + self.channels.held_tensors() + early)

    def _holds_last_stage(self) -> bool:
        last = self.schedule.num_stages - 1
        return self.schedule.owner_of(last)[0] == self.inp.rank


def _map_tensors(value: Any, func: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` (a loss function's reported values: tensors in dicts, lists, tuples) with `func`
    applied to each tensor."""
    if isinstance(value, torch.Tensor):
        return func(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, func) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, func) for item in value)
    return value


def _output_head(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The `output_head` of a (wrapped) model chunk (megatron_adapter.OutputHead), or None."""
    while not hasattr(model, "output_head"):
        if not hasattr(model, "module"):
            return None
        model = model.module
    return model.output_head


def _set_input_tensor(model: torch.nn.Module, tensor: Optional[torch.Tensor]) -> None:
    """Megatron's `set_input_tensor`, found through any DDP / Float16Module wrappers."""
    get_attr_wrapped_model(model, "set_input_tensor")([tensor])
