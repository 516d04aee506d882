"""Command-line flags of the training harness, with Megatron-LM's names, defaults and meanings.

`parse_args(argv)` only parses; `validate_args(args, world_size)` fills in what Megatron derives
(DP size, micro-batches per step, virtual stages, padded vocabulary, ...) and rejects every bad
combination with an `ArgumentError` whose message is one line naming the flag. It reads files
(tokenizer, .idx headers, the tracker and, when resuming, the common state of the checkpoint it
starts from) but writes nothing, so a rejected run leaves no trace.
`parse_and_validate_args` is the CLI form: the message on stderr and exit code 2.

The flags are grouped as Megatron-LM groups them (_add_network_size_args,
_add_regularization_args, _add_training_args, ... in its megatron/training/arguments.py), so
--help reads in the order its users know; Seq1F1B's own schedule flags have a group of their
own, and megatron_lm_flags holds the rest of Megatron-LM's (accepted without effect, or refused).

Schedule names are read lazily from `seq1f1b.plan.registry` (plus megatron-core's own schedules).
This module does not import megatron-core (~4 s), so a bad flag is reported at once; only a
resume imports torch and megatron-core, last, to read how its checkpoint was saved (its LR
schedule, `checkpoint_common.read_common_state`, and its layout record, `checkpoint_resharding`).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import signal
import sys
from dataclasses import dataclass
from typing import NoReturn, Optional, Sequence

from megatron.training import checkpoint_model, lr_schedule, megatron_lm_flags
from megatron.training.checkpoint_common import read_common_state, starting_point
from megatron.training.data import DataConfig, check_data_config, check_token_ids, parse_split
from megatron.training.tokenizer import add_tokenizer_args, build_tokenizer, unread_flag_error
from seq1f1b import checkpoint_layout, writable
from seq1f1b.model_flags import (LOSS_BACKWARD_IN_FORWARD_HELP, SHAPE_FLAGS,
                                 SPREAD_OUTPUT_HELP, add_model_shape_args,
                                 default_ffn_hidden_size, kv_channels_error, query_groups_error,
                                 swiglu_ffn_error)

MEGATRON_SCHEDULES = {"megatron-1f1b": False, "megatron-interleaved-1f1b": True}
MEGATRON_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")   # megatron's --cp-comm-type
"""megatron-core's unmodified schedules (full sequences): name -> interleaves model chunks."""
DEFAULT_SCHEDULE = "seq1f1b"
PARTITIONS = ("even", "compute", "fit", "explicit")   # what seq1f1b.plan.partition implements
DEFAULT_FIT_ITERATIONS = 2
PIPE_SP_STRATEGIES = {"average": "even", "uniform_comp": "compute"}  # reference fork's names
ATTENTION_BACKENDS = ("auto", "eager", "sdpa", "flex", "flash", "te", "local", "unfused", "fused")
MEGATRON_BACKENDS = {"local": "eager", "unfused": "eager", "fused": "te"}
"""Megatron-LM's --attention-backend names and ours for them: megatron-core's local attention and
TE's unfused one are the plain softmax(QK^T)V (eager), TE's fused attention is te."""
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
TRANSFORMER_IMPLS = ("local", "transformer_engine", "inference_optimized")
CKPT_FORMATS = ("torch_dist", "torch", "zarr", "torch_dcp", "fsdp_dtensor")


class ArgumentError(ValueError):
    """A bad flag or flag combination; the message is one line and names the flag."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a parse error is one line on stderr (no usage block) and exit code 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def schedule_catalog() -> dict[str, Optional[bool]]:
    """Every accepted --pipeline-schedule: name -> whether it interleaves V >= 2 chunks per rank
    (None: it runs on one chunk per rank or two, as the flags lay the model out).

    Read at call time, so schedules registered after this module was imported are included; when
    the registry is missing or empty, megatron-core's own schedules remain.
    """
    catalog: dict[str, Optional[bool]] = {}
    try:
        from seq1f1b.plan import registry
    except ImportError:
        registry = None
    if registry is not None:
        catalog.update((name, None if registry.get(name).any_chunks else registry.get(name).chunked)
                       for name in registry.names())
    for name, chunked in MEGATRON_SCHEDULES.items():
        catalog.setdefault(name, chunked)
    return catalog


def _placement(name: str, chunks: Optional[int] = None) -> str:
    """How schedule `name` maps (rank, chunk) to virtual stages ("loop" without the registry);
    a searched one's own placement at V = `chunks` (it may choose another: _place_schedule)."""
    try:
        from seq1f1b.plan import registry
    except ImportError:
        return "loop"
    info = registry.get(name)
    if info.searched and (chunks or 1) == 1:
        return "loop"
    return info.placement


def _searched(name: str) -> bool:
    from megatron.training.schedule_budget import searched

    return searched(name)


EXIT_SIGNALS = tuple(sorted(s.name for s in signal.valid_signals()
                            if isinstance(s, signal.Signals)
                            and s not in (signal.SIGKILL, signal.SIGSTOP)))
"""What --exit-signal accepts: the catchable signals, by name (Megatron-LM's choices)."""


def _add_network_size_args(parser: ArgumentParser) -> None:
    """The model's shape (seq1f1b.model_flags: every tool that takes a model shares it; only
    --seq-length sits with the data, as in Megatron-LM) and the vocabulary's padding."""
    g = parser.add_argument_group("network size")
    add_model_shape_args(g, tuple(name for name in SHAPE_FLAGS if name != "seq_length"))
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")


def _add_regularization_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="grad-norm clip (0: off)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)


def _add_training_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, help="samples per micro-batch (required)")
    g.add_argument("--global-batch-size", type=int,
                   help="samples per iteration over all DP ranks (default: micro x DP)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="selective recompute (= --recompute-granularity selective)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"],
                   help="activation recompute: whole layers (full) or core attention "
                        "(selective); exact with spans")
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="full recompute: checkpoint groups of --recompute-num-layers layers "
                        "(uniform) or the first --recompute-num-layers layers of a stage (block)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per recompute group (uniform) or recomputed per stage (block)")
    g.add_argument("--train-iters", type=int,
                   help="iterations to train (required, or --train-samples)")
    g.add_argument("--train-samples", type=int,
                   help="samples to train instead of --train-iters (iterations = samples // "
                        "global batch); the LR schedule is then counted in samples")
    g.add_argument("--skip-train", action="store_true",
                   help="do not train: load the checkpoint (weights only, as --no-load-optim), "
                        "evaluate on the validation and test splits from their start, and exit")
    g.add_argument("--exit-interval", type=int,
                   help="save (with --save) and stop once the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float,
                   help="after this many minutes from the start, finish the iteration, save "
                        "(with --save) and exit with code 0")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal (on any rank), finish the iteration, save (with --save) "
                        "and exit with code 0")
    g.add_argument("--exit-signal", choices=EXIT_SIGNALS, metavar="SIGNAL",
                   help="the signal --exit-signal-handler catches (default: SIGTERM)")
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler chrome traces of iterations [--profile-step-start, "
                        "--profile-step-end) into --tensorboard-dir, one per profiled rank, "
                        "with the executor's actions named")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="accepted for Megatron-LM command lines: --profile always uses "
                        "torch.profiler here")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="first profiled iteration, counted from this run's start")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="iteration where profiling stops (exclusive)")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], metavar="RANK",
                   help="global ranks to profile (default: 0)")
    g.add_argument("--record-memory-history", action="store_true",
                   help="record the CUDA caching allocator's history; the last rank dumps a "
                        "snapshot to --memory-snapshot-path at each log line (GPU only)")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle",
                   help="where --record-memory-history dumps (default: snapshot.pickle)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="do not stop at a NaN or inf loss or gradient norm (by default the run "
                        "stops, naming the iteration, the stage and the micro-batch)")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's garbage collector off for the run and collect at the same "
                        "points on every rank: at the start, every --manual-gc-interval "
                        "iterations and around each evaluation (a rank collecting on its own is "
                        "a straggler the pipeline waits for)")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc, collect after every this many iterations (default 0: "
                        "never between iterations)")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", dest="manual_gc_eval",
                   action="store_false",
                   help="with --manual-gc, do not collect around evaluations")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="return the CUDA caching allocator's unused blocks to the device: 1 "
                        "after each iteration's forward-backward and each evaluation step, 2 "
                        "also after each optimizer step (default 0: never; slower, less "
                        "fragmented; nothing on a CPU)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="gradient of the global batch's token mean (default: mean over "
                        "micro-batches of each one's token mean, as Megatron)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false",
                   help="compute each weight gradient into a fresh tensor that DDP then adds to "
                        "main_grad (by default the GEMM accumulates into main_grad: "
                        "fused_weight_gradient_mlp_cuda on a GPU, addmm_ on the CPU)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="core attention kernel of the span-aware attention; Megatron-LM's "
                        "local and unfused run eager, fused runs te")
    g.add_argument("--transformer-impl", default="local", choices=TRANSFORMER_IMPLS,
                   help="the layers: megatron-core's local ones (Transformer Engine's are not "
                        "supported; Megatron-LM's default is transformer_engine)")


