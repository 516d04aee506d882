"""pretrain_gpt.py end to end with bad input: each run stops before training with exit code 2,
exactly one line on stderr naming the flag, and nothing written (no --save or --tensorboard-dir
folder, no checkpoint file touched). The full table of bad flag sets is test_arguments.py; here
a selection goes through the real entry point (subprocess, as a user would run it), plus the
checks that read a --load folder's tracker."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _base(tmp_path: Path) -> dict:
    return {"--num-layers": "4", "--hidden-size": "32", "--num-attention-heads": "4",
            "--seq-length": "64", "--micro-batch-size": "2", "--train-iters": "4",
            "--lr": "1e-3", "--mock-data": None, "--save": str(tmp_path / "ckpt"),
            "--tensorboard-dir": str(tmp_path / "tb")}


def _argv(flags: dict) -> list[str]:
    argv = []
    for flag, value in flags.items():
        argv.append(flag)
        if value is not None:
            argv.extend(value if isinstance(value, list) else [value])
    return argv


def _corrupt_dataset(tmp_path: Path) -> str:
    (tmp_path / "corrupt.idx").write_bytes(b"not a megatron index")
    (tmp_path / "corrupt.bin").write_bytes(b"")
    return str(tmp_path / "corrupt")


def _bad_tracker(tmp_path: Path) -> str:
    folder = tmp_path / "old_run"
    folder.mkdir()
    (folder / "latest_checkpointed_iteration.txt").write_text("release\n")
    return str(folder)


def _tracker_to_nowhere(tmp_path: Path) -> str:
    folder = tmp_path / "old_run"
    folder.mkdir()
    (folder / "latest_checkpointed_iteration.txt").write_text("20\n")
    return str(folder)


def _no_mock(flags: dict) -> dict:
    return {k: v for k, v in flags.items() if k != "--mock-data"}


CLI_CASES = [  # (changes to the base flags, world size, flag the message must name)
    (lambda f, t: {**f, "--pipeline-schedule": "zigzag"}, 1, "--pipeline-schedule"),
    (lambda f, t: {**f, "--seq1f1b-splits": "65"}, 1, "--seq1f1b-splits"),
    (lambda f, t: {**f, "--seq1f1b-partition": "fit"}, 1, "--seq1f1b-partition"),
    (lambda f, t: {**f, "--timeline-path": str(t / "timeline.svg")}, 1, "--timeline-path"),
    (lambda f, t: {**_no_mock(f), "--data-path": str(t / "missing_text_document")}, 1,
     "--data-path"),
    (lambda f, t: {**_no_mock(f), "--data-path": _corrupt_dataset(t)}, 1, "--data-path"),
    (lambda f, t: {**f, "--tokenizer-type": "HuggingFaceTokenizer",
                   "--tokenizer-model": str(t / "tokenizer.json")}, 1, "--tokenizer-model"),
    (lambda f, t: {**f, "--global-batch-size": "6"}, 2, "--global-batch-size"),
    (lambda f, t: {**f, "--pipeline-model-parallel-size": "2", "--num-layers": "3"}, 2,
     "--num-layers"),
    (lambda f, t: {**f, "--load": _bad_tracker(t)}, 1, "--load"),
    # wandb is not installed (requirements.txt): asking for it is one line
    (lambda f, t: {**f, "--wandb-project": "p", "--wandb-exp-name": "e"}, 1, "--wandb-project"),
    # the suite runs without a GPU
    (lambda f, t: {**f, "--record-memory-history": None}, 1, "--record-memory-history"),
    (lambda f, t: {**f, "--finetune": None}, 1, "--finetune"),
    (lambda f, t: {**f, "--pretrained-checkpoint": str(t)}, 1, "--pretrained-checkpoint"),
    (lambda f, t: {**f, "--override-opt_param-scheduler": None,
                   "--use-checkpoint-opt_param-scheduler": None}, 1,
     "--use-checkpoint-opt_param-scheduler"),
    (lambda f, t: {**f, "--exit-signal": "SIGUSR1"}, 1, "--exit-signal-handler"),
    (lambda f, t: {**f, "--exit-duration-in-mins": "0"}, 1, "--exit-duration-in-mins"),
]


@pytest.mark.parametrize("change, world, flag", CLI_CASES,
                         ids=[flag + f"-{i}" for i, (_, _, flag) in enumerate(CLI_CASES)])
def test_entry_point_rejects_bad_input_before_training(tmp_path, change, world, flag):
    flags = change(_base(tmp_path), tmp_path)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    env = {**os.environ, "WORLD_SIZE": str(world)}
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *_argv(flags)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and flag in lines[0], proc.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: ")
    assert proc.stdout == ""
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


@pytest.mark.parametrize("make_load", [_bad_tracker, _tracker_to_nowhere])
def test_a_load_folder_whose_tracker_is_unusable_is_rejected(tmp_path, make_load):
    flags = {**_base(tmp_path), "--load": make_load(tmp_path)}
    with pytest.raises(ArgumentError, match="^--load: .*latest_checkpointed_iteration.txt"):
        validate_args(parse_args(_argv(flags)), 1)


def test_a_checkpoint_beyond_train_iters_is_rejected(tmp_path):
    folder = Path(_tracker_to_nowhere(tmp_path))
    (folder / "iter_0000020").mkdir()
    flags = {**_base(tmp_path), "--load": str(folder)}
    with pytest.raises(ArgumentError, match="^--train-iters 4 is below the iteration 20"):
        validate_args(parse_args(_argv(flags)), 1)


def test_a_load_folder_without_checkpoint_is_a_fresh_start(tmp_path):
    (tmp_path / "empty").mkdir()
    args = validate_args(parse_args(_argv({**_base(tmp_path), "--load": str(tmp_path / "empty")})),
                         1)
    assert args.load == str(tmp_path / "empty")


def test_load_may_be_missing_only_when_it_is_also_save(tmp_path):
    """`--save X --load X` is the requeue pattern: the first submission finds no X yet."""
    flags = {**_base(tmp_path), "--load": str(tmp_path / "ckpt")}          # --save is tmp/ckpt
    assert validate_args(parse_args(_argv(flags)), 1).load == str(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    flags["--load"] = str(tmp_path / "ckpt_typo")
    with pytest.raises(ArgumentError, match="^--load: checkpoint directory .* does not exist"):
        validate_args(parse_args(_argv(flags)), 1)


def test_null_tokenizer_gives_mock_data_a_real_vocabulary(tmp_path):
    """Megatron's NullTokenizer: --vocab-size ids plus EOD, padded like any vocabulary."""
    flags = {**_base(tmp_path), "--tokenizer-type": "NullTokenizer", "--vocab-size": "50257",
             "--tensor-model-parallel-size": "2"}
    args = validate_args(parse_args(_argv(flags)), 2)
    assert args.padded_vocab_size == 50432          # 50258 up to a multiple of 128 x TP 2
    tokenizer = build_tokenizer(args)
    assert tokenizer.eod == 50257 and tokenizer.tokenize("3 1 4") == [3, 1, 4]
    assert tokenizer.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="token ids must lie in"):
        tokenizer.tokenize("50257")


