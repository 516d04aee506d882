#!/usr/bin/env bash
# Extend a Hugging Face model's context with Seq1F1B: convert it, continue training at FACTOR x
# the context it was trained at with a raised RoPE base, and export the result back to Hugging
# Face. The long sequences are what Seq1F1B is for: each is cut into SPLITS spans, so a stage
# holds activations of spans, not of whole sequences.
#
#   HF_DIR=/models/Llama-3.2-1B DATA=corpus.jsonl TP=2 PP=4 EXTRA="--bf16" \
#       bash examples/extend_context.sh
#
# Environment (default):
#   HF_DIR        a local Llama / Mistral / Qwen2 folder: config.json, safetensors, tokenizer.json
#   DATA          JSON lines with a "text" field, tokenized with the folder's tokenizer
#   OUT           where everything goes (runs/extend_context; emptied first when an earlier
#                 run made it, any other existing folder is refused: examples/out_folder.sh):
#                   data/ release/ (the converted checkpoint) extended/ (training checkpoints)
#                   hf/ (the exported folder) train.log convert.log
#   BASE_LENGTH   the context to extend (config.json's max_position_embeddings)
#   FACTOR        4: train at FACTOR x BASE_LENGTH tokens
#   ROTARY_BASE   FACTOR x config.json's rope_theta: a raised base, the usual ("ABF") recipe
#   TP PP SPLITS  1, 2, 4: tensor and pipeline sizes (TP x PP processes), seq1f1b's k
#   TRAIN_ITERS LR MICRO_BATCH GLOBAL_BATCH   20, 1e-5, 1, 8
#   EXTRA         more pretrain_gpt.py flags (e.g. --bf16 --sequence-parallel
#                 --use-distributed-optimizer --recompute-granularity selective)
#   PY            .venv/bin/python
# A GPU node runs the same command (NCCL); without a GPU, gloo on CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
: "${HF_DIR:?HF_DIR must name a Hugging Face model folder}"
: "${DATA:?DATA must name a JSON-lines corpus}"
OUT=${OUT:-runs/extend_context}
FACTOR=${FACTOR:-4}
TP=${TP:-1}
PP=${PP:-2}
SPLITS=${SPLITS:-4}
TRAIN_ITERS=${TRAIN_ITERS:-20}
LR=${LR:-1e-5}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-8}
PORT=${MASTER_PORT:-29531}
EXTRA=${EXTRA:-}

for file in "$HF_DIR/config.json" "$DATA"; do
    [ -f "$file" ] || { echo "extend_context.sh: error: $file does not exist" >&2; exit 2; }
done
config() { "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" \
    "$HF_DIR/config.json" "$1"; }
BASE_LENGTH=${BASE_LENGTH:-$(config max_position_embeddings)}
LENGTH=$(( FACTOR * BASE_LENGTH ))
ROTARY_BASE=${ROTARY_BASE:-$("$PY" -c "print(int($FACTOR * float('$(config rope_theta)')))")}

# shellcheck source=out_folder.sh
source examples/out_folder.sh
prepare_out "$OUT" extend_context.sh
mkdir -p "$OUT/data"
start=$(date +%s)

echo "== 1/4 convert $HF_DIR -> $OUT/release (TP=$TP PP=$PP)"
"$PY" tools/checkpoint/convert.py hf-to-megatron --hf-dir "$HF_DIR" --save "$OUT/release" \
    --tp "$TP" --pp "$PP" | tee "$OUT/convert.log"
# The line after "pretrain_gpt.py flags for it": the model, tokenizer and --load flags.
read -r -a MODEL_FLAGS <<< "$(sed -n '/^pretrain_gpt.py flags for it/{n;p}' "$OUT/convert.log")"

echo "== 2/4 tokenize $DATA with the model's tokenizer -> $OUT/data"
"$PY" tools/preprocess_data.py --input "$DATA" --output-prefix "$OUT/data/corpus" \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_DIR" --append-eod --workers 2

echo "== 3/4 train at $LENGTH tokens ($FACTOR x $BASE_LENGTH), RoPE base $ROTARY_BASE," \
     "seq1f1b k=$SPLITS, $TRAIN_ITERS iterations"
# Later flags win: --rotary-base and the lengths override what the converter printed.
# shellcheck disable=SC2086  # EXTRA is a list of flags
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" -m torch.distributed.run \
    --nproc-per-node $(( TP * PP )) --master-addr 127.0.0.1 --master-port "$PORT" \
    pretrain_gpt.py "${MODEL_FLAGS[@]}" \
    --seq-length "$LENGTH" --max-position-embeddings "$LENGTH" --rotary-base "$ROTARY_BASE" \
    --pipeline-schedule seq1f1b --seq1f1b-splits "$SPLITS" --seq1f1b-partition compute \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$(python3 -c "print($LR / 10)")" \
    --lr-decay-style cosine --lr-warmup-iters "$(( TRAIN_ITERS / 10 ))" --clip-grad 1.0 \
    --data-path "$OUT/data/corpus_text_document" --split 98,2,0 \
    --log-interval 1 --eval-interval "$TRAIN_ITERS" --eval-iters 1 \
    --save "$OUT/extended" --save-interval "$TRAIN_ITERS" $EXTRA \
    2>&1 | grep -v -e "UserWarning" -e "warnings.warn" | tee "$OUT/train.log"
[ -f "$OUT/extended/latest_checkpointed_iteration.txt" ] || {
    echo "extend_context.sh: error: training wrote no checkpoint (see $OUT/train.log)" >&2; exit 1; }

echo "== 4/4 export $OUT/extended -> $OUT/hf"
# The checkpoint carries the RoPE base and the context it was trained with: the exporter writes
# them (the context only when longer than config.json's).
"$PY" tools/checkpoint/convert.py megatron-to-hf --load "$OUT/extended" --save "$OUT/hf" \
    --hf-dir "$HF_DIR"
"$PY" - "$OUT/hf" "$LENGTH" <<'PY'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
folder, length = sys.argv[1], int(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
config = AutoConfig.from_pretrained(folder)
with torch.no_grad():
    logits = model(torch.arange(8).unsqueeze(0) % config.vocab_size).logits
assert config.max_position_embeddings >= length and torch.isfinite(logits).all()
print(f"transformers loads {folder}: {type(model).__name__}, rope_theta {config.rope_theta:g}, "
      f"max_position_embeddings {config.max_position_embeddings}")
PY
losses=$(grep -o "lm loss: [0-9.E+-]*" "$OUT/train.log" | awk '{print $3}')
echo "== done in $(( $(date +%s) - start )) s: lm loss $(echo "$losses" | head -n1) (first)" \
     "-> $(echo "$losses" | tail -n1) (last); Hugging Face folder $OUT/hf"
