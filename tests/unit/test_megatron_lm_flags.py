"""Megatron-LM's flags (arguments.py at core_v0.16.1, megatron_lm_flags.tsv): each one honoured,
accepted as a no-op, or refused in one line saying why; and Megatron-LM's Llama-3 8B script's
flag set, unchanged at a tiny shape, refused only for its GPU-only flags."""
import argparse
import sys
from pathlib import Path

import pytest

from megatron.training import megatron_lm_flags as table
from megatron.training.arguments import (ArgumentError, build_parser, parse_args,
                                         validate_args)
from megatron.training.lr_schedule import ScheduleSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_llama3_script as llama3  # noqa: E402

WORLD = 4


def _honoured() -> frozenset[str]:
    return frozenset(option for option, action in build_parser()._option_string_actions.items()
                     if not isinstance(action, (table._NoOp, table._Refused)))


def test_every_upstream_flag_has_a_status_and_a_reason():
    flags = table.upstream_flags()
    assert len(flags) == 651 and len({f.name for f in flags}) == 651
    parser, honoured = build_parser(), _honoured()
    counts = {"honoured": 0, "no-op": 0, "refused": 0}
    for flag in flags:
        kind, reason = table.status(flag, honoured)
        counts[kind] += 1
        assert all(option in parser._option_string_actions for option in flag.options), flag
        assert (kind == "honoured") == (reason == ""), flag
        # every refusal says why in its own words, never the generic fallback
        assert not reason.startswith("not implemented here ("), flag
    # 142 honoured, 39 no-ops, 470 refused at this writing; a no-op honoured later moves over
    assert counts["honoured"] >= 142 and counts["honoured"] + counts["no-op"] >= 180, counts
    # the table's own entries name real upstream flags (no typos that would never match)
    names = {option for flag in flags for option in flag.options}
    assert set(table.NO_OPS) <= names and set(table.REFUSED) <= names
    # no entry for a flag the parser honours (it would never be read)
    assert not (set(table.NO_OPS) | set(table.REFUSED)) & honoured


def test_no_ops_are_accepted_with_their_values(capsys):
    args = parse_args(["--use-mcore-models", "--num-workers", "4", "--no-rope-fusion",
                       "--tiktoken-pattern", "v2", "--attention-softmax-in-fp32"])
    assert args.num_workers == "4" and args.use_mcore_models is True
    # flags not given leave no attribute: `getattr(args, "optimizer", "adam")` (what a checkpoint
    # records) must not read a None from a flag nobody passed
    assert not hasattr(args, "optimizer") and not hasattr(args, "use_persistent_ckpt_worker")


@pytest.mark.parametrize("argv, named", [
    (["--dataloader-type", "cyclic"], "--dataloader-type cyclic (only single"),
    (["--distributed-backend", "mpi"], "--distributed-backend mpi (only nccl or gloo"),
    (["--rampup-batch-size", "1", "1", "10"], "--rampup-batch-size (batch-size ramp-up"),
])
def test_a_no_op_flags_other_values_and_counted_values_are_refused_in_one_line(capsys, argv,
                                                                                 named):
    """A no-op's other values mean something not done here (upstream's cyclic loader); a flag
    of three values was handed to argparse as the string "3" (a traceback)."""
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    line = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in line and named in line, line
    assert parse_args(["--dataloader-type", "single", "--distributed-backend", "nccl"])


def test_refused_flags_are_named_in_one_line_with_why(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--num-experts", "8", "--fp8-format", "hybrid", "--inference-max-requests",
                    "2", "--yaml-cfg", "x.yaml"])
    assert stop.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line
    for name in ("--num-experts (mixture of experts", "--fp8-format (FP8/FP4",
                 "--inference-max-requests (inference",
                 "--yaml-cfg (flags are read from the command line only"):
        assert name in line, line


def _run(**extra):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--lr", "1e-3", "--mock-data"]
    values = {flag: [] if value is True else value if isinstance(value, list) else [value]
              for flag, value in extra.items()}
    return base + [str(item) for flag, given in values.items()
                   for item in ["--" + flag.replace("_", "-"), *given]]


def test_the_sample_based_schedule_counts_in_samples():
    args = validate_args(parse_args(_run(train_samples=100, lr_decay_samples=80,
                                         lr_warmup_samples=8)), 1)
    assert args.train_iters == 12                           # 100 // 8, as Megatron-LM
    settings = ScheduleSettings.from_args(args)
    assert (settings.lr_decay_steps, settings.lr_warmup_steps, settings.wd_incr_steps) == \
        (80, 8, 100)
    args = validate_args(parse_args(_run(train_samples=100, lr_warmup_fraction=0.25)), 1)
    assert ScheduleSettings.from_args(args).lr_warmup_steps == 25    # of --train-samples
    args = validate_args(parse_args(_run(train_iters=10, lr_warmup_fraction=0.5)), 1)
    assert ScheduleSettings.from_args(args).lr_warmup_steps == 40    # of 10 x 8 samples


