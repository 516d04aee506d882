"""Projected iteration time, TFLOPS per GPU and tokens/s of a setup on a modelled device.

The pipeline is replayed by the simulator with per-action durations from costs.py's FLOPs at
the device's GEMM and attention efficiencies for each span's shape, plus a fixed host cost per
span and layer and the tensor-parallel collectives of each action; each pipeline hop costs the
latency and bandwidth of the link its two stages sit across, and the data-parallel gradient
exchange of the distributed optimizer comes from link bandwidths. The terms that grow with the
span count k live in overheads.py with their sources; `Projection.overheads` says what each one
costs an iteration. Every rate is a field of `DeviceModel`, printed with every projection: the
numbers are a model's, to be replaced by measured ones (tools/device_check.py measures span
kernels and per-span stage times on a GPU).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable, Optional

from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.context_parallel import all_to_all_bytes
from seq1f1b.plan.costs import ModelConfig, iteration_flops, stage_parameters
from seq1f1b.plan.memory import TrainingSetup, plan_schedule
from seq1f1b.plan.overheads import (AttentionEfficiency, GemmEfficiency, Link, SpanFixedCost,
                                    describe)
from seq1f1b.plan.simulate import (Efficiency, SimulationReport, SpanCosts, Table,
                                   layers_per_stage, model_costs, simulate)

A100_GEMM = GemmEfficiency(
    saturated=0.6, half_tokens=1024, width=512,
    source="saturated: ~55-60% of bf16 peak is what Megatron-LM's published A100 GPT runs reach "
           "per GPU with the layers' memory-bound ops included (Narayanan et al. 2021: 52% at "
           "scale, comms included); half_tokens at width h/TP = 512 (7B, TP 8): estimate from "
           "cuBLAS tile counts (see GemmEfficiency), not measured")
A100_ATTENTION = AttentionEfficiency(
    saturated=0.56, half_rows=8192, half_loop=600,
    source="saturated and half_loop: flash-attention 2 on A100 (Dao 2023, causal, head dim 128, "
           "fwd+bwd) runs ~175 TFLOPS at 8-16K tokens and about half that at 512, read from the "
           "paper's figure; half_rows: estimate, half a wave of 108 SMs in 128-row blocks")
A100_SPAN_FIXED = SpanFixedCost(
    s_per_layer=150e-6, backward_factor=2.0,
    source="estimate: ~30 kernels in a layer's forward with TP and SP (norms, 2 all-gathers, 2 "
           "reduce-scatters, 4 GEMMs, unfused RoPE, flash attention, K/V cache writes, "
           "bias-dropout-adds) at ~5 us host launch each (PyTorch eager dispatch + "
           "cudaLaunchKernel, CUDA_DEVICE_MAX_CONNECTIONS=1); backward ~2x the kernels")
A100_NVLINK = Link(
    latency_s=10e-6, gbps=100.0,
    source="NVLink3 gives 300 GB/s per direction per A100 (NVIDIA datasheet: 600 GB/s total); "
           "one NCCL send between two GPUs reaches a fraction: 100 GB/s and ~10 us for a "
           "small message are estimates of nccl-tests' order of magnitude")
A100_INFINIBAND = Link(
    latency_s=20e-6, gbps=24.0,
    source="one 200 Gb/s HDR NIC per GPU (DGX A100): 25 GB/s line rate, ~24 GB/s as "
           "nccl-tests reports across nodes; latency a few us on the wire plus NCCL's proxy "
           "and launch, ~20 us estimated")


@dataclass(frozen=True)
class DeviceModel:
    """Rates of one GPU and its links. Defaults: A100 SXM 80 GB in 8-GPU HDR InfiniBand nodes."""

    name: str = "A100-SXM4-80GB"
    peak_tflops: float = 312.0                      # bf16 dense
    gemm: GemmEfficiency = A100_GEMM
    attention: AttentionEfficiency = A100_ATTENTION
    span_fixed: SpanFixedCost = A100_SPAN_FIXED     # per span, per layer
    nvlink: Link = A100_NVLINK                      # pipeline hop inside a node
    infiniband: Link = A100_INFINIBAND              # pipeline hop across nodes; DP across nodes
    tp_bus_gbps: float = 200.0            # NCCL bus bandwidth of all-gather/reduce-scatter, NVLink3
    gpus_per_node: int = 8
    memory_gib: float = 79.25             # total capacity as torch reports it (its OOM messages)

    def describe(self) -> list[str]:
        """One line per field; the k-dependent terms with their values and sources."""
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            lines.append(f"{f.name}: {describe(value)}" if hasattr(value, "source")
                         else f"{f.name} = {value}")
        return lines

    def without(self, *terms: str) -> "DeviceModel":
        """This device with the k-dependent `terms` (field names) costing nothing."""
        return replace(self, **{term: getattr(self, term).ideal() for term in terms})


A100 = DeviceModel()

TERMS = {"span_fixed": ("span_fixed",), "p2p": ("nvlink", "infiniband"), "gemm": ("gemm",),
         "attention": ("attention",)}
"""The k-dependent terms `Projection.overheads` prices, by the DeviceModel fields they are."""


@dataclass
class Projection:
    """One projected setup."""

    setup: TrainingSetup
    device: DeviceModel
    span_lengths: list[int]
    gpus: int
    pipeline_s: float          # makespan of the pipeline (forwards, backwards, p2p, TP comm)
    data_parallel_s: float     # reduce-scatter of fp32 grads + all-gather of bf16 params
    report: SimulationReport
    simulator: "Simulator" = field(default=simulate, repr=False, compare=False)
    schedule: Optional[Schedule] = field(default=None, repr=False, compare=False)

    @property
    def iteration_s(self) -> float:
        return self.pipeline_s + self.data_parallel_s

    @property
    def global_batch(self) -> int:
        return self.setup.microbatches * self.setup.micro_batch_size * self.setup.dp

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch * self.setup.seq_length / self.iteration_s

    @property
    def tflops_per_gpu(self) -> float:
        """The paper's count (costs.iteration_flops) over the iteration time and the GPUs."""
        model = replace(self.setup.model, vocab_size=self.setup.padded_vocab_size)
        flops = iteration_flops(model, self.setup.seq_length, self.global_batch)
        return flops / self.iteration_s / self.gpus / 1e12

    def overheads(self) -> dict[str, float]:
        """Seconds each of TERMS adds to the iteration: this makespan minus the one projected
        with that term alone costing nothing (fixed cost 0, free links, saturated efficiency).
        Terms interact through the pipeline, so they need not add up to the difference from a
        run without all of them."""
        return {name: self.pipeline_s - project(self.setup, self.device.without(*terms),
                                                simulator=self.simulator,
                                                schedule=self.schedule).pipeline_s
                for name, terms in TERMS.items()}


