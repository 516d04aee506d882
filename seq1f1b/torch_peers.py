"""The peers' pipeline orders, from torch.distributed.pipelining's own generators.

torch 2.13 builds the compute order of ZB-V, DualPipeV and interleaved zero bubble per rank in
`_calculate_single_rank_operations`, a pure function of the group size and micro-batch count
(no process group, no stages). We call it on a bare instance with those attributes set, write
the result in torch's CSV form and read it back with `plan.torch_format.read_torch_csv`: the
comparison (`plan.py compare`, the peer tests) replays the peers' exact orders in our simulator
beside ours, on the same costs. This lives outside seq1f1b/plan, which imports no
torch.distributed.
"""
from __future__ import annotations

import csv
import io
from typing import Callable, Optional

from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.torch_format import read_torch_csv


def _zbv(pp: int, microbatches: int):
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    generator = object.__new__(ScheduleZBVZeroBubble)
    generator.pp_group_size, generator._n_microbatches = pp, microbatches
    generator.num_stages = 2 * pp
    return generator


def _dualpipev(pp: int, microbatches: int):
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV
    if microbatches < 2 * pp:
        return None           # torch refuses fewer micro-batches than stages
    generator = object.__new__(ScheduleDualPipeV)
    generator.pp_group_size, generator._n_microbatches = pp, microbatches
    return generator


def _interleaved_zero_bubble(pp: int, microbatches: int):
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble
    generator = object.__new__(ScheduleInterleavedZeroBubble)
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        return None           # torch refuses micro-batches that do not fill whole rounds
    generator.pp_group_size, generator._n_microbatches = pp, microbatches
    generator.n_local_stages, generator.number_of_rounds = 2, rounds
    generator.microbatches_per_round = microbatches // rounds
    return generator


PEERS: dict[str, Callable] = {
    "torch-zbv": _zbv,
    "torch-dualpipev": _dualpipev,
    "torch-interleaved-zb": _interleaved_zero_bubble,
}
"""Peer name -> a bare torch generator for (P, m), or None where torch has none."""


def torch_csv(name: str, pp: int, microbatches: int) -> Optional[str]:
    """Peer `name`'s compute order for P ranks and m micro-batches (two stages per rank) in
    torch's CSV form, or None where torch has no generator for that shape."""
    generator = PEERS[name](pp, microbatches)
    if generator is None:
        return None
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in range(pp):
        writer.writerow([str(a) for a in generator._calculate_single_rank_operations(rank)
                         if a is not None])
    return out.getvalue()


def peer_schedule(name: str, pp: int, microbatches: int) -> Optional[Schedule]:
    """Peer `name`'s order as our Schedule (k = 1, V = 2), or None (see torch_csv)."""
    text = torch_csv(name, pp, microbatches)
    return None if text is None else read_torch_csv(text, name=name)
