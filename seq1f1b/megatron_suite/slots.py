"""Our schedule functions in megatron-core's slots, each forward-only call checked against
megatron's own, and megatron's test utilities joined to the torchrun world over gloo: what
tools/megatron_schedule_worker.py installs before it runs Megatron-LM's schedule tests.
"""
from __future__ import annotations

from datetime import timedelta
from types import ModuleType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from seq1f1b.runtime.forward_backward import SpanSettings, get_forward_backward_func

# megatron-core's slot -> the registry schedule put there; at k=1 each is megatron's schedule.
SLOTS = {"forward_backward_pipelining_without_interleaving": "seq1f1b",
         "forward_backward_pipelining_with_interleaving": "seq1f1b-interleaved"}
# Long enough for 8 processes on 2 cores, short enough that a rank stuck in a collective (another
# rank failed between two of them) ends the run instead of freezing it.
GROUP_TIMEOUT = timedelta(minutes=5)


def same_result(ours: Any, theirs: Any) -> bool:
    """Whether two forward-backward results are equal: the same nesting of lists, tuples and
    dicts, equal plain values, tensors equal in dtype, shape and every element."""
    if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
        return (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor)
                and ours.dtype == theirs.dtype and torch.equal(ours, theirs))
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(same_result(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, (list, tuple)) or isinstance(theirs, (list, tuple)):
        return (type(ours) is type(theirs) and len(ours) == len(theirs)
                and all(same_result(a, b) for a, b in zip(ours, theirs)))
    return ours == theirs


class CheckedSlot:
    """Our forward-backward function in one of megatron's slots, checked against megatron's own.

    A forward-only call runs megatron's function first, then ours from the same RNG state, and
    requires the same result, or an exception of the same type (the test then sees ours). A
    training call runs ours alone: running it twice would accumulate every gradient twice.
    `compared` counts the calls that were checked.
    """

    def __init__(self, name: str, ours: Callable, theirs: Callable) -> None:
        self.name = name
        self.ours = ours
        self.theirs = theirs
        self.compared = 0

    def __call__(self, **kwargs: Any) -> Any:
        if not kwargs.get("forward_only", False):
            return self.ours(**kwargs)
        rng = torch.get_rng_state()
        expected: Any = None
        refusal: Optional[Exception] = None
        try:
            expected = self.theirs(**kwargs)
        except Exception as err:  # noqa: BLE001 - any refusal of megatron's is part of the contract
            refusal = err
        torch.set_rng_state(rng)
        try:
            result = self.ours(**kwargs)
        except Exception as err:
            if refusal is None:
                raise
            if type(err) is not type(refusal):
                raise AssertionError(f"{self.name}: ours raised {type(err).__name__}, megatron's "
                                     f"{type(refusal).__name__} ({refusal})") from err
            self.compared += 1
            raise
        if refusal is not None:
            raise AssertionError(f"{self.name}: megatron's raised {type(refusal).__name__} "
                                 f"({refusal}), ours returned {result!r}")
        if not same_result(result, expected):
            raise AssertionError(f"{self.name}: ours returned {result!r}, megatron's {expected!r}")
        self.compared += 1
        return result


def install_slots(schedules: ModuleType) -> list[CheckedSlot]:
    """Put our k=1 functions, checked against megatron's, into `schedules`' slots."""
    slots = []
    for slot, name in SLOTS.items():
        settings = SpanSettings(splits=1, p2p_timeout_s=GROUP_TIMEOUT.total_seconds())
        checked = CheckedSlot(slot, get_forward_backward_func(name, settings),
                              getattr(schedules, slot))
        setattr(schedules, slot, checked)
        slots.append(checked)
    return slots


def use_gloo(utils: type) -> None:
    """Replace megatron's `Utils.initialize_distributed` (NCCL, `torch.cuda.set_device(rank %
    device_count)`) with a join of the torchrun world over gloo."""

    def initialize_distributed() -> None:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
            dist.barrier()
        utils.inited = True

    utils.initialize_distributed = staticmethod(initialize_distributed)
