"""Strict mode of the CPU platform layer: CUDA's rules, enforced on the CPU.

The platform layer lands every CUDA tensor on the CPU, so the whole suite runs without a GPU. It
also hides the mistakes a GPU punishes at once: a batch never moved to the device, a host tensor
handed to NCCL, a host sync in the hot loop. Strict mode (`SEQ1F1B_STRICT_CUDA=1` with the layer
active, or `platform.strict_mode()` around a block) makes them fail here too.

Which tensors are on the "GPU". Being on a device is a property of memory, so strict mode keeps
the set of storages that would be in GPU memory (by identity, without keeping them alive); a view,
an alias, `.data` or a saved tensor of a device tensor shares its storage and so its place. A
storage is on the device when it was:
- made for CUDA: a factory or `.to()` given "cuda", "cuda:N", a cuda torch.device or an ordinal
  (what `torch.cuda.current_device()` returns), `.cuda()`, a module's `.cuda()`;
- computed from device tensors (any op with one among its inputs, unless it moves the result to
  the host: `.cpu()`, `.to("cpu")`), or is the `.grad` of one;
- in a backward pass whose roots are on the device, a gradient the autograd engine hands to Python
  code (custom Functions' backward, hooks): the engine makes those outside any torch call, so
  there a floating-point tensor strict mode has not seen is taken for a gradient. Tensors the
  backward makes on the host with torch calls stay on the host, and so do integer ones (e.g. the
  RNG states megatron's tracker compares when a recomputed forward forks it).
A device tensor answers `.device` with a CPU device object that strict mode recognises as the GPU:
code that allocates with `device=x.device` allocates on the "GPU", and code that picks a kernel by
`x.device.type` still picks the CPU's. Every other tensor with a storage is on the host (tensors
without one, e.g. sparse, are not checked). Moving a host tensor to the device (or back) makes a
new tensor, as on a GPU; the original stays where it was.

The rules:
1. placement: an op that mixes a device tensor with a host tensor that is not a 0-dim scalar
   raises CUDA's "Expected all tensors to be on the same device" (CUDA takes host scalars, but an
   in-place op does not write device values into a host tensor). Transfers (`copy_`, `.to`,
   assignment into a device tensor) and host index tensors are allowed, as on CUDA; `.numpy()` of
   a device tensor raises CUDA's TypeError; a `.grad` must be where its tensor is.
2. collectives: a torch.distributed collective or p2p given a host tensor raises, as NCCL does
   ("Tensors must be CUDA and dense"). The check is in the torch.distributed functions (and in
   megatron's module-level aliases of them), not in the thread-local mode, so it holds in any
   thread. Groups created with an explicit `backend="gloo"` (megatron's *_GLOO groups) take host
   tensors, as they do on a GPU machine.
3. host syncs: inside `host_sync_forbidden()` (entered around the executor's run), `.item()`,
   `.tolist()`, `int()`, `float()`, `bool()`, `__index__`, printing, `.cpu()` / `.to("cpu")` (unless
   non_blocking), a blocking `copy_` to the host, `torch.equal` / `allclose`, `nonzero` and boolean-
   mask indexing of a device tensor raise, and so does `Work.wait(timeout)` (on NCCL a wait with a
   timeout busy-waits the host). So does a blocking host-to-device copy: `.to(device)`, `.cuda()`
   or `copy_` of a host tensor without `non_blocking=True`, `torch.tensor` / `as_tensor` /
   `asarray` of host data with a device placement, a host tensor assigned into a device tensor
   (CUDA's blocking copies synchronize the stream: they wait for every queued kernel).
   `host_sync_allowed()` lifts this for a deliberate sync. The rule holds in the thread that
   entered it (the autograd engine runs a CPU backward in that thread).
4. kernel dispatch: our scaled_dot_product_attention calls are checked against the kernel CUDA
   would choose for them (seq1f1b/runtime/sdpa_dispatch.py): the math kernel above a size, or a
   padded copy of a mask of that size, raises.

What strict mode cannot emulate:
- streams and asynchrony: kernels run at once on the CPU, so a missing stream wait or
  `record_stream`, a race between streams, a `non_blocking` copy read before it lands and host
  timings without CUDA events (the trace's) all pass;
- the caching allocator: reuse, fragmentation, reserved versus allocated memory, out-of-memory;
- NCCL's matching and progress: gloo matches by tag and buffers sends (the plan's communication
  checker replays NCCL's order instead), NCCL's watchdog and communicator aborts;
- host syncs it does not see: other ops with data-dependent shapes or blocking semantics, syncs in
  threads that run without the mode (a p2p worker thread), waits inside other libraries;
- kernels: dtype support, TF32 and fused/flash numerics, device capability checks;
- memory that reaches Python without a torch call the mode sees (made by C++ outside a backward,
  in threads without the mode, before activation) counts as host: a false alarm names such a
  tensor. `str(x.device)` and `torch.device(x.device)` lose the device mark.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

# What a device tensor's `.device` answers: the CPU (for kernels), taken for the GPU (placement).
DEVICE_MARK = torch.device("cpu")

_CHECKED_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "gather", "scatter",
    "all_to_all", "all_to_all_single", "all_reduce_coalesced", "all_gather_coalesced", "send",
    "recv", "isend", "irecv", "batch_isend_irecv")
# P2POp accepts only distributed_c10d's own isend/irecv: those two are replaced there too.
_C10D_REPLACED = ("isend", "irecv")
_INPLACE_OPERATORS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                            "and", "or", "xor", "lshift", "rshift"))
_SYNCS = frozenset([
    Tensor.item, Tensor.tolist, Tensor.__int__, Tensor.__float__, Tensor.__bool__,
    Tensor.__index__, Tensor.__complex__, Tensor.__repr__, Tensor.__format__, Tensor.equal,
    Tensor.allclose, Tensor.nonzero, torch.equal, torch.allclose, torch.nonzero])
# Ops that compare or relate tensors without computing on them: any devices.
_ANY_DEVICES = frozenset([torch._has_compatible_shallow_copy_type, torch.is_same_size,
                          Tensor.is_set_to])
_ATTRIBUTE_ACCESS = type(Tensor.grad.__get__)     # how torch names a Tensor attribute's get/set
_BASE = torch._C.TensorBase


class _Ref(weakref.ref):
    """A weak reference that knows its key in `StorageSet`."""

    __slots__ = ("key",)


def _storage(tensor: Tensor) -> Optional[torch.UntypedStorage]:
    """The memory `tensor` views (one Python object per storage while it lives), or None."""
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):   # sparse, nested, wrapper subclasses
        return None


class StorageSet:
    """The storages of tensors, held weakly (a weakref.WeakSet would compare them with ==)."""

    def __init__(self) -> None:
        self._refs: dict[int, _Ref] = {}

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        ref = self._refs.get(id(storage))
        return ref is not None and ref() is storage

    def add(self, storage: torch.UntypedStorage) -> None:
        if storage not in self:
            ref = _Ref(storage, self._forget)
            ref.key = id(storage)
            self._refs[ref.key] = ref

    def clear(self) -> None:
        self._refs.clear()

    def _forget(self, ref: _Ref) -> None:
        if self._refs.get(ref.key) is ref:
            del self._refs[ref.key]


class _SyncState(threading.local):
    forbidden = 0


_sync = _SyncState()


@contextlib.contextmanager
def host_sync_forbidden() -> Iterator[None]:
    """In this thread, a host sync on a device tensor raises (strict mode; otherwise nothing is
    checked). Entered around the executor's run: on a GPU each sync stalls the pipeline until
    every queued kernel is done."""
    _sync.forbidden += 1
    try:
        yield
    finally:
        _sync.forbidden -= 1


@contextlib.contextmanager
def host_sync_allowed() -> Iterator[None]:
    """A deliberate host sync inside `host_sync_forbidden()`: say why where you use it."""
    saved, _sync.forbidden = _sync.forbidden, 0
    try:
        yield
    finally:
        _sync.forbidden = saved


def _check_sync(what: str, cost: str = "waits for every queued GPU kernel") -> None:
    if _sync.forbidden:
        raise RuntimeError(
            f"host sync in the hot loop: {what} {cost} (strict CUDA mode, inside "
            "platform.host_sync_forbidden()). Keep the value on the device, or make a deliberate "
            "sync explicit with seq1f1b.platform.host_sync_allowed()")


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _tensors(values: Iterable[Any]) -> list[Tensor]:
    """The tensors among `values` and inside lists/tuples among them (one level deep)."""
    found = []
    for value in values:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, Tensor))
    return found


def _in_place(func: Any) -> bool:
    """An in-place op: CUDA takes a host 0-dim tensor as an input, never as the one written."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_OPERATORS


