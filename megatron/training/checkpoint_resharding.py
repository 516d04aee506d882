"""Resuming at another parallel layout: what a checkpoint records about the layout it was saved
at, and what a run at another TP x PP x V x DP may take from it.

The model's sharded tensors carry global names, shapes and offsets, so dist_checkpointing
reshards them to any layout; the optimizer's Adam moments are keyed like the parameters and
follow. Three things need a decision of their own:

- The padded vocabulary. Megatron pads the embedding and output rows to a multiple of
  --make-vocab-size-divisible-by x TP, so another TP pads differently; the padding rows are logits
  in the softmax, and dropping or adding them changes the loss. A resumed run therefore keeps the
  checkpoint's padded size whenever its TP divides it (the model is then the same function).
- The distributed optimizer. Megatron's default checkpoint format for it (`dp_reshardable`)
  mirrors its internal gradient buckets, which depend on TP, PP and V, so it reshards across DP
  only. With --dist-ckpt-optim-fully-reshardable (Megatron-LM's flag) the state is stored per
  parameter, like the model, and reshards like it; saving gathers each model-parallel shard's
  optimizer state across its DP group first, which is why it is not the default.
- The RNG states belong to ranks (see `checkpointing`): at another rank grid they are not
  restored and the run's seeds apply. Without dropout they do not affect the loss.

`check_resume` applies these rules while the flags are validated, before any work starts.
"""
from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from typing import Optional

DP_RESHARDABLE = "dp_reshardable"
FULLY_RESHARDABLE = "fully_reshardable"

_VIRTUAL_KEY = "virtual_pipeline_model_parallel_size"
_VOCAB_KEY = "padded_vocab_size"
_OPTIMIZER_KEY = "distrib_optim_sharding_type"


@dataclass(frozen=True)
class ParallelLayout:
    """A run's model-parallel split (TP, PP, V) and its DP size. `virtual` is None for a
    checkpoint saved before the layout record held it."""

    tensor: int
    pipeline: int
    virtual: Optional[int]
    data: int

    @classmethod
    def of_run(cls, args: argparse.Namespace) -> ParallelLayout:
        """The layout validated flags ask for."""
        return cls(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                   args.virtual_pipeline_model_parallel_size or 1, args.data_parallel_size)

    def splits_model_like(self, other: ParallelLayout) -> bool:
        """Whether both cut the model into the same pieces (TP, PP and, where known, V)."""
        same_virtual = self.virtual is None or other.virtual is None \
            or self.virtual == other.virtual
        return (self.tensor, self.pipeline) == (other.tensor, other.pipeline) and same_virtual

    def __str__(self) -> str:
        virtual = "?" if self.virtual is None else self.virtual
        return f"TP{self.tensor} x PP{self.pipeline} x V{virtual} x DP{self.data}"


@dataclass(frozen=True)
class CheckpointRecord:
    """What the common state of a checkpoint says about how it was saved.

    `optimizer_format` is the distributed optimizer's format, None when the optimizer was
    another one; `has_optimizer_record` is False (and the format unknown) for a checkpoint saved
    before the record held it.
    """

    layout: ParallelLayout
    padded_vocab_size: Optional[int]
    optimizer_format: Optional[str]
    has_optimizer_record: bool

    @classmethod
    def from_common(cls, common: dict) -> CheckpointRecord:
        pipeline, tensor, data = common["parallel_layout"]
        return cls(ParallelLayout(tensor, pipeline, common.get(_VIRTUAL_KEY), data),
                   common.get(_VOCAB_KEY), common.get(_OPTIMIZER_KEY),
                   _OPTIMIZER_KEY in common)


def record_entries(virtual: int, padded_vocab_size: Optional[int],
                   optimizer_format: Optional[str]) -> dict:
    """The common-state entries `CheckpointRecord.from_common` reads, besides the
    `parallel_layout` [PP, TP, DP] that `checkpointing` keys the RNG states by."""
    return {_VIRTUAL_KEY: virtual, _VOCAB_KEY: padded_vocab_size, _OPTIMIZER_KEY: optimizer_format}


def optimizer_format(distributed_optimizer: bool, fully_reshardable: bool) -> Optional[str]:
    """The distributed optimizer's checkpoint format (--dist-ckpt-optim-fully-reshardable or
    megatron's default); None for the other optimizers, whose state is always keyed like the
    parameters."""
    if not distributed_optimizer:
        return None
    return FULLY_RESHARDABLE if fully_reshardable else DP_RESHARDABLE


def read_record(folder: str) -> Optional[CheckpointRecord]:
    """The record of the checkpoint in `folder` (read from its common state only), or None when
    `folder` holds no checkpoint this project wrote (another format is its loader's business)."""
    with warnings.catch_warnings():   # megatron-core's import notices (no TE, no Apex): a
        warnings.simplefilter("ignore")  # refused flag must stay one line on stderr
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        common = dist_checkpointing.load_common_state_dict(folder)
    except (CheckpointingException, OSError):
        return None
    if not isinstance(common, dict) or "parallel_layout" not in common:
        return None
    return CheckpointRecord.from_common(common)


def check_resume(args: argparse.Namespace, record: CheckpointRecord, folder: str,
                 restores_optimizer: bool = True, flag: str = "--load") -> None:
    """Check that a run with validated `args` can resume from the checkpoint in `folder`, whose
    record is `record`, and keep the checkpoint's padded vocabulary in `args.padded_vocab_size`.

    Raises ValueError (one line naming `flag`) for an optimizer state this run cannot read, unless
    the run does not restore it (`restores_optimizer`: --finetune, --no-load-optim).
    """
    _check_vocabulary(args, record, folder, flag)
    if not restores_optimizer:
        return
    run = ParallelLayout.of_run(args)
    wanted = optimizer_format(args.use_distributed_optimizer,
                              args.dist_ckpt_optim_fully_reshardable)
    if record.has_optimizer_record and (record.optimizer_format is None) != (wanted is None):
        saved_with = "with" if record.optimizer_format else "without"
        raise ValueError(f"{flag}: {folder} was saved {saved_with} --use-distributed-optimizer; "
                         f"its optimizer state cannot be read the other way (or give "
                         f"--no-load-optim)")
    if record.optimizer_format == DP_RESHARDABLE and not record.layout.splits_model_like(run):
        raise ValueError(
            f"{flag}: {folder} holds the distributed optimizer's state in the {DP_RESHARDABLE} "
            f"format, which reshards across DP only; it was saved at {record.layout}, this run is "
            f"{run} (save with --dist-ckpt-optim-fully-reshardable to change TP, PP or V, or "
            f"give --no-load-optim)")


def _check_vocabulary(args: argparse.Namespace, record: CheckpointRecord, folder: str,
                      flag: str) -> None:
    """Keep the checkpoint's padded vocabulary: padding rows are logits in the softmax."""
    saved_rows = record.padded_vocab_size
    if saved_rows is not None and saved_rows != args.padded_vocab_size:
        if saved_rows % args.tensor_model_parallel_size:
            raise ValueError(f"{flag}: {folder} has a padded vocabulary of {saved_rows} rows, "
                             f"which --tensor-model-parallel-size "
                             f"{args.tensor_model_parallel_size} does not divide")
        args.padded_vocab_size = saved_rows
