"""device_check's numerics part: span attention with a cached prefix, in bf16, against fp32.

A query span of L/4 tokens at the end of an L-token sequence attends to the K/V of the L - L/4
tokens before it, read from the micro-batch's cache (kv_cache.py), as the executor runs the
last span: the forward, then the backward of the span, which leaves the prefix's dK/dV in the
cache's fp32 accumulators. Its output, dQ, and the prefix's dK/dV are compared with an fp32
eager reference computed from the same inputs (the bf16 inputs, upcast, so that only the
kernel's arithmetic differs), one head at a time so that the reference's span x L score
matrix stays small.

The figure is the max relative error (max |x - ref| / max |ref|) of each tensor. What bf16
allows: its unit roundoff is 2^-8 (0.39%), which rounding a kernel's fp32 result to bf16 costs
alone; a kernel's bf16 inputs and bf16 intermediates (P in flash-style kernels) cost more. So
each backend's span path is measured beside the same backend run unsplit over the whole
sequence (the same rows compared), and it is within bounds when its error is at most twice
max(2^-8, that unsplit error): splitting may round once more (the span's K/V gradient), never
compound. Where the unsplit run does not fit (eager's L x L fp32 scores past
`eager_max_score_bytes`), the baseline is the same kernel on the compared rows alone, the whole
K/V passed as plain tensors: the unsplit run's arithmetic on those rows, without the cache that
the span path reads its prefix from and accumulates the prefix's dK/dV in. (On an H200 eager's
span path was 1-2% off, over the 2 x 2^-8 it had been held to without a baseline: eager rounds
its scores to bf16 before the softmax, as megatron's unfused attention does.)
"""
from __future__ import annotations

from typing import Optional

BF16_UNIT_ROUNDOFF = 2.0 ** -8
BOUND_FACTOR = 2.0
NUMERICS_BACKENDS = ("sdpa", "flex", "eager", "flash", "te")


def _relative_error(value, reference) -> float:
    if value.shape != reference.shape:
        raise ValueError(f"shape {tuple(value.shape)} against the reference's "
                         f"{tuple(reference.shape)}")
    scale = reference.abs().max().item()
    return (value.float() - reference).abs().max().item() / (scale if scale > 0 else 1.0)


def _reference(q, k, v, grad_out, start: int) -> dict:
    """fp32 eager attention of the query rows [start, L) over keys [0, L) with the
    bottom-right causal mask, per head: output, dQ and the prefix's dK/dV (rows [0, start))."""
    import torch

    from seq1f1b.runtime.attention import bottom_right_causal_mask

    length, _, heads, dim = q.shape
    mask = bottom_right_causal_mask(length - start, length, q.device)
    outputs, dq, dk, dv = [], [], [], []
    for head in range(heads):
        qh = q[start:, 0, head].float().requires_grad_()
        kh, vh = (t[:, 0, head].float().requires_grad_() for t in (k, v))
        scores = (qh @ kh.T) / dim ** 0.5
        out = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ vh
        out.backward(grad_out[:, 0, head * dim:(head + 1) * dim].float())
        outputs.append(out.detach())
        dq.append(qh.grad)
        dk.append(kh.grad[:start])
        dv.append(vh.grad[:start])
    return {"output": torch.cat(outputs, dim=-1), "dq": torch.stack(dq, dim=1),
            "prefix_dk": torch.stack(dk, dim=1), "prefix_dv": torch.stack(dv, dim=1)}


def _span_path(module, q, k, v, grad_out, start: int, backward: bool) -> dict:
    """The last span as the executor runs it: prefix K/V in the cache, the span's q/k/v as
    leaves; the prefix's dK/dV from the cache's accumulators."""
    from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context

    length = q.size(0)
    cache = MicrobatchKVCache(0, length, requires_grad=backward)
    layer_kv = cache.layer(module, k, v)
    layer_kv.write(0, start, k[:start], v[:start])
    leaves = [t[start:].detach().requires_grad_(backward) for t in (q, k, v)]
    with span_context(SpanContext(0, 1, start, length, cache)):
        out = module(*leaves, None)
    result = {"output": out.detach().reshape(length - start, -1)}
    if backward:
        out.backward(grad_out)
        result.update(dq=leaves[0].grad[:, 0], prefix_dk=layer_kv.key_grad[:start, 0],
                      prefix_dv=layer_kv.value_grad[:start, 0])
    return result


def _unsplit_path(module, q, k, v, grad_out, start: int, backward: bool) -> dict:
    """The same backend over the whole causal sequence, the upstream gradient on rows
    [start, L) only: the same rows and gradients as the span path."""
    import torch

    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    out = module(*leaves, None)
    result = {"output": out.detach()[start:].reshape(q.size(0) - start, -1)}
    if backward:
        full_grad = torch.zeros_like(out)
        full_grad[start:] = grad_out
        out.backward(full_grad)
        result.update(dq=leaves[0].grad[start:, 0], prefix_dk=leaves[1].grad[:start, 0],
                      prefix_dv=leaves[2].grad[:start, 0])
    return result


