"""From validated args to what the train loop steps: model chunks in megatron DDP, the megatron
optimizer and the LR schedule.

All of it is megatron-core's own machinery, configured the way Megatron-LM's training.py does:
the user's model provider builds each chunk, `Float16Module` casts it for --bf16/--fp16,
`DistributedDataParallel` owns the gradient buffers, `get_megatron_optimizer` builds Adam (or the
distributed optimizer) with gradient clipping, and `OptimizerParamScheduler` anneals the LR in
samples, as Megatron does.
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import asdict
from typing import Callable, Iterator

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.training.lr_schedule import ScheduleSettings
from seq1f1b import megatron_adapter, platform
from seq1f1b.plan.stage_layers import StageLayers
from seq1f1b.runtime import tied_output, wgrad_fusion
from seq1f1b.runtime.wgrad import has_split_backward

ModelProvider = Callable[..., torch.nn.Module]
"""`model_provider(pre_process, post_process, vp_stage, config) -> one model chunk`."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return _DTYPES[args.params_dtype]


def core_transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """The TransformerConfig of the run: CPU initialisation without a GPU, the kernel fusions
    off except gradient accumulation (--no-gradient-accumulation-fusion; without its kernel on a
    GPU, off after one notice on the first rank: runtime/wgrad_fusion.py)."""
    dtype = params_dtype(args)
    return megatron_adapter.make_transformer_config(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        architecture=megatron_adapter.Architecture.from_args(args),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel, hidden_dropout=args.hidden_dropout,
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=args.cp_comm_type if args.context_parallel_size > 1 else None,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        fp16=args.fp16, bf16=args.bf16, params_dtype=dtype, pipeline_dtype=dtype,
        calculate_per_token_loss=args.calculate_per_token_loss,
        placement=args.pipeline_placement,
        stage_layers=StageLayers.of_flags(args),
        gradient_accumulation_fusion=wgrad_fusion.resolve(args.gradient_accumulation_fusion),
        **_recompute_fields(args))


def _recompute_fields(args: argparse.Namespace) -> dict:
    """Megatron's recompute settings; selective recompute is of core attention."""
    if args.recompute_granularity == "full":
        return dict(recompute_granularity="full", recompute_method=args.recompute_method,
                    recompute_num_layers=args.recompute_num_layers)
    if args.recompute_granularity == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return {}


def build_model(args: argparse.Namespace, config: TransformerConfig,
                model_provider: ModelProvider) -> list[DistributedDataParallel]:
    """This rank's model chunks (one, or V with interleaving), cast and wrapped in megatron DDP.

    Also installs the hooks megatron's schedules call on `config`, as Megatron-LM does: no_sync
    (one per chunk when interleaving), finalize_model_grads and, with --overlap-param-gather
    (aligned, Megatron's default), param_sync_func. Split-backward linears (zero-bubble
    schedules) get their weight-gradient hooks through megatron's `delay_wgrad_compute`, so that
    with --overlap-grad-reduce a gradient is reported ready at W (seq1f1b.runtime.wgrad).
    """
    chunks = []
    for vp_stage, (pre_process, post_process) in enumerate(chunk_roles(args.pipeline_placement)):
        vp = vp_stage if args.virtual_pipeline_model_parallel_size else None
        chunk = model_provider(
            pre_process=pre_process, post_process=post_process,
            vp_stage=vp, config=config).to(platform.compute_device())   # as Megatron's get_model
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if args.pipeline_spread_output:
            _copy_output_layer_from_owner(chunk, args.pipeline_placement)
        if args.fp16 or args.bf16:
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    # the output layer's copies of a tied embedding megatron cannot tie (a V, the layer spread)
    tied_output.copy_embedding(chunks, parallel_state.get_pipeline_model_parallel_group())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.overlap_param_gather and args.align_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        delay_wgrad_compute=any(has_split_backward(chunk) for chunk in chunks))
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
             for index, chunk in enumerate(chunks)]
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    config.param_sync_func = None
    if ddp_config.align_param_gather:
        param_sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = param_sync if len(param_sync) > 1 else param_sync[0]
    config.finalize_model_grads_func = finalize_model_grads
    return model


