"""--pipeline-schedule-file (seq1f1b/plan/schedule_file.py): a file round-trips any registry
schedule, loop or V, and runs under the registry's rules; a bad one is refused in one line
naming the file and the first bad action, before any work (pretrain_gpt.py, plan.py,
check_equivalence.py, benchmark.py all exit 2 on it)."""
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training import arguments
from megatron.training.arguments import parse_and_validate_args
from seq1f1b.plan import registry, schedule_file
from seq1f1b.plan.actions import ScheduleError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    """Files registered here are gone after each test: later tests that walk every registry
    name (the schedule grids) see the families only."""
    registry.names()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


@pytest.mark.parametrize("name, pp, m, k, v", [("1f1b", 2, 3, 1, 1), ("seq1f1b", 4, 4, 2, 1),
                                               ("seq1f1b-interleaved", 2, 4, 2, 2),
                                               ("seq1f1b-zbv", 2, 4, 3, 2), ("zbv", 4, 8, 1, 2)])
def test_a_written_schedule_loads_back_as_itself_with_its_placement(tmp_path, name, pp, m, k, v):
    plan = registry.build(name, pp, m, k, v)
    path = tmp_path / f"{name}.csv"
    path.write_text(schedule_file.write(plan))
    loaded = schedule_file.load(path)
    assert loaded.name == f"file:{path}" and loaded.programs == plan.programs
    assert (loaded.pp, loaded.microbatches, loaded.splits, loaded.chunks, loaded.placement) == \
        (pp, m, k, v, plan.placement)
    info = registry.get(loaded.name)
    assert (info.placement, info.chunked, info.splits_backward) == \
        (plan.placement, v > 1, plan.split_backward)
    assert registry.build(loaded.name, pp, m, k, v).programs == plan.programs
    with pytest.raises(ScheduleError, match=r"is written for P=\d+ m=\d+ k=\d+ V=\d+; this run "
                                            r"has P=\d+ m=99"):
        registry.build(loaded.name, pp, 99, k, v)


def _bad(tmp_path, text: str):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, problem", [
    ("F0.0,B0.0\nF0.0,X1\n", "rank 1, action 2: 'X1' is not an action"),
    ("F0.0,B0.0\nB0.0,F0.0\n", "rank 1 runs B0.0 (step 0) before F0.0 (step 1)"),
    ("F0.0,B0.0\nF0.0\n", "rank 1 never runs: B0.0"),
    ("F0.0,F0.1,B0.1,B0.0\nF0.1,F0.0,B0.1,B0.0\n", "rank 1 runs F0.1 (step 0) before F0.0"),
    ("# placement: spiral\nF0.0,B0.0\n", "placement 'spiral'"),
    ("0F0,0Q1\n1F0,1B0\n", "row 1 cell 2: cannot read '0Q1'"),      # torch's format
    ("\n# nothing\n", "no actions"),
])
def test_a_bad_file_is_refused_naming_the_first_bad_action(tmp_path, text, problem):
    path = _bad(tmp_path, text)
    with pytest.raises(ScheduleError) as err:
        schedule_file.load(path)
    message = str(err.value)
    assert message.startswith(f"--pipeline-schedule-file {path}: ") and "\n" not in message
    assert problem in message, message


def _train_flags(path, *extra):
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "2", "--lr", "1e-3", "--mock-data",
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule-file", str(path), *extra]


@pytest.fixture
def registry_catalog(monkeypatch):
    """The schedule names the registry holds now (test_arguments fixes a catalog instead)."""
    monkeypatch.setattr(arguments, "schedule_catalog", arguments.schedule_catalog)


def test_pretrain_takes_the_files_schedule_and_its_k(tmp_path, registry_catalog):
    path = tmp_path / "zbv.csv"
    path.write_text(schedule_file.write(registry.build("seq1f1b-zbv", 2, 4, 2, 2)))
    args = parse_and_validate_args(_train_flags(
        path, "--num-layers-per-virtual-pipeline-stage", "1",
        "--untie-embeddings-and-output-weights"), world_size=2)
    assert (args.pipeline_schedule, args.seq1f1b_splits) == (f"file:{path}", 2)
    assert args.virtual_pipeline_model_parallel_size == 2


