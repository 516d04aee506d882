"""The numerics part of device_check --suite gpu can fail: a span path that loses part of its
cached prefix, or rounds worse than bf16 allows, is out of bounds."""
import pytest

from seq1f1b.device_checks import numerics as device_numerics

pytestmark = pytest.mark.usefixtures("megatron_world")


class _Open:
    @staticmethod
    def passed() -> bool:
        return False


def _sdpa(monkeypatch, corrupt=None, backend: str = "sdpa", max_score_bytes: float = 1e9
          ) -> dict:
    monkeypatch.setattr(device_numerics, "NUMERICS_BACKENDS", (backend,))
    if corrupt is not None:
        span_path = device_numerics._span_path

        def corrupted(*args, **kwargs):
            return {name: corrupt(name, value)
                    for name, value in span_path(*args, **kwargs).items()}

        monkeypatch.setattr(device_numerics, "_span_path", corrupted)
    return device_numerics.check_numerics(128, 2, 16, max_score_bytes,
                                          _Open())["backends"][backend]


def test_the_span_path_is_within_bf16_bounds(monkeypatch):
    entry = _sdpa(monkeypatch)
    assert entry["within_bound"], entry
    assert all(0 < error < 2 ** -6 for error in entry["span_errors"].values())


@pytest.mark.parametrize("tensor", ["output", "prefix_dk"])
def test_an_error_a_few_percent_past_bf16_is_out_of_bounds(monkeypatch, tensor):
    def corrupt(name, value):
        return value * 1.05 if name == tensor else value

    entry = _sdpa(monkeypatch, corrupt)
    assert not entry["within_bound"]
    assert entry["span_errors"][tensor] > entry["bounds"][tensor]


@pytest.mark.parametrize("corrupted", [None, "prefix_dv"])
def test_eager_without_room_to_run_unsplit_is_held_to_its_error_on_the_spans_rows(
        monkeypatch, corrupted):
    """Eager's unsplit run needs L x L scores (128 x 128 x 2 heads x 4 B here, past a 1e5
    limit): its baseline is then the kernel on the span's rows with the whole K/V and no
    cache, whose output error is the span path's to the bit (the same arithmetic), while a
    span path 5% off in one tensor stays out of bounds."""
    def corrupt(name, value):
        return value * 1.05 if name == corrupted else value

    entry = _sdpa(monkeypatch, corrupt, backend="eager", max_score_bytes=1e5)
    assert "unsplit_errors" not in entry and "unsplit_skipped" in entry
    assert entry["rows_errors"]["output"] == entry["span_errors"]["output"]
    assert entry["within_bound"] == (corrupted is None), entry
    if corrupted:
        assert entry["span_errors"][corrupted] > entry["bounds"][corrupted]


