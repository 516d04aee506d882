"""The scalar writers: W&B gets what TensorBoard gets, through wandb's public API only.

wandb is not installed here (an optional dependency), so a stand-in module on sys.modules records
the calls; how a real offline run stores them is wandb's business and is not tested."""
import argparse
import sys
import types

import pytest

from megatron.training.logging_utils import IntervalReport, Throughput
from megatron.training.writers import (ScalarWriters, evaluation_scalars, interval_scalars,
                                       wandb_save_dir)


def _report(**changes) -> IntervalReport:
    fields = dict(iteration=20, train_iters=100, consumed_samples=640,
                  seconds_per_iteration=0.5, learning_rate=3e-4, global_batch_size=32,
                  lm_loss=4.25, loss_scale=1.0, grad_norm=1.5, skipped_iterations=0,
                  throughput=Throughput(8192.0, 0.0123), peak_memory_mb=[12.5, 9.75],
                  memory_source="MB held for backward")
    fields.update(changes)
    return IntervalReport(**fields)


def _args(tmp_path, **changes) -> argparse.Namespace:
    values = dict(tensorboard_dir=None, wandb_project="proj", wandb_exp_name="run",
                  wandb_save_dir=None, save=str(tmp_path / "ckpt"), lr=1e-3)
    values.update(changes)
    return argparse.Namespace(**values)


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: calls.append(("init", kwargs))
    module.log = lambda data, step=None: calls.append(("log", data, step))
    module.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_run_is_named_configured_and_gets_the_scalars(tmp_path, fake_wandb):
    writers = ScalarWriters(_args(tmp_path), enabled=True)
    writers.training(_report())
    writers.evaluation("validation", 20, 4.0)
    writers.close()
    init, train, evaluation, finish = fake_wandb
    assert init == ("init", {"project": "proj", "name": "run", "dir": str(tmp_path / "ckpt/wandb"),
                             "config": vars(_args(tmp_path))})
    assert (tmp_path / "ckpt" / "wandb").is_dir()
    assert train == ("log", interval_scalars(_report()), 20)
    assert train[1]["iteration-time"] == 0.5 and train[1]["peak-memory-mb/stage-1"] == 9.75
    assert evaluation == ("log", evaluation_scalars("validation", 4.0), 20)
    assert finish == ("finish",)


def test_only_the_logging_rank_writes(tmp_path, fake_wandb):
    writers = ScalarWriters(_args(tmp_path), enabled=False)
    writers.training(_report())
    writers.close()
    assert fake_wandb == [] and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("save_dir, save, expected", [
    ("/w", "/c", "/w"), (None, "/c", "/c/wandb"), (None, None, None)])
def test_wandb_folder_follows_megatron(tmp_path, save_dir, save, expected):
    assert wandb_save_dir(_args(tmp_path, wandb_save_dir=save_dir, save=save)) == expected


def test_scalars_without_a_value_are_left_out():
    from megatron.training.writers import IterationScalars

    scalars = IterationScalars(1e-3, 8, {}, loss_scale=1.0).scalars()
    assert "lm loss" not in scalars and "grad-norm" not in scalars
    assert evaluation_scalars("test", 2.0)["lm loss test ppl"] == pytest.approx(7.389056, 1e-6)


def test_iteration_scalars_carry_megatrons_tags_as_the_flags_ask():
    from megatron.training.writers import MEMORY_TAGS, IterationScalars

    plain = IterationScalars(3e-4, 32, {"lm loss": 4.25}, loss_scale=1.0, grad_norm=1.5)
    assert plain.scalars() == {"learning-rate": 3e-4, "batch-size": 32, "lm loss": 4.25,
                               "loss-scale": 1.0, "grad-norm": 1.5}
    stats = {key: float(i) for i, key in enumerate(MEMORY_TAGS.values())}
    full = IterationScalars(3e-4, 32, {}, loss_scale=None, num_zeros_in_grad=7,
                            params_norm=12.5, world_size=4, memory_stats=stats).scalars()
    assert "loss-scale" not in full and (full["num-zeros"], full["params-norm"],
                                         full["world-size"]) == (7, 12.5, 4)
    assert [full[tag] for tag in MEMORY_TAGS] == [0.0, 1.0, 2.0, 3.0]
    assert interval_scalars(_report(), throughput=True)["throughput"] == 0.0123
    assert "throughput" not in interval_scalars(_report())
    assert evaluation_scalars("validation", 4.0, ppl=False) == {"lm loss validation": 4.0}
