"""Is a parallel configuration exact? One iteration against the unsplit single-process model.

Every rank first builds the whole model (TP=1, PP=1) from the seed and runs the global batch through
it unsplit: that is the reference loss and gradient. Then it builds its own chunks for the asked
TP x PP x DP x V layout, copies the reference weights into them through megatron's sharded state
dict (which knows each shard's place in the global tensor), runs one iteration of the asked
schedule through megatron DDP and `finalize_model_grads`, and compares the loss and every gradient
shard with the matching slice of the reference. Data: random tokens and a loss mask with holes, so
uneven spans hold different numbers of loss tokens and a biased normalisation shows. With
`document_lengths` every sample packs documents of those lengths, each closed by an EOD token
(the last id of the vocabulary); `reset_attention_mask` / `reset_position_ids` then mask them
(document ids as the attention mask) and restart their positions, in the reference as in the
pipelined run.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from seq1f1b import megatron_adapter, platform
from seq1f1b.distributed import release_model_parallel
from seq1f1b.model_flags import (LOSS_BACKWARD_IN_FORWARD_HELP, SHAPE_FLAGS, SPREAD_OUTPUT_HELP,
                                 add_model_shape_args, default_ffn_hidden_size, heads_error,
                                 kv_channels_error, query_groups_error, sizes_error,
                                 swiglu_ffn_error)
from seq1f1b.plan import partition as span_partition
from seq1f1b.plan import registry, schedule_file
from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.budget import (MemoryCap, RunShape, ScheduleBudget, run_budget,
                                 spread_output_refusal)
from seq1f1b.plan.context_parallel import span_alignment
from seq1f1b.plan.partition import span_multiple_error
from seq1f1b.plan.costs import ModelConfig, Recompute
from seq1f1b.plan.stage_layers import StageLayers, layers_per_virtual_stage
from seq1f1b.runtime.attention import DOCUMENT_BACKENDS
from seq1f1b.runtime import wgrad_fusion
from seq1f1b.runtime.documents import document_ids, document_positions
from seq1f1b.runtime.forward_backward import (MEGATRON_SCHEDULES, SpanSettings,
                                              get_forward_backward_func, placement_of,
                                              splits_backward)


@dataclass
class EquivalenceCase:
    """One configuration to check (the flags of tools/check_equivalence.py)."""

    schedule: str = "seq1f1b"
    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None     # GQA (megatron_adapter.Architecture's fields)
    swiglu: bool = False
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    rotary_seq_len_interpolation_factor: Optional[float] = None
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    ffn_hidden_size: Optional[int] = None
    vocab_size: int = 96
    seq_length: int = 24
    micro_batch_size: int = 2
    num_microbatches: int = 4
    tp: int = 1
    pp: int = 1
    cp: int = 1                        # context parallelism (a2a around the span attention)
    chunks: int = 1
    splits: int = 1
    partition: str = "even"
    span_lengths: Optional[list[int]] = None
    span_alignment: int = 1            # every span a multiple of it (and of TP under SP, of CP)
    position_embedding_type: str = "rope"
    sequence_parallel: bool = False
    untie_embeddings: bool = False
    attention_backend: str = "auto"
    init_method_std: float = 0.2       # sharp attention: a wrong position or K/V shows
    recompute_granularity: Optional[str] = None     # None | full | selective
    recompute_method: Optional[str] = None          # uniform | block (full recompute)
    recompute_num_layers: Optional[int] = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    seed: int = 1234
    against: Optional[str] = None      # baseline schedule instead of the unsplit model
    against_no_recompute: bool = False  # baseline: this case with activation recompute off
    loss_tolerance: float = 1e-6
    grad_tolerance: float = 1e-5
    document_lengths: Optional[list[int]] = None   # the packing of every sample (EOD ends each)
    reset_attention_mask: bool = False             # document masking
    reset_position_ids: bool = False               # positions restart with each document
    schedule_memory_cap: Optional[str] = None      # a searched schedule's cap ("0.5x", bytes)
    spread_output: bool = False    # a searched schedule may run the output layer as O actions
    pipeline_schedule_file: Optional[str] = None   # the schedule from this file (schedule_file)
    decoder_first_pipeline_num_layers: Optional[int] = None   # uneven first stage (stage_layers)
    decoder_last_pipeline_num_layers: Optional[int] = None    # uneven last stage
    pipeline_model_parallel_layout: Optional[str] = None      # every stage's layers (a layout)
    gradient_accumulation_fusion: bool = True      # weight-gradient GEMMs add into main_grad
    loss_backward_in_forward: bool = False         # the output layer's backward at F


TOOL_SHAPE_DEFAULTS = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=24,
                           position_embedding_type="rope", rotary_base=10000,
                           rope_scaling_factor=8.0)
"""The checking tools' model: tiny, RoPE (pretrain_gpt.py's defaults are Megatron-LM's)."""