def test_sequence_parallel_at_tp_1_warns_and_turns_off_as_megatron(capsys):
    args = validate_args(parse_args(_run(train_iters=2, sequence_parallel=True,
                                         distributed_timeout_minutes=2)), 1)
    assert args.sequence_parallel is False and args.p2p_timeout == 120
    assert "warning: --sequence-parallel is turned off" in capsys.readouterr().err


def test_the_llama3_script_is_refused_only_for_its_gpu_only_flags(tmp_path, capsys):
    flags = llama3.script_flags(str(tmp_path))
    with pytest.raises(SystemExit) as stop:
        parse_args(flags)
    assert stop.value.code == 2
    line = capsys.readouterr().err.strip()
    named = sorted(word for word in line.split() if word.startswith("--"))
    assert "\n" not in line and named == sorted(llama3.REFUSED_AT_PARSE), line
    flags = llama3.cpu_flags(str(tmp_path), attention_backend="fused")
    with pytest.raises(ArgumentError, match=r"^--attention-backend fused is unavailable: needs "
                                            r"a CUDA GPU$"):
        validate_args(parse_args(flags), WORLD)
    cpu = llama3.cpu_flags(str(tmp_path))
    args = validate_args(parse_args(cpu), WORLD)
    assert (args.train_iters, args.num_micro_batches, args.kv_channels) == (4, 2, 16)
    assert args.decoupled_lr == 5e-4 and args.sequence_parallel and args.log_throughput
    assert not (tmp_path / "checkpoints").exists()          # validation writes nothing


def test_span_alignment_rounds_every_cut_and_the_runtime_cuts_the_same():
    """--seq1f1b-span-alignment 64: the compute cut of 4096 tokens into 4 spans (not multiples
    of 64 without it) rounds every span to a multiple of 64; the runtime's spans (span_settings,
    as the iterations run them) are the first line's, the budget's and the estimate's
    (starting_span_lengths); the fit's cut is aligned too (test_training.py). Numbers it cannot
    take are refused in one line."""
    from megatron.training.schedule_budget import starting_span_lengths
    from megatron.training.schedule_function import span_settings
    from seq1f1b.runtime.forward_backward import _spans

    flags = dict(train_iters=2, seq1f1b_splits=4, seq1f1b_partition="compute",
                 seq_length=4096, max_position_embeddings=4096)
    plain = validate_args(parse_args(_run(**flags)), 1)
    assert any(length % 64 for length in starting_span_lengths(plain))
    args = validate_args(parse_args(_run(**flags, seq1f1b_span_alignment=64)), 1)
    lengths = starting_span_lengths(args)
    assert all(length % 64 == 0 for length in lengths) and sum(lengths) == 4096
    bounds = _spans(span_settings(args), 4096, None, 1, False)
    assert [end - start for start, end in bounds] == list(lengths)
    for extra, message in ((dict(seq1f1b_span_alignment=0), "--seq1f1b-span-alignment must be"),
                           (dict(seq1f1b_span_alignment=3000), "--seq-length 4096: "
                            "--seq1f1b-span-alignment 3000 must divide it"),
                           (dict(seq1f1b_span_alignment=64, seq1f1b_partition="explicit",
                                 seq1f1b_span_lengths=[2000, 2096]),
                            "--seq1f1b-span-lengths 2000 2096: --seq1f1b-span-alignment 64")):
        with pytest.raises(ArgumentError, match=message):
            validate_args(parse_args(_run(**{**flags, **extra})), 1)


def test_the_first_line_gives_the_span_lengths_the_runtime_uses():
    from megatron.training.training import _first_span_lengths

    for extra, lengths in (({"seq1f1b_splits": 4}, "4 4 4 4"),
                           ({"seq1f1b_splits": 2, "seq1f1b_partition": "compute",
                             "seq_length": 4096, "max_position_embeddings": 4096}, None),
                           ({"seq1f1b_span_lengths": [10, 6]}, "10 6")):
        args = validate_args(parse_args(_run(train_iters=2, **extra)), 1)
        text = _first_span_lengths(args)
        spans = [int(n) for n in text.split()]
        assert sum(spans) == args.seq_length and len(spans) == args.seq1f1b_splits, text
        if lengths is None:           # compute: the later span attends to more keys, shorter
            assert spans[0] > spans[1], text
        else:
            assert text == lengths


