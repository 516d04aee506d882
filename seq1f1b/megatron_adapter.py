"""Where Seq1F1B meets megatron-core: the span-aware layer spec and model chunks.

Everything here is megatron's own GPT model, built through ModuleSpec injection instead of patches:
the local layer spec with `SpanAttention` as core attention, a norm that also works under sequence
parallelism, and a rotary embedding that knows the absolute positions of a span.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import sharded_state_dict_default

from seq1f1b.plan.actions import virtual_stage
from seq1f1b.plan.stage_layers import EVEN, StageLayers, layers_per_virtual_stage
from seq1f1b.runtime.attention import SpanAttention, SpanSelfAttention
from seq1f1b.runtime.context_parallel import ContextParallelSpanAttention
from seq1f1b.runtime import tied_output
from seq1f1b.runtime.positions import make_span_aware, use_position_ids
from seq1f1b.runtime.wgrad import (
    SplitBackwardColumnParallelLinear,
    SplitBackwardRowParallelLinear,
    make_split_backward,
)

POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass(frozen=True)
class Architecture:
    """What makes a GPT Llama-, Mistral- or Qwen2-shaped, with Megatron-LM's flag names.

    One record for every path that builds a model (pretrain_gpt.py, check_equivalence.py, the
    Hugging Face converter, benchmarks), so a flag cannot reach one of them and miss another.
    `transformer_fields()` goes into megatron's TransformerConfig, `rotary_kwargs()` into
    GPTModel; megatron-core implements all of it, Seq1F1B only has to keep it exact per span
    (the span norm does RMSNorm, the span rotary embedding keeps megatron's frequencies).
    """

    num_query_groups: Optional[int] = None    # --group-query-attention --num-query-groups
    swiglu: bool = False                      # --swiglu: gated SiLU MLP (three GEMMs)
    normalization: str = "LayerNorm"          # --normalization
    norm_epsilon: float = 1e-5                # --norm-epsilon
    add_bias_linear: bool = True              # not --disable-bias-linear
    add_qkv_bias: bool = False                # --add-qkv-bias (Qwen2)
    rotary_base: int = 10000                  # --rotary-base
    rotary_percent: float = 1.0               # --rotary-percent
    rotary_seq_len_interpolation_factor: Optional[float] = None
    use_rope_scaling: bool = False            # --use-rope-scaling: Llama 3.x frequencies
    rope_scaling_factor: float = 8.0          # --rope-scaling-factor

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"--normalization {self.normalization!r}: choose from "
                             f"{', '.join(NORMALIZATIONS)}")

    @classmethod
    def from_args(cls, args) -> "Architecture":
        """The architecture flags of a parsed command line (missing ones keep the defaults);
        `--disable-bias-linear` is the negation of `add_bias_linear`."""
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if getattr(args, f.name, None) is not None}
        if getattr(args, "disable_bias_linear", False):
            given["add_bias_linear"] = False
        return cls(**given)

    def transformer_fields(self) -> dict:
        """TransformerConfig fields, as Megatron-LM's `core_transformer_config_from_args` sets
        them (SwiGLU: gated linear unit with SiLU, unfused on the CPU)."""
        result = dict(num_query_groups=self.num_query_groups, normalization=self.normalization,
                      layernorm_epsilon=self.norm_epsilon, add_bias_linear=self.add_bias_linear,
                      add_qkv_bias=self.add_qkv_bias)
        if self.swiglu:
            result.update(gated_linear_unit=True, activation_func=F.silu)
        return result

    def rotary_kwargs(self) -> dict:
        """GPTModel's rotary arguments."""
        return dict(rotary_base=self.rotary_base, rotary_percent=self.rotary_percent,
                    seq_len_interpolation_factor=self.rotary_seq_len_interpolation_factor,
                    rope_scaling=self.use_rope_scaling,
                    rope_scaling_factor=self.rope_scaling_factor)


def layout_entries(counts: tuple[int, ...]) -> list[list[str]]:
    """What each virtual stage holds, in stage order, in megatron's layout names: the embedding
    opens the first, `counts[v]` decoder layers, the loss closes the last."""
    return [["embedding"] * (index == 0) + ["decoder"] * count
            + ["loss"] * (index == len(counts) - 1) for index, count in enumerate(counts)]


class VShapeLayerLayout(PipelineParallelLayerLayout):
    """megatron-core's pipeline layout for two chunks per rank in a V (the `vshape` placement of
    zbv, seq1f1b-zbv, seq1f1b-zb-auto): chunk 0 of rank r is virtual stage r, chunk 1 is stage
    2P-1-r, so rank 0 holds the embedding and the loss.

    megatron's layout lists what each (rank, chunk) holds, but counts a chunk's layer offset in its
    loop order (chunk-major); the V's offsets run in stage order instead, which is all this class
    changes. Set as `TransformerConfig.pipeline_model_parallel_layout`, it gives every layer its
    global number through megatron's own `get_transformer_layer_offset`, so the layers' sharded
    state dict (checkpoints, the equivalence check's weight copy) names the right layers.
    """

    def __init__(self, pp: int, num_layers: int, split: StageLayers = EVEN) -> None:
        """`split`: uneven first / last stages, on a V virtual stages 0 and 2P-1
        (seq1f1b/plan/stage_layers.py)."""
        if pp < 2:
            raise ValueError("a V placement needs --pipeline-model-parallel-size >= 2 "
                             "(megatron gives every chunk of a single stage offset 0)")
        if not split.uneven and num_layers % (2 * pp):
            raise ValueError(f"--num-layers {num_layers}: a V of two chunks on {pp} pipeline "
                             f"ranks needs a multiple of {2 * pp} layers")
        stages = layout_entries(layers_per_virtual_stage(num_layers, pp, 2, "vshape", split))
        # megatron's flat order: entry c*P + r is chunk c of rank r.
        super().__init__([stages[virtual_stage("vshape", pp, rank, chunk)]
                          for chunk in range(2) for rank in range(pp)], pp)
        self.flatten_layout = [LayerType[name] for stage in stages for name in stage]

    def get_layer_offset(self, layer_type: LayerType = LayerType.decoder,
                         vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> int:
        """Layers of `layer_type` on the stages before this chunk's, in stage order."""
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if vp_stage is None:
            raise ValueError("a V placement builds each chunk with its vp_stage")
        pp = self.pipeline_model_parallel_size
        before = virtual_stage("vshape", pp, pp_rank, vp_stage)
        return sum(self.layout[rank][chunk].count(layer_type)
                   for rank in range(pp) for chunk in range(2)
                   if virtual_stage("vshape", pp, rank, chunk) < before)


def chunk_roles(placement: str, pp: int, rank: int, chunk: int, chunks: int) -> tuple[bool, bool]:
    """(pre_process, post_process) of model chunk `chunk` on pipeline rank `rank`: whether it
    holds the first virtual stage (embedding) or the last (output layer and loss)."""
    stage = virtual_stage(placement, pp, rank, chunk)
    return stage == 0, stage == pp * chunks - 1


class SequenceParallelNorm(MegatronModule):
    """LayerNorm / RMSNorm (per `config.normalization`) usable with sequence parallelism.

    megatron's torch fallback norm refuses sequence parallelism (TE and Apex norms accept it). A
    norm is per token, so it works on a sequence shard unchanged; what SP needs is that each TP
    rank's partial weight grads get summed: the params are marked `sequence_parallel`, which
    megatron's `finalize_model_grads` all-reduces over the TP group. Parameter names match torch's
    norms.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: Optional[float] = None) -> None:
        super().__init__(config=config)
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization {config.normalization}: only LayerNorm and RMSNorm")
        if config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("persist/memory-efficient layer norm need Apex; turn them off")
        self.hidden_size = hidden_size
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        make = functools.partial(torch.empty, hidden_size, device=device,
                                 dtype=config.params_dtype)
        gamma_init = torch.nn.init.zeros_ if self.zero_centered_gamma else torch.nn.init.ones_
        self.weight = torch.nn.Parameter(gamma_init(make()))
        self.bias = (torch.nn.Parameter(torch.nn.init.zeros_(make()))
                     if config.normalization == "LayerNorm" else None)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.bias is None:
            return F.rms_norm(hidden, (self.hidden_size,), weight, self.eps)
        return F.layer_norm(hidden, (self.hidden_size,), weight, self.bias, self.eps)


class OutputHead(LanguageModule):
    """The final norm, the output layer and the loss of the last stage, as a module of its own:
    what an O action runs (the output layer spread over the pipeline ranks, actions.OPS).

    Every pipeline rank holds one, as a child `output_head` of its last model chunk, whose
    GPTModel then stops before the final norm on the last stage (built with post_process
    False), so the last stage sends its hidden states on like any other stage. It behaves as a
    GPT chunk of no layers with pre_process False and post_process True: `forward_step_func(data,
    head)` reads the span's labels and calls it with them, its input comes through
    `set_input_tensor`; the layers are megatron's own (the norm of the layer spec, the
    ColumnParallelLinear GPTModel builds, LanguageModule's loss), so its numbers are the last
    stage's.

    The copies are one parameter: the last stage's is the owner; the others are marked `shared`
    (megatron counts such a gradient once in the grad norm) and give their checkpoint entries a
    non-zero replica id, under the names the last stage's GPTModel gives them
    (`decoder.final_layernorm.*`, `output_layer.weight`), so a checkpoint is the same with the
    layer spread or not and every copy loads the owner's weights. Each parameter also gets a
    gradient bucket of its own (`shared_embedding`, as megatron does for a tied embedding), so
    the distributed optimizer shards it alike on every pipeline rank; the executor sums the
    copies' gradients over the pipeline group after the data-parallel reduction. `tied`: the
    output weight is a copy of the word embedding (runtime/tied_output.py), stored under the
    embedding's key on every rank, as megatron stores a tied last stage's.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, owner: bool,
                 parallel_output: bool = True,
                 pg_collection: Optional[ProcessGroupCollection] = None,
                 tied: bool = False) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.pre_process, self.post_process = False, True
        self.owner = owner
        self.final_layernorm = SequenceParallelNorm(config, config.hidden_size,
                                                    eps=config.layernorm_epsilon)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, vocab_size, config=config, init_method=config.init_method,
            bias=False, skip_bias_add=False, gather_output=not parallel_output,
            tp_group=self.pg_collection.tp)
        self.input_tensor: Optional[torch.Tensor] = None
        for param in self.parameters():
            param.shared_embedding = True
            param.shared = not owner
        self.tied = tied
        if tied:
            tied_output.mark_copy(self.output_layer.weight)

    def set_input_tensor(self, input_tensor) -> None:
        """The last stage's hidden states of one span (a list, as megatron passes them)."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, labels=None,
                **kwargs) -> torch.Tensor:
        """Per-token losses [b, s] with `labels`, else the logits [b, s, V/TP], as GPTModel's."""
        logits, _ = self.output_layer(self.final_layernorm(self.input_tensor))
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """This module's entries (under its own names, which load_state_dict reads) stored as
        the last stage's (`decoder.final_layernorm.*`, `output_layer.*`: `prefix` without this
        module's name, which the chunk appends); replica id 1 on every rank but the owner's
        (on every rank for a tied output weight, which is stored as the embedding)."""
        base = prefix[:-len("output_head.")] if prefix.endswith("output_head.") else prefix
        entries = {}
        for local, stored, module in (("final_layernorm.", "decoder.final_layernorm.",
                                       self.final_layernorm),
                                      ("output_layer.", "output_layer.", self.output_layer)):
            part = sharded_state_dict_default(module, prefix + local, sharded_offsets, metadata)
            for entry in part.values():
                if isinstance(entry, ShardedBase):
                    entry.key = base + stored + entry.key[len(prefix + local):]
                    copy = not self.owner
                    if self.tied and entry.key == base + "output_layer.weight":
                        entry.key = base + "embedding.word_embeddings.weight"
                        entry.allow_shape_mismatch = True
                        copy = True
                    if copy:
                        replica = entry.replica_id
                        entry.replica_id = ((1, *replica[1:]) if isinstance(replica, tuple)
                                            else (1, replica))
            entries.update(part)
        return entries


