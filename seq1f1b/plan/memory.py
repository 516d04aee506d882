"""Per-GPU memory of a training setup, stage by stage, and whether it fits a device.

Every byte comes from costs.py (parameters, activations, K/V, logits, backward workspace) and the
moment of the peak from the simulator: a rank's activations, K/V cache and logits are summed over
the spans it holds at once, replayed from its program (`simulate.RankReport.held_at_peak`), so a
schedule's memory is read off the same plan that runs. What the estimate counts, per GPU:

- parameters in the training precision, plus the word embedding on the first stage and the
  final norm and untied output layer on the last (vocabulary padded as megatron pads it);
- gradients: fp32 (megatron accumulates bf16 training's gradients in fp32 buffers);
- optimizer states of Adam: fp32 master weights + two moments (12 bytes per parameter in bf16,
  8 in fp32 training where the parameters are the master copy), divided over the data-parallel
  ranks by the distributed optimizer (both figures are reported);
- activations: Korthikanti et al.'s per-layer bytes with flash attention, split by TP (and by SP
  where sequence parallelism shards them), no dropout masks (dropout 0, as the paper); with
  activation recompute (Megatron's --recompute-* flags), what each model chunk keeps under it
  (costs.chunk_activation_bytes: selective drops the softmax statistics, full keeps each
  group's input);
- the K/V cache of the micro-batches in flight, each the whole sequence's from its first span's
  forward to its last backward (the runtime's one buffer per micro-batch), and its dK/dV
  accumulators (fp32 whatever the precision) from its first backward on; on the last stage
  ("logits") the loss's fp32 softmax and the inputs of the final norm and the output layer, or
  with the loss's backward at F (`loss_backward_in_forward`, runtime/early_loss.py) the final
  norm's input, the output layer's input gradient and each micro-batch's fp32 output-weight
  gradient; with the output layer spread over the ranks (a schedule with O actions,
  actions.OPS) every rank holds the output layer's weights and, while an O runs, its softmax,
  input and input gradient, and the last stage keeps only the final norm's input;
- a backward workspace (costs.backward_workspace_bytes; with full recompute it includes the
  recomputed group's activations) and a fixed framework overhead (`FRAMEWORK_OVERHEAD_GIB`);
- under context parallelism (`cp` = C): activations, logits and workspace of span / C tokens, the
  rank's share of the K/V cache (plan/context_parallel.py), the send and receive buffers of one
  layer's all-to-alls in the workspace, and the distributed optimizer sharded over DP x CP.
Not counted: the pipeline's stashed stage outputs (megatron deallocates them after the send),
p2p buffers (the runtime holds at most about two span messages of s*b*h per rank at a time, an
output awaiting its send and a receive posted ahead: tests/unit/test_p2p_held.py; 128 MiB at 7B,
32K, k=4, bf16; the meter counts them), fragmentation beyond the fixed overhead.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Callable, Optional, Sequence

from seq1f1b.plan import registry
from seq1f1b.plan.actions import Schedule, ScheduleError
from seq1f1b.plan.budget import (NOMINAL_FLOPS_PER_SECOND, MemoryCap, model_budget,
                                 with_output_spread)
from seq1f1b.plan.context_parallel import all_to_all_bytes, check_heads
from seq1f1b.plan.costs import (ModelConfig, Recompute, backward_workspace_bytes,
                                padded_vocab_size, recomputed_activation_bytes, stage_parameters)
from seq1f1b.plan.partition import partition
from seq1f1b.plan.simulate import RankReport, SpanCosts, layers_per_stage, model_costs, simulate
from seq1f1b.plan.stage_layers import StageLayers

GIB = 2 ** 30

FRAMEWORK_OVERHEAD_GIB = 1.5
"""Fixed per-GPU overhead: the CUDA context and kernel images (~0.5 GiB, outside torch's
allocator but on the device) and cuBLAS/NCCL workspaces with allocator rounding (~1 GiB).
A stated guess, not fitted to any measurement; override with --overhead-gb."""


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each state, and per activation element."""

    name: str
    parameter: int
    gradient: int
    optimizer: int        # Adam: fp32 master copy (16-bit training only) + two fp32 moments
    activation: int


