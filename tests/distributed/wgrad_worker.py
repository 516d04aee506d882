"""Split backward (B, then W) against megatron's own backward on a tiny GPT stage.

`compare_split_backward` is the check; tests/unit/test_wgrad.py runs it in-process at TP=1 and
through this file as a torchrun worker at TP=2 (with and without sequence parallelism).
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: megatron_world

from megatron_world import init_megatron  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
)

from seq1f1b.megatron_adapter import build_model_chunk, make_transformer_config  # noqa: E402
from seq1f1b.runtime.wgrad import (  # noqa: E402
    SplitBackwardColumnParallelLinear,
    SplitBackwardRowParallelLinear,
    WeightGradStore,
)

SEQ, BATCH, HIDDEN, VOCAB = 16, 2, 32, 64
KEYS = [(0, 1, 0), (1, 0, 0)]
"""Two B actions (micro-batch, span, chunk) whose weight gradients are deferred side by side."""


def _stage(tp: int, sequence_parallel: bool, split_backward: bool, ddp: bool,
           fusion: bool = False):
    """A last pipeline stage (2 layers + output layer) fed a hidden-state tensor; `fusion`:
    gradient accumulation fusion (needs DDP's main_grad)."""
    config = make_transformer_config(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                                     ffn_hidden_size=64, tensor_model_parallel_size=tp,
                                     sequence_parallel=sequence_parallel, init_method_std=0.2,
                                     gradient_accumulation_fusion=fusion)
    torch.manual_seed(0)
    model = build_model_chunk(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                              pre_process=False, post_process=True,
                              split_backward=split_backward)
    if ddp:
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    return model


def _grads(model, ddp: bool) -> dict[str, torch.Tensor | None]:
    def grad(param):
        value = param.main_grad if ddp else param.grad
        return None if value is None else value.detach().clone()
    return {name: grad(param) for name, param in model.named_parameters()}


def _inputs(tp: int, sequence_parallel: bool, microbatch: int):
    """Stage input (this TP rank's sequence shard under SP) and labels of one micro-batch."""
    gen = torch.Generator().manual_seed(100 + microbatch)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    if sequence_parallel:
        hidden = hidden.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
    return hidden, labels


def _backward(model, tp: int, sequence_parallel: bool, microbatch: int,
              scope=contextlib.nullcontext) -> torch.Tensor:
    """Forward one micro-batch, backward its loss inside `scope()`; returns the input grad."""
    hidden, labels = _inputs(tp, sequence_parallel, microbatch)
    hidden.requires_grad_()
    getattr(model, "module", model).set_input_tensor(hidden)   # through DDP
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    loss = model(None, positions, None, labels=labels).sum() / labels.numel()
    with scope():
        loss.backward()
    return hidden.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare_split_backward(tp: int, sequence_parallel: bool, ddp: bool,
                           fusion: bool = False) -> dict:
    """Two micro-batches through a split-backward stage and through megatron's stage (always
    unfused: with `fusion` the split stage's GEMMs accumulate into main_grad, at W and in the
    plain backward, and `fused` says whether every linear's weight took that path).

    Returns the worst relative differences (max over this process's params): of the input grads
    after B alone, of the not-deferred param grads after B, of every grad after W; whether the
    deferred weights were still without gradient after B; and the same for a plain backward
    (no `begin`) of the split-backward stage, which must be megatron's exactly.
    """
    init_megatron(tensor_model_parallel_size=tp)
    reference = _stage(tp, sequence_parallel, False, ddp)
    split = _stage(tp, sequence_parallel, True, ddp, fusion)
    split.load_state_dict(reference.state_dict())
    deferred = {f"{name}.weight" for name, module in split.named_modules()
                if isinstance(module, (SplitBackwardColumnParallelLinear,
                                       SplitBackwardRowParallelLinear))}
    ref_input = [_backward(reference, tp, sequence_parallel, n) for n in range(len(KEYS))]
    expected = _grads(reference, ddp)

    store = WeightGradStore()
    split_input = [_backward(split, tp, sequence_parallel, n, lambda key=key: store.begin(key))
                   for n, key in enumerate(KEYS)]
    after_b = _grads(split, ddp)
    pending = store.pending()
    for key in KEYS:
        store.flush(key)
    after_w = _grads(split, ddp)
    fused_at_w = all(getattr(split.get_parameter(name), "grad_added_to_main_grad", False)
                     for name in deferred) if ddp else False

    if ddp:
        split.zero_grad_buffer()
    else:
        split.zero_grad(set_to_none=True)
    plain_input = [_backward(split, tp, sequence_parallel, n) for n in range(len(KEYS))]
    plain = _grads(split, ddp)
    fused_plain = all(getattr(split.get_parameter(name), "grad_added_to_main_grad", False)
                      for name in deferred) if ddp else False

    def absent(grad):
        return grad is None or not bool(grad.any())

    return {
        "deferred": len(deferred),
        "pending_after_b": [list(key) for key in pending],
        "pending_after_w": len(store.pending()),
        "deferred_absent_after_b": all(absent(after_b[name]) for name in deferred),
        "input_after_b": max(_rel(a, b) for a, b in zip(split_input, ref_input)),
        "others_after_b": max(_rel(after_b[name], expected[name])
                              for name in expected if name not in deferred),
        "all_after_w": max(_rel(after_w[name], expected[name]) for name in expected),
        "plain_input": max(_rel(a, b) for a, b in zip(plain_input, ref_input)),
        "plain_all": max(_rel(plain[name], expected[name]) for name in expected),
        "fused": fused_at_w and fused_plain,
    }


def _worst_over_ranks(result: dict) -> dict:
    """Differences: the max over TP ranks; flags: all ranks agree."""
    out = dict(result)
    for name, value in result.items():
        if isinstance(value, float):
            tensor = torch.tensor([value])
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            out[name] = float(tensor)
        elif isinstance(value, bool):
            tensor = torch.tensor([0.0 if value else 1.0])
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            out[name] = float(tensor) == 0.0
    return out


def main(cases_path: str, results_path: str) -> None:
    results = []
    for case in json.load(open(cases_path)):
        results.append(_worst_over_ranks(compare_split_backward(**case)))
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        json.dump(results, open(results_path, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