def _add_initialization_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("initialization")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--init-method-std", type=float, default=0.02)


def _add_learning_rate_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, help="peak learning rate (required)")
    g.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES)
    g.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=int,
                   help="with --train-samples: samples to decay over (default: --train-samples)")
    g.add_argument("--lr-warmup-fraction", type=float,
                   help="warm-up as a fraction of the decay horizon (instead of --lr-warmup-iters"
                        " / --lr-warmup-samples)")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="with --train-samples: warm-up samples")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="the learning rate warm-up starts from")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, the LR schedule of the flags replaces the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, keep the checkpoint's LR schedule over the flags'")
    g.add_argument("--decoupled-lr", type=float,
                   help="a separate peak LR for the input embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=float,
                   help="a separate minimum LR for them (with --decoupled-lr)")


def _add_checkpointing_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", help="checkpoint directory to write")
    g.add_argument("--save-interval", type=int, help="iterations between checkpoints")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background with megatron-core's async save "
                        "(a forked writer per rank; torch_dist only): training goes on, the "
                        "checkpoint is published (renamed, tracker updated) once every rank "
                        "finished writing, checked each iteration and forced before the next "
                        "save and at exit")
    g.add_argument("--no-save-optim", action="store_true",
                   help="leave the optimizer state and LR schedule out of checkpoints (loading "
                        "one then needs --no-load-optim or --finetune)")
    g.add_argument("--no-save-rng", action="store_true",
                   help="leave the RNG states out of checkpoints (a resume then starts the RNGs "
                        "from --seed)")
    g.add_argument("--load", help="checkpoint directory to resume from")
    g.add_argument("--no-load-optim", action="store_true",
                   help="do not load the optimizer state and LR schedule of --load")
    g.add_argument("--no-load-rng", action="store_true",
                   help="do not load the RNG states of --load")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="stop (one line) when --load holds no checkpoint, instead of starting "
                        "from iteration 0")
    g.add_argument("--finetune", action="store_true",
                   help="load only the model weights of --load; start at iteration 0 with a fresh "
                        "optimizer, LR schedule, data position and RNG")
    g.add_argument("--pretrained-checkpoint",
                   help="fine-tune from this checkpoint directory when --load holds no "
                        "checkpoint (as --finetune); once the run has saved into --load, "
                        "requeues resume from there")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model flags from the checkpoint the run starts from (its "
                        "args, or a release's config.json), as Megatron-LM: the sizes where not "
                        "given, the rest forced; a RoPE base or scaling given here stays (a "
                        "context extension)")
    g.add_argument("--ckpt-format", default="torch_dist", choices=CKPT_FORMATS,
                   help="checkpoint format: torch_dist (megatron-core's dist_checkpointing) is "
                        "the one written and read here")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="save the distributed optimizer's state per parameter, so that the "
                        "checkpoint resumes at another TP, PP or V (saving gathers it over DP; "
                        "default: megatron's dp_reshardable format, which reshards over DP only)")


def _add_mixed_precision_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients over data parallelism in bf16 (default: fp32)")
    g.add_argument("--loss-scale", type=float,
                   help="with --fp16: a static loss scale (default: dynamic scaling)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32,
                   help="with --fp16: the dynamic loss scale's start")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="with --fp16: the dynamic loss scale's floor")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="with --fp16: iterations without overflow before the scale grows")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="with --fp16: overflows tolerated before the scale shrinks")


def _add_distributed_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, metavar="N",
                   help="uneven first stage: its decoder layers; the other stages share the "
                        "rest evenly (megatron-core's num_layers_in_first_pipeline_stage: of "
                        "pipeline rank 0, over its chunks; on a V, of virtual stage 0, the "
                        "embedding's chunk of rank 0)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, metavar="N",
                   help="uneven last stage: its decoder layers (megatron-core's "
                        "num_layers_in_last_pipeline_stage: of the last pipeline rank; on a V, "
                        "of virtual stage 2P-1, the output layer's chunk of rank 0)")
    g.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT",
                   help="every virtual stage's layers in megatron's string form, stages in the "
                        "order data flows (a V: stage 2P-1 is rank 0's chunk 1), e.g. "
                        "'Et*3|t*5|t*5|t*3L'; its stage count gives the chunks per rank "
                        "(seq1f1b/plan/stage_layers.py)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="layers per model chunk; chunks per rank V = layers / (PP x this)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce each gradient bucket over data parallelism as soon as its last "
                        "gradient of the iteration is in (at W for the zero-bubble schedules' "
                        "weights), overlapped with the rest of the backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="gather the updated parameters (--use-distributed-optimizer) during "
                        "the next forward instead of after the optimizer step")
    g.add_argument("--no-align-param-gather", dest="align_param_gather", action="store_false",
                   help="with --overlap-param-gather: each bucket's gather starts at its first "
                        "forward, not the whole chunk's ahead of it")
    g.add_argument("--distributed-timeout-minutes", type=int,
                   help="Megatron-LM's process-group timeout in minutes: sets --p2p-timeout")
    g.add_argument("--p2p-timeout", type=float, default=600.0,
                   help="seconds a pipeline send/receive, or any collective (the process "
                        "groups' timeout, which NCCL's watchdog enforces), may wait before the "
                        "run fails")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over data-parallel ranks")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="shard norms/dropout activations along the sequence over TP")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context parallelism C: each span's tokens split over C ranks, an "
                        "all-to-all around core attention (span schedules)")
    g.add_argument("--cp-comm-type", default="a2a",
                   help="context-parallel communication: a2a (Ulysses, the only one span "
                        "schedules run; Megatron's p2p ring, all_gather and a2a+p2p are refused)")


def _add_pipeline_schedule_args(parser: ArgumentParser) -> None:
    """Seq1F1B's own flags: the schedule, its spans and the reference fork's aliases (no
    Megatron-LM group holds them)."""
    g = parser.add_argument_group("pipeline schedule (Seq1F1B)")
    g.add_argument("--pipeline-schedule",
                   help="a registered schedule name (seq1f1b.plan.registry), or megatron-1f1b / "
                        f"megatron-interleaved-1f1b (default: {DEFAULT_SCHEDULE})")
    g.add_argument("--pipeline-schedule-file", metavar="FILE.csv",
                   help="run the schedule in this file instead (one row per pipeline rank, "
                        "actions like F0.1, B0.1@1, W0.1; '# placement: vshape' first for a V; "
                        "seq1f1b/plan/schedule_file.py): its P, micro-batches, k and V must be "
                        "the run's; checked, also under NCCL's rules, before any work")
    g.add_argument("--seq1f1b-splits", type=int,
                   help="k: spans each sequence is cut into (default: 1)")
    g.add_argument("--seq1f1b-partition", choices=PARTITIONS,
                   help="where the span boundaries go: even lengths, compute (equal FLOPs by "
                        "the cost model), fit (equal time as measured over the run's first "
                        "--seq1f1b-fit-iterations iterations, which run the compute cut), or "
                        "explicit (--seq1f1b-span-lengths) (default: even)")
    g.add_argument("--seq1f1b-fit-iterations", type=int, metavar="N",
                   help="with --seq1f1b-partition fit: the first N iterations of the run (a "
                        "resumed run's too) are traced and the spans are fitted to their times "
                        f"(default: {DEFAULT_FIT_ITERATIONS})")
    g.add_argument("--seq1f1b-span-lengths", type=int, nargs="+", metavar="L",
                   help="explicit span lengths L1 ... Lk (sum = --seq-length)")
    g.add_argument("--seq1f1b-span-alignment", type=int, metavar="N",
                   help="every span a multiple of N tokens: the even, compute and fit cuts "
                        "round to it, explicit lengths must be (with --sequence-parallel also a "
                        "multiple of the TP size, with context parallelism of CP: their lcm); "
                        "GPU kernels run multiples of 64 or 128 best (default: 1)")
    g.add_argument("--schedule-memory-cap", metavar="CAP",
                   help="searched schedules (seq1f1b-zb-auto): per-rank cap on held activations "
                        "and K/V, bytes (e.g. 17GiB) or a fraction of 1F1B's rank-0 peak (e.g. "
                        "0.5x); the schedule is placed with this model's FLOP and byte costs "
                        "(with --seq1f1b-partition fit: re-placed with the measured times once "
                        "the fit is in) (default: the schedule's own budget)")
    g.add_argument("--loss-backward-in-forward", action="store_true",
                   help=LOSS_BACKWARD_IN_FORWARD_HELP)
    g.add_argument("--spread-output", action="store_true", help=SPREAD_OUTPUT_HELP)
    g.add_argument("--search-layout", action="store_true",
                   help="seq1f1b-zb-auto on two chunks per rank: also choose every virtual "
                        "stage's decoder layers (a --pipeline-model-parallel-layout) with the "
                        "schedule, as plan.py search --search-layout does, under the cap the "
                        "even split's search placed under; the last rank says which it kept")
    g.add_argument("--pipe-sp-splits", type=int, help="alias of --seq1f1b-splits")
    g.add_argument("--pipe-sp-strategy", choices=tuple(PIPE_SP_STRATEGIES),
                   help="alias of --seq1f1b-partition: average = even, uniform_comp = compute")


