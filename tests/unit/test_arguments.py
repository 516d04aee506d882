"""Flags: Megatron's derived values, the reference fork's aliases, and a table of bad inputs, each
rejected with one line naming the right flag and nothing written."""
import os
import re

import pytest

from megatron.training import arguments
from megatron.training.arguments import (
    MEGATRON_SCHEDULES, ArgumentError, ScheduleConfig, parse_and_validate_args, parse_args,
    schedule_catalog, validate_args)

# A fixed catalog, so the table does not depend on which families are registered today.
CATALOG = {"1f1b": False, "seq1f1b": False, "interleaved-1f1b": True,
           "seq1f1b-interleaved": True, **MEGATRON_SCHEDULES}
WORLD = 8


@pytest.fixture(autouse=True)
def fixed_catalog(monkeypatch):
    monkeypatch.setattr(arguments, "schedule_catalog", lambda: dict(CATALOG))


def _base(tmp_path):
    """A valid run: TP2 x PP2 x DP2 on 8 processes, 2 micro-batches, seq1f1b with k=4."""
    return {"--num-layers": 8, "--hidden-size": 64, "--num-attention-heads": 4,
            "--seq-length": 64, "--micro-batch-size": 2, "--global-batch-size": 8,
            "--train-iters": 10, "--lr": 1e-3, "--mock-data": True,
            "--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2,
            "--pipeline-schedule": "seq1f1b", "--seq1f1b-splits": 4,
            "--save": str(tmp_path / "ckpt")}


