#!/usr/bin/env python3
"""Measure on one device what the cost model and the memory estimator assume.

    device_check.py OUTDIR            on a GPU (about 3-6 minutes on one H200)
    device_check.py OUTDIR --tiny     small shapes, runs on a CPU in seconds (CI smoke test)
    device_check.py OUTDIR --suite gpu [--tiny] [--parts P ...]   the first GPU run's evidence

--suite gpu writes five parts, each with its own budget (SUITE_BUDGETS_S, 9 minutes in all) and its
failure kept to itself: numerics (seq1f1b/device_checks/numerics.py: bf16 span attention with a
cached prefix against an fp32 reference, per backend), training
(megatron/training/device_training.py: pretrain_gpt.py, bf16, the 1.3B shape at 16K, 20 iterations
with seq1f1b k=1 and k=4, two iterations of each profiled), memory (the stage run at 32K,
held_microbatches below, and the same stage with and without --loss-backward-in-forward and
under selective and full (uniform, 2 layers) recompute: the allocator's peak of each),
attention (the comparison, merge_gqa: the span merge with grouped-query attention on cuDNN,
seq1f1b/device_checks/merge_gqa.py, and span_kernels below) and documents
(seq1f1b/device_checks/documents.py: packed documents' peak memory against the dense case at the
same shape, per backend).

The default suite writes OUTDIR/device_check.json with these parts (the stage first; parts that
would start after --budget-s are skipped and say so):
- attention: per kernel backend of `SpanAttention` (eager, sdpa, flex, flash, te; the ones that
  cannot run here are listed with the reason), the forward and forward+backward time of a query
  span of L/4 tokens at the end of a sequence of L, attending to its cached prefix, against full
  causal attention over a sequence with the same number of query-key pairs (equal FLOPs).
- stage: a 7B-shaped model of 8 layers (one stage of the 32-layer 7B at PP=4; as the only stage
  it also holds the embedding and the output layer), bf16, one micro-batch cut into k=4
  computation-balanced spans and run by the seq1f1b executor at L = 32K and 64K: per-span F and B
  times beside the cost model's FLOPs for them (achieved TFLOPS per span), the iteration time.
- memory: for the same runs, torch.cuda.max_memory_allocated and the saved-tensor meter's peak
  beside the estimator's parameters + gradients + held-for-backward + workspace (no optimizer:
  no step is taken), and max_memory_reserved over max_memory_allocated: the caching allocator's
  reserve, which the estimator (allocated bytes) leaves out and the paper's figures include.
- held_microbatches: the same memory figures for the stage under GPipe with 4 unsplit
  micro-batches of 16K: at its peak it holds all 4, as 1F1B's first stage does at P = 4.
- span_kernels (last, with a budget and a try/except per check of its own): what only a GPU
  confirms of the span kernels. flex: k=8 computation-balanced spans of a 32K micro-batch,
  forward and backward as the executor runs them, twice, with dynamo failing rather than falling
  back to eager flex: the graphs each iteration compiled (expected 2, then 0), the peak memory,
  the errors against unsplit sdpa. te (when installed): the bytes of K/V prefix copies its
  attention saves, with 1 and 2 sequences per micro-batch (expected 0 with 1).

`reproduce_paper.py --device-check OUTDIR/device_check.json` (and `plan.py ... --device-check`)
turn the stage part into the cost model's GEMM and attention efficiencies, and the largest
reserved/allocated of all the runs into the memory verdicts' reserve
(seq1f1b/plan/calibration.py).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from seq1f1b.plan.costs import Recompute  # noqa: E402  (the repository root, just added)

PROG = "device_check.py"
BACKENDS = ("sdpa", "flash", "te", "eager", "flex")
"""In the order they are measured: flex last, its compilation takes the longest."""


class Deadline:
    """The wall-clock budget of the whole check; parts that would start past it are skipped."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def passed(self) -> bool:
        return time.perf_counter() > self.end

    def remaining(self) -> float:
        return max(0.0, self.end - time.perf_counter())


@dataclass(frozen=True)
class Shapes:
    """Sizes of one run of the check."""

    attention_length: int          # L of the attention comparison
    heads: int
    head_dim: int
    eager_max_score_bytes: float   # skip eager when its fp32 score matrix would exceed this
    hidden_size: int
    num_layers: int
    vocab_size: int
    stage_lengths: tuple[int, ...]
    splits: int
    repeats: int
    held_length: int               # tokens per micro-batch of the GPipe memory run
    held_microbatches: int
    kernel_length: int             # L of the span kernels part (flex in k spans, TE's layouts)
    kernel_splits: int
    numerics_length: int           # L of the numerics part (--suite gpu), its query span L/4
    numerics_heads: int


