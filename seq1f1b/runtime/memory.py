"""Bytes held for backward, measured: what autograd saves plus what the KV caches hold.

`SavedTensorMeter` installs saved-tensor hooks: every tensor autograd saves is wrapped in a handle
that lives exactly as long as the graph keeps it; handles count their storage once however many
graphs save it (a K/V buffer viewed by several spans, an input saved by several ops). Storages of
`excluded` tensors (the model's parameters, which linear layers save for their input gradient) are
not counted: they are held whatever the schedule. The meter also counts what the executor holds
outside autograd (stashed stage outputs, deferred output grads, the KV caches, which a full
recompute's no-grad forward fills without any graph saving them) through `extra_tensors`, each
storage once and not again when a graph saves it too, so its peak is what a device would have to
hold for backward at the worst moment of the iteration. It samples whenever a tensor is saved,
after each action (the trace) and when something is allocated in the middle of an action with
nothing saved (`sample_active_meters`: the dK/dV accumulators of a first backward). Works on
CPU, where no allocator statistics exist; on GPU `torch.cuda.max_memory_allocated` complements
it.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

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

    def __init__(self, extra_tensors: Optional[Callable[[], Iterable[torch.Tensor]]] = None,
                 excluded: Iterable[torch.Tensor] = ()) -> None:
        self._refs: dict[tuple[int, int], int] = {}
        self._excluded = {_storage_key(t) for t in excluded}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.extra_tensors = extra_tensors
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> object:
        if _storage_key(tensor) in self._excluded:
            return tensor
        return _Handle(tensor, self)

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Handle) else packed

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
        extra = {}
        for tensor in self.extra_tensors() if self.extra_tensors else ():
            key = _storage_key(tensor)
            if key not in self._refs and key not in self._excluded:
                extra[key] = key[1]
        total = self.live_bytes + sum(extra.values())
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc)


_ACTIVE: list[SavedTensorMeter] = []
"""The meters measuring now (one per traced iteration; none outside measurement)."""


def sample_active_meters() -> None:
    """Sample every active meter now: for allocations in the middle of an action, where no
    tensor is saved (the dK/dV accumulators a first backward makes layer by layer)."""
    for meter in _ACTIVE:
        meter.sample()