PRECISIONS = {
    "bf16": Precision("bf16", parameter=2, gradient=4, optimizer=12, activation=2),
    "fp32": Precision("fp32", parameter=4, gradient=4, optimizer=8, activation=4),
}

MEGATRON_PLANS = {"megatron-1f1b": "1f1b", "megatron-interleaved-1f1b": "interleaved-1f1b"}
"""megatron-core's own schedules hold what our plans of the same order hold."""


@dataclass(frozen=True)
class TrainingSetup:
    """What the memory of one GPU depends on (the flags of a training run)."""

    model: ModelConfig
    seq_length: int
    schedule: str = "seq1f1b"
    pp: int = 1
    microbatches: int = 1
    splits: int = 1
    chunks: int = 1
    tp: int = 1
    dp: int = 1
    cp: int = 1                 # context parallelism: each span's tokens over C ranks (a2a)
    micro_batch_size: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    partition: str = "even"
    span_lengths: Optional[tuple[int, ...]] = None
    precision: str = "bf16"
    make_vocab_size_divisible_by: int = 128
    overhead_gib: float = FRAMEWORK_OVERHEAD_GIB
    recompute_granularity: Optional[str] = None     # None | "full" | "selective"
    recompute_method: Optional[str] = None          # "uniform" | "block", full only
    recompute_num_layers: Optional[int] = None      # full only
    schedule_memory_cap: Optional[str] = None       # searched schedules: "0.5x" or bytes
    decoder_first_pipeline_num_layers: Optional[int] = None   # uneven first stage
    decoder_last_pipeline_num_layers: Optional[int] = None    # uneven last stage
    pipeline_model_parallel_layout: Optional[str] = None      # every stage's layers (a layout)
    loss_backward_in_forward: bool = False          # the output layer's backward at F
    spread_output: bool = False     # searched: also with the output layer as O actions

    def __post_init__(self) -> None:
        recompute = self.recompute      # validates; full's defaults (uniform, 1) written back
        if recompute is not None:
            object.__setattr__(self, "recompute_method", recompute.method)
            object.__setattr__(self, "recompute_num_layers", recompute.num_layers)
        if self.precision not in PRECISIONS:
            raise ScheduleError(f"--precision {self.precision!r}: choose from "
                                f"{', '.join(PRECISIONS)}")
        for flag, value in (("--dp", self.dp), ("--micro-batch-size", self.micro_batch_size),
                            ("--make-vocab-size-divisible-by",
                             self.make_vocab_size_divisible_by)):
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{flag} must be a positive integer, got {value!r}")
        if self.overhead_gib < 0:
            raise ScheduleError("--overhead-gb must not be negative")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ScheduleError(f"--tp must be a positive integer, got {self.tp!r}")
        for flag, value in (("--num-attention-heads", self.model.num_attention_heads),
                            ("--num-query-groups", self.model.num_query_groups),
                            ("--ffn-hidden-size", self.model.ffn_hidden_size)):
            if value % self.tp:
                raise ScheduleError(f"{flag} {value} is not divisible by --tp {self.tp}")
        check_heads(self.model.num_attention_heads, self.model.num_query_groups, self.tp,
                    self.cp, flag="--cp")
        if self.loss_backward_in_forward and self.schedule in MEGATRON_PLANS:
            # pretrain_gpt.py refuses it too: megatron-core's schedules run the loss at B
            raise ScheduleError(f"--loss-backward-in-forward: {self.schedule} is megatron-core's "
                                "own schedule, which runs the loss's backward at B; choose one "
                                f"of ours (e.g. {MEGATRON_PLANS[self.schedule]})")
        if self.spread_output and not registry.get(self.plan_name).searched:
            # pretrain_gpt.py's rule: only a search chooses where the output layer runs
            raise ScheduleError(f"--spread-output: {self.schedule} is not searched; "
                                "seq1f1b-zb-auto chooses where the output layer runs")

    def spans(self, model: Optional[ModelConfig] = None) -> list[int]:
        """The span lengths: multiples of C (of C x TP under sequence parallelism), since each
        CP rank holds a contiguous 1/C of every span."""
        align = self.cp * self.tp if self.sequence_parallel else self.cp
        return partition(self.seq_length, self.splits, self.partition, model or self.model,
                         tp=self.tp, sequence_parallel=self.sequence_parallel, align=align,
                         lengths=list(self.span_lengths) if self.span_lengths else None)

    @property
    def recompute(self) -> Optional[Recompute]:
        """The activation recompute the three recompute fields ask for (None: none)."""
        return Recompute.from_flags(self.recompute_granularity, self.recompute_method,
                                    self.recompute_num_layers)

    @property
    def stage_layers(self) -> StageLayers:
        """The uneven first / last stages or the layout (stage_layers.py; all None: even)."""
        return StageLayers.of_flags(self)

    @property
    def plan_name(self) -> str:
        return MEGATRON_PLANS.get(self.schedule, self.schedule)

    @property
    def padded_vocab_size(self) -> int:
        """megatron's padding: a multiple of make_vocab_size_divisible_by x TP."""
        return padded_vocab_size(self.model.vocab_size, self.make_vocab_size_divisible_by, self.tp)


