"""CPU platform layer: lets megatron-core 0.16.1 run on a machine without CUDA.

megatron-core has no CPU switch: it allocates on `torch.cuda.current_device()`, writes literal
`device="cuda"` tensors in its schedules, keeps its RNG tracker in CUDA generator states and checks
`param.type() == 'torch.cuda.FloatTensor'` in its optimizers. `activate()` makes all of that land on
the CPU, without copying or patching any megatron-core file:

1. a process-wide `TorchFunctionMode` rewrites every CUDA device (`"cuda"`, `"cuda:N"`, a cuda
   `torch.device` or a bare int, as `torch.cuda.current_device()` returns) to the CPU in `device=`
   arguments and in `Tensor.to(...)`; `Tensor.cuda()` and `Tensor.pin_memory()` become the identity
   (`pin_memory=True` becomes False); `Tensor.type()` answers the CUDA type name
   (`torch.cuda.FloatTensor`) so megatron's clip_grads / (distributed) optimizer accept CPU params;
2. `torch.cuda.current_device` (0), `set_device`, `synchronize` and `nvtx.range_push/range_pop/mark`
   become harmless, each its own function object (megatron's jit_fuser registers torch functions
   with dynamo, which refuses one object under two names: "Duplicate torch object");
3. the CUDA RNG calls (`torch.cuda.{get,set}_rng_state[_all]`, `manual_seed[_all]` and megatron's
   `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`) act on the CPU default
   generator, so `model_parallel_cuda_manual_seed`, the RNG tracker's `fork()` (attention dropout)
   and activation recompute work. The "CUDA" stream *is* the CPU stream here, so `fork()`'s warning
   "CPU RNG state changed within GPU RNG context" is expected and filtered out;
4. the autograd engine runs under the mode too. A mode is popped while its handler runs, and
   `Tensor.backward` / `torch.autograd.backward` / `grad` are Python functions that dispatch through
   that handler, so the whole backward (megatron's autograd Functions allocate with
   `device=torch.cuda.current_device()` there, e.g. the sequence-parallel reduce-scatter) would run
   without it. `torch.autograd._engine_run_backward`, the one private hook used here, is wrapped to
   push the mode again around the engine run; `activate()` fails loudly if torch renames it.

5. strict mode (`SEQ1F1B_STRICT_CUDA=1` at `activate()`, or `strict_mode()` around a block) keeps
   track of which tensors would be on the GPU and enforces CUDA's rules on them: no op mixing
   device and host tensors, no host tensor handed to a collective, no host sync inside
   `host_sync_forbidden()` (the executor's run) unless `host_sync_allowed()`. The rules, and what
   strict mode cannot emulate (streams, asynchrony, the caching allocator, NCCL's matching, GPU
   kernels), are in `seq1f1b/strict_cuda.py`.
6. megatron's gradient-accumulation-fusion kernel (`fused_weight_gradient_mlp_cuda`, apex or TE)
   is `seq1f1b.runtime.wgrad_fusion.HostWgradKernel`, the same accumulation as one `addmm_`.
7. fp32 denormals are flushed to zero (`torch.set_flush_denormal`, the calling thread's SSE
   flags): a GPU computes with denormals at full speed, a CPU takes a microcode assist for each.
   A small-init model's attention backward is full of them (probabilities times tiny gradients):
   at h 1024, L 1024, 16 heads, one thread, the CPU flash kernel's backward took 0.60-0.77 s
   per layer with them and 0.08-0.11 s without, and a 4-layer iteration of two micro-batches
   12.9 s against 6.9 s, so the CPU measured the denormals more than the schedule. Only values
   below 1.2e-38 change (to 0). Worker threads of a multi-threaded kernel keep their own flags.
8. fp32 products of activations and a weight (`torch.matmul`, `Tensor.matmul`: a linear's
   forward and input gradient) run on oneDNN where it beats MKL's sgemm, which loses per row
   as spans get shorter (`seq1f1b/runtime/host_gemm.py`).

Limits: a `TorchFunctionMode` is thread-local, so threads started by user code run without it; on a
machine with CUDA `activate()` does nothing and returns False.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from seq1f1b import strict_cuda
from seq1f1b.runtime import host_gemm
# Re-exported: the executor's hot loop and a deliberate sync in it (no-ops unless strict).
from seq1f1b.strict_cuda import host_sync_allowed, host_sync_forbidden  # noqa: F401

STRICT_ENV = "SEQ1F1B_STRICT_CUDA"
_CPU = torch.device("cpu")
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"
_active_mode: _CudaToCpuMode | None = None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a CUDA ordinal: torch.cuda.current_device() answers 0 under this layer
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_if_cuda(device: Any) -> Any:
    return _CPU if _is_cuda_device(device) else device


_REWRITTEN = frozenset((torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.type,
                        torch.Tensor.to))
"""The functions the mode changes whatever their keywords (others only by `device=`/`pin_memory=`)."""
_PRODUCTS = frozenset((torch.matmul, torch.Tensor.matmul))
"""Products the mode may run with oneDNN (`host_gemm.product`)."""
_HANDLED = _REWRITTEN | _PRODUCTS


def _cpu_type_name(name: str) -> str:
    return "torch." + name[len("torch.cuda."):] if name.startswith("torch.cuda.") else name


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements of every torch call to the CPU (see the module docstring), under
    strict mode's rules when `rules` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.rules: Optional[strict_cuda.StrictRules] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the process comes through here (a few per layer op, dozens per
        # span): the common case, no keyword and no function of its own, is one test.
        if self.rules is not None:
            return self.rules.call(func, args, kwargs or {}, self._on_cpu)
        if kwargs or func in _HANDLED:
            return self._on_cpu(func, args, kwargs)
        return func(*args)

    def _on_cpu(self, func, args, kwargs):
        if func in _PRODUCTS and not kwargs and len(args) == 2:
            out = host_gemm.product(*args)
            if out is not None:
                return out
        kwargs = kwargs or {}
        if func in _REWRITTEN:
            if func is torch.Tensor.type:
                return self._tensor_type(func, args, dict(kwargs))
            if func is not torch.Tensor.to:          # .cuda(), .pin_memory(): the identity
                return args[0]
            if len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], _CPU) + tuple(args[2:])
        if "device" in kwargs or kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            if "device" in kwargs:
                kwargs["device"] = _cpu_if_cuda(kwargs["device"])
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        return func(*args, **kwargs)

    @staticmethod
    def _tensor_type(func: Callable, args: tuple, kwargs: dict) -> Any:
        target = args[1] if len(args) > 1 else kwargs.pop("dtype", None)
        if target is None:  # a query: answer as a CUDA tensor would
            name = func(args[0])
            return name if name.startswith("torch.cuda.") else "torch.cuda." + name[len("torch."):]
        if isinstance(target, str):
            target = _cpu_type_name(target)
        elif isinstance(target, type) and target.__module__ == "torch.cuda":
            target = getattr(torch, target.__name__)
        return func(args[0], target, *args[2:], **kwargs)


class _DropRngForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _RNG_WARNING not in record.getMessage()


def _cpu_manual_seed(seed: int) -> None:
    # Never torch.manual_seed: it calls torch.cuda.manual_seed_all, i.e. this function again.
    torch.default_generator.manual_seed(int(seed))


def _rng_functions() -> dict[str, Callable[..., Any]]:
    """Fresh CPU-generator replacements of the torch.cuda RNG API (new objects on every call)."""

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    def get_rng_state_all() -> list[torch.Tensor]:
        return [torch.get_rng_state()]

    def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
        torch.set_rng_state(new_states[0])

    def manual_seed(seed: int) -> None:
        _cpu_manual_seed(seed)

    def manual_seed_all(seed: int) -> None:
        _cpu_manual_seed(seed)

    return {f.__name__: f for f in (get_rng_state, set_rng_state, get_rng_state_all,
                                    set_rng_state_all, manual_seed, manual_seed_all)}


def _device_functions() -> dict[str, Callable[..., Any]]:
    def current_device() -> int:
        return 0

    def set_device(device: Any) -> None:
        return None

    def synchronize(device: Any = None) -> None:
        return None

    return {f.__name__: f for f in (current_device, set_device, synchronize)}


def _nvtx_functions() -> dict[str, Callable[..., Any]]:
    def range_push(msg: str) -> int:
        return 0

    def range_pop() -> int:
        return 0

    def mark(msg: str) -> None:
        return None

    return {f.__name__: f for f in (range_push, range_pop, mark)}


def _megatron_rng_functions() -> dict[str, Callable[..., Any]]:
    def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False,
                            graph_safe: bool = False) -> torch.Tensor:
        if graph_safe:
            raise NotImplementedError("CUDA-graph-safe RNG states have no CPU equivalent")
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1,
                            graph_safe: bool = False) -> None:
        if graph_safe:
            raise NotImplementedError("CUDA-graph-safe RNG states have no CPU equivalent")
        torch.set_rng_state(new_state)

    return {f.__name__: f for f in (_get_cuda_rng_state, _set_cuda_rng_state)}


def _engine_run_backward_under(mode: TorchFunctionMode,
                                engine_run_backward: Callable[..., Any]) -> Callable[..., Any]:
    def _engine_run_backward(*args: Any, **kwargs: Any) -> Any:
        with mode:
            return engine_run_backward(*args, **kwargs)

    return _engine_run_backward


def _patch(namespace: object, functions: dict[str, Callable[..., Any]]) -> None:
    for name, function in functions.items():
        setattr(namespace, name, function)


def activate() -> bool:
    """Install the CPU layer when CUDA is absent; idempotent. Returns whether it is active."""
    global _active_mode
    if _active_mode is not None:
        return True
    if torch.cuda.is_available():
        return False
    engine_run_backward = getattr(torch.autograd, "_engine_run_backward", None)
    if engine_run_backward is None:
        raise RuntimeError(f"torch {torch.__version__} lacks torch.autograd._engine_run_backward: "
                           "the CPU platform layer cannot cover the backward pass")
    # megatron.core first: its import registers torch.cuda functions with dynamo (see docstring).
    import megatron.core  # noqa: F401
    from megatron.core.tensor_parallel import random as megatron_random
    from seq1f1b.runtime import wgrad_fusion

    _patch(torch.cuda, _device_functions())
    _patch(torch.cuda.nvtx, _nvtx_functions())
    _patch(torch.cuda, _rng_functions())
    _patch(torch.cuda.random, _rng_functions())
    _patch(megatron_random, _megatron_rng_functions())
    wgrad_fusion.install_host_kernel()
    logging.getLogger(megatron_random.__name__).addFilter(_DropRngForkWarning())
    mode = _CudaToCpuMode()
    torch.autograd._engine_run_backward = _engine_run_backward_under(mode, engine_run_backward)
    mode.__enter__()  # process-wide from here on (for this thread: the mode stack is thread-local)
    torch.set_flush_denormal(True)
    _active_mode = mode
    if os.environ.get(STRICT_ENV) == "1":   # for the rest of the process
        mode.rules = strict_cuda.install(_is_cuda_device)
        mode.rules.enforcing += 1
    return True


def is_active() -> bool:
    """Whether `activate()` installed the CPU layer in this process."""
    return _active_mode is not None


def is_strict() -> bool:
    """Whether CUDA's rules are enforced now (see `strict_mode`)."""
    return _active_mode is not None and _active_mode.rules is not None