def test_the_runtime_cuts_the_spans_the_trainer_prices_under_cp_and_its_vocabulary():
    # The runtime's compute cut balances the run's model (padded vocabulary 512 here, where the
    # chunks' TransformerConfig knows none) in multiples of CP x TP under SP: the cut the first
    # line prints, the estimator plans and a searched schedule's budget is priced on.
    from megatron.training import model_setup
    from megatron.training.schedule_budget import starting_span_lengths
    from megatron.training.schedule_function import span_settings
    from megatron.training.training import _first_span_lengths
    from seq1f1b.plan.costs import ModelConfig
    from seq1f1b.runtime import forward_backward

    args = validate_args(parse_args(_run(
        train_iters=2, seq1f1b_splits=4, seq1f1b_partition="compute", seq_length=4096,
        max_position_embeddings=4096, tensor_model_parallel_size=2, sequence_parallel=True,
        context_parallel_size=2)), 4)
    config = model_setup.core_transformer_config_from_args(args)
    bounds = forward_backward._spans(span_settings(args), args.seq_length,
                                     ModelConfig.of_transformer_config(config), 2, True, 2)
    lengths = tuple(end - start for start, end in bounds)
    assert lengths == starting_span_lengths(args)
    assert _first_span_lengths(args) == " ".join(map(str, lengths))
    assert all(length % 4 == 0 for length in lengths) and lengths[0] > lengths[-1]


def test_skip_train_loads_no_optimizer_as_megatron(tmp_path, capsys):
    args = validate_args(parse_args(_run(train_iters=2, skip_train=True)), 1)
    assert args.skip_train and args.no_load_optim
    assert "warning: enabling --no-load-optim when skipping training" in capsys.readouterr().err


def test_exit_on_missing_checkpoint_stops_a_load_without_one(tmp_path):
    flags = _run(train_iters=2, load=str(tmp_path), exit_on_missing_checkpoint=True)
    with pytest.raises(ArgumentError, match=r"^--exit-on-missing-checkpoint: --load \S+ holds no "
                                            r"checkpoint \(latest_checkpointed_iteration.txt is "
                                            r"missing\)$"):
        validate_args(parse_args(flags), 1)
    assert validate_args(parse_args(flags[:-1]), 1).load == str(tmp_path)


def test_the_logging_flags_are_megatrons(capsys):
    args = validate_args(parse_args(_run(train_iters=2)), 1)
    assert (args.tensorboard_log_interval, args.tensorboard_queue_size) == (1, 1000)
    assert args.log_loss_scale_to_tensorboard and not args.log_validation_ppl_to_tensorboard
    args = validate_args(parse_args(_run(train_iters=2, no_log_loss_scale_to_tensorboard=True,
                                         log_memory_to_tensorboard=True)), 1)
    assert not args.log_loss_scale_to_tensorboard
    assert "--log-memory-to-tensorboard writes the CUDA allocator's" in capsys.readouterr().err
    with pytest.raises(ArgumentError, match="^--tensorboard-log-interval must be"):
        validate_args(parse_args(_run(train_iters=2, tensorboard_log_interval=0)), 1)


def test_the_manual_gc_flags_are_megatrons():
    args = validate_args(parse_args(_run(train_iters=2)), 1)
    assert (args.manual_gc, args.manual_gc_interval, args.manual_gc_eval) == (False, 0, True)
    for eval_flag in ("no_manual_gc_eval", "disable_manual_gc_eval"):     # upstream's two names
        args = validate_args(parse_args(_run(train_iters=2, manual_gc=True, manual_gc_interval=5,
                                             **{eval_flag: True})), 1)
        assert (args.manual_gc, args.manual_gc_interval, args.manual_gc_eval) == (True, 5, False)
    with pytest.raises(ArgumentError, match=r"^--manual-gc-interval must be >= 0, got -1$"):
        validate_args(parse_args(_run(train_iters=2, manual_gc=True, manual_gc_interval=-1)), 1)


def test_the_empty_unused_memory_level_is_megatrons(capsys):
    assert validate_args(parse_args(_run(train_iters=2)), 1).empty_unused_memory_level == 0
    assert validate_args(parse_args(_run(train_iters=2, empty_unused_memory_level=2)),
                         1).empty_unused_memory_level == 2
    with pytest.raises(SystemExit) as stopped:
        parse_args(_run(train_iters=2, empty_unused_memory_level=3))
    assert stopped.value.code == 2
    assert "argument --empty-unused-memory-level: invalid choice: 3" in capsys.readouterr().err