def span_layer_spec(config: TransformerConfig, attention_backend: str = "auto",
                    split_backward: bool = False) -> ModuleSpec:
    """megatron's local GPT layer spec with `SpanAttention` and `SequenceParallelNorm` injected.

    `split_backward`: the four linears (QKV, attention projection, FC1, FC2) defer their weight
    gradients to W actions (runtime/wgrad.py), for the zero-bubble schedules. With gradient
    accumulation fusion they are those linears too (outside a W key they back-propagate as
    megatron's): their autograd function keeps the fused path right under saved-tensor hooks.
    """
    if config.num_moe_experts or config.multi_latent_attention:
        raise NotImplementedError("Seq1F1B's layer spec covers dense GPT layers (no MoE, no MLA)")
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                    normalization=config.normalization)
    layer = spec.submodules
    layer.input_layernorm = SequenceParallelNorm
    layer.pre_mlp_layernorm = SequenceParallelNorm
    layer.self_attention.module = SpanSelfAttention
    attention = layer.self_attention.submodules
    core = ContextParallelSpanAttention if config.context_parallel_size > 1 else SpanAttention
    attention.core_attention = functools.partial(core, backend=attention_backend)
    if config.qk_layernorm:
        attention.q_layernorm = SequenceParallelNorm
        attention.k_layernorm = SequenceParallelNorm
    if split_backward or config.gradient_accumulation_fusion:
        mlp = layer.mlp.submodules
        attention.linear_qkv = mlp.linear_fc1 = SplitBackwardColumnParallelLinear
        attention.linear_proj = mlp.linear_fc2 = SplitBackwardRowParallelLinear
    return spec