@dataclass
class StageMemory:
    """Bytes one GPU of pipeline rank `rank` holds at its peak."""

    rank: int
    parameters: float                    # count, not bytes
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes_replicated: float    # without the distributed optimizer
    optimizer_bytes_sharded: float       # with it (divided over DP)
    activation_bytes: float
    kv_cache_bytes: float
    logits_bytes: float
    workspace_bytes: float               # includes recomputed_bytes
    recomputed_bytes: float              # full recompute: one group's rebuilt activations
    overhead_bytes: float
    peak_live_spans: int
    distributed_optimizer: bool

    @property
    def optimizer_bytes(self) -> float:
        return (self.optimizer_bytes_sharded if self.distributed_optimizer
                else self.optimizer_bytes_replicated)

    @property
    def held_for_backward_bytes(self) -> float:
        """Activations + K/V + logits held between a span's forward and its backward."""
        return self.activation_bytes + self.kv_cache_bytes + self.logits_bytes

    @property
    def metered_bytes(self) -> float:
        """What the runtime's saved-tensor meter measures at its peak: what is held for backward
        plus, under full recompute, the group the backward rebuilds (an upper bound: the
        rebuild happens in a backward, when less may be held)."""
        return self.held_for_backward_bytes + self.recomputed_bytes

    @property
    def total_bytes(self) -> float:
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes
                + self.held_for_backward_bytes + self.workspace_bytes + self.overhead_bytes)


