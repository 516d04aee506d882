"""The whole training loop is exact (CPU, one torchrun launch of 4 processes):

- resume: 2 x N iterations in one run equal N iterations (stopped by --exit-interval, which saves)
  plus N more resumed with --load: every logged loss, grad norm, learning rate and evaluation is
  identical, bit for bit. Three layouts: PP2 x DP2 with the distributed optimizer in fp32, the
  same with --overlap-grad-reduce and --overlap-param-gather (same figures and same saved weights
  as without), and
  TP2 x PP2 x V2 (seq1f1b-interleaved, two model chunks per rank) in bf16 with megatron's
  mixed-precision optimizer; warm-up + cosine LR, evaluations before and after the resume;
- schedules: the same data and seed under --pipeline-schedule 1f1b and seq1f1b with k=4 give the
  same loss at every one of 10 iterations (rtol 1e-5) at TP2 x PP2 with sequence parallelism, and
  our 1f1b matches megatron-core's own 1F1B schedule (megatron-1f1b) over the same iterations;
- packed documents: with --reset-attention-mask --reset-position-ids --eod-mask-loss and RoPE at
  PP4 (two middle stages, which then read the data too), 1f1b and seq1f1b with k=4 give the same
  loss at every one of 10 iterations and the same evaluations (masked alike);
- resharding: a checkpoint saved at one layout resumes at another (dist_checkpointing reshards the
  model and the optimizer, the padded vocabulary of the checkpoint is kept) and the next two
  iterations log the losses of a resume at the saving layout. TP2 x PP2 -> TP1 x PP4 with the
  Llama-shaped flags (GQA, SwiGLU, RMSNorm, no biases, RoPE, untied output) and Adam in fp32;
  PP4 -> PP2 x V2 x DP2 with the distributed optimizer saved --dist-ckpt-optim-fully-reshardable.
  A distributed optimizer saved in megatron's default format is refused at another TP/PP/V;
- V placements (zbv, seq1f1b-zbv, and seq1f1b-zb-auto under --schedule-memory-cap with the fit
  partition, re-placed with the measured times on the placement it chose) and the search on one
  chunk per rank (a loop): each resumes the Llama-shaped loop checkpoint at TP2 x PP2 and logs the
  loop's losses, and the search says where it placed itself; zbv trained from the start (evaluating on the V) resumes
  bit for bit, and its checkpoint resumes in the loop with the V's losses, with the output layer
  tied to the embedding (as are the spread V's and the spread loop's runs);
  --pipeline-schedule-file with the seq1f1b-zbv plan written to a file trains bit for bit as
  that schedule; uneven stages (--decoder-first-pipeline-num-layers 1) resume the even
  checkpoint with its losses, and so does a --pipeline-model-parallel-layout; --search-layout
  trains the layout it chose as that layout given by hand;
- checkpoints: --async-save publishes each checkpoint only after every rank wrote it (the tracker
  names the previous one until then) and its resume is exact; --no-save-optim --no-save-rng
  leave those states out and the load asks for --no-load-optim; --skip-train only evaluates;
- the TensorBoard scalars of a run are the figures it logged (Megatron-LM's per-iteration tags
  every --tensorboard-log-interval, timers with --log-timers-to-tensorboard), and W&B (a fake
  `wandb` module on PYTHONPATH with WANDB_MODE=offline: the package is not installed here) gets
  the same ones;
- overlap: --overlap-grad-reduce and --overlap-param-gather (distributed optimizer) at PP2 x DP2
  leave every loss, grad norm and evaluation of 10 iterations bit for bit as without overlap,
  under 1f1b (unaligned gathers), seq1f1b, the split-backward seq1f1b-zb-h1 (gradients of the
  weights come in at W) and seq1f1b-interleaved (two chunks, all-reduce without the distributed
  optimizer);
- observability: the log line's timestamp and nan-iteration count, megatron's timers at
  --timing-log-level 2 after each line, and --profile's chrome traces on the ranks asked for,
  holding the executor's actions by name;
- measured spans: --seq1f1b-partition fit calibrates on the first two iterations, logs the fit
  and boundaries that cut the sequence, and the run trains on with the losses of the even cut;
  --timeline-path draws a later iteration from every pipeline rank's actions, with the actions
  as JSON beside it, in seconds within that iteration;
- preemption: SIGTERM on one rank with --exit-signal-handler stops every rank after that
  iteration with a checkpoint, and resuming from it logs what the straight run logged;
  --exit-duration-in-mins stops and saves after the first iteration past its budget;
- extending a finished run to twice its iterations with --override-opt_param-scheduler follows
  the new schedule (megatron-core's own scheduler, built fresh for 2 x 2N iterations, gives the
  expected rates); --use-checkpoint-opt_param-scheduler keeps the old one (its minimum);
- starting points: --no-load-optim --no-load-rng continues from the checkpoint's weights and data
  position (the next loss is the straight run's) with fresh Adam, and on a V with the output
  layer tied (distributed optimizer, both overlaps) with the same figures; --finetune and
  --pretrained-checkpoint start at iteration 0 from the same weights and log the same figures.
"""
import json
import math
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

import pytest

from launch import ROOT, run_cases
from seq1f1b.plan import registry, schedule_file

sys.path.insert(0, str(ROOT / "tests"))
import megatron_llama3_script as llama3  # noqa: E402
from spread_orders import spread_order  # noqa: E402

WORLD = 4
CASES_PER_LAUNCH = 10
"""Runs per torchrun launch. A finished run's gloo groups are destroyed, but some of their
threads outlive it (about 16 groups' worth per run at this world size), so one launch for all
~70 runs would end with ~1,000 polling threads per rank; a few launches keep that bounded for
~17 s of start-up each. Three things hold a finished run: the config's `grad_scale_func` (the
optimizer's bound `scale_loss`, whose shards reach megatron's DDP through the gradient
accumulators' C++ hooks, a cycle the collector cannot see), the spread output head's last input
(the last stage's own output, its autograd graph) and megatron's lru_cache on
`RotaryEmbedding.forward` (keyed on the module). With all three cut every run's groups end with
it, and this module ran in one launch in 449-485 s (three runs) against 644 s. But with the
groups freed, one run of this module in six (the first cut alone) aborted a rank with a heap
error in a gloo all_gather, and a suite run with all three cut hung in an evaluation's param
all-gather (start_param_sync: a distributed-optimizer run with --overlap-param-gather); so they
are kept out (8456c8c, 1e02335) until that is understood."""
N = 3
SCHEDULE_ITERS = 10
FIT_ITERS = 2
TIMELINE_AT = FIT_ITERS + 1
"""The fit case's timeline: the first iteration of the fitted cut."""


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
    # the same with overlap: the optimizer step leaves the parameters sharded, saving gathers
    "dp2_distopt_overlap": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                            "--pipeline-schedule", "seq1f1b", "--seq1f1b-splits", "2",
                            "--overlap-grad-reduce", "--overlap-param-gather"],
    "tp2_v2_bf16": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1", "--bf16",
                    "--pipeline-schedule", "seq1f1b-interleaved", "--seq1f1b-splits", "2"],
    # dp2_distopt with the DP ranks turned into context-parallel ranks (PP2 x CP2 x DP1)
    "cp2_distopt": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                    "--pipeline-schedule", "seq1f1b", "--seq1f1b-splits", "2",
                    "--context-parallel-size", "2", "--cp-comm-type", "a2a"],
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