def add_model_flags(parser, partitions: tuple[str, ...] = ("even", "compute", "explicit"),
                    **defaults) -> None:
    """The model and layout flags of EquivalenceCase (shared by check_equivalence.py and
    benchmark.py): the model shape in pretrain_gpt.py's spelling (seq1f1b.model_flags), then
    the layout; `partitions` the --partition choices, `defaults` overrides a flag's default
    by its dest, e.g. hidden_size=256. settle_shape_flags completes them."""
    defaults = {**TOOL_SHAPE_DEFAULTS, **defaults}

    def add(flag: str, **kwargs) -> None:
        dest = flag[2:].replace("-", "_")
        if dest in defaults:
            kwargs["default"] = defaults[dest]
        parser.add_argument(flag, **kwargs)

    add_model_shape_args(parser, dests={"untie_embeddings_and_output_weights": "untie_embeddings"},
                         required="", **{name: value for name, value in defaults.items()
                            if name in SHAPE_FLAGS})
    add("--decoder-first-pipeline-num-layers", type=int, default=None, metavar="N",
        help="uneven first stage: its decoder layers (a loop: pipeline rank 0's; a V: virtual "
             "stage 0's); the other stages share the rest evenly")
    add("--decoder-last-pipeline-num-layers", type=int, default=None, metavar="N",
        help="uneven last stage: its decoder layers (a loop: pipeline rank P-1's; a V: virtual "
             "stage 2P-1's, the output layer's, on rank 0)")
    add("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
        help="every virtual stage's decoder layers, megatron's string form in stage order, "
             "e.g. 'Et|t*2|t|tL' (seq1f1b/plan/stage_layers.py)")
    add("--vocab-size", type=int, default=96)
    add("--micro-batch-size", type=int, default=2)
    add("--num-microbatches", type=int, default=4)
    add("--tp", type=int, default=1, help="tensor-parallel size")
    add("--pp", type=int, default=1, help="pipeline-parallel size")
    add("--chunks", type=int, default=1, help="model chunks per rank (interleaved schedules)")
    add("--splits", type=int, default=1, help="spans per micro-batch (k)")
    add("--partition", choices=list(partitions), default="even")
    add("--span-lengths", type=int, nargs="+", default=None,
        help="explicit span lengths (implies --partition explicit)")
    add("--span-alignment", type=int, default=1, metavar="N",
        help="every span a multiple of N tokens (pretrain_gpt.py's --seq1f1b-span-alignment): "
             "the cuts round to it, explicit lengths must be")
    add("--sequence-parallel", action="store_true")
    add("--attention-backend", choices=["auto", "eager", "sdpa", "flex", "flash", "te"],
        default="auto")
    add("--recompute-granularity", choices=["full", "selective"], default=None,
        help="activation recompute, megatron's meaning (selective = core attention)")
    add("--recompute-method", choices=["uniform", "block"], default=None,
        help="full recompute: groups of --recompute-num-layers layers (uniform) or the first "
             "--recompute-num-layers layers of each chunk (block); default uniform")
    add("--recompute-num-layers", type=int, default=None,
        help="full recompute: layers per group (uniform) or recomputed layers (block); default 1")
    add("--document-lengths", type=int, nargs="+", default=None,
        help="pack every sample with documents of these lengths (EOD ends each; they must sum "
             "to --seq-length)")
    add("--reset-attention-mask", action="store_true",
        help="document masking: a token attends only to its own document")
    add("--reset-position-ids", action="store_true",
        help="positions restart at 0 with each document")
    parser.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                        action="store_false",
                        help="weight gradients into fresh tensors that DDP adds to main_grad "
                             "(default: the GEMM accumulates into main_grad, as Megatron-LM)")
    parser.add_argument("--loss-backward-in-forward", action="store_true",
                        help=LOSS_BACKWARD_IN_FORWARD_HELP)
    parser.add_argument("--spread-output", action="store_true", help=SPREAD_OUTPUT_HELP)


