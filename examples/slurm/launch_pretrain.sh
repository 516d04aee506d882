# Shared body of the pretrain_gpt_*.sbatch scripts: sourced by them, never run on its own.
#
# The sbatch script sets the paper's defaults for its model (NUM_LAYERS, HIDDEN_SIZE,
# NUM_ATTENTION_HEADS, TP, PP, SEQ_LENGTH, MICRO_BATCHES, ...) with `: "${VAR:=value}"`, so every
# one of them can be overridden from the environment at submission; then it sources this file,
# which starts one rank per GPU on every node and trains with pretrain_gpt.py.
#
# Environment (defaults in brackets):
#   LAUNCHER        srun: one Slurm task per GPU, ranks from SLURM_PROCID/SLURM_NTASKS [srun]
#                   torchrun: one Slurm task per node running torchrun with GPUS_PER_NODE ranks
#                   (submit with --ntasks-per-node=1)
#                   local: no Slurm, torchrun on this machine (examples/pretrain_gpt_single_node.sh)
#   GPUS_PER_NODE   ranks per node with torchrun [SLURM_GPUS_ON_NODE, else the GPUs nvidia-smi
#                   lists, else 8]
#   SCHEDULE, SPLITS    --pipeline-schedule and k [seq1f1b, 4 (1 for non-seq1f1b schedules)]
#   PARTITION_METHOD    --seq1f1b-partition [compute]
#   VPP_LAYERS      --num-layers-per-virtual-pipeline-stage, for the interleaved schedules [unset]
#   CP              --context-parallel-size [1]; DP = world / (TP x PP x CP)
#   MICRO_BATCHES   micro-batches per iteration and DP rank; global batch = this x DP x MICRO_BATCH
#   MICRO_BATCH     --micro-batch-size [1]
#   TRAIN_ITERS, LOG_INTERVAL  [20, 1]
#   DATA_PATH       Megatron --data-path (prefixes, or WEIGHT PREFIX pairs); empty: --mock-data with
#                   Megatron's NullTokenizer at GPT-2's vocabulary (VOCAB_SIZE [50257])
#   TOKENIZER_TYPE, VOCAB_FILE, MERGE_FILE, TOKENIZER_MODEL  with DATA_PATH [GPT2BPETokenizer]
#   PRECISION       [--bf16]; empty for fp32
#   SAVE_INTERVAL   checkpoint every N iterations into RUN_DIR/checkpoints and resume from there
#                   when it holds one [unset: no checkpoints]
#   RUN_DIR         logs and checkpoints [runs/slurm-<job name>-<job id>]
#   PYTHON          [.venv/bin/python of the repository, else python3]
#   MASTER_PORT     rendezvous port on the first node [20000 + job id mod 20000]
#   P2P_TIMEOUT     seconds a pipeline send/receive may wait [600]
#   EXTRA_ARGS      more pretrain_gpt.py flags; arguments given to sbatch after the script too
#   CONTAINER_ARGS  extra srun options, e.g. "--container-image=... --container-mounts=..."
#
# Preemption: the sbatch scripts ask Slurm for SIGTERM 2 minutes before the time limit
# (`#SBATCH --signal=TERM@120`; Slurm may send it up to a minute earlier; a model whose checkpoint
# takes longer to write wants more, e.g. `sbatch --signal=TERM@600`), and pretrain_gpt.py
# runs with --exit-signal-handler: every rank finishes the iteration, saves (with SAVE_INTERVAL)
# and exits 0. Submitting the same job again resumes from that checkpoint.
#
# Output: the launch line (nodes, world, layout), Megatron's log line per LOG_INTERVAL, and as the
# last line the job summary of examples/slurm/job_results.py (SEQ1F1B_RESULT status=OK|OOM|...);
# the job's exit code is the launcher's (a failed or killed rank fails the job with its code).

set -uo pipefail

REPO="${REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
cd "$REPO" || { echo "launch_pretrain.sh: repository $REPO not found" >&2; exit 2; }
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ -x "$REPO/.venv/bin/python" ] && PYTHON="$REPO/.venv/bin/python"
fi

