"""Starting points of a run (--finetune, --no-load-optim, --no-load-rng) and Megatron-LM's own
torch_dist checkpoints, in a one-process world.

The Megatron-LM checkpoint is written the way Megatron-LM's training writes one for a GPT model
with the local layer spec (`--transformer-impl local`): megatron-core's stock GPTModel (not our
span-aware model) in DDP, its optimizer's sharded state dict with Megatron-LM's content metadata,
the RNG entry as a (PP, TP)-sharded object holding a list of Megatron-LM's RNG dicts, and the
common-state keys of Megatron-LM's `generate_state_dict` (`args`, `checkpoint_version` 3.0,
`iteration`, `opt_param_scheduler`, `num_floating_point_operations_so_far`), saved with
megatron-core's dist_checkpointing. Our loader reads it (that direction is a round trip here). The
other direction, Megatron-LM loading ours, is checked by asking our checkpoint for exactly what
Megatron-LM's loader requests (the same request builder): Megatron-LM's code itself is not here.
"""
from __future__ import annotations

import argparse
import random

import numpy
import pytest
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.enums import AttnBackend

from megatron.training.checkpoint_common import StartingPoint
from megatron.training.checkpointing import RunPosition, load_checkpoint, save_checkpoint
from seq1f1b.megatron_adapter import build_model_chunk, make_transformer_config

pytestmark = pytest.mark.usefixtures("megatron_world")

VOCAB, SEQ = 64, 16
MEGATRON_LM_CONTENT = {"distrib_optim_sharding_type": "dp_reshardable",
                       "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""What Megatron-LM 0.16's _build_sharded_state_dict_metadata stores (without the process group)."""


def _config():
    return make_transformer_config(num_layers=2, hidden_size=16, num_attention_heads=2)


def _train(model, optimizer, scheduler, steps: int) -> None:
    """Real gradient steps on random tokens: Adam state and the weights move."""
    gen = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        positions = torch.arange(SEQ).expand(2, SEQ)
        losses = model[0](tokens, positions, None, labels=tokens)
        losses.float().mean().backward()
        optimizer.step()
        scheduler.step(increment=8)


def _state(distributed_optimizer: bool, stock_megatron: bool = False):
    """Model chunk in DDP (ours, or megatron-core's stock GPT with the local spec), Adam, LR
    schedule: the objects a training run holds."""
    config = _config()
    if stock_megatron:
        chunk = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope")
    else:
        chunk = build_model_chunk(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                                  attention_backend="eager")
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), chunk)]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, min_lr=1e-3, use_distributed_optimizer=distributed_optimizer,
        params_dtype=torch.float32), model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=8, lr_decay_steps=80,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=80,
        wd_incr_style="constant")
    return model, optimizer, scheduler


def _megatron_lm_args(distributed_optimizer: bool) -> argparse.Namespace:
    """The part of Megatron-LM's `args` its loader reads, with values of Megatron-LM's types."""
    return argparse.Namespace(
        num_layers=2, hidden_size=16, num_attention_heads=2, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, data_parallel_size=1, world_size=1,
        use_distributed_optimizer=distributed_optimizer, bf16=False, fp16=False,
        optimizer="adam", params_dtype=torch.float32, attention_backend=AttnBackend.auto,
        consumed_train_samples=24, consumed_valid_samples=8, no_save_optim=None,
        no_save_rng=None, ckpt_format="torch_dist")


def _megatron_lm_rng() -> dict:
    """Megatron-LM's get_rng_state entry (no CUDA here: its CUDA state is None)."""
    return {"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _megatron_lm_request(model, optimizer, scheduler, args, iteration, rng) -> dict:
    """Megatron-LM's generate_state_dict for torch_dist (one model chunk, unwrapped from DDP as
    Megatron-LM's save and load do): what it saves, and, with rng None, what its load_checkpoint
    requests."""
    metadata = {**MEGATRON_LM_CONTENT, "dp_cp_group": parallel_state.get_data_parallel_group()}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model[0].module.sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata,
                                                      is_loading=rng is None)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = ShardedObject("rng_state", None if rng is None else [rng], (1, 1),
                                       (0, 0), replica_id=0)
    return state