def _add_validation_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="global batches per evaluation (0: no evaluation)")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="iterations between evaluations on the validation split")


def _add_data_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("data and dataloader")
    g.add_argument("--data-path", nargs="+",
                   help="dataset prefixes, or WEIGHT PREFIX pairs to blend")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights")
    g.add_argument("--data-cache-path", help="where megatron-core caches sample indices")
    g.add_argument("--mock-data", action="store_true", help="synthetic data, no files")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read the .bin files without memory-mapping them")
    add_model_shape_args(g, ("seq_length",))
    g.add_argument("--reset-position-ids", action="store_true",
                   help="packed documents: positions restart at 0 after each EOD")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="packed documents: a token attends only to its own document (exact "
                        "across spans; every pipeline stage then reads the data)")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on EOD tokens")


def _add_tokenizer_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("tokenizer")
    add_tokenizer_args(g)


def _add_logging_args(parser: ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-params-norm", action="store_true",
                   help="add Megatron-LM's 'params norm' field: the L2 norm of the parameters")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="add Megatron-LM's 'num zeros' field: the zero gradient entries the "
                        "optimizer counted")
    g.add_argument("--log-throughput", action="store_true",
                   help="add Megatron-LM's 'throughput per GPU (TFLOP/s/GPU)' field to the log "
                        "line (by the paper's FLOP count, as TFLOPS/GPU)")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="megatron timers printed after each log line: 0 none, 1 forward-"
                        "backward, grad sync and optimizer, 2 also each op's compute")
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                   help="the timers across ranks: the maximum, min and max, or every rank")
    g.add_argument("--no-barrier-with-level-1-timing", dest="barrier_with_L1_time",
                   action="store_false",
                   help="level-1 timers start and stop without a barrier across ranks")
    g.add_argument("--tensorboard-dir", help="write TensorBoard scalars here")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="iterations between the per-iteration TensorBoard/W&B scalars (loss, "
                        "learning rate, grad norm, ...); the log line's timings follow "
                        "--log-interval")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="TensorBoard events queued before a write to disk")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write megatron's timers (<name>-time: max over ranks, s per iteration; "
                        "those --timing-log-level enables) and, with --log-throughput, "
                        "'throughput' at each log line")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write the CUDA allocator's mem-reserved-bytes, mem-allocated-bytes, "
                        "mem-max-allocated-bytes and mem-allocated-count (GPU only; on the CPU "
                        "the log line's peak-memory-mb/stage-N is what there is)")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also write each evaluation's perplexity ('lm loss validation ppl')")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false", help="do not write 'loss-scale'")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="also write 'world-size'")
    g.add_argument("--log-interval", type=int, default=100, help="iterations per log line")
    g.add_argument("--wandb-project", help="log the TensorBoard scalars to this W&B project "
                   "(needs the wandb package)")
    g.add_argument("--wandb-exp-name", help="the W&B run's name (required with --wandb-project)")
    g.add_argument("--wandb-save-dir", help="W&B's local folder (default: <--save>/wandb)")
    g.add_argument("--timeline-path", metavar="FILE.png",
                   help="trace one training iteration on every rank and draw each pipeline "
                        "rank's measured actions (seconds of this run) to FILE.png, with the "
                        "actions as JSON in FILE.json (written by the last rank)")
    g.add_argument("--timeline-iteration", type=int, metavar="N",
                   help="the iteration --timeline-path draws (default: --train-iters, the last)")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description="Megatron-style GPT pretraining with Seq1F1B schedules")
    for add in (_add_network_size_args, _add_regularization_args, _add_training_args,
                _add_initialization_args, _add_learning_rate_args, _add_checkpointing_args,
                _add_mixed_precision_args, _add_distributed_args, _add_pipeline_schedule_args,
                _add_validation_args, _add_data_args, _add_tokenizer_args, _add_logging_args):
        add(parser)
    megatron_lm_flags.add_upstream_flags(parser)    # the rest of Megatron-LM's: no-op or refused
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse only (argparse errors, and Megatron-LM flags refused here: one line on stderr, exit
    2). Call validate_args next."""
    parser = build_parser()
    args = parser.parse_args(argv)
    refused = megatron_lm_flags.refusals(args)
    if refused is not None:
        parser.error(refused)
    return args


@dataclass(frozen=True)
class ScheduleConfig:
    """What the runtime needs to build and run the pipeline plan (from validated args)."""

    name: str
    pipeline_parallel_size: int
    num_micro_batches: int
    splits: int
    chunks: int
    partition: str
    span_lengths: Optional[tuple[int, ...]]
    seq_length: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ScheduleConfig":
        return cls(name=args.pipeline_schedule,
                   pipeline_parallel_size=args.pipeline_model_parallel_size,
                   num_micro_batches=args.num_micro_batches,
                   splits=args.seq1f1b_splits,
                   chunks=args.virtual_pipeline_model_parallel_size or 1,
                   partition=args.seq1f1b_partition,
                   span_lengths=tuple(args.seq1f1b_span_lengths)
                   if args.seq1f1b_span_lengths else None,
                   seq_length=args.seq_length)


def _fail(message: str) -> NoReturn:
    raise ArgumentError(message)


def _warn(message: str) -> None:
    """What Megatron-LM warns about and then adjusts: one line on stderr, the run goes on."""
    print(f"{os.path.basename(sys.argv[0]) or 'pretrain_gpt.py'}: warning: {message}",
          file=sys.stderr)


def _require(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            _fail(f"--{name.replace('_', '-')} is required")


def check_range(args: argparse.Namespace, name: str, low: float, high: Optional[float] = None,
                low_inclusive: bool = True) -> None:
    """getattr(args, name), when set, must be a finite number in [low, high) (or (low, high)):
    NaN fails every comparison and would pass, infinity passes an open upper end."""
    value = getattr(args, name)
    if value is None:
        return
    if not math.isfinite(value):
        _fail(f"--{name.replace('_', '-')} must be a finite number, got {value:g}")
    too_low = value < low if low_inclusive else value <= low
    if too_low or (high is not None and value >= high):
        bound = f"{'>=' if low_inclusive else '>'} {low:g}" + ("" if high is None else
                                                             f" and < {high:g}")
        _fail(f"--{name.replace('_', '-')} must be {bound}, got {value:g}")


def _fold_alias(args: argparse.Namespace, alias: str, canonical: str, value: object) -> None:
    """Move the reference fork's alias onto the canonical flag; both given must agree."""
    if value is None:
        return
    current = getattr(args, canonical)
    if current is not None and current != value:
        _fail(f"--{alias.replace('_', '-')} contradicts --{canonical.replace('_', '-')} "
              f"({value} vs {current})")
    setattr(args, canonical, value)


