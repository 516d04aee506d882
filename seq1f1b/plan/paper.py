"""The paper's setups and tables from the plan layer: the panels of its memory figure with the
layouts we assume for them, and per cell the estimator's memory (with an OOM verdict), the
projected throughput, the context reach under CP, the micro-batch sweep and the partition
ablation; and the sweep that measures the same cells on a cluster (one examples/slurm/sweep.sh
call per panel, V and partition).

`tools/reproduce_paper.py` prints these tables, writes and submits the sweep and collects its
jobs; `tools/plan.py tune`'s docs compare its layouts with `PANELS`. Pure plan layer: no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator, Optional

from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.calibration import Calibration
from seq1f1b.plan.context_parallel import check_heads
from seq1f1b.plan.costs import preset
from seq1f1b.plan.memory import GIB, MemoryEstimate, TrainingSetup, estimate_memory
from seq1f1b.plan.projection import A100, DeviceModel, Projection, project

SPLITS = 4                  # k of the authors' scripts (--pipe-sp-splits 4)
CHUNKS = 2                  # V of the interleaved runs (the authors' VPP 2)
SWEPT_PANEL = ("7b", 32)    # the panel whose throughput is shown by micro-batch count
MICROBATCH_COUNTS = (8, 16, 32)
CP_SIZES = (1, 2, 4, 8)
REACH_LENGTHS = tuple(16384 * 2 ** i for i in range(9))     # 16K .. 4M tokens
REACH_SPAN = 32768
"""Seq1F1B's spans in the context-reach table: k = L / 32K (at least SPLITS, at most 32)."""
RECOMPUTES = (None, "selective", "full")
"""Tried in this order at each length of the reach table: the least recompute that fits."""
"""The paper measured 8 and 16 micro-batches (PAPER.md holds none of its throughput figures);
32 is the authors' 7B script's."""


@dataclass(frozen=True)
class Panel:
    """One panel of the paper's memory figure and the layout we assume for it."""

    model: str
    gpus: int
    tp: int
    pp: int
    microbatches: int
    seq_lengths: tuple[int, ...]
    why: str

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def script(self) -> str:
        """The shipped sbatch script of this panel (its defaults are this layout)."""
        return f"examples/slurm/pretrain_gpt_{self.model}_{self.gpus}gpu.sbatch"


PANELS = (
    Panel("2.7b", 8, tp=1, pp=8, microbatches=32, seq_lengths=(16384, 24576, 32768),
          why="one node, no node boundary to keep TP inside: pure pipeline PP=8 (a TP=2, PP=4 "
              "layout would put 1F1B at 16K near 28 GiB, far below the paper's 51.4 GB)"),
    Panel("7b", 32, tp=8, pp=4, microbatches=32, seq_lengths=(32768, 65536, 131072),
          why="TP=8 inside each node, PP=4 across the 4 nodes, as the authors' 30B script "
              "(TP=8, PP=8 on 64 GPUs); the authors' 7B script (TP=2, PP=4) is a one-node 16K run"),
    Panel("13b", 32, tp=8, pp=4, microbatches=32, seq_lengths=(32768, 49152, 65536),
          why="as 7B: TP=8 inside a node, PP=4 across 4 nodes"),
    Panel("30b", 64, tp=8, pp=8, microbatches=16, seq_lengths=(32768, 49152, 65536),
          why="the authors' 30B script: TP=8, PP=8, 16 micro-batches"),
)
"""Micro-batch size 1, m=32 as the authors' 7B script (16 for 30B as its script); the peak does
not depend on m once m >= P (x V). bf16, sequence parallelism where TP > 1, distributed
optimizer, no recompute, k=4 computation-balanced spans, V=2 for the interleaved schedules."""

SCHEDULES = (("1F1B", "1f1b"), ("1F1B-I", "interleaved-1f1b"), ("Seq1F1B", "seq1f1b"),
             ("Seq1F1B-I", "seq1f1b-interleaved"))
"""The paper's names and the registry's."""

