"""The winner as a run: its complete pretrain_gpt.py flags and an sbatch script.

The sbatch script has the shape of examples/slurm's pretrain_gpt_*.sbatch: #SBATCH lines for the
nodes, the layout as the variables examples/slurm/launch_pretrain.sh reads (`: "${VAR:=...}"`,
each overridable at submission), what that script has no variable for in EXTRA_ARGS, then it
sources launch_pretrain.sh, the one body of every shipped script (which derives DP, and with it
the global batch, as world / (TP x PP x CP)).
"""
from __future__ import annotations

import shlex

from seq1f1b.model_flags import SIZE_FLAG_TOKENS, shape_flags
from seq1f1b.plan.memory import TrainingSetup

RUN_FLAGS = ("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", "0.006",
             "--train-iters", "20", "--lr", "6e-5", "--min-lr", "6e-6",
             "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
             "--log-interval", "1", "--eval-iters", "0")
"""The run settings of examples/slurm/launch_pretrain.sh (rope, untied output layer as the
estimator counts it, no dropout as the paper); replace --mock-data with your --data-path."""


def model_flags(setup: TrainingSetup) -> list[str]:
    """The model's shape flags (seq1f1b.model_flags.shape_flags)."""
    model = setup.model
    return shape_flags(num_layers=model.num_layers, hidden_size=model.hidden_size,
                       num_attention_heads=model.num_attention_heads,
                       ffn_hidden_size=model.ffn_hidden_size,
                       num_query_groups=model.num_query_groups, swiglu=model.swiglu,
                       normalization=model.normalization, add_bias_linear=model.add_bias_linear,
                       add_qkv_bias=model.add_qkv_bias)


def layout_flags(setup: TrainingSetup, global_batch_size: int) -> list[str]:
    """TP, PP, CP, V, uneven stages, schedule, k, partition, recompute and the batch."""
    flags = ["--tensor-model-parallel-size", str(setup.tp),
             "--pipeline-model-parallel-size", str(setup.pp)]
    if setup.sequence_parallel:
        flags.append("--sequence-parallel")
    if setup.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if _vpp_layers(setup):
        flags += ["--num-layers-per-virtual-pipeline-stage", str(_vpp_layers(setup))]
    if setup.cp > 1:
        flags += ["--context-parallel-size", str(setup.cp)]
    flags += _script_gaps(setup)
    flags += ["--pipeline-schedule", setup.schedule, "--seq1f1b-splits", str(setup.splits),
              "--seq1f1b-partition", setup.partition,
              "--micro-batch-size", str(setup.micro_batch_size),
              "--global-batch-size", str(global_batch_size)]
    return flags


def _vpp_layers(setup: TrainingSetup) -> int | None:
    return setup.model.num_layers // (setup.pp * setup.chunks) if setup.chunks > 1 else None


def _script_gaps(setup: TrainingSetup) -> list[str]:
    """The layout flags launch_pretrain.sh has no variable for: uneven stages, recompute, the
    loss's backward at F, a searched schedule's memory cap and --spread-output."""
    flags = []
    if setup.decoder_first_pipeline_num_layers:
        flags += ["--decoder-first-pipeline-num-layers",
                  str(setup.decoder_first_pipeline_num_layers)]
    if setup.decoder_last_pipeline_num_layers:
        flags += ["--decoder-last-pipeline-num-layers",
                  str(setup.decoder_last_pipeline_num_layers)]
    if setup.recompute_granularity:
        flags += ["--recompute-granularity", setup.recompute_granularity]
        if setup.recompute_granularity == "full":
            flags += ["--recompute-method", setup.recompute_method,
                      "--recompute-num-layers", str(setup.recompute_num_layers)]
    if setup.loss_backward_in_forward:
        flags.append("--loss-backward-in-forward")
    if setup.schedule_memory_cap:
        flags += ["--schedule-memory-cap", setup.schedule_memory_cap]
    if setup.spread_output:
        flags.append("--spread-output")
    return flags


def pretrain_flags(setup: TrainingSetup, global_batch_size: int) -> list[str]:
    """The complete pretrain_gpt.py command line of `setup` (mock data)."""
    return (model_flags(setup) + ["--seq-length", str(setup.seq_length),
                                  "--max-position-embeddings", str(setup.seq_length)]
            + layout_flags(setup, global_batch_size) + ["--bf16"] + list(RUN_FLAGS)
            + ["--mock-data", "--tokenizer-type", "NullTokenizer",
               "--vocab-size", str(setup.model.vocab_size)])


def sbatch_script(setup: TrainingSetup, gpus: int,
                  gpus_per_node: int, about: str) -> str:
    """The sbatch script of `setup` (see the module docstring); `about`: a comment line."""
    nodes = max(1, gpus // gpus_per_node)
    per_node = min(gpus, gpus_per_node)
    model = setup.model
    # launch_pretrain.sh passes the first three model dimensions; the rest go as EXTRA_ARGS
    extra = model_flags(setup)[SIZE_FLAG_TOKENS:] + _script_gaps(setup)
    defaults = {"NUM_LAYERS": model.num_layers, "HIDDEN_SIZE": model.hidden_size,
                "NUM_ATTENTION_HEADS": model.num_attention_heads, "TP": setup.tp,
                "PP": setup.pp, "CP": setup.cp, "SEQ_LENGTH": setup.seq_length,
                "MICRO_BATCHES": setup.microbatches, "MICRO_BATCH": setup.micro_batch_size,
                "SCHEDULE": setup.schedule, "SPLITS": setup.splits,
                "PARTITION_METHOD": setup.partition, "VOCAB_SIZE": model.vocab_size}
    lines = ["#!/bin/bash",
             "# Written by tools/plan.py tune (seq1f1b/plan/tune/launch.py), the shape of",
             "# examples/slurm/pretrain_gpt_*.sbatch: every setting below is a default, the",
             "# variables are examples/slurm/launch_pretrain.sh's (README, \"Launch on Slurm\").",
             f"# {about}",
             "#SBATCH --job-name=seq1f1b-tuned",
             f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks-per-node={per_node}",
             f"#SBATCH --gpus-per-node={per_node}",
             "#SBATCH --time=02:00:00",
             "#SBATCH --signal=TERM@120",
             "",
             "MODEL_NAME=tuned"]
    lines += [f': "${{{key}:={value}}}"' for key, value in defaults.items()]
    if _vpp_layers(setup):
        lines.append(f': "${{VPP_LAYERS:={_vpp_layers(setup)}}}"')
    lines.append(f': "${{EXTRA_ARGS:={shlex.join(extra)}}}"')
    lines += ["", 'source "${REPO:-${SLURM_SUBMIT_DIR:-.}}/examples/slurm/launch_pretrain.sh"']
    return "\n".join(lines) + "\n"