V_FLAGS = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--num-layers-per-virtual-pipeline-stage", "1"]
V_SCHEDULES = {   # name: flags of a V (two chunks per rank, rank 0 holds the first and last stage)
    "zbv": V_FLAGS + ["--pipeline-schedule", "zbv"],
    "seq1f1b-zbv": V_FLAGS + ["--pipeline-schedule", "seq1f1b-zbv", "--seq1f1b-splits", "2"],
    # searched under a cap with the model's costs, re-placed with the fit's measured times after
    # the resumed run's first iteration
    "seq1f1b-zb-auto": V_FLAGS + ["--pipeline-schedule", "seq1f1b-zb-auto", "--seq1f1b-splits",
                                  "2", "--schedule-memory-cap", "1x", "--seq1f1b-partition",
                                  "fit", "--seq1f1b-fit-iterations", "1"],
    # the search on the loop's own layout (one chunk per rank): a loop, W split off
    "seq1f1b-zb-auto:1": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                          "2", "--pipeline-schedule", "seq1f1b-zb-auto", "--seq1f1b-splits", "2"],
}
V_RESHARD_FROM = "tp2pp2_to_tp1pp4"
"""The loop checkpoint every V resumes from: the same Llama-shaped model (untied output), TP2 x
PP2, saved at N by that resharding case."""


def _v_cases(data_prefix: str, root) -> dict:
    """Each V schedule resumed from the loop's checkpoint (same weights: the V's losses are the
    loop's); zbv trained from the start, saved at N, resumed exactly, and resumed in the loop,
    and so a V with the output layer spread, both with the output layer tied to the embedding
    (runtime/tied_output.py: its copies start from the embedding and step with the summed
    gradient, or their V and their loop would part)."""
    common, saving, _ = RESHARDS[V_RESHARD_FROM]
    flags = _model_flags(data_prefix) + common + [
        "--train-iters", str(RESHARD_ITERS), "--eval-iters", "0"]
    tied = [flag for flag in flags if flag != "--untie-embeddings-and-output-weights"]
    cases = {("v", name, "from_loop"): flags + v + ["--load", str(root / V_RESHARD_FROM)]
             for name, v in V_SCHEDULES.items()}
    plan = registry.build("seq1f1b-zbv", 2, 4, 2, 2)     # TP2 x PP2: 4 micro-batches of 2
    (root / "seq1f1b-zbv.csv").write_text(schedule_file.write(plan))
    cases[("v", "file", "from_loop")] = flags + V_FLAGS + [
        "--pipeline-schedule-file", str(root / "seq1f1b-zbv.csv"), "--load",
        str(root / V_RESHARD_FROM)]
    cases[("uneven", "from_loop")] = flags + saving + [
        "--decoder-first-pipeline-num-layers", "1", "--load", str(root / V_RESHARD_FROM)]
    cases[("layout", "from_loop")] = flags + saving + [
        "--pipeline-model-parallel-layout", "Et*3|tL", "--load", str(root / V_RESHARD_FROM)]
    spread = root / "spread-v.csv"       # the output layer on both ranks (O actions)
    spread.write_text(schedule_file.write(spread_order(2, 4, 2, 2, "vshape")))
    v_file = tied + V_FLAGS + ["--pipeline-schedule-file", str(spread), "--eval-interval", "2",
                               "--eval-iters", "1"]
    cases[("spread", "straight")] = v_file
    cases[("spread", "seq1f1b-zbv")] = tied + V_SCHEDULES["seq1f1b-zbv"] + v_file[-4:]
    cases[("spread", "first_half")] = v_file + ["--save", str(root / "spread"),
                                                "--exit-interval", str(N)]
    cases[("spread", "resumed")] = v_file + ["--load", str(root / "spread")]
    cases[("spread", "to_loop")] = tied + saving + ["--load", str(root / "spread")]
    own, evaluated = str(root / "zbv"), ["--eval-interval", "2", "--eval-iters", "1"]
    cases[("v", "zbv", "straight")] = tied + V_SCHEDULES["zbv"] + evaluated
    cases[("v", "zbv", "first_half")] = tied + V_SCHEDULES["zbv"] + evaluated + [
        "--save", own, "--exit-interval", str(N)]
    cases[("v", "zbv", "resumed")] = tied + V_SCHEDULES["zbv"] + evaluated + ["--load", own]
    cases[("v", "zbv", "to_loop")] = tied + saving + ["--load", own]
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