OOM = "OOM"
PAPER_MEMORY_GB: dict[tuple[str, int], tuple] = {
    ("2.7b", 16384): (51.40, 70.95, 29.85, 29.70),
    ("2.7b", 24576): (74.30, OOM, 41.45, 41.90),
    ("2.7b", 32768): (OOM, OOM, 53.10, 54.45),
    ("7b", 32768): (28.00, 34.20, 18.90, 16.35),
    ("7b", 65536): (51.40, 62.90, 34.30, 28.45),
    ("7b", 131072): (OOM, OOM, 69.80, 57.55),
}
"""PAPER.md's memory table, in SCHEDULES order (GB as the paper prints them)."""


def _is_seq1f1b(schedule: str) -> bool:
    return schedule.startswith("seq1f1b")


def _chunks(schedule: str) -> int:
    return CHUNKS if "interleaved" in schedule else 1


def _setup(panel: Panel, seq_length: int, schedule: str, partition: str = "compute"
           ) -> TrainingSetup:
    seq1f1b = _is_seq1f1b(schedule)
    return TrainingSetup(
        model=preset(panel.model), seq_length=seq_length, schedule=schedule, pp=panel.pp,
        microbatches=panel.microbatches, splits=SPLITS if seq1f1b else 1,
        chunks=_chunks(schedule), tp=panel.tp, dp=panel.dp,
        sequence_parallel=panel.tp > 1, distributed_optimizer=True,
        partition=partition if seq1f1b else "even")


def paper_memory(model: str, seq_length: int, schedule: str) -> dict:
    """The paper's figure for one cell: paper_gb (None: not given or OOM) and paper_oom (None:
    the cell is not in PAPER_MEMORY_GB)."""
    paper = PAPER_MEMORY_GB.get((model, seq_length))
    value = paper[[name for _, name in SCHEDULES].index(schedule)] if paper else None
    return {"paper_gb": None if value in (None, OOM) else value,
            "paper_oom": None if value is None else value == OOM}


def _cell(panel: Panel, seq_length: int, schedule: str) -> dict:
    """The keys every table row starts with."""
    return {"model": panel.model, "gpus": panel.gpus, "seq_length": seq_length,
            "schedule": schedule, "tp": panel.tp, "pp": panel.pp,
            "microbatches": panel.microbatches}


def _cells(panels: tuple[Panel, ...] = ()) -> Iterator[tuple[dict, TrainingSetup]]:
    """Every (panel, sequence length, schedule) cell of the paper's tables (of `panels`, when
    given): the keys its rows start with (k and V included) and the setup it assumes."""
    for panel in panels or PANELS:
        for seq_length in panel.seq_lengths:
            for _, schedule in SCHEDULES:
                setup = _setup(panel, seq_length, schedule)
                yield ({**_cell(panel, seq_length, schedule), "splits": setup.splits,
                        "chunks": setup.chunks}, setup)


@dataclass(frozen=True)
class Models:
    """What the estimated tables assume of the device: its memory, its rates and, once
    device_check has measured them (--device-check), the measured efficiencies and the caching
    allocator's reserve, by which the OOM verdicts then judge reserved rather than allocated
    bytes."""

    gpu_memory_gib: float = A100.memory_gib
    calibration: Optional[Calibration] = None

    @property
    def device(self) -> DeviceModel:
        return self.calibration.device_model(A100) if self.calibration else A100

    @property
    def reserve_ratio(self) -> Optional[float]:
        return self.calibration.reserve_ratio if self.calibration else None

    def fits(self, estimate: MemoryEstimate) -> bool:
        return estimate.fits(self.gpu_memory_gib, self.reserve_ratio or 1.0)


def memory_rows(models: Models) -> list[dict]:
    rows = []
    for cell, setup in _cells():
        estimate = estimate_memory(setup)
        reserved = (estimate.reserved_peak_bytes(models.reserve_ratio) / GIB
                    if models.reserve_ratio else None)
        rows.append({**cell, "estimate_gb": estimate.peak_bytes / GIB, "reserved_gb": reserved,
                     "fits_up_to_reserve": estimate.largest_fitting_reserve(
                         models.gpu_memory_gib),
                     "oom": not models.fits(estimate),
                     **paper_memory(cell["model"], cell["seq_length"],
                                     cell["schedule"])})
    return rows


def _throughput_row(cell: dict, setup: TrainingSetup, models: Models) -> tuple[dict, Projection]:
    projection = project(setup, models.device)
    return {**cell, "tflops_per_gpu": projection.tflops_per_gpu,
            "tokens_per_s": projection.tokens_per_s, "iteration_s": projection.iteration_s,
            "bubble_ratio": projection.report.bubble_ratio,
            "oom": not models.fits(estimate_memory(setup)), "paper_tflops": None}, projection