def span_block_spec(config: TransformerConfig, attention_backend: str = "auto",
                    vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                    split_backward: bool = False) -> TransformerBlockSubmodules:
    """The decoder block of one model chunk: its layers plus a final norm that allows SP."""
    layer = span_layer_spec(config, attention_backend, split_backward)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * count,
                                      layer_norm=SequenceParallelNorm)


def build_model_chunk(config: TransformerConfig, *, vocab_size: int, max_sequence_length: int,
                      position_embedding_type: str = "rope", pre_process: bool = True,
                      post_process: bool = True, vp_stage: Optional[int] = None,
                      attention_backend: str = "auto",
                      share_embeddings_and_output_weights: bool = False,
                      parallel_output: bool = True,
                      architecture: Architecture = Architecture(),
                      pg_collection: Optional[ProcessGroupCollection] = None,
                      split_backward: bool = False,
                      reset_position_ids: bool = False,
                      spread_output: bool = False) -> GPTModel:
    """One GPTModel chunk (the layers of `vp_stage` on this pipeline rank) that can run spans.

    `config` must come from `architecture.transformer_fields()` (make_transformer_config does
    that); the architecture's rotary settings go to GPTModel here. `split_backward`: the layers'
    linears (span_layer_spec) and the output layer defer their weight gradients to W actions
    (runtime/wgrad.py). `reset_position_ids`: RoPE rows from the per-token position_ids (packed
    documents whose positions restart; runtime/positions.py). `spread_output`: the output layer
    runs as O actions on any pipeline rank (a schedule with O's, actions.OPS): the rank's last
    chunk gets an `OutputHead` (the owner's on the last stage, whose GPTModel then ends before
    the final norm). `share_embeddings_and_output_weights` on a V (the last stage beside the
    embedding on rank 0) or with the layer spread: tied by runtime/tied_output.py, where
    megatron's tying would hang."""
    if position_embedding_type not in POSITION_EMBEDDINGS:
        raise ValueError(f"--position-embedding-type {position_embedding_type!r}: Seq1F1B spans "
                         f"support {', '.join(POSITION_EMBEDDINGS)}")
    # On a V or with the layer spread megatron's tying would hang: built untied, tied here
    tied_here = share_embeddings_and_output_weights and (
        spread_output or isinstance(config.pipeline_model_parallel_layout, VShapeLayerLayout))
    head_chunk = spread_output and (vp_stage or 0) == (
        config.virtual_pipeline_model_parallel_size or 1) - 1
    owner, post_process = post_process, post_process and not spread_output
    pp_group = getattr(pg_collection, "pp", None)
    model = GPTModel(
        config=config,
        transformer_layer_spec=span_block_spec(
            config, attention_backend, vp_stage,
            pp_rank=pp_group.rank() if pp_group is not None else None,
            split_backward=split_backward),
        vocab_size=vocab_size, max_sequence_length=max_sequence_length,
        pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights and not tied_here,
        position_embedding_type=position_embedding_type, **architecture.rotary_kwargs(),
        pg_collection=pg_collection, vp_stage=vp_stage)
    if tied_here and pre_process:
        tied_output.mark_embedding(model)
    if tied_here and post_process:
        # a V's last stage: tied from here on as megatron ties a last stage (its forward passes
        # the weight, its checkpoint entry is the embedding's), the values kept by tied_output
        model.share_embeddings_and_output_weights = True
        tied_output.mark_copy(model.output_layer.weight)
    if position_embedding_type == "rope":
        make_span_aware(model.rotary_pos_emb)
    if reset_position_ids and position_embedding_type == "rope":
        use_position_ids(model)
    if head_chunk:
        model.output_head = OutputHead(config, vocab_size, owner, parallel_output,
                                       pg_collection, tied=tied_here)
    if split_backward or config.gradient_accumulation_fusion:
        if post_process:
            make_split_backward(model.output_layer)
        if head_chunk:
            make_split_backward(model.output_head.output_layer)
    return model


