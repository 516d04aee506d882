"""The output layer's backward inside the last stage's forward (`--loss-backward-in-forward`).

On the last stage a span's forward ends in the output layer and the loss. Their backward needs
what megatron's vocab-parallel cross entropy keeps: the fp32 softmax, s x V/TP floats per span,
412 MB for a 16K-token span of a 50K vocabulary at TP 8. Seq1F1B's last stage runs every span of
a micro-batch forward before the first of their backwards (span j's backward needs span j+1's),
so it holds k of them: 13.5 GiB of the 7B/1M-token run's 53.7 GiB peak. Here F runs the loss's
backward through the output layer at once and keeps only the gradient of the output layer's
input (s x h, over TP with sequence parallelism); the softmax is freed when F ends.

Exact, at any loss scale. A micro-batch's scale (1/tokens of the whole micro-batch, loss.py) is
known only once every span of it has its loss, so F back-propagates at unit scale: B multiplies
the kept input gradient by the scale before back-propagating it through the stage, and the output
layer's weight gradients of the micro-batch, gathered at unit scale in buffers of their own (one
set per micro-batch in flight on the stage, the weights' size in `main_grad`'s precision), go
into the weights' gradients at the micro-batch's first backward, scaled.

How the gradients are kept apart: with megatron's DDP, F points the weights' `main_grad` at the
micro-batch's buffers (megatron's fused linear reads it at forward, its DDP hook at backward);
without DDP, their `.grad`. The `grad_added_to_main_grad` mark the fused path sets is put back as
it was, so a tied embedding's own gradient at B is still added. The scaled buffers are added
into `main_grad` directly; then, at each micro-batch's last backward on the stage, a dummy
gradient marked `grad_added_to_main_grad` goes through each weight's accumulator so that DDP's
hook reports it ready inside the grad-sync window (runtime/grad_sync.py: the window opens before
the stage's last B, and `overlap_grad_reduce` launches a bucket only once each of its parameters
has reported there), after the last buffer went in.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from megatron.core.utils import get_attr_wrapped_model

from seq1f1b.runtime import wgrad_fusion


def output_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights the output layer of last-stage chunk `model` uses: its own, or the embedding
    it shares; refused for a model whose post-process calls the output layer more than once."""
    gpt = get_attr_wrapped_model(model, "output_layer", return_model_obj=True)
    if getattr(gpt.config, "mtp_num_layers", None):
        raise ValueError("--loss-backward-in-forward: multi-token prediction calls the output "
                         "layer once per depth; run it without --mtp-num-layers")
    params = [p for p in gpt.output_layer.parameters() if p.requires_grad]
    if gpt.share_embeddings_and_output_weights:
        params.append(gpt.shared_embedding_or_output_weight())
    return list({id(p): p for p in params}.values())


@dataclass
class _Microbatch:
    """One micro-batch's unit-scale output-layer weight gradients (emptied once added), and
    each span's kept (output-layer input, its unit-scale gradient)."""

    gradients: list[Optional[torch.Tensor]]
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class EarlyLoss:
    """One last-stage chunk's early output-layer backwards: what F keeps and B takes back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._layer = get_attr_wrapped_model(model, "output_layer")
        self._params = output_parameters(model)
        self._open: dict[int, _Microbatch] = {}

    @contextlib.contextmanager
    def forward(self, microbatch: int, span: int) -> Iterator[dict[str, Any]]:
        """Around F(microbatch, span)'s forward step and `backward_now`: the output layer's input
        becomes a leaf (the stage's graph ends there) and its weights' gradients go into the
        micro-batch's buffers."""
        state = self._open.setdefault(microbatch, _Microbatch([None] * len(self._params)))
        cut: dict[str, Any] = {}

        def cut_input(module, args, kwargs):
            hidden = args[0]
            leaf = hidden.detach().requires_grad_(hidden.requires_grad)
            cut["hidden"], cut["leaf"] = hidden, leaf
            return (leaf, *args[1:]), kwargs

        handle = self._layer.register_forward_pre_hook(cut_input, with_kwargs=True)
        saved = [(p.grad, getattr(p, "main_grad", None), getattr(p, "grad_added_to_main_grad",
                                                                  None)) for p in self._params]
        for p, gradient, (_, main, _) in zip(self._params, state.gradients, saved):
            if main is not None:
                p.main_grad = gradient if gradient is not None else torch.zeros_like(main)
            else:
                p.grad = gradient
        try:
            yield cut
        finally:
            handle.remove()
            for n, (p, (grad, main, mark)) in enumerate(zip(self._params, saved)):
                state.gradients[n] = p.main_grad if main is not None else p.grad
                if main is not None:
                    p.main_grad = main
                p.grad = grad
                if mark is not None:
                    p.grad_added_to_main_grad = mark
        if "leaf" in cut:
            leaf = cut["leaf"]
            state.inputs[span] = (cut["hidden"], leaf.grad if leaf.grad is not None
                                  else torch.zeros_like(leaf))

    def take(self, microbatch: int, span: int, scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """At B(microbatch, span): the output layer's input and its gradient at `scale`; at the
        micro-batch's first backward its scaled weight gradients go into the weights' own."""
        state = self._open[microbatch]
        if state.gradients:
            for p, gradient in zip(self._params, state.gradients):
                if gradient is None:
                    continue
                if hasattr(p, "main_grad"):
                    p.main_grad.add_(gradient.mul_(scale))
                elif p.grad is None:
                    p.grad = gradient.mul_(scale)
                else:
                    p.grad.add_(gradient.mul_(scale))
            state.gradients = []
        hidden, gradient = state.inputs.pop(span)
        if not state.inputs:
            del self._open[microbatch]
            wgrad_fusion.report_ready(self._params)
        return hidden, gradient.mul_(scale)

    def held_tensors(self) -> list[torch.Tensor]:
        """The buffers, kept inputs and their gradients of micro-batches in flight (the memory
        meter's; an input whose data the executor swapped out after F holds one element)."""
        return [t for state in self._open.values()
                for t in [g for g in state.gradients if g is not None]
                + [t for pair in state.inputs.values() for t in pair]]

    def pending(self) -> int:
        return len(self._open)