def _rows_path(name: str, q, k, v, grad_out, start: int, backward: bool) -> dict:
    """Backend `name`'s kernel on the query rows [start, L) over the whole K/V, no cache: the
    rows and gradients the span path gives."""
    from seq1f1b.runtime.attention import attention_kernel

    leaves = [t.detach().requires_grad_(backward) for t in (q[start:], k, v)]
    out = attention_kernel(name)(*leaves, None, q.size(-1) ** -0.5, 0.0)
    result = {"output": out.detach().reshape(q.size(0) - start, -1)}
    if backward:
        out.backward(grad_out)
        result.update(dq=leaves[0].grad[:, 0], prefix_dk=leaves[1].grad[:start, 0],
                      prefix_dv=leaves[2].grad[:start, 0])
    return result


def bf16_bounds(errors: dict, baseline: dict) -> dict:
    """Each tensor's bound: BOUND_FACTOR x max(2^-8, the baseline path's error for it, 0 when
    the baseline did not run)."""
    return {tensor: BOUND_FACTOR * max(BF16_UNIT_ROUNDOFF, baseline.get(tensor, 0.0))
            for tensor in errors}


def _errors(result: dict, reference: dict) -> dict:
    return {name: _relative_error(value, reference[name]) for name, value in result.items()}


def _skip_reason(name: str, config, device, score_bytes: float, limit: float) -> Optional[str]:
    from seq1f1b.runtime.attention import backend_unavailable_reason

    reason = backend_unavailable_reason(name, config)
    if reason is None and name == "eager" and score_bytes > limit:
        reason = f"its fp32 score matrix would take {score_bytes / 1e9:.0f} GB"
    return reason


def check_numerics(length: int, heads: int, head_dim: int, eager_max_score_bytes: float,
                   deadline) -> dict:
    """The numerics part: per backend, the span path's and the unsplit path's errors against
    the fp32 reference, the bound, and whether the span path meets it."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from seq1f1b import megatron_adapter
    from seq1f1b.runtime.attention import SpanAttention

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = megatron_adapter.make_transformer_config(
        num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads, fp32=False)
    span = length // 4
    start = length - span
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(length, 1, heads, head_dim, device=device, generator=gen,
                           dtype=torch.bfloat16) for _ in range(3))
    grad_out = torch.randn(span, 1, heads * head_dim, device=device, generator=gen,
                           dtype=torch.bfloat16)
    reference = _reference(q, k, v, grad_out, start)
    results = {"length": length, "span": span, "prefix": start, "heads": heads,
               "head_dim": head_dim, "dtype": "bfloat16", "reference": "fp32 eager, per head",
               "bf16_unit_roundoff": BF16_UNIT_ROUNDOFF,
               "bound": f"{BOUND_FACTOR:g} x max(2^-8, the backend's unsplit error, or its "
                        "error on the span's rows without the cache where the unsplit run "
                        "does not fit)",
               "backends": {}}
    for name in NUMERICS_BACKENDS:
        reason = _skip_reason(name, config, device, 4.0 * heads * span * length,
                              eager_max_score_bytes)
        if reason is None and deadline.passed():
            reason = "the part's time budget ran out"
        if reason is not None:
            results["backends"][name] = {"skipped": reason}
            continue
        backward = not (name == "flex" and device.type == "cpu")  # no CPU backward for flex
        module = SpanAttention(config, 1, AttnMaskType.causal, "self", backend=name).to(device)
        entry: dict = {"backward": backward}
        try:
            entry["span_errors"] = _errors(
                _span_path(module, q, k, v, grad_out, start, backward), reference)
            unsplit_reason = _skip_reason(name, config, device, 4.0 * heads * length * length,
                                          eager_max_score_bytes)
            if unsplit_reason is None:
                entry["unsplit_errors"] = _errors(
                    _unsplit_path(module, q, k, v, grad_out, start, backward), reference)
            else:
                entry["unsplit_skipped"] = unsplit_reason
                entry["rows_errors"] = _errors(
                    _rows_path(name, q, k, v, grad_out, start, backward), reference)
        except (RuntimeError, ValueError, NotImplementedError) as err:
            results["backends"][name] = {"error": f"{type(err).__name__}: "
                                                  f"{str(err).splitlines()[0] if str(err) else ''}"}
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        baseline = entry.get("unsplit_errors", entry.get("rows_errors", {}))
        entry["bounds"] = bf16_bounds(entry["span_errors"], baseline)
        entry["within_bound"] = all(entry["span_errors"][t] <= entry["bounds"][t]
                                    for t in entry["span_errors"])
        results["backends"][name] = entry
    return results
