"""What a checkpoint's common (non-sharded) state says, ours and Megatron-LM's alike.

Both are megatron-core dist_checkpointing folders (`iter_N/` with `common.pt`, the `.distcp` shards
and `metadata.json`). Megatron-LM's training (torch_dist format) writes into the common state
`checkpoint_version` 3.0, its `args` namespace (the parallel layout, precision, optimizer and the
consumed train/valid samples), `iteration` and, unless it ran with --no-save-optim,
`opt_param_scheduler`; the model, optimizer and RNG entries are sharded. Our checkpoints carry the
same keys, so that Megatron-LM reads them, plus our `parallel_layout` record.

This module decides, from flags and that common state, where a run starts (`StartingPoint`) and
what of a checkpoint fits this run (`CheckpointLayout`). It imports torch and megatron-core only
inside `read_common_state`, so argument validation can use it before any heavy import.
"""
from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import dataclass
from typing import Optional

from seq1f1b import checkpoint_layout

MEGATRON_CHECKPOINT_VERSION = 3.0
"""Megatron-LM's `checkpoint_version` of torch_dist checkpoints (below 2.0 it would reorder the
query/key/value weights of what it loads)."""

FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")
"""The distributed optimizer's checkpoint formats that may change tensor/pipeline parallelism
(megatron-core's DistributedOptimizer.checkpoint_fully_reshardable_formats)."""


def read_common_state(folder: str) -> dict:
    """The common state (`common.pt`) of the checkpoint in `folder`, as megatron-core loads it.

    Megatron-LM's `args` holds megatron-core enums and dtypes; megatron-core's list of classes
    allowed in a checkpoint is registered first (its import warns about optional kernels, which
    says nothing here). Raises ValueError naming the file when it cannot be read.
    """
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.safe_globals import register_safe_globals
    register_safe_globals()
    path = os.path.join(folder, "common.pt")
    try:
        return torch.load(path, map_location="cpu")
    except Exception as err:  # unreadable: a one-line report, not a traceback
        raise ValueError(f"cannot read the checkpoint's common state {path}: "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                         ) from None


@dataclass(frozen=True)
class StartingPoint:
    """The checkpoint a run starts from and what it restores, as Megatron-LM decides it.

    --load's newest checkpoint is resumed; when --load holds none, --pretrained-checkpoint's
    newest is fine-tuned from (weights only, iteration 0). --finetune, --no-load-optim and
    --no-load-rng narrow what is restored.
    """

    root: str
    iteration: int
    flag: str
    finetune: bool
    load_optim: bool
    load_rng: bool
    release: bool = False      # a converted model (tracker "release"): its weights, iteration 0

    @property
    def folder(self) -> str:
        if self.release:
            return checkpoint_layout.release_dir(self.root)
        return checkpoint_layout.iteration_dir(self.root, self.iteration)

    @property
    def restores_optimizer(self) -> bool:
        """Whether the optimizer and LR schedule come from the checkpoint."""
        return self.load_optim and not self.finetune

    @property
    def restores_rng(self) -> bool:
        return self.load_rng and not self.finetune


def starting_point(args: argparse.Namespace) -> Optional[StartingPoint]:
    """Where the run of `args` starts; None for a fresh start. Reads trackers only.

    Raises ValueError (one line naming the flag) for an unusable tracker, or a
    --pretrained-checkpoint that is needed and holds no checkpoint.
    """
    iteration = checkpoint_layout.read_tracker(args.load) if args.load else None
    if iteration is not None and checkpoint_layout.is_release(args.load):
        return StartingPoint(args.load, 0, "--load", finetune=True, load_optim=False,
                             load_rng=False, release=True)
    if iteration is not None:
        return StartingPoint(args.load, iteration, "--load", args.finetune,
                             not args.no_load_optim, not args.no_load_rng)
    if args.pretrained_checkpoint is None:
        return None
    iteration = checkpoint_layout.read_tracker(args.pretrained_checkpoint,
                                               "--pretrained-checkpoint")
    if iteration is None:
        raise ValueError(f"--pretrained-checkpoint: {args.pretrained_checkpoint} holds no "
                         f"checkpoint ({checkpoint_layout.TRACKER_NAME} is missing)")
    return StartingPoint(args.pretrained_checkpoint, iteration, "--pretrained-checkpoint",
                         finetune=True, load_optim=False, load_rng=False,
                         release=checkpoint_layout.is_release(args.pretrained_checkpoint))