def _document_flags(data_prefix: str, schedule: str, splits: int) -> list[str]:
    return _model_flags(data_prefix, micro_batch_size=4) + [
        "--pipeline-model-parallel-size", "4", "--position-embedding-type", "rope",
        "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
        "--pipeline-schedule", schedule, "--seq1f1b-splits", str(splits),
        "--train-iters", str(SCHEDULE_ITERS), "--eval-interval", "5", "--eval-iters", "1"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
OVERLAP_LAYOUTS = {   # name: (flags of both runs, flags the overlapped run adds)
    "1f1b": (["--pipeline-schedule", "1f1b", "--use-distributed-optimizer"],
             OVERLAP + ["--no-align-param-gather"]),
    "seq1f1b": (["--pipeline-schedule", "seq1f1b", "--seq1f1b-splits", "2",
                 "--use-distributed-optimizer"], OVERLAP),
    "seq1f1b-zb-h1": (["--pipeline-schedule", "seq1f1b-zb-h1", "--seq1f1b-splits", "2",
                       "--use-distributed-optimizer"], OVERLAP + ["--timing-log-level", "2"]),
    "seq1f1b-interleaved": (["--pipeline-schedule", "seq1f1b-interleaved", "--seq1f1b-splits",
                             "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                            ["--overlap-grad-reduce"]),
    # the output layer's weight gradients go into main_grad at B, outside autograd, and report
    # ready to their bucket at the stage's last B (runtime/early_loss.py)
    "seq1f1b-early": (["--pipeline-schedule", "seq1f1b", "--seq1f1b-splits", "2",
                       "--use-distributed-optimizer", "--loss-backward-in-forward"], OVERLAP),
}
SPREAD_OVERLAP = ["--micro-batch-size", "1", "--use-distributed-optimizer", *OVERLAP]
"""PP2 x DP2 with the distributed optimizer and both overlaps, four micro-batches of 1: a loop
with the output layer spread (a file, `spread_overlap`) against seq1f1b-zb-h1 (`zb_overlap`),
the output layer tied to the embedding."""


def _overlap_flags(data_prefix: str, layout: str, overlapped: bool) -> list[str]:
    """PP2 x DP2, two micro-batches of 2 per DP rank, 10 iterations, two evaluations."""
    common, extra = OVERLAP_LAYOUTS[layout]
    return _model_flags(data_prefix) + common + (extra if overlapped else []) + [
        "--pipeline-model-parallel-size", "2", "--train-iters", str(SCHEDULE_ITERS),
        "--eval-interval", "5", "--eval-iters", "1"]


FAKE_WANDB = '''"""A stand-in for wandb's public API (the package is not installed in CI):
every call is appended, as JSON, to fake_wandb.jsonl in the run's dir."""
import json
import os

_log = None


def _write(entry):
    with open(_log, "a") as f:
        f.write(json.dumps(entry) + "\\n")


def init(project=None, name=None, dir=None, config=None, **unexpected):
    global _log
    _log = os.path.join(dir, "fake_wandb.jsonl")
    _write({"call": "init", "project": project, "name": name, "dir": dir,
            "config_keys": sorted(config), "unexpected": sorted(unexpected),
            "mode": os.environ.get("WANDB_MODE")})


def log(data, step=None):
    _write({"call": "log", "data": data, "step": step})


def finish():
    _write({"call": "finish"})
'''


TENSORBOARD_INTERVAL = 2
TENSORBOARD_FLAGS = ["--tensorboard-log-interval", str(TENSORBOARD_INTERVAL),
                     "--log-timers-to-tensorboard", "--timing-log-level", "1", "--log-throughput",
                     "--log-validation-ppl-to-tensorboard", "--log-params-norm",
                     "--log-num-zeros-in-grad", "--log-world-size-to-tensorboard",
                     "--log-memory-to-tensorboard"]
"""The 1f1b case's logging flags (Megatron-LM's): what each writes is checked in the event file."""


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
            # the same weights on a V with the distributed optimizer and both overlaps: rank
            # 0's embedding and its output-layer copy tied by runtime/tied_output.py
            cases["no_load_optim_v"] = {"argv": cases["no_load_optim"]["argv"] + [
                "--pipeline-schedule", "seq1f1b-zbv", "--num-layers-per-virtual-pipeline-stage",
                "1", *OVERLAP]}
            cases.update(_save_cases(flags, root))
        if layout == "cp2_distopt":      # the CP2 checkpoint at N resumed at CP1 (DP2)
            cases["cp2_to_cp1"] = {"argv": _resume_flags(data_prefix, "dp2_distopt") + [
                "--load", checkpoints]}
            # the fit partition cut to the CP ranks, its second iteration drawn
            cases["cp2_fit"] = {"argv": flags + [
                "--seq1f1b-partition", "fit", "--seq1f1b-fit-iterations", "1",
                "--timeline-path", str(root / "cp2_timeline" / "timeline.png"),
                "--timeline-iteration", "2"]}
        cases[(layout, "resumed")] = {"argv": flags + ["--load", checkpoints, "--save",
                                                       checkpoints]}
    cases.update({name: {"argv": argv} for name, argv in _reshard_cases(data_prefix, root).items()})
    cases.update({name: {"argv": argv} for name, argv in _v_cases(data_prefix, root).items()})
    cases.update(_preemption_cases(data_prefix, root))
    cases.update({
        "1f1b": {"argv": _schedule_flags(data_prefix, "1f1b", 1) + [
            "--tensorboard-dir", str(root / "tensorboard"), *TENSORBOARD_FLAGS,
            "--wandb-project", "seq1f1b-tests",
            "--wandb-exp-name", "1f1b", "--wandb-save-dir", str(root / "wandb"),
            "--profile", "--profile-step-start", "2", "--profile-step-end", "3",
            "--profile-ranks", "0", "3"]},
        # with Megatron-LM's manual collection, which must change no figure
        "seq1f1b": {"argv": _schedule_flags(data_prefix, "seq1f1b", 4) + [
            "--manual-gc", "--manual-gc-interval", "4"]},
        "fit": {"argv": _schedule_flags(data_prefix, "seq1f1b", 4) + [
            "--seq1f1b-partition", "fit", "--seq1f1b-fit-iterations", str(FIT_ITERS),
            "--timeline-path", str(root / "timeline" / "timeline.png"),
            "--timeline-iteration", str(TIMELINE_AT)]},
        # with Megatron-LM's cache emptying (a no-op on the CPU, counted by the worker)
        "megatron-1f1b": {"argv": _schedule_flags(data_prefix, "megatron-1f1b", 1) + [
            "--empty-unused-memory-level", "2"]},
        "documents-1f1b": {"argv": _document_flags(data_prefix, "1f1b", 1)},
        "documents-seq1f1b": {"argv": _document_flags(data_prefix, "seq1f1b", 4)},
        "llama3_script": {"argv": llama3.cpu_flags(str(root / "llama3"))},
    })
    for layout in OVERLAP_LAYOUTS:
        for overlapped in (False, True):
            cases[("overlap", layout, overlapped)] = {
                "argv": _overlap_flags(data_prefix, layout, overlapped)}
    spread = root / "spread-loop.csv"
    spread.write_text(schedule_file.write(spread_order(2, 4, 2, 1, "loop")))
    overlapped = _model_flags(data_prefix) + SPREAD_OVERLAP + [
        "--pipeline-model-parallel-size", "2", "--train-iters", str(SCHEDULE_ITERS),
        "--eval-interval", "5", "--eval-iters", "1"]
    cases["spread_overlap"] = {"argv": overlapped + ["--pipeline-schedule-file", str(spread)]}
    # two layers, k = 4: the output layer weighs a stage, and the search spreads it; two
    # micro-batches of four (each rank's search at start-up takes one core 11 s; with four
    # micro-batches of two it took 46 s, the launch's longest case)
    searched = _model_flags(data_prefix, micro_batch_size=4) + TP2_PP2 + [
        "--num-layers", "2", "--seq1f1b-splits", "4",
        "--train-iters", str(N), "--eval-iters", "0"]
    # with the fit partition: searched on the compute cut, then re-placed with the measured
    # times (each span's O scaled with it) after the first iteration
    cases["search_spread"] = {"argv": searched + ["--pipeline-schedule", "seq1f1b-zb-auto",
                                                  "--spread-output", "--seq1f1b-partition",
                                                  "fit", "--seq1f1b-fit-iterations", "1"]}
    cases["search_spread_reference"] = {"argv": searched}
    chosen = _search_layout_cases(data_prefix, cases)
    cases["zb_overlap"] = {"argv": overlapped + ["--pipeline-schedule", "seq1f1b-zb-h1",
                                                 "--seq1f1b-splits", "2"]}
    fake = root / "fake_wandb"
    fake.mkdir()
    (fake / "wandb.py").write_text(FAKE_WANDB)
    items, out = list(cases.values()), []
    for first in range(0, len(items), CASES_PER_LAUNCH):      # in order: later cases load
        out += run_cases(WORLD, "training_worker.py",          # earlier cases' checkpoints
                         items[first:first + CASES_PER_LAUNCH],
                         env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(fake)]),
                              "WANDB_MODE": "offline"})
    by_name = dict(zip(cases, out))
    for name, result in by_name.items():
        assert "error" not in result, f"{name}: {result.get('traceback', result.get('error'))}"
    print("seconds per case:", {str(name): r["seconds"] for name, r in by_name.items()})
    by_name["checkpoint_root"] = str(root)
    by_name["data_prefix"] = data_prefix
    by_name["search_layout_chosen"] = chosen
    return by_name


