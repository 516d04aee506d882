"""The cost terms that grow with the span count k, each a named value with where it comes from.

Cutting a micro-batch into k spans keeps its FLOPs but not its time: every span launches every
layer's kernels again, crosses every pipeline hop again, and hands the GEMM and attention kernels
1/k of the rows they parallelise over. A model that counts FLOPs at fixed efficiencies cannot see
any of that, so it rates k = 64 above k = 4. The terms here put those costs in:

- `SpanFixedCost`: host time per span per layer (kernel launches), backward a multiple of it;
- `Link`: a p2p hop as latency + bytes / bandwidth, one per kind of link (NVLink, InfiniBand);
- `GemmEfficiency`: the fraction of peak a layer's GEMMs reach as a function of the span's tokens;
- `AttentionEfficiency`: the fraction of peak flash attention reaches as a function of the query
  rows it parallelises over and the key length it loops over.

Every term carries a `source` string that tools print with their numbers: the defaults
(`seq1f1b.plan.projection.A100`) are public A100 figures or estimates from first principles and
say which; a device_check calibration replaces the saturated efficiencies and says so. None is
fitted to the paper's throughput: those tables are what the model is checked against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace


def describe(term: object) -> str:
    """One line for tool output: the term's values, then its source in brackets."""
    values = ", ".join(f"{f.name} {getattr(term, f.name):g}" for f in fields(term)
                       if f.name != "source")
    return f"{values} [{getattr(term, 'source')}]"


@dataclass(frozen=True)
class SpanFixedCost:
    """Seconds a span's forward spends per layer beyond its FLOPs; its backward `backward_factor`
    times that (about twice the kernels). Counted in full on every span, as if the GPU's queue
    never hid the launches: an upper estimate once kernels run longer than it takes to launch
    them, and the term that makes many short spans lose."""

    s_per_layer: float
    backward_factor: float
    source: str

    def forward_s(self, layers: int) -> float:
        return self.s_per_layer * layers

    def backward_s(self, layers: int) -> float:
        return self.s_per_layer * self.backward_factor * layers

    def ideal(self) -> "SpanFixedCost":
        """The same term costing nothing (what a run without it would take)."""
        return replace(self, s_per_layer=0.0)


@dataclass(frozen=True)
class Link:
    """A pipeline p2p link: one message takes latency_s + bytes / (gbps x 1e9) seconds."""

    latency_s: float
    gbps: float
    source: str

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9)

    def ideal(self) -> "Link":
        return replace(self, latency_s=0.0, gbps=math.inf)


@dataclass(frozen=True)
class GemmEfficiency:
    """e = saturated x t / (t + half_tokens x width / w) for a span of t tokens (s x b, the
    GEMMs' M) through GEMMs w = h / TP columns wide per GPU.

    A GEMM keeps the SMs busy only with enough output tiles, and its tiles grow with t x w: a
    7B-class layer at TP = 8 (w = 512; its four GEMMs 512-4096 columns wide, ~11 tiles of
    128 x 256 per 128 rows) fills one wave of A100's 108 SMs at ~1.2K tokens. Below that the
    GEMMs run on part of the chip, above it the rate approaches `saturated` (which folds in the
    layer's memory-bound ops: norms, GeLU, bias-dropout-add). `half_tokens` holds at `width`
    columns; wider GEMMs (smaller TP, larger h) need proportionally fewer tokens.
    """

    saturated: float
    half_tokens: float
    width: int
    source: str

    def at(self, tokens: float, width: float) -> float:
        return self.saturated * tokens / (tokens + self.half_tokens * self.width / width)

    def ideal(self) -> "GemmEfficiency":
        return replace(self, half_tokens=0.0)


@dataclass(frozen=True)
class AttentionEfficiency:
    """The fraction of peak flash attention reaches on sq queries against sk keys (the span's
    end: its prefix and itself) with `heads` = b x heads-per-GPU:

        e = saturated x r / (r + half_rows) x l / (l + half_loop)

    r is the rows the kernel spreads over thread blocks (128 per block), l the length each
    block loops over. Few rows leave SMs idle; a short loop leaves a block's fixed work (loading
    its tile, writing results, the masked diagonal block) unamortised. flash-attention 2's
    forward splits queries (r = heads x sq, l = sk), its backward splits keys (r = heads x sk,
    l = sq), so a short span late in a long sequence loses in both: too few blocks forward, too
    short a loop backward. With half_rows / heads >= half_loop (the 7B class at TP = 8) it runs
    below a square causal block of the same FLOPs.
    """

    saturated: float
    half_rows: float
    half_loop: float
    source: str

    def _at(self, rows: float, loop: float) -> float:
        return (self.saturated * rows / (rows + self.half_rows)
                * loop / (loop + self.half_loop))

    def forward(self, queries: float, keys: float, heads: float) -> float:
        return self._at(heads * queries, keys)

    def backward(self, queries: float, keys: float, heads: float) -> float:
        return self._at(heads * keys, queries)

    def ideal(self) -> "AttentionEfficiency":
        return replace(self, half_rows=0.0, half_loop=0.0)