@pytest.mark.parametrize("flags, flag", [
    ({"--tokenizer-type": "NullTokenizer"}, "--vocab-size is required"),
    ({"--vocab-size": "100"}, "--vocab-size is only read by --tokenizer-type NullTokenizer"),
    ({"--tokenizer-type": "NullTokenizer", "--vocab-size": "0"}, "--vocab-size must be >= 1"),
])
def test_null_tokenizer_flags_are_checked(tmp_path, flags, flag):
    with pytest.raises(ArgumentError, match=flag):
        validate_args(parse_args(_argv({**_base(tmp_path), **flags})), 1)


def _checkpoint_after(tmp_path: Path, train_iters: int) -> str:
    """A real checkpoint (ours, one process) of a run of `train_iters` iterations of the base
    flags, saved at its end: its LR schedule is the one build_lr_scheduler made for them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron.training import model_setup
    from megatron.training.checkpointing import RunPosition, save_checkpoint
    from seq1f1b.megatron_adapter import build_model_chunk

    flags = {**_base(tmp_path), "--train-iters": str(train_iters)}
    args = validate_args(parse_args(_argv(flags)), 1)
    config = model_setup.core_transformer_config_from_args(args)
    chunk = build_model_chunk(config, vocab_size=args.padded_vocab_size, max_sequence_length=64)
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(), chunk)]
    optimizer = model_setup.build_optimizer(args, config, model)
    scheduler = model_setup.build_lr_scheduler(args, optimizer)
    scheduler.step(increment=train_iters * args.global_batch_size)
    root = tmp_path / "old_run"
    save_checkpoint(str(root), model, optimizer, scheduler,
                    RunPosition(train_iters, train_iters * args.global_batch_size), args)
    return str(root)


@pytest.mark.usefixtures("megatron_world")
def test_extending_a_run_needs_a_word_on_its_lr_schedule(tmp_path):
    """The checkpoint decays over 2 iterations, the flags over 4: Megatron-LM stops; so does
    the entry point, in one line naming both values and both flags, before anything is
    written. Either flag, or the same schedule, lets the run start."""
    load = _checkpoint_after(tmp_path, 2)
    flags = {**_base(tmp_path), "--load": load}
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *_argv(flags)],
                          cwd=tmp_path, env={**os.environ, "WORLD_SIZE": "1"},
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "lr_decay_steps 4 in the checkpoint, 8 from the flags" in lines[0]
    assert "--override-opt_param-scheduler" in lines[0]
    assert "--use-checkpoint-opt_param-scheduler" in lines[0]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
    for extra in (["--override-opt_param-scheduler"], ["--use-checkpoint-opt_param-scheduler"],
                  ["--no-load-optim"], ["--finetune"]):
        validate_args(parse_args(_argv(flags) + extra), 1)
    validate_args(parse_args(_argv({**flags, "--train-iters": "2"})), 1)
