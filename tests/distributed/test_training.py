"""The whole training loop is exact (CPU, one torchrun launch of 4 processes):

- resume: 2 x N iterations in one run equal N iterations (stopped by --exit-interval, which saves)
  plus N more resumed with --load: every logged loss, grad norm, learning rate and evaluation is
  identical, bit for bit. Two layouts: PP2 x DP2 with the distributed optimizer in fp32, and
  TP2 x PP2 x V2 (seq1f1b-interleaved, two model chunks per rank) in bf16 with megatron's
  mixed-precision optimizer; warm-up + cosine LR, evaluations before and after the resume;
- schedules: the same data and seed under --pipeline-schedule 1f1b and seq1f1b with k=4 give the
  same loss at every one of 10 iterations (rtol 1e-5) at TP2 x PP2 with sequence parallelism, and
  our 1f1b matches megatron-core's own 1F1B schedule (megatron-1f1b) over the same iterations;
- resharding: a checkpoint saved at one layout resumes at another (dist_checkpointing reshards the
  model and the optimizer, the padded vocabulary of the checkpoint is kept) and the next two
  iterations log the losses of a resume at the saving layout. TP2 x PP2 -> TP1 x PP4 with the
  Llama-shaped flags (GQA, SwiGLU, RMSNorm, no biases, RoPE, untied output) and Adam in fp32;
  PP4 -> PP2 x V2 x DP2 with the distributed optimizer saved --dist-ckpt-optim-fully-reshardable.
  A distributed optimizer saved in megatron's default format is refused at another TP/PP/V;
- the TensorBoard scalars of a run are the figures it logged.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ROOT, run_cases

WORLD = 4
N = 3
SCHEDULE_ITERS = 10


def _model_flags(data_prefix: str, micro_batch_size: int = 2) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "64", "--micro-batch-size", str(micro_batch_size),
            "--global-batch-size", "8",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--data-path", data_prefix,
            "--split", "90,8,2", "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style",
            "cosine", "--lr-warmup-iters", "2", "--log-interval", "1", "--seed", "7"]


RESUME_LAYOUTS = {
    "dp2_distopt": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                    "--pipeline-schedule", "seq1f1b", "--seq1f1b-splits", "2"],
    "tp2_v2_bf16": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1", "--bf16",
                    "--pipeline-schedule", "seq1f1b-interleaved", "--seq1f1b-splits", "2"],
}


LLAMA = ["--group-query-attention", "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size",
         "64", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type",
         "rope", "--untie-embeddings-and-output-weights"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--pipeline-schedule", "seq1f1b", "--seq1f1b-splits", "2"]
PP4 = ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "seq1f1b",
       "--seq1f1b-splits", "2"]
PP2_V2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--pipeline-schedule", "seq1f1b-interleaved", "--seq1f1b-splits", "2"]
DISTRIBUTED_OPTIMIZER = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
RESHARDS = {   # name: (flags of both runs, saving layout, resuming layout)
    "tp2pp2_to_tp1pp4": (LLAMA, TP2_PP2, PP4),
    "pp4_to_pp2v2": (DISTRIBUTED_OPTIMIZER, PP4, PP2_V2),
}
RESHARD_ITERS = N + 2
"""Save at N, resume for two iterations: the first one's loss reads the resharded weights, the
second one's the update that the resharded Adam moments and LR schedule made."""


def _reshard_cases(data_prefix: str, root) -> dict:
    cases = {}
    for name, (common, saving, resuming) in RESHARDS.items():
        flags = _model_flags(data_prefix) + common + [
            "--train-iters", str(RESHARD_ITERS), "--eval-iters", "0"]
        checkpoints = str(root / name)
        cases[(name, "straight")] = flags + saving
        cases[(name, "first_half")] = flags + saving + ["--save", checkpoints,
                                                        "--exit-interval", str(N)]
        cases[(name, "same_layout")] = flags + saving + ["--load", checkpoints]
        cases[(name, "resharded")] = flags + resuming + ["--load", checkpoints]
    return cases


def _resume_flags(data_prefix: str, layout: str) -> list[str]:
    return _model_flags(data_prefix) + RESUME_LAYOUTS[layout] + [
        "--train-iters", str(2 * N), "--eval-interval", "2", "--eval-iters", "1"]


