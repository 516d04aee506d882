"""Save and resume a run with megatron-core's dist_checkpointing, in Megatron-LM's torch_dist
format.

A checkpoint holds everything that decides what the next iteration computes: every model chunk's
and the optimizer's sharded state dicts (so TP/PP shards land in one global, reshardable layout),
the LR scheduler, the RNG states of every rank (Python, NumPy, torch, CUDA and megatron's
tensor-parallel tracker), the iteration and, in the `args` namespace, the consumed train/valid
samples (the data position). The keys, the RNG entry's sharding and the content metadata are
Megatron-LM's (`checkpoint_common`), so each side loads the other's checkpoints.

Resuming with the same layout continues bit for bit. Another layout reshards the model; the
optimizer state is loaded where it fits the new layout (`CheckpointLayout.optimizer_mismatch`)
and the RNG states, which belong to (pipeline, tensor) ranks, where those sizes agree.
--finetune, --no-load-optim and --no-load-rng narrow what is loaded (`StartingPoint`). With
`--dist-ckpt-optim-fully-reshardable` the distributed optimizer's state reshards too, and the
layout record (`checkpoint_resharding`: V, the padded vocabulary, the optimizer's format) lets
validation keep the checkpoint's padded vocabulary and refuse what would not reshard.

A release checkpoint (a converted model, tools/checkpoint/convert.py) holds the model only: it is
loaded as Megatron-LM loads one, as iteration 0 with the optimizer, scheduler and RNGs as built.

Atomicity is `checkpoint_layout`'s: the state is written to a staging folder, and only after every
rank finished is it renamed and the tracker updated, by rank 0. With --async-save the shards are
written in the background (`async_checkpoint`) and that publish is the async request's last
finalize step. --no-save-optim and --no-save-rng leave the optimizer with the LR schedule and the
RNG states out, and say so in the stored `args`, as Megatron-LM does (validation then asks for
--no-load-optim or --finetune; the RNGs are not looked for).
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Callable, Optional

import numpy
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import MegatronOptimizer, distrib_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training import async_checkpoint, checkpoint_resharding
from megatron.training.checkpoint_common import (MEGATRON_CHECKPOINT_VERSION, CheckpointLayout,
                                                 StartingPoint, saved_args)
from megatron.training.model_setup import unwrap
from seq1f1b import checkpoint_layout

CONTENT_METADATA = {"distrib_optim_sharding_type": checkpoint_resharding.DP_RESHARDABLE,
                    "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""How the sharded state dicts are laid out (megatron-core's `metadata`), stored with the
checkpoint as Megatron-LM stores it; a checkpoint's own is read back when loading."""


@dataclass(frozen=True)
class RunPosition:
    """Where a run stands: what `--load` restores besides the weights and optimizer."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def _dp_cp_group():
    """The ranks that hold the same model shards: data parallel x context parallel (megatron's
    dp_cp group, over which the distributed optimizer shards and replicas are counted)."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _dp_cp_size() -> int:
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def _dp_cp_rank() -> int:
    return parallel_state.get_data_parallel_rank(with_context_parallel=True)


def _layout() -> list[int]:
    """Our `parallel_layout` record: [PP, TP, DP x CP] of the run that saved."""
    return [parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            _dp_cp_size()]