def settle_shape_flags(args) -> None:
    """Fill in the model-shape flags of add_model_flags as pretrain_gpt.py does (the SwiGLU FFN
    width), or raise ValueError (one line naming the flag) for what a case cannot build:
    a size below 1, inconsistent grouped-query flags, --kv-channels other than hidden / heads, a
    hidden size the heads do not divide, a position table other than --seq-length (the case
    builds one of that size)."""
    error = (sizes_error(args) or query_groups_error(args) or kv_channels_error(args)
             or swiglu_ffn_error(args) or heads_error(args))
    if error is not None:
        raise ValueError(error)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    if args.max_position_embeddings not in (None, args.seq_length):
        raise ValueError(f"--max-position-embeddings {args.max_position_embeddings}: this tool "
                         f"builds the position table of --seq-length {args.seq_length}")


def cost_model(flags) -> ModelConfig:
    """The cost model's shape of an EquivalenceCase, or of a command line with its fields
    (add_model_flags: benchmark.py's too)."""
    return ModelConfig.of_flags(flags, vocab_size=flags.vocab_size)


def stage_layers(case: "EquivalenceCase") -> StageLayers:
    """The case's uneven first / last stages or layout (all None: even)."""
    return StageLayers.of_flags(case)


def case_budget(case: "EquivalenceCase") -> Optional[ScheduleBudget]:
    """A searched schedule's budget: the model's FLOP durations and fp32 bytes with the case's
    cut, under the case's schedule_memory_cap or the schedule's default cap (None for a schedule
    that is not searched: an --against baseline)."""
    if case.schedule in MEGATRON_SCHEDULES or not registry.get(case.schedule).searched:
        return None
    model = cost_model(case)
    shape = RunShape(model, case.seq_length, tuple(case_spans(case)), tp=case.tp,
                     sequence_parallel=case.sequence_parallel,
                     micro_batch_size=case.micro_batch_size, bytes_per_element=4,
                     recompute=Recompute.from_flags(case.recompute_granularity,
                                                    case.recompute_method,
                                                    case.recompute_num_layers),
                     stage_layers=stage_layers(case), cp=case.cp,
                     loss_backward_in_forward=case.loss_backward_in_forward,
                     spread_output=case.spread_output)
    return run_budget(case.schedule, case.pp, case.num_microbatches, case.chunks,
                      MemoryCap.parse(case.schedule_memory_cap)
                      if case.schedule_memory_cap is not None else None, shape)


def case_spans(case: "EquivalenceCase") -> list[int]:
    """The span lengths of the case's cut (ScheduleError, one line naming the flag, for a cut
    the sequence cannot take: more spans than tokens, bad --span-lengths)."""
    return span_partition.partition(
        case.seq_length, case.splits, "explicit" if case.span_lengths else case.partition,
        cost_model(case), tp=case.tp, sequence_parallel=case.sequence_parallel,
        align=span_alignment(case.cp, case.tp, case.sequence_parallel, case.span_alignment),
        lengths=case.span_lengths)


def case_placement(case: "EquivalenceCase") -> str:
    """How the case's chunks are laid out: its schedule's placement, a searched one's choice."""
    return placement_of(case.schedule, case.pp, case.num_microbatches, case.splits, case.chunks,
                        case_budget(case))


def check_stage_layers(case: "EquivalenceCase") -> None:
    """Layers that cannot be dealt on the case's layout (uneven first / last stages, or even
    ones that pp x chunks does not divide), refused before any work (ScheduleError, one line
    naming the flag) rather than by megatron inside the ranks."""
    layers_per_virtual_stage(case.num_layers, case.pp, case.chunks, case_placement(case),
                             stage_layers(case))


