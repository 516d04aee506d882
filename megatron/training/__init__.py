"""The training harness megatron-core does not ship: arguments, tokenizers, data (and, later,
initialisation, the train loop, checkpointing and logging).

This folder merges with the installed megatron-core's `megatron` namespace package, so there must
never be a `megatron/__init__.py` (it would hide `megatron.core`) nor a `megatron/core/` here.
Nothing is imported eagerly: `import megatron.training.arguments` stays fast. `seq1f1b` is
imported (it imports no torch) so that megatron-core's fused kernels stay plain functions on a
host without CUDA whichever of the two a program imports first (seq1f1b/host_fusions.py).
"""
import seq1f1b  # noqa: F401