def throughput_rows(models: Models) -> list[dict]:
    return [_throughput_row(cell, setup, models)[0] for cell, setup in _cells()]


def cp_layout(panel: Panel, cp: int) -> Optional[tuple[int, int]]:
    """(TP, PP) for the panel's GPUs with CP = `cp` and DP = 1: the largest TP up to the panel's
    whose heads C can shard, PP the rest (dividing the layers); None when none exists."""
    model = preset(panel.model)
    tp = panel.tp
    while tp >= 1:
        pp = panel.gpus // (tp * cp)
        try:
            check_heads(model.num_attention_heads, model.num_query_groups, tp, cp)
            heads_ok = model.num_attention_heads % tp == 0
        except ScheduleError:
            heads_ok = False
        if heads_ok and pp >= 1 and pp * tp * cp == panel.gpus and model.num_layers % pp == 0:
            return tp, pp
        tp //= 2
    return None


REACH_RUNS = (("1f1b", False), ("seq1f1b", False), ("seq1f1b", True))
"""The reach table's runs: (schedule, with the loss's backward at F; --loss-backward-in-forward,
which frees the last stage of the loss's softmax over its k spans)."""


def reach_setup(panel: Panel, layout: tuple[int, int], cp: int, schedule: str,
                 seq_length: int, recompute: Optional[str],
                 loss_backward_in_forward: bool = False) -> TrainingSetup:
    tp, pp = layout
    splits = min(max(seq_length // REACH_SPAN, SPLITS), 32) if _is_seq1f1b(schedule) else 1
    return TrainingSetup(
        model=preset(panel.model), seq_length=seq_length, schedule=schedule, pp=pp,
        microbatches=panel.microbatches, splits=splits, tp=tp, cp=cp, dp=1,
        sequence_parallel=tp > 1, distributed_optimizer=True, recompute_granularity=recompute,
        loss_backward_in_forward=loss_backward_in_forward)


def reach_rows(models: Models) -> list[dict]:
    """Per paper panel, CP size and run of REACH_RUNS (1F1B, Seq1F1B, Seq1F1B with the loss's
    backward at F): the longest context of REACH_LENGTHS that fits its GPUs (DP = 1, the least
    recompute of RECOMPUTES that fits), with the projected throughput there."""
    rows = []
    for panel in PANELS:
        for cp in CP_SIZES:
            layout = cp_layout(panel, cp)
            for schedule, early in REACH_RUNS:
                row = {"model": panel.model, "gpus": panel.gpus, "cp": cp, "schedule": schedule,
                       "loss_backward_in_forward": early,
                       "tp": layout[0] if layout else None, "pp": layout[1] if layout else None,
                       "seq_length": None, "splits": None, "recompute": None,
                       "tflops_per_gpu": None, "tokens_per_s": None}
                reached = None
                for seq_length in REACH_LENGTHS if layout else ():
                    fitting = next((setup for recompute in RECOMPUTES
                                    for setup in [reach_setup(panel, layout, cp, schedule,
                                                               seq_length, recompute, early)]
                                    if models.fits(estimate_memory(setup))), None)
                    if fitting is None:
                        break
                    reached = fitting
                if reached is not None:
                    projection = project(reached, models.device)
                    row.update(seq_length=reached.seq_length, splits=reached.splits,
                               recompute=reached.recompute_granularity,
                               tflops_per_gpu=projection.tflops_per_gpu,
                               tokens_per_s=projection.tokens_per_s)
                rows.append(row)
    return rows


def microbatch_rows(models: Models) -> list[dict]:
    """SWEPT_PANEL's throughput at each of MICROBATCH_COUNTS, each row with the seconds each
    k-dependent term adds to its iteration (`Projection.overheads`); none without the panel."""
    panels = [panel for panel in PANELS if (panel.model, panel.gpus) == SWEPT_PANEL]
    rows = []
    for cell, setup in _cells(tuple(replace(panel, microbatches=m) for panel in panels
                                    for m in MICROBATCH_COUNTS)):
        row, projection = _throughput_row(cell, setup, models)
        rows.append({**row, "overheads_s": projection.overheads()})
    return rows


def ablation_rows(models: Models) -> list[dict]:
    rows = []
    for panel in PANELS:
        for seq_length in panel.seq_lengths:
            for _, schedule in SCHEDULES[2:]:
                even = project(_setup(panel, seq_length, schedule, "even"), models.device)
                balanced = project(_setup(panel, seq_length, schedule, "compute"),
                                   models.device)
                rows.append({**_cell(panel, seq_length, schedule), "splits": SPLITS,
                             "even_spans": even.span_lengths,
                             "compute_spans": balanced.span_lengths,
                             "tflops_even": even.tflops_per_gpu,
                             "tflops_compute": balanced.tflops_per_gpu,
                             "gain": balanced.tflops_per_gpu / even.tflops_per_gpu - 1})
    return rows


def agreeing_reserves(memory: list[dict]) -> Optional[tuple[float, float]]:
    """(low, high): every OOM verdict agrees with the paper's marks at a reserved/allocated
    ratio above low (at least 1) and up to high; None where no ratio does. What a device
    measurement of the allocator's reserve would have to show for the tables to match."""
    checked = [r for r in memory if r["paper_oom"] is not None]
    low = max([1.0] + [r["fits_up_to_reserve"] for r in checked if r["paper_oom"]])
    high = min([math.inf] + [r["fits_up_to_reserve"] for r in checked if not r["paper_oom"]])
    return (low, high) if low < high else None


PARTITIONS = ("compute", "even")
"""The partition of the tables' runs, then the ablation's other half (Seq1F1B schedules only)."""

@dataclass(frozen=True)
class Sweep:
    """One examples/slurm/sweep.sh call: the cells of a panel that share V and the partition.

    sweep.sh crosses schedules x k x lengths x micro-batches and hands every other variable to
    its jobs unchanged, so a panel's cells fall into one call per (V, partition): the whole-
    sequence and Seq1F1B schedules, their interleaved forms (VPP_LAYERS), and the Seq1F1B ones
    again with even spans for the ablation.
    """

    panel: Panel
    schedules: tuple[str, ...]
    chunks: int
    partition: str

    @property
    def folder(self) -> str:
        """Its sweep.sh --out, under the launch folder."""
        return f"{self.panel.model}-{self.panel.gpus}gpu-v{self.chunks}-{self.partition}"

    @property
    def jobs(self) -> int:
        return len(self.schedules) * len(self.panel.seq_lengths)

    def environment(self, train_iters: int) -> dict[str, str]:
        """sweep.sh's grid (SCHEDULES, SPLITS, SEQ_LENGTHS, MICRO_BATCHES) and the variables of
        examples/slurm/launch_pretrain.sh the jobs read. Every layout setting is explicit, so a
        variable left in the submitting shell cannot change a cell (an empty VPP_LAYERS is
        unset for the script)."""
        layers = preset(self.panel.model).num_layers
        vpp_layers = str(layers // (self.panel.pp * self.chunks)) if self.chunks > 1 else ""
        return {"SCHEDULES": " ".join(self.schedules), "SPLITS": str(SPLITS),
                "SEQ_LENGTHS": " ".join(map(str, self.panel.seq_lengths)),
                "MICRO_BATCHES": str(self.panel.microbatches), "TP": str(self.panel.tp),
                "PP": str(self.panel.pp), "VPP_LAYERS": vpp_layers,
                "PARTITION_METHOD": self.partition, "TRAIN_ITERS": str(train_iters)}

    def record(self) -> dict:
        """Its entry in the launch folder's sweeps.json: what --collect names its jobs by."""
        return {"folder": self.folder, "script": self.panel.script, "model": self.panel.model,
                "gpus": self.panel.gpus, "tp": self.panel.tp, "pp": self.panel.pp,
                "chunks": self.chunks, "partition": self.partition}


def sweeps() -> list[Sweep]:
    """The whole sweep: every cell of the tables (computation-balanced spans) and, for the
    ablation, the Seq1F1B cells with even spans."""
    found = []
    for panel in PANELS:
        for partition in PARTITIONS:
            for chunks in (1, CHUNKS):
                schedules = tuple(name for _, name in SCHEDULES if _chunks(name) == chunks
                                  and (partition == "compute" or _is_seq1f1b(name)))
                found.append(Sweep(panel, schedules, chunks, partition))
    return found
