"""FLOPs, bytes and parameter counts of GPT spans: the one cost formula of the project.

The span partitioner balances with it, the simulator turns it into action durations and memory,
and the runtime's TFLOPS logging and any memory estimate call it, so every number the project
reports about compute or memory comes from the functions below.

Notation: a span holds `s` tokens of one micro-batch (batch `b` sequences) and its last token sits
at absolute position `E` (E counts the span itself); h hidden, n heads, g query groups (K/V heads),
d = h/n, f FFN hidden, Vv vocabulary, N layers, TP tensor-parallel size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from seq1f1b.plan.actions import ScheduleError


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a GPT model as far as cost is concerned."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None        # None: 4 * hidden_size
    vocab_size: int = 50257                   # GPT-2 BPE; pass the padded size where it matters
    num_query_groups: int | None = None       # None: one K/V head per query head (no GQA)
    seq_length: int | None = None
    swiglu: bool = False                      # gated MLP: FC1 is two GEMMs (gate, up) of f
    normalization: str = "LayerNorm"          # RMSNorm has no bias
    add_bias_linear: bool = True
    add_qkv_bias: bool = False

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        for flag, value in (("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                            ("--num-attention-heads", self.num_attention_heads),
                            ("--ffn-hidden-size", self.ffn_hidden_size),
                            ("--vocab-size", self.vocab_size),
                            ("--num-query-groups", self.num_query_groups)):
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{flag} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ScheduleError(f"--hidden-size {self.hidden_size} is not divisible by "
                                f"--num-attention-heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ScheduleError(f"--num-attention-heads {self.num_attention_heads} is not "
                                f"divisible by --num-query-groups {self.num_query_groups}")

    @property
    def kv_channels(self) -> int:
        """d: channels per attention head."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def of_transformer_config(cls, config, vocab_size: int = 50257) -> "ModelConfig":
        """The cost shape of a megatron-core TransformerConfig (read by attribute, so this
        module stays free of torch and megatron)."""
        return cls(num_layers=config.num_layers, hidden_size=config.hidden_size,
                   num_attention_heads=config.num_attention_heads,
                   ffn_hidden_size=config.ffn_hidden_size, vocab_size=vocab_size,
                   num_query_groups=config.num_query_groups, swiglu=config.gated_linear_unit,
                   normalization=config.normalization, add_bias_linear=config.add_bias_linear,
                   add_qkv_bias=config.add_qkv_bias)

    @classmethod
    def of_flags(cls, flags, vocab_size: int) -> "ModelConfig":
        """The cost shape of Megatron-named flags (attributes num_layers, hidden_size, ...,
        disable_bias_linear, add_qkv_bias: a parsed command line or an equivalence case)."""
        return cls(num_layers=flags.num_layers, hidden_size=flags.hidden_size,
                   num_attention_heads=flags.num_attention_heads,
                   ffn_hidden_size=flags.ffn_hidden_size, vocab_size=vocab_size,
                   num_query_groups=flags.num_query_groups, swiglu=flags.swiglu,
                   normalization=flags.normalization,
                   add_bias_linear=not flags.disable_bias_linear,
                   add_qkv_bias=flags.add_qkv_bias)

    @property
    def fc1_width(self) -> int:
        """Output width of FC1: f, or 2f with SwiGLU (gate and up projections side by side)."""
        return 2 * self.ffn_hidden_size if self.swiglu else self.ffn_hidden_size

    @property
    def norm_parameters(self) -> int:
        """Parameters of one norm: weight and bias (LayerNorm) or weight only (RMSNorm)."""
        return self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)