def _add(table: Table, extra: Table) -> Table:
    return tuple(tuple(a + b for a, b in zip(row, more)) for row, more in zip(table, extra))


def _tp_seconds(setup: TrainingSetup, device: DeviceModel, spans: list[int], layers: int,
                collectives: int) -> tuple[float, ...]:
    """Per span: `collectives` TP collectives per layer, each moving a span's hidden states.

    With sequence parallelism a layer's forward runs 2 all-gathers and 2 reduce-scatters and its
    backward the same (the weight-gradient re-gathers overlap the GEMMs); without it, 2
    all-reduces each way, each worth an all-gather plus a reduce-scatter. Each moves
    (TP-1)/TP of the span's [s, b, h] 16-bit tensor at the bus bandwidth, not overlapped.
    """
    if setup.tp == 1:
        return tuple(0.0 for _ in spans)
    per_token = setup.model.hidden_size * 2 * setup.micro_batch_size * (setup.tp - 1) / setup.tp
    weight = 1 if setup.sequence_parallel else 2
    return tuple(layers * collectives * weight * (n // setup.cp) * per_token
                 / (device.tp_bus_gbps * 1e9) for n in spans)


def _global_rank(setup: TrainingSetup, t: int, c: int, d: int, r: int) -> int:
    """megatron's rank order tp-cp-dp-pp: TP fastest, then CP, DP, PP."""
    return t + setup.tp * (c + setup.cp * (d + setup.dp * r))


def cp_crosses_nodes(setup: TrainingSetup, device: DeviceModel) -> bool:
    """Whether a CP group (equal t, d, r; c = 0..C-1, ranks TP apart) spans nodes."""
    return any(_global_rank(setup, t, 0, d, r) // device.gpus_per_node
               != _global_rank(setup, t, setup.cp - 1, d, r) // device.gpus_per_node
               for t in range(setup.tp) for d in range(setup.dp) for r in range(setup.pp))


def _cp_seconds(setup: TrainingSetup, device: DeviceModel, model: ModelConfig, spans: list[int],
                layers: int) -> tuple[float, ...]:
    """Per span and pass (forward, or backward): a layer's four all-to-alls (q, k, v, output or
    their gradients) of the rank's span / C tokens, over NVLink at the bus bandwidth inside a
    node, InfiniBand across nodes, each with the link's latency; not overlapped."""
    if setup.cp == 1:
        return tuple(0.0 for _ in spans)
    link = device.infiniband if cp_crosses_nodes(setup, device) else \
        replace(device.nvlink, gbps=device.tp_bus_gbps)
    return tuple(layers * (4 * link.latency_s + all_to_all_bytes(
        model, n, setup.micro_batch_size, setup.tp, setup.cp) / (link.gbps * 1e9))
        for n in spans)


def _crosses_nodes(setup: TrainingSetup, device: DeviceModel, rank: int, peer: int) -> bool:
    """Whether pipeline ranks `rank` and `peer` exchange across nodes. megatron orders GPUs TP
    fastest, then CP, DP, PP (`_global_rank`); a p2p pairs equal (t, c, d) of the two stages,
    so the hop crosses nodes when any such pair sits on different nodes."""
    def node(t: int, c: int, d: int, r: int) -> int:
        return _global_rank(setup, t, c, d, r) // device.gpus_per_node

    return any(node(t, c, d, rank) != node(t, c, d, peer)
               for t in range(setup.tp) for c in range(setup.cp) for d in range(setup.dp))


def stage_links(setup: TrainingSetup, device: DeviceModel, schedule: Schedule) -> list[Link]:
    """The link between virtual stages v and v+1, for each v: InfiniBand when their ranks sit
    on different nodes, else NVLink (two stages of one rank never use theirs)."""
    links = []
    for stage in range(schedule.num_stages - 1):
        rank, peer = schedule.owner_of(stage)[0], schedule.owner_of(stage + 1)[0]
        links.append(device.infiniband if _crosses_nodes(setup, device, rank, peer)
                     else device.nvlink)
    return links


def _hops(setup: TrainingSetup, device: DeviceModel, schedule: Schedule, model: ModelConfig,
          spans: list[int]) -> Table:
    """Seconds of the p2p between virtual stages v and v+1 for each span: its activation (or
    gradient), [s, b, h] in 16 bits (/TP with sequence parallelism, /C under context
    parallelism), over their link."""
    divisor = (setup.tp if setup.sequence_parallel else 1) * setup.cp
    return tuple(tuple(link.seconds(n * setup.micro_batch_size * model.hidden_size * 2 / divisor)
                       for n in spans) for link in stage_links(setup, device, schedule))


def _span_costs(setup: TrainingSetup, device: DeviceModel, schedule: Schedule,
                model: ModelConfig, spans: list[int]) -> SpanCosts:
    """F and B of every (virtual stage, span): FLOPs at the span's efficiencies, the fixed cost
    of its layers, its TP collectives and CP all-to-alls; W (split-backward schedules) at the
    GEMM efficiency; an O (the output layer spread over the ranks) at the GEMM efficiency, its
    input and gradient over the last stage's link; and the hops between stages. Under CP a
    rank's GEMMs see span / C tokens and its attention the whole span for 1/C of the heads."""
    batch = setup.micro_batch_size
    heads = batch * model.num_attention_heads // (setup.tp * setup.cp)

    def efficiency(start: int, end: int) -> Efficiency:
        queries = end - start
        return Efficiency(device.gemm.at(queries // setup.cp * batch,
                                         model.hidden_size / setup.tp),
                          device.attention.forward(queries, end, heads),
                          device.attention.backward(queries, end, heads))

    peak = device.peak_tflops * 1e12
    compute = model_costs(schedule, model, spans, flops_per_second=peak, tp=setup.tp,
                          sequence_parallel=setup.sequence_parallel, batch=batch,
                          efficiency=efficiency, recompute=setup.recompute, cp=setup.cp,
                          stage_layers=setup.stage_layers,
                          loss_backward_in_forward=setup.loss_backward_in_forward,
                          spread_output=schedule.spread_output)
    layers = layers_per_stage(model, schedule, setup.stage_layers)
    comm = [tuple(t + c for t, c in zip(_tp_seconds(setup, device, spans, count, 4),
                                        _cp_seconds(setup, device, model, spans, count)))
            for count in layers]
    fixed = device.span_fixed
    return SpanCosts(
        forward=_add(compute.forward, tuple(tuple(t + fixed.forward_s(count) for t in row)
                                            for count, row in zip(layers, comm))),
        backward=_add(compute.backward, tuple(tuple(t + fixed.backward_s(count) for t in row)
                                              for count, row in zip(layers, comm))),
        weight=compute.weight, hop=_hops(setup, device, schedule, model, spans),
        output=compute.output)


Simulator = Callable[[Schedule, SpanCosts], SimulationReport]
"""What replays a schedule with costs: `simulate`, or a replay with the same results (the
layout planner's, seq1f1b/plan/tune/replay.py, compiled once per schedule shape)."""


def pipeline_costs(setup: TrainingSetup, device: DeviceModel, schedule: Schedule) -> SpanCosts:
    """The per-action seconds `project` replays `schedule` with for `setup` on `device`."""
    model = replace(setup.model, vocab_size=setup.padded_vocab_size)
    return _span_costs(setup, device, schedule, model, setup.spans(model))


def project(setup: TrainingSetup, device: DeviceModel = A100, *,
            simulator: Simulator = simulate, schedule: Optional[Schedule] = None) -> Projection:
    """Replay `setup`'s plan with the device model's durations (bf16 training); `schedule`:
    that plan built already (`memory.plan_schedule`'s)."""
    model = replace(setup.model, vocab_size=setup.padded_vocab_size)
    schedule = schedule or plan_schedule(setup)
    spans = setup.spans(model)
    report = simulator(schedule, _span_costs(setup, device, schedule, model, spans))
    layers = layers_per_stage(model, schedule, setup.stage_layers)
    params = max(sum(stage_parameters(model, layers[schedule.stage_of(r, c)],
                                      first=schedule.stage_of(r, c) == 0,
                                      last=schedule.stage_of(r, c) == schedule.num_stages - 1,
                                      tp=setup.tp) for c in range(schedule.chunks))
                 for r in range(schedule.pp))
    # the distributed optimizer's exchange runs over DP x CP (megatron's dp_cp group)
    replicas = setup.dp * setup.cp
    dp_link = device.infiniband.gbps if setup.tp * replicas > device.gpus_per_node else \
        device.tp_bus_gbps
    dp_seconds = params * (4 + 2) * (replicas - 1) / replicas / (dp_link * 1e9)
    gpus = setup.tp * setup.cp * setup.pp * setup.dp
    return Projection(setup, device, spans, gpus, report.makespan, dp_seconds, report, simulator,
                      schedule)