def _copy_output_layer_from_owner(chunk: torch.nn.Module, placement: str) -> None:
    """With O actions every rank's last chunk holds a copy of the output layer
    (megatron_adapter.OutputHead), each initialised from its own rank's seed: all take the last
    stage's (the owner's, its pipeline rank from `placement`) weights, as a checkpoint load
    gives every copy the same ones."""
    head = getattr(chunk, "output_head", None)
    if head is None:
        return
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    chunks = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    owner = next(rank for rank in range(pp) if megatron_adapter.chunk_roles(
        placement, pp, rank, chunks - 1, chunks)[1])
    group = parallel_state.get_pipeline_model_parallel_group()
    with torch.no_grad():
        for param in head.parameters():
            torch.distributed.broadcast(param.data, group_src=owner, group=group)


@contextlib.contextmanager
def parameters_gathered(model: list[DistributedDataParallel]) -> Iterator[None]:
    """With --overlap-param-gather, the optimizer step leaves each rank its own shard updated and
    the forward pre-hooks gather the rest at the next training forward. Evaluation and checkpoint
    saving read whole parameters: as Megatron-LM does, turn the hooks off around them, which
    gathers synchronously, and back on after. Without overlap, nothing to do."""
    overlapped = [chunk for chunk in model if chunk.use_forward_hook]
    for chunk in overlapped:
        chunk.disable_forward_pre_hook()
    try:
        yield
    finally:
        for chunk in overlapped:
            chunk.enable_forward_pre_hook()


def build_optimizer(args: argparse.Namespace, config: TransformerConfig,
                    model: list[DistributedDataParallel]) -> MegatronOptimizer:
    """Megatron's Adam (or distributed optimizer) with --clip-grad; also sets the loss scaling
    hook the schedules call (dynamic loss scaling with --fp16)."""
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        params_dtype=params_dtype(args), use_distributed_optimizer=args.use_distributed_optimizer,
        timers=config.timers, barrier_with_L1_time=config.barrier_with_L1_time)
    optimizer = get_megatron_optimizer(optimizer_config, model)
    config.grad_scale_func = optimizer.scale_loss
    return optimizer


def build_lr_scheduler(args: argparse.Namespace, optimizer: MegatronOptimizer
                       ) -> OptimizerParamScheduler:
    """Warm-up then decay to --min-lr, counted in samples (iterations x global batch).

    On resume, megatron-core's own rule decides between the flags' schedule and the checkpoint's:
    --override-opt_param-scheduler keeps the flags', --use-checkpoint-opt_param-scheduler takes
    the checkpoint's, neither requires them to agree (validation has checked they do).
    """
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, **asdict(ScheduleSettings.from_args(args)),
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)


def reads_data_on_every_stage(args: object) -> bool:
    """Whether every pipeline stage reads the micro-batches: with packed documents, and with
    the output layer spread over the ranks (an O action reads its span's labels and loss mask
    on any rank)."""
    return bool(args.reset_attention_mask or args.reset_position_ids
                or getattr(args, "pipeline_spread_output", False))


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The user's model under the DDP and Float16Module wrappers (whose state dict keys it
    owns: checkpoints name parameters as the model does, without `module.` prefixes)."""
    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def chunk_roles(placement: str) -> list[tuple[bool, bool]]:
    """(pre_process, post_process) of each model chunk of this pipeline rank under `placement`
    (args.pipeline_placement): whether it holds the first virtual stage (embedding) or the last
    (output layer and loss). In a V, both are chunks of rank 0."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    return [megatron_adapter.chunk_roles(placement, pp, rank, chunk, chunks)
            for chunk in range(chunks)]


def chunks_reading_data(placement: str, every_stage: bool = False) -> list[bool]:
    """For each model chunk of this rank, whether it reads data: the first pipeline stage (tokens)
    and the last (labels, loss mask); the chunks in between only receive activations, unless
    `every_stage` (packed documents: each stage's attention needs the document ids, its RoPE
    the reset position ids; Megatron-LM's middle stages would get neither)."""
    return [every_stage or first or last for first, last in chunk_roles(placement)]