def check_layout(case: "EquivalenceCase") -> None:
    """What the ranks would refuse only after the reference run, refused before any work
    (ValueError, one line naming the flag): chunks a schedule does not run on, a cut the
    sequence cannot take, layers the stages cannot share."""
    check_chunks(case)
    check_span_alignment(case)
    case_spans(case)
    check_stage_layers(case)


def check_span_alignment(case: "EquivalenceCase") -> None:
    """--span-alignment N (with TP under sequence parallelism and CP, their lcm): the sequence
    must hold --splits spans of its multiples, explicit lengths must be multiples (ValueError,
    one line naming the flag)."""
    if case.span_alignment == 1:
        return
    unit = span_alignment(case.cp, case.tp, case.sequence_parallel, case.span_alignment)
    error = span_multiple_error(case.seq_length, case.splits, case.span_lengths, unit,
                                f"--span-alignment {case.span_alignment}" + (
                                    f" with the TP / CP multiple = {unit}"
                                    if unit != case.span_alignment else ""), "--")
    if error is not None:
        raise ValueError(error)


def check_chunks(case: "EquivalenceCase") -> None:
    """--chunks that the case's schedule or its --against baseline does not run on (ValueError,
    one line)."""
    for name in filter(None, (case.schedule, case.against)):
        if is_chunked(name) not in (None, case.chunks > 1):
            raise ValueError(f"--chunks {case.chunks} does not fit schedule {name!r}")


def check_budget(case: "EquivalenceCase") -> None:
    """A memory cap for a schedule that is not searched, or one no order fits (with the output
    layer spread too, `case.spread_output`), refused before any work (ValueError:
    ScheduleError, one line)."""
    if case.schedule_memory_cap is None and not case.spread_output:
        return
    if case.schedule_memory_cap is not None and (
            case.schedule in MEGATRON_SCHEDULES or not registry.get(case.schedule).searched):
        raise ValueError(f"--schedule-memory-cap: schedule {case.schedule} is not searched; it "
                         "takes no memory cap (seq1f1b-zb-auto does)")
    case_plan(case)


def check_spread_output(schedule: str, loss_backward_in_forward: bool,
                        schedule_flag: str) -> None:
    """--spread-output for `schedule` (named by `schedule_flag`), refused (ValueError, one line)
    where pretrain_gpt.py refuses it (budget.spread_output_refusal)."""
    refusal = spread_output_refusal(schedule, loss_backward_in_forward, schedule_flag)
    if refusal is not None:
        raise ValueError(refusal)


def case_plan(case: "EquivalenceCase") -> Schedule:
    """The plan the case's schedule runs (a searched one with its budget)."""
    return registry.build(case.schedule, case.pp, case.num_microbatches, case.splits,
                          case.chunks, budget=case_budget(case))


def check_documents(case: "EquivalenceCase") -> None:
    """The document flags of a case, checked before any work; raises ValueError (one line)."""
    lengths = case.document_lengths
    if lengths is None:
        if case.reset_attention_mask or case.reset_position_ids:
            raise ValueError("--reset-attention-mask/--reset-position-ids need "
                             "--document-lengths (the packing of every sample)")
        return
    if min(lengths) < 1:
        raise ValueError(f"--document-lengths must all be >= 1, got {' '.join(map(str, lengths))}")
    if sum(lengths) != case.seq_length:
        raise ValueError(f"--document-lengths sum to {sum(lengths)}, not --seq-length "
                         f"{case.seq_length}")
    if case.reset_attention_mask and case.attention_backend not in ("auto", *DOCUMENT_BACKENDS):
        raise ValueError(f"--reset-attention-mask: --attention-backend {case.attention_backend} "
                         f"cannot mask documents; use {', '.join(DOCUMENT_BACKENDS)}")


def case_fields(args) -> dict:
    """The EquivalenceCase fields a parsed command line carries under their own names (the flags
    of add_model_flags and any others the tool declares alike)."""
    names = {f.name for f in fields(EquivalenceCase)}
    return {name: value for name, value in vars(args).items() if name in names}