SEARCH_LAYOUT = ["--hidden-size", "16", "--num-attention-heads", "2", "--num-layers", "8",
                 "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                 "2", "--pipeline-schedule", "seq1f1b-zb-auto", "--seq1f1b-splits", "2",
                 "--train-iters", str(N), "--eval-iters", "0"]
"""A model whose output layer outweighs a stage of its layers (hidden 16, a 384-row padded
vocabulary), P2 x DP2 on two chunks per rank: --search-layout moves layers off its stage."""


def _search_layout_cases(data_prefix: str, cases: dict) -> Optional[str]:
    """--search-layout, and the layout and cap it keeps given by hand (what validation chose
    here, in this process, as every rank of the run chooses it); returns that layout."""
    from megatron.training.arguments import parse_args, validate_args

    flags = _model_flags(data_prefix) + SEARCH_LAYOUT
    chosen = validate_args(parse_args(flags + ["--search-layout"]), WORLD)
    cases["search_layout"] = {"argv": flags + ["--search-layout"]}
    at = flags.index("--num-layers-per-virtual-pipeline-stage")    # the layout sets the chunks
    cases["search_layout_given"] = {"argv": flags[:at] + flags[at + 2:] + [
        "--pipeline-model-parallel-layout", str(chosen.pipeline_model_parallel_layout),
        "--schedule-memory-cap", chosen.schedule_memory_cap]}
    return chosen.pipeline_model_parallel_layout


def _save_cases(flags: list[str], root) -> dict:
    """dp2_distopt's first half saved with --async-save at every iteration (rank 0 noting each
    save and the disk before each publish) and resumed from it; and saved without optimizer and
    RNG states."""
    return {
        "async_save": {"argv": flags + ["--save", str(root / "async"), "--async-save",
                                        "--save-interval", "1", "--exit-interval", str(N)],
                       "record_saves": str(root / "async_saves.jsonl")},
        "after_async_save": {"argv": flags + ["--load", str(root / "async")]},
        "no_save_optim_rng": {"argv": flags + ["--save", str(root / "no_save"), "--no-save-optim",
                                               "--no-save-rng", "--exit-interval", str(N)]},
    }


SIGTERM_AT = (1, 2)
"""Rank 1 (not the last, which logs) receives SIGTERM as iteration 2 starts."""


def test_megatron_lms_llama3_script_trains_on_the_cpu_with_seq1f1b(results):
    """TP 2 x DP 2, bf16, distributed optimizer with both overlaps, the sample-based schedule
    with a decoupled LR for the embedding and output layer, --log-throughput, --profile."""
    result = results["llama3_script"]
    assert result["iteration"] == 4 and len(result["history"]) == 4
    losses = [r["losses"]["lm loss"] for r in result["history"]]
    assert all(math.isfinite(loss) for loss in losses)
    lines = [line for line in result["stdout"].splitlines() if "consumed samples" in line]
    assert len(lines) == 4 and all(" throughput per GPU (TFLOP/s/GPU): " in line
                                   for line in lines)
    rates = [float(re.search(r"learning rate: (\S+) \|", line).group(1)) for line in lines]
    assert rates[0] == pytest.approx(1.5e-4)      # after the 4 warm-up samples: the peak
    assert rates == sorted(rates, reverse=True)   # then cosine decay


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
        "skip_train": {"argv": flags + ["--load", finished, "--skip-train"]},
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


def test_context_parallel_trains_with_the_losses_of_data_parallel(results):
    """PP2 x CP2 against PP2 x DP2 on the same global batches (fp32, dropout 0): each CP rank
    holds half of every span's tokens, the all-to-all gives attention the whole span; only the
    order of the sums differs (measured: loss and grad norm within 1e-6 relative)."""
    cp, dp = results[("cp2_distopt", "straight")], results[("dp2_distopt", "straight")]
    assert _losses(cp) == pytest.approx(_losses(dp), rel=1e-5, abs=0)
    assert [r["grad_norm"] for r in cp["history"]] == \
        pytest.approx([r["grad_norm"] for r in dp["history"]], rel=1e-5)
    assert [r["learning_rate"] for r in cp["history"]] == \
        [r["learning_rate"] for r in dp["history"]]


def test_context_parallel_fits_its_cut_to_the_cp_ranks_and_draws_one_rank_per_stage(results):
    """--seq1f1b-partition fit under CP 2 (PP 2): every span of the fitted cut splits over the
    two CP ranks, the losses are the run's with its own cut (any cut is exact), and the traces
    the fit and the timeline read hold one rank per pipeline stage, not one per CP rank."""
    fit, straight = results["cp2_fit"], results[("cp2_distopt", "straight")]
    lines = [line for line in fit["stdout"].splitlines() if line.startswith(" fit partition ")]
    assert len(lines) == 1, fit["stdout"][-3000:]
    found = re.fullmatch(r" fit partition from iterations 1-1: F .* fitted to 2 spans within "
                         r"\d+%; span lengths (\d+) (\d+): \[0, \d+\) \[\d+, 64\)", lines[0])
    assert found, lines[0]
    lengths = [int(found[1]), int(found[2])]
    assert sum(lengths) == 64 and all(n > 0 and n % 2 == 0 for n in lengths), lengths
    assert _losses(fit) == pytest.approx(_losses(straight), rel=1e-5, abs=0)
    record = json.loads(Path(results["checkpoint_root"], "cp2_timeline",
                             "timeline.json").read_text())
    assert record["iteration"] == 2
    assert [tuple(b) for b in record["span_bounds"]] == [(0, lengths[0]), (lengths[0], 64)]
    programs = registry.build("seq1f1b", 2, 4, 2, 1).programs
    assert [rank["rank"] for rank in record["ranks"]] == [0, 1]
    for rank in record["ranks"]:
        assert {a["action"] for a in rank["actions"]} == \
            {a.format() for a in programs[rank["rank"]]}