GPU = Shapes(attention_length=16384, heads=32, head_dim=128, eager_max_score_bytes=24e9,
             hidden_size=4096, num_layers=8, vocab_size=50304,
             stage_lengths=(32768, 65536), splits=4, repeats=2, held_length=16384,
             held_microbatches=4, kernel_length=32768, kernel_splits=8,
             numerics_length=32768, numerics_heads=8)
TINY = Shapes(attention_length=256, heads=4, head_dim=16, eager_max_score_bytes=1e9,
              hidden_size=64, num_layers=2, vocab_size=128, stage_lengths=(128, 256), splits=4,
              repeats=2, held_length=128, held_microbatches=4, kernel_length=2048,
              kernel_splits=8, numerics_length=256, numerics_heads=4)
KERNELS_BUDGET_S = 180.0
"""The span kernels part's own budget (flex's first compilation of forward and backward takes
about a minute on a GPU); it runs last, whatever the other parts left."""


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_seconds(run: Callable[[], None], repeats: int) -> float:
    run()                                   # warm-up (kernel selection, compilation)
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        run()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _setup_process() -> None:
    """A one-process world with TP = PP = 1 (gloo on CPU with the platform layer, NCCL on GPU)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from seq1f1b.distributed import init_distributed

    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    init_distributed()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    assert dist.get_world_size() == 1, "device_check.py runs as one process"


def _config(hidden_size: int, heads: int, layers: int, **overrides):
    """fp32 on the CPU, bf16 on a GPU (the paper's precision); `overrides` go to the
    TransformerConfig (activation recompute)."""
    import torch

    from seq1f1b import megatron_adapter

    return megatron_adapter.make_transformer_config(
        num_layers=layers, hidden_size=hidden_size, num_attention_heads=heads,
        fp32=not torch.cuda.is_available(), **overrides)


# -- attention -----------------------------------------------------------------------------------
def _equal_pairs_length(length: int, span: int) -> int:
    """The causal sequence with as many query-key pairs as a span of `span` queries ending at
    `length` (span*length - span^2/2 = full^2/2), rounded to a multiple of 64 when that is
    possible."""
    exact = math.sqrt(2 * span * length - span * span)
    return max(64, round(exact / 64) * 64) if exact >= 64 else max(1, round(exact))


def check_attention(shapes: Shapes, deadline: Deadline) -> dict:
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from seq1f1b.plan.costs import ModelConfig, layer_flops
    from seq1f1b.runtime.attention import SpanAttention, backend_unavailable_reason
    from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context

    config = _config(shapes.heads * shapes.head_dim, shapes.heads, 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = config.params_dtype
    n, d, length = shapes.heads, shapes.head_dim, shapes.attention_length
    span = length // 4
    full = _equal_pairs_length(length, span)
    model = ModelConfig(num_layers=1, hidden_size=n * d, num_attention_heads=n)
    results = {"length": length, "span": span, "prefix": length - span, "full_length": full,
               "heads": n, "head_dim": d, "dtype": str(dtype).replace("torch.", ""),
               "backends": {}}

    def tensors(rows: int) -> list:
        return [torch.randn(rows, 1, n, d, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3)]

    for name in BACKENDS:
        reason = backend_unavailable_reason(name, config)
        score_bytes = 4.0 * n * max(span * length, full * full)
        if reason is None and name == "eager" and score_bytes > shapes.eager_max_score_bytes:
            reason = f"its fp32 score matrix would take {score_bytes / 1e9:.0f} GB"
        if reason is None and name == "flex" and device.type == "cpu":
            reason = "torch's FlexAttention has no CPU backward"
        if reason is None and deadline.passed():
            reason = "the time budget (--budget-s) ran out"
        if reason is not None:
            results["backends"][name] = {"skipped": reason}
            continue
        module = SpanAttention(config, 1, AttnMaskType.causal, "self", backend=name).to(device)
        q_full, k_full, v_full = tensors(full)
        q_span, k_span, v_span = tensors(span)
        prefix_k, prefix_v = (torch.randn(length - span, 1, n, d, device=device, dtype=dtype,
                                          requires_grad=True) for _ in range(2))

        def full_forward():
            return module(q_full, k_full, v_full, None)

        def span_forward():
            cache = MicrobatchKVCache(0, length)
            cache.layer(module, prefix_k, prefix_v).write(0, length - span, prefix_k, prefix_v)
            with span_context(SpanContext(0, 1, length - span, length, cache)):
                return module(q_span, k_span, v_span, None)

        def forward_backward(forward):
            def run():
                forward().float().sum().backward()
            return run

        try:
            with torch.no_grad():
                times = {"full_forward_s": _median_seconds(full_forward, shapes.repeats),
                         "span_forward_s": _median_seconds(span_forward, shapes.repeats)}
            times["full_forward_backward_s"] = _median_seconds(forward_backward(full_forward),
                                                               shapes.repeats)
            times["span_forward_backward_s"] = _median_seconds(forward_backward(span_forward),
                                                               shapes.repeats)
        except (RuntimeError, ValueError, NotImplementedError) as err:
            results["backends"][name] = {"skipped": f"{type(err).__name__}: "
                                                    f"{str(err).splitlines()[0]}"}
            continue
        span_flops = layer_flops(model, span, length).attention
        full_flops = layer_flops(model, full, full).attention
        times.update(
            span_forward_tflops=span_flops / times["span_forward_s"] / 1e12,
            full_forward_tflops=full_flops / times["full_forward_s"] / 1e12,
            span_over_full_forward_backward=(times["span_forward_backward_s"] / span_flops)
            / (times["full_forward_backward_s"] / full_flops))
        results["backends"][name] = times
    return results


# -- span kernels: what only a GPU confirms of flex and TE ----------------------------------------
def _span_pass(module, tensors: list, bounds: list[tuple[int, int]], backward: bool) -> list:
    """One micro-batch through `module` in spans as the executor runs it (forward 0..k-1, then
    backward k-1..0): the output and, with `backward`, the gradients of q, k and v."""
    import torch

    from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context

    *qkv, grad_out = tensors
    leaves = [t.detach().requires_grad_(backward) for t in qkv]
    cache = MicrobatchKVCache(0, bounds[-1][1], requires_grad=backward)
    outputs = []
    with torch.set_grad_enabled(backward):
        for j, (start, end) in enumerate(bounds):
            with span_context(SpanContext(0, j, start, end, cache)):
                outputs.append(module(*(t[start:end] for t in leaves), None))
    if backward:
        for j, (start, end) in reversed(list(enumerate(bounds))):
            with span_context(SpanContext(0, j, start, end, cache)):
                outputs[j].backward(grad_out[start:end])
    return [torch.cat([o.detach() for o in outputs])] + [t.grad for t in leaves if backward]


def _flex_in_spans(shapes: Shapes, config, device) -> dict:
    """flex over k computation-balanced spans of an L-token micro-batch, twice, dynamo failing
    instead of falling back to eager flex past its recompile limit: the graphs each iteration
    compiled, the peak memory beside the score matrix an eager fallback would hold, and the
    relative error of the output (and, on a GPU, dQ/dK/dV) against unsplit sdpa."""
    import torch
    import torch._dynamo
    from megatron.core.transformer.enums import AttnMaskType

    from seq1f1b.plan.costs import ModelConfig
    from seq1f1b.plan.partition import partition, span_bounds
    from seq1f1b.runtime.attention import SpanAttention

    n, d, length = shapes.heads, shapes.head_dim, shapes.kernel_length
    lengths = partition(length, shapes.kernel_splits, "compute",
                        ModelConfig(num_layers=1, hidden_size=n * d, num_attention_heads=n))
    backward = device.type == "cuda"        # torch has no CPU backward for flex
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(length, 1, n, d, device=device, dtype=config.params_dtype,
                           generator=gen) for _ in range(3)]
    tensors.append(torch.randn(length, 1, n * d, device=device, dtype=config.params_dtype,
                               generator=gen))
    modules = {name: SpanAttention(config, 1, AttnMaskType.causal, "self", backend=name)
               for name in ("flex", "sdpa")}
    reference = _span_pass(modules["sdpa"], tensors, [(0, length)], backward)
    torch._dynamo.reset()                   # count this run's graphs only
    counters = torch._dynamo.utils.counters["stats"]
    graphs, started = [], time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for _ in range(2):
            before = counters["unique_graphs"]
            result = _span_pass(modules["flex"], tensors, span_bounds(lengths), backward)
            graphs.append(counters["unique_graphs"] - before)
    names = ("output", "dq", "dk", "dv")
    return {
        "length": length, "span_lengths": lengths, "backward": backward,
        "graphs_compiled_per_iteration": graphs, "seconds": time.perf_counter() - started,
        "max_memory_allocated_bytes":
            torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "eager_fallback_score_bytes": 4.0 * n * lengths[-1] * length,
        "relative_error_vs_unsplit_sdpa": {
            name: ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
            for name, ours, ref in zip(names, result, reference)}}


def _te_prefix_copies(shapes: Shapes, config, device) -> dict:
    """Whether TE's attention reads the cache's K/V prefix in place: per micro-batch size (1 and
    2), the bytes of the tensors its graph saves that are prefix-sized and not the cache's
    storage (0 = read in place; see attention._build_te_attention)."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from seq1f1b.runtime.attention import SpanAttention
    from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context

    n, d, length = shapes.heads, shapes.head_dim, shapes.kernel_length
    start = length - length // shapes.kernel_splits
    module = SpanAttention(config, 1, AttnMaskType.causal, "self", backend="te")
    copies = {}
    for batch in (1, 2):
        q, k, v = (torch.randn(length, batch, n, d, device=device, dtype=config.params_dtype)
                   for _ in range(3))
        cache = MicrobatchKVCache(0, length)
        layer_kv = cache.layer(module, k, v)
        layer_kv.write(0, start, k[:start], v[:start])
        cache_storages = {t.untyped_storage().data_ptr() for t in layer_kv.tensors()}
        saved = []

        def keep(tensor):
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), \
                span_context(SpanContext(0, 1, start, length, cache)):
            module(*(t[start:].requires_grad_() for t in (q, k, v)), None)
        prefix = k[:start].numel()
        copies[f"batch_{batch}"] = sum(
            t.numel() * t.element_size() for t in saved
            if t.numel() >= prefix and t.untyped_storage().data_ptr() not in cache_storages)
    return {"length": length, "span_start": start, "copied_prefix_bytes": copies}


