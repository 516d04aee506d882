"""Save and resume the distributed optimizer's Adam state, on torch's Adam and on the state layout
of Transformer Engine's FusedAdam (which megatron uses whenever TE is installed).

TE cannot be installed here, so `FusedAdamLayout` stands in for it: a stub with TE FusedAdam's
state layout as its source has it (transformer_engine/pytorch/optimizers/fused_adam.py):
- Adam's step is an int in each param group (`group["step"]`), not per parameter;
- the per-parameter state holds exp_avg and exp_avg_sq (master_param only with master weights);
- `state_dict()` and `load_state_dict()` look every per-parameter state name up in that set
  (`name_to_dtype_map`, through `get_unscaled_state` / `set_scaled_state`): any other name, such
  as torch Adam's "step", raises KeyError.
megatron switches its distributed optimizer between the two layouts with module flags, patched
here as an installed TE sets them.
"""
from __future__ import annotations

import argparse

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.checkpoint_common import StartingPoint
from megatron.training.checkpointing import RunPosition, load_checkpoint, save_checkpoint
from seq1f1b.megatron_adapter import build_model_chunk, make_transformer_config

pytestmark = pytest.mark.usefixtures("megatron_world")


class FusedAdamLayout(torch.optim.Optimizer):
    """Adam with TE FusedAdam's state layout and its state-name lookups (see the module
    docstring); megatron builds it with FusedAdam's keyword arguments."""

    STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")

    def __init__(self, params, lr: float, weight_decay: float, betas: tuple[float, float],
                 eps: float, adam_w_mode: bool = True) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                                      bias_correction=True))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["exp_avg"].lerp_(param.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                denominator = (state["exp_avg_sq"] / (1 - beta2 ** group["step"])).sqrt()
                param.addcdiv_(state["exp_avg"], denominator.add_(group["eps"]),
                               value=-group["lr"] / (1 - beta1 ** group["step"]))

    def _check_names(self, state: dict) -> None:
        for entry in state.values():
            for name in entry:
                if name not in self.STATE_NAMES:
                    raise KeyError(name)

    def state_dict(self) -> dict:
        state_dict = super().state_dict()
        self._check_names(state_dict["state"])
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_names(state_dict["state"])
        super().load_state_dict(state_dict)


@pytest.fixture(params=["torch", "te"])
def adam(request, monkeypatch) -> str:
    """Which Adam megatron builds: torch's, or TE FusedAdam's layout (flags as TE sets them)."""
    if request.param == "te":
        from megatron.core import optimizer
        from megatron.core.optimizer import distrib_optimizer

        monkeypatch.setattr(optimizer, "Adam", FusedAdamLayout)
        monkeypatch.setattr(optimizer, "USING_PYTORCH_OPTIMIZER", False)
        monkeypatch.setattr(distrib_optimizer, "Adam", FusedAdamLayout)
        monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
        monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    return request.param


def _training_state():
    """A one-layer GPT in megatron DDP, its distributed optimizer and LR schedule."""
    config = make_transformer_config(num_layers=1, hidden_size=16, num_attention_heads=2)
    chunk = build_model_chunk(config, vocab_size=32, max_sequence_length=8,
                              attention_backend="eager")
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), chunk)]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, use_distributed_optimizer=True, params_dtype=torch.float32),
        model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=1e-2, max_lr=1e-2, min_lr=1e-2, lr_warmup_steps=0, lr_decay_steps=10,
        lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=10,
        wd_incr_style="constant")
    return model, optimizer, scheduler


def _adam_state(optimizer) -> tuple[list, list]:
    """Per main parameter (in order): its state tensors by name; per param group: its step."""
    inner = optimizer.optimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    tensors = [{name: value.clone() for name, value in inner.state[p].items()} for p in params]
    return tensors, [group.get("step") for group in inner.param_groups]


def _steps(model, optimizer, count: int) -> None:
    gen = torch.Generator().manual_seed(count)
    for _ in range(count):
        for param in model[0].parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=gen))
        optimizer.step()


def test_resume_restores_adam_state_in_each_layout(adam, tmp_path):
    model, optimizer, scheduler = _training_state()
    _steps(model, optimizer, 2)
    saved = _adam_state(optimizer)
    flags = argparse.Namespace(position_embedding_type="rope", use_distributed_optimizer=True)
    save_checkpoint(str(tmp_path), model, optimizer, scheduler, RunPosition(iteration=2), flags)

    model, optimizer, scheduler = _training_state()
    start = StartingPoint(str(tmp_path), 2, "--load", finetune=False, load_optim=True,
                          load_rng=True)
    assert load_checkpoint(start, model, optimizer, scheduler).iteration == 2
    tensors, group_steps = _adam_state(optimizer)
    assert [sorted(t) for t in tensors] == [sorted(t) for t in saved[0]]
    for loaded, before in zip(tensors, saved[0]):
        for name in before:
            assert torch.equal(loaded[name], before[name]), name
    if adam == "te":    # the step lives in the param groups only
        assert group_steps == saved[1] == [2] * len(saved[1]) and "step" not in tensors[0]
    else:       # torch's Adam: each parameter its own step tensor, as it increments in place
        steps = [t["step"] for t in tensors]
        assert all(s.item() == 2 for s in steps)
        assert len({s.data_ptr() for s in steps}) == len(steps)