@dataclass
class EquivalenceResult:
    loss: float
    ref_loss: float
    loss_rel_diff: float
    max_rel_grad_diff: float
    worst_param: str
    params_compared: int
    passed: bool
    case: dict = field(default_factory=dict)


def _recompute_fields(case: EquivalenceCase) -> dict:
    if case.recompute_granularity == "full":
        return dict(recompute_granularity="full", recompute_method=case.recompute_method or
                    "uniform", recompute_num_layers=case.recompute_num_layers or 1)
    if case.recompute_granularity == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if case.recompute_granularity is not None:
        raise ValueError(f"--recompute-granularity {case.recompute_granularity!r}: "
                         "choose full or selective")
    return {}


def _config(case: EquivalenceCase, tp: int, pp: int, chunks: int, sequence_parallel: bool,
            placement: str = "loop", cp: int = 1):
    return megatron_adapter.make_transformer_config(
        context_parallel_size=cp, cp_comm_type="a2a" if cp > 1 else None,
        placement=placement, stage_layers=stage_layers(case),
        init_method_std=case.init_method_std, hidden_dropout=case.hidden_dropout,
        attention_dropout=case.attention_dropout, **_recompute_fields(case),
        num_layers=case.num_layers, hidden_size=case.hidden_size,
        num_attention_heads=case.num_attention_heads,
        architecture=megatron_adapter.Architecture.from_args(case),
        ffn_hidden_size=case.ffn_hidden_size, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        sequence_parallel=sequence_parallel,
        gradient_accumulation_fusion=wgrad_fusion.resolve(case.gradient_accumulation_fusion))


def _build(case: EquivalenceCase, config, *, pre_process: bool, post_process: bool,
           vp_stage: Optional[int], spread_output: bool = False) -> torch.nn.Module:
    """A chunk on the device, where Megatron-LM's get_model puts it: without a GPU the config
    initialises on the host (`use_cpu_initialization`), and megatron-core never moves a model.
    `spread_output`: for a plan with O actions (every rank's last chunk holds the output
    layer's copy)."""
    return megatron_adapter.build_model_chunk(
        config, vocab_size=case.vocab_size, max_sequence_length=case.seq_length,
        position_embedding_type=case.position_embedding_type, pre_process=pre_process,
        post_process=post_process, vp_stage=vp_stage,
        share_embeddings_and_output_weights=not case.untie_embeddings,
        attention_backend=case.attention_backend,
        architecture=megatron_adapter.Architecture.from_args(case),
        split_backward=splits_backward(case.schedule),
        reset_position_ids=case.reset_position_ids,
        spread_output=spread_output).to(platform.compute_device())


def global_batch(case: EquivalenceCase, dp: int) -> list[dict]:
    """DP x m micro-batches of random tokens, next-token labels and a loss mask with holes, on
    the device the model computes on (drawn on the CPU, so every device draws the same); with
    `document_lengths`, the documents' EOD tokens, and the document ids / reset positions the
    case asks for."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    shape = (case.micro_batch_size, case.seq_length)
    device = platform.compute_device()
    eod = case.vocab_size - 1
    batches = []
    for _ in range(dp * case.num_microbatches):
        vocab = case.vocab_size if case.document_lengths is None else eod
        tokens = torch.randint(0, vocab, (shape[0], shape[1] + 1), generator=gen)
        if case.document_lengths is not None:
            tokens[:, torch.tensor(case.document_lengths).cumsum(0) - 1] = eod
        batch = {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": (torch.rand(shape, generator=gen) > 0.25).float(),
            "position_ids": torch.arange(shape[1]).unsqueeze(0).expand(shape),
        }
        if case.reset_position_ids:
            batch["position_ids"] = document_positions(document_ids(batch["tokens"], eod))
        if case.reset_attention_mask:
            batch["attention_mask"] = document_ids(batch["tokens"], eod)
        batches.append({key: value.to(device).contiguous() for key, value in batch.items()})
    return batches


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron's per-token loss form: (sum of masked token losses, token count, report)."""
    losses = output.float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def forward_step(data_iterator, model):
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:
        return model(None, None, None), None
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