def _guarded(check: Callable[[], dict], deadline: Deadline) -> dict:
    """`check()`, or why it did not run or what it raised: one sub-check never loses another."""
    import torch

    if deadline.passed():
        return {"skipped": "the part's time budget ran out"}
    try:
        return check()
    except Exception as err:            # noqa: BLE001 -- reported in the JSON, not fatal
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def check_span_kernels(shapes: Shapes, deadline: Deadline) -> dict:
    """What only a GPU can confirm of the span kernels (issue 14, findings 6 and 8): flex trains
    k spans of a 32K micro-batch without recompiling per span shape and without the eager
    fallback's out-of-memory, and TE reads the cache's K/V prefix in place. On a CPU: flex's
    forward only, TE reported as unavailable."""
    import torch

    from seq1f1b.runtime.attention import backend_unavailable_reason

    config = _config(shapes.heads * shapes.head_dim, shapes.heads, 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {}
    for name, check in (("flex", _flex_in_spans), ("te", _te_prefix_copies)):
        reason = backend_unavailable_reason(name, config)
        result[name] = ({"skipped": reason} if reason is not None else
                        _guarded(functools.partial(check, shapes, config, device), deadline))
    return result


# -- one stage -----------------------------------------------------------------------------------
def _stage_model(shapes: Shapes, seq_length: int, recompute: Optional[Recompute] = None):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from seq1f1b import megatron_adapter

    config = _config(shapes.hidden_size, shapes.heads, shapes.num_layers,
                     **_recompute_fields(recompute))
    chunk = megatron_adapter.build_model_chunk(
        config, vocab_size=shapes.vocab_size, max_sequence_length=seq_length,
        position_embedding_type="rope", share_embeddings_and_output_weights=False)
    if torch.cuda.is_available():
        chunk = chunk.cuda()
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), chunk)
    config.no_sync_func = model.no_sync
    return config, model