SPREAD_FILE = ("F0.0,F1.0,B0.0,F2.0,B1.0,F3.0,B2.0,B3.0\n"
               "F0.0,O0.0,B0.0,F1.0,O1.0,B1.0,F2.0,O2.0,B2.0,F3.0,O3.0,B3.0\n")
"""P=2, m=4 with the output layer and the loss as O actions (here on the last stage's rank)."""


@pytest.mark.parametrize("extra, text, flag", [
    ((), "F0.0,B0.0\nB0.0,F0.0\n", "--pipeline-schedule-file"),
    (("--pipeline-schedule", "1f1b"), None, "--pipeline-schedule-file replaces"),
    (("--seq1f1b-splits", "2"), None, "is written for P=2 m=4 k=1 V=1; this run has P=2 m=4 k=2"),
    (("--global-batch-size", "2"), None, "this run has P=2 m=2"),
    (("--loss-backward-in-forward",), SPREAD_FILE,
     "--loss-backward-in-forward: --pipeline-schedule-file"),
])
def test_pretrain_refuses_a_bad_or_mismatched_file_in_one_line(tmp_path, capsys, registry_catalog,
                                                              extra, text, flag):
    path = tmp_path / "plan.csv"
    path.write_text(text or schedule_file.write(registry.build("1f1b", 2, 4, 1, 1)))
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate_args(_train_flags(path, *extra), world_size=2)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and flag in err and "\n" not in err, err


@pytest.mark.parametrize("tool, argv", [
    ("plan.py", ["show"]), ("plan.py", ["comm"]),
    ("check_equivalence.py", []), ("benchmark.py", []),
])
def test_the_tools_refuse_a_bad_file_in_one_line_exit_2(tmp_path, tool, argv):
    path = _bad(tmp_path, "F0.0,B0.0\nB0.0,F0.0\n")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / tool), *argv,
                           "--pipeline-schedule-file", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"{tool}: error: --pipeline-schedule-file {path}: rank 1 runs B0.0 (step 0) "
                    "before F0.0 (step 1), which it needs (its own forward)"), proc.stderr


@pytest.mark.parametrize("name, pp, m", [("zbv", 2, 4), ("1f1b", 3, 5)])
def test_torch_pipelining_csv_files_load_as_their_schedules(tmp_path, name, pp, m):
    """A schedule written for torch.distributed.pipelining (or torchtitan's
    pipeline_parallel_schedule_csv) runs here as it is."""
    from seq1f1b.plan.torch_format import write_torch_csv

    chunks = 2 if name == "zbv" else 1
    ours = registry.build(name, pp, m, 1, chunks)
    path = tmp_path / f"{name}.csv"
    path.write_text(write_torch_csv(ours))
    loaded = schedule_file.load(path)
    assert loaded.programs == ours.programs and loaded.placement == ours.placement


def test_a_mixed_backward_runs_each_full_backward_as_b_then_w(tmp_path):
    """DualPipeV's form: some units with a full backward, others split; the runtime gets every
    backward split, at the same moment on each rank."""
    path = tmp_path / "mixed.csv"
    path.write_text("F0.0,F1.0,B0.0,W0.0,B1.0\nF0.0,F1.0,B0.0,B1.0,W1.0\n")
    loaded = schedule_file.load(path)
    assert [a.format() for a in loaded.programs[0]] == ["F0.0", "F1.0", "B0.0", "W0.0", "B1.0",
                                                         "W1.0"]
    assert [a.format() for a in loaded.programs[1]] == ["F0.0", "F1.0", "B0.0", "W0.0", "B1.0",
                                                         "W1.0"]
