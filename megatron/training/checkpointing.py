"""Save and resume a run with megatron-core's dist_checkpointing.

A checkpoint holds everything that decides what the next iteration computes: every model chunk's
and the optimizer's sharded state dicts (so TP/PP shards land in one global, reshardable layout),
the LR scheduler, the RNG states of every rank (Python, NumPy, torch, CUDA and megatron's
tensor-parallel tracker), the iteration and the consumed train/valid samples (the data position).
Resuming with the same layout continues bit for bit; at another TP x PP x V x DP layout the model
and optimizer reshard and the RNG states, which belong to ranks, are left as seeded (see
`checkpoint_resharding`, which also says what the layout record holds and why).

Atomicity is `checkpoint_layout`'s: the state is written to a staging folder, and only after every
rank finished is it renamed and the tracker updated, by rank 0.

A release checkpoint (a converted model, tools/checkpoint/convert.py) holds the model only: it is
loaded as Megatron-LM loads one, as iteration 0 with the optimizer, scheduler and RNGs as built.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import numpy
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import MegatronOptimizer, distrib_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training import checkpoint_layout, checkpoint_resharding
from megatron.training.model_setup import unwrap

CHECKPOINT_VERSION = 1


@dataclass(frozen=True)
class RunPosition:
    """Where a run stands: what `--load` restores besides the weights and optimizer."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def _layout() -> list[int]:
    return [parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size()]


def _rng_state() -> dict:
    return {"random": random.getstate(), "numpy": numpy.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state: Optional[dict]) -> ShardedObject:
    """One RNG entry per rank, placed by (pipeline, tensor, data) rank."""
    offset = (parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank(),
              parallel_state.get_data_parallel_rank())
    return ShardedObject("rng_state", state, tuple(_layout()), offset, replica_id=0)


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


def _model_key(index: int, chunks: int) -> str:
    return "model" if chunks == 1 else f"model{index}"


def _sharded_state_dict(model: list, optimizer: MegatronOptimizer,
                        scheduler: OptimizerParamScheduler, position: RunPosition,
                        is_loading: bool, with_rng: bool, optimizer_format: Optional[str]) -> dict:
    """`optimizer_format`: the distributed optimizer's format (None for the other optimizers)."""
    state: dict = {_model_key(i, len(model)): unwrap(chunk).sharded_state_dict()
                   for i, chunk in enumerate(model)}
    metadata = {"distrib_optim_sharding_type":
                optimizer_format or checkpoint_resharding.DP_RESHARDABLE,
                "chained_optim_avoid_prefix": True}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                      metadata=metadata)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["iteration"] = position.iteration
    state["consumed_train_samples"] = position.consumed_train_samples
    state["consumed_valid_samples"] = position.consumed_valid_samples
    state["parallel_layout"] = _layout()
    state["checkpoint_version"] = CHECKPOINT_VERSION
    state.update(checkpoint_resharding.record_entries(
        virtual=len(model), padded_vocab_size=getattr(unwrap(model[0]), "vocab_size", None),
        optimizer_format=optimizer_format))
    if with_rng:
        state["rng_state"] = _rng_sharded_object(None if is_loading else _rng_state())
    return state


def save_checkpoint(save_dir: str, model: list, optimizer: MegatronOptimizer,
                    scheduler: OptimizerParamScheduler, position: RunPosition,
                    fully_reshardable_optimizer: bool = False) -> str:
    """Write the checkpoint of `position.iteration` under `save_dir`, atomically; collective.

    `fully_reshardable_optimizer` (--dist-ckpt-optim-fully-reshardable) stores the distributed
    optimizer's state so that it resumes at another TP/PP/V. Returns the published folder.
    """
    staging = checkpoint_layout.staging_dir(save_dir, position.iteration)
    if dist.get_rank() == 0:
        checkpoint_layout.prepare_staging(save_dir, position.iteration)
    dist.barrier()
    optimizer_format = checkpoint_resharding.optimizer_format(
        optimizer.config.use_distributed_optimizer, fully_reshardable_optimizer)
    state = _sharded_state_dict(model, optimizer, scheduler, position, is_loading=False,
                                with_rng=True, optimizer_format=optimizer_format)
    dist_checkpointing.save(state, staging)
    dist.barrier()     # every rank's shards are on disk before the checkpoint becomes visible
    final = checkpoint_layout.iteration_dir(save_dir, position.iteration)
    if dist.get_rank() == 0:
        checkpoint_layout.publish(save_dir, position.iteration)
    dist.barrier()
    return final


def load_model_weights(folder: str, model: list) -> None:
    """Load only the model chunks' weights from the checkpoint `folder` (any TP x PP x V layout:
    sharded tensors are keyed by global tensor and layer); collective."""
    request = {_model_key(i, len(model)): unwrap(chunk).sharded_state_dict()
               for i, chunk in enumerate(model)}
    state = dist_checkpointing.load(request, folder)
    with torch.no_grad():
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(state[_model_key(i, len(model))], strict=True)


def load_checkpoint(load_dir: str, model: list, optimizer: MegatronOptimizer,
                    scheduler: OptimizerParamScheduler) -> Optional[RunPosition]:
    """Restore the newest complete checkpoint under `load_dir` into model, optimizer, scheduler
    and the RNGs; returns its position, or None when `load_dir` holds no checkpoint yet.

    A release checkpoint restores the weights only and returns iteration 0."""
    iteration = checkpoint_layout.read_tracker(load_dir)
    if iteration is None:
        return None
    if checkpoint_layout.is_release(load_dir):
        load_model_weights(checkpoint_layout.release_dir(load_dir), model)
        optimizer.reload_model_params()     # main (fp32) copies of bf16/fp16 params follow
        return RunPosition()
    folder = checkpoint_layout.iteration_dir(load_dir, iteration)
    common = dist_checkpointing.load_common_state_dict(folder)
    record = checkpoint_resharding.CheckpointRecord.from_common(common)
    same_layout = list(common["parallel_layout"]) == _layout()
    if not same_layout and dist.get_rank() == 0:
        print(f" resharding the checkpoint saved at {record.layout} (RNG states not restored: "
              f"they belong to ranks)", flush=True)
    adam_step_per_parameter = _adam_step_per_parameter(optimizer)
    if adam_step_per_parameter:
        _allocate_adam_state(optimizer)
    request = _sharded_state_dict(model, optimizer, scheduler, RunPosition(), is_loading=True,
                                  with_rng=same_layout, optimizer_format=record.optimizer_format)
    state = dist_checkpointing.load(request, folder)
    # no_grad: with fp32 parameters the distributed optimizer's main shards are views of the
    # parameters, which megatron copies into in place.
    with torch.no_grad():
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(state[_model_key(i, len(model))], strict=True)
        if adam_step_per_parameter and \
                record.optimizer_format == checkpoint_resharding.FULLY_RESHARDABLE:
            _load_fully_reshardable_without_steps(optimizer, state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])
    if adam_step_per_parameter:
        _restore_adam_steps(optimizer)
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_layout:
        _set_rng_state(state["rng_state"])
    return RunPosition(int(state["iteration"]), int(state["consumed_train_samples"]),
                       int(state["consumed_valid_samples"]))
