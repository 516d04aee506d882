"""Process-group start-up shared by the tools and the trainer: torchrun's or Slurm's environment,
gloo on CPU (with the CPU platform layer) and NCCL on GPU."""
from __future__ import annotations

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
