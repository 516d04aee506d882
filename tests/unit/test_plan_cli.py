"""tools/plan.py: show / partition / simulate / comm, their JSON, the pictures, one-line errors."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from prefetch_order import prefetch_plan

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_cli", REPO / "tools" / "plan.py")
plan_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_cli)


def run(capsys, *argv):
    code = plan_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_show_text_and_json(capsys):
    code, out, _ = run(capsys, "show", "--schedule", "seq1f1b", "--pp", "4", "--microbatches",
                       "8", "--splits", "2")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("rank 0: F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 F2.1 B0.0")
    data = run_json(capsys, "show", "--schedule", "seq1f1b-interleaved", "--pp", "2",
                    "--microbatches", "2", "--splits", "2", "--chunks", "2")
    assert {k: data[k] for k in ("schedule", "pp", "microbatches", "splits", "chunks")} == \
        {"schedule": "seq1f1b-interleaved", "pp": 2, "microbatches": 2, "splits": 2, "chunks": 2}
    assert len(data["ranks"]) == 2 and data["ranks"][0][0] == "F0.0@0"
    assert all(len(actions) == 2 * 2 * 2 * 2 for actions in data["ranks"])


def test_comm_prints_each_ranks_groups_and_both_verdicts(capsys):
    code, out, _ = run(capsys, "comm", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("1f1b: P=2 m=4 k=1 V=1; each line is one batch_isend_irecv")
    assert "  after F1.0     send activation of micro-batch 1 span 0 for stage 1 to rank 1; recv " \
           "gradient of micro-batch 0 span 0 for stage 0 from rank 1" in lines
    assert lines[-2:] == ["NCCL lazy mode: 11 groups, 8 messages: ok",
                          "NCCL eager mode: 11 groups, 8 messages: ok"]
    data = run_json(capsys, "comm", "--schedule", "seq1f1b-interleaved", "--pp", "2",
                    "--microbatches", "2", "--splits", "2", "--chunks", "2", "--mode", "eager")
    assert list(data["verdicts"]) == ["eager"] and data["verdicts"]["eager"]["ok"]
    first = data["ranks"][1][0]
    assert first["after"] is None and first["ops"][0] == {
        "op": "recv", "peer": 0, "message": "activation of micro-batch 0 span 0 for stage 1"}


def test_comm_exits_1_on_an_order_that_deadlocks(capsys, monkeypatch):
    monkeypatch.setattr(plan_cli, "communication_plan", prefetch_plan)
    code, out, _ = run(capsys, "comm", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4")
    assert code == 1
    assert out.splitlines()[-1].startswith("NCCL eager mode: 16 groups, 8 messages: FAILS: "
                                           "deadlock among ranks 0, 1: ")


@pytest.mark.parametrize("seq_length", [32768, 65536, 131072])
def test_partition_compute_7b_tp2_sequence_parallel(capsys, seq_length):
    data = run_json(capsys, "partition", "--seq-length", str(seq_length), "--splits", "4",
                    "--method", "compute", "--model", "7b", "--tp", "2", "--sequence-parallel")
    assert sum(data["spans"]) == seq_length and all(n % 2 == 0 for n in data["spans"])
    assert len(data["flops"]) == 4
    assert data["imbalance"] == max(data["flops"]) * 4 / sum(data["flops"]) <= 1.01


def test_partition_with_model_dimensions_and_text_output(capsys):
    code, out, _ = run(capsys, "partition", "--seq-length", "4096", "--splits", "2", "--method",
                       "even", "--num-layers", "4", "--hidden-size", "256",
                       "--num-attention-heads", "4")
    assert code == 0 and out.splitlines()[0] == "spans: 2048 2048"
    assert "imbalance" in out
    assert run_json(capsys, "partition", "--seq-length", "10", "--splits", "3", "--method",
                    "explicit", "--span-lengths", "5", "3", "2") == {"spans": [5, 3, 2]}


def test_simulate_uniform_json_matches_the_closed_form(capsys):
    data = run_json(capsys, "simulate", "--schedule", "seq1f1b", "--pp", "4", "--microbatches",
                    "8", "--splits", "4", "--uniform-cost", "1", "2")
    assert data["bubble_ratio"] == 3 / (8 * 4 + 3)
    assert data["makespan"] == 3 * (8 * 4 + 3)
    assert [r["peak_live_spans"] for r in data["ranks"]] == [7, 6, 5, 4]
    assert all(r["busy"] + r["idle"] == data["makespan"] for r in data["ranks"])
    assert "actions" not in data["ranks"][0]


def test_simulate_model_writes_plot_and_trace(capsys, tmp_path):
    png, trace = tmp_path / "timeline.png", tmp_path / "trace.json"
    code, out, err = run(capsys, "simulate", "--schedule", "seq1f1b-interleaved", "--pp", "2",
                         "--microbatches", "4", "--splits", "2", "--chunks", "2", "--model",
                         "1.3b", "--seq-length", "8192", "--tp", "2", "--sequence-parallel",
                         "--partition", "compute", "--plot", str(png), "--trace", str(trace))
    assert code == 0, err
    assert "bubble" in out and "act GiB" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    boxes = [e for e in events if e["ph"] == "X"]
    assert len(boxes) == 2 * (2 * 4 * 2 * 2)                # P ranks x F,B of m*k*V units
    assert {e["tid"] for e in boxes} == {0, 1} and {e["pid"] for e in boxes} == {0}
    assert all(e["dur"] > 0 for e in boxes)
    data = run_json(capsys, "simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches",
                    "2", "--splits", "2", "--model", "1.3b", "--seq-length", "8192",
                    "--timeline")
    assert data["ranks"][0]["peak_activation_bytes"] > data["ranks"][1]["peak_activation_bytes"]
    assert len(data["ranks"][0]["actions"]) == 8


BAD_INPUTS = [
    (["show", "--schedule", "seq1f1b", "--pp", "0", "--microbatches", "2"], "--pp"),
    (["show", "--schedule", "nope", "--pp", "2", "--microbatches", "2"], "--schedule"),
    (["partition", "--seq-length", "3", "--splits", "4"], "--splits"),
    (["partition", "--seq-length", "1024", "--splits", "2", "--model", "8b"], "--model"),
    (["partition", "--seq-length", "65535", "--splits", "4", "--tp", "2", "--sequence-parallel"],
     "--seq-length"),
    (["partition", "--seq-length", "64", "--splits", "2", "--method", "compute"], "--method"),
    (["partition", "--seq-length", "64", "--splits", "2", "--num-layers", "2"], "--hidden-size"),
    (["simulate", "--schedule", "seq1f1b", "--pp", "3", "--microbatches", "2", "--splits", "2",
      "--model", "7b", "--seq-length", "4096"], "--pp"),
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2"],
     "--uniform-cost"),
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--uniform-cost",
      "1"], "--uniform-cost"),
    (["comm", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--mode", "fast"],
     "--mode"),
    (["comm", "--schedule", "seq1f1b-interleaved", "--pp", "2", "--microbatches", "2"],
     "--chunks"),
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--model", "7b",
      "--seq-length", "4096", "--pipeline-model-parallel-layout", "Et*16|t*15L"],
     "--pipeline-model-parallel-layout holds 31"),
    (["search", "--pp", "2", "--microbatches", "2", "--model", "7b", "--seq-length", "4096",
      "--search-layout", "--pipeline-model-parallel-layout", "Et*8|t*8|t*8|t*8L"],
     "--search-layout"),
    (["search", "--pp", "2", "--microbatches", "2", "--search-layout"], "--search-layout"),
    (["search", "--pp", "2", "--microbatches", "2", "--model", "7b", "--seq-length", "4096",
      "--chunks", "1", "--search-layout"], "--search-layout chooses the layers of the 2P stages"),
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--splits", "2",
      "--uniform-cost", "1", "2", "--loss-backward-in-forward"], "--loss-backward-in-forward"),
    (["memory", "--schedule", "megatron-1f1b", "--pp", "2", "--microbatches", "2", "--model",
      "7b", "--seq-length", "4096", "--loss-backward-in-forward"], "--loss-backward-in-forward"),
    (["memory", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--model",
      "7b", "--seq-length", "4096", "--spread-output"], "--spread-output: seq1f1b is not searched"),
    (["tune", "--model", "7b", "--seq-length", "4096", "--gpus", "8",
      "--loss-backward-in-forward", "maybe"], "--loss-backward-in-forward"),
    # 0 is a value, not an absent flag (it ran k = 1), and nothing is said before the error
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--splits", "0",
      "--uniform-cost", "1", "2"], "--splits"),
    (["search", "--pp", "0", "--microbatches", "4"], "--pp"),
    (["search", "--pp", "2", "--microbatches", "4", "--chunks", "0"], "--chunks"),
    (["compare", "--pp", "4", "--microbatches", "0"], "--microbatches"),
    # signs, emptiness, formats and flags a command would have ignored
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "4", "--splits", "2",
      "--model", "1.3b", "--seq-length", "4096", "--cp", "-1"], "--cp"),
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "4", "--splits", "2",
      "--model", "1.3b", "--seq-length", "4096", "--cp", "3"], "--cp 3"),
    (["partition", "--seq-length", "100", "--splits", "2", "--align", "-4"], "--align"),
    (["partition", "--seq-length", "100", "--splits", "2", "--cp", "0"], "--cp"),
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--uniform-cost",
      "1", "2", "--plot", "timeline.txt"], "--plot"),
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--uniform-cost",
      "1", "2", "--trace", "/proc/trace.json"], "--trace"),
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--uniform-cost",
      "1", "2", "--trace", ""], "--trace"),
    (["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--uniform-cost",
      "1", "2", "--p2p-latency", "-1"], "--p2p-latency"),
    (["search", "--pp", "2", "--microbatches", "2", "--device-tflops", "nan"], "--device-tflops"),
    (["search", "--pp", "2", "--microbatches", "2", "--save-schedule", ""], "--save-schedule"),
    (["show", "--schedule", "seq1f1b-zb-auto", "--pp", "2", "--microbatches", "2",
      "--schedule-memory-cap", ""], "--schedule-memory-cap"),
    (["memory", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--model", "1.3b",
      "--seq-length", "4096", "--align", "3"], "--align"),
    (["memory", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--model", "1.3b",
      "--seq-length", "4096", "--calibration", "timings.json"], "--calibration"),
    (["memory", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--model", "1.3b",
      "--seq-length", "4096", "--gpu-memory", "nan"], "--gpu-memory"),
    (["memory", "--schedule", "seq1f1b", "--pp", "2", "--microbatches", "2", "--model", "1.3b",
      "--seq-length", "4096", "--overhead-gb", "nan"], "--overhead-gb"),
    (["tune", "--model", "7b", "--seq-length", "4096", "--gpus", "8", "--gpu-memory", "inf"],
     "--gpu-memory"),
    (["tune", "--model", "7b", "--seq-length", "4096", "--gpus", "8", "--gpu-memory", ""],
     "--gpu-memory"),
    (["tune", "--model", "7b", "--seq-length", "4096", "--gpus", "8", "--schedules", ","],
     "--schedules"),
    (["tune", "--model", "7b", "--seq-length", "4096", "--gpus", "8", "--schedules", ""],
     "--schedules"),
    (["tune", "--model", "7b", "--seq-length", "4096", "--gpus", "8", "--recompute", ""],
     "--recompute"),
    (["tune", "--model", "7b", "--seq-length", "4096", "--gpus", "8", "--emit-sbatch", ""],
     "--emit-sbatch"),
]


@pytest.mark.parametrize("command", ["search", "compare"])
def test_search_and_compare_price_context_parallelism(capsys, command):
    """--cp divides every rank's compute by C (it was accepted and ignored here while simulate
    priced it): the makespans halve at C = 2."""
    def makespans(cp):
        data = run_json(capsys, command, "--pp", "2", "--microbatches", "2", "--splits", "2",
                        "--model", "1.3b", "--seq-length", "8192", "--cp", str(cp))
        return [data["makespan"]] if command == "search" else [r["makespan"] for r in data]
    for whole, halved in zip(makespans(1), makespans(2)):
        assert halved < 0.6 * whole


@pytest.mark.parametrize("argv, flag", BAD_INPUTS)
def test_bad_input_is_one_line_naming_the_flag(capsys, argv, flag):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and flag in err


def test_bad_input_from_a_shell_exits_2_with_one_line():
    for argv, flag in (BAD_INPUTS[0], BAD_INPUTS[2], BAD_INPUTS[7]):
        done = subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), *argv],
                              capture_output=True, text=True, cwd="/", timeout=120)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.splitlines()) == 1 and flag in done.stderr
        assert "Traceback" not in done.stderr


def test_search_layout_says_the_layout_it_chose_and_simulate_runs_it(capsys, monkeypatch):
    """plan.py search --search-layout (7B/64K, P=4, m=8, k=2, cap 0.5x): the layout chosen on
    a V is printed (JSON and stderr), no slower than the even split it started from; each
    layout searched says its makespan as it ends (search_progress.py, here without waiting),
    the even split first, the shortest of them the one chosen; the final
    search, which also places a loop of the same stages and ends with the annealing walk the
    candidates were compared without, is no slower than that V; and the schedule searched with
    that layout
    given back as --pipeline-model-parallel-layout finds the search's costs: its lower bound
    and its makespan are the search's."""
    from seq1f1b.plan import search_progress
    monkeypatch.setattr(search_progress, "QUIET_SECONDS", 0.0)
    shape = ["--pp", "4", "--microbatches", "8", "--splits", "2", "--model", "7b", "--tp", "8",
             "--sequence-parallel", "--seq-length", "65536", "--partition", "compute"]
    code, out, err = run(capsys, "search", *shape, "--schedule-memory-cap", "0.5x",
                         "--search-layout", "--json")
    assert code == 0, err
    found = json.loads(out)
    line = next(x for x in err.splitlines() if "--search-layout chose" in x)
    assert f"'{found['layout']}'" in line
    chosen, even = (float(x) for x in line.split("makespan ")[1].split(" for the")[0]
                    .split(" on a V against "))
    assert chosen <= even and found["makespan"] <= chosen * (1 + 1e-9)
    tried = [x for x in err.splitlines() if x.startswith("plan.py: --search-layout: layout ")]
    assert [x.split(" (")[0] for x in tried] == [
        f"plan.py: --search-layout: layout {n} of 7" for n in range(1, 8)], tried
    assert "('Et*4|t*4|t*4|t*4|t*4|t*4|t*4|t*4L'): makespan " in tried[0]
    assert float(tried[0].split("makespan ")[1].split(" ")[0]) == pytest.approx(even, 1e-5)
    assert float(tried[-1].split("so far ")[1].split(" ")[0]) == pytest.approx(chosen, 1e-5)
    again = run_json(capsys, "search", *shape, "--schedule-memory-cap", "0.5x",
                     "--pipeline-model-parallel-layout", found["layout"])
    assert again["lower_bound"] == pytest.approx(found["lower_bound"])
    assert again["makespan"] == pytest.approx(found["makespan"])