def test_a_context_parallel_checkpoint_resumes_without_context_parallelism(results):
    """The CP2 checkpoint at N (weights, the distributed optimizer sharded over DP x CP = 2 in
    megatron's default format, the RNG states) resumed at CP1 x DP2 continues like the CP2 run."""
    moved, resumed = results["cp2_to_cp1"], results[("cp2_distopt", "resumed")]
    assert moved["start_iteration"] == N and moved["iteration"] == 2 * N
    assert _losses(moved) == pytest.approx(_losses(resumed), rel=1e-5, abs=0)
    assert [r["grad_norm"] for r in moved["history"]] == \
        pytest.approx([r["grad_norm"] for r in resumed["history"]], rel=1e-5)


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
    history = results["1f1b"]["history"]
    every, due = [r["iteration"] for r in history], [r["iteration"] for r in history
                                                    if r["iteration"] % TENSORBOARD_INTERVAL == 0]
    # each iteration's figures every --tensorboard-log-interval, as Megatron-LM's training_log
    per_iteration = {"lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm",
                     "params-norm", "num-zeros", "world-size"}
    # each log line's (every --log-interval): timing, throughput, --log-timers-to-tensorboard
    per_line = {"iteration-time", "tokens-per-second", "tflops-per-gpu", "throughput",
                "peak-memory-mb/stage-0", "peak-memory-mb/stage-1", "forward-backward-time",
                "optimizer-time", "all-grads-sync-time"}
    assert per_iteration | per_line | {"lm loss validation", "lm loss validation ppl",
                                       "lm loss test", "lm loss test ppl"} <= tags
    assert not any(tag.startswith("mem-") for tag in tags)      # no CUDA allocator here
    assert all([step for step, _ in _scalars(events, tag)] == due for tag in per_iteration)
    assert all([step for step, _ in _scalars(events, tag)] == every for tag in per_line)
    assert _scalars(events, "lm loss") == [
        (r["iteration"], pytest.approx(r["losses"]["lm loss"], rel=1e-6)) for r in history
        if r["iteration"] in due]
    assert _scalars(events, "grad-norm") == [
        (r["iteration"], pytest.approx(r["grad_norm"], rel=1e-6)) for r in history
        if r["iteration"] in due]
    assert {value for _, value in _scalars(events, "world-size")} == {WORLD}
    assert all(value > 0 for _, value in _scalars(events, "forward-backward-time"))
    ppl = _scalars(events, "lm loss validation ppl")
    assert [value for _, value in ppl] == pytest.approx(
        [math.exp(value) for _, value in _scalars(events, "lm loss validation")], rel=1e-5)


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


def test_manual_gc_collects_where_megatron_does(results):
    # 10 iterations, --manual-gc-interval 4, an evaluation at 5 and 10: a full collection at the
    # start, after iterations 4 and 8, before each evaluation, and generation 0 after each (the
    # case's losses are 1f1b's: test_schedules_give_the_same_loss_at_every_iteration)
    assert results["seq1f1b"]["manual_collections"] == {
        "generations": [2, 2, 2, 0, 2, 2, 0], "enabled_after": True}
    # without the flag the collector is never turned off
    assert results["1f1b"]["manual_collections"] == {"generations": [], "enabled_after": True}


def test_empty_unused_memory_level_empties_the_cache_where_megatron_does(results):
    # level 2, 10 iterations: after each forward-backward and each optimizer step (20), and after
    # each evaluation step (one at 5, at 10 and at the end on the validation and the test split)
    assert results["megatron-1f1b"]["empty_cache_calls"] == 2 * SCHEDULE_ITERS + 4
    assert results["1f1b"]["empty_cache_calls"] == 0      # level 0, the default


def test_packed_documents_train_alike_under_1f1b_and_seq1f1b(results):
    reference, candidate = results["documents-1f1b"], results["documents-seq1f1b"]
    assert len(_losses(reference)) == SCHEDULE_ITERS
    assert _losses(candidate) == pytest.approx(_losses(reference), rel=1e-5, abs=0)
    ref_eval = [losses["lm loss"] for _, losses in reference["validation"]]
    assert len(ref_eval) == 4
    assert [losses["lm loss"] for _, losses in candidate["validation"]] == pytest.approx(
        ref_eval, rel=1e-5, abs=0)


