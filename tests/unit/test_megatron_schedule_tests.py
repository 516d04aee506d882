"""tools/megatron_schedule_tests.py without a Megatron-LM checkout: the check of our functions
against megatron's in its slots, the merge of the ranks' reports, and the one-line refusals."""
import importlib.util
import types
from pathlib import Path

import pytest
import torch

from seq1f1b.megatron_suite import rank_report, results, slots as checked_slots

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _load("megatron_schedule_tests")


@pytest.mark.parametrize("ours,theirs,same", [
    ([{"loss": 1}], [{"loss": 1}], True),
    ([{"loss": 1}], [{"loss": 2}], False),
    ([{"loss": 1}], ({"loss": 1},), False),
    ([], [{"loss": 1}], False),
    (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), True),
    (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]), False),
    (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64), False),
    ({"lm loss": torch.tensor(3.0)}, {"lm loss": 3.0}, False),
])
def test_same_result(ours, theirs, same):
    assert checked_slots.same_result(ours, theirs) is same


def _slot(ours, theirs):
    return checked_slots.CheckedSlot("slot", ours, theirs)


def test_a_forward_only_call_runs_both_from_the_same_rng_state_and_returns_ours():
    calls = []

    def draw(tag):
        def run(**kwargs):
            calls.append(tag)
            return [float(torch.rand(()))]
        return run

    torch.manual_seed(3)
    first_draw = [float(torch.rand(()))]
    torch.manual_seed(3)
    slot = _slot(draw("ours"), draw("theirs"))
    assert slot(forward_only=True) == first_draw       # ours drew what megatron's drew
    assert calls == ["theirs", "ours"] and slot.compared == 1


def test_different_results_fail():
    slot = _slot(lambda **kw: [{"loss": 1}], lambda **kw: [{"loss": 2}])
    with pytest.raises(AssertionError, match="ours returned"):
        slot(forward_only=True)
    assert slot.compared == 0


def _raiser(error):
    def run(**kwargs):
        raise error
    return run


def test_a_refusal_must_be_megatrons_exception_type():
    same = _slot(_raiser(RuntimeError("ours")), _raiser(RuntimeError("theirs")))
    with pytest.raises(RuntimeError, match="ours"):
        same(forward_only=True)
    assert same.compared == 1
    other = _slot(_raiser(ValueError("ours")), _raiser(RuntimeError("theirs")))
    with pytest.raises(AssertionError, match="ours raised ValueError, megatron's RuntimeError"):
        other(forward_only=True)
    accepted = _slot(lambda **kw: [], _raiser(RuntimeError("theirs")))
    with pytest.raises(AssertionError, match="megatron's raised RuntimeError"):
        accepted(forward_only=True)


def test_a_training_call_runs_ours_alone():
    slot = _slot(lambda **kw: ["ours"], _raiser(AssertionError("megatron's must not run")))
    assert slot(forward_only=False) == ["ours"] and slot() == ["ours"]
    assert slot.compared == 0


def test_install_slots_fills_both_slots_with_checked_functions():
    def without(**kwargs):
        return "1f1b"

    def interleaved(**kwargs):
        return "interleaved"

    schedules = types.SimpleNamespace(forward_backward_pipelining_without_interleaving=without,
                                      forward_backward_pipelining_with_interleaving=interleaved)
    slots = checked_slots.install_slots(schedules)
    assert [s.theirs for s in slots] == [without, interleaved]
    assert schedules.forward_backward_pipelining_without_interleaving is slots[0]
    assert slots[0].ours.__name__ == "forward_backward_seq1f1b"
    assert slots[1].ours.__name__ == "forward_backward_seq1f1b_interleaved"


def _fake_report(when, outcome, longrepr=None, nodeid="t.py::test_a"):
    return types.SimpleNamespace(nodeid=nodeid, when=when, failed=outcome == "failed",
                                 skipped=outcome == "skipped", longrepr=longrepr,
                                 longreprtext=str(longrepr))


def test_rank_report_keeps_the_worst_phase_and_the_calls_compared(tmp_path):
    slot = _slot(lambda **kw: [], lambda **kw: [])
    report = rank_report.RankReport(tmp_path / "rank0.json", 0, [slot])
    crash = types.SimpleNamespace(reprcrash=types.SimpleNamespace(message="ValueError: boom\nmore"))
    report.pytest_runtest_logreport(_fake_report("setup", "passed"))
    slot(forward_only=True)
    report.pytest_runtest_logreport(_fake_report("call", "failed", crash))
    report.pytest_runtest_logreport(_fake_report("teardown", "passed"))
    skip = ("f.py", 3, "Skipped: CUDA not available")
    report.pytest_runtest_logreport(_fake_report("setup", "skipped", skip, "t.py::test_b"))
    report.pytest_runtest_logreport(_fake_report("teardown", "passed", None, "t.py::test_b"))
    assert report.tests == {
        "t.py::test_a": {"outcome": "failed", "detail": "ValueError: boom", "compared": 1},
        "t.py::test_b": {"outcome": "skipped", "detail": "Skipped: CUDA not available",
                         "compared": 0}}


def _rank(**tests):
    return {"tests": {name: {"outcome": outcome, "detail": detail, "compared": 1}
                      for name, (outcome, detail) in tests.items()}}


def test_merge_fails_a_test_that_fails_on_one_rank_or_whose_rank_is_silent():
    reports = {0: _rank(a=("passed", ""), b=("passed", ""), c=("skipped", "no CUDA")),
               1: _rank(a=("passed", ""), b=("failed", "AssertionError: x"),
                        c=("skipped", "no CUDA"))}
    merged = results.merge_reports(reports, 2)
    assert merged["a"] == {"outcome": "passed", "failed_ranks": [], "detail": "", "compared": 2}
    assert merged["b"]["outcome"] == "failed" and merged["b"]["failed_ranks"] == [1]
    assert merged["b"]["detail"] == "AssertionError: x"
    assert merged["c"]["outcome"] == "skipped"
    assert results.summary_line(merged) == "1 passed, 1 failed, 1 skipped"
    silent = results.merge_reports({0: reports[0], 1: None}, 2)
    assert silent["a"]["outcome"] == "failed" and silent["a"]["failed_ranks"] == [1]
    assert silent["a"]["detail"] == "rank 1 has no result for this test"


def test_render_lists_failures_with_their_ranks_and_groups_skips():
    merged = results.merge_reports(
        {0: _rank(**{"f::test_b": ("failed", "E: x"), "f::test_c[1]": ("skipped", "no CUDA"),
                     "f::test_c[2]": ("skipped", "no CUDA")})}, 1)
    text = results.render(merged, "ours")
    assert "FAILED  test_b  (1 calls on all ranks checked against megatron's)" in text
    assert "ranks [0]: E: x" in text
    assert "SKIPPED test_c x2: no CUDA" in text
    assert text.endswith("0 passed, 1 failed, 2 skipped")


def test_without_a_checkout_one_line_names_the_flag(tmp_path, capsys):
    assert launcher.main(["--megatron-repo", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        f"megatron_schedule_tests.py: error: --megatron-repo {tmp_path}: no tests/unit_tests/")


def test_missing_test_dependencies_are_named(tmp_path, monkeypatch):
    (tmp_path / results.TEST_FILE).parent.mkdir(parents=True)
    (tmp_path / results.TEST_FILE).write_text("")
    monkeypatch.setattr(results, "TEST_DEPENDENCIES", {"no-such-package": "no_such_module_x"})
    assert results.check_setup(tmp_path) == (
        "no-such-package not installed: Megatron-LM's test_schedules.py needs them "
        "(pip install no-such-package)")
