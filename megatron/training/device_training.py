"""device_check's training part: pretrain_gpt.py on one device, seq1f1b with k=1 and k=4.

Both runs train the same model from the same seed on the same mock data with dropout off, so
they differ only in how each sequence is cut into spans: in fp32 their losses would be equal to
~1e-6 (tests/distributed/test_training.py); in bf16 each run rounds differently and the
trajectories drift apart by rounding noise. The part reports both runs' per-iteration losses,
their largest relative difference, and the last log line as printed (tokens/s and TFLOPS/GPU
from the trainer's own figures), and calls the losses in agreement when that difference stays
under `BF16_LOSS_TOLERANCE`. Two late iterations of each run are profiled (`--profile`), and
`kernels` says where their GPU time went (seq1f1b/device_checks/kernel_time.py): whether k=4's
extra time is in the kernels or in the GPU waiting for the host.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from seq1f1b.device_checks.kernel_time import summarize_trace

ROOT = Path(__file__).resolve().parents[2]
BF16_LOSS_TOLERANCE = 0.02
"""2% relative: five times bf16's unit roundoff (2^-8), for losses that are means over the
batch's tokens after up to 20 updates whose gradients were rounded differently."""
SPLITS = (1, 4)
_LOSS = re.compile(r"\blm loss: ([0-9.E+-]+)")
_TOKENS = re.compile(r"\btokens/s: ([0-9.]+)")
_TFLOPS = re.compile(r"\bTFLOPS/GPU: ([0-9.]+)")


@dataclass(frozen=True)
class TrainingShape:
    """The model and run of the training part."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    iterations: int
    bf16: bool


GPU_TRAINING = TrainingShape(num_layers=24, hidden_size=2048, num_attention_heads=16,
                             seq_length=16384, vocab_size=50257, iterations=20, bf16=True)
"""The paper's 1.3B configuration (PAPER.md) at 16K tokens."""
TINY_TRAINING = TrainingShape(num_layers=2, hidden_size=64, num_attention_heads=4,
                              seq_length=128, vocab_size=128, iterations=4, bf16=True)


def profiled_steps(iterations: int) -> tuple[int, int]:
    """[start, end) of the two profiled iterations: late enough to be warm, before the last,
    whose log line gives the run's tokens/s and TFLOPS unslowed by the profiler."""
    start = max(iterations - 4, 1)
    return start, start + 2


def command(shape: TrainingShape, splits: int, trace_dir: str) -> list[str]:
    """The pretrain_gpt.py command line of one run (one process, PP = 1), profiled into
    `trace_dir` (kernel_time.py reads the trace)."""
    start, end = profiled_steps(shape.iterations)
    flags = [
        "--num-layers", shape.num_layers, "--hidden-size", shape.hidden_size,
        "--num-attention-heads", shape.num_attention_heads, "--seq-length", shape.seq_length,
        "--max-position-embeddings", shape.seq_length, "--position-embedding-type", "rope",
        "--micro-batch-size", 1, "--global-batch-size", 1, "--train-iters", shape.iterations,
        "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine",
        "--hidden-dropout", 0, "--attention-dropout", 0, "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", shape.vocab_size,
        "--pipeline-schedule", "seq1f1b", "--seq1f1b-splits", splits,
        "--seq1f1b-partition", "compute", "--log-interval", 1, "--eval-iters", 0,
        "--profile", "--profile-step-start", start, "--profile-step-end", end,
        "--tensorboard-dir", trace_dir,
    ] + (["--bf16"] if shape.bf16 else [])
    # --standalone: a rendezvous on a port the OS gives (a fixed one was once taken by another
    # process of the suite: EADDRINUSE, and the run was lost)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "1", str(ROOT / "pretrain_gpt.py")] + [str(flag) for flag in flags]


_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?(?:[A-Za-z_][\w.]*\.)?\w*(?:Error|Exception)\b")
STDERR_TAIL_LINES = 40


def _failure(stderr: str) -> dict:
    """A failed run's error: the child's own exception line, not torchrun's closing banner
    (its last stderr line is a row of '=' and its summary names only ChildFailedError), and
    the stderr's tail, which is all the device session brings back of a run that failed."""
    lines = [line.rstrip() for line in stderr.splitlines() if line.strip()]
    raised = [line for line in lines
              if _EXCEPTION.match(line.strip()) and "ChildFailedError" not in line]
    error = raised[-1] if raised else (lines[-1] if lines else "no log line")
    return {"error": error.strip(), "stderr_tail": lines[-STDERR_TAIL_LINES:]}


def child_environment() -> dict:
    """The run's environment: the repo root first on PYTHONPATH, and the caller's entries kept
    (the GPU machine finds megatron-core only through them: tools/gpu_suite.sh)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _run(shape: TrainingShape, splits: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="device_training_") as trace_dir:
        result = _run_into(shape, splits, timeout_s, trace_dir)
        if "error" not in result:
            result["kernels"] = _kernels(Path(trace_dir), *profiled_steps(shape.iterations))
    return result


def _kernels(trace_dir: Path, start: int, end: int) -> dict:
    traces = sorted(trace_dir.glob("*.pt.trace.json"))
    if not traces:
        return {"skipped": "the run wrote no profiler trace"}
    return summarize_trace(traces[-1], end - start)


def _run_into(shape: TrainingShape, splits: int, timeout_s: float, trace_dir: str) -> dict:
    argv = command(shape, splits, trace_dir)
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(timeout_s, 1),
                              env=child_environment())
    except subprocess.TimeoutExpired:
        return {"command": " ".join(argv[3:]), "error": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if _LOSS.search(line)
             and "iteration" in line and "validation" not in line]
    result = {"command": " ".join(argv[3:]), "returncode": proc.returncode,
              "losses": [float(_LOSS.search(line).group(1)) for line in lines]}
    if proc.returncode != 0 or not lines:
        result.update(_failure(proc.stderr))
        return result
    last = lines[-1]
    result.update(last_log_line=last.strip(),
                  tokens_per_s=float(_TOKENS.search(last).group(1)) if _TOKENS.search(last)
                  else None,
                  tflops_per_gpu=float(_TFLOPS.search(last).group(1)) if _TFLOPS.search(last)
                  else None)
    return result


def check_training(shape: TrainingShape, deadline) -> dict:
    """Both runs, each given half of what is left of the part's budget, and their comparison."""
    runs = {}
    for index, splits in enumerate(SPLITS):
        left = deadline.remaining() / (len(SPLITS) - index)
        runs[f"k{splits}"] = _run(shape, splits, left)
    result = {"shape": vars(shape), "runs": runs}
    losses = [run.get("losses", []) for run in runs.values()]
    if all(losses) and len(losses[0]) == len(losses[1]) == shape.iterations:
        diff = max(abs(a - b) / abs(b) for a, b in zip(*losses))
        result.update(max_rel_loss_diff=diff, tolerance=BF16_LOSS_TOLERANCE,
                      losses_agree=diff <= BF16_LOSS_TOLERANCE)
    else:
        result["losses_agree"] = None       # a run failed or was cut short: see its entry
    return result