@contextlib.contextmanager
def strict_mode() -> Iterator[None]:
    """Enforce CUDA's rules (seq1f1b/strict_cuda.py) within this block, on tensors made in it;
    `SEQ1F1B_STRICT_CUDA=1` enforces them in the whole process from `activate()` on."""
    if _active_mode is None:
        raise RuntimeError("strict CUDA mode needs the CPU platform layer: call activate() first")
    rules = strict_cuda.install(_is_cuda_device)
    previous, _active_mode.rules = _active_mode.rules, rules
    rules.enforcing += 1
    try:
        yield
    finally:
        rules.enforcing -= 1
        _active_mode.rules = previous


def seen_on_device(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is in GPU memory: a CUDA tensor, or one strict mode keeps on its
    emulated device (without strict mode the CPU layer keeps no such record: False)."""
    if tensor.is_cuda:
        return True
    rules = _active_mode.rules if _active_mode is not None else None
    return rules is not None and rules.enforcing > 0 and rules.is_device(tensor)


def compute_device() -> torch.device:
    """The device the model computes on, as the code should name it: the current CUDA device on
    a GPU and under the CPU layer (whose mode lands it on the CPU, so code written for the GPU is
    the code that runs here), the CPU otherwise (plain single-process use without `activate()`)."""
    if torch.cuda.is_available() or is_active():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU
