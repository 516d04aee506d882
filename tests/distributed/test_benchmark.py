"""Smoke runs of the measuring tools: tools/benchmark.py in one torchrun launch of 2 processes
(a tiny model, one timed iteration per schedule) and tools/device_check.py --tiny on the CPU.
Timings are printed by the tools, never asserted: only the shape and sanity of what they report."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from seq1f1b.plan import schedule_file
from seq1f1b.plan.calibration import CalibrationError, read_device_check
from spread_orders import spread_order

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
SCHEDULES = ["1f1b", "seq1f1b", "megatron-1f1b", "seq1f1b-interleaved", "seq1f1b@fit",
             "seq1f1b-zb-auto", "seq1f1b:1"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    spread = out / "spread.csv"   # the output layer on both ranks (O actions): the last entry
    spread.write_text(schedule_file.write(spread_order(2, 2, 2, 1, "loop")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(ROOT / "tools" / "benchmark.py"), "--pp", "2", "--num-layers", "4",
           "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
           "--vocab-size", "64", "--num-microbatches", "2", "--splits", "2", "--warmup", "1",
           "--iterations", "2", "--schedules", *SCHEDULES, "--output", str(out / "result.json"),
           "--untie-embeddings-and-output-weights", "--schedule-memory-cap", "0.7x",
           "--spread-output",     # the searched entry chooses the output layer spread
           "--plot", str(out / "timelines.png"), "--pipeline-schedule-file", str(spread)]
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    (out / "stderr.txt").write_text(proc.stderr)
    return proc.stdout, json.loads((out / "result.json").read_text()), out


def test_every_schedule_is_reported_in_order(benchmark):
    stdout, result, _ = benchmark
    runs = result["runs"]
    assert [r["schedule"] for r in runs[:-1]] == [entry.split("@")[0].split(":")[0]
                                                  for entry in SCHEDULES]
    assert runs[-1]["schedule"].startswith("file:") and runs[-1]["schedule"].endswith("spread.csv")
    assert [(r["splits"], r["chunks"]) for r in runs] == [(1, 1), (2, 1), (1, 1), (2, 2), (2, 1),
                                                          (2, 2), (1, 1), (2, 1)]
    assert [r["partition"] for r in runs[1:]] == ["even", "even", "even", "fit", "even", "even",
                                                  "even"]
    assert runs[0]["ratio_to_first"] == 1.0
    # paired by round only with the first schedule's chunks: one chunk, the output layer in the
    # last stage (a spread one's chunks hold the layer on every rank: a group of their own)
    assert [r["paired_ratio_to_first"] is None for r in runs] == [
        False, False, False, True, False, True, False, True]
    for run in runs:
        paired = run["paired_ratio_to_first"]
        if paired is not None:
            rounds = sorted(a / b for a, b in zip(runs[0]["iterations_s"], run["iterations_s"]))
            assert paired == pytest.approx((rounds[0] + rounds[1]) / 2)    # 2 rounds
    tokens = result["config"]["tokens_per_iteration"]
    assert tokens == 2 * 32
    for run in runs:
        assert run["iteration_s"] > 0
        assert run["tokens_per_s"] == pytest.approx(tokens / run["iteration_s"])
    assert stdout.count("\n| ") >= len(runs)          # the markdown rows
    # seq1f1b:1 runs 1f1b's order on our executor: the noise floor (megatron's is not one)
    assert result["config"]["control"] == {"label": "seq1f1b", "ratio": runs[-2]["ratio_to_first"],
                                           "work": runs[-2]["work_ratio_to_first"]}
    assert "noise floor: seq1f1b computes what 1f1b does" in stdout
    assert result["config"]["processor"].endswith(" cores") and "cpu: " in stdout


def test_traced_schedules_have_bubbles_predictions_and_memory(benchmark):
    _, result, _ = benchmark
    for run in result["runs"]:
        if run["schedule"].startswith("megatron"):
            assert "measured_bubble" not in run and "peak_saved_bytes" not in run
            continue
        assert 0 <= run["measured_bubble"] < 1 and 0 <= run["simulated_bubble"] < 1
        assert run["simulated_makespan_s"] > 0
        stages = 2 * run["chunks"]
        assert len(run["calibrated_forward_s"]) == stages
        assert all(len(row) == run["splits"] for row in run["calibrated_backward_s"])
        assert len(run["peak_saved_bytes"]) == 2 and min(run["peak_saved_bytes"]) > 0
        assert len(run["estimated_held_bytes"]) == 2 and min(run["estimated_held_bytes"]) > 0
        assert run["busy_per_rank_s"] == pytest.approx(
            run["measured_makespan_s"] * (1 - run["measured_bubble"]))
        assert run["wall_work_ratio_to_first"] == pytest.approx(
            run["busy_per_rank_s"] / result["runs"][0]["busy_per_rank_s"])
        # work is compute: main-thread CPU time, never more than the busy wall time
        assert 0 < run["compute_per_rank_s"] <= run["busy_per_rank_s"] * 1.01
        assert run["descheduled"] == pytest.approx(
            max(0.0, 1 - run["compute_per_rank_s"] / run["busy_per_rank_s"]))
        assert run["work_ratio_to_first"] == pytest.approx(
            run["compute_per_rank_s"] / result["runs"][0]["compute_per_rank_s"])
        assert run["ceiling"] == pytest.approx(run["uniform_cost_ratio"]
                                               / run["work_ratio_to_first"])
        # paired work: per rank the median over rounds (2 here) of its compute over the
        # first schedule's in the same round, then the mean over ranks
        first = result["runs"][0]["compute_s"]
        if run["paired_ratio_to_first"] is None:      # not in the first schedule's group
            assert run["paired_work_ratio_to_first"] is None
        else:
            assert run["paired_work_ratio_to_first"] == pytest.approx(sum(
                (mine[0] / base[0] + mine[1] / base[1]) / 2
                for mine, base in zip(run["compute_s"], first)) / len(first))
        assert 0 <= run["uniform_cost_bubble"] < 1
        assert run["uniform_cost_bubble"] + run["bubble_gap_from_costs"] + run[
            "bubble_gap_from_runtime"] == pytest.approx(run["measured_bubble"])


def test_the_output_layer_spread_over_the_ranks_is_timed_and_calibrated(benchmark):
    """A schedule file with O actions (on both ranks here) runs, and so does the search with
    --spread-output (which spreads the layer at this shape); the analysis times each span's O
    beside the stages' F and B (the bubble checks above hold for them too)."""
    _, result, _ = benchmark
    spread, kept = result["runs"][-1], result["runs"][1]        # seq1f1b, the same P, m, k
    searched = result["runs"][5]
    assert searched["schedule"] == "seq1f1b-zb-auto"
    for run in (spread, searched):
        assert len(run["calibrated_output_s"]) == 2 and min(run["calibrated_output_s"]) > 0
    assert kept["calibrated_output_s"] is None
    # the span timings fold each O into its span's F (a third) and B (two thirds)
    for span, timing in enumerate(spread["spans"]):
        stages = range(len(spread["calibrated_forward_s"]))
        assert timing["forward_s"] == pytest.approx(
            sum(spread["calibrated_forward_s"][v][span] for v in stages)
            + spread["calibrated_output_s"][span] / 3)


def test_the_noise_of_the_machine_is_reported_and_rounds_show_as_they_run(benchmark):
    _, result, out = benchmark
    config = result["config"]
    assert config["noise_threshold"] == 0.2
    # four groups of shared chunks (V=1; V=2 looped; V=2 looped, the output layer spread; V=1
    # with it spread), two timed rounds each
    assert config["others_cores"] >= 0 and len(config["others_cores_per_round"]) == 4 * 2
    assert config["noisy"] == (config["others_cores"] > 0.2)
    progress = [line for line in (out / "stderr.txt").read_text().splitlines()
                if line.startswith("benchmark.py: ")]
    # per group: one line per warm-up round, then one per timed round, in order
    assert [line.split(":")[1].strip() for line in progress] == [
        "warm-up 1/1", "round 1/2", "round 2/2"] * 4
    groups = ["1f1b", "seq1f1b-interleaved", "seq1f1b-zb-auto", "spread.csv"]
    assert all("others" in line and name in line
               for line, name in zip(progress, [name for name in groups for _ in range(3)]))


def test_a_fit_entry_is_cut_by_its_warm_up_and_the_output_calibrates_plan_py(benchmark):
    _, result, out = benchmark
    fitted = result["runs"][4]
    assert fitted["label"] == "seq1f1b@fit" and "fitted to 2 spans" in fitted["fit"]
    assert sum(fitted["span_lengths"]) == 32 and len(fitted["spans"]) == 2
    for span in fitted["spans"]:
        assert span["forward_s"] > 0 and span["backward_s"] > 0
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), "partition",
                           "--seq-length", "32", "--splits", "2", "--method", "fit",
                           "--calibration", str(out / "result.json"), "--json"],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sum(json.loads(proc.stdout)["spans"]) == 32


def test_a_global_fit_partition_cuts_the_span_schedules_and_leaves_the_baseline_whole():
    """`--partition fit --schedules 1f1b seq1f1b` (seen: a traceback on every rank from the k=1
    baseline, which has no boundary to fit): the fit applies to the span schedule only."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(ROOT / "tools" / "benchmark.py"), "--pp", "2", "--num-layers", "2",
           "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
           "--vocab-size", "64", "--num-microbatches", "2", "--splits", "2", "--warmup", "1",
           "--iterations", "1", "--partition", "fit", "--schedules", "1f1b", "seq1f1b", "--json"]
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Traceback" not in proc.stderr
    baseline, spans = json.loads(proc.stdout)["runs"]
    assert (baseline["label"], baseline["partition"]) == ("1f1b", "even")
    assert spans["partition"] == "fit" and "fitted to 2 spans" in spans["fit"]


def test_a_fit_of_one_span_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "benchmark.py"), "--schedules",
                           "seq1f1b", "1f1b@fit"], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "benchmark.py: error: --schedules 1f1b@fit: one span per micro-batch has no boundary to "
        "fit; @fit needs k >= 2")


def test_plot_is_written(benchmark):
    _, _, out = benchmark
    assert (out / "timelines.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_schedule_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "benchmark.py"), "--schedules",
                           "seq1f1b:0"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("benchmark.py: error: --schedules")


def test_searched_schedule_is_placed_under_the_cap_and_estimated_alike(benchmark):
    _, result, _ = benchmark
    searched = result["runs"][SCHEDULES.index("seq1f1b-zb-auto")]
    assert searched["label"] == "seq1f1b-zb-auto@even"
    for measured, estimated in zip(searched["peak_saved_bytes"], searched["estimated_held_bytes"]):
        assert measured == pytest.approx(estimated, rel=0.15)


def test_a_cap_no_order_fits_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "benchmark.py"), "--schedules",
                           "seq1f1b-zb-auto", "--pp", "2", "--splits", "2", "--seq-length", "32",
                           "--untie-embeddings-and-output-weights", "--schedule-memory-cap",
                           "0.5x"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("benchmark.py: error: --schedules seq1f1b-zb-auto@even: "
                           "--schedule-memory-cap")


def test_device_check_tiny_runs_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "device_check.py"),
                           str(tmp_path), "--tiny"], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((tmp_path / "device_check.json").read_text())
    backends = data["attention"]["backends"]
    assert set(backends) == {"eager", "sdpa", "flex", "flash", "te"}
    assert "span_forward_backward_s" in backends["sdpa"]
    assert "skipped" in backends["flash"]                    # no GPU here
    assert [run["seq_length"] for run in data["stage"]] == data["shapes"]["stage_lengths"]
    for run in data["stage"]:
        assert len(run["spans"]) == data["shapes"]["splits"]
        assert run["memory"]["peak_saved_bytes"] > 0
        assert run["trace_clock"] == "host clock"       # CUDA events on a GPU
        assert 0.5 < run["traced_over_iteration"] <= 1.0
        for span in run["spans"]:
            assert span["forward_linear_flops"] + span["forward_attention_flops"] == \
                pytest.approx(span["forward_flops"])
    flex, te = data["span_kernels"]["flex"], data["span_kernels"]["te"]
    assert len(flex["span_lengths"]) == data["shapes"]["kernel_splits"]
    assert flex["graphs_compiled_per_iteration"] == [2, 0]   # square span 0, then all others
    assert flex["relative_error_vs_unsplit_sdpa"]["output"] < 1e-5
    assert "skipped" in te
    held = data["held_microbatches"]
    assert (held["schedule"], held["microbatches"]) == ("gpipe", 4)
    assert held["memory"]["saved_over_estimated"] == pytest.approx(1, abs=0.1)   # 4 held
    with pytest.raises(CalibrationError, match="without a GPU"):
        read_device_check(tmp_path / "device_check.json")


def test_device_check_gpu_suite_tiny_runs_every_part_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "device_check.py"),
                           str(tmp_path), "--tiny", "--suite", "gpu"], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert {"numerics", "training", "memory", "attention", "documents"} <= set(data)
    backends = data["numerics"]["backends"]
    for name in ("sdpa", "eager", "flex"):                   # flex: forward only on a CPU
        assert backends[name]["within_bound"], backends[name]
    assert set(backends["sdpa"]["span_errors"]) == {"output", "dq", "prefix_dk", "prefix_dv"}
    assert "skipped" in backends["flash"] and "skipped" in backends["te"]
    training = data["training"]
    assert training["losses_agree"], training
    for run in training["runs"].values():
        assert len(run["losses"]) == training["shape"]["iterations"]
        assert run["tokens_per_s"] > 0 and "lm loss" in run["last_log_line"]
    stage = data["memory"]["stage"][0]
    assert stage["memory"]["saved_over_estimated"] == pytest.approx(1, abs=0.1)
    early = data["memory"]["loss_backward_in_forward"]
    for name in ("loss_at_backward", "loss_backward_in_forward"):
        assert early[name]["saved_over_estimated"] == pytest.approx(1, abs=0.1), name
    assert early["peak_saved_bytes_early_over_plain"] < 1
    assert early["estimated_held_for_backward_bytes_early_over_plain"] < 1
    recomputed = data["memory"]["recompute"]        # full: the rebuilt group is workspace
    for name, memory in recomputed.items():
        rebuilt = memory["estimate_gib"]["recomputed_bytes"] * 2 ** 30
        assert memory["peak_saved_bytes"] / (memory["estimated_held_for_backward_bytes"]
                                             + rebuilt) == pytest.approx(1, abs=0.1), name
    assert recomputed["full_uniform_2"]["estimate_gib"]["recomputed_bytes"] > 0
    assert "sdpa" in data["attention"]["comparison"]["backends"]
    assert data["attention"]["merge_gqa"]["within_bound"], data["attention"]["merge_gqa"]
    for run in training["runs"].values():                       # profiled, no GPU kernels
        assert "no GPU kernels" in run["kernels"]["skipped"], run["kernels"]
    documents = data["documents"]["backends"]
    for name in ("sdpa_mha", "sdpa_gqa", "flex_mha"):
        assert documents[name]["peak_bytes"]["dense"] > 0, documents[name]
    assert "skipped" in documents["flash_mha"]
    with pytest.raises(CalibrationError, match="without a GPU"):   # reads the suite's layout
        read_device_check(tmp_path / "device_check.json")


@pytest.mark.parametrize("flag, path", [("--plot", "{tmp}"), ("--plot", "{tmp}/plot.svg"),
                                        ("--output", "{tmp}"), ("--output", "/proc/self/r.json"),
                                        ("--output", "{tmp}/missing/r.json")])
def test_bad_output_paths_are_refused_before_the_run(tmp_path, flag, path):
    """The results are written after the whole run: a path that cannot take them is refused
    while the flags are parsed (a folder as --plot used to become FOLDER.png)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_tool", ROOT / "tools" / "benchmark.py")
    tool = sys.modules["benchmark_tool"] = importlib.util.module_from_spec(spec)  # dataclasses
    spec.loader.exec_module(tool)
    with pytest.raises(tool.UsageError, match=f"^{flag}") as err:
        tool.parse_args(["--schedules", "1f1b", flag, path.format(tmp=tmp_path)])
    assert "\n" not in str(err.value)