def test_a_long_search_says_how_far_it_is_and_finds_the_same_order(capsys, monkeypatch):
    """A search that has run for QUIET_SECONDS reports its stages on stderr (one at P = 16,
    m = 64, k = 8 takes minutes); before that it says nothing, and the order is the same
    either way: the clock decides only what is printed (search_progress.py)."""
    from seq1f1b.plan import registry, search_progress
    argv = ["search", "--pp", "2", "--microbatches", "4", "--splits", "2", "--chunks", "2",
            "--model", "1.3b", "--seq-length", "8192", "--json"]
    said = {}
    for quiet in (1e9, 0.0):
        monkeypatch.setattr(search_progress, "QUIET_SECONDS", quiet)
        registry._searched.cache_clear()      # searched again, not read from the last run
        code, out, err = run(capsys, *argv)
        assert code == 0, err
        said[quiet] = out, [line for line in err.splitlines() if "seq1f1b-zb-auto on a" in line]
    assert said[1e9][0] == said[0.0][0] and said[1e9][1] == []
    lines = said[0.0][1]
    assert lines[0].startswith("plan.py: seq1f1b-zb-auto on a V: ")
    assert "greedy replays and the constructions, makespan" in lines[0]
    assert any("on a V: refined, makespan" in line for line in lines)
    assert any("on a loop: refined, makespan" in line for line in lines)