@dataclass(frozen=True)
class CheckpointLayout:
    """What decides whether optimizer and RNG state written by one run fit another."""

    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    distributed_optimizer: bool
    precision: str          # "bf16", "fp16" or "fp32": mixed precision keeps fp32 main params
    optimizer: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CheckpointLayout":
        """From a run's (or a checkpoint's Megatron-LM `args`) namespace; Megatron-LM's defaults
        for names an older writer left out."""
        return cls(tensor_parallel=getattr(args, "tensor_model_parallel_size", 1),
                   pipeline_parallel=getattr(args, "pipeline_model_parallel_size", 1),
                   # the distributed optimizer shards over DP x CP (megatron's dp_cp group)
                   data_parallel=getattr(args, "data_parallel_size", 1)
                   * getattr(args, "context_parallel_size", 1),
                   distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
                   precision="bf16" if getattr(args, "bf16", False) else
                   "fp16" if getattr(args, "fp16", False) else "fp32",
                   optimizer=getattr(args, "optimizer", "adam"))

    def optimizer_mismatch(self, saved: "CheckpointLayout", sharding_type: Optional[str]
                           ) -> Optional[str]:
        """Why the optimizer state of a checkpoint written with `saved` cannot be loaded into
        this run (None: it can). The distributed optimizer's non-canonical formats (ours and
        Megatron-LM's default, dp_reshardable) follow its buffers, so they need the same tensor
        and pipeline parallelism; the data-parallel size may change."""
        if saved.optimizer != self.optimizer:
            return f"the checkpoint's optimizer is {saved.optimizer}, this run's {self.optimizer}"
        if saved.distributed_optimizer != self.distributed_optimizer:
            return ("the checkpoint was written " + ("with" if saved.distributed_optimizer
                                                     else "without")
                    + " --use-distributed-optimizer, this run " + ("uses" if
                                                                   self.distributed_optimizer
                                                                   else "does not use") + " it")
        if saved.precision != self.precision:
            return f"the checkpoint's precision is {saved.precision}, this run's {self.precision}"
        model_parallel = (saved.tensor_parallel, saved.pipeline_parallel)
        if self.distributed_optimizer and sharding_type not in FULLY_RESHARDABLE and \
                model_parallel != (self.tensor_parallel, self.pipeline_parallel):
            return (f"the distributed optimizer's {sharding_type} state of TP={model_parallel[0]}"
                    f" PP={model_parallel[1]} does not reshard to TP={self.tensor_parallel} "
                    f"PP={self.pipeline_parallel}")
        return None


def saved_args(args: argparse.Namespace, consumed_train_samples: int,
               consumed_valid_samples: int) -> argparse.Namespace:
    """The `args` a checkpoint carries: the run's flags with Megatron-LM's names for what its
    loader reads besides them (the consumed samples, add_position_embedding, the format, what
    --no-save-optim / --no-save-rng left out)."""
    saved = argparse.Namespace(**vars(args))
    saved.consumed_train_samples = consumed_train_samples
    saved.consumed_valid_samples = consumed_valid_samples
    saved.add_position_embedding = args.position_embedding_type == "learned_absolute"
    saved.ckpt_format = "torch_dist"
    saved.no_save_optim = bool(getattr(args, "no_save_optim", False))
    saved.no_save_rng = bool(getattr(args, "no_save_rng", False))
    return saved