def _benchmark_tool():
    """tools/benchmark.py as a module (registered first: its dataclasses look it up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_tool", ROOT / "tools" / "benchmark.py")
    tool = sys.modules["benchmark_tool"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


TINY = ["--pp", "1", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--num-microbatches", "1", "--iterations", "1",
        "--warmup", "0"]


@pytest.mark.parametrize("schedules, extra, flag", [
    # activation recompute, as pretrain_gpt.py (-1 ran away on memory, 0 failed after the run)
    (["1f1b"], ["--recompute-granularity", "full", "--recompute-num-layers", "-1"],
     "--recompute-num-layers"),
    (["1f1b"], ["--recompute-granularity", "full", "--recompute-num-layers", "0"],
     "--recompute-num-layers"),
    (["1f1b"], ["--recompute-num-layers", "1"], "--recompute-num-layers"),
    (["1f1b"], ["--recompute-method", "block"], "--recompute-method"),
    (["1f1b"], ["--recompute-granularity", "full", "--recompute-num-layers", "3"],
     "--recompute-num-layers"),       # uniform groups of 3 in a chunk of 2 layers
    # span cuts (the ranks raised ScheduleError after they started)
    (["seq1f1b:2"], ["--span-lengths", "8", "4"], "--span-lengths"),
    (["seq1f1b:2"], ["--span-lengths", "16", "0"], "--span-lengths"),
    (["1f1b"], ["--span-lengths", "16"], "--span-lengths"),
    # shape divisibility (a traceback from megatron-core)
    (["1f1b"], ["--hidden-size", "30"], "--hidden-size"),
    (["1f1b"], ["--tp", "2", "--num-attention-heads", "3", "--hidden-size", "24"],
     "--num-attention-heads"),
    (["1f1b"], ["--tp", "2", "--num-query-groups", "1"], "--num-query-groups"),
    # documents, as check_equivalence.py (were accepted)
    (["1f1b"], ["--document-lengths", "8", "4", "--reset-attention-mask"], "--document-lengths"),
    (["1f1b"], ["--document-lengths", "16", "0"], "--document-lengths"),
    (["1f1b"], ["--reset-position-ids"], "--reset-position-ids"),
    # RoPE and norm values, as pretrain_gpt.py (were accepted)
    (["1f1b"], ["--rotary-base", "0"], "--rotary-base"),
    (["1f1b"], ["--rotary-percent", "0"], "--rotary-percent"),
    (["1f1b"], ["--use-rope-scaling", "--rope-scaling-factor", "0"], "--rope-scaling-factor"),
    (["1f1b"], ["--norm-epsilon", "0"], "--norm-epsilon"),
    (["1f1b"], ["--norm-epsilon", "-1"], "--norm-epsilon"),
    # an empty output path was taken as none: nothing written, exit 0
    (["1f1b"], ["--output", ""], "--output"),
])
def test_bad_model_flags_are_refused_while_parsing(schedules, extra, flag):
    """What the ranks refused only after they started (a traceback, or memory run away), or did
    not refuse at all, is one line naming the flag before any process starts."""
    tool = _benchmark_tool()
    with pytest.raises(tool.UsageError) as err:
        tool.parse_args(["--schedules", *schedules, *TINY, *extra])
    assert flag in str(err.value) and "\n" not in str(err.value)


def test_a_bad_flag_exits_2_with_one_line(capsys):
    assert _benchmark_tool().main(["--schedules", "1f1b", *TINY, "--norm-epsilon", "0"]) == 2
    assert capsys.readouterr().err == "benchmark.py: error: --norm-epsilon must be > 0, got 0\n"


def test_the_recompute_shown_is_the_one_given():
    tool = _benchmark_tool()
    assert tool._recompute_text({"recompute_granularity": "full"}) == "full/uniform/1"
    assert tool._recompute_text({"recompute_granularity": "full", "recompute_method": "block",
                                 "recompute_num_layers": 2}) == "full/block/2"
    assert tool._recompute_text({"recompute_granularity": "full",
                                 "recompute_num_layers": 0}) == "full/uniform/0"


@pytest.mark.parametrize("extra", [
    [], ["--recompute-granularity", "full", "--recompute-num-layers", "2"],
    ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
     "1"], ["--document-lengths", "10", "6", "--reset-attention-mask", "--reset-position-ids"],
    ["--span-lengths", "10", "6"], ["--tp", "2", "--num-query-groups", "2"]])
def test_good_model_flags_still_parse(extra):
    schedules = ["seq1f1b:2"] if "--span-lengths" in extra else ["1f1b", "seq1f1b:2"]
    _benchmark_tool().parse_args(["--schedules", *schedules, *TINY, *extra])