PRESETS: dict[str, ModelConfig] = {
    "1.3b": ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16),
    "2.7b": ModelConfig(num_layers=32, hidden_size=2560, num_attention_heads=32),
    "7b": ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32),
    "13b": ModelConfig(num_layers=40, hidden_size=5120, num_attention_heads=40),
    "30b": ModelConfig(num_layers=64, hidden_size=6144, num_attention_heads=64),
}
"""The paper's GPT configurations (authors' scripts): FFN 4h, GPT-2 vocabulary, no GQA."""


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int,
                      tensor_model_parallel_size: int) -> int:
    """Megatron's embedding size: the vocabulary rounded up to a multiple of
    divisible_by x TP, so each TP shard of the embedding has the same, aligned size."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def preset(name: str) -> ModelConfig:
    """The paper's model `name` (case-insensitive, e.g. "7b")."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ScheduleError(f"--model: unknown model {name!r}; choose from "
                            f"{', '.join(PRESETS)}") from None


# -- FLOPs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpanFlops:
    """Forward FLOPs of one span split by kind, so that backward costs follow from them.

    `linear`: GEMMs against weights. Their backward costs twice the forward, half of it for the
    input gradient and half for the weight gradient. `attention`: the core attention (QK^T,
    softmax, AV), which has no weights; its backward costs twice its forward, all input gradient.
    """

    linear: float
    attention: float

    @property
    def forward(self) -> float:
        return self.linear + self.attention

    @property
    def input_grad(self) -> float:
        """FLOPs of B when backward is split into B (input grad) and W (weight grad)."""
        return self.linear + 2 * self.attention

    @property
    def weight_grad(self) -> float:
        """FLOPs of W when backward is split."""
        return self.linear

    @property
    def backward(self) -> float:
        """FLOPs of a full (unsplit) backward: twice the forward."""
        return self.input_grad + self.weight_grad

    def __add__(self, other: "SpanFlops") -> "SpanFlops":
        return SpanFlops(self.linear + other.linear, self.attention + other.attention)

    def scaled(self, factor: float) -> "SpanFlops":
        return SpanFlops(self.linear * factor, self.attention * factor)


def _check_span(span_length: int, end: int) -> None:
    if span_length < 1 or end < span_length:
        raise ScheduleError(f"a span of {span_length} tokens cannot end at position {end}")


def layer_flops(model: ModelConfig, span_length: int, end: int, batch: int = 1) -> SpanFlops:
    """Forward FLOPs of one transformer layer on a span of `span_length` tokens ending at `end`.

    linear = 4*s*h*d*(n + g) + 2*s*h*(f1 + f), i.e. QKV and output projections (8*s*h*(n*d)
    without GQA) plus the MLP GEMMs, with f1 = f (GeLU, 4*s*h*f) or 2f (SwiGLU's gate and up
    projections, 6*s*h*f); attention = (4d + 3) * n * (s*E - s^2/2): 4d per query-key pair
    for QK^T and AV, 3 for scale, mask and softmax, over the causal pairs of the span. The pair
    count s*E - s^2/2 = (E^2 - (E-s)^2)/2 telescopes, so the spans of a sequence sum exactly to
    the whole causal sequence's cost (L^2/2 pairs).
    """
    _check_span(span_length, end)
    h, n, g = model.hidden_size, model.num_attention_heads, model.num_query_groups
    d, f = model.kv_channels, model.ffn_hidden_size
    linear = 4 * span_length * h * d * (n + g) + 2 * span_length * h * (model.fc1_width + f)
    start = end - span_length
    attention = (4 * d + 3) * n * (end * end - start * start) / 2
    return SpanFlops(float(linear * batch), attention * batch)


def logits_flops(model: ModelConfig, span_length: int, batch: int = 1,
                 embedding_as_gemm: bool = False) -> SpanFlops:
    """FLOPs of the output layer on a span: 2*s*h*Vv (once per model, on the last stage).

    `embedding_as_gemm` adds another 2*s*h*Vv for the input embedding, as the paper's TFLOPS
    formula counts it; the lookup costs nothing in reality, so partitioning and simulation leave
    it out.
    """
    gemms = 2 if embedding_as_gemm else 1
    return SpanFlops(float(gemms * 2 * span_length * model.hidden_size * model.vocab_size * batch),
                     0.0)


