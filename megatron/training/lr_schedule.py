"""The learning-rate and weight-decay schedule the flags ask for, and how it compares with the one a
checkpoint carries.

megatron-core's OptimizerParamScheduler stores its settings in its state dict. Loading one either
keeps the flags' settings (`override_opt_param_scheduler`: --override-opt_param-scheduler), takes
the checkpoint's (`use_checkpoint_opt_param_scheduler`: --use-checkpoint-opt_param-scheduler), or,
with neither, asserts that both agree, as Megatron-LM's training does. Argument validation uses
`disagreements` to find such a mismatch before any work starts and report it in one line instead
of an assertion deep in the load. Pure Python.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ScheduleSettings:
    """OptimizerParamScheduler's settings (its keyword arguments of the same names), in samples:
    warm-up, decay and weight-decay horizons are iterations x global batch size, as in Megatron."""

    max_lr: float
    min_lr: float
    lr_warmup_steps: float      # a fraction of the decay horizon need not be whole
    lr_decay_steps: int
    lr_decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    wd_incr_style: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ScheduleSettings":
        """As Megatron-LM's get_optimizer_param_scheduler: iterations x global batch, or the
        samples themselves with --train-samples; --lr-warmup-fraction of the decay horizon."""
        if getattr(args, "train_samples", None) is not None:
            decay, warmup = args.lr_decay_samples, args.lr_warmup_samples
            total = args.train_samples
        else:
            samples = args.global_batch_size
            decay, warmup = args.lr_decay_iters * samples, args.lr_warmup_iters * samples
            total = args.train_iters * samples
        if getattr(args, "lr_warmup_fraction", None) is not None:
            warmup = args.lr_warmup_fraction * decay
        return cls(max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
                   lr_decay_steps=decay, lr_decay_style=args.lr_decay_style,
                   start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=total,
                   wd_incr_style="constant")


_CHECKPOINT_KEYS = {
    "max_lr": ("start_lr", "max_lr"),
    "min_lr": ("min_lr",),
    "lr_warmup_steps": ("warmup_iter", "warmup_steps", "lr_warmup_steps"),
    "lr_decay_steps": ("end_iter", "decay_steps", "lr_decay_steps"),
    "lr_decay_style": ("decay_style", "lr_decay_style"),
    "start_wd": ("start_wd",),
    "end_wd": ("end_wd",),
    "wd_incr_steps": ("wd_incr_steps",),
    "wd_incr_style": ("wd_incr_style",),
}
"""Where megatron-core's load_state_dict reads each setting (older names first, as it does); the
weight-decay settings are compared only when the state dict has them."""


def disagreements(settings: ScheduleSettings, checkpoint_state: dict
                  ) -> list[tuple[str, object, object]]:
    """(setting, checkpoint's value, flags' value) for each setting megatron-core's
    OptimizerParamScheduler.load_state_dict would find unequal; [] when they agree."""
    found = []
    for field in fields(settings):
        key = next((k for k in _CHECKPOINT_KEYS[field.name] if k in checkpoint_state), None)
        if key is None:
            continue
        ours = getattr(settings, field.name)
        if checkpoint_state[key] != ours:
            found.append((field.name, checkpoint_state[key], ours))
    return found
