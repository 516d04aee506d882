#!/usr/bin/env bash
# Quickstart, from nothing to a trained tiny GPT on 4 CPU processes (`make quickstart` runs it
# after building .venv). Everything it writes goes to OUT=runs/quickstart/ (emptied first when an
# earlier run made it; any other existing folder is refused, examples/out_folder.sh):
#   data/          the shipped corpus (examples/data/corpus.jsonl) as Megatron .bin/.idx
#   train.log      the training log (Megatron's log line every 5 iterations)
#   checkpoints/   the dist_checkpointing checkpoint at the end (resume: add --load)
#   tensorboard/   scalars (tensorboard --logdir runs/quickstart/tensorboard)
#   timeline.png   the last iteration as it ran: each pipeline stage's F and B of every span
#                  (P=2, m=2, k=4), measured in seconds (pretrain_gpt.py --timeline-path)
#   timeline.json  those actions, with start and end times, beside it
# Training: TP=2 x PP=2, --pipeline-schedule seq1f1b --seq1f1b-splits 4, byte-level tokenizer.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/quickstart}
TRAIN_ITERS=${TRAIN_ITERS:-50}
PORT=${MASTER_PORT:-29517}

# shellcheck source=out_folder.sh
source examples/out_folder.sh
prepare_out "$OUT" quickstart.sh
mkdir -p "$OUT/data"
start=$(date +%s)

echo "== 1/2 preprocess examples/data/corpus.jsonl -> $OUT/data"
"$PY" tools/preprocess_data.py --input examples/data/corpus.jsonl \
    --output-prefix "$OUT/data/corpus" --append-eod --workers 2 --log-interval 500

MODEL=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128
       --max-position-embeddings 128 --position-embedding-type rope)
echo "== 2/2 train: 4 processes, TP=2 PP=2, seq1f1b k=4, $TRAIN_ITERS iterations; the last one" \
     "drawn to $OUT/timeline.png"
# One intra-op thread per process: 4 processes share the cores.
OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1 "$PY" -m torch.distributed.run \
    --nproc-per-node 4 --master-addr 127.0.0.1 --master-port "$PORT" pretrain_gpt.py \
    "${MODEL[@]}" \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --pipeline-schedule seq1f1b --seq1f1b-splits 4 \
    --micro-batch-size 8 --global-batch-size 16 \
    --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine \
    --lr-warmup-iters 5 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
    --hidden-dropout 0 --attention-dropout 0 \
    --data-path "$OUT/data/corpus_text_document" --split 949,50,1 \
    --log-interval 5 --eval-interval 25 --eval-iters 1 \
    --save "$OUT/checkpoints" --tensorboard-dir "$OUT/tensorboard" \
    --timeline-path "$OUT/timeline.png" \
    2>&1 | grep -v -e "UserWarning" -e "warnings.warn" | tee "$OUT/train.log"

losses=$(grep -o "lm loss: [0-9.E+-]*" "$OUT/train.log" | awk '{print $3}')
echo "== done in $(( $(date +%s) - start )) s: lm loss $(echo "$losses" | head -n1) (first log line)" \
     "-> $(echo "$losses" | tail -n1) (last); checkpoint $(cat "$OUT/checkpoints/latest_checkpointed_iteration.txt")" \
     "in $OUT/checkpoints, timeline $OUT/timeline.png"
