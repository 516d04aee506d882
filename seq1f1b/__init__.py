"""Seq1F1B: sequence-level 1F1B pipeline parallelism on megatron-core.

`seq1f1b.plan` holds the schedules as data (pure Python + numpy, no torch.distributed);
`seq1f1b.runtime` runs a plan on megatron-core model chunks with torch.distributed.
"""
from seq1f1b import host_fusions

host_fusions.install()   # before any module here imports megatron-core: see its docstring