class Shard(NamedTuple):
    """One piece of a parameter in megatron's sharded state dict: most parameters are one
    ShardedTensor, SwiGLU's FC1 weight is two (gate and up rows, each sharded over TP on its
    own), which `offset` (in elements) locates inside the flattened parameter."""

    name: str
    sharded: ShardedTensor
    offset: int

    def part(self, tensor: torch.Tensor) -> torch.Tensor:
        """The piece of `tensor` (shaped like the parameter: the weight, its grad) it covers."""
        numel = math.prod(self.sharded.local_shape)
        return tensor.reshape(-1)[self.offset:self.offset + numel].view(self.sharded.local_shape)


def _shard_index(model: torch.nn.Module) -> list[Shard]:
    """Every parameter's pieces, with factories (SwiGLU) built into their ShardedTensors."""
    params = {p.untyped_storage().data_ptr(): (n, p) for n, p in model.named_parameters()}
    index = []
    for entry in model.sharded_state_dict().values():
        pieces = entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]
        for sharded in pieces:
            owner = params.get(sharded.data.untyped_storage().data_ptr()) \
                if isinstance(sharded, ShardedTensor) else None
            if owner is not None:
                name, param = owner
                index.append(Shard(name, sharded,
                                   sharded.data.storage_offset() - param.storage_offset()))
    return index


def _place(sharded: ShardedTensor) -> tuple[str, tuple[int, ...]]:
    """(key, offsets of the prepended layer axes): where a shard's whole tensor lives."""
    return sharded.key, tuple(sharded.global_offset[:sharded.prepend_axis_num])


def _slice(full: torch.Tensor, sharded: ShardedTensor) -> torch.Tensor:
    offsets = sharded.global_offset[sharded.prepend_axis_num:]
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, sharded.local_shape))]


def _whole_model(case: EquivalenceCase) -> torch.nn.Module:
    """The unsplit model (TP = PP = 1, no dropout, no recompute, weight gradients unfused: it
    has no DDP, so no main_grad) from the case's seed; the caller releases the model-parallel
    state it initialises."""
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(case.seed)
    config = _config(replace(case, recompute_granularity=None, hidden_dropout=0.0,
                             attention_dropout=0.0, decoder_first_pipeline_num_layers=None,
                             decoder_last_pipeline_num_layers=None,
                             pipeline_model_parallel_layout=None,
                             gradient_accumulation_fusion=False), 1, 1, 1, False)
    return _build(case, config, pre_process=True, post_process=True, vp_stage=None)


def _by_place(model: torch.nn.Module, grads: bool = False) -> dict:
    """Weights (or grads) of the whole model keyed by their place in the global tensors."""
    params = dict(model.named_parameters())
    return {_place(shard.sharded): (params[shard.name].grad if grads
                                    else params[shard.name]).detach().clone()
            for shard in _shard_index(model)}


def whole_model_weights(case: EquivalenceCase) -> dict:
    """The unsplit model's weights, as `ParallelLayout` copies them into any layout's chunks."""
    weights = _by_place(_whole_model(case))
    release_model_parallel()
    return weights


def _reference(case: EquivalenceCase, batches: list[dict]) -> tuple[float, dict, dict]:
    """Loss, weights and grads of the whole model on the whole global batch, in one process."""
    model = _whole_model(case)
    total = 0.0
    for batch in batches:
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                       labels=batch["labels"])
        loss, tokens, _ = _loss_func(batch["loss_mask"], output)
        scaled = loss / max(int(tokens), 1) / len(batches)
        scaled.backward()
        total += float(scaled)
    weights, grads = _by_place(model), _by_place(model, grads=True)
    release_model_parallel()
    return total, weights, grads


def _max_rel_diff(pairs) -> tuple[float, str, int]:
    """Worst max|g - g_ref| / max|g_ref| over (name, grad, ref) triples on this rank."""
    worst, worst_name, compared = 0.0, "", 0
    for name, grad, ref in pairs:
        scale = ref.abs().max().item()
        diff = (grad - ref).abs().max().item() / (scale if scale > 0 else 1.0)
        compared += 1
        if diff > worst or math.isnan(diff):
            worst, worst_name = diff, name
    return worst, worst_name, compared