: "${LAUNCHER:=srun}" "${SCHEDULE:=seq1f1b}" "${PARTITION_METHOD:=compute}"
# k = 4 for the seq1f1b* schedules; the others run whole sequences unless SPLITS says otherwise.
case "$SCHEDULE" in seq1f1b*) : "${SPLITS:=4}" ;; *) : "${SPLITS:=1}" ;; esac
: "${CP:=1}" "${MICRO_BATCH:=1}" "${TRAIN_ITERS:=20}" "${LOG_INTERVAL:=1}" "${VOCAB_SIZE:=50257}"
: "${TOKENIZER_TYPE:=GPT2BPETokenizer}" "${P2P_TIMEOUT:=600}" "${DATA_PATH:=}"
: "${EXTRA_ARGS:=}" "${CONTAINER_ARGS:=}" "${SAVE_INTERVAL:=}"
PRECISION="${PRECISION---bf16}"
RUN_DIR="${RUN_DIR:-runs/slurm-${SLURM_JOB_NAME:-job}-${SLURM_JOB_ID:-0}}"
mkdir -p "$RUN_DIR"

NODES="${SLURM_NNODES:-1}"
HOSTS=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" 2>/dev/null || hostname)
export MASTER_ADDR="${MASTER_ADDR:-$(echo "$HOSTS" | head -n1)}"
export MASTER_PORT="${MASTER_PORT:-$(( 20000 + ${SLURM_JOB_ID:-0} % 20000 ))}"
export CUDA_DEVICE_MAX_CONNECTIONS=1       # megatron's TP communication overlap needs it
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

case "$LAUNCHER" in
    srun) WORLD="${SLURM_NTASKS:-1}" ;;
    torchrun|local)
        if [ -z "${GPUS_PER_NODE:-}" ]; then
            GPUS_PER_NODE="${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}"
            [ "${GPUS_PER_NODE:-0}" -gt 0 ] || GPUS_PER_NODE=8
        fi
        WORLD=$(( NODES * GPUS_PER_NODE )) ;;
    *) echo "launch_pretrain.sh: LAUNCHER must be srun, torchrun or local, not '$LAUNCHER'" >&2
       exit 2 ;;
esac
MODEL_PARALLEL=$(( TP * PP * CP ))
if [ "$WORLD" -lt "$MODEL_PARALLEL" ] || [ $(( WORLD % MODEL_PARALLEL )) -ne 0 ]; then
    echo "launch_pretrain.sh: TP=$TP x PP=$PP x CP=$CP does not divide the $WORLD ranks" >&2; exit 2
fi
DP=$(( WORLD / MODEL_PARALLEL ))
GLOBAL_BATCH=$(( MICRO_BATCHES * DP * MICRO_BATCH ))

ARGS=(--num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE"
      --num-attention-heads "$NUM_ATTENTION_HEADS" --seq-length "$SEQ_LENGTH"
      --max-position-embeddings "$SEQ_LENGTH" --position-embedding-type rope
      --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0
      --init-method-std 0.006
      --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
      --context-parallel-size "$CP"
      --use-distributed-optimizer
      --pipeline-schedule "$SCHEDULE" --seq1f1b-splits "$SPLITS"
      --seq1f1b-partition "$PARTITION_METHOD"
      --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
      --train-iters "$TRAIN_ITERS" --lr 6e-5 --min-lr 6e-6 --lr-decay-style cosine
      --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
      --log-interval "$LOG_INTERVAL" --eval-iters 0 --p2p-timeout "$P2P_TIMEOUT"
      --exit-signal-handler)
[ "$TP" -gt 1 ] && ARGS+=(--sequence-parallel)
[ -n "$PRECISION" ] && ARGS+=("$PRECISION")
if [ -n "${VPP_LAYERS:-}" ]; then ARGS+=(--num-layers-per-virtual-pipeline-stage "$VPP_LAYERS"); fi
if [ -z "$DATA_PATH" ]; then
    ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
