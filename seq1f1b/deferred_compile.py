"""megatron-core's fused kernels handed to `torch.compile` when first called, not when imported.

megatron-core 0.16.1 decorates its fused kernels (bias-GeLU, GeGLU, SwiGLU, ...) with
`megatron.core.jit.jit_fuser`, which is `torch.compile`, and calling `torch.compile` imports
dynamo and inductor: about 3 s of CPU in every process that imports megatron-core (each rank of
each launch, each tool), close to half of that import, for kernels a CPU run never calls and a
GPU run first calls after its setup. `install()`, run when the `seq1f1b` package is imported
(before any of its modules imports megatron-core, and by `megatron.training` as well), waits for
`megatron.core.jit` to be imported and, once it has run, makes its `jit_fuser` defer: each
decorated function is compiled by `torch.compile` on its first call, the kernel `torch.compile`
would have built then anyway (it compiles on the first call too). No megatron-core file changes,
and where megatron-core was imported first (`jit` already loaded) nothing is done.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

_JIT = "megatron.core.jit"


def deferred(compile_fn: Callable) -> Callable:
    """A decorator that hands `fn` to `compile_fn` on `fn`'s first call."""
    def decorate(fn: Callable) -> Callable:
        compiled = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn)
            return compiled(*args, **kwargs)
        return call
    return decorate


class _DeferringLoader(importlib.abc.Loader):
    """Runs `megatron.core.jit` with its own loader, then defers its `jit_fuser`."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        import torch   # imported by megatron.core.jit already
        if module.jit_fuser is torch.compile:
            module.jit_fuser = deferred(torch.compile)

    def __getattr__(self, name: str) -> Any:   # get_source, get_filename, ... for inspect
        return getattr(self.loader, name)


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` where the path finder would, with the deferring loader; then
    leaves the import system as it was."""

    def find_spec(self, name, path, target=None):
        if name != _JIT:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferringLoader(spec.loader)
        return spec


def install() -> None:
    """Defer megatron-core's `jit_fuser` once `megatron.core.jit` is imported (a no-op if it
    was imported already, or if this was installed before)."""
    if _JIT in sys.modules or any(isinstance(f, _JitFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFinder())
