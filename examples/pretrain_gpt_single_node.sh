#!/bin/bash
# One machine, no Slurm: torchrun with one rank per GPU, the paper's settings for MODEL.
#
#   examples/pretrain_gpt_single_node.sh                     GPT 2.7B on 8 GPUs (TP=1 x PP=8)
#   MODEL=7b TP=2 PP=4 SEQ_LENGTH=16384 examples/pretrain_gpt_single_node.sh   (the authors' one-node
#       7B run; the 7B script's own layout, TP=8 x PP=4, needs 32 GPUs)
#   SCHEDULE=1f1b examples/pretrain_gpt_single_node.sh --log-interval 10   (flags go through)
#   GPUS_PER_NODE=4 TP=2 PP=2 NUM_LAYERS=4 HIDDEN_SIZE=64 NUM_ATTENTION_HEADS=4 SEQ_LENGTH=128 \
#       MICRO_BATCHES=4 PRECISION= examples/pretrain_gpt_single_node.sh       (a CPU-sized run)
#
# MODEL (2.7b, 7b, 13b, 30b) picks the model and parallel layout of examples/slurm's script of
# that name, run with LAUNCHER=local; every variable of examples/slurm/launch_pretrain.sh applies
# (GPUS_PER_NODE defaults to the GPUs nvidia-smi lists). Logs go to RUN_DIR
# [runs/local-<model>-<date>-<time>], with the summary line last.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-2.7b}"
scripts=(examples/slurm/pretrain_gpt_"$MODEL"_*gpu.sbatch)
if [ ! -f "${scripts[0]}" ]; then
    echo "pretrain_gpt_single_node.sh: MODEL must be 2.7b, 7b, 13b or 30b, not '$MODEL'" >&2
    exit 2
fi
export LAUNCHER=local REPO="$PWD"
export RUN_DIR="${RUN_DIR:-runs/local-$MODEL-$(date +%Y%m%d-%H%M%S)}"
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" MASTER_PORT="${MASTER_PORT:-29500}"
exec bash "${scripts[0]}" "$@"
