"""lr_schedule.disagreements finds exactly what megatron-core's OptimizerParamScheduler refuses to
load without --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler, for current
and older state-dict key names."""
from __future__ import annotations

import argparse
from dataclasses import asdict
from types import SimpleNamespace

import pytest
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.lr_schedule import ScheduleSettings, disagreements

FLAGS = argparse.Namespace(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_iters=8,
                           lr_decay_style="cosine", weight_decay=0.1, train_iters=8,
                           global_batch_size=4)


def _scheduler(settings: ScheduleSettings) -> OptimizerParamScheduler:
    """As build_lr_scheduler makes it with neither flag (megatron-core's constructor default
    would trust the checkpoint)."""
    return OptimizerParamScheduler(SimpleNamespace(param_groups=[{}]), init_lr=0.0,
                                   **asdict(settings), use_checkpoint_opt_param_scheduler=False,
                                   override_opt_param_scheduler=False)


def _megatron_refuses(settings: ScheduleSettings, state: dict) -> bool:
    try:
        _scheduler(settings).load_state_dict(state)
    except AssertionError:
        return True
    return False


def _older_names(state: dict) -> dict:
    """The same state under the names older Megatron checkpoints used (no weight decay)."""
    return {"start_lr": state["max_lr"], "min_lr": state["min_lr"],
            "warmup_iter": state["lr_warmup_steps"], "end_iter": state["lr_decay_steps"],
            "decay_style": state["lr_decay_style"], "num_iters": state["num_steps"]}


@pytest.mark.parametrize("older", [False, True])
@pytest.mark.parametrize("changed, expected", [
    ({}, []),
    ({"train_iters": 16, "lr_decay_iters": 16}, ["lr_decay_steps", "wd_incr_steps"]),
    ({"lr": 2e-3}, ["max_lr"]),
    ({"lr_decay_style": "linear", "min_lr": 0.0}, ["min_lr", "lr_decay_style"]),
])
def test_disagreements_are_what_megatron_core_refuses(changed, expected, older):
    saved = _scheduler(ScheduleSettings.from_args(FLAGS)).state_dict()
    if older:
        saved = _older_names(saved)
        expected = [name for name in expected if name != "wd_incr_steps"]
    flags = ScheduleSettings.from_args(argparse.Namespace(**{**vars(FLAGS), **changed}))
    found = disagreements(flags, saved)
    assert [name for name, _, _ in found] == expected
    assert _megatron_refuses(flags, saved) == bool(expected)
    for name, checkpoint_value, flag_value in found:
        assert flag_value == getattr(flags, name) and checkpoint_value != flag_value