def make_transformer_config(*, num_layers: int, hidden_size: int, num_attention_heads: int,
                            ffn_hidden_size: Optional[int] = None,
                            architecture: Architecture = Architecture(),
                            tensor_model_parallel_size: int = 1,
                            pipeline_model_parallel_size: int = 1,
                            virtual_pipeline_model_parallel_size: Optional[int] = None,
                            sequence_parallel: bool = False, fp32: bool = True,
                            hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
                            placement: str = "loop", stage_layers: StageLayers = EVEN,
                            **overrides) -> TransformerConfig:
    """A TransformerConfig for tests and tools from a few numbers.

    Dropout defaults to 0 (exact comparisons), fp32 or bf16, CPU initialisation when there is no
    GPU; megatron-core's dataclass defaults already keep the fused kernels off (on the CPU each
    costs seconds of inductor compilation). Pipeline stage outputs are freed after their send
    (`deallocate_pipeline_outputs`, which Megatron-LM's training always turns on; the dataclass
    default keeps every in-flight output). `architecture` gives the layer's shape (GQA, SwiGLU,
    norm, biases); `placement` "vshape" lays the chunks out in a V (VShapeLayerLayout);
    `stage_layers`: uneven first / last stages or a layout (stage_layers.py), megatron's
    num_layers_in_first/last_pipeline_stage or pipeline_model_parallel_layout on a loop, the V's
    layout on a V;
    `overrides` go to TransformerConfig unchanged.
    """
    dtype = torch.float32 if fp32 else torch.bfloat16
    fields = dict(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size, **architecture.transformer_fields(),
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        sequence_parallel=sequence_parallel, hidden_dropout=hidden_dropout,
        attention_dropout=attention_dropout, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=not fp32, use_cpu_initialization=not torch.cuda.is_available(),
        deallocate_pipeline_outputs=True)
    if placement == "vshape":
        fields["pipeline_model_parallel_layout"] = VShapeLayerLayout(
            pipeline_model_parallel_size, num_layers, stage_layers)
    elif stage_layers.uneven:
        counts = layers_per_virtual_stage(    # checked, in words
            num_layers, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1,
            placement, stage_layers)
        if stage_layers.counts is not None:   # a loop's stage order is megatron's flat order
            fields["pipeline_model_parallel_layout"] = PipelineParallelLayerLayout(
                layout_entries(counts), pipeline_model_parallel_size)
        else:
            fields.update(num_layers_in_first_pipeline_stage=stage_layers.first,
                          num_layers_in_last_pipeline_stage=stage_layers.last)
    fields.update(overrides)
    return TransformerConfig(**fields)