def _batch(shapes: Shapes, seq_length: int) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, shapes.vocab_size, (1, seq_length + 1), device=device)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(1, seq_length, device=device),
            "position_ids": torch.arange(seq_length, device=device).unsqueeze(0)}


def _recompute_fields(recompute: Optional[Recompute]) -> dict:
    """TransformerConfig's and TrainingSetup's fields of `recompute` (none without it)."""
    if recompute is None:
        return {}
    return {"recompute_granularity": recompute.granularity,
            "recompute_method": recompute.method, "recompute_num_layers": recompute.num_layers}


def _stage_estimate(shapes: Shapes, seq_length: int, precision: str, schedule: str = "seq1f1b",
                    microbatches: int = 1, splits: Optional[int] = None, early: bool = False,
                    recompute: Optional[Recompute] = None):
    from seq1f1b.plan.costs import ModelConfig
    from seq1f1b.plan.memory import TrainingSetup, estimate_memory

    model = ModelConfig(num_layers=shapes.num_layers, hidden_size=shapes.hidden_size,
                        num_attention_heads=shapes.heads, vocab_size=shapes.vocab_size)
    return estimate_memory(TrainingSetup(
        model=model, seq_length=seq_length, schedule=schedule, pp=1, microbatches=microbatches,
        splits=shapes.splits if splits is None else splits, partition="compute",
        precision=precision, make_vocab_size_divisible_by=1, loss_backward_in_forward=early,
        **_recompute_fields(recompute)))