def _schedule_flags(data_prefix: str, schedule: str, splits: int) -> list[str]:
    """Two micro-batches of 4 per iteration (fewer, larger spans: the same check, less time)."""
    return _model_flags(data_prefix, micro_batch_size=4) + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel", "--pipeline-schedule", schedule, "--seq1f1b-splits", str(splits),
        "--train-iters", str(SCHEDULE_ITERS), "--eval-interval", "5", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """The first 300 documents of the quickstart corpus, preprocessed with the byte tokenizer."""
    folder = tmp_path_factory.mktemp("data")
    lines = (ROOT / "examples" / "data" / "corpus.jsonl").read_text().splitlines()[:300]
    (folder / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"),
                    "--input", str(folder / "corpus.jsonl"), "--output-prefix",
                    str(folder / "corpus"), "--append-eod"], check=True, capture_output=True)
    return str(folder / "corpus_text_document")


@pytest.fixture(scope="module")
def results(data_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    cases = {}
    for layout in RESUME_LAYOUTS:
        flags, checkpoints = _resume_flags(data_prefix, layout), str(root / layout)
        cases[(layout, "straight")] = flags
        cases[(layout, "first_half")] = flags + ["--save", checkpoints, "--exit-interval", str(N)]
        cases[(layout, "resumed")] = flags + ["--load", checkpoints, "--save", checkpoints]
    cases.update(_reshard_cases(data_prefix, root))
    cases.update({
        "1f1b": _schedule_flags(data_prefix, "1f1b", 1) + ["--tensorboard-dir",
                                                            str(root / "tensorboard")],
        "seq1f1b": _schedule_flags(data_prefix, "seq1f1b", 4),
        "megatron-1f1b": _schedule_flags(data_prefix, "megatron-1f1b", 1),
    })
    out = run_cases(WORLD, "training_worker.py", [{"argv": argv} for argv in cases.values()])
    by_name = dict(zip(cases, out))
    for name, result in by_name.items():
        assert "error" not in result, f"{name}: {result.get('traceback', result.get('error'))}"
    print("seconds per case:", {str(name): r["seconds"] for name, r in by_name.items()})
    by_name["checkpoint_root"] = str(root)
    by_name["data_prefix"] = data_prefix
    return by_name


def _losses(result: dict) -> list[float]:
    return [record["losses"]["lm loss"] for record in result["history"]]


@pytest.mark.parametrize("layout", RESUME_LAYOUTS)
def test_exit_interval_stops_and_saves(results, layout):
    first = results[(layout, "first_half")]
    assert first["iteration"] == N and len(first["history"]) == N
    assert first["checkpoints"] == [f"{results['checkpoint_root']}/{layout}/iter_{N:07d}"]


@pytest.mark.parametrize("layout", RESUME_LAYOUTS)
def test_resumed_run_logs_exactly_what_the_straight_run_logged(results, layout):
    straight, first, resumed = (results[(layout, name)]
                                for name in ("straight", "first_half", "resumed"))
    assert resumed["start_iteration"] == N and resumed["iteration"] == 2 * N
    assert [r["iteration"] for r in resumed["history"]] == list(range(N + 1, 2 * N + 1))
    assert first["history"] + resumed["history"] == straight["history"]   # floats, bit for bit
    # the evaluation after the resume reads the validation data where the first half left it
    assert first["validation"] + resumed["validation"] == straight["validation"]


def test_loss_falls_and_lr_follows_warmup_then_cosine(results):
    history = results[("dp2_distopt", "straight")]["history"]
    assert [r["learning_rate"] for r in history[:2]] == [0.0, 1e-3]
    assert history[2]["learning_rate"] == pytest.approx(2e-3)
    assert all(a > b for a, b in zip([r["learning_rate"] for r in history[2:]],
                                     [r["learning_rate"] for r in history[3:]]))
    losses = _losses(results["1f1b"])
    assert losses[-1] < losses[0]


def test_tensorboard_holds_the_logged_figures(results):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(f"{results['checkpoint_root']}/tensorboard")
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "iteration-time", "tokens-per-second",
            "tflops-per-gpu", "peak-memory-mb/stage-0", "peak-memory-mb/stage-1",
            "lm loss validation", "lm loss test"} <= tags
    logged = [(e.step, e.value) for e in events.Scalars("lm loss")]
    assert logged == [(r["iteration"], pytest.approx(r["losses"]["lm loss"], rel=1e-6))
                      for r in results["1f1b"]["history"]]


@pytest.mark.parametrize("other", ["seq1f1b", "megatron-1f1b"])
def test_schedules_give_the_same_loss_at_every_iteration(results, other):
    reference, candidate = _losses(results["1f1b"]), _losses(results[other])
    assert len(reference) == len(candidate) == SCHEDULE_ITERS
    assert candidate == pytest.approx(reference, rel=1e-5, abs=0)
    ref_eval = [losses["lm loss"] for _, losses in results["1f1b"]["validation"]]
    got_eval = [losses["lm loss"] for _, losses in results[other]["validation"]]
    assert len(ref_eval) == 4    # iterations 5 and 10, end of training (valid, test)
    assert got_eval == pytest.approx(ref_eval, rel=1e-5, abs=0)
    grad_norms = [r["grad_norm"] for r in results[other]["history"]]
    assert grad_norms == pytest.approx([r["grad_norm"] for r in results["1f1b"]["history"]],
                                       rel=1e-4)


