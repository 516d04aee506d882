"""Make a process ready to build and run megatron-core models (tests and torchrun test workers).

A module of its own, not conftest.py: several conftest.py files exist under tests/, so importing
"conftest" by name from a worker would pick whichever was imported first.
"""
from __future__ import annotations

from typing import Optional

import torch

from seq1f1b.distributed import release_model_parallel


def init_megatron(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                  virtual_pipeline_model_parallel_size: Optional[int] = None,
                  seed: int = 1234) -> None:
    """Make this process ready to build and run megatron-core models.

    Activates the CPU platform layer (a no-op with CUDA), joins torch.distributed with gloo (the
    torchrun environment when RANK is set, else a world of one over an in-memory store), (re)builds
    parallel_state for the given layout and seeds megatron's RNG tracker. Callable again with
    another layout; torchrun workers of distributed tests can import and call it too.
    One intra-op thread: the models under test are tiny, and on a shared 2-core machine two OpenMP
    threads turn each small matmul into a ~20 ms wait.
    """
    from megatron.core import parallel_state, tensor_parallel

    from seq1f1b.distributed import join_gloo_world

    torch.set_num_threads(1)
    join_gloo_world()
    if parallel_state.model_parallel_is_initialized():
        release_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