@dataclass
class MemoryEstimate:
    setup: TrainingSetup
    span_lengths: list[int]
    stages: list[StageMemory]

    @property
    def peak_bytes(self) -> float:
        return self.peak_stage.total_bytes

    @property
    def peak_stage(self) -> StageMemory:
        """The stage that needs the most memory: the one that decides the verdict."""
        return max(self.stages, key=lambda stage: stage.total_bytes)

    @property
    def allocator_peak_bytes(self) -> float:
        """The peak stage's bytes that go through torch's caching allocator: all but the fixed
        overhead (the CUDA context is outside the allocator)."""
        return self.peak_stage.total_bytes - self.peak_stage.overhead_bytes

    def reserved_peak_bytes(self, reserve_ratio: float = 1.0) -> float:
        """The peak as the caching allocator would reserve it: the allocator's bytes times a
        measured reserved/allocated ratio (calibration.py), plus the fixed overhead."""
        return self.allocator_peak_bytes * reserve_ratio + self.peak_stage.overhead_bytes

    def fits(self, gpu_memory_gib: float, reserve_ratio: float = 1.0) -> bool:
        return self.reserved_peak_bytes(reserve_ratio) <= gpu_memory_gib * GIB

    def held_room(self, gpu_memory_gib: float, reserve_ratio: float = 1.0) -> float:
        """The most held bytes (activations, K/V, logits) every stage may keep and still fit
        `gpu_memory_gib` as `fits` judges it: per stage, the allocator bytes the GPU allows
        minus everything but its held bytes; the least over the stages."""
        return min((gpu_memory_gib * GIB - stage.overhead_bytes) / reserve_ratio
                   - (stage.total_bytes - stage.overhead_bytes - stage.held_for_backward_bytes)
                   for stage in self.stages)

    def largest_fitting_reserve(self, gpu_memory_gib: float) -> float:
        """The reserved/allocated ratio up to which the peak still fits `gpu_memory_gib`."""
        return ((gpu_memory_gib * GIB - self.peak_stage.overhead_bytes)
                / self.allocator_peak_bytes)

    def to_dict(self, gpu_memory_gib: Optional[float] = None, reserve_ratio: float = 1.0) -> dict:
        setup = asdict(self.setup)
        setup["model"] = asdict(self.setup.model)
        out = {"setup": setup, "span_lengths": self.span_lengths,
               "padded_vocab_size": self.setup.padded_vocab_size,
               "stages": [{**{f.name: getattr(s, f.name) for f in fields(s)},
                           "optimizer_bytes": s.optimizer_bytes,
                           "held_for_backward_bytes": s.held_for_backward_bytes,
                           "metered_bytes": s.metered_bytes,
                           "total_bytes": s.total_bytes} for s in self.stages],
               "peak_bytes": self.peak_bytes}
        if gpu_memory_gib is not None:
            out.update(gpu_memory_gib=gpu_memory_gib, reserve_ratio=reserve_ratio,
                       reserved_peak_bytes=self.reserved_peak_bytes(reserve_ratio),
                       oom=not self.fits(gpu_memory_gib, reserve_ratio))
        return out


HeldPeaks = Callable[[Schedule, SpanCosts], Sequence[RankReport]]
"""Each rank's report of what it holds at its peak (rank, held_at_peak, peak_live_spans): the
simulator's, or the same figures found faster (the layout planner's, seq1f1b/plan/tune/held.py)."""


def _simulated_peaks(schedule: Schedule, costs: SpanCosts) -> Sequence[RankReport]:
    return simulate(schedule, costs).ranks


def setup_costs(setup: TrainingSetup, spans: Optional[list[int]] = None
                ) -> Callable[..., SpanCosts]:
    """`costs_of(schedule, whole=False)`: the model's per-action costs of `setup`'s spans (of the
    unsplit sequence when `whole`: a memory cap's reference is stock 1F1B's peak), durations at
    the rate pretrain_gpt.py searches on (budget.NOMINAL_FLOPS_PER_SECOND, so a searched
    schedule is the order the trainer runs), bytes at the setup's precision. `spans`: the
    setup's span lengths when computed already."""
    model = replace(setup.model, vocab_size=setup.padded_vocab_size)
    spans = spans or setup.spans(model)
    bytes_per_element = PRECISIONS[setup.precision].activation

    def costs_of(schedule: Schedule, whole: bool = False, spread: Optional[bool] = None
                 ) -> SpanCosts:
        """`spread`: price the output layer as O actions (default: where `schedule` has
        them)."""
        spread = schedule.spread_output if spread is None else spread
        return model_costs(schedule, model, [setup.seq_length] if whole else spans,
                           flops_per_second=NOMINAL_FLOPS_PER_SECOND, tp=setup.tp,
                           sequence_parallel=setup.sequence_parallel,
                           batch=setup.micro_batch_size, bytes_per_element=bytes_per_element,
                           recompute=setup.recompute, stage_layers=setup.stage_layers,
                           cp=setup.cp,
                           loss_backward_in_forward=setup.loss_backward_in_forward and not whole,
                           spread_output=spread and not whole)

    return costs_of