def model_forward_flops(model: ModelConfig, span_length: int, end: int, batch: int = 1,
                        embedding_as_gemm: bool = False) -> float:
    """Forward FLOPs of the whole model (all layers and the logits) on one span."""
    layers = layer_flops(model, span_length, end, batch).scaled(model.num_layers)
    return (layers + logits_flops(model, span_length, batch, embedding_as_gemm)).forward


def iteration_flops(model: ModelConfig, seq_length: int, global_batch_size: int) -> float:
    """Model FLOPs of one training iteration as the paper counts them for TFLOPS.

    3 x forward FLOPs of the global batch (forward + twice for backward), causal attention counted
    at half, the input embedding counted as a GEMM, no recompute term. Divide by iteration time
    and GPU count for TFLOPS per GPU.
    """
    return 3 * model_forward_flops(model, seq_length, seq_length, global_batch_size,
                                   embedding_as_gemm=True)


# -- bytes ------------------------------------------------------------------------------------
def layer_input_bytes(model: ModelConfig, span_length: int, batch: int = 1, tp: int = 1,
                      sequence_parallel: bool = False, bytes_per_element: int = 2) -> float:
    """Bytes of a layer's input hidden states on one span: s*b*h elements, split over TP only
    with sequence parallelism. Also what a full-recompute checkpoint keeps for its layer group."""
    divisor = tp if sequence_parallel else 1
    return span_length * batch * model.hidden_size * bytes_per_element / divisor


def softmax_stats_bytes(model: ModelConfig, span_length: int, batch: int = 1,
                        tp: int = 1) -> float:
    """Bytes of one layer's softmax statistics on one span: the fp32 logsumexp of each head and
    query (4*n*s*b/TP), which flash-style attention keeps for its backward."""
    return 4 * model.num_attention_heads * span_length * batch / tp


def _rms_norm_extra(model: ModelConfig) -> int:
    """Hidden-sized tensors a norm keeps beyond its input: 1 for torch's composite RMSNorm."""
    return int(model.normalization == "RMSNorm")


def activation_bytes(model: ModelConfig, span_length: int, batch: int = 1, tp: int = 1,
                     sequence_parallel: bool = False, bytes_per_element: int = 2,
                     dropout: bool = False) -> float:
    """Bytes one transformer layer keeps for the backward of one span, excluding the span's K/V,
    without activation recompute (see `chunk_activation_bytes` for recompute).

    Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022)
    count, per token of a layer in 16-bit, 34*h bytes + 5*n*s for the materialised attention
    matrix. With flash attention that matrix is replaced by the softmax statistics (4*n bytes,
    fp32 logsumexp), so, per token:
      - LayerNorm inputs (2h), inputs of the QKV and FC1 GEMMs (2h), dropout masks (2h bytes of
        1 byte each, only when dropout > 0: with p = 0 torch keeps no mask): split over TP only
        with sequence parallelism, else replicated;
      - Q (n*d), attention output = input of the output projection (n*d), softmax statistics,
        FC1 output = GeLU input (f), GeLU output = FC2 input (f): split over TP. With SwiGLU
        (megatron's unfused gated unit, the one that runs here) 5f: FC1's output (2f), the SiLU
        of its gate half (f), the up half plus `glu_linear_offset` (a new tensor, f) and their
        product = FC2 input (f); megatron's fused bias-SwiGLU kernel would keep 3f.
      - RMSNorm (torch's composite `rms_norm`, measured on torch 2.13) keeps the normalised input
        before the weight as well as the input: 2h per norm instead of LayerNorm's h.
      - RoPE's cos and sin of the span, once for Q and once for K (4*d): megatron's unfused
        rotary embedding (its default) computes them in each layer and the products save them;
        broadcast over heads, so not split by TP. Assumes RoPE, as the paper's models.
    K and V (2*g*d) are the span's entry in the KV cache: see `kv_cache_bytes`; the cache and the
    graph share their storage, so adding the two gives the span's whole footprint.
    Assumptions: the runtime keeps no concatenated copy of the prefix's K/V, embeddings and
    logits (first and last stage only) are not included.
    """
    n, d, f = model.num_attention_heads, model.kv_channels, model.ffn_hidden_size
    tokens = span_length * batch
    norm_and_gemm_inputs = (4 + 2 * _rms_norm_extra(model)) * layer_input_bytes(
        model, span_length, batch, tp, sequence_parallel, bytes_per_element)
    masks = (2 * tokens * model.hidden_size / (tp if sequence_parallel else 1)
             if dropout else 0.0)
    mlp = 5 * f if model.swiglu else 2 * f
    sharded = tokens * (2 * n * d + mlp) * bytes_per_element / tp
    rope = tokens * 4 * d * bytes_per_element
    return norm_and_gemm_inputs + masks + sharded + rope + softmax_stats_bytes(
        model, span_length, batch, tp)


