"""Forward-backward functions with megatron-core's signature, one per registry name.

`get_forward_backward_func(name, ...)` returns what `megatron.core.pipeline_parallel.
get_forward_backward_func()` returns for stock schedules: a function taking megatron 0.16's whole
keyword set and returning one loss entry per micro-batch on the last stage and [] elsewhere. Our
names run the plan executor; `megatron-1f1b` and `megatron-interleaved-1f1b` are megatron's own,
unmodified functions, so any run can be compared with the engine it extends.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.utils import get_model_config

from seq1f1b import platform
from seq1f1b.plan import partition as span_partition
from seq1f1b.plan import registry
from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.budget import ScheduleBudget
from seq1f1b.plan.context_parallel import span_alignment
from seq1f1b.plan.costs import ModelConfig
from seq1f1b.runtime import tied_output
from seq1f1b.runtime.executor import Executor, StepInputs
from seq1f1b.runtime.trace import ExecutionTrace

MEGATRON_SCHEDULES = ("megatron-1f1b", "megatron-interleaved-1f1b")


@dataclass(frozen=True)
class SpanSettings:
    """How micro-batches are cut into spans (the --seq1f1b-* flags)."""

    splits: int = 1
    partition: str = "even"                       # even | compute | explicit
    span_lengths: Optional[tuple[int, ...]] = None
    align: int = 1                                # every span a multiple of it (and of CP, TP)
    p2p_timeout_s: float = 600.0
    trace: Optional[ExecutionTrace] = field(default=None, compare=False, hash=False)
    budget: Optional[ScheduleBudget] = None       # a searched schedule's costs and memory cap
    loss_backward_in_forward: bool = False        # the output layer's backward at F (early_loss)
    # The model a compute cut balances the FLOPs of. None: the chunks' TransformerConfig, which
    # has no vocabulary (the cost model then takes 50257); the trainer gives its padded one, so
    # its cut is the one its log line, its estimate and a searched schedule's budget name.
    cost_model: Optional[ModelConfig] = None


def schedule_names() -> list[str]:
    """Every name `get_forward_backward_func` accepts: the registry's plus megatron's own."""
    return registry.names() + list(MEGATRON_SCHEDULES)


def splits_backward(name: str) -> bool:
    """Whether schedule `name` defers weight gradients to W actions: its model chunks must then
    be built with split-backward linears (`build_model_chunk(split_backward=True)`)."""
    return name not in MEGATRON_SCHEDULES and registry.get(name).splits_backward


def placement_of(name: str, pp: Optional[int] = None, microbatches: int = 1, splits: int = 1,
                 chunks: int = 1, budget: Optional[ScheduleBudget] = None) -> str:
    """How schedule `name` maps (rank, chunk) to virtual stages (actions.PLACEMENTS); megatron's
    own schedules loop. A searched schedule chooses its placement: it is built (P, m, k, V and
    `budget` are then needed; the registry keeps the search) and its choice returned."""
    if name in MEGATRON_SCHEDULES:
        return "loop"
    info = registry.get(name)
    if not info.searched:
        return info.placement
    if pp is None:
        raise ValueError(f"{name} chooses its placement: give the shape it is searched for")
    return registry.build(name, pp, microbatches, splits, chunks, budget=budget).placement


def _megatron_function(name: str) -> Callable:
    def run(**kwargs):
        pp_group = _pp_group(kwargs.get("p2p_communicator"), kwargs.get("pg_collection"))
        if _cp_group(kwargs.get("pg_collection")).size() > 1:
            raise ValueError(f"--pipeline-schedule {name} with context parallelism needs "
                             "megatron's own CP attention (Transformer Engine) and data "
                             "sharding; span schedules run it (--cp-comm-type a2a)")
        if name == "megatron-interleaved-1f1b":
            return megatron_schedules.forward_backward_pipelining_with_interleaving(**kwargs)
        if pp_group.size() == 1:
            for key in ("p2p_communicator", "adjust_tensor_shapes_fn"):
                kwargs.pop(key, None)
            return megatron_schedules.forward_backward_no_pipelining(**kwargs)
        return megatron_schedules.forward_backward_pipelining_without_interleaving(**kwargs)

    run.__name__ = name.replace("-", "_")
    return run


def _pp_group(p2p_communicator, pg_collection) -> dist.ProcessGroup:
    if p2p_communicator is not None:
        return p2p_communicator.pp_group
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        return pg_collection.pp
    return parallel_state.get_pipeline_model_parallel_group()


def _group_size(pg_collection, attr: str, fallback: Callable[[], int]) -> int:
    group = getattr(pg_collection, attr, None) if pg_collection is not None else None
    return group.size() if group is not None else fallback()


def _cp_group(pg_collection) -> dist.ProcessGroup:
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    return group if group is not None else parallel_state.get_context_parallel_group()


def check_context_parallel_spans(lengths: Sequence[int], cp: int, tp: int,
                                 sequence_parallel: bool) -> None:
    """Every span must split evenly over the CP ranks (and, under sequence parallelism, each
    rank's part over TP); raises ValueError naming the span lengths."""
    unit = span_alignment(cp, tp, sequence_parallel)
    if any(length % unit for length in lengths):
        what = f"--context-parallel-size {cp}" + (f" x TP {tp} (sequence parallel)"
                                                  if sequence_parallel and tp > 1 else "")
        raise ValueError(f"{what} must divide every span length, got "
                         f"{' '.join(map(str, lengths))}")


@functools.lru_cache(maxsize=64)
def _spans(settings: SpanSettings, seq_length: int, config_model: Optional[ModelConfig], tp: int,
           sequence_parallel: bool, cp: int = 1) -> tuple[tuple[int, int], ...]:
    """The span bounds, a compute cut balanced on `settings.cost_model` (else `config_model`,
    the chunks' config), every span a multiple of `settings.align`; under context parallelism
    also of C (of C x TP under sequence parallelism: each CP rank's part is then cut over
    TP)."""
    if cp > 1 and settings.span_lengths is not None:
        check_context_parallel_spans(settings.span_lengths, cp, tp, sequence_parallel)
    lengths = span_partition.partition(
        seq_length, settings.splits, settings.partition,
        model=settings.cost_model or config_model, tp=tp,
        sequence_parallel=sequence_parallel, lengths=settings.span_lengths,
        align=span_alignment(cp, tp, sequence_parallel, settings.align))
    return tuple(span_partition.span_bounds(lengths))


@functools.lru_cache(maxsize=64)
def _schedule(name: str, pp: int, microbatches: int, splits: int, chunks: int,
              budget: Optional[ScheduleBudget]):
    return registry.build(name, pp, microbatches, splits, chunks, budget=budget)


def _cost_model(config) -> Optional[ModelConfig]:
    """The cost-model shape of megatron's TransformerConfig (None for toy configs without one)."""
    try:
        return ModelConfig.of_transformer_config(config)
    except (AttributeError, TypeError, ValueError):
        return None


def pipeline_sequence_length(chunked: bool, splits: int, seq_length: int,
                             decoder_seq_length: Optional[int]) -> int:
    """The length L of the sequence that flows between stages: the p2p tensors are
    [L / cp (/ tp under sequence parallelism), b, h], and the spans cut [0, L).

    megatron-core 0.16.1 reads `decoder_seq_length` in one place, `get_tensor_shapes` of
    `forward_backward_pipelining_without_interleaving`: when given, it replaces `seq_length` as
    the length of every p2p tensor, so later stages see a [decoder_seq_length, b, h] input (e.g. a
    language model fed image embeddings as well as text). The interleaved function sizes its
    tensors with `seq_length` and ignores `decoder_seq_length`, as does the no-pipelining one. We
    follow that: non-chunked schedules take L = decoder_seq_length when given, chunked ones
    L = seq_length.

    Span boundaries are positions of that flowing sequence. At k=1 the single span is [0, L) and
    the first stage's forward_step gets the micro-batch whole (slicing [0, L) cuts nothing), which
    is megatron exactly. At k>1 with L != seq_length the data (seq_length tokens) and the flowing
    sequence (L positions) have no mapping the schedule knows, so a span of the data cannot be cut:
    refused."""
    if chunked or decoder_seq_length is None or decoder_seq_length == seq_length:
        return seq_length
    if splits > 1:
        raise ValueError(f"decoder_seq_length={decoder_seq_length} differs from seq_length="
                         f"{seq_length}: spans cannot cut it, use --seq1f1b-splits 1")
    return decoder_seq_length


def _as_iterator(data: Any) -> Any:
    """Megatron hands data_iterator to forward_step_func untouched; we read one item per
    micro-batch to cut its spans, so a plain iterable (megatron's tests pass a range) becomes an
    iterator. Anything with __next__ stays as it is: megatron's RerunDataIterator has no
    __iter__."""
    return data if data is None or hasattr(data, "__next__") else iter(data)


def _check_interleaving_like_megatron(num_microbatches: int, pp: int, config) -> None:
    """Refuse what megatron's interleaved schedule refuses, with the exception type it uses."""
    group = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp
    if group != pp:
        raise ValueError(f"microbatch_group_size_per_vp_stage={group}: the interleaved plan "
                         f"groups micro-batches by the pipeline size {pp}")
    if group > num_microbatches:
        raise ValueError(f"The number of microbatches ({num_microbatches}) must be at least the "
                         f"pipeline parallel size ({pp}) for an interleaved schedule")
    remainder = num_microbatches % group
    if 0 < remainder < pp:
        raise RuntimeError(f"The number of microbatches ({num_microbatches}) leaves a final group "
                           f"of {remainder}, smaller than the pipeline parallel size ({pp})")


def get_forward_backward_func(name: str = "seq1f1b",
                              settings: SpanSettings = SpanSettings()) -> Callable:
    """The forward-backward function for schedule `name` (megatron's keyword signature)."""
    if name in MEGATRON_SCHEDULES:
        return _megatron_function(name)
    info = registry.get(name)

    def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int,
                         seq_length: int, micro_batch_size: int,
                         decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                         collect_non_loss_data: bool = False, first_val_step=None,
                         adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
                         force_all_reduce: Optional[bool] = False) -> list:
        chunks: Sequence = model if isinstance(model, list) else [model]
        iterators = [_as_iterator(it) for it in (data_iterator if isinstance(data_iterator, list)
                                                 else [data_iterator] * len(chunks))]
        config = get_model_config(chunks[0])
        if adjust_tensor_shapes_fn is not None:
            raise ValueError("adjust_tensor_shapes_fn: span shapes come from the plan; "
                             f"schedule {name!r} cannot adjust them")
        length = pipeline_sequence_length(len(chunks) > 1, settings.splits, seq_length,
                                          decoder_seq_length)
        pp_group = _pp_group(p2p_communicator, pg_collection)
        pp = pp_group.size()
        tp = _group_size(pg_collection, "tp", parallel_state.get_tensor_model_parallel_world_size)
        cp_group = _cp_group(pg_collection)
        cp = cp_group.size()
        if info.chunked:
            if not isinstance(model, list) or len(model) < 2:
                raise AssertionError("interleaved pipeline parallelism expected model chunking")
            if info.placement == "loop":    # megatron's interleaving rules; a V has no groups
                _check_interleaving_like_megatron(num_microbatches, pp, config)
        spans = _spans(settings, length, _cost_model(config), tp,
                       bool(config.sequence_parallel), cp)
        schedule = _schedule(name, pp, num_microbatches, settings.splits, len(chunks),
                             settings.budget)
        executor = Executor(StepInputs(
            schedule=schedule, spans=spans, rank=pp_group.rank(), pp_group=pp_group,
            forward_step_func=forward_step_func, data_iterators=iterators, model_chunks=chunks,
            config=config, seq_length=length, micro_batch_size=micro_batch_size,
            tp_size=tp, cp_size=cp, cp_rank=cp_group.rank(), cp_group=cp_group,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data, p2p_timeout_s=settings.p2p_timeout_s,
            trace=settings.trace, loss_backward_in_forward=settings.loss_backward_in_forward))
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(
                barrier=config.barrier_with_L1_time)
        with platform.host_sync_forbidden():   # strict mode: no host sync in the hot loop
            store = executor.run()
        if executor.schedule.spread_output:    # the losses O actions computed, to the last rank
            store = executor.gather_output_reports()
        if config.finalize_model_grads_func is not None and not forward_only:
            config.finalize_model_grads_func(
                list(chunks),
                executor.total_num_tokens if getattr(config, "calculate_per_token_loss", False)
                else None,
                pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        if executor.schedule.spread_output:
            executor.reduce_output_grads()
        if not forward_only:    # a tied embedding's copies megatron could not tie
            tied_output.sum_gradients(chunks, pp_group)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return store

    forward_backward.__name__ = f"forward_backward_{name.replace('-', '_')}"
    return forward_backward
