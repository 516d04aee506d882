"""The numerics part of device_check --suite gpu can fail: a span path that loses part of its
cached prefix, or rounds worse than bf16 allows, is out of bounds."""
import pytest

from seq1f1b.device_checks import numerics as device_numerics

pytestmark = pytest.mark.usefixtures("megatron_world")


class _Open:
    @staticmethod
    def passed() -> bool:
        return False


def _sdpa(monkeypatch, corrupt=None) -> dict:
    monkeypatch.setattr(device_numerics, "NUMERICS_BACKENDS", ("sdpa",))
    if corrupt is not None:
        span_path = device_numerics._span_path

        def corrupted(*args, **kwargs):
            return {name: corrupt(name, value)
                    for name, value in span_path(*args, **kwargs).items()}

        monkeypatch.setattr(device_numerics, "_span_path", corrupted)
    return device_numerics.check_numerics(128, 2, 16, 1e9, _Open())["backends"]["sdpa"]


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