def _validate_basics(args: argparse.Namespace) -> None:
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "lr")
    if (args.train_iters is None) == (args.train_samples is None):
        _fail("--train-iters or --train-samples is required" if args.train_iters is None else
              "--train-samples contradicts --train-iters; give one")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "ffn_hidden_size", "max_position_embeddings", "micro_batch_size",
                 "global_batch_size", "train_iters", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "context_parallel_size",
                 "num_layers_per_virtual_pipeline_stage",
                 "seq1f1b_splits", "pipe_sp_splits", "seq1f1b_fit_iterations",
                 "make_vocab_size_divisible_by",
                 "lr_decay_iters", "save_interval", "eval_interval", "log_interval",
                 "exit_interval", "tensorboard_log_interval", "tensorboard_queue_size",
                 "vocab_size", "num_query_groups", "rotary_base",
                 "kv_channels", "train_samples", "lr_decay_samples",
                 "distributed_timeout_minutes",
                 "rotary_seq_len_interpolation_factor"):
        check_range(args, name, 1)
    check_range(args, "exit_duration_in_mins", 0, low_inclusive=False)
    check_range(args, "manual_gc_interval", 0)
    for name in ("eval_iters", "lr_warmup_iters", "lr", "min_lr", "weight_decay", "clip_grad",
                 "lr_warmup_samples", "lr_warmup_init", "decoupled_lr", "decoupled_min_lr"):
        check_range(args, name, 0)
    check_range(args, "lr_warmup_fraction", 0, 1)
    for name in ("hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2"):
        check_range(args, name, 0, 1)
    for name in ("init_method_std", "adam_eps", "p2p_timeout", "norm_epsilon",
                 "rope_scaling_factor", "loss_scale", "initial_loss_scale", "min_loss_scale",
                 "loss_scale_window", "hysteresis"):
        check_range(args, name, 0, low_inclusive=False)
    check_rotary_percent(args)
    if getattr(args, "accumulate_allreduce_grads_in_fp32", False) and args.grad_reduce_in_bf16:
        _fail("--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16; give one")


def check_rotary_percent(args: argparse.Namespace) -> None:
    """--rotary-percent is the share of each head's channels that rotate: in (0, 1]."""
    if not 0 < args.rotary_percent <= 1:
        _fail(f"--rotary-percent must be > 0 and <= 1, got {args.rotary_percent:g}")


def _validate_model(args: argparse.Namespace) -> None:
    if args.transformer_impl != "local":
        _fail(f"--transformer-impl {args.transformer_impl}: TE layers are not supported; use "
              f"--transformer-impl local (megatron-core's own layers, what runs here)")
    if args.recompute_activations:          # Megatron-LM's older spelling
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        if args.recompute_method is None:   # megatron-core's TransformerConfig refuses it
            _fail("--recompute-granularity full needs --recompute-method uniform or block")
        if args.recompute_num_layers is None:
            _fail("--recompute-granularity full needs --recompute-num-layers (layers per "
                  "recompute group, or recomputed per stage)")
        if args.recompute_num_layers < 1:
            _fail(f"--recompute-num-layers must be at least 1, got {args.recompute_num_layers}")
    elif args.recompute_method or args.recompute_num_layers is not None:
        _fail("--recompute-method / --recompute-num-layers need --recompute-granularity full")
    _validate_architecture(args)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        _fail(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
              f"{args.max_position_embeddings}")
    if args.hidden_size % args.num_attention_heads:
        _fail(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
              f"{args.num_attention_heads}")
    if args.bf16 and args.fp16:
        _fail("--bf16 and --fp16 are exclusive; give one")
    args.params_dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"


def _validate_attention_backend(args: argparse.Namespace) -> None:
    """What the span attention would refuse at its first forward, refused here: a kernel this
    machine lacks, FlexAttention's training on the CPU (torch has no CPU backward for it) or
    with dropout (it has none). Imports the attention module (megatron-core) only for flash, te
    and flex."""
    flag = f"--attention-backend {args.attention_backend}"
    name = args.attention_backend = MEGATRON_BACKENDS.get(args.attention_backend,
                                                          args.attention_backend)
    if name not in ("flash", "te", "flex"):
        return
    if name == "flex" and args.attention_dropout > 0:
        _fail(f"{flag}: FlexAttention has no dropout; give --attention-dropout 0 (default 0.1)")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from seq1f1b.runtime.attention import backend_unavailable_reason
    if name == "flex" and not torch.cuda.is_available():
        _fail(f"{flag}: FlexAttention trains on a GPU only (torch has no CPU backward for it); "
              f"use sdpa or eager")
    reason = backend_unavailable_reason(name, argparse.Namespace(fp16=args.fp16, bf16=args.bf16))
    if reason is not None:
        _fail(f"{flag} is unavailable: {reason}")


def _validate_architecture(args: argparse.Namespace) -> None:
    """GQA, norm and RoPE flags, checked as Megatron-LM checks them."""
    if args.group_query_attention:
        error = query_groups_error(args)
        if error is not None:
            _fail(error)
        if args.num_query_groups % args.tensor_model_parallel_size:
            _fail(f"--num-query-groups {args.num_query_groups} is not divisible by "
                  f"--tensor-model-parallel-size {args.tensor_model_parallel_size}")
    elif args.num_query_groups is not None:
        _fail("--num-query-groups needs --group-query-attention")
    rotary_flags = {"rotary_base": None, "rotary_percent": 1.0,
                    "rotary_seq_len_interpolation_factor": None, "use_rope_scaling": False}
    if args.position_embedding_type != "rope":
        changed = [name for name, default in rotary_flags.items()
                   if getattr(args, name) != default]
        if changed:
            _fail(f"--{changed[0].replace('_', '-')} needs --position-embedding-type rope")
    args.rotary_base = args.rotary_base or 10000
    args.rope_scaling_factor = args.rope_scaling_factor or 8.0
    error = kv_channels_error(args)
    if error is not None:
        _fail(error)
    args.kv_channels = args.hidden_size // args.num_attention_heads
    error = swiglu_ffn_error(args)
    if error is not None:
        _fail(error)