else
    # shellcheck disable=SC2206  # DATA_PATH is a list: prefixes or WEIGHT PREFIX pairs
    ARGS+=(--data-path $DATA_PATH --tokenizer-type "$TOKENIZER_TYPE")
    [ -n "${VOCAB_FILE:-}" ] && ARGS+=(--vocab-file "$VOCAB_FILE")
    [ -n "${MERGE_FILE:-}" ] && ARGS+=(--merge-file "$MERGE_FILE")
    [ -n "${TOKENIZER_MODEL:-}" ] && ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
fi
if [ -n "$SAVE_INTERVAL" ]; then
    ARGS+=(--save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints"
           --save-interval "$SAVE_INTERVAL")
    mkdir -p "$RUN_DIR/checkpoints"
fi
# shellcheck disable=SC2206  # EXTRA_ARGS is a list of flags
ARGS+=($EXTRA_ARGS "$@")

echo "launch: LAUNCHER=$LAUNCHER nodes=$NODES ($(echo "$HOSTS" | paste -sd, -)) world=$WORLD" \
     "TP=$TP PP=$PP CP=$CP DP=$DP schedule=$SCHEDULE k=$SPLITS L=$SEQ_LENGTH m=$MICRO_BATCHES" \
     "master=$MASTER_ADDR:$MASTER_PORT run_dir=$RUN_DIR"

LOG="$RUN_DIR/train.log"
# Every Slurm task records its own exit code in RUN_DIR/exit.<task>: after the first failure srun
# kills the other tasks and reports them as 128 + signal, which would hide the failing rank's code.
# The task's shell outlives Slurm's early SIGTERM (trapped, not ignored: the ranks it starts still
# receive it) to record the code of the rank that saved and exited.
RECORD_EXIT='trap : TERM; "$@"; code=$?; echo "$code" > "$RUN_DIR/exit.$SLURM_PROCID"; exit "$code"'
export RUN_DIR
rm -f "$RUN_DIR"/exit.*
# shellcheck disable=SC2086  # CONTAINER_ARGS is a list of srun options
if [ "$LAUNCHER" = local ]; then
    "$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS_PER_NODE" \
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" pretrain_gpt.py "${ARGS[@]}" \
        2>&1 | tee "$LOG"
elif [ "$LAUNCHER" = srun ]; then
    srun --kill-on-bad-exit=1 $CONTAINER_ARGS bash -c "$RECORD_EXIT" rank \
        "$PYTHON" pretrain_gpt.py "${ARGS[@]}" 2>&1 | tee "$LOG"
else
    # One torchrun per node; SLURM_NODEID is read inside each task, hence the inner shell.
    srun --kill-on-bad-exit=1 --ntasks-per-node=1 $CONTAINER_ARGS bash -c \
        'set -- "$0" -m torch.distributed.run --nnodes "$SLURM_NNODES" \
            --node-rank "$SLURM_NODEID" --nproc-per-node "$1" --master-addr "$MASTER_ADDR" \
            --master-port "$MASTER_PORT" pretrain_gpt.py "${@:2}"; '"$RECORD_EXIT" \
        "$PYTHON" "$GPUS_PER_NODE" "${ARGS[@]}" 2>&1 | tee "$LOG"
fi
STATUS=${PIPESTATUS[0]}
# The job's exit code: that of the task that failed first (none recorded: srun's own).
for exit_file in $(ls -tr "$RUN_DIR"/exit.* 2>/dev/null); do
    code=$(cat "$exit_file")
    if [ "$code" != 0 ]; then STATUS=$code; break; fi
done

"$PYTHON" examples/slurm/job_results.py summarize --log "$LOG" --exit-code "$STATUS" \
    model="$MODEL_NAME" nodes="$NODES" gpus="$WORLD" tp="$TP" pp="$PP" dp="$DP" \
    schedule="$SCHEDULE" splits="$SPLITS" seq_length="$SEQ_LENGTH" \
    micro_batches="$MICRO_BATCHES"
exit "$STATUS"
