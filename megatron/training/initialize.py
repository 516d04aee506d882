"""Start-up of a run: process group, megatron's parallel_state, seeds; and the matching tear-down.

The process group comes from torchrun's or Slurm's environment (`seq1f1b.distributed`: gloo with
the CPU platform layer without a GPU, NCCL with one). `initialize_megatron` may be called again in
the same process for another layout (tests run several trainings per torchrun launch).
"""
from __future__ import annotations

import argparse
import random

import numpy
import torch
from megatron.core import parallel_state, tensor_parallel

from seq1f1b.distributed import init_distributed, release_model_parallel


def initialize_megatron(args: argparse.Namespace) -> None:
    """Join (or reuse) the process group, build parallel_state for TP x CP x PP (x V), seed the
    RNGs."""
    # --p2p-timeout is every process group's timeout too: on NCCL the pipeline's waits have none
    # of their own (a wait with one would block the host), and the watchdog then reports a stuck
    # transfer or collective instead of the job freezing.
    timeout_s = max(args.p2p_timeout, 60.0)
    _, world = init_distributed(timeout_s=timeout_s)
    if world != args.world_size:
        raise RuntimeError(f"the flags were validated for {args.world_size} processes, but the "
                           f"process group has {world}")
    finish_megatron()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        distributed_timeout_minutes=timeout_s / 60)
    set_random_seed(args.seed)


def set_random_seed(seed: int) -> None:
    """Megatron's seeding: each pipeline stage its own stream (seed + 100 x stage); the TP ranks of
    a stage share it and megatron's RNG tracker derives the tensor-parallel streams."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    numpy.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def finish_megatron() -> None:
    """Drop parallel_state and its process groups (the default group stays, for a next run in the
    same process: each layout's gloo groups hold threads of their own)."""
    if parallel_state.model_parallel_is_initialized():
        release_model_parallel()