def plan_schedule(setup: TrainingSetup, costs_of: Optional[Callable[..., SpanCosts]] = None
                  ) -> Schedule:
    """`setup`'s plan as its run builds it: the registry's order, or for a searched schedule
    (seq1f1b-zb-auto) the order searched on the setup's model costs under its
    --schedule-memory-cap (its default cap without one), as pretrain_gpt.py searches it; with
    `spread_output` also with the output layer as O actions, the shorter kept (pretrain_gpt.py
    --spread-output). `costs_of`: `setup_costs(setup)` when made already."""
    cap = MemoryCap.parse(setup.schedule_memory_cap) if setup.schedule_memory_cap else None
    costs_of = costs_of or setup_costs(setup)
    budget = model_budget(setup.plan_name, setup.pp, setup.microbatches, setup.splits,
                          setup.chunks, cap, costs_of)
    if budget is not None and setup.spread_output:
        budget = with_output_spread(budget, setup.plan_name, setup.pp, setup.microbatches,
                                    setup.splits, setup.chunks,
                                    lambda schedule: costs_of(schedule, False, True))
    return registry.build(setup.plan_name, setup.pp, setup.microbatches, setup.splits,
                          setup.chunks, budget=budget)


def estimate_memory(setup: TrainingSetup, held_peaks: HeldPeaks = _simulated_peaks,
                    schedule: Optional[Schedule] = None) -> MemoryEstimate:
    """The per-rank memory of `setup` (see the module docstring for what is counted);
    `schedule`: its plan built already (`plan_schedule`'s)."""
    if setup.seq_length is None:
        raise ScheduleError("--seq-length is required")
    model = replace(setup.model, vocab_size=setup.padded_vocab_size)
    precision = PRECISIONS[setup.precision]
    spans = setup.spans(model)
    local = max(spans) // setup.cp      # a CP rank's tokens of the longest span
    costs_of = setup_costs(setup, spans)
    schedule = schedule or plan_schedule(setup, costs_of)
    costs = costs_of(schedule)
    ranks = held_peaks(schedule, costs)
    layers = layers_per_stage(model, schedule, setup.stage_layers)
    last = schedule.num_stages - 1
    stages = []
    for rank in ranks:
        virtual = [schedule.stage_of(rank.rank, chunk) for chunk in range(schedule.chunks)]
        params = sum(stage_parameters(model, layers[v], first=v == 0, last=v == last,
                                      tp=setup.tp) for v in virtual)
        if schedule.spread_output and last not in virtual:      # a replica of the output layer
            params += model.vocab_size * model.hidden_size / setup.tp
        workspace = backward_workspace_bytes(model, local, setup.micro_batch_size,
                                             setup.tp, precision.activation,
                                             last_stage=last in virtual or schedule.spread_output,
                                             sequence_parallel=setup.sequence_parallel,
                                             recompute=setup.recompute) \
            + 2 * all_to_all_bytes(model, max(spans), setup.micro_batch_size, setup.tp,
                                   setup.cp, precision.activation)
        held = rank.held_at_peak
        stages.append(StageMemory(
            rank=rank.rank, parameters=params,
            parameter_bytes=params * precision.parameter,
            gradient_bytes=params * precision.gradient,
            optimizer_bytes_replicated=params * precision.optimizer,
            optimizer_bytes_sharded=params * precision.optimizer / (setup.dp * setup.cp),
            activation_bytes=held["activation"], kv_cache_bytes=held["kv_cache"],
            logits_bytes=held["logits"], workspace_bytes=workspace,
            recomputed_bytes=recomputed_activation_bytes(
                model, local, setup.micro_batch_size, setup.tp, setup.sequence_parallel,
                precision.activation, setup.recompute),
            overhead_bytes=setup.overhead_gib * GIB, peak_live_spans=rank.peak_live_spans,
            distributed_optimizer=setup.distributed_optimizer))
    return MemoryEstimate(setup, spans, stages)