@pytest.mark.parametrize("name", RESHARDS)
def test_resharded_resume_logs_what_an_unchanged_resume_logs(results, name):
    """fp32 throughout. A TP change reorders the sums of the row-parallel layers' partial
    products and a DP change the gradient all-reduce, so bitwise equality is not guaranteed:
    measured, the losses differ by at most one float32 ulp (8e-8 relative at 6.06; rel 1e-6
    allows ~12) and the grad norms by at most 7e-7 relative (rel 1e-5 allowed). What goes wrong
    fails far beyond: TP1's own vocabulary padding instead of the checkpoint's moves the first
    loss by 0.29 (log 512/384), and a resume without the optimizer state the second loss by
    2.2e-3 relative and the second grad norm by 7%. The unchanged resume itself continues a
    straight run at the saving layout bit for bit, so the reference carries the whole state."""
    straight, first, same, resharded = (results[(name, case)] for case in (
        "straight", "first_half", "same_layout", "resharded"))
    assert first["history"] + same["history"] == straight["history"]   # the reference is exact
    assert same["start_iteration"] == resharded["start_iteration"] == N
    assert [r["iteration"] for r in resharded["history"]] == [N + 1, N + 2]
    assert _losses(resharded) == pytest.approx(_losses(same), rel=1e-6, abs=0)
    assert [r["learning_rate"] for r in resharded["history"]] == \
        [r["learning_rate"] for r in same["history"]]
    assert [r["grad_norm"] for r in resharded["history"]] == \
        pytest.approx([r["grad_norm"] for r in same["history"]], rel=1e-5)


def test_resume_keeps_the_checkpoints_padded_vocabulary(results):
    """The byte tokenizer's 257 ids pad to 512 rows at TP2 and to 384 at TP1; resuming the TP2
    checkpoint at TP1 keeps its 512 (the padding rows are logits in the softmax)."""
    from megatron.training.arguments import parse_args, validate_args

    common, saving, resuming = RESHARDS["tp2pp2_to_tp1pp4"]
    flags = _model_flags(results["data_prefix"]) + common + resuming + [
        "--train-iters", str(RESHARD_ITERS)]
    assert validate_args(parse_args(flags), WORLD).padded_vocab_size == 384
    checkpoints = f"{results['checkpoint_root']}/tp2pp2_to_tp1pp4"
    resumed = validate_args(parse_args(flags + ["--load", checkpoints]), WORLD)
    assert resumed.padded_vocab_size == 512


def test_a_dp_reshardable_optimizer_at_another_layout_is_refused_in_one_line(results):
    """The PP2 x DP2 resume case saved the distributed optimizer in megatron's default format:
    pretrain_gpt.py at PP4 exits 2 with one line naming --load and the flag, having written
    nothing."""
    checkpoints = Path(results["checkpoint_root"]) / "dp2_distopt"
    flags = _resume_flags(results["data_prefix"], "dp2_distopt") + [
        "--pipeline-model-parallel-size", "4", "--load", str(checkpoints)]
    before = {path: path.stat().st_mtime_ns for path in checkpoints.rglob("*")}
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *flags],
                          env={**os.environ, "WORLD_SIZE": str(WORLD), "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(
        r"pretrain_gpt.py: error: --load: \S+/iter_0000006 holds the distributed optimizer's "
        r"state in the dp_reshardable format, which reshards across DP only; it was saved at "
        r"TP1 x PP2 x V1 x DP2, this run is TP1 x PP4 x V1 x DP1 \(save with "
        r"--dist-ckpt-optim-fully-reshardable to change TP, PP or V\)\n", proc.stderr), proc.stderr
    assert proc.stdout == ""
    assert {path: path.stat().st_mtime_ns for path in checkpoints.rglob("*")} == before


def test_a_distributed_optimizers_state_is_not_read_by_another_optimizer(results):
    from megatron.training.arguments import ArgumentError, parse_args, validate_args

    flags = [flag for flag in _resume_flags(results["data_prefix"], "dp2_distopt")
             if flag != "--use-distributed-optimizer"]
    with pytest.raises(ArgumentError, match="^--load: .* was saved with "
                                            "--use-distributed-optimizer; its optimizer state"):
        validate_args(parse_args(flags + ["--load", f"{results['checkpoint_root']}/dp2_distopt"]),
                      WORLD)
