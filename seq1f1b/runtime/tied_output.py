"""The output layer tied to the word embedding where megatron-core cannot tie it.

megatron ties them on a loop: the first stage's rank holds the embedding, the last stage's a copy
of it as the output layer's weight, and an all-reduce over the embedding group (those two ranks)
makes the copy start equal and step with the summed gradient. Two of our layouts put the copies
elsewhere, where that group's protocol hangs or breaks (LanguageModule's set-up all-reduces the
weight of a chunk that has none):

- a V places the last stage in chunk 1 of pipeline rank 0, beside the embedding in chunk 0: one
  rank, two chunks, no second rank to reduce with;
- with the output layer spread (O actions, megatron_adapter.OutputHead) every pipeline rank holds a
  copy.

There the chunks are built untied (megatron does nothing), and this module does what megatron's
protocol does: each copy of the output weight is marked `TIED` (and `shared`, so the gradient
norm counts the embedding once; `shared_embedding`, so the distributed optimizer shards it alike
with the embedding, also marked), starts from the embedding's values (`copy_embedding`), and after
the data-parallel reduction every copy and the embedding get the sum of all their gradients
(`sum_gradients`: on the rank, then over the pipeline group where the copies are spread).
Checkpoints store the copies as megatron stores a tied last stage's: under the embedding's key
with a non-zero replica id, so a checkpoint is the same in every layout.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.utils import get_attr_wrapped_model

TIED = "tied_to_embedding"
"""The attribute marking a parameter as a copy of the word embedding tied by this module."""


def mark_copy(weight: torch.nn.Parameter) -> None:
    """`weight` (an output layer's) is a copy of the word embedding, tied here."""
    setattr(weight, TIED, True)
    weight.shared = True
    weight.shared_embedding = True


def mark_embedding(model: torch.nn.Module) -> None:
    """The embedding of first-stage chunk `model` is tied to copies this module keeps: its own
    gradient bucket, sharded as the copies' are (megatron marks it so when it ties)."""
    model.embedding.word_embeddings.weight.shared_embedding = True


def _gpt(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside a (DDP, Float16Module) wrapped chunk."""
    return get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)


def _embedding(chunks: Sequence[torch.nn.Module]) -> Optional[torch.nn.Parameter]:
    """The word embedding of this rank's first chunk, where its copies are tied here."""
    model = _gpt(chunks[0])
    if not model.pre_process:
        return None
    weight = model.embedding.word_embeddings.weight
    return weight if getattr(weight, "shared_embedding", False) else None


def _copies(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    return [param for chunk in chunks for param in chunk.parameters()
            if getattr(param, TIED, False)]


def _gradient(param: torch.nn.Parameter) -> torch.Tensor:
    """Where `param`'s gradient is: megatron DDP's main_grad, else .grad (made if missing)."""
    grad = getattr(param, "main_grad", None)
    if grad is not None:
        return grad
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _spread(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the output layer is spread (every rank's last chunk holds a copy)."""
    return hasattr(_gpt(chunks[-1]), "output_head")


def copy_embedding(chunks: Sequence[torch.nn.Module], pp_group: dist.ProcessGroup) -> None:
    """At build: every copy takes the embedding's values (from the first pipeline rank over
    `pp_group` where the copies are spread, else from the rank's own first chunk)."""
    copies = _copies(chunks)
    if not copies:
        return
    embedding = _embedding(chunks)
    with torch.no_grad():
        if _spread(chunks):
            source = embedding.data if embedding is not None else copies[0].data
            dist.broadcast(source, group_src=0, group=pp_group)
            for copy in copies:
                copy.data.copy_(source)
        else:
            for copy in copies:
                copy.data.copy_(embedding.data)


def sum_gradients(chunks: Sequence[torch.nn.Module], pp_group: dist.ProcessGroup) -> None:
    """After the data-parallel reduction: the embedding and each of its copies hold the sum of
    all their gradients (on this rank, then over `pp_group` where the copies are spread)."""
    copies = _copies(chunks)
    if not copies:
        return
    embedding = _embedding(chunks)
    tied = copies + ([embedding] if embedding is not None else [])
    total = _gradient(tied[0])
    for param in tied[1:]:
        total += _gradient(param)
    if _spread(chunks):
        dist.all_reduce(total, group=pp_group)
    for param in tied[1:]:
        _gradient(param).copy_(total)
