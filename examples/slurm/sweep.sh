#!/bin/bash
# The paper's sweep on Slurm: one job of an example script per cell of
# schedule x k x sequence length x micro-batches, and one result row per job (OOM rows included).
#
#   SCHEDULES="1f1b seq1f1b" SPLITS="2 4" SEQ_LENGTHS="16384 24576 32768" MICRO_BATCHES="32" \
#       examples/slurm/sweep.sh [--out DIR] [--wait] [--SBATCH-OPTION=VALUE ...] SCRIPT [ARG ...]
#   examples/slurm/sweep.sh --collect DIR
#
# SPLITS (k) applies to the seq1f1b* schedules; the other schedules run once each with k = 1.
# With --wait, a failed squeue is asked again every 2 s, up to SQUEUE_TRIES (30) times in a row.
# Each job gets SCHEDULE, SPLITS, SEQ_LENGTH and MICRO_BATCHES in its environment (the example
# scripts read them) and everything else exported here; sbatch options go before SCRIPT in their
# --name=value form, ARGs after it reach the script (and pretrain_gpt.py). The jobs' output files
# and run folders (RUN_DIR: training log, checkpoints), DIR/jobs.tsv (what was submitted) and
# DIR/results.csv (one row per job, written by --wait and --collect through job_results.py) all
# live in DIR (default: runs/sweep-<date>-<time>).
set -euo pipefail

usage() { echo "sweep.sh: error: $1" >&2; exit 2; }
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"

collect() {
    "$PYTHON" "$HERE/job_results.py" collect "$1"
    echo "results: $1/results.csv"
}

OUT="runs/sweep-$(date +%Y%m%d-%H%M%S)"
WAIT=0
SBATCH_OPTIONS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --collect) [ $# -eq 2 ] || usage "--collect takes one folder and nothing else"
                   collect "$2"; exit 0 ;;
        --out) [ $# -ge 2 ] || usage "--out needs a folder"; OUT="$2"; shift 2 ;;
        --out=*) OUT="${1#--out=}"; shift ;;
        --wait) WAIT=1; shift ;;
        --*=*) SBATCH_OPTIONS+=("$1"); shift ;;
        -*) usage "sbatch option $1: give it as --name=value, before the script" ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || usage "no sbatch script given"
SCRIPT="$1"; shift
[ -f "$SCRIPT" ] || usage "script $SCRIPT not found"
# Job names start with the script's model and GPUs (pretrain_gpt_7b_32gpu.sbatch: 7b_32gpu), the
# part squeue's 8-character NAME column shows, so two models' sweeps tell apart.
MODEL="$(basename "$SCRIPT" .sbatch)"; MODEL="${MODEL#pretrain_gpt_}"
: "${SCHEDULES:=1f1b seq1f1b}" "${SPLITS:=4}"
[ -n "${SEQ_LENGTHS:-}" ] || usage "set SEQ_LENGTHS (e.g. SEQ_LENGTHS=\"16384 32768\")"
[ -n "${MICRO_BATCHES:-}" ] || usage "set MICRO_BATCHES (e.g. MICRO_BATCHES=32)"
: "${SQUEUE_TRIES:=30}"    # --wait: squeue failures in a row before giving up (below)
for value in $SPLITS $SEQ_LENGTHS $MICRO_BATCHES $SQUEUE_TRIES; do
    [[ "$value" =~ ^[1-9][0-9]*$ ]] || usage "SPLITS, SEQ_LENGTHS, MICRO_BATCHES, SQUEUE_TRIES: $value is not a positive integer"
done

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
[ ! -e "$OUT/jobs.tsv" ] || usage "$OUT already holds a sweep (jobs.tsv): use another --out"
printf 'job_id\toutput\tschedule\tsplits\tseq_length\tmicro_batches\n' > "$OUT/jobs.tsv"
JOB_IDS=()
for schedule in $SCHEDULES; do
    case "$schedule" in seq1f1b*) ks="$SPLITS" ;; *) ks=1 ;; esac
    for k in $ks; do
        for length in $SEQ_LENGTHS; do
            for m in $MICRO_BATCHES; do
                name="sweep-$schedule-k$k-L$length-m$m"
                output="$OUT/$name-%j.out"
                id=$(SCHEDULE="$schedule" SPLITS="$k" SEQ_LENGTH="$length" MICRO_BATCHES="$m" \
                    RUN_DIR="$OUT/$name" sbatch --parsable --export=ALL --job-name="$MODEL-$schedule-k$k-L$length-m$m" --output="$output" \
                    ${SBATCH_OPTIONS[@]+"${SBATCH_OPTIONS[@]}"} "$SCRIPT" "$@")
                id="${id%%;*}"
                printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$output" "$schedule" "$k" "$length" \
                    "$m" >> "$OUT/jobs.tsv"
                JOB_IDS+=("$id")
                echo "submitted $id $name"
            done
        done
    done
done

if [ "$WAIT" -eq 0 ]; then
    echo "collect when done: $0 --collect $OUT"
    exit 0
fi
# Wait until none of the sweep's jobs is in the queue. A failed squeue (a busy slurmctld times
# out) is not an empty queue: it is asked again, or collecting would write the jobs still running
# as FAILED (a CI run under load did). SQUEUE_TRIES failures in a row give up, jobs untouched.
failures=0
while :; do
    if listed="$(squeue -h --me -o %i)"; then
        failures=0
        grep -qFx -f <(printf '%s\n' "${JOB_IDS[@]}") <<< "$listed" || break
    elif [ $((failures += 1)) -ge "$SQUEUE_TRIES" ]; then
        echo "sweep.sh: error: squeue failed $failures times in a row; the jobs may still be running: collect them when done with $0 --collect $OUT" >&2
        exit 1
    fi
    sleep 2
done
collect "$OUT"