def _iteration(model, schedule: str, splits: int, batch: dict, microbatches: int,
               seq_length: int, trace, early: bool = False) -> float:
    """One forward-backward of `microbatches` copies of `batch` under `schedule`, in seconds
    (`early`: --loss-backward-in-forward)."""
    from seq1f1b.equivalence import forward_step
    from seq1f1b.runtime.forward_backward import SpanSettings, get_forward_backward_func

    model.zero_grad_buffer()
    function = get_forward_backward_func(schedule, SpanSettings(
        splits, "compute", trace=trace, loss_backward_in_forward=early))
    _sync()
    start = time.perf_counter()
    function(forward_step_func=forward_step, data_iterator=iter([batch] * microbatches),
             model=model, num_microbatches=microbatches, seq_length=seq_length,
             micro_batch_size=1)
    _sync()
    return time.perf_counter() - start


def _measure_memory(model, schedule: str, splits: int, batch: dict, microbatches: int,
                    seq_length: int, estimate, early: bool = False) -> dict:
    """One iteration's peaks (saved-tensor meter; on a GPU the allocator's allocated and
    reserved bytes) beside the estimate of its only stage (no optimizer: no step is taken)."""
    import torch

    from seq1f1b.plan.memory import GIB
    from seq1f1b.runtime.trace import ExecutionTrace

    trace = ExecutionTrace(measure_memory=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _iteration(model, schedule, splits, batch, microbatches, seq_length, trace, early)
    stage = estimate.stages[0]
    without_optimizer = (stage.parameter_bytes + stage.gradient_bytes
                         + stage.held_for_backward_bytes + stage.workspace_bytes)
    allocated, reserved = trace.peak_device_bytes, trace.peak_device_reserved_bytes
    return {"peak_saved_bytes": trace.peak_saved_bytes,
            "estimated_held_for_backward_bytes": stage.held_for_backward_bytes,
            "saved_over_estimated": trace.peak_saved_bytes / stage.held_for_backward_bytes,
            "max_memory_allocated_bytes": allocated, "max_memory_reserved_bytes": reserved,
            "reserved_over_allocated": reserved / allocated if allocated else None,
            "estimated_without_optimizer_bytes": without_optimizer,
            "allocated_over_estimated": allocated / without_optimizer if allocated else None,
            "estimate_gib": {k: v / GIB for k, v in asdict(stage).items()
                             if k.endswith("_bytes")}}


def _release_cache() -> None:
    """Free what the last run left and give the allocator's cached blocks back, so that the next
    run's peak and reserve are its own. The collection comes first: a stage model is a reference
    cycle (config.no_sync_func is the model's bound no_sync), which `del` does not free. On the
    H200 (docs/gpu/h200_suite.json) each check's peak held the earlier checks' models: one
    model's parameters and gradients are 12.14 GB, and held_microbatches peaked at 109.62 GB
    against 97.37 GB estimated (97.48 without one model), the loss check at 79.01 GB against
    54.69 GB for the same run in check_stage (54.73 without two)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_stage(shapes: Shapes, deadline: Deadline) -> list[dict]:
    import torch

    from seq1f1b.plan.costs import layer_flops, logits_flops
    from seq1f1b.plan.partition import span_bounds
    from seq1f1b.runtime.trace import ExecutionTrace

    runs = []
    for seq_length in shapes.stage_lengths:
        if deadline.passed():
            runs.append({"seq_length": seq_length, "skipped": "the time budget ran out"})
            continue
        config, model = _stage_model(shapes, seq_length)
        precision = "fp32" if config.params_dtype == torch.float32 else "bf16"
        batch = _batch(shapes, seq_length)
        run = functools.partial(_iteration, model, "seq1f1b", shapes.splits, batch, 1,
                                seq_length)
        run(ExecutionTrace())                               # warm-up
        traces = [ExecutionTrace() for _ in range(shapes.repeats)]
        seconds = [run(trace) for trace in traces]
        estimate = _stage_estimate(shapes, seq_length, precision)
        memory = _measure_memory(model, "seq1f1b", shapes.splits, batch, 1, seq_length,
                                 estimate)
        cost_model = estimate.setup.model
        spans = []
        for j, (start, end) in enumerate(span_bounds(estimate.span_lengths)):
            flops = (layer_flops(cost_model, end - start, end).scaled(shapes.num_layers)
                     + logits_flops(cost_model, end - start))
            forward = statistics.median(_action_seconds(t, f"F0.{j}") for t in traces)
            backward = statistics.median(_action_seconds(t, f"B0.{j}") for t in traces)
            spans.append({"span": j, "start": start, "end": end, "forward_s": forward,
                          "backward_s": backward, "forward_flops": flops.forward,
                          "forward_linear_flops": flops.linear,
                          "forward_attention_flops": flops.attention,
                          "forward_tflops": flops.forward / forward / 1e12,
                          "backward_tflops": flops.backward / backward / 1e12})
        traced = statistics.median(t.busy for t in traces)
        runs.append({
            "seq_length": seq_length, "splits": shapes.splits, "layers": shapes.num_layers,
            "hidden_size": shapes.hidden_size, "precision": precision,
            "iteration_s": statistics.median(seconds), "spans": spans, "memory": memory,
            # The span times above come from the executor's trace: CUDA events on a GPU. One
            # stage has no bubble, so its actions should cover the synchronised iteration
            # (host-clock marks would time an F by its launches and leave this well below 1).
            "trace_clock": "cuda events" if torch.cuda.is_available() else "host clock",
            "traced_over_iteration": traced / statistics.median(seconds)})
        del run, model, config
        _release_cache()
    return runs


def check_held_microbatches(shapes: Shapes, deadline: Deadline) -> dict:
    """The same stage under GPipe with m micro-batches of L = held_length, unsplit: at its
    peak it holds all m micro-batches' activations, as 1F1B's first stage does at P = m (the
    paper's 7B and 13B panels: P = 4). Its reserved/allocated ratio is the allocator's reserve
    under that pattern of allocations, which the seq1f1b runs (one micro-batch in spans) need
    not show."""
    import torch

    from seq1f1b.runtime.trace import ExecutionTrace

    length, microbatches = shapes.held_length, shapes.held_microbatches
    if deadline.passed():
        return {"skipped": "the time budget ran out"}
    config, model = _stage_model(shapes, length)
    precision = "fp32" if config.params_dtype == torch.float32 else "bf16"
    batch = _batch(shapes, length)
    _iteration(model, "gpipe", 1, batch, microbatches, length, ExecutionTrace())   # warm-up
    estimate = _stage_estimate(shapes, length, precision, "gpipe", microbatches, splits=1)
    result = {"schedule": "gpipe", "seq_length": length, "microbatches": microbatches,
              "memory": _measure_memory(model, "gpipe", 1, batch, microbatches, length,
                                        estimate)}
    del model, config
    _release_cache()
    return result


def check_loss_backward_in_forward(shapes: Shapes, deadline: Deadline) -> dict:
    """The stage of `check_stage` (seq1f1b, k spans, one micro-batch) with and without
    --loss-backward-in-forward: the allocator's peak, the meter and the estimate of each. The
    one stage is also the last, so it holds the loss's fp32 softmax of every span until the
    backward without the flag, and the output layer's input gradients with it."""
    import torch

    from seq1f1b.runtime.trace import ExecutionTrace

    length = shapes.stage_lengths[0]
    if deadline.passed():
        return {"skipped": "the time budget ran out"}
    config, model = _stage_model(shapes, length)
    precision = "fp32" if config.params_dtype == torch.float32 else "bf16"
    batch = _batch(shapes, length)
    result = {"schedule": "seq1f1b", "splits": shapes.splits, "seq_length": length}
    for name, early in (("loss_at_backward", False), ("loss_backward_in_forward", True)):
        _iteration(model, "seq1f1b", shapes.splits, batch, 1, length, ExecutionTrace(),
                   early)                                                    # warm-up
        _release_cache()
        estimate = _stage_estimate(shapes, length, precision, early=early)
        result[name] = _measure_memory(model, "seq1f1b", shapes.splits, batch, 1, length,
                                       estimate, early)
    plain, early = result["loss_at_backward"], result["loss_backward_in_forward"]
    for key in ("max_memory_allocated_bytes", "peak_saved_bytes",
                "estimated_held_for_backward_bytes"):
        if plain[key]:
            result[f"{key}_early_over_plain"] = early[key] / plain[key]
    del model, config
    _release_cache()
    return result


RECOMPUTED = {"selective": Recompute("selective"),
              "full_uniform_2": Recompute("full", "uniform", 2)}
"""The recompute settings the memory part measures beside the plain stage: a first backward
makes its dK/dV accumulators layer by layer (selective) or group by group (full) as each frees
what it kept, and the estimator follows that order (simulate.held_change)."""


def check_recompute(shapes: Shapes, deadline: Deadline) -> dict:
    """The stage of `check_stage` (seq1f1b, k spans, one micro-batch) under each of
    `RECOMPUTED`: the allocator's peak, the meter and the estimate of each."""
    import torch

    from seq1f1b.runtime.trace import ExecutionTrace

    length = shapes.stage_lengths[0]
    result = {}
    for name, recompute in RECOMPUTED.items():
        if deadline.passed():
            result[name] = {"skipped": "the time budget ran out"}
            continue
        config, model = _stage_model(shapes, length, recompute)
        precision = "fp32" if config.params_dtype == torch.float32 else "bf16"
        batch = _batch(shapes, length)
        _iteration(model, "seq1f1b", shapes.splits, batch, 1, length, ExecutionTrace())
        _release_cache()
        estimate = _stage_estimate(shapes, length, precision, recompute=recompute)
        result[name] = _measure_memory(model, "seq1f1b", shapes.splits, batch, 1, length,
                                       estimate)
        del model, config
        _release_cache()
    return result


def _action_seconds(trace, label: str) -> float:
    return next(a.end - a.start for a in trace.actions if a.action == label)


def _environment() -> dict:
    import torch

    from seq1f1b.plan.calibration import peak_tflops

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        info.update(device=name, peak_bf16_tflops=peak_tflops(name), total_memory_bytes=
                    torch.cuda.get_device_properties(0).total_memory)
    return info


SUITE_BUDGETS_S = {"numerics": 60.0, "training": 165.0, "memory": 150.0, "attention": 135.0,
                   "documents": 30.0}
"""--suite gpu: each part's own budget, 9 minutes in all (the session's device time is 15)."""


def run_gpu_suite(shapes: Shapes, tiny: bool,
                  names: tuple[str, ...] = tuple(SUITE_BUDGETS_S)) -> Iterator[tuple[str, dict]]:
    """The parts of --suite gpu, each with its own budget and its failures kept to itself,
    yielded one at a time so that the caller writes each down as it ends: the device session
    cuts a command off at its time limit, and what was measured before must survive that."""
    from megatron.training.device_training import GPU_TRAINING, TINY_TRAINING, check_training
    from seq1f1b.device_checks.documents import check_documents
    from seq1f1b.device_checks.merge_gqa import check_merge_gqa
    from seq1f1b.device_checks.numerics import check_numerics

    memory_shapes = replace(shapes, stage_lengths=shapes.stage_lengths[:1])
    parts = {
        "numerics": lambda deadline: check_numerics(
            shapes.numerics_length, shapes.numerics_heads, shapes.head_dim,
            shapes.eager_max_score_bytes, deadline),
        "training": lambda deadline: check_training(TINY_TRAINING if tiny else GPU_TRAINING,
                                                    deadline),
        "memory": lambda deadline: {
            "stage": check_stage(memory_shapes, deadline),
            "held_microbatches": check_held_microbatches(memory_shapes, deadline),
            "loss_backward_in_forward": check_loss_backward_in_forward(memory_shapes,
                                                                       deadline),
            "recompute": check_recompute(memory_shapes, deadline)},
        "attention": lambda deadline: {
            "comparison": check_attention(shapes, deadline),
            "merge_gqa": _guarded(functools.partial(
                check_merge_gqa, shapes.attention_length, shapes.heads, shapes.head_dim,
                deadline), deadline),
            "span_kernels": check_span_kernels(shapes, deadline)},
        "documents": lambda deadline: check_documents(
            shapes.numerics_length, shapes.heads, shapes.head_dim, deadline),
    }
    for name in names:
        part = parts[name]
        deadline = Deadline(SUITE_BUDGETS_S[name])
        started = time.perf_counter()
        measured = {**_guarded(functools.partial(part, deadline), deadline),
                    "wall_s": time.perf_counter() - started}
        print(f"{PROG}: {name} done in {measured['wall_s']:.0f} s", flush=True)
        yield name, measured


DEFAULT_BUDGET_S = 420.0
"""--budget-s when not given: the stage suite's parts that would start later are skipped."""
RESULT_FILE = "device_check.json"


def check_arguments(args: argparse.Namespace) -> None:
    """Before any measuring (minutes on a GPU): a budget that lets a part run, one the suite
    reads, and an OUTDIR the result can be written into (writable.check_output_dir). Raises
    ValueError, one line naming the flag."""
    from seq1f1b.writable import check_output_dir, check_output_file

    if args.budget_s is not None:
        if args.suite == "gpu":
            raise ValueError("--budget-s belongs to --suite stage (the gpu suite's parts have "
                             "their own budgets)")
        if not math.isfinite(args.budget_s) or args.budget_s <= 0:
            raise ValueError(f"--budget-s must be a positive number of seconds, got "
                             f"{args.budget_s:g} (every part would be skipped)")
    check_output_dir(args.outdir, "OUTDIR")
    check_output_file(os.path.join(args.outdir, RESULT_FILE), "OUTDIR", makes_folders=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", help="folder for device_check.json (created)")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    parser.add_argument("--skip-stage", action="store_true",
                        help="only the attention comparison and the span kernels")
    parser.add_argument("--suite", choices=["stage", "gpu"], default="stage",
                        help="stage (default): the calibration parts above; gpu: the first GPU "
                             "run's evidence under the keys numerics, training, memory, "
                             "attention and documents, each part with its own budget (under 9 "
                             "minutes)")
    parser.add_argument("--parts", nargs="+", choices=list(SUITE_BUDGETS_S), default=None,
                        help="--suite gpu: run only these parts (default: all five), e.g. to "
                             "rerun one that failed in what is left of the device's time")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="--suite stage: skip the parts that would start after this many "
                             f"seconds (default {DEFAULT_BUDGET_S:g})")
    args = parser.parse_args(argv)
    if args.suite == "gpu" and args.skip_stage:
        parser.error("--skip-stage belongs to --suite stage (the gpu suite's parts have their "
                     "own budgets)")
    if args.suite != "gpu" and args.parts:
        parser.error("--parts belongs to --suite gpu")
    try:
        check_arguments(args)
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if args.budget_s is None:
        args.budget_s = DEFAULT_BUDGET_S
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print(f"{PROG}: error: no GPU here; use --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    shapes = TINY if args.tiny else GPU
    torch.manual_seed(0)
    _setup_process()
    started = time.perf_counter()
    deadline = Deadline(args.budget_s)
    result = {"environment": _environment(), "shapes": asdict(shapes)}
    path = outdir / RESULT_FILE
    if args.suite == "gpu":
        names = tuple(name for name in SUITE_BUDGETS_S if name in (args.parts or SUITE_BUDGETS_S))
        for name, measured in run_gpu_suite(shapes, args.tiny, names):
            result[name] = measured
            result["wall_s"] = time.perf_counter() - started
            path.write_text(json.dumps(result, indent=1))
    else:
        if not args.skip_stage:                 # first: it calibrates the cost model
            result["stage"] = check_stage(shapes, deadline)
            result["held_microbatches"] = check_held_microbatches(shapes, deadline)
        result["attention"] = check_attention(shapes, deadline)
        result["span_kernels"] = check_span_kernels(shapes, Deadline(KERNELS_BUDGET_S))
    result["wall_s"] = time.perf_counter() - started
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
