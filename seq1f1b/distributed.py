"""Process-group start-up shared by the tools and the trainer: torchrun's or Slurm's environment,
gloo on CPU (with the CPU platform layer) and NCCL on GPU."""
from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group once; returns (rank, world size).

    Reads RANK/WORLD_SIZE/LOCAL_RANK (torchrun) or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (srun),
    with MASTER_ADDR/MASTER_PORT from the environment (default: a single local process).
    """
    from seq1f1b import platform

    env = os.environ
    rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        backend = "nccl"
    else:
        platform.activate()
        backend = "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return rank, world


def join_gloo_world() -> None:
    """Join torchrun's world when RANK is set, else a gloo world of one over an in-memory store
    (no port to collide on), with the CPU platform layer active: for tests and single-process
    tools that build megatron-core models on the host."""
    from seq1f1b import platform

    platform.activate()
    if dist.is_initialized():
        return
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _process_groups(value, found: dict) -> None:
    if isinstance(value, dist.ProcessGroup):
        found[id(value)] = value
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            _process_groups(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _process_groups(item, found)


def release_model_parallel() -> None:
    """megatron's `destroy_model_parallel()`, plus destroying the process groups it only forgets.

    A process that builds several layouts in turn (the equivalence check, benchmarks, tests)
    otherwise keeps every group of every layout alive, each with its own gloo threads: after a
    few dozen layouts, thousands of threads and most of the CPU time in the kernel. A destroyed
    group's threads end only when the group object does, and a finished run's model, DDP buffers
    and optimizer hold it in reference cycles that Python's collector may not visit for many runs
    (16 groups, 48 gloo threads, per training run in a world of one): so this collects them too.
    """
    from megatron.core import parallel_state

    found: dict = {}
    for value in list(vars(parallel_state).values()):
        _process_groups(value, found)
    parallel_state.destroy_model_parallel()
    world = dist.group.WORLD
    for group in found.values():
        if group is world:
            continue
        try:
            dist.destroy_process_group(group)
        except ValueError:  # destroyed by an earlier release: megatron lists every group it made
            pass
    gc.collect()