def _write_megatron_lm_checkpoint(root, iteration: int, distributed_optimizer: bool):
    model, optimizer, scheduler = _state(distributed_optimizer, stock_megatron=True)
    _train(model, optimizer, scheduler, 3)
    rng = _megatron_lm_rng()
    state = _megatron_lm_request(model, optimizer, scheduler,
                                 _megatron_lm_args(distributed_optimizer), iteration, rng)
    state["num_floating_point_operations_so_far"] = 0
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    dist_checkpointing.save(state, str(folder), content_metadata=MEGATRON_LM_CONTENT)
    (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return model, optimizer, scheduler, rng


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model[0].module.state_dict().items()
            if torch.is_tensor(v) and "_extra_state" not in k}


def _megatron_optimizer(optimizer):
    """The one megatron optimizer (get_megatron_optimizer chains the mixed-precision one)."""
    return getattr(optimizer, "chained_optimizers", [optimizer])[0]


def _adam(optimizer) -> list:
    inner = _megatron_optimizer(optimizer).optimizer
    return [{k: v.clone() for k, v in inner.state[p].items() if k != "step"}
            for group in inner.param_groups for p in group["params"]]


def _start(root, iteration, finetune=False, load_optim=True, load_rng=True) -> StartingPoint:
    return StartingPoint(str(root), iteration, "--load", finetune, load_optim, load_rng)


def _assert_same(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for key in expected:
        assert torch.equal(loaded[key], expected[key]), key


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_a_megatron_lm_checkpoint_resumes_weights_optimizer_schedule_rng_position(
        tmp_path, distributed_optimizer):
    written, optimizer, scheduler, rng = _write_megatron_lm_checkpoint(
        tmp_path, 3, distributed_optimizer)
    expected_adam = _adam(optimizer)
    model, ours, our_scheduler = _state(distributed_optimizer)
    torch.manual_seed(99)
    position = load_checkpoint(_start(tmp_path, 3), model, ours, our_scheduler)
    assert position == RunPosition(3, 24, 8)           # iteration; samples from Megatron's args
    _assert_same(_weights(model), _weights(written))
    for loaded, expected in zip(_adam(ours), expected_adam, strict=True):
        _assert_same(loaded, expected)
    assert our_scheduler.num_steps == scheduler.num_steps == 24
    assert ours.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert torch.equal(torch.get_rng_state(), rng["torch_rng_state"])
    assert random.getstate() == rng["random_rng_state"]


def test_a_checkpoint_whose_optimizer_does_not_fit_loads_weights_and_schedule(tmp_path, capsys):
    """Distributed optimizer in the checkpoint, a plain one here: Adam starts afresh."""
    written, _, scheduler, _ = _write_megatron_lm_checkpoint(tmp_path, 3, True)
    model, optimizer, our_scheduler = _state(False)
    position = load_checkpoint(_start(tmp_path, 3), model, optimizer, our_scheduler)
    assert position.iteration == 3
    _assert_same(_weights(model), _weights(written))
    assert all(not state for state in _adam(optimizer))
    assert our_scheduler.num_steps == scheduler.num_steps
    assert "optimizer state not loaded (the checkpoint was written with " \
           "--use-distributed-optimizer, this run does not use it)" in capsys.readouterr().out


def _our_checkpoint(tmp_path, bf16: bool = False):
    """Ours, after 3 trained steps (fp32, or bf16 with fp32 main parameters)."""
    config = make_transformer_config(num_layers=2, hidden_size=16, num_attention_heads=2,
                                     bf16=bf16, params_dtype=torch.bfloat16 if bf16 else
                                     torch.float32)
    model, optimizer, scheduler = _bf16_state(config) if bf16 else _state(False)
    _train(model, optimizer, scheduler, 3)
    flags = argparse.Namespace(position_embedding_type="rope", use_distributed_optimizer=False,
                               tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                               data_parallel_size=1, bf16=bf16, fp16=False)
    save_checkpoint(str(tmp_path), model, optimizer, scheduler, RunPosition(3, 24, 8), flags)
    return model, optimizer, scheduler, flags


def _bf16_state(config):
    from megatron.core.transformer.module import Float16Module

    chunk = Float16Module(config, build_model_chunk(config, vocab_size=VOCAB,
                                                    max_sequence_length=SEQ,
                                                    attention_backend="eager"))
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), chunk)]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, min_lr=1e-3, bf16=True, params_dtype=torch.bfloat16), model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=8, lr_decay_steps=80,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=80,
        wd_incr_style="constant")
    return model, optimizer, scheduler


