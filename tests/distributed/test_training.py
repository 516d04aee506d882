"""The whole training loop is exact (CPU, one torchrun launch of 4 processes):

- resume: 2 x N iterations in one run equal N iterations (stopped by --exit-interval, which saves)
  plus N more resumed with --load: every logged loss, grad norm, learning rate and evaluation is
  identical, bit for bit. Two layouts: PP2 x DP2 with the distributed optimizer in fp32, and
  TP2 x PP2 x V2 (seq1f1b-interleaved, two model chunks per rank) in bf16 with megatron's
  mixed-precision optimizer; warm-up + cosine LR, evaluations before and after the resume;
- schedules: the same data and seed under --pipeline-schedule 1f1b and seq1f1b with k=4 give the
  same loss at every one of 10 iterations (rtol 1e-5) at TP2 x PP2 with sequence parallelism, and
  our 1f1b matches megatron-core's own 1F1B schedule (megatron-1f1b) over the same iterations;
- the TensorBoard scalars of a run are the figures it logged;
- preemption: SIGTERM on one rank with --exit-signal-handler stops every rank after that
  iteration with a checkpoint, and resuming from it logs what the straight run logged;
  --exit-duration-in-mins stops and saves after the first iteration past its budget;
- extending a finished run to twice its iterations with --override-opt_param-scheduler follows
  the new schedule (megatron-core's own scheduler, built fresh for 2 x 2N iterations, gives the
  expected rates); --use-checkpoint-opt_param-scheduler keeps the old one (its minimum);
- starting points: --no-load-optim --no-load-rng continues from the checkpoint's weights and data
  position (the next loss is the straight run's) with fresh Adam; --finetune and
  --pretrained-checkpoint start at iteration 0 from the same weights and log the same figures.
"""
import subprocess
import sys

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
        cases[(layout, "straight")] = {"argv": flags}
        cases[(layout, "first_half")] = {
            "argv": flags + ["--save", checkpoints, "--exit-interval", str(N)]}
        if layout == "dp2_distopt":      # from the checkpoint at N, before the next save
            cases["no_load_optim"] = {"argv": flags + ["--load", checkpoints, "--no-load-optim",
                                                       "--no-load-rng"]}
        cases[(layout, "resumed")] = {"argv": flags + ["--load", checkpoints, "--save",
                                                       checkpoints]}
    cases.update(_preemption_cases(data_prefix, root))
    cases.update({
        "1f1b": {"argv": _schedule_flags(data_prefix, "1f1b", 1) + [
            "--tensorboard-dir", str(root / "tensorboard")]},
        "seq1f1b": {"argv": _schedule_flags(data_prefix, "seq1f1b", 4)},
        "megatron-1f1b": {"argv": _schedule_flags(data_prefix, "megatron-1f1b", 1)},
    })
    out = run_cases(WORLD, "training_worker.py", list(cases.values()))
    by_name = dict(zip(cases, out))
    for name, result in by_name.items():
        assert "error" not in result, f"{name}: {result.get('traceback', result.get('error'))}"
    print("seconds per case:", {str(name): r["seconds"] for name, r in by_name.items()})
    by_name["checkpoint_root"] = str(root)
    return by_name


SIGTERM_AT = (1, 2)
"""Rank 1 (not the last, which logs) receives SIGTERM as iteration 2 starts."""


def _preemption_cases(data_prefix: str, root) -> dict:
    """Cases on the dp2_distopt layout, run after its straight / first_half / resumed cases (its
    checkpoint folder then holds iterations N and 2N, the tracker at 2N)."""
    flags = _resume_flags(data_prefix, "dp2_distopt")
    finished, signalled = str(root / "dp2_distopt"), str(root / "signalled")
    fine_tune = ["--train-iters", "3", "--eval-interval", "100"]
    return {
        "sigterm": {"argv": flags + ["--save", signalled, "--exit-signal-handler"],
                    "sigterm": list(SIGTERM_AT)},
        "after_sigterm": {"argv": flags + ["--load", signalled, "--save", signalled,
                                           "--exit-signal-handler"]},
        "duration": {"argv": flags + ["--save", str(root / "duration"),
                                      "--exit-duration-in-mins", "1e-6"]},
        "override": {"argv": _extended(flags, 4 * N) + [
            "--load", finished, "--override-opt_param-scheduler", "--eval-iters", "0"]},
        "use_checkpoint": {"argv": _extended(flags, 2 * N + 1) + [
            "--load", finished, "--use-checkpoint-opt_param-scheduler", "--eval-iters", "0"]},
        "finetune": {"argv": flags + fine_tune + ["--load", finished, "--finetune"]},
        "pretrained": {"argv": flags + fine_tune + [
            "--load", str(root / "finetuned"), "--save", str(root / "finetuned"),
            "--pretrained-checkpoint", finished]},
    }


