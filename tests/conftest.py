"""Shared fixtures: megatron-core on this machine (CPU platform layer, gloo, parallel_state)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_world import init_megatron
from seq1f1b.distributed import release_model_parallel
from worker_groups import pytest_collection_modifyitems  # noqa: F401  (make test's groups)


@pytest.fixture(scope="session")
def megatron_world() -> None:
    """A one-process gloo world with TP = PP = 1, the CPU platform layer active."""
    init_megatron()
    yield
    release_model_parallel()
    dist.destroy_process_group()