def test_our_checkpoint_answers_megatron_lm_loaders_request(tmp_path):
    """Megatron-LM's load of our checkpoint: its common-state keys are there and its sharded
    request (model, optimizer with the stored content metadata, (PP, TP) RNG entry) is met."""
    written, optimizer, scheduler, _ = _our_checkpoint(tmp_path)
    folder = str(tmp_path / "iter_0000003")
    common = dist_checkpointing.load_common_state_dict(folder)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 3
    args = common["args"]
    assert (args.consumed_train_samples, args.consumed_valid_samples) == (24, 8)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.data_parallel_size, args.use_distributed_optimizer) == (1, 1, 1, False)
    assert dist_checkpointing.load_content_metadata(folder) == MEGATRON_LM_CONTENT
    model, fresh, fresh_scheduler = _state(False)
    request = _megatron_lm_request(model, fresh, fresh_scheduler, None, None, rng=None)
    request = {k: v for k, v in request.items() if k in ("model", "optimizer", "rng_state")}
    state = dist_checkpointing.load(request, folder)
    model[0].module.load_state_dict(state["model"])
    fresh.load_state_dict(state["optimizer"])
    _assert_same(_weights(model), _weights(written))
    for loaded, expected in zip(_adam(fresh), _adam(optimizer), strict=True):
        _assert_same(loaded, expected)
    rng = state["rng_state"][0]         # Megatron-LM reads entry 0 of the list
    assert set(rng) == {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
                        "rng_tracker_states"}


@pytest.mark.parametrize("how", ["finetune", "no_load_optim", "no_load_rng"])
def test_starting_points_restore_what_they_say(tmp_path, how):
    """bf16 with fp32 main parameters: without the optimizer state, the main parameters must
    copy the loaded weights, or the first step would write the random ones back."""
    written, optimizer, scheduler, _ = _our_checkpoint(tmp_path, bf16=True)
    config = make_transformer_config(num_layers=2, hidden_size=16, num_attention_heads=2,
                                     bf16=True, params_dtype=torch.bfloat16)
    torch.manual_seed(5)
    model, fresh, fresh_scheduler = _bf16_state(config)
    rng_before = torch.get_rng_state()
    start = _start(tmp_path, 3, finetune=how == "finetune", load_optim=how != "no_load_optim",
                   load_rng=how != "no_load_rng")
    position = load_checkpoint(start, model, fresh, fresh_scheduler)
    _assert_same(_weights(model), _weights(written))
    mixed = _megatron_optimizer(fresh)
    mains = [p for group in mixed.optimizer.param_groups for p in group["params"]]
    models = [p for group in mixed.float16_groups for p in group]
    assert all(torch.equal(main.to(torch.bfloat16), weight) for main, weight in
               zip(mains, models, strict=True))
    restored = how == "no_load_rng"          # the optimizer comes back only there
    assert position == (RunPosition() if how == "finetune" else RunPosition(3, 24, 8))
    assert fresh_scheduler.num_steps == (scheduler.num_steps if restored else 0)
    assert bool(all(_adam(fresh))) == restored
    if restored:
        for loaded, expected in zip(_adam(fresh), _adam(optimizer), strict=True):
            _assert_same(loaded, expected)
    assert torch.equal(torch.get_rng_state(), rng_before) == (how != "no_load_optim")