def _rng_state() -> dict:
    """This rank's RNG states, under Megatron-LM's names."""
    return {"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    numpy.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state["cuda_rng_state"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _rng_sharded_object(states: Optional[list]) -> ShardedObject:
    """Megatron-LM's RNG entry: one object per (pipeline, tensor) rank holding the list of its
    data-parallel ranks' states (written by DP rank 0, the others are its replicas)."""
    return ShardedObject("rng_state", states,
                         (parallel_state.get_pipeline_model_parallel_world_size(),
                          parallel_state.get_tensor_model_parallel_world_size()),
                         (parallel_state.get_pipeline_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=_dp_cp_rank())


def _gathered_rng_states() -> list:
    """Every data-parallel rank's RNG states, in DP rank order (collective over DP)."""
    states: list = [None] * _dp_cp_size()
    dist.all_gather_object(states, _rng_state(), group=_dp_cp_group())
    return states


def _own_rng_state(states: list) -> Optional[dict]:
    """This rank's entry of a loaded RNG list: its own DP rank's when the list has one per DP
    rank, the single entry of Megatron-LM's list (which holds DP rank 0's), else None."""
    if len(states) == _dp_cp_size():
        return states[_dp_cp_rank()]
    return states[0] if len(states) == 1 else None


def _adam_step_per_parameter(optimizer: MegatronOptimizer) -> bool:
    """Whether `optimizer` is megatron's distributed optimizer on torch's Adam, which keeps Adam's
    step per parameter: the case `_allocate_adam_state` and `_restore_adam_steps` are for.

    With Transformer Engine (or Apex) installed, megatron builds their FusedAdam instead. It keeps
    the step in its param groups, megatron allocates and restores its state itself, and it knows
    only exp_avg, exp_avg_sq and master_param per parameter: its state_dict and load_state_dict
    look every state name up in that set, so a per-parameter "step" is a KeyError. megatron's
    own switch between the two is `distrib_optimizer.HAVE_APEX_OR_TE`, read here at call time.
    """
    return optimizer.config.use_distributed_optimizer and not distrib_optimizer.HAVE_APEX_OR_TE


def _allocate_adam_state(optimizer: MegatronOptimizer) -> None:
    """Give every parameter of a fresh distributed optimizer torch Adam's state, as zeros.

    Without TE/Apex, megatron's DistributedOptimizer.state_dict reads Adam's step from the
    per-parameter state, which a fresh optimizer has not created yet, and the state dict that
    serves as the loading template fails. Allocating the state torch would create at the first
    step (and leaving the parameters alone) makes the template; loading overwrites it.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                                          "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}


def _restore_adam_steps(optimizer: MegatronOptimizer) -> None:
    """Set each parameter's Adam step, after a load, from the step its param group carries.

    Without TE/Apex, megatron's DistributedOptimizer checkpoints Adam's step in the param groups
    and treats the per-parameter step as a local, non-persistent value: loading copies the
    template's step (here the zeros of `_allocate_adam_state`) into one tensor that it also
    shares between all parameters. torch's Adam increments each parameter's step in place, so
    each parameter gets its own tensor holding the checkpoint's step.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            if group.get("step") is None:
                continue
            for param in group["params"]:
                if "step" in inner.state[param]:
                    inner.state[param]["step"] = torch.tensor(float(group["step"]),
                                                              dtype=torch.float32)


def _model_key(index: int, chunks: int) -> str:
    return "model" if chunks == 1 else f"model{index}"


def _load_fully_reshardable_without_steps(optimizer: MegatronOptimizer, state: dict) -> None:
    """Load a `fully_reshardable` distributed-optimizer state into torch's Adam.

    megatron-core 0.16.1 copies every per-parameter state entry from the loaded tensors, and
    these never hold torch Adam's per-parameter "step" (megatron keeps the step in the param
    groups): a KeyError. So the parameter state is loaded apart, with the per-parameter steps set
    aside; `_restore_adam_steps` then sets them from the param groups, as after any load.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    entries = [state] if len(chained) == 1 else [state[i] for i in sorted(state)]
    param_states = [entry.pop("param_state") for entry in entries]
    optimizer.load_state_dict(state)       # param groups, steps, grad scaler
    for inner, param_state in zip(chained, param_states):
        steps = {param: entry.pop("step") for param, entry in inner.optimizer.state.items()
                 if "step" in entry}
        inner.load_parameter_state_from_fully_reshardable(param_state)
        for param, step in steps.items():
            inner.optimizer.state[param]["step"] = step


def _metadata(content: dict) -> dict:
    """megatron-core's sharded-state-dict metadata: the checkpoint's content metadata and the
    data-parallel group the distributed optimizer shards over."""
    return {**content, "dp_cp_group": _dp_cp_group()}


def _model_state(model: list) -> dict:
    return {_model_key(i, len(model)): unwrap(chunk).sharded_state_dict()
            for i, chunk in enumerate(model)}


def save_checkpoint(save_dir: str, model: list, optimizer: MegatronOptimizer,
                    scheduler: OptimizerParamScheduler, position: RunPosition,
                    args: argparse.Namespace,
                    background: Optional[async_checkpoint.AsyncSaves] = None,
                    on_published: Callable[[str], None] = lambda folder: None) -> str:
    """Write the checkpoint of `position.iteration` under `save_dir`, atomically; collective.

    `args` (the run's validated flags) is stored as Megatron-LM's `args`, with the position's
    consumed samples; its --dist-ckpt-optim-fully-reshardable stores the distributed optimizer's
    state so that it resumes at another TP/PP/V, and --no-save-optim / --no-save-rng leave the
    optimizer and LR schedule / the RNG states out, as Megatron-LM does. With `background`
    (--async-save) the shards are written by megatron-core's async save and this returns while
    they are; the checkpoint is published when `background` finalizes it. `on_published(folder)`
    runs on every rank once it is published. Returns the folder it is published as.
    """
    staging = checkpoint_layout.staging_dir(save_dir, position.iteration)
    if dist.get_rank() == 0:
        checkpoint_layout.prepare_staging(save_dir, position.iteration)
    dist.barrier()
    optimizer_format = checkpoint_resharding.optimizer_format(
        optimizer.config.use_distributed_optimizer,
        getattr(args, "dist_ckpt_optim_fully_reshardable", False))
    content = {**CONTENT_METADATA, "distrib_optim_sharding_type":
               optimizer_format or checkpoint_resharding.DP_RESHARDABLE}
    state = _model_state(model)
    if not getattr(args, "no_save_optim", False):
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False,
                                                          metadata=_metadata(content))
        state["opt_param_scheduler"] = scheduler.state_dict()
    if not getattr(args, "no_save_rng", False):
        state["rng_state"] = _rng_sharded_object(_gathered_rng_states())
    state["args"] = saved_args(args, position.consumed_train_samples,
                               position.consumed_valid_samples)
    state["checkpoint_version"] = MEGATRON_CHECKPOINT_VERSION
    state["iteration"] = position.iteration
    state["parallel_layout"] = _layout()
    state.update(checkpoint_resharding.record_entries(
        virtual=len(model), padded_vocab_size=getattr(unwrap(model[0]), "vocab_size", None),
        optimizer_format=optimizer_format))
    request = dist_checkpointing.save(state, staging, content_metadata=content,
                                      async_sharded_save=background is not None)
    final = checkpoint_layout.iteration_dir(save_dir, position.iteration)

    def publish() -> None:       # every rank's shards are on disk: make the checkpoint visible
        if dist.get_rank() == 0:
            checkpoint_layout.publish(save_dir, position.iteration)
        dist.barrier()
        on_published(final)

    if background is None:
        dist.barrier()
        publish()
    else:
        request.add_finalize_fn(publish)
        background.schedule(request)
    return final


def _print_rank_0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def load_model_weights(folder: str, model: list) -> None:
    """Load only the model chunks' weights from the checkpoint `folder` (any TP x PP x V layout:
    sharded tensors are keyed by global tensor and layer); collective."""
    state = dist_checkpointing.load(_model_state(model), folder)
    with torch.no_grad():
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(state[_model_key(i, len(model))], strict=True)


def load_checkpoint(start: StartingPoint, model: list, optimizer: Optional[MegatronOptimizer],
                    scheduler: Optional[OptimizerParamScheduler]) -> RunPosition:
    """Restore the checkpoint `start` names (ours or Megatron-LM's) into the model and, as far as
    `start` asks and the layouts allow, the optimizer, the LR schedule and the RNGs; collective.
    Without an optimizer (--skip-train builds none) `start` must not restore one.

    Returns the position to continue from (iteration 0 for a fine-tune).
    """
    if start.release:
        load_model_weights(start.folder, model)
        if optimizer is not None:     # main (fp32) copies of bf16/fp16 params follow
            optimizer.reload_model_params()
        return RunPosition()
    common = dist_checkpointing.load_common_state_dict(start.folder)
    if "args" not in common:
        raise RuntimeError(f"{start.flag}: {start.folder} has no 'args' in its common state: "
                           f"not a Megatron-LM torch_dist checkpoint (nor one of ours since "
                           f"checkpoint_version {MEGATRON_CHECKPOINT_VERSION})")
    saved = CheckpointLayout.from_args(common["args"])
    content = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    load_optimizer = start.restores_optimizer and "opt_param_scheduler" in common
    if load_optimizer:   # Megatron-LM's --no-save-optim leaves out optimizer and schedule
        mismatch = CheckpointLayout.from_args(argparse.Namespace(
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            data_parallel_size=_dp_cp_size(),
            use_distributed_optimizer=optimizer.config.use_distributed_optimizer,
            bf16=optimizer.config.bf16, fp16=optimizer.config.fp16)).optimizer_mismatch(
                saved, content.get("distrib_optim_sharding_type"))
        if mismatch is not None:
            _print_rank_0(f" {start.flag}: optimizer state not loaded ({mismatch}): Adam starts "
                          f"afresh, the LR schedule and the iteration continue")
            load_optimizer = False
    load_rng = start.restores_rng and not getattr(common["args"], "no_save_rng", False) and \
        (saved.pipeline_parallel, saved.tensor_parallel) == (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size())
    if start.restores_rng and getattr(common["args"], "no_save_rng", False):
        _print_rank_0(f" {start.flag}: the checkpoint holds no RNG states (saved with "
                      f"--no-save-rng): the RNGs start from --seed, as in Megatron-LM")
    elif start.restores_rng and not load_rng:
        _print_rank_0(f" {start.flag}: resharding the checkpoint saved at TP="
                      f"{saved.tensor_parallel} PP={saved.pipeline_parallel} (RNG states not "
                      f"restored: they belong to ranks)")
    request = _model_state(model)
    adam_step_per_parameter = load_optimizer and _adam_step_per_parameter(optimizer)
    if adam_step_per_parameter:
        _allocate_adam_state(optimizer)
    if load_optimizer:
        request["optimizer"] = optimizer.sharded_state_dict(
            request, is_loading=True, metadata=_metadata(content or CONTENT_METADATA))
    if load_rng:
        request["rng_state"] = _rng_sharded_object(None)
    state = dist_checkpointing.load(request, start.folder)
    # no_grad: with fp32 parameters the distributed optimizer's main shards are views of the
    # parameters, which megatron copies into in place.
    with torch.no_grad():
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(state[_model_key(i, len(model))], strict=True)
        if adam_step_per_parameter and content.get("distrib_optim_sharding_type") == \
                checkpoint_resharding.FULLY_RESHARDABLE:
            _load_fully_reshardable_without_steps(optimizer, state["optimizer"])
        elif load_optimizer:
            optimizer.load_state_dict(state["optimizer"])
        elif optimizer is not None:   # mixed precision: the fp32 main parameters copy them
            optimizer.reload_model_params()
    if adam_step_per_parameter:
        _restore_adam_steps(optimizer)
    if "opt_param_scheduler" in common and start.restores_optimizer:
        scheduler.load_state_dict(common["opt_param_scheduler"])
    if load_rng:
        own = _own_rng_state(state["rng_state"])
        if own is not None:
            _set_rng_state(own)
    if start.finetune:
        return RunPosition()
    return RunPosition(int(common["iteration"]),
                       int(getattr(common["args"], "consumed_train_samples", 0)),
                       int(getattr(common["args"], "consumed_valid_samples", 0)))
