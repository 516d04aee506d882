"""megatron-core's fused kernels stay plain Python functions on a host without CUDA.

megatron-core 0.16.1 decorates its fused kernels (bias-GeLU, GeGLU, SwiGLU, bias-dropout-add,
the fused RoPE and more) with `megatron.core.jit.jit_fuser`, which that module sets to
`torch.compile` when it is imported, and every module of `megatron.core.fusions` is imported by
`megatron.core`'s own `__init__`. Calling `torch.compile` imports dynamo and inductor: about 3 s
of CPU in every process that imports megatron-core (each rank of each launch, each tool), half
of that import, for kernels the CPU platform never calls (this project's configs keep those
fusions off; a CPU that did call one would wait ~13 s for inductor to build it with the C
compiler). megatron-core has the switch, `megatron.core.jit.disable_jit_fuser()`, but by the time
a caller can reach it every kernel is decorated.

`install()` throws that switch the moment `megatron.core.jit` has run, before any fusion module
reads `jit_fuser`, where CUDA is absent (the condition `seq1f1b.platform.activate()` uses). It
runs when the `seq1f1b` package is imported and when `megatron.training` is, neither of which
imports torch, so whichever a program imports first comes before megatron-core. On a GPU host
nothing changes: the kernels are compiled as megatron-core intends. No megatron-core file
changes; in a process that imported megatron-core before either package, its kernels keep
`torch.compile`.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

JIT_MODULE = "megatron.core.jit"


class _EagerOnHostLoader(importlib.abc.Loader):
    """Runs `megatron.core.jit` with its own loader, then disables `jit_fuser` without CUDA."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        import torch    # megatron.core.jit has imported it

        if not torch.cuda.is_available():
            module.disable_jit_fuser()

    def __getattr__(self, name: str) -> Any:     # get_source, get_filename, ...: inspect's
        return getattr(self.loader, name)


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` where the path finder would and hands it the loader above;
    then takes itself off the import system."""

    def find_spec(self, name: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name != JIT_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _EagerOnHostLoader(spec.loader)
        return spec


def install() -> None:
    """Disable megatron-core's `jit_fuser` once `megatron.core.jit` is imported, on a host
    without CUDA; nothing if that module is imported already or this is installed."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _JitFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFinder())