# -- activation recompute ---------------------------------------------------------------------
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def _refuse_full_only_flags(method: str | None, num_layers: int | None) -> None:
    for flag, value in (("--recompute-method", method), ("--recompute-num-layers", num_layers)):
        if value is not None:
            raise ScheduleError(f"{flag} needs --recompute-granularity full")


@dataclass(frozen=True)
class Recompute:
    """Megatron's activation recompute (--recompute-granularity, --recompute-method,
    --recompute-num-layers), with Megatron's meanings.

    "selective": the core attention (Megatron's default recompute module) re-runs its forward
    in the backward, from Q and the cached K/V. "full": whole layers re-run their forward in the
    backward from the checkpointed input of their group; method "uniform" cuts each model chunk's
    layers into groups of `num_layers`, "block" checkpoints the first `num_layers` layers of each
    chunk, one layer each, and leaves the others as without recompute. As the training harness
    (megatron/training/arguments.py) does, full recompute defaults to uniform groups of 1 layer.
    """

    granularity: str
    method: str | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ScheduleError(f"--recompute-granularity {self.granularity!r}: choose from "
                                f"{', '.join(RECOMPUTE_GRANULARITIES)}")
        if self.granularity != "full":
            _refuse_full_only_flags(self.method, self.num_layers)
            return
        if self.method is None:
            object.__setattr__(self, "method", "uniform")
        if self.num_layers is None:
            object.__setattr__(self, "num_layers", 1)
        if self.method not in RECOMPUTE_METHODS:
            raise ScheduleError(f"--recompute-method {self.method!r}: choose from "
                                f"{', '.join(RECOMPUTE_METHODS)}")
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ScheduleError(f"--recompute-num-layers must be at least 1, "
                                f"got {self.num_layers!r}")

    @classmethod
    def from_flags(cls, granularity: str | None, method: str | None = None,
                   num_layers: int | None = None) -> "Recompute | None":
        """The recompute the three flags ask for; None (no recompute) without a granularity."""
        if granularity is None:
            _refuse_full_only_flags(method, num_layers)
            return None
        return cls(granularity, method, num_layers)

    def check_chunk_layers(self, counts: Sequence[int]) -> None:
        """Uniform groups must divide every model chunk's layer count (`counts`): megatron-core
        would index past a chunk's last layer. ScheduleError, one line naming the flag."""
        if self.method != "uniform":
            return
        bad = [count for count in counts if count % self.num_layers]
        if bad:
            raise ScheduleError(f"--recompute-num-layers {self.num_layers} must divide the "
                                f"{bad[0]} layers of a model chunk with --recompute-method "
                                "uniform")

    def describe(self) -> str:
        """One line for tool output, e.g. "full recompute, uniform groups of 2 layers"."""
        if self.granularity == "selective":
            return "selective recompute (core attention)"
        layers = f"{self.num_layers} layer{'s' if self.num_layers > 1 else ''}"
        if self.method == "uniform":
            return f"full recompute, uniform groups of {layers}"
        return f"full recompute of the first {layers} of each chunk (block)"