def _worst_over_ranks(worst: float, name: str, compared: int, dp: int) -> tuple[float, str, int]:
    world = dist.get_world_size()
    device = platform.compute_device()      # NCCL takes device tensors only
    gathered = [torch.zeros(2, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([worst, float(compared)], device=device))
    names = [None] * world
    dist.all_gather_object(names, name)
    rank = max(range(world), key=lambda r: float(gathered[r][0]))
    return (float(gathered[rank][0]), names[rank],
            int(sum(float(g[1]) for g in gathered) / dp))


class ParallelLayout:
    """This rank's chunks of the case's TP x PP x V layout, wrapped in megatron DDP."""

    def __init__(self, case: EquivalenceCase, chunked: bool, ref_weights: dict) -> None:
        parallel_state.initialize_model_parallel(
            case.tp, case.pp, virtual_pipeline_model_parallel_size=case.chunks if chunked else None,
            context_parallel_size=case.cp)
        tensor_parallel.model_parallel_cuda_manual_seed(case.seed)
        placement = case_placement(case)
        config = _config(case, case.tp, case.pp, case.chunks, case.sequence_parallel, placement,
                         case.cp)
        rank = parallel_state.get_pipeline_model_parallel_rank()
        spread = case.schedule not in MEGATRON_SCHEDULES and case_plan(case).spread_output
        models, self.shards = [], []
        for chunk in range(case.chunks):
            vp = chunk if chunked else None
            pre, post = megatron_adapter.chunk_roles(placement, case.pp, rank, chunk, case.chunks)
            model = _build(case, config, vp_stage=vp, pre_process=pre, post_process=post,
                           spread_output=spread)
            params = dict(model.named_parameters())
            shards = _shard_index(model)
            missing = sorted(set(params) - {shard.name for shard in shards})
            if missing:
                raise RuntimeError(f"parameters without a reference shard: {missing}")
            with torch.no_grad():
                for shard in shards:
                    shard.part(params[shard.name]).copy_(
                        _slice(ref_weights[_place(shard.sharded)], shard.sharded))
            models.append(model)
            self.shards.append(shards)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        self.chunks = [DistributedDataParallel(config, ddp_config, m) for m in models]
        no_sync = [model.no_sync for model in self.chunks]
        config.no_sync_func = no_sync if chunked else no_sync[0]
        config.finalize_model_grads_func = finalize_model_grads
        self.case, self.chunked = case, chunked

    def run(self, schedule: str, batches: list[dict]) -> tuple[float, list]:
        """One iteration of `schedule`: (loss as megatron reports it, [(name, grad shard)])."""
        case = self.case
        for model in self.chunks:
            model.zero_grad_buffer()
        # Same RNG streams for every run: dropout masks then depend only on the schedule.
        torch.manual_seed(case.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(case.seed)
        dp = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        mine = batches[dp_rank * case.num_microbatches:(dp_rank + 1) * case.num_microbatches]
        iterators = [iter(mine) for _ in self.chunks]
        settings = SpanSettings(case.splits, "explicit" if case.span_lengths else case.partition,
                                tuple(case.span_lengths) if case.span_lengths else None,
                                align=case.span_alignment,
                                budget=case_budget(replace(case, schedule=schedule)),
                                loss_backward_in_forward=case.loss_backward_in_forward)
        losses = get_forward_backward_func(schedule, settings)(
            forward_step_func=forward_step,
            data_iterator=iterators if self.chunked else iterators[0],
            model=self.chunks if self.chunked else self.chunks[0],
            num_microbatches=case.num_microbatches, seq_length=case.seq_length,
            micro_batch_size=case.micro_batch_size)
        # Mean over micro-batches of each one's token mean, then over DP (megatron's report);
        # under CP each micro-batch's [loss sum, tokens] is summed over the CP ranks first.
        device = platform.compute_device()
        sums = torch.zeros(case.num_microbatches, 2, device=device)
        if losses:
            sums += torch.stack([x["lm loss"].float().to(device) for x in losses])
        dist.all_reduce(sums, group=parallel_state.get_context_parallel_group())
        loss = torch.zeros((), device=device)
        if losses and parallel_state.get_tensor_model_parallel_rank() == 0 \
                and parallel_state.get_context_parallel_rank() == 0:
            loss += (sums[:, 0] / sums[:, 1].clamp(min=1.0)).sum() / case.num_microbatches
        dist.all_reduce(loss)
        grads = []
        for model, shards in zip(self.chunks, self.shards):
            params = dict(model.module.named_parameters())
            grads += [(shard.name, shard.sharded,
                       shard.part(params[shard.name].main_grad).float().clone())
                      for shard in shards]
        return float(loss) / dp, grads


def run_case(case: EquivalenceCase) -> EquivalenceResult:
    """Run `case` on the current process group (world = TP x CP x PP x DP); same result on all
    ranks.

    With `case.against` set, the baseline is that schedule run on the same chunks and data
    (e.g. our `1f1b` against megatron-core's own `megatron-1f1b`) instead of the unsplit model.
    """
    check_documents(case)
    if case.pipeline_schedule_file is not None:     # registered in this process under its name
        case = replace(case, schedule=schedule_file.load(case.pipeline_schedule_file).name)
    world = dist.get_world_size()
    if world % (case.tp * case.pp * case.cp):
        raise ValueError(f"world size {world} is not divisible by --tp {case.tp} x --pp {case.pp}"
                         f" x --cp {case.cp}")
    dp = world // (case.tp * case.pp * case.cp)
    chunked = case.chunks > 1
    check_chunks(case)
    if (case.hidden_dropout or case.attention_dropout) and not (case.against or
                                                                case.against_no_recompute):
        raise ValueError("--hidden-dropout/--attention-dropout > 0 draw other masks than the "
                         "unsplit model: compare with --against or --against-no-recompute")
    batches = global_batch(case, dp)
    ref_loss, ref_weights, ref_grads = _reference(case, batches)
    reference = None
    if case.against or case.against_no_recompute:
        base = replace(case, schedule=case.against or case.schedule,
                       recompute_granularity=None if case.against_no_recompute
                       else case.recompute_granularity)
        ref_loss, baseline = ParallelLayout(base, chunked, ref_weights).run(
            base.schedule, batches)
        reference = _from_every_rank({_identity(sharded): grad for _, sharded, grad in baseline})
        release_model_parallel()
    loss, grads = ParallelLayout(case, chunked, ref_weights).run(case.schedule, batches)
    triples = [(name, grad, reference[_identity(sharded)] if reference is not None
                else _slice(ref_grads[_place(sharded)], sharded))
               for name, sharded, grad in grads]
    worst, name, compared = _worst_over_ranks(*_max_rel_diff(triples), dp * case.cp)
    release_model_parallel()
    loss_rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    passed = (loss_rel <= case.loss_tolerance and worst <= case.grad_tolerance
              and not math.isnan(worst))
    return EquivalenceResult(loss, ref_loss, loss_rel, worst, name, compared, passed, asdict(case))


def _from_every_rank(grads: dict) -> dict:
    """`grads` (this rank's, by shard identity: its key and its offsets in the whole tensor)
    with every other rank's: with the output layer spread (O actions) every pipeline rank holds
    a copy of the last stage's final norm and output layer under the last stage's names, which
    an --against baseline that keeps the layer in the last stage has on that stage's ranks only.
    Gathered over the world group, which outlives the layout (a group destroyed right after a
    collective on it can close a connection a slower rank still reads from)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {key: grad.cpu() for key, grad in grads.items()})
    device = platform.compute_device()
    return {key: grad.to(device) for part in gathered for key, grad in part.items()}


def _identity(sharded: ShardedTensor) -> tuple:
    return sharded.key, tuple(sharded.global_offset)


def is_chunked(schedule: str) -> Optional[bool]:
    """Whether `schedule` interleaves V >= 2 chunks per rank; None when it runs on one or two
    (seq1f1b-zb-auto: as the case lays the model out)."""
    if schedule in MEGATRON_SCHEDULES:
        return schedule == "megatron-interleaved-1f1b"
    info = registry.get(schedule)
    return None if info.any_chunks else info.chunked