def _argv(flags):
    argv = []
    for flag, value in flags.items():
        if value is None or value is False:
            continue
        argv.append(flag)
        if value is not True:
            argv.extend(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return argv


def _with(tmp_path, **changes):
    """The base flags with `changes` (keys: flag names with _ for -; None removes a flag)."""
    flags = _base(tmp_path)
    for key, value in changes.items():
        flags["--" + key.replace("_", "-")] = value
    return flags


def _data_files(tmp_path):
    """A corrupt dataset (valid-looking names, garbage .idx) and a file where a dir is expected."""
    (tmp_path / "corrupt.idx").write_bytes(b"garbage, not an index")
    (tmp_path / "corrupt.bin").write_bytes(b"")
    (tmp_path / "a_file").write_text("x")


BAD = [  # (changes to the base flags, world size, flag the message must name)
    ({}, 6, "--pipeline-model-parallel-size"),
    ({"global_batch_size": 6}, WORLD, "--global-batch-size"),
    ({"num_layers": 7}, WORLD, "--num-layers"),
    ({"num_layers": None}, WORLD, "--num-layers"),
    ({"train_iters": 0}, WORLD, "--train-iters"),
    ({"num_attention_heads": 1}, WORLD, "--num-attention-heads"),
    ({"hidden_size": 66}, WORLD, "--hidden-size"),
    ({"ffn_hidden_size": 101}, WORLD, "--ffn-hidden-size"),
    ({"seq1f1b_splits": 65}, WORLD, "--seq1f1b-splits"),
    ({"recompute_method": "block"}, WORLD, "--recompute-method"),
    ({"recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": -1}, WORLD, "--recompute-num-layers"),
    ({"recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": 3}, WORLD,
     "--recompute-num-layers"),       # uniform groups of 3 do not divide a stage's layers
    ({"recompute_granularity": "full"}, WORLD, "--recompute-method"),    # megatron-core refuses
    ({"recompute_granularity": "full", "recompute_method": "block"}, WORLD,
     "--recompute-num-layers"),
    ({"transformer_impl": "transformer_engine"}, WORLD, "--transformer-impl transformer_engine"),
    ({"ckpt_format": "torch"}, WORLD, "--ckpt-format torch"),
    ({"train_samples": 80}, WORLD, "--train-samples"),                 # and --train-iters
    ({"train_iters": None, "train_samples": 80, "lr_warmup_iters": 2}, WORLD,
     "--lr-warmup-samples"),
    ({"lr_decay_samples": 40}, WORLD, "--lr-decay-samples"),
    ({"lr_warmup_fraction": 0.1, "lr_warmup_iters": 1}, WORLD, "--lr-warmup-fraction"),
    ({"lr_warmup_fraction": 1.5}, WORLD, "--lr-warmup-fraction"),
    ({"decoupled_min_lr": 1e-5}, WORLD, "--decoupled-min-lr"),
    ({"sequence_parallel": True, "seq_length": 63}, WORLD, "--seq-length"),
    ({"seq1f1b_span_lengths": [16, 16, 16, 8]}, WORLD, "--seq1f1b-span-lengths"),
    ({"seq1f1b_span_lengths": [32, 32]}, WORLD, "--seq1f1b-span-lengths"),
    ({"sequence_parallel": True, "seq1f1b_span_lengths": [15, 17, 16, 16]}, WORLD,
     "--seq1f1b-span-lengths"),
    ({"seq1f1b_partition": "explicit"}, WORLD, "--seq1f1b-span-lengths"),
    ({"seq1f1b_partition": "compute", "seq1f1b_span_lengths": [16] * 4}, WORLD,
     "--seq1f1b-span-lengths"),
    ({"seq1f1b_partition": "fit", "seq1f1b_splits": 1}, WORLD, "--seq1f1b-splits"),
    ({"pipeline_schedule": "megatron-1f1b", "seq1f1b_splits": 1, "seq1f1b_partition": "fit"},
     WORLD, "--seq1f1b-partition fit: --pipeline-schedule megatron-1f1b"),
    ({"seq1f1b_fit_iterations": 2}, WORLD, "--seq1f1b-fit-iterations needs"),
    ({"seq1f1b_partition": "fit", "seq1f1b_fit_iterations": 0}, WORLD,
     "--seq1f1b-fit-iterations"),
    ({"seq1f1b_partition": "fit", "seq1f1b_fit_iterations": 10}, WORLD,
     "--seq1f1b-fit-iterations 10 leaves none"),
    ({"timeline_iteration": 3}, WORLD, "--timeline-path"),
    ({"timeline_path": "{tmp}/timeline.svg"}, WORLD, "--timeline-path"),
    ({"timeline_path": "{tmp}/a_file/timeline.png"}, WORLD, "--timeline-path"),
    ({"timeline_path": "{tmp}/timeline.png", "timeline_iteration": 11}, WORLD,
     "--timeline-iteration 11"),
    ({"timeline_path": "{tmp}/timeline.png", "pipeline_schedule": "megatron-1f1b",
      "seq1f1b_splits": 1}, WORLD, "--timeline-path"),
    ({"pipe_sp_splits": 2}, WORLD, "--pipe-sp-splits"),
    ({"seq1f1b_partition": "even", "pipe_sp_strategy": "uniform_comp"}, WORLD,
     "--pipe-sp-strategy"),
    ({"bf16": True, "fp16": True}, WORLD, "--bf16"),
    ({"pipeline_schedule": "no-such-schedule"}, WORLD, "--pipeline-schedule"),
    ({"pipeline_schedule": "interleaved-1f1b"}, WORLD, "--num-layers-per-virtual-pipeline-stage"),
    ({"num_layers_per_virtual_pipeline_stage": 2}, WORLD,
     "--num-layers-per-virtual-pipeline-stage"),
    ({"pipeline_schedule": "seq1f1b-interleaved", "num_layers_per_virtual_pipeline_stage": 3},
     WORLD, "--num-layers-per-virtual-pipeline-stage"),
    ({"pipeline_schedule": "seq1f1b-interleaved", "num_layers_per_virtual_pipeline_stage": 4},
     WORLD, "--num-layers-per-virtual-pipeline-stage"),
    ({"pipeline_schedule": "seq1f1b-interleaved", "num_layers_per_virtual_pipeline_stage": 2,
      "pipeline_model_parallel_size": 1, "num_layers": 4}, 2,
     "--num-layers-per-virtual-pipeline-stage"),
    ({"pipeline_schedule": "megatron-1f1b"}, WORLD, "--seq1f1b-splits"),
    ({"pipeline_schedule": "megatron-1f1b", "seq1f1b_splits": 1,
      "loss_backward_in_forward": True}, WORLD, "--loss-backward-in-forward"),
    ({"pipeline_schedule": "megatron-interleaved-1f1b", "seq1f1b_splits": 1,
      "num_layers_per_virtual_pipeline_stage": 2, "global_batch_size": 12}, WORLD,
     "--global-batch-size"),
    ({"seq_length": 128, "max_position_embeddings": 64}, WORLD, "--max-position-embeddings"),
    ({"lr": 1e-4, "min_lr": 1e-3}, WORLD, "--min-lr"),
    ({"lr_warmup_iters": 10}, WORLD, "--lr-warmup-iters"),
    ({"hidden_dropout": 1.5}, WORLD, "--hidden-dropout"),
    ({"adam_beta2": 1.0}, WORLD, "--adam-beta2"),
    ({"p2p_timeout": 0}, WORLD, "--p2p-timeout"),
    ({"mock_data": None}, WORLD, "--data-path"),
    ({"data_path": "{tmp}/missing_text_document"}, WORLD, "--mock-data"),
    ({"mock_data": None, "data_path": "{tmp}/missing_text_document"}, WORLD, "--data-path"),
    ({"mock_data": None, "data_path": "{tmp}/corrupt"}, WORLD, "--data-path"),
    ({"mock_data": None, "data_path": ["0", "{tmp}/corrupt"]}, WORLD, "--data-path"),
    ({"split": "1,2,3,4"}, WORLD, "--split"),
    ({"split": "0,0,0"}, WORLD, "--split"),
    ({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "{tmp}/vocab.json",
      "merge_file": "{tmp}/merges.txt"}, WORLD, "--vocab-file"),
    ({"tokenizer_type": "HuggingFaceTokenizer"}, WORLD, "--tokenizer-model"),
    ({"vocab_file": "{tmp}/vocab.json"}, WORLD, "--vocab-file"),
    ({"load": "{tmp}/no_checkpoint_here"}, WORLD, "--load"),
    ({"save": "{tmp}/a_file"}, WORLD, "--save"),
    ({"save": None, "save_interval": 5}, WORLD, "--save-interval"),
    ({"tensorboard_dir": "{tmp}/a_file"}, WORLD, "--tensorboard-dir"),
    ({"make_vocab_size_divisible_by": 0}, WORLD, "--make-vocab-size-divisible-by"),
    ({"group_query_attention": True}, WORLD, "--group-query-attention"),
    ({"group_query_attention": True, "num_query_groups": 3}, WORLD, "--num-query-groups"),
    ({"group_query_attention": True, "num_query_groups": 1}, WORLD, "--num-query-groups"),  # TP 2
    ({"num_query_groups": 2}, WORLD, "--num-query-groups"),
    ({"position_embedding_type": "learned_absolute", "rotary_base": 500000}, WORLD,
     "--rotary-base"),
    ({"position_embedding_type": "learned_absolute", "use_rope_scaling": True}, WORLD,
     "--use-rope-scaling"),
    ({"rotary_percent": 1.5}, WORLD, "--rotary-percent"),
    ({"norm_epsilon": 0}, WORLD, "--norm-epsilon"),
    ({"swiglu": True, "hidden_size": 32}, WORLD, "--swiglu"),
    ({"reset_attention_mask": True, "attention_backend": "te"}, WORLD, "--reset-attention-mask"),
    ({"attention_backend": "flash"}, WORLD, "--attention-backend flash"),     # no GPU, no package
    ({"attention_backend": "te"}, WORLD, "--attention-backend te"),
    ({"attention_backend": "fused"}, WORLD, "--attention-backend fused"),
    ({"attention_backend": "flex"}, WORLD, "--attention-dropout 0"),           # default dropout 0.1
    ({"attention_backend": "flex", "attention_dropout": 0}, WORLD, "--attention-backend flex"),
    ({"pipeline_schedule": "seq1f1b-interleaved", "num_layers_per_virtual_pipeline_stage": 2,
      "global_batch_size": 12}, WORLD, "--global-batch-size"),   # 3 micro-batches over PP 2
    ({"save": "/proc/self/checkpoints"}, WORLD, "--save"),          # not writable, even by root
    ({"tensorboard_dir": "/proc/self/tb"}, WORLD, "--tensorboard-dir"),
    ({"data_cache_path": "/proc/self/cache"}, WORLD, "--data-cache-path"),
    ({"kv_channels": 8}, WORLD, "--kv-channels 8"),
    ({"overlap_grad_reduce": True, "overlap_param_gather": True}, WORLD,
     "--use-distributed-optimizer"),
    ({"use_distributed_optimizer": True, "overlap_param_gather": True}, WORLD,
     "--overlap-grad-reduce"),
    ({"wandb_exp_name": "run"}, WORLD, "--wandb-project"),
    ({"profile": True}, WORLD, "--tensorboard-dir"),
    ({"profile": True, "tensorboard_dir": "{tmp}/tb", "profile_step_start": 4,
      "profile_step_end": 4}, WORLD, "--profile-step-end"),
    ({"profile": True, "tensorboard_dir": "{tmp}/tb", "profile_step_start": -1}, WORLD,
     "--profile-step-start"),
    ({"profile": True, "tensorboard_dir": "{tmp}/tb", "profile_ranks": [0, 8]}, WORLD,
     "--profile-ranks 8"),
    # context parallelism: the ring and Megatron's other comm types named with a2a, an unknown
    # one, a world C does not fit, heads C cannot shard, spans C does not divide
    ({"context_parallel_size": 2, "cp_comm_type": "p2p"}, WORLD, "a2a"),
    ({"context_parallel_size": 2, "cp_comm_type": "all_gather"}, WORLD, "--cp-comm-type"),
    ({"context_parallel_size": 2, "cp_comm_type": "ring"}, WORLD, "--cp-comm-type 'ring'"),
    ({"context_parallel_size": 3}, WORLD, "--context-parallel-size 3"),
    ({"context_parallel_size": 4}, 16, "--context-parallel-size 4 must divide the attention"),
    ({"context_parallel_size": 2, "group_query_attention": True, "num_query_groups": 6,
      "num_attention_heads": 12, "hidden_size": 96}, WORLD,
     "--context-parallel-size 2: the K/V groups"),
    ({"context_parallel_size": 0}, WORLD, "--context-parallel-size"),
    ({"context_parallel_size": 2, "seq1f1b_span_lengths": [15, 17, 16, 16]}, WORLD,
     "--seq1f1b-span-lengths 15 17 16 16"),
    ({"context_parallel_size": 2, "sequence_parallel": True, "seq_length": 66}, WORLD,
     "--seq-length 66"),
    ({"context_parallel_size": 2, "pipeline_schedule": "megatron-1f1b", "seq1f1b_splits": None},
     WORLD, "--pipeline-schedule megatron-1f1b"),
    # NaN passes every comparison and infinity an open upper end: both reached the ranks
    ({"lr": "nan"}, WORLD, "--lr must be a finite"),
    ({"hidden_dropout": "nan"}, WORLD, "--hidden-dropout"),
    ({"p2p_timeout": "inf"}, WORLD, "--p2p-timeout"),
    ({"seed": -1}, WORLD, "--seed"),
    ({"seed": 2**32 - 1}, WORLD, "--seed"),            # stage 1 seeds 100 more than numpy takes
    ({"pipeline_schedule": ""}, WORLD, "--pipeline-schedule"),
    ({"decoupled_lr": 1e-3, "decoupled_min_lr": 1e-2}, WORLD, "--decoupled-min-lr"),
    ({"cp_comm_type": "bogus"}, WORLD, "--cp-comm-type"),
    ({"bf16": True, "grad_reduce_in_bf16": True, "accumulate_allreduce_grads_in_fp32": True},
     WORLD, "--accumulate-allreduce-grads-in-fp32"),
]


def _fill(value, tmp_path):
    if isinstance(value, list):
        return [_fill(v, tmp_path) for v in value]
    return value.replace("{tmp}", str(tmp_path)) if isinstance(value, str) else value


@pytest.mark.parametrize("changes, world, flag", BAD,
                         ids=[f"{i}:{flag}" for i, (_, _, flag) in enumerate(BAD)])
def test_bad_flags_are_rejected_with_one_line_naming_the_flag(tmp_path, changes, world, flag):
    _data_files(tmp_path)
    before = sorted(os.listdir(tmp_path))
    flags = _with(tmp_path, **{k: _fill(v, tmp_path) for k, v in changes.items()})
    with pytest.raises(ArgumentError) as err:
        validate_args(parse_args(_argv(flags)), world)
    message = str(err.value)
    assert flag in message and "\n" not in message, message
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no --save dir created


def test_the_table_is_big_enough():
    assert len(BAD) >= 20 and len({flag for _, _, flag in BAD}) >= 20


def test_base_is_valid_and_derives_megatrons_values(tmp_path):
    args = validate_args(parse_args(_argv(_base(tmp_path))), WORLD)
    assert (args.data_parallel_size, args.num_micro_batches) == (2, 2)
    assert (args.ffn_hidden_size, args.max_position_embeddings) == (256, 64)
    assert (args.seq1f1b_splits, args.seq1f1b_partition) == (4, "even")
    assert args.virtual_pipeline_model_parallel_size is None
    assert args.padded_vocab_size % (128 * 2) == 0 and args.padded_vocab_size >= 258
    assert args.lr_decay_iters == 10 and args.params_dtype == "float32"
    assert not os.path.exists(args.save)
    assert ScheduleConfig.from_args(args) == ScheduleConfig(
        name="seq1f1b", pipeline_parallel_size=2, num_micro_batches=2, splits=4, chunks=1,
        partition="even", span_lengths=None, seq_length=64)


def test_llama_flags_derive_megatrons_values(tmp_path):
    flags = _with(tmp_path, hidden_size=4096, num_attention_heads=32, swiglu=True,
                  group_query_attention=True, num_query_groups=8, normalization="RMSNorm",
                  disable_bias_linear=True, position_embedding_type="rope", rotary_base=500000)
    args = validate_args(parse_args(_argv(flags)), WORLD)
    assert args.ffn_hidden_size == 10880          # Megatron-LM's SwiGLU default for h = 4096
    from seq1f1b.megatron_adapter import Architecture
    assert Architecture.from_args(args) == Architecture(
        num_query_groups=8, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
        rotary_base=500000)


def test_interleaving_and_global_batch_default(tmp_path):
    flags = _with(tmp_path, pipeline_schedule="seq1f1b-interleaved",
                  num_layers_per_virtual_pipeline_stage=2, bf16=True)
    args = validate_args(parse_args(_argv(flags)), WORLD)
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.num_micro_batches == 2 and args.params_dtype == "bfloat16"
    # the default global batch is one micro-batch per DP rank, which interleaving refuses
    args = validate_args(parse_args(_argv(_with(tmp_path, global_batch_size=None))), WORLD)
    assert (args.global_batch_size, args.num_micro_batches) == (4, 1)


def test_fit_partition_and_timeline_defaults(tmp_path):
    """Two calibrating iterations; the timeline draws the last iteration, its folder made only
    when it is drawn."""
    timeline = tmp_path / "new" / "timeline.png"
    args = validate_args(parse_args(_argv(_with(tmp_path, seq1f1b_partition="fit",
                                                timeline_path=str(timeline)))), WORLD)
    assert (args.seq1f1b_partition, args.seq1f1b_fit_iterations) == ("fit", 2)
    assert args.timeline_iteration == 10 and not timeline.parent.exists()
    args = validate_args(parse_args(_argv(_base(tmp_path))), WORLD)
    assert (args.seq1f1b_fit_iterations, args.timeline_path, args.timeline_iteration) == \
        (None, None, None)


def test_reference_fork_aliases_fold_into_seq1f1b_flags(tmp_path):
    flags = _with(tmp_path, seq1f1b_splits=None, pipe_sp_splits=8, pipe_sp_strategy="uniform_comp")
    args = validate_args(parse_args(_argv(flags)), WORLD)
    assert (args.seq1f1b_splits, args.seq1f1b_partition) == (8, "compute")
    assert not hasattr(args, "pipe_sp_splits") and not hasattr(args, "pipe_sp_strategy")
    flags = _with(tmp_path, pipe_sp_splits=4, pipe_sp_strategy="average")
    args = validate_args(parse_args(_argv(flags)), WORLD)
    assert (args.seq1f1b_splits, args.seq1f1b_partition) == (4, "even")


def test_span_lengths_imply_an_explicit_partition(tmp_path):
    flags = _with(tmp_path, seq1f1b_splits=None, sequence_parallel=True,
                  seq1f1b_span_lengths=[24, 20, 12, 8])
    args = validate_args(parse_args(_argv(flags)), WORLD)
    assert (args.seq1f1b_splits, args.seq1f1b_partition) == (4, "explicit")
    assert ScheduleConfig.from_args(args).span_lengths == (24, 20, 12, 8)


@pytest.mark.parametrize("argv, flag", [
    (["--seq1f1b-partition", "bogus"], "--seq1f1b-partition"),
    (["--micro-batch-size", "two"], "--micro-batch-size"),
    (["--pipe-sp-strategy", "fastest"], "--pipe-sp-strategy"),
    (["--attention-backend", "cudnn"], "--attention-backend"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--timing-log-level", "3"], "--timing-log-level"),
    (["--timing-log-option", "mean"], "--timing-log-option"),
])
def test_parse_errors_are_one_line_exit_2(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and flag in err and "\n" not in err, err


def test_cli_form_prints_one_line_and_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate_args(_argv(_with(tmp_path, num_layers=7)), WORLD)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "--num-layers" in err and "\n" not in err


def test_catalog_reads_the_registry_lazily_and_falls_back(monkeypatch):
    monkeypatch.undo()  # the real schedule_catalog, not the fixed one
    from seq1f1b.plan import registry
    catalog = schedule_catalog()
    for name in registry.names():
        info = registry.get(name)
        assert catalog[name] == (None if info.any_chunks else info.chunked)
    assert catalog["seq1f1b-zb-auto"] is None      # one chunk per rank or two, as laid out
    assert all(catalog[name] == chunked for name, chunked in MEGATRON_SCHEDULES.items())
    monkeypatch.setattr(registry, "names", lambda: [])
    assert schedule_catalog() == MEGATRON_SCHEDULES


def test_wandb_is_refused_without_the_package(tmp_path, monkeypatch):
    real = arguments.importlib.util.find_spec
    monkeypatch.setattr(arguments.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    flags = _with(tmp_path, wandb_project="proj", wandb_exp_name="run")
    with pytest.raises(ArgumentError, match=r"^--wandb-project needs the wandb package"):
        validate_args(parse_args(_argv(flags)), WORLD)


def test_wandb_with_the_package_needs_a_run_name(tmp_path, monkeypatch):
    monkeypatch.setattr(arguments.importlib.util, "find_spec", lambda name, *a: object())
    flags = _with(tmp_path, wandb_project="proj")
    with pytest.raises(ArgumentError, match=r"^--wandb-exp-name is required with --wandb-project"):
        validate_args(parse_args(_argv(flags)), WORLD)
    args = validate_args(parse_args(_argv(_with(tmp_path, wandb_project="proj",
                                                wandb_exp_name="run"))), WORLD)
    assert (args.wandb_project, args.wandb_exp_name) == ("proj", "run")


def test_memory_history_is_refused_without_a_gpu(tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flags = _with(tmp_path, record_memory_history=True)
    with pytest.raises(ArgumentError, match=r"^--record-memory-history .*GPU only"):
        validate_args(parse_args(_argv(flags)), WORLD)


def test_observability_and_overlap_defaults_are_megatrons(tmp_path):
    args = validate_args(parse_args(_argv(_base(tmp_path))), WORLD)
    assert (args.overlap_grad_reduce, args.overlap_param_gather, args.align_param_gather) == \
        (False, False, True)
    assert (args.profile, args.profile_step_start, args.profile_step_end, args.profile_ranks) \
        == (False, 10, 12, [0])
    assert (args.timing_log_level, args.timing_log_option, args.barrier_with_L1_time) == \
        (0, "minmax", True)
    assert (args.record_memory_history, args.memory_snapshot_path) == (False, "snapshot.pickle")


V_SCHEDULES = {"zbv": True, "seq1f1b-zbv": True, "seq1f1b-zb-auto": None}


def _assert_refused_in_one_line(tmp_path, capsys, flags: dict, changes: dict, flag: str) -> None:
    """`flags` with `changes` (keys: flag names with _ for -) stop validation with one line on
    stderr naming `flag`, exit code 2, and nothing written."""
    flags = {**flags, **{"--" + key.replace("_", "-"): value for key, value in changes.items()}}
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate_args(_argv(flags), WORLD)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and flag in err, err
    assert "\n" not in err and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("changes, flag", [
    (dict(num_layers_per_virtual_pipeline_stage=1), "--num-layers-per-virtual-pipeline-stage"),
    (dict(pipeline_schedule="seq1f1b-zbv", schedule_memory_cap="1x"), "--schedule-memory-cap"),
    (dict(schedule_memory_cap="half"), "--schedule-memory-cap"),
    (dict(schedule_memory_cap="0.01x"), "--schedule-memory-cap"),   # no order fits it
])
def test_v_placement_flags_are_refused_in_one_line(tmp_path, capsys, monkeypatch, changes, flag):
    """A V runs two chunks per rank; a memory cap is for the
    searched schedule only, readable, and one some order fits (placed before any work)."""
    monkeypatch.setattr(arguments, "schedule_catalog", lambda: {**CATALOG, **V_SCHEDULES})
    flags = _with(tmp_path, pipeline_schedule="seq1f1b-zb-auto",
                  num_layers_per_virtual_pipeline_stage=2, untie_embeddings_and_output_weights=True)
    _assert_refused_in_one_line(tmp_path, capsys, flags, changes, flag)


@pytest.mark.parametrize("changes, flag", [
    (dict(pipeline_schedule="seq1f1b"), "--spread-output: --pipeline-schedule seq1f1b is not"),
    (dict(loss_backward_in_forward=True), "--loss-backward-in-forward with --spread-output"),
])
def test_spread_output_flags_are_refused_in_one_line(tmp_path, capsys, monkeypatch, changes,
                                                     flag):
    """--spread-output: the searched schedule's option, not with the loss's backward at F (an
    O runs it at once)."""
    monkeypatch.setattr(arguments, "schedule_catalog", lambda: {**CATALOG, **V_SCHEDULES})
    flags = _with(tmp_path, pipeline_schedule="seq1f1b-zb-auto", spread_output=True,
                  untie_embeddings_and_output_weights=True)
    _assert_refused_in_one_line(tmp_path, capsys, flags, changes, flag)


@pytest.mark.parametrize("changes, flag", [
    (dict(pipeline_schedule="seq1f1b-interleaved"),
     "--search-layout: --pipeline-schedule seq1f1b-interleaved is not searched"),
    (dict(num_layers_per_virtual_pipeline_stage=None),
     "--search-layout chooses the layers of the 2P stages of two chunks per rank"),
    (dict(decoder_first_pipeline_num_layers=1),
     "--search-layout chooses every stage's layers: drop --decoder-first-pipeline-num-layers"),
])
def test_search_layout_flags_are_refused_in_one_line(tmp_path, capsys, monkeypatch, changes,
                                                     flag):
    """--search-layout: the searched schedule's, on two chunks per rank, choosing every stage's
    layers itself (trainer-level: tests/distributed/test_training.py trains what it keeps)."""
    monkeypatch.setattr(arguments, "schedule_catalog", lambda: {**CATALOG, **V_SCHEDULES})
    flags = _with(tmp_path, pipeline_schedule="seq1f1b-zb-auto", search_layout=True,
                  num_layers_per_virtual_pipeline_stage=2)
    _assert_refused_in_one_line(tmp_path, capsys, flags, changes, flag)


def test_the_searched_schedule_chooses_its_placement_at_validation(tmp_path, monkeypatch,
                                                                     capsys):
    """seq1f1b-zb-auto runs on the model's layout: one chunk per rank (a loop), or two (a V or a
    loop, whichever simulates shorter, tied embeddings or not); args.pipeline_placement holds
    the choice and the last rank says it in a line, with how far the order is above the lower
    bound (never below it)."""
    monkeypatch.setattr(arguments, "schedule_catalog", lambda: {**CATALOG, **V_SCHEDULES})
    monkeypatch.setenv("RANK", str(WORLD - 1))
    for changes, chunks, placements in (
            (dict(), None, ("loop",)),
            (dict(num_layers_per_virtual_pipeline_stage=2), 2, ("loop", "vshape")),
            (dict(num_layers_per_virtual_pipeline_stage=2,
                  untie_embeddings_and_output_weights=True), 2, ("loop", "vshape"))):
        args = validate_args(parse_args(_argv(_with(
            tmp_path, pipeline_schedule="seq1f1b-zb-auto", **changes))), WORLD)
        assert args.virtual_pipeline_model_parallel_size == chunks
        assert args.pipeline_placement in placements
        said = capsys.readouterr().out.splitlines()
        assert said[-1].startswith(" seq1f1b-zb-auto: placed on a "), said
        gap = re.search(r" on the model's FLOPs \((\d+\.\d)% above the lower bound\), peak held ",
                        said[-1])
        assert gap and float(gap[1]) >= 0, said[-1]
    args = validate_args(parse_args(_argv(_with(tmp_path, pipeline_schedule="zbv",
                                                num_layers_per_virtual_pipeline_stage=2,
                                                untie_embeddings_and_output_weights=True))),
                         WORLD)
    assert args.pipeline_placement == "vshape"
    args = validate_args(parse_args(_argv(_with(tmp_path, pipeline_schedule="seq1f1b"))), WORLD)
    assert args.pipeline_placement == "loop"


def test_v_placements_and_a_searched_schedules_cap_are_accepted(tmp_path, monkeypatch):
    monkeypatch.setattr(arguments, "schedule_catalog", lambda: {**CATALOG, **V_SCHEDULES})
    for name, cap in (("zbv", None), ("seq1f1b-zbv", None), ("seq1f1b-zb-auto", "0.75x")):
        args = validate_args(parse_args(_argv(_with(
            tmp_path, pipeline_schedule=name, num_layers_per_virtual_pipeline_stage=2,
            untie_embeddings_and_output_weights=True, schedule_memory_cap=cap))), WORLD)
        assert args.virtual_pipeline_model_parallel_size == 2
        assert args.schedule_memory_cap == cap