def chunk_activation_bytes(model: ModelConfig, layers: int, span_length: int, batch: int = 1,
                           tp: int = 1, sequence_parallel: bool = False,
                           bytes_per_element: int = 2,
                           recompute: Recompute | None = None) -> float:
    """Bytes a model chunk of `layers` layers keeps for the backward of one span, excluding its
    K/V: every recompute mode still fills the K/V cache in the forward and holds it as without
    recompute (see `kv_cache_bytes`).

    - no recompute: `layers` x `activation_bytes`;
    - selective: the core attention's forward re-runs in the backward, so a layer no longer keeps
      its softmax statistics (`softmax_stats_bytes`); Q stays (the recompute's input) and so does
      the attention output (the output projection's input). With flash-style attention, which
      this estimate assumes, that saves little; with an eager kernel it saves the s x E score and
      probability matrices of every head, the term flash attention never materialises;
    - full, uniform N: each group of N consecutive layers keeps only its input
      (`layer_input_bytes`). N must divide `layers`: megatron-core 0.16's loop
      (`while l < num_layers: checkpoint(l, l + N)`) indexes past the chunk's last layer
      otherwise (IndexError, checked on CPU);
    - full, block N: the first min(N, layers) layers keep their input, the others as without
      recompute.
    """
    plain = activation_bytes(model, span_length, batch, tp, sequence_parallel, bytes_per_element)
    if recompute is None:
        return layers * plain
    if recompute.granularity == "selective":
        return layers * (plain - softmax_stats_bytes(model, span_length, batch, tp))
    checkpoint = layer_input_bytes(model, span_length, batch, tp, sequence_parallel,
                                   bytes_per_element)
    if recompute.method == "uniform":
        if layers % recompute.num_layers:
            raise ScheduleError(
                f"--recompute-num-layers {recompute.num_layers} does not divide the {layers} "
                "layers of a model chunk: megatron-core's uniform recompute would index past "
                "the chunk's last layer")
        return layers // recompute.num_layers * checkpoint
    checkpointed = min(recompute.num_layers, layers)
    return checkpointed * checkpoint + (layers - checkpointed) * plain


def kv_cache_bytes(model: ModelConfig, span_length: int, batch: int = 1, tp: int = 1,
                   bytes_per_element: int = 2) -> float:
    """Bytes of one layer's K and V for one span: 2*s*b*g*d*bytes/TP.

    The runtime keeps one contiguous K and one V buffer per (micro-batch, model chunk, layer),
    sized for the whole sequence: allocated at the micro-batch's first forward F(i,0), written
    span by span, read through prefix views (no concatenated copy), freed after its last backward
    B(i,0). So a micro-batch in flight holds the sum of this over all its spans, from F(i,0) on;
    the simulator's replay counts it that way. From the micro-batch's first backward (its last
    span's B) to B(i,0) the cache also accumulates the later spans' dK/dV for the rows of spans
    0..k-2, in fp32 whatever the training precision: these bytes again for those spans at 4 bytes
    per element (`simulate.ACCUMULATOR_BYTES`), twice them in bf16 training.
    """
    return 2 * span_length * batch * model.num_query_groups * model.kv_channels \
        * bytes_per_element / tp


def logits_bytes(model: ModelConfig, span_length: int, batch: int = 1, tp: int = 1) -> float:
    """Bytes the loss keeps for the backward of one span on the last stage: s*b*Vv/TP*4.

    megatron's vocab-parallel cross entropy casts the logits to fp32 and keeps the softmax (fp32,
    whatever the training precision) until the span's backward; the 16-bit logits themselves are
    freed after the forward. Pass the padded vocabulary in `model.vocab_size`.
    """
    return span_length * batch * model.vocab_size / tp * 4


def output_layer_input_bytes(model: ModelConfig, span_length: int, batch: int = 1, tp: int = 1,
                             sequence_parallel: bool = False,
                             bytes_per_element: int = 2) -> float:
    """Bytes the last stage keeps for the backward of its head on one span: the final norm's
    input and the output layer's input (the norm's output), 2*s*b*h elements (3 with RMSNorm, see
    `activation_bytes`), split over TP only with sequence parallelism (the output GEMM saves its
    sharded input and gathers it again)."""
    tensors = 2 + _rms_norm_extra(model)
    return tensors * span_length * batch * model.hidden_size * bytes_per_element \
        / (tp if sequence_parallel else 1)