def _validate_parallelism(args: argparse.Namespace, world_size: int) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    if world_size < 1:
        _fail(f"world size must be >= 1, got {world_size}")
    if world_size % (tp * pp * cp):
        _fail(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
              f"--context-parallel-size {cp} = {tp * pp * cp} does not divide the world size "
              f"{world_size}")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * cp)
    highest_seed = 2**32 - 1 - 100 * (pp - 1)      # stage s seeds numpy with seed + 100 s
    if not 0 <= args.seed <= highest_seed:
        _fail(f"--seed must lie in 0 .. {highest_seed} (pipeline stage s seeds seed + 100 x s; "
              f"numpy takes 0 .. 2**32 - 1), got {args.seed}")
    if args.cp_comm_type not in MEGATRON_CP_COMM_TYPES:     # given at CP 1 too: a typo
        _fail(f"--cp-comm-type {args.cp_comm_type!r} is unknown; Megatron's are "
              f"{', '.join(MEGATRON_CP_COMM_TYPES)} (span schedules run a2a)")
    if cp > 1:
        _validate_context_parallel(args)
    if args.num_attention_heads % tp:
        _fail(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
              f"--tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size % tp:
        _fail(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
              f"--tensor-model-parallel-size {tp}")
    uneven = (args.decoder_first_pipeline_num_layers is not None
              or args.decoder_last_pipeline_num_layers is not None
              or args.pipeline_model_parallel_layout is not None)
    if args.num_layers % pp and not uneven:
        _fail(f"--num-layers {args.num_layers} is not divisible by "
              f"--pipeline-model-parallel-size {pp}")
    args.virtual_pipeline_model_parallel_size = None
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is not None:
        if pp < 2:
            _fail("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size "
                  ">= 2")
        per_stage = args.num_layers // pp
        if per_stage % per_chunk or per_stage // per_chunk < 2:
            _fail(f"--num-layers-per-virtual-pipeline-stage {per_chunk} must divide the "
                  f"{per_stage} layers of each pipeline stage into >= 2 chunks")
        args.virtual_pipeline_model_parallel_size = per_stage // per_chunk
    _layout_chunks(args)
    chunk_layers = per_chunk or args.num_layers // pp
    if args.recompute_method == "uniform" and chunk_layers % args.recompute_num_layers \
            and not uneven:     # uneven: every chunk's count checked with the placement
        # megatron-core's uniform loop would index past the chunk's last layer (IndexError).
        _fail(f"--recompute-num-layers {args.recompute_num_layers} must divide the "
              f"{chunk_layers} layers of each model chunk with --recompute-method uniform")
    if args.sequence_parallel and tp == 1:      # as Megatron-LM: a warning, and off
        _warn("--sequence-parallel is turned off: --tensor-model-parallel-size is 1")
        args.sequence_parallel = False
    if args.distributed_timeout_minutes is not None:
        args.p2p_timeout = 60.0 * args.distributed_timeout_minutes
    if args.sequence_parallel:
        if args.seq_length % tp:
            _fail(f"--seq-length {args.seq_length} is not divisible by "
                  f"--tensor-model-parallel-size {tp} (needed by --sequence-parallel)")


def _validate_training_length(args: argparse.Namespace) -> None:
    """Megatron-LM's two ways to say how long: iterations, or samples (then the LR schedule is
    counted in samples too); a fraction of the decay horizon may give the warm-up."""
    if args.train_samples is not None:
        for flag in ("lr_decay_iters", "lr_warmup_iters"):
            if getattr(args, flag):
                _fail(f"--{flag.replace('_', '-')} counts iterations: with --train-samples give "
                      f"--{flag.replace('_iters', '_samples').replace('_', '-')}")
        args.train_iters = args.train_samples // args.global_batch_size
        if args.train_iters < 1:
            _fail(f"--train-samples {args.train_samples} is less than one --global-batch-size "
                  f"{args.global_batch_size}")
        args.lr_decay_samples = args.lr_decay_samples or args.train_samples
    else:
        for flag in ("lr_decay_samples", "lr_warmup_samples"):
            if getattr(args, flag):
                _fail(f"--{flag.replace('_', '-')} needs --train-samples (with --train-iters "
                      f"give --{flag.replace('_samples', '_iters').replace('_', '-')})")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        _fail("--lr-warmup-fraction contradicts --lr-warmup-iters / --lr-warmup-samples; give one")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        _fail("--decoupled-min-lr needs --decoupled-lr")
    if args.decoupled_min_lr is not None and args.decoupled_min_lr > args.decoupled_lr:
        _fail(f"--decoupled-min-lr {args.decoupled_min_lr:g} must be <= --decoupled-lr "
              f"{args.decoupled_lr:g}")


def _validate_context_parallel(args: argparse.Namespace) -> None:
    """--context-parallel-size > 1: Ulysses a2a over the span attention (the span lengths are
    checked with the schedule's)."""
    from seq1f1b.runtime.context_parallel import check_comm_type, check_heads

    try:
        check_comm_type(args.cp_comm_type)
        check_heads(args.num_attention_heads, args.num_query_groups or args.num_attention_heads,
                    args.tensor_model_parallel_size, args.context_parallel_size)
    except ValueError as err:
        _fail(str(err))
    if args.pipeline_schedule in MEGATRON_SCHEDULES:
        _fail(f"--context-parallel-size {args.context_parallel_size}: --pipeline-schedule "
              f"{args.pipeline_schedule} would need megatron's own CP attention (Transformer "
              "Engine); use a span schedule")


def _validate_batch(args: argparse.Namespace) -> None:
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        _fail(f"--global-batch-size {args.global_batch_size} is not divisible by "
              f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
              f"{args.data_parallel_size}")
    args.num_micro_batches = args.global_batch_size // per_step


def _validate_schedule(args: argparse.Namespace) -> None:
    _fold_alias(args, "pipe_sp_splits", "seq1f1b_splits", args.pipe_sp_splits)
    _fold_alias(args, "pipe_sp_strategy", "seq1f1b_partition",
                PIPE_SP_STRATEGIES.get(args.pipe_sp_strategy))
    del args.pipe_sp_splits, args.pipe_sp_strategy
    spans = args.seq1f1b_span_lengths
    args.pipeline_spread_output = False     # a schedule file with O actions sets it
    if args.pipeline_schedule_file is not None:
        _load_schedule_file(args)
    if args.pipeline_schedule is None:
        args.pipeline_schedule = DEFAULT_SCHEDULE
    if spans is not None:
        args.seq1f1b_partition = args.seq1f1b_partition or "explicit"
        args.seq1f1b_splits = args.seq1f1b_splits or len(spans)
    args.seq1f1b_partition = args.seq1f1b_partition or "even"
    args.seq1f1b_splits = args.seq1f1b_splits or 1
    k, name = args.seq1f1b_splits, args.pipeline_schedule

    catalog = schedule_catalog()
    if name not in catalog:
        _fail(f"--pipeline-schedule: unknown schedule {name!r}; choose from "
              f"{', '.join(catalog)}")
    chunked = catalog[name]
    chunks_flag = ("--num-layers-per-virtual-pipeline-stage"
                   if args.pipeline_model_parallel_layout is None
                   else "--pipeline-model-parallel-layout (V x P stages)")
    if chunked is True and args.virtual_pipeline_model_parallel_size is None:
        _fail(f"--pipeline-schedule {name} interleaves model chunks and needs {chunks_flag}")
    if chunked is False and args.virtual_pipeline_model_parallel_size is not None:
        _fail(f"{chunks_flag}: --pipeline-schedule {name} runs one model chunk per rank "
              "(a stage per pipeline rank); use an interleaved schedule")
    if chunked is None and (args.virtual_pipeline_model_parallel_size or 1) > 2:
        _fail(f"{chunks_flag}: --pipeline-schedule {name} runs one or two model chunks per rank, "
              f"got {args.virtual_pipeline_model_parallel_size}")
    if name not in MEGATRON_SCHEDULES and not _searched(name) and _placement(name) == "vshape":
        _validate_v_placement(args)
    _validate_memory_cap(args)
    _validate_spread_output(args)
    _validate_search_layout(args)
    _validate_stage_layers(args)
    if args.pipeline_schedule_file is not None:
        _check_schedule_file_shape(args)
    if name in MEGATRON_SCHEDULES and k != 1:
        _fail(f"--seq1f1b-splits {k}: --pipeline-schedule {name} runs whole sequences (k = 1)")
    if name in MEGATRON_SCHEDULES and args.loss_backward_in_forward:
        _fail(f"--loss-backward-in-forward: --pipeline-schedule {name} is megatron-core's own "
              "schedule, which runs the loss's backward at B; choose one of ours (e.g. 1f1b)")
    if chunked and (name in MEGATRON_SCHEDULES or _placement(name) == "loop") and \
            args.num_micro_batches % args.pipeline_model_parallel_size:
        # megatron-core's interleaving rule, which seq1f1b's interleaved schedules keep
        _fail(f"--global-batch-size: {name} needs the micro-batch count "
              f"({args.num_micro_batches}) to be a multiple of --pipeline-model-parallel-size "
              f"{args.pipeline_model_parallel_size}")

    if k > args.seq_length:
        _fail(f"--seq1f1b-splits {k} exceeds --seq-length {args.seq_length}")
    tp_unit = args.tensor_model_parallel_size if args.sequence_parallel else 1
    cp = args.context_parallel_size
    if cp > 1:
        _validate_cp_spans(args, k, tp_unit * cp)
    _validate_span_alignment(args, k, tp_unit * cp)
    if args.seq1f1b_partition == "explicit":
        if spans is None:
            _fail("--seq1f1b-span-lengths is required by --seq1f1b-partition explicit")
        if len(spans) != k:
            _fail(f"--seq1f1b-span-lengths gives {len(spans)} spans but --seq1f1b-splits is {k}")
        if min(spans) < 1:
            _fail(f"--seq1f1b-span-lengths must all be >= 1, got {' '.join(map(str, spans))}")
        if sum(spans) != args.seq_length:
            _fail(f"--seq1f1b-span-lengths sum to {sum(spans)}, not --seq-length "
                  f"{args.seq_length}")
        if any(span % tp_unit for span in spans):
            _fail(f"--seq1f1b-span-lengths must be multiples of --tensor-model-parallel-size "
                  f"{tp_unit} with --sequence-parallel")
    elif spans is not None:
        _fail(f"--seq1f1b-span-lengths needs --seq1f1b-partition explicit, not "
              f"{args.seq1f1b_partition}")
    elif args.seq_length // tp_unit < k:
        _fail(f"--seq1f1b-splits {k}: --seq-length {args.seq_length} has fewer than {k} spans of "
              f"--tensor-model-parallel-size {tp_unit} tokens (needed by --sequence-parallel)")
    _validate_fit(args)


def _load_schedule_file(args: argparse.Namespace) -> None:
    """--pipeline-schedule-file: read, checked and registered (seq1f1b/plan/schedule_file.py);
    --pipeline-schedule becomes its registry name, k defaults to the file's."""
    from seq1f1b.plan import schedule_file
    from seq1f1b.plan.actions import ScheduleError

    if args.pipeline_schedule is not None:
        _fail("--pipeline-schedule-file replaces --pipeline-schedule: give one of them")
    try:
        schedule = schedule_file.load(args.pipeline_schedule_file)
    except ScheduleError as err:
        _fail(str(err))
    args.pipeline_schedule = schedule.name
    args.pipeline_spread_output = schedule.spread_output
    if schedule.spread_output and args.loss_backward_in_forward:
        _fail(f"--loss-backward-in-forward: --pipeline-schedule-file "
              f"{args.pipeline_schedule_file} runs the output layer on every pipeline rank (O "
              "actions), whose backward runs at once already")
    if args.seq1f1b_splits is None and args.seq1f1b_span_lengths is None:
        args.seq1f1b_splits = schedule.splits


def _check_schedule_file_shape(args: argparse.Namespace) -> None:
    """The file's P, m, k and V are this run's (its builder refuses any other)."""
    from seq1f1b.plan import registry
    from seq1f1b.plan.actions import ScheduleError

    try:
        registry.build(args.pipeline_schedule, args.pipeline_model_parallel_size,
                       args.num_micro_batches, args.seq1f1b_splits,
                       args.virtual_pipeline_model_parallel_size or 1)
    except ScheduleError as err:
        _fail(str(err))


def _validate_v_placement(args: argparse.Namespace) -> None:
    """A V (zbv, seq1f1b-zbv) has two chunks per rank, chunk 1 of rank 0 the last stage (with
    tied embeddings beside the embedding: runtime/tied_output.py ties them)."""
    name = args.pipeline_schedule
    if args.virtual_pipeline_model_parallel_size != 2:
        _fail(f"--num-layers-per-virtual-pipeline-stage: --pipeline-schedule {name} places two "
              f"model chunks per rank in a V; give --num-layers / (2 x "
              f"--pipeline-model-parallel-size)")


def _layout_chunks(args: argparse.Namespace) -> None:
    """--pipeline-model-parallel-layout: its stage count sets the chunks per rank (as in
    Megatron-LM), so it replaces --num-layers-per-virtual-pipeline-stage."""
    if args.pipeline_model_parallel_layout is None:
        return
    from seq1f1b.plan.actions import ScheduleError
    from seq1f1b.plan.stage_layers import LAYOUT_FLAG, StageLayers

    if args.num_layers_per_virtual_pipeline_stage is not None:
        _fail(f"{LAYOUT_FLAG} gives every chunk's layers: drop "
              "--num-layers-per-virtual-pipeline-stage")
    try:
        stages = len(StageLayers.of_flags(args).counts)
    except ScheduleError as err:
        _fail(str(err))
    pp = args.pipeline_model_parallel_size
    if stages % pp:
        _fail(f"{LAYOUT_FLAG} lists {stages} stages, not a multiple of "
              f"--pipeline-model-parallel-size {pp}")
    if stages > pp:
        args.virtual_pipeline_model_parallel_size = stages // pp


def _validate_stage_layers(args: argparse.Namespace, placement: Optional[str] = None) -> None:
    """Uneven first / last stages (seq1f1b/plan/stage_layers.py, which says how they apply to a
    loop and to a V): the other stages must share the rest evenly, >= 1 layer each; with
    uniform full recompute every chunk's count is a multiple of --recompute-num-layers.
    `placement`: the one to check (default: the schedule's, a searched one's own)."""
    from seq1f1b.plan.actions import ScheduleError
    from seq1f1b.plan.costs import Recompute
    from seq1f1b.plan.stage_layers import StageLayers, layers_per_virtual_stage

    split = StageLayers.of_flags(args)     # a layout parsed by _layout_chunks already
    if not split.uneven:
        return
    name = args.pipeline_schedule
    if placement is None:
        placement = "loop" if name in MEGATRON_SCHEDULES else \
            _placement(name, args.virtual_pipeline_model_parallel_size)
    try:
        counts = layers_per_virtual_stage(args.num_layers, args.pipeline_model_parallel_size,
                                          args.virtual_pipeline_model_parallel_size or 1,
                                          placement, split)
        recompute = Recompute.from_flags(args.recompute_granularity, args.recompute_method,
                                         args.recompute_num_layers)
        if recompute is not None:
            recompute.check_chunk_layers(counts)
    except ScheduleError as err:
        _fail(str(err))


def _validate_memory_cap(args: argparse.Namespace) -> None:
    """--schedule-memory-cap: parsed here, for a searched schedule only."""
    if args.schedule_memory_cap is None:
        return
    from seq1f1b.plan import registry
    from seq1f1b.plan.actions import ScheduleError
    from seq1f1b.plan.budget import MemoryCap

    name = args.pipeline_schedule
    if name in MEGATRON_SCHEDULES or not registry.get(name).searched:
        _fail(f"--schedule-memory-cap: --pipeline-schedule {name} is not searched; it takes no "
              f"memory cap (seq1f1b-zb-auto does)")
    try:
        MemoryCap.parse(args.schedule_memory_cap)
    except ScheduleError as err:
        _fail(str(err))


def _validate_spread_output(args: argparse.Namespace) -> None:
    """--spread-output: a searched schedule's option (a schedule file says itself whether it
    spreads the layer), where budget.spread_output_refusal lets it run."""
    if not args.spread_output:
        return
    from seq1f1b.plan.budget import spread_output_refusal

    if args.pipeline_schedule_file is not None:
        _fail("--spread-output: a --pipeline-schedule-file has its O actions or not; drop the flag")
    refusal = spread_output_refusal(args.pipeline_schedule, args.loss_backward_in_forward,
                                    "--pipeline-schedule")
    if refusal is not None:
        _fail(refusal)


def _validate_search_layout(args: argparse.Namespace) -> None:
    """--search-layout: the searched schedule's, on the 2P stages of two chunks per rank, whose
    layers it chooses itself."""
    if not args.search_layout:
        return
    from seq1f1b.plan.stage_layers import FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG, StageLayers

    name = args.pipeline_schedule
    if name in MEGATRON_SCHEDULES or not _searched(name):
        _fail(f"--search-layout: --pipeline-schedule {name} is not searched; seq1f1b-zb-auto "
              "chooses its layout")
    if args.virtual_pipeline_model_parallel_size != 2:
        _fail("--search-layout chooses the layers of the 2P stages of two chunks per rank: give "
              "--num-layers-per-virtual-pipeline-stage = --num-layers / (2 x "
              "--pipeline-model-parallel-size)")
    if StageLayers.of_flags(args).uneven:
        _fail(f"--search-layout chooses every stage's layers: drop {FIRST_FLAG} / {LAST_FLAG} "
              f"/ {LAYOUT_FLAG}")


def _validate_span_alignment(args: argparse.Namespace, k: int, parallel_unit: int) -> None:
    """--seq1f1b-span-alignment N: with the multiple TP and CP ask for (`parallel_unit`), every
    span a multiple of their lcm: the sequence must hold k such spans, explicit lengths must be
    multiples."""
    if args.seq1f1b_span_alignment is None:
        args.seq1f1b_span_alignment = 1
    align = args.seq1f1b_span_alignment
    if align < 1:
        _fail(f"--seq1f1b-span-alignment must be a positive integer, got {align}")
    unit = math.lcm(align, parallel_unit)
    if align == 1:
        return
    _check_span_multiple(args, k, unit, f"--seq1f1b-span-alignment {align}" + (
        f" with the TP / CP multiple {parallel_unit} = {unit}" if unit != align else ""))


def _validate_cp_spans(args: argparse.Namespace, k: int, unit: int) -> None:
    """Every span splits over the CP ranks (each part over TP under sequence parallelism)."""
    cp = args.context_parallel_size
    _check_span_multiple(args, k, unit, f"--context-parallel-size {cp}" + (
        f" x --tensor-model-parallel-size {unit // cp} (--sequence-parallel)" if unit > cp
        else "") + f" = {unit}")


def _check_span_multiple(args: argparse.Namespace, k: int, unit: int, why: str) -> None:
    """Explicit span lengths must be multiples of `unit`, else the sequence must hold k spans
    of its multiples; `why` names the flags that ask for it."""
    from seq1f1b.plan.partition import span_multiple_error

    error = span_multiple_error(args.seq_length, k, args.seq1f1b_span_lengths, unit, why,
                                "--seq1f1b-")
    if error is not None:
        _fail(error)


def _validate_fit(args: argparse.Namespace) -> None:
    """--seq1f1b-partition fit calibrates from the executor's trace of this run's first
    iterations: it needs a schedule that records one, boundaries to place and iterations left to
    run the fitted cut."""
    if args.seq1f1b_partition != "fit":
        if args.seq1f1b_fit_iterations is not None:
            _fail("--seq1f1b-fit-iterations needs --seq1f1b-partition fit")
        return
    _refuse_untraced_schedule(args, "--seq1f1b-partition fit")
    if args.seq1f1b_splits < 2:
        _fail("--seq1f1b-partition fit needs --seq1f1b-splits >= 2: one span has no boundary "
              "to place")
    if args.seq1f1b_fit_iterations is None:
        args.seq1f1b_fit_iterations = DEFAULT_FIT_ITERATIONS
    if args.seq1f1b_fit_iterations >= args.train_iters:
        _fail(f"--seq1f1b-fit-iterations {args.seq1f1b_fit_iterations} leaves none of the "
              f"--train-iters {args.train_iters} iterations to run the fitted cut")


def _refuse_untraced_schedule(args: argparse.Namespace, flag: str) -> None:
    """`flag` reads the executor's trace, which megatron-core's own schedules do not record."""
    if args.pipeline_schedule in MEGATRON_SCHEDULES:
        _fail(f"{flag}: --pipeline-schedule {args.pipeline_schedule} is megatron-core's own "
              f"schedule, which records no actions to measure; use one of the registry's")


def _validate_optimisation(args: argparse.Namespace) -> None:
    if args.lr < args.min_lr:
        _fail(f"--min-lr {args.min_lr:g} exceeds --lr {args.lr:g}")
    if args.train_samples is not None:
        if args.lr_warmup_samples >= args.lr_decay_samples:
            _fail(f"--lr-warmup-samples {args.lr_warmup_samples} must be < --lr-decay-samples "
                  f"{args.lr_decay_samples} (default: --train-samples)")
        return
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        _fail(f"--lr-warmup-iters {args.lr_warmup_iters} must be < --lr-decay-iters "
              f"{args.lr_decay_iters} (default: --train-iters)")


def _validate_data(args: argparse.Namespace) -> None:
    if args.mock_data and args.data_path:
        _fail("--mock-data contradicts --data-path; give one")
    if not args.mock_data and not args.data_path:
        _fail("--data-path is required (or --mock-data)")
    unread = unread_flag_error(args, args.tokenizer_type)
    if unread is not None:
        _fail(unread)
    if args.reset_attention_mask and args.attention_backend == "te":
        _fail(f"--reset-attention-mask: --attention-backend {args.attention_backend} cannot mask "
              f"documents; use eager, sdpa, flex or flash")
    from seq1f1b.plan.costs import padded_vocab_size

    try:
        parse_split(args.split)
        infos = check_data_config(DataConfig.from_args(args))
        tokenizer = build_tokenizer(args)
        args.padded_vocab_size = padded_vocab_size(
            tokenizer.vocab_size, args.make_vocab_size_divisible_by,
            args.tensor_model_parallel_size)
        check_token_ids(infos, args.padded_vocab_size)
    except ValueError as err:
        _fail(str(err))


def _validate_resume_layout(args: argparse.Namespace, start) -> None:
    """Refuse what the checkpoint `start` names cannot give this layout; keep its padded
    vocabulary (checkpoint_resharding; checkpoints without our layout record are not checked).

    Reads the checkpoint's common state through megatron-core, imported only here: a run that
    resumes pays for the import during validation instead of a moment later.
    """
    from megatron.training.checkpoint_resharding import check_resume, read_record
    record = read_record(start.folder)
    if record is None:
        return
    try:
        check_resume(args, record, start.folder, start.restores_optimizer, start.flag)
    except ValueError as err:
        _fail(str(err))


def _validate_run(args: argparse.Namespace, explicit: frozenset[str]) -> None:
    if args.load is not None:
        resumes_own_save = args.save is not None and \
            os.path.abspath(args.load) == os.path.abspath(args.save)
        if not os.path.isdir(args.load) and not resumes_own_save:   # a typo, or a fresh start
            _fail(f"--load: checkpoint directory {args.load} does not exist (it may be missing "
                  f"only when it is also --save)")
    for flag in ("save", "tensorboard_dir", "data_cache_path", "wandb_save_dir"):
        path = getattr(args, flag)
        if path is not None:
            try:
                writable.check_output_dir(path, f"--{flag.replace('_', '-')}")
            except ValueError as err:
                _fail(str(err))
    if args.save_interval is not None and args.save is None:
        _fail("--save-interval needs --save")
    if args.ckpt_format != "torch_dist":
        _fail(f"--ckpt-format {args.ckpt_format}: only torch_dist (megatron-core's "
              f"dist_checkpointing, Megatron-LM's default) is written and read here")
    if args.skip_train and not args.no_load_optim:     # as Megatron-LM
        _warn("enabling --no-load-optim when skipping training (--skip-train)")
        args.no_load_optim = True
    _validate_start(args, explicit)
    if args.exit_signal is not None and not args.exit_signal_handler:
        _fail(f"--exit-signal {args.exit_signal} needs --exit-signal-handler")
    args.exit_signal = args.exit_signal or "SIGTERM"


def _use_checkpoint_args(args: argparse.Namespace, explicit: frozenset[str]) -> None:
    """--use-checkpoint-args: the model flags of the checkpoint the run starts from, before any
    other check (a run without a checkpoint yet keeps its flags, as in Megatron-LM)."""
    try:
        start = starting_point(args)
        stored = None if start is None else checkpoint_model.stored_model(start)
    except ValueError as err:
        _fail(str(err))
    if stored is not None:
        checkpoint_model.fill_from_checkpoint(args, stored, explicit)


def _validate_start(args: argparse.Namespace, explicit: frozenset[str]) -> None:
    """The checkpoint the run starts from: its tracker, its iteration, its files, its model
    (checkpoint_model: the flags' model must be the checkpoint's), its LR schedule."""
    for flag in ("finetune", "no_load_optim", "no_load_rng"):
        if getattr(args, flag) and args.load is None and args.pretrained_checkpoint is None \
                and not (flag == "no_load_optim" and args.skip_train):
            _fail(f"--{flag.replace('_', '-')} needs --load or --pretrained-checkpoint")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail("--override-opt_param-scheduler contradicts --use-checkpoint-opt_param-scheduler; "
              "give one")
    try:
        start = starting_point(args)
    except ValueError as err:
        _fail(str(err))
    if start is None and args.exit_on_missing_checkpoint and args.load is not None:
        _fail(f"--exit-on-missing-checkpoint: --load {args.load} holds no checkpoint "
              f"({checkpoint_layout.TRACKER_NAME} is missing)")
    if start is None:
        return
    if not start.finetune and not args.skip_train and start.iteration > args.train_iters:
        _fail(f"--train-iters {args.train_iters} is below the iteration {start.iteration} of the "
              f"checkpoint in {start.flag} {start.root}")
    try:
        stored = checkpoint_model.stored_model(start)
        if stored is not None:
            checkpoint_model.check_model(args, stored, f"{start.flag} {start.root}", explicit)
    except ValueError as err:
        _fail(str(err))
    if not start.release:
        _validate_resume_layout(args, start)
    if not start.restores_optimizer:
        return
    try:
        common = read_common_state(start.folder)
    except ValueError as err:
        _fail(f"{start.flag}: {err}")
    if getattr(common.get("args"), "no_save_optim", False):
        _fail(f"{start.flag} {start.root}: the checkpoint was saved with --no-save-optim (no "
              f"optimizer state or LR schedule): give --no-load-optim or --finetune, as "
              f"Megatron-LM asks")
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    saved = common.get("opt_param_scheduler")
    found = [] if saved is None else lr_schedule.disagreements(
        lr_schedule.ScheduleSettings.from_args(args), saved)
    if found:
        differences = ", ".join(f"{name} {old!r} in the checkpoint, {new!r} from the flags"
                                for name, old, new in found)
        _fail(f"{start.flag} {start.root}: the LR schedule differs ({differences}): give "
              f"--override-opt_param-scheduler (the flags win) or "
              f"--use-checkpoint-opt_param-scheduler (the checkpoint wins)")


def _validate_overlap(args: argparse.Namespace) -> None:
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        _fail("--overlap-param-gather needs --use-distributed-optimizer (the parameters are "
              "gathered from its shards)")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        _fail("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")


def _validate_observability(args: argparse.Namespace) -> None:
    if args.wandb_project:
        if importlib.util.find_spec("wandb") is None:
            _fail("--wandb-project needs the wandb package, which is not installed "
                  "(pip install wandb)")
        if not args.wandb_exp_name:
            _fail("--wandb-exp-name is required with --wandb-project")
    elif args.wandb_exp_name or args.wandb_save_dir:
        _fail("--wandb-exp-name / --wandb-save-dir need --wandb-project")
    if args.profile:
        if not args.tensorboard_dir:
            _fail("--profile writes its traces to --tensorboard-dir; give one")
        check_range(args, "profile_step_start", 0)
        if args.profile_step_end <= args.profile_step_start:
            _fail(f"--profile-step-end {args.profile_step_end} must exceed "
                  f"--profile-step-start {args.profile_step_start}")
        outside = [r for r in args.profile_ranks if not 0 <= r < args.world_size]
        if outside:
            _fail(f"--profile-ranks {' '.join(map(str, outside))}: ranks are 0 to "
                  f"{args.world_size - 1}")
    _validate_timeline(args)
    if args.log_memory_to_tensorboard:
        import torch
        if not torch.cuda.is_available():
            _warn("--log-memory-to-tensorboard writes the CUDA allocator's statistics: no CUDA "
                  "device here, so none are written (peak-memory-mb/stage-N still is)")
    if args.record_memory_history:
        import torch
        if not torch.cuda.is_available():
            _fail("--record-memory-history records the CUDA caching allocator: GPU only "
                  "(no CUDA device here)")


def _validate_timeline(args: argparse.Namespace) -> None:
    path, iteration = args.timeline_path, args.timeline_iteration
    if path is None:
        if iteration is not None:
            _fail("--timeline-iteration needs --timeline-path")
        return
    _refuse_untraced_schedule(args, "--timeline-path")
    try:      # the folders it lacks are made when it is drawn; its actions go beside it (.json)
        writable.check_output_file(path, "--timeline-path", ".png", makes_folders=True)
    except ValueError as err:
        _fail(str(err))
    args.timeline_iteration = args.train_iters if iteration is None else iteration
    if not 1 <= args.timeline_iteration <= args.train_iters:
        _fail(f"--timeline-iteration {args.timeline_iteration} is not one of the iterations 1 to "
              f"--train-iters {args.train_iters}")


def _place_schedule(args: argparse.Namespace) -> None:
    """Sets args.pipeline_placement, how the model chunks are laid out on the pipeline ranks
    (actions.PLACEMENTS). A searched schedule is placed now, with the model's costs (the padded
    vocabulary known): it chooses a V or a loop of its two chunks per rank (a loop on one), a
    cap that no order fits is refused before any work, and the last rank (the one that logs the
    losses) says what it chose.
    The registry keeps the search, so the run's schedule function gets the same one without
    searching again (schedule_budget.py pins the placement when the fit partition re-places
    it)."""
    name = args.pipeline_schedule
    if not _searched(name):
        args.pipeline_placement = "loop" if name in MEGATRON_SCHEDULES else _placement(name)
        return
    from megatron.training.schedule_budget import placement_report, schedule_budget
    from seq1f1b.plan import registry
    from seq1f1b.plan.actions import ScheduleError, placement_words
    from seq1f1b.plan.search_progress import shown

    chunks = args.virtual_pipeline_model_parallel_size or 1
    says = os.environ.get("RANK", "0") == str(args.world_size - 1)
    # the searches say how far they are on the rank that logs
    with shown(sys.stdout, " ") if says else contextlib.nullcontext():
        if args.search_layout:
            _search_layout(args, says)
        try:
            budget = schedule_budget(args)
            if says:
                where = " and ".join(dict.fromkeys(
                    placement_words(placement) for placement, _ in budget.options()))
                output = (", the output layer in the last stage and spread over the ranks"
                          if args.spread_output else "")
                print(f" {name}: searching orders of F, B and W for "
                      f"P={args.pipeline_model_parallel_size} m={args.num_micro_batches} "
                      f"k={args.seq1f1b_splits} on {where} of {chunks} chunk"
                      f"{'s' if chunks > 1 else ''} per rank{output} ...", flush=True)
            schedule = registry.build(name, args.pipeline_model_parallel_size,
                                      args.num_micro_batches, args.seq1f1b_splits, chunks,
                                      budget=budget)
        except ScheduleError as err:
            _fail(f"--pipeline-schedule {name}: {err}")
    args.pipeline_placement = schedule.placement
    args.pipeline_spread_output = schedule.spread_output
    if schedule.placement != _placement(name, chunks):
        _validate_stage_layers(args, schedule.placement)
    if says:
        print(f" {name}: {placement_report(schedule, budget)}", flush=True)


def _search_layout(args: argparse.Namespace, says: bool) -> None:
    """--search-layout: the layout kept becomes the run's --pipeline-model-parallel-layout (the
    model chunks are built with it), and the cap every layout was searched under its
    --schedule-memory-cap where none was given (the run's own search then places the same
    order under it); `says`: this rank prints what was kept."""
    from megatron.training.schedule_budget import searched_layout
    from seq1f1b.plan.actions import ScheduleError

    if says:
        print(f" {args.pipeline_schedule}: --search-layout: searching the layers of the "
              f"{2 * args.pipeline_model_parallel_size} stages ...", flush=True)
    try:
        chosen = searched_layout(args)
    except ScheduleError as err:
        _fail(f"--pipeline-schedule {args.pipeline_schedule}: {err}")
    if args.schedule_memory_cap is None:
        args.schedule_memory_cap = f"{chosen.cap:.6f}"
    if chosen.layout is not None:
        args.pipeline_model_parallel_layout = chosen.layout.layout
        _validate_stage_layers(args)
    if says:
        print(f" {args.pipeline_schedule}: {chosen.report()}", flush=True)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check every flag and combination, fill in Megatron's derived values; write nothing.

    Adds: world_size, data_parallel_size, num_micro_batches, virtual_pipeline_model_parallel_size
    (None or V >= 2), padded_vocab_size (the --load checkpoint's when it has one: see
    checkpoint_resharding), params_dtype ("float32"/"bfloat16"/"float16"), and resolves defaults
    of ffn_hidden_size, max_position_embeddings, global_batch_size, lr_decay_iters,
    seq1f1b_splits (1), seq1f1b_partition ("even"; "explicit" when span lengths are given),
    seq1f1b_fit_iterations (2 with the fit partition) and timeline_iteration (--train-iters with
    --timeline-path).
    The --pipe-sp-* aliases are folded into seq1f1b_* and removed.
    Raises ArgumentError (one line, naming the flag).
    """
    explicit = checkpoint_model.explicit_context(args)
    if args.use_checkpoint_args:
        _use_checkpoint_args(args, explicit)
    _validate_basics(args)
    _validate_model(args)
    _validate_parallelism(args, world_size)
    _validate_batch(args)
    _validate_training_length(args)
    _validate_schedule(args)
    _validate_optimisation(args)
    _validate_data(args)
    _validate_attention_backend(args)
    _validate_run(args, explicit)
    _validate_overlap(args)
    _validate_observability(args)
    _place_schedule(args)
    return args


def world_size_from_environment() -> int:
    """The world size torchrun (WORLD_SIZE) or srun (SLURM_NTASKS) announces; 1 without either.

    The same variables `seq1f1b.distributed.init_distributed` reads, so flags are validated
    against the world the run will have, before any process group exists.
    """
    env = os.environ
    text = env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))
    try:
        return int(text)
    except ValueError:
        raise ArgumentError(f"world size: WORLD_SIZE / SLURM_NTASKS is {text!r}, not a number") \
            from None


def parse_and_validate_args(argv: Optional[Sequence[str]], world_size: Optional[int] = None
                            ) -> argparse.Namespace:
    """The CLI entry: bad flags print one line on stderr and exit with code 2.

    `world_size` defaults to `world_size_from_environment()`.
    """
    args = parse_args(argv)
    try:
        world = world_size_from_environment() if world_size is None else world_size
        return validate_args(args, world)
    except ArgumentError as err:
        print(f"{os.path.basename(sys.argv[0]) or 'pretrain_gpt.py'}: error: {err}",
              file=sys.stderr)
        raise SystemExit(2) from None