def _device_check_tool():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "device_check.py"
    spec = importlib.util.spec_from_file_location("device_check_tool", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("outdir, extra, needle", [
    ("/proc", [], "OUTDIR: /proc is not writable"),
    ("/proc/x", [], "OUTDIR: /proc/x cannot be created"),
    ("a_file", [], "OUTDIR: a_file exists and is not a directory"),
    ("", [], "OUTDIR: empty path"),
    ("out", ["--budget-s", "-1"], "--budget-s"),
    ("out", ["--budget-s", "0"], "--budget-s"),
    ("out", ["--budget-s", "nan"], "--budget-s"),
    ("out", ["--suite", "gpu", "--budget-s", "60"], "--budget-s belongs to --suite stage"),
])
def test_device_check_refuses_bad_arguments_before_measuring(tmp_path, monkeypatch, capsys,
                                                             outdir, extra, needle):
    """One line, exit code 2, nothing written: not a traceback after minutes of measuring."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x")
    tool = _device_check_tool()
    monkeypatch.setattr(tool, "_setup_process", lambda: pytest.fail("measuring started"))
    assert tool.main([outdir, "--tiny", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_measured_model_is_freed_before_the_next_check():
    """A stage model is a reference cycle; left to the garbage collector's schedule it stayed
    allocated through the next check on the GPU and inflated that check's peak."""
    import weakref

    tool = _device_check_tool()
    config, model = tool._stage_model(tool.TINY, tool.TINY.stage_lengths[0])
    parameter = weakref.ref(next(model.parameters()))
    del config, model
    tool._release_cache()
    assert parameter() is None


def test_the_gpu_suite_writes_each_part_down_as_it_ends(tmp_path, monkeypatch):
    """The device session cuts a command off at its limit: the parts that ended are on disk."""
    import json

    tool = _device_check_tool()
    seen = []

    def parts(shapes, tiny, names):
        for name in names:
            if seen:                        # the part before this one is already written
                assert json.loads((tmp_path / tool.RESULT_FILE).read_text())[seen[-1]] == {
                    "measured": seen[-1]}
            seen.append(name)
            yield name, {"measured": name}

    monkeypatch.setattr(tool, "run_gpu_suite", parts)
    monkeypatch.setattr(tool, "_setup_process", lambda: None)
    assert tool.main([str(tmp_path), "--tiny", "--suite", "gpu",
                      "--parts", "memory", "numerics"]) == 0
    assert seen == ["numerics", "memory"]           # the suite's order, not the command's
    written = json.loads((tmp_path / tool.RESULT_FILE).read_text())
    assert [name for name in written if name in tool.SUITE_BUDGETS_S] == seen


def test_a_failed_training_run_names_the_childs_exception():
    """torchrun's last stderr line is a banner; the part must report what the child raised."""
    from megatron.training.device_training import _failure

    stderr = ("Traceback (most recent call last):\n  File \"pretrain_gpt.py\", line 3\n"
              "[rank0]: ModuleNotFoundError: No module named 'megatron.core'\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
              "=========\n/work/main/pretrain_gpt.py FAILED\n=========\n")
    failure = _failure(stderr)
    assert failure["error"] == "[rank0]: ModuleNotFoundError: No module named 'megatron.core'"
    assert failure["stderr_tail"][-1] == "========="
    assert _failure("")["error"] == "no log line"


def test_a_training_run_keeps_the_callers_python_path(monkeypatch):
    """On the GPU machine megatron-core is found only through PYTHONPATH (.device/site)."""
    import os

    from megatron.training import device_training

    monkeypatch.setenv("PYTHONPATH", "/device/site")
    path = device_training.child_environment()["PYTHONPATH"].split(os.pathsep)
    assert path == [str(device_training.ROOT), "/device/site"]


def test_the_estimate_holds_the_h200_stages_allocated_peak():
    """The H200 run (docs/gpu/h200_suite.json: one 8-layer stage at 32K, k = 4, bf16, one
    micro-batch, no optimizer) peaked at its first backward, where the runtime makes the dK/dV
    accumulators layer by layer as the layers' saved tensors go. The estimate for the run's
    shapes (device_check's own `_stage_estimate`) must hold that allocated peak, with little to
    spare: the estimator had counted the span's activations, its logits and all the
    accumulators at once (1.133 of the peak)."""
    import json
    from pathlib import Path

    tool = _device_check_tool()
    run = json.loads((Path(__file__).resolve().parents[2] / "docs" / "gpu" /
                      "h200_suite.json").read_text())
    shapes = tool.Shapes(**{name: tuple(value) if isinstance(value, list) else value
                            for name, value in run["shapes"].items()})
    measured = run["memory"]["stage"][0]
    stage = tool._stage_estimate(shapes, measured["seq_length"], measured["precision"]).stages[0]
    estimated = (stage.parameter_bytes + stage.gradient_bytes + stage.held_for_backward_bytes
                 + stage.workspace_bytes)
    assert 1.0 <= estimated / measured["memory"]["max_memory_allocated_bytes"] <= 1.03