def _extended(flags: list[str], train_iters: int) -> list[str]:
    """The same run asked to train to `train_iters` (the LR decays over them)."""
    at = flags.index("--train-iters")
    return flags[:at] + ["--train-iters", str(train_iters)] + flags[at + 2:]


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



def test_sigterm_on_one_rank_stops_all_after_the_iteration_and_resumes_exactly(results):
    first, resumed = results["sigterm"], results["after_sigterm"]
    straight = results[("dp2_distopt", "straight")]
    at = SIGTERM_AT[1]
    assert first["iteration"] == at and first["stopped_by"] == "received SIGTERM"
    assert first["checkpoints"] == [f"{results['checkpoint_root']}/signalled/iter_{at:07d}"]
    assert resumed["start_iteration"] == at and resumed["stopped_by"] is None
    assert first["history"] + resumed["history"] == straight["history"]


def test_exit_duration_stops_and_saves(results):
    result = results["duration"]
    assert result["iteration"] == 1 and result["stopped_by"].startswith("--exit-duration-in-mins")
    assert result["checkpoints"] == [f"{results['checkpoint_root']}/duration/iter_0000001"]


def _schedule(train_iters: int) -> list[float]:
    """The LR each iteration of a fresh run of the dp2_distopt flags uses, by megatron-core's
    scheduler: warm-up 2, cosine 2e-3 -> 2e-4 over `train_iters`, 8 samples per iteration."""
    from types import SimpleNamespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    group: dict = {}
    scheduler = OptimizerParamScheduler(
        SimpleNamespace(param_groups=[group]), init_lr=0.0, max_lr=2e-3, min_lr=2e-4,
        lr_warmup_steps=2 * 8, lr_decay_steps=train_iters * 8, lr_decay_style="cosine",
        start_wd=0.01, end_wd=0.01, wd_incr_steps=train_iters * 8, wd_incr_style="constant")
    rates = []
    for _ in range(train_iters):
        rates.append(group["lr"])
        scheduler.step(increment=8)
    return rates


def test_extending_a_run_follows_the_schedule_the_flags_choose(results):
    override, kept = results["override"], results["use_checkpoint"]
    assert override["start_iteration"] == 2 * N and override["iteration"] == 4 * N
    rates = [r["learning_rate"] for r in override["history"]]
    assert rates == pytest.approx(_schedule(4 * N)[2 * N:], rel=1e-12)
    assert min(rates) > 2e-4          # the old schedule had reached its minimum
    assert [r["learning_rate"] for r in kept["history"]] == [2e-4]
    straight = results[("dp2_distopt", "straight")]["history"]
    assert [r["learning_rate"] for r in straight] == pytest.approx(_schedule(2 * N), rel=1e-12)


def test_no_load_optim_continues_the_weights_and_data_with_fresh_adam(results):
    result, straight = results["no_load_optim"], results[("dp2_distopt", "straight")]["history"]
    assert result["start_iteration"] == N
    history = result["history"]
    assert history[0]["losses"] == straight[N]["losses"]       # W_N on batch N + 1
    assert history[0]["learning_rate"] == 0.0                  # Megatron: schedule not loaded
    assert history[2]["losses"] != straight[N + 2]["losses"]


def test_finetune_and_pretrained_checkpoint_start_from_the_weights(results):
    finetune, pretrained = results["finetune"], results["pretrained"]
    assert finetune["start_iteration"] == pretrained["start_iteration"] == 0
    assert [r["learning_rate"] for r in finetune["history"]] == [0.0, 1e-3, 2e-3]
    assert finetune["history"] == pretrained["history"]
    fresh = results[("dp2_distopt", "straight")]["history"][0]
    assert finetune["history"][0]["losses"]["lm loss"] < fresh["losses"]["lm loss"]
    assert pretrained["checkpoints"] == [f"{results['checkpoint_root']}/finetuned/iter_0000003"]
