"""Projected iteration time, TFLOPS per GPU and tokens/s of a setup on a modelled device.

The pipeline is replayed by the simulator with per-action durations from costs.py's FLOPs at the
device's GEMM and attention rates, plus the tensor-parallel collectives of each action; the
pipeline p2p hop and the data-parallel gradient exchange of the distributed optimizer come from
link bandwidths. Every rate is a field of `DeviceModel`, printed with every projection: the
numbers are a model's, to be replaced by measured ones (tools/device_check.py measures span
kernels and per-span stage times on a GPU).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from seq1f1b.plan import registry
from seq1f1b.plan.costs import iteration_flops, stage_parameters
from seq1f1b.plan.memory import TrainingSetup
from seq1f1b.plan.partition import partition
from seq1f1b.plan.simulate import (SimulationReport, SpanCosts, Table, layers_per_stage,
                                   model_costs, simulate)


@dataclass(frozen=True)
class DeviceModel:
    """Rates of one GPU and its links. Defaults: A100 SXM 80 GB in 8-GPU HDR InfiniBand nodes."""

    name: str = "A100-SXM4-80GB"
    peak_tflops: float = 312.0            # bf16 dense
    gemm_efficiency: float = 0.6          # of peak in the layers' GEMMs, memory-bound ops folded in
    attention_efficiency: float = 0.5     # of peak in flash-attention 2 (causal, fwd and bwd)
    tp_bus_gbps: float = 200.0            # NCCL bus bandwidth of all-gather/reduce-scatter, NVLink3
    intra_node_p2p_gbps: float = 100.0    # pipeline send between GPUs of one node
    inter_node_gbps: float = 25.0         # per GPU across nodes: one 200 Gb/s HDR NIC per GPU
    p2p_latency_s: float = 20e-6
    gpus_per_node: int = 8
    memory_gib: float = 79.25             # total capacity as torch reports it (its OOM messages)

    def describe(self) -> list[str]:
        return [f"{key} = {value}" for key, value in asdict(self).items()]


A100 = DeviceModel()


@dataclass
class Projection:
    """One projected setup."""

    setup: TrainingSetup
    span_lengths: list[int]
    gpus: int
    pipeline_s: float          # makespan of the pipeline (forwards, backwards, p2p, TP comm)
    data_parallel_s: float     # reduce-scatter of fp32 grads + all-gather of bf16 params
    report: SimulationReport

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
    return tuple(layers * collectives * weight * n * per_token / (device.tp_bus_gbps * 1e9)
                 for n in spans)


def _crosses_nodes(setup: TrainingSetup, device: DeviceModel) -> bool:
    """megatron orders ranks TP fastest, then DP, then PP: one pipeline stage spans TP x DP
    consecutive GPUs, so neighbouring stages sit on different nodes once that fills a node."""
    return setup.tp * setup.dp >= device.gpus_per_node


def project(setup: TrainingSetup, device: DeviceModel = A100) -> Projection:
    """Replay `setup`'s plan with the device model's durations (bf16 training)."""
    model = replace(setup.model, vocab_size=setup.padded_vocab_size)
    schedule = registry.build(setup.plan_name, setup.pp, setup.microbatches, setup.splits,
                              setup.chunks)
    spans = partition(setup.seq_length, setup.splits, setup.partition, model, tp=setup.tp,
                      sequence_parallel=setup.sequence_parallel,
                      lengths=list(setup.span_lengths) if setup.span_lengths else None)
    peak = device.peak_tflops * 1e12
    compute = model_costs(schedule, model, spans, flops_per_second=peak * device.gemm_efficiency,
                          attention_flops_per_second=peak * device.attention_efficiency,
                          tp=setup.tp, sequence_parallel=setup.sequence_parallel,
                          batch=setup.micro_batch_size)
    layers = layers_per_stage(model, schedule)
    tp_forward = (_tp_seconds(setup, device, spans, layers, 4),) * schedule.num_stages
    costs = SpanCosts(forward=_add(compute.forward, tp_forward),
                      backward=_add(compute.backward, tp_forward), weight=None)
    hop_bytes = (setup.seq_length / setup.splits * setup.micro_batch_size
                 * model.hidden_size * 2 / (setup.tp if setup.sequence_parallel else 1))
    link = device.inter_node_gbps if _crosses_nodes(setup, device) else \
        device.intra_node_p2p_gbps
    report = simulate(schedule, costs, device.p2p_latency_s + hop_bytes / (link * 1e9))
    params = max(sum(stage_parameters(model, layers, first=schedule.stage_of(r, c) == 0,
                                      last=schedule.stage_of(r, c) == schedule.num_stages - 1,
                                      tp=setup.tp) for c in range(schedule.chunks))
                 for r in range(schedule.pp))
    dp_link = device.inter_node_gbps if setup.tp * setup.dp > device.gpus_per_node else \
        device.tp_bus_gbps
    dp_seconds = params * (4 + 2) * (setup.dp - 1) / setup.dp / (dp_link * 1e9)
    gpus = setup.tp * setup.pp * setup.dp
    return Projection(setup, spans, gpus, report.makespan, dp_seconds, report)