def _scalars(events, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_wandb_gets_the_tensorboard_scalars(results):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(f"{results['checkpoint_root']}/tensorboard")
    events.Reload()
    calls = [json.loads(line) for line in
             open(f"{results['checkpoint_root']}/wandb/fake_wandb.jsonl")]
    init, logs, finish = calls[0], calls[1:-1], calls[-1]
    assert init["call"] == "init" and finish == {"call": "finish"}
    assert (init["project"], init["name"], init["mode"]) == ("seq1f1b-tests", "1f1b", "offline")
    assert init["unexpected"] == [] and "pipeline_schedule" in init["config_keys"]
    logged: dict[str, list] = {}
    for call in logs:
        assert call["call"] == "log"
        for tag, value in call["data"].items():
            logged.setdefault(tag, []).append((call["step"], value))
    tags = set(events.Tags()["scalars"])
    assert set(logged) == tags
    for tag in tags:   # TensorBoard stores float32
        assert [(s, pytest.approx(v, rel=1e-6)) for s, v in logged[tag]] == _scalars(events, tag)


def _program_labels(rank_stage: int, k: int = 1) -> set[str]:
    """What one iteration of (seq)1f1b with k spans runs on a stage of PP2 with two
    micro-batches."""
    from seq1f1b.plan import registry
    name = "seq1f1b" if k > 1 else "1f1b"
    return {a.format() for a in registry.build(name, 2, 2, k, 1).programs[rank_stage]}


def test_profile_traces_name_the_executors_actions(results):
    traces = sorted(Path(results["checkpoint_root"], "tensorboard").glob("*.pt.trace.json"))
    by_rank = {int(re.search(r"_rank(\d+)\.", p.name).group(1)): p for p in traces}
    assert sorted(by_rank) == [0, 3]            # --profile-ranks 0 3, one trace each
    for rank, path in by_rank.items():
        names = {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}
        actions = {name for name in names if name and re.fullmatch(r"[FBW]\d+\.\d+", name)}
        stage = rank // 2                        # TP2 x PP2: ranks 0, 1 stage 0; 2, 3 stage 1
        assert actions == _program_labels(stage)
        assert "ProfilerStep#2" in names        # the one active step: iteration 2


def test_log_lines_carry_a_timestamp_and_the_nan_iteration_count(results):
    lines = [line for line in results["1f1b"]["stdout"].splitlines() if " iteration " in line
             and "consumed samples" in line]
    assert len(lines) == SCHEDULE_ITERS
    for line in lines:
        stamp = re.match(r" \[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})\] iteration ", line)
        assert stamp, line
        assert abs((datetime.now() - datetime.fromisoformat(stamp.group(1))).total_seconds()) \
            < 3600
        assert " number of skipped iterations:   0 | number of nan iterations:   0 |" in line


def _fit_line(stdout: str) -> tuple[str, list[int], list[tuple[int, int]]]:
    """The fit partition's log line, its span lengths and its boundaries."""
    lines = [line for line in stdout.splitlines() if line.startswith(" fit partition ")]
    assert len(lines) == 1, stdout[-3000:]
    found = re.fullmatch(r" fit partition from iterations 1-2: F .* fitted to 4 spans within "
                         r"\d+%; span lengths ([\d ]+): ((?:\[\d+, \d+\) ?)+)", lines[0])
    assert found, lines[0]
    bounds = [tuple(map(int, pair)) for pair in re.findall(r"\[(\d+), (\d+)\)", found[2])]
    return lines[0], [int(n) for n in found[1].split()], bounds


def test_fit_partition_logs_its_cut_and_trains_on_exactly(results):
    fit, even = results["fit"], results["seq1f1b"]
    line, lengths, bounds = _fit_line(fit["stdout"])
    print(line)
    assert sum(lengths) == 64 and len(lengths) == 4 and all(n % 2 == 0 for n in lengths)  # SP
    assert bounds[0][0] == 0 and bounds[-1][1] == 64
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    after = fit["stdout"].split(line)[0]          # logged before the line: iterations 1 and 2
    assert re.findall(r"iteration +(\d+)/", after) == ["1", "2"]
    assert len(_losses(fit)) == SCHEDULE_ITERS and all(map(math.isfinite, _losses(fit)))
    assert _losses(fit) == pytest.approx(_losses(even), rel=1e-5, abs=0)   # any cut is exact


def test_timeline_draws_the_measured_iteration_with_its_actions(results):
    folder = Path(results["checkpoint_root"], "timeline")
    assert (folder / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    record = json.loads((folder / "timeline.json").read_text())
    stdout = results["fit"]["stdout"]
    _, _, bounds = _fit_line(stdout)
    assert record["iteration"] == TIMELINE_AT
    assert [tuple(b) for b in record["span_bounds"]] == bounds       # drawn with the fitted cut
    elapsed_ms = float(re.search(rf"iteration +{TIMELINE_AT}/.*?elapsed time per iteration "
                                 r"\(ms\): ([\d.]+)", stdout)[1])
    assert [rank["rank"] for rank in record["ranks"]] == [0, 1]
    for rank in record["ranks"]:
        assert {a["action"] for a in rank["actions"]} == _program_labels(rank["rank"], k=4)
        for action in rank["actions"]:
            # start == end where a dependency on another rank ended, by that rank's clock, after
            # this action's recorded end (each rank's times count from its own iteration start;
            # simulate.measured_report caps the compute's start at the end)
            assert 0 <= action["start"] <= action["end"] <= elapsed_ms / 1e3
    assert 0 < record["makespan"] <= elapsed_ms / 1e3 and 0 <= record["bubble_ratio"] < 1
    assert f"measured timeline of iteration {TIMELINE_AT} written to {folder}" in stdout


def test_timers_follow_each_log_line_at_level_2(results):
    printed = results[("overlap", "seq1f1b-zb-h1", True)]["stdout"]
    blocks = printed.split("(min, max) time across ranks (ms):")[1:]
    assert len(blocks) == SCHEDULE_ITERS
    for block in blocks:
        timers = dict(re.findall(r"\n    (\S[\w-]*) \.+: \(([\d.]+), [\d.]+\)", block))
        measured = {"forward-backward", "forward-compute", "backward-compute",
                    "weight-grad-compute", "all-grads-sync", "optimizer", "optimizer-inner-step"}
        assert measured <= set(timers)
        assert all(float(timers[name]) > 0 for name in measured)
        # params-all-gather times the dispatch of asynchronous gathers (about 5 us with
        # --overlap-param-gather): its minimum prints as 0.00 or 0.01 by chance
        assert all(float(ms) >= 0 for ms in timers.values())
    assert "time across ranks" not in results[("overlap", "seq1f1b-zb-h1", False)]["stdout"]


@pytest.mark.parametrize("layout", OVERLAP_LAYOUTS)
def test_overlap_leaves_the_run_exactly_as_it_was(results, layout):
    plain, overlapped = (results[("overlap", layout, flag)] for flag in (False, True))
    assert len(plain["history"]) == SCHEDULE_ITERS
    assert overlapped["history"] == plain["history"]          # losses, grad norms: bit for bit
    assert overlapped["validation"] == plain["validation"]    # gathered before evaluating
    # every bucket's reduction launched while the schedule ran, none left to finalize_model_grads
    assert overlapped["grad_reductions"]["after_schedule"] == 0
    assert overlapped["grad_reductions"]["in_schedule"] >= SCHEDULE_ITERS - 1
    losses = _losses(plain)
    assert losses[-1] < losses[0]


def test_the_loss_backward_in_forward_trains_as_the_loss_at_backward(results):
    """--loss-backward-in-forward at PP2 x DP2 with the distributed optimizer: every loss, grad
    norm and evaluation of the 10 iterations is the plain seq1f1b run's (fp32; the output
    layer's gradients are summed at unit scale, then scaled, so equal to rounding)."""
    early, plain = (results[("overlap", layout, False)] for layout in ("seq1f1b-early", "seq1f1b"))
    assert len(early["history"]) == SCHEDULE_ITERS
    assert _losses(early) == pytest.approx(_losses(plain), rel=1e-5)
    assert [r["grad_norm"] for r in early["history"]] == \
        pytest.approx([r["grad_norm"] for r in plain["history"]], rel=1e-5)
    assert [where for where, _ in early["validation"]] == \
        [where for where, _ in plain["validation"]]
    for (_, losses), (_, expected) in zip(early["validation"], plain["validation"]):
        assert losses == pytest.approx(expected, rel=1e-5)


def _saved_model_weights(folder: str) -> dict:
    """The model tensors of a torch_dist checkpoint folder, read in this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(folder)
    meta = reader.read_metadata().state_dict_metadata
    weights = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in meta.items()
               if isinstance(m, TensorStorageMetadata)
               and not key.startswith(("optimizer", "rng_state"))}
    dcp.load(weights, storage_reader=reader, no_dist=True)
    return weights


def test_overlap_saves_the_gathered_weights_and_changes_no_figure(results):
    """After the step each DP rank holds only its own shard updated; a checkpoint written without
    gathering would keep the other shard's old values (seen: every weight but the last stage's
    final norm differed)."""
    import torch

    plain, overlapped = (_saved_model_weights(results[(layout, "first_half")]["checkpoints"][0])
                         for layout in ("dp2_distopt", "dp2_distopt_overlap"))
    assert len(plain) >= 16 and sorted(plain) == sorted(overlapped)
    assert all(torch.equal(plain[key], overlapped[key]) for key in plain)
    for name in ("straight", "first_half", "resumed"):
        assert results[("dp2_distopt_overlap", name)]["history"] == \
            results[("dp2_distopt", name)]["history"]


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


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_v_placements_resume_a_loop_checkpoint_with_the_loops_losses(results, name):
    """A loop checkpoint resumed in a V (the layers move to stages r and 2P-1-r, the output layer
    to rank 0) logs what the loop logs from it: the V's losses are 1F1B's (fp32, dropout 0;
    rel 1e-6 as for every resharding, the grad norm's sum over ranks reordered)."""
    same = results[(V_RESHARD_FROM, "same_layout")]
    resumed = results[("v", name, "from_loop")]
    assert resumed["start_iteration"] == N
    assert [r["iteration"] for r in resumed["history"]] == [N + 1, N + 2]
    assert _losses(resumed) == pytest.approx(_losses(same), rel=1e-6, abs=0)
    assert [r["grad_norm"] for r in resumed["history"]] == \
        pytest.approx([r["grad_norm"] for r in same["history"]], rel=1e-5)
    assert [r["learning_rate"] for r in resumed["history"]] == \
        [r["learning_rate"] for r in same["history"]]


def test_uneven_stages_resume_an_even_checkpoint_with_its_losses(results):
    """--decoder-first-pipeline-num-layers 1 at TP2 x PP2: rank 0 holds one layer, rank 1
    three; the even checkpoint's layers move by their global numbers and train on alike."""
    same, uneven = results[(V_RESHARD_FROM, "same_layout")], results[("uneven", "from_loop")]
    assert [r["iteration"] for r in uneven["history"]] == [N + 1, N + 2]
    assert _losses(uneven) == pytest.approx(_losses(same), rel=1e-6, abs=0)
    assert [r["grad_norm"] for r in uneven["history"]] == \
        pytest.approx([r["grad_norm"] for r in same["history"]], rel=1e-5)


def test_a_layout_resumes_an_even_checkpoint_with_its_losses(results):
    """--pipeline-model-parallel-layout 'Et*3|tL' at TP2 x PP2 (megatron-core's own layout on a
    loop: three layers on rank 0, one with the output layer on rank 1): the even checkpoint's
    layers move by their global numbers and train on alike."""
    same, layout = results[(V_RESHARD_FROM, "same_layout")], results[("layout", "from_loop")]
    assert [r["iteration"] for r in layout["history"]] == [N + 1, N + 2]
    assert _losses(layout) == pytest.approx(_losses(same), rel=1e-6, abs=0)
    assert [r["grad_norm"] for r in layout["history"]] == \
        pytest.approx([r["grad_norm"] for r in same["history"]], rel=1e-5)


def test_a_schedule_file_trains_exactly_as_the_schedule_it_holds(results):
    """--pipeline-schedule-file with the seq1f1b-zbv plan written out (schedule_file.write):
    the same run as --pipeline-schedule seq1f1b-zbv, bit for bit."""
    from_file = results[("v", "file", "from_loop")]
    assert len(from_file["history"]) == 2
    assert from_file["history"] == results[("v", "seq1f1b-zbv", "from_loop")]["history"]


def test_the_searched_schedule_says_where_it_placed_itself(results):
    """The last rank's line after the search: a loop of one chunk per rank without VPP flags;
    a V or a loop of two with them (whichever simulates shorter on these costs)."""
    one = results[("v", "seq1f1b-zb-auto:1", "from_loop")]["stdout"]
    two = results[("v", "seq1f1b-zb-auto", "from_loop")]["stdout"]
    assert " seq1f1b-zb-auto: placed on a loop of 1 chunk per rank, simulated bubble " in one
    assert re.search(r" seq1f1b-zb-auto: placed on (a V of two chunks|a loop of 2 chunks) per "
                     r"rank, simulated bubble ", two), two[-2000:]


def test_searched_v_schedule_refits_its_spans_and_trains_on(results):
    """seq1f1b-zb-auto under a cap with --seq1f1b-partition fit: the resumed run measures its
    first iteration, cuts the spans by it and re-places the schedule with the measured times."""
    stdout = results[("v", "seq1f1b-zb-auto", "from_loop")]["stdout"]
    lines = [line for line in stdout.splitlines() if line.startswith(" fit partition ")]
    assert len(lines) == 1 and lines[0].startswith(f" fit partition from iterations {N + 1}-"
                                                   f"{N + 1}: F "), stdout[-2000:]


def test_a_v_run_resumes_exactly_and_its_checkpoint_resumes_in_a_loop(results):
    straight, first, resumed, to_loop = (results[("v", "zbv", case)] for case in (
        "straight", "first_half", "resumed", "to_loop"))
    assert len(straight["history"]) == RESHARD_ITERS
    assert first["history"] + resumed["history"] == straight["history"]   # bit for bit
    # evaluations (forward only on the V) at 2 and 4, and at the end on valid and test data
    assert len(straight["validation"]) == 4
    assert first["validation"] + resumed["validation"] == straight["validation"]
    assert first["checkpoints"] == [f"{results['checkpoint_root']}/zbv/iter_{N:07d}"]
    assert [r["iteration"] for r in to_loop["history"]] == [N + 1, N + 2]
    assert _losses(to_loop) == pytest.approx(_losses(resumed), rel=1e-6, abs=0)
    assert [r["grad_norm"] for r in to_loop["history"]] == \
        pytest.approx([r["grad_norm"] for r in resumed["history"]], rel=1e-5)
    losses = _losses(straight)
    assert losses[-1] < losses[0]


def test_the_output_layer_spread_over_the_ranks_trains_as_the_last_stage_runs_it(results):
    """O actions on both ranks of a V (a searched order from a file, every rank holding a copy
    of the output layer, tied to the embedding): the losses, grad norms and evaluations of
    seq1f1b-zbv (the same model: the copies start from the embedding's weights); saved at N and
    resumed bit for bit; its checkpoint resumes in a loop without copies with the same
    losses."""
    straight, zbv, first, resumed, to_loop = (results[("spread", case)] for case in (
        "straight", "seq1f1b-zbv", "first_half", "resumed", "to_loop"))
    assert len(straight["history"]) == RESHARD_ITERS and len(straight["validation"]) == 4
    assert _losses(straight) == pytest.approx(_losses(zbv), rel=1e-6, abs=0)
    assert [r["grad_norm"] for r in straight["history"]] == \
        pytest.approx([r["grad_norm"] for r in zbv["history"]], rel=1e-5)
    assert [e["lm loss"] for _, e in straight["validation"]] == \
        pytest.approx([e["lm loss"] for _, e in zbv["validation"]], rel=1e-6)
    assert first["history"] + resumed["history"] == straight["history"]   # bit for bit
    assert first["validation"] + resumed["validation"] == straight["validation"]
    assert _losses(to_loop) == pytest.approx(_losses(resumed), rel=1e-6, abs=0)


def test_the_output_layer_spread_trains_with_the_distributed_optimizer_and_overlap(results):
    """PP2 x DP2, distributed optimizer, overlapped gradient reduction and parameter gathering:
    each copy's gradient has a bucket of its own, a rank without an O still reports it ready,
    the copies' gradients are summed over the pipeline ranks after the DP reduction and counted
    once in the grad norm: the run logs seq1f1b-zb-h1's figures."""
    spread, plain = results["spread_overlap"], results["zb_overlap"]
    assert len(spread["history"]) == SCHEDULE_ITERS
    assert _losses(spread) == pytest.approx(_losses(plain), rel=1e-5, abs=0)
    assert [r["grad_norm"] for r in spread["history"]] == \
        pytest.approx([r["grad_norm"] for r in plain["history"]], rel=1e-4)
    assert [e["lm loss"] for _, e in spread["validation"]] == \
        pytest.approx([e["lm loss"] for _, e in plain["validation"]], rel=1e-5)


def test_the_search_with_spread_output_trains_the_order_it_chose(results):
    """--pipeline-schedule seq1f1b-zb-auto --spread-output searches with the output layer kept
    and spread, says which it runs, builds the copies when it spreads, and logs seq1f1b's
    losses (the same model); with the fit partition it cuts the spans by the first iteration's
    times and re-places the order, the layer still spread."""
    spread, reference = results["search_spread"], results["search_spread_reference"]
    assert ", the output layer spread over the ranks, simulated bubble " in spread["stdout"], \
        spread["stdout"][-2000:]
    fits = [line for line in spread["stdout"].splitlines() if line.startswith(" fit partition ")]
    assert len(fits) == 1 and fits[0].startswith(" fit partition from iterations 1-1: F "), \
        spread["stdout"][-2000:]
    assert len(spread["history"]) == N
    assert _losses(spread) == pytest.approx(_losses(reference), rel=1e-5, abs=0)
    assert [r["grad_norm"] for r in spread["history"]] == \
        pytest.approx([r["grad_norm"] for r in reference["history"]], rel=1e-4)


def test_search_layout_trains_the_layout_it_chose(results):
    """--search-layout: the last rank says which layout it kept (an uneven one for this model),
    the model chunks are built with it, and the run is, bit for bit, the run given that layout
    and cap by hand."""
    from seq1f1b.plan.stage_layers import parse_layout

    searched, given = results["search_layout"], results["search_layout_given"]
    layout = results["search_layout_chosen"]
    counts = parse_layout(layout)
    assert sum(counts) == 8 and len(counts) == 4 and counts != (2, 2, 2, 2)
    said = [line for line in searched["stdout"].splitlines() if "--search-layout" in line]
    assert any(f"--search-layout chose --pipeline-model-parallel-layout '{layout}'" in line
               for line in said), said
    assert len(searched["history"]) == N and searched["history"] == given["history"]


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
        r"--dist-ckpt-optim-fully-reshardable to change TP, PP or V, or give --no-load-optim\)\n",
        proc.stderr), proc.stderr
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


def test_a_tied_v_with_the_distributed_optimizer_trains_as_its_loop(results):
    """PP2 x DP2, the distributed optimizer with overlapped reduction and gathering, the loop's
    checkpoint resumed on a V (seq1f1b-zbv) with fresh Adam: rank 0 holds the embedding and its
    tied copy in the output layer, each in a bucket of its own (sharded alike), their gradients
    summed after the reduction; the figures are the loop's."""
    v, loop = results["no_load_optim_v"]["history"], results["no_load_optim"]["history"]
    assert len(v) == len(loop) == N
    assert [r["losses"]["lm loss"] for r in v] == \
        pytest.approx([r["losses"]["lm loss"] for r in loop], rel=1e-6)
    assert [r["grad_norm"] for r in v] == pytest.approx([r["grad_norm"] for r in loop], rel=1e-5)


def test_finetune_and_pretrained_checkpoint_start_from_the_weights(results):
    finetune, pretrained = results["finetune"], results["pretrained"]
    assert finetune["start_iteration"] == pretrained["start_iteration"] == 0
    assert [r["learning_rate"] for r in finetune["history"]] == [0.0, 1e-3, 2e-3]
    assert finetune["history"] == pretrained["history"]
    fresh = results[("dp2_distopt", "straight")]["history"][0]
    assert finetune["history"][0]["losses"]["lm loss"] < fresh["losses"]["lm loss"]
    assert pretrained["checkpoints"] == [f"{results['checkpoint_root']}/finetuned/iter_0000003"]


def test_async_save_publishes_each_write_when_done_and_resumes_exactly(results):
    """--async-save at every iteration: each save returns before its checkpoint is published,
    and the pending one is published before the next save; until then the tracker names the
    previous checkpoint and the new one is a staging folder (what a job killed before the
    finalization leaves: its --load resumes the previous one). Resuming the last equals the
    straight run bit for bit."""
    first, resumed = results["async_save"], results["after_async_save"]
    straight, root = results[("dp2_distopt", "straight")], results["checkpoint_root"]
    assert first["checkpoints"] == [f"{root}/async/iter_{i:07d}" for i in range(1, N + 1)]
    assert resumed["start_iteration"] == N
    assert first["history"] + resumed["history"] == straight["history"]
    assert first["validation"] + resumed["validation"] == straight["validation"]
    events = [json.loads(line) for line in open(f"{root}/async_saves.jsonl")]
    expected = []
    for i in range(1, N + 1):
        expected += [{"scheduled": i}, {"publishing": i, "tracker": i - 1 if i > 1 else None,
                                        "staged": True, "final": False}]
    assert events == expected


def test_no_save_optim_and_rng_leave_them_out_and_their_load_needs_no_load_optim(results):
    """As Megatron-LM: the checkpoint holds the weights and the position only; resuming it needs
    --no-load-optim or --finetune (one line otherwise), and its RNGs are not looked for."""
    from megatron.training.arguments import ArgumentError, parse_args, validate_args
    from megatron.training.checkpoint_common import read_common_state
    import torch
    import torch.distributed.checkpoint as dcp

    folder = results["no_save_optim_rng"]["checkpoints"][0]
    assert folder.endswith(f"/no_save/iter_{N:07d}")
    stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    assert not any(key.startswith(("optimizer", "rng_state")) for key in stored)
    common = read_common_state(folder)
    assert "opt_param_scheduler" not in common and common["iteration"] == N
    assert common["args"].no_save_optim and common["args"].no_save_rng
    weights = _saved_model_weights(folder)      # the same training as dp2_distopt's first half
    reference = _saved_model_weights(results[("dp2_distopt", "first_half")]["checkpoints"][0])
    assert sorted(weights) == sorted(reference)
    assert all(torch.equal(weights[key], reference[key]) for key in weights)
    flags = _resume_flags(results["data_prefix"], "dp2_distopt") + [
        "--load", str(Path(folder).parent)]
    with pytest.raises(ArgumentError, match=r"^--load \S+/no_save: the checkpoint was saved "
                                            r"with --no-save-optim .* give --no-load-optim or "
                                            r"--finetune"):
        validate_args(parse_args(flags), WORLD)
    assert validate_args(parse_args(flags + ["--no-load-optim"]), WORLD).no_load_optim
    assert validate_args(parse_args(flags + ["--finetune"]), WORLD).finetune


def test_skip_train_only_evaluates_the_checkpoint(results):
    """--skip-train loads the finished dp2_distopt checkpoint (at 2N) without its optimizer,
    trains nothing, saves nothing and evaluates the validation and test splits from their
    start: the test loss is the one the run that wrote the checkpoint logged at its end."""
    skipped, straight = results["skip_train"], results[("dp2_distopt", "straight")]
    assert skipped["start_iteration"] == skipped["iteration"] == 2 * N
    assert skipped["history"] == [] and skipped["checkpoints"] == []
    assert [where for where, _ in skipped["validation"]] == ["end/valid", "end/test"]
    assert skipped["validation"][1] == straight["validation"][-1]
