"""Bytes held for backward, measured: what autograd saves plus what the KV caches hold.

`SavedTensorMeter` installs saved-tensor hooks: every tensor autograd saves is wrapped in a handle
that lives exactly as long as the graph keeps it; handles count their storage once however many
graphs save it (a K/V piece saved by several later spans, an input saved by several ops). The meter
also counts the executor's stashed stage inputs/outputs and KV caches through `extra_bytes`, so its
peak is what a device would have to hold for backward at the worst moment of the iteration. Works
on CPU, where no allocator statistics exist; on GPU `torch.cuda.max_memory_allocated` complements it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class _Handle:
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "SavedTensorMeter") -> None:
        self.tensor = tensor
        self.meter = meter
        self.key = _storage_key(tensor)
        meter._acquire(self.key)

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Context manager tracking live and peak bytes of tensors saved for backward."""

    def __init__(self, extra_bytes: Optional[Callable[[], int]] = None) -> None:
        self._refs: dict[tuple[int, int], int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.extra_bytes = extra_bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Handle:
        return _Handle(tensor, self)

    @staticmethod
    def _unpack(handle: _Handle) -> torch.Tensor:
        return handle.tensor

    def _acquire(self, key: tuple[int, int]) -> None:
        count = self._refs.get(key, 0)
        self._refs[key] = count + 1
        if count == 0:
            self.live_bytes += key[1]
            self.sample()

    def _release(self, key: tuple[int, int]) -> None:
        count = self._refs.get(key, 0) - 1
        if count <= 0:
            self._refs.pop(key, None)
            self.live_bytes -= key[1]
        else:
            self._refs[key] = count

    def sample(self) -> int:
        """Update the peak with the current total; returns it."""
        total = self.live_bytes + (self.extra_bytes() if self.extra_bytes else 0)
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