def recomputed_activation_bytes(model: ModelConfig, span_length: int, batch: int = 1,
                                tp: int = 1, sequence_parallel: bool = False,
                                bytes_per_element: int = 2,
                                recompute: Recompute | None = None) -> float:
    """Activations full recompute rebuilds for one span while one checkpointed group
    back-propagates (N layers with uniform, 1 with block; 0 without full recompute).

    They are saved tensors for that moment, so the runtime's saved-tensor meter sees them on top
    of what is held for backward; part of `backward_workspace_bytes`."""
    if recompute is None or recompute.granularity != "full":
        return 0.0
    group = recompute.num_layers if recompute.method == "uniform" else 1
    return group * activation_bytes(model, span_length, batch, tp, sequence_parallel,
                                    bytes_per_element)


def backward_workspace_bytes(model: ModelConfig, span_length: int, batch: int = 1, tp: int = 1,
                             bytes_per_element: int = 2, last_stage: bool = False, *,
                             sequence_parallel: bool = False,
                             recompute: Recompute | None = None) -> float:
    """Transient bytes of one backward on one span, on top of what is kept for backward.

    The largest working set of a layer's backward is its MLP: the gradients of the FC1 output and
    of the GeLU output (2*s*b*f/TP elements; 3*s*b*f/TP with SwiGLU, whose FC1 output is 2f)
    while the layer's output gradient and its (on TP with sequence parallelism, all-gathered)
    input live (2*s*b*h): 2*s*b*(f/TP + h) elements. With
    full recompute the recomputed group's whole activations (`activation_bytes` of N layers with
    uniform, of 1 layer with block) live on top of that while the group back-propagates.
    Selective recompute adds nothing: the core attention re-runs after the layer's MLP and
    output projection have back-propagated and released more (their saved tensors, among them
    the attention output the recompute rebuilds) than it rebuilds. On the last stage the logits'
    gradient (s*b*Vv/TP, 16-bit), taken before any layer's backward, can be larger. An estimate
    of the peak allocator demand, not a count of saved tensors.
    """
    e = bytes_per_element
    mlp_grads = model.fc1_width + model.ffn_hidden_size
    layer = span_length * batch * (mlp_grads / tp + 2 * model.hidden_size) * e
    layer += recomputed_activation_bytes(model, span_length, batch, tp, sequence_parallel, e,
                                         recompute)
    if not last_stage:
        return layer
    return max(layer, span_length * batch * model.vocab_size / tp * e)


# -- parameters -------------------------------------------------------------------------------
def stage_parameters(model: ModelConfig, num_layers: int, *, first: bool, last: bool,
                     tp: int = 1) -> float:
    """Parameters one GPU of a pipeline stage holds: `num_layers` layers, plus the word embedding
    on the first stage and the final LayerNorm and (untied) output layer on the last stage.

    Megatron GPT with RoPE (no position-embedding table), biases unless `add_bias_linear` is off
    (the QKV bias stays with `add_qkv_bias`), LayerNorm or RMSNorm, GeLU or SwiGLU (FC1 twice as
    wide). TP splits the QKV, FC1 (weights and biases), output projection and FC2 weights and the
    vocabulary; the norms and the row-parallel biases are replicated.
    """
    h, n, g, d, f = model.hidden_size, model.num_attention_heads, model.num_query_groups, \
        model.kv_channels, model.ffn_hidden_size
    qkv, fc1, bias = (n + 2 * g) * d, model.fc1_width, int(model.add_bias_linear)
    qkv_bias = int(model.add_bias_linear or model.add_qkv_bias)
    sharded = (h + qkv_bias) * qkv + n * d * h + (h + bias) * fc1 + f * h
    replicated = 2 * bias * h + 2 * model.norm_parameters  # row-parallel biases; 2 norms
    params = num_layers * (sharded / tp + replicated)
    vocab = model.vocab_size * h / tp
    if first:
        params += vocab
    if last:
        params += vocab + model.norm_parameters
    return params