def _mixing_error(func: Any, host: Tensor, device: Optional[Tensor]) -> RuntimeError:
    met = f"a device tensor of shape {tuple(device.shape)}" if device is not None else "device ones"
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 "
        f"and cpu! ({_name(func)}: a host tensor of shape {tuple(host.shape)} meets {met}; "
        "strict CUDA mode: move it to the device, or make it on the device)")


class StrictRules:
    """The device storages and the rules; the platform's mode calls `call` for every torch call
    while it enforces them (`enforcing` > 0)."""

    def __init__(self, is_cuda_device: Callable[[Any], bool]) -> None:
        self.device = StorageSet()
        self.enforcing = 0
        self._is_cuda_device = is_cuda_device
        self._backward_depth = 0
        self._backward_host = StorageSet()     # host memory made during a device backward
        self._special: dict[Any, Callable] = {
            Tensor.cuda: self._cuda, Tensor.cpu: self._cpu, Tensor.to: self._to,
            Tensor.copy_: self._copy, Tensor.__getitem__: self._getitem,
            Tensor.__setitem__: self._setitem, Tensor.numpy: self._numpy,
            Tensor.__array__: self._numpy,
            torch.tensor: self._from_data, torch.as_tensor: self._from_data,
            torch.asarray: self._from_data,
            **{func: self._sync_op for func in _SYNCS},
            **{func: self._any_devices for func in _ANY_DEVICES}}
        self._attributes: dict[tuple[Any, str], Callable] = {
            (_BASE.device, "__get__"): self._get_device, (_BASE.grad, "__get__"): self._get_grad,
            (_BASE.grad, "__set__"): self._set_grad}

    # -- where tensors are ------------------------------------------------------------------------
    def where(self, tensor: Tensor) -> Optional[bool]:
        """True on the device, False on the host, None without a storage (not checked)."""
        storage = _storage(tensor)
        if storage is None:
            return None
        if storage in self.device:
            return True
        if (self._backward_depth and tensor.is_floating_point()
                and storage not in self._backward_host):
            self.device.add(storage)    # a gradient the autograd engine made in a device backward
            return True
        return False

    def is_device(self, tensor: Tensor) -> bool:
        return self.where(tensor) is True

    def placement(self, device: Any) -> Optional[bool]:
        """True for a device placement, False for the host, None when `device` is None."""
        if device is None:
            return None
        return device is DEVICE_MARK or self._is_cuda_device(device)

    def place(self, out: Any, on_device: bool) -> Any:
        """Record where the tensors of an op's result are; returns `out`."""
        if on_device:
            where = self.device
        elif self._backward_depth:
            where = self._backward_host
        else:
            return out
        for tensor in _tensors((out,)):
            storage = _storage(tensor)
            if storage is not None:
                where.add(storage)
        return out

    @contextlib.contextmanager
    def device_backward(self) -> Iterator[None]:
        self._backward_depth += 1
        try:
            yield
        finally:
            self._backward_depth -= 1
            if not self._backward_depth:
                self._backward_host.clear()

    # -- every torch call --------------------------------------------------------------------------
    def call(self, func: Any, args: tuple, kwargs: dict, run: Callable) -> Any:
        """Check and run one torch call; `run(func, args, kwargs)` is the CPU layer's mapping."""
        if type(func) is _ATTRIBUTE_ACCESS:
            handler = self._attributes.get((func.__self__, func.__name__), self._attribute)
        else:
            handler = self._special.get(func, self._op)
        return handler(func, args, kwargs, run)

    def _attribute(self, func: Any, args: tuple, kwargs: dict, run: Callable) -> Any:
        """Any other attribute of a tensor (shape, dtype, T, ...): one tensor, nothing to mix."""
        out = run(func, args, kwargs)
        if isinstance(out, Tensor):
            self.place(out, self.is_device(args[0]))
        return out

    def _op(self, func: Any, args: tuple, kwargs: dict, run: Callable) -> Any:
        on_device = self._device_inputs(func, args, kwargs)
        target = self.placement(kwargs.get("device")) if kwargs else None
        return self.place(run(func, args, kwargs), on_device if target is None else target)

    def _sync_op(self, func: Any, args: tuple, kwargs: dict, run: Callable) -> Any:
        if self._device_inputs(func, args, kwargs):
            _check_sync(f"{_name(func)} of a device tensor")
        return self._op(func, args, kwargs, run)

    def _any_devices(self, func: Any, args: tuple, kwargs: dict, run: Callable) -> Any:
        return run(func, args, kwargs)

    def _device_inputs(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether a device tensor is among the inputs; raises when a host one is too."""
        tensors = _tensors((*args, *kwargs.values()) if kwargs else args)
        device, host = None, None
        for tensor in tensors:
            where = self.where(tensor)
            if where:
                device = tensor
            elif (where is not None and host is None
                  and (tensor.dim() > 0 or tensor is args[0] and _in_place(func))):
                host = tensor
        if device is not None and host is not None:
            raise _mixing_error(func, host, device)
        return device is not None

    # -- transfers ---------------------------------------------------------------------------------
    def _moved(self, source: Tensor, out: Tensor, to_device: bool) -> Tensor:
        """A transfer between host and device makes a new tensor, as on a GPU (the CPU layer
        hands back the same one)."""
        if out is source and self.is_device(source) != to_device:
            out = source.clone()
        return self.place(out, to_device)

    def _upload(self, what: str, source: Tensor, non_blocking: bool) -> None:
        """A host tensor going to the device: a sync unless the copy is non-blocking."""
        if not non_blocking and self.where(source) is False:
            _check_sync(f"{what} of a host tensor", "is a blocking host-to-device copy: it "
                        "waits for every queued GPU kernel (use non_blocking=True, from pinned "
                        "memory)")

    def _cuda(self, func, args, kwargs, run):
        self._upload("Tensor.cuda()", args[0], kwargs.get("non_blocking", False))
        return self._moved(args[0], args[0], True)

    def _cpu(self, func, args, kwargs, run):
        if self.is_device(args[0]):
            _check_sync("Tensor.cpu() of a device tensor")
        return self._moved(args[0], run(func, args, kwargs), False)

    def _to(self, func, args, kwargs, run):
        source = args[0]
        target = self._to_target(args, kwargs)
        if target is None:
            return self.place(run(func, args, kwargs), self.is_device(source))
        if not target and self.is_device(source) and not kwargs.get("non_blocking"):
            _check_sync("Tensor.to(host) of a device tensor")
        if target:
            self._upload("Tensor.to(device)", source, kwargs.get("non_blocking", False))
        return self._moved(source, run(func, args, kwargs), target)

    def _to_target(self, args: tuple, kwargs: dict) -> Optional[bool]:
        other = kwargs.get("other")
        device = kwargs.get("device")
        if len(args) > 1:
            if isinstance(args[1], Tensor):
                other = args[1]
            elif not isinstance(args[1], torch.dtype):
                device = args[1]
        if other is not None:
            return self.is_device(other)
        return self.placement(device)

    def _copy(self, func, args, kwargs, run):
        target, source = args[0], args[1]
        non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
        if self.is_device(source) and not self.is_device(target) and not non_blocking:
            _check_sync("copy_ of a device tensor into a host tensor")
        if self.is_device(target) and isinstance(source, Tensor):
            self._upload("copy_ into a device tensor", source, non_blocking)
        return run(func, args, kwargs)

    def _from_data(self, func, args, kwargs, run):
        """torch.tensor / as_tensor / asarray: with a device placement, host data (a Python
        value or a host tensor) is copied to the device, blocking."""
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        if self.placement(kwargs.get("device")) and not (
                isinstance(data, Tensor) and self.is_device(data)):
            _check_sync(f"torch.{func.__name__}(host data, device=cuda)", "is a blocking "
                        "host-to-device copy: it waits for every queued GPU kernel (make it on "
                        "the host and move it with non_blocking=True, or use a fill such as "
                        "torch.full)")
        return self._op(func, args, kwargs, run)

    def _getitem(self, func, args, kwargs, run):
        on_device = self.is_device(args[0])
        for index in _tensors(args[1:]):
            if not on_device and self.is_device(index):
                raise _mixing_error(func, args[0], None)
            if on_device and index.dtype == torch.bool:
                _check_sync("boolean-mask indexing of a device tensor (data-dependent shape)")
        return self.place(run(func, args, kwargs), on_device)

    def _setitem(self, func, args, kwargs, run):
        target, index, value = args[0], args[1], args[2]
        on_device = self.is_device(target)
        indices = _tensors((index,))
        if not on_device and any(self.is_device(i) for i in indices):
            raise _mixing_error(func, target, None)
        scalar = not isinstance(value, Tensor) or (value.dim() == 0 and not self.is_device(value))
        if on_device and not scalar and any(i.dtype == torch.bool for i in indices):
            # (a host scalar under a boolean mask is a masked_fill_: no sync)
            _check_sync("boolean-mask assignment into a device tensor (data-dependent shape)")
        if not on_device and isinstance(value, Tensor) and self.is_device(value):
            _check_sync("assignment of a device tensor into a host tensor")
        if on_device and isinstance(value, Tensor) and value.dim() > 0:
            self._upload("assignment into a device tensor", value, False)
        return run(func, args, kwargs)

    def _numpy(self, func, args, kwargs, run):
        if self.is_device(args[0]):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() "
                            "to copy the tensor to host memory first. (strict CUDA mode)")
        return run(func, args, kwargs)

    # -- attributes --------------------------------------------------------------------------------
    def _get_device(self, func, args, kwargs, run):
        return DEVICE_MARK if self.is_device(args[0]) else run(func, args, kwargs)

    def _get_grad(self, func, args, kwargs, run):
        return self.place(run(func, args, kwargs), self.is_device(args[0]))

    def _set_grad(self, func, args, kwargs, run):
        tensor, grad = args[0], args[1]
        if isinstance(grad, Tensor) and self.is_device(grad) != self.is_device(tensor):
            raise RuntimeError("assigned grad has data located on a different device (strict "
                               "CUDA mode: a .grad must be on its tensor's device)")
        return run(func, args, kwargs)

    # -- collectives -------------------------------------------------------------------------------
    def check_collective(self, name: str, args: tuple, kwargs: dict) -> None:
        """Raise when a collective or p2p would hand NCCL a host tensor."""
        values = (*args, *kwargs.values())
        tensors = _tensors(values)
        groups = [v for v in values if isinstance(v, dist.ProcessGroup)]
        for op in (item for value in values if isinstance(value, (list, tuple))
                   for item in value if isinstance(item, dist.P2POp)):
            tensors.append(op.tensor)
            groups.append(op.group)
        if any(group in _host_groups for group in groups):
            return
        for tensor in tensors:
            if self.where(tensor) is False:
                raise RuntimeError(
                    f"torch.distributed.{name}: Tensors must be CUDA and dense (a host tensor of "
                    f"shape {tuple(tensor.shape)} goes to an NCCL group; strict CUDA mode: "
                    "allocate it on the device, or use a group created with backend='gloo')")


_rules: Optional[StrictRules] = None
_host_groups: "weakref.WeakSet[dist.ProcessGroup]" = weakref.WeakSet()


def _checked_collective(name: str, function: Callable) -> Callable:
    def checked(*args: Any, **kwargs: Any) -> Any:
        if _rules is not None and _rules.enforcing:
            _rules.check_collective(name, args, kwargs)
        return function(*args, **kwargs)

    checked.__name__ = checked.__qualname__ = name
    checked.__doc__ = function.__doc__
    checked.__wrapped__ = function
    return checked


def _recording_new_group(new_group: Callable) -> Callable:
    def recording(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if isinstance(group, dist.ProcessGroup) and str(backend).lower() == "gloo":
            _host_groups.add(group)
        return group

    recording.__name__ = recording.__qualname__ = "new_group"
    recording.__wrapped__ = new_group
    return recording


def _checked_wait(wait: Callable) -> Callable:
    def checked(work: Any, timeout: timedelta = timedelta(0)) -> Any:
        if _rules is not None and _rules.enforcing and timeout != timedelta(0):
            _check_sync(f"Work.wait({timeout})", "busy-waits the host on NCCL until the work is "
                        "done (without a timeout, wait() only makes the current stream wait)")
        return wait(work, timeout)

    checked.__name__ = checked.__qualname__ = "wait"
    return checked


class _BackwardEngine:
    """torch's autograd engine, noting when a backward starts from device tensors: the gradients
    it then hands to Python code are device tensors (see the module docstring)."""

    def __init__(self, engine: Any, rules: StrictRules) -> None:
        self._engine = engine
        self._rules = rules

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        roots = kwargs.get("tensors", args[0] if args else ())
        grads = kwargs.get("grad_tensors", args[1] if len(args) > 1 else ())
        rules = self._rules
        if not rules.enforcing or not any(rules.is_device(t) for t in _tensors((roots, grads))):
            return self._engine.run_backward(*args, **kwargs)
        with rules.device_backward():
            return rules.place(self._engine.run_backward(*args, **kwargs), True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _tracking_backward_apply(apply: Callable) -> Callable:
    """A custom autograd Function's backward entry: in a device backward, the gradients it is
    handed are device tensors even if it only keeps them (e.g. for a deferred W)."""
    def backward_apply(ctx: Any, *args: Any) -> Any:
        if _rules is not None and _rules.enforcing:
            for tensor in _tensors(args):
                _rules.is_device(tensor)
        return apply(ctx, *args)

    return backward_apply


def _rebind(replacements: dict[int, tuple[Callable, Callable]]) -> None:
    """Point module-level aliases of replaced functions (megatron keeps a few, e.g.
    `dist_all_gather_func = torch.distributed.all_gather_into_tensor`) at the replacements;
    `replacements` maps id(original) to (original, replacement)."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("megatron", "seq1f1b")):
            continue
        for attr, value in list(vars(module).items()):
            original, replacement = replacements.get(id(value), (None, None))
            if value is original:
                setattr(module, attr, replacement)


def install(is_cuda_device: Callable[[Any], bool]) -> StrictRules:
    """Install the checks that live outside the torch-function mode (torch.distributed,
    `Work.wait`, the autograd engine, custom Functions' backward) once; returns the process's
    rules. Each check does nothing until `rules.enforcing` is raised."""
    global _rules
    if _rules is not None:
        return _rules
    rules = StrictRules(is_cuda_device)
    originals = {name: getattr(dist, name) for name in (*_CHECKED_COLLECTIVES, "new_group")}
    replaced = {name: _checked_collective(name, originals[name]) for name in _CHECKED_COLLECTIVES}
    replaced["new_group"] = _recording_new_group(originals["new_group"])
    for name, function in replaced.items():
        setattr(dist, name, function)
    for name in _C10D_REPLACED:
        setattr(dist.distributed_c10d, name, replaced[name])
    _rebind({id(originals[name]): (originals[name], function)
             for name, function in replaced.items()})
    dist.Work.wait = _checked_wait(dist.Work.wait)
    backward = torch.autograd.function.BackwardCFunction
    backward.apply = _tracking_backward_apply(backward.apply)
    variable = torch.autograd.Variable
    variable._execution_engine = _BackwardEngine(variable._execution_engine, rules)
    _rules = rules
    return rules
