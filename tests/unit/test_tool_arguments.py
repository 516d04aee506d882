"""Bad command lines of tools/check_equivalence.py, tools/benchmark.py (--spread-output, a
searched entry's fit cut) and tools/peer_grid.py: refused in one line on stderr naming the flag,
exit code 2, before any process group, reference run or case starts (no traceback from inside
the ranks, no value quietly read as another)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_args", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # benchmark.py's dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def check_equivalence():
    return _tool("check_equivalence")


@pytest.fixture(scope="module")
def benchmark():
    return _tool("benchmark")


@pytest.fixture(scope="module")
def peer_grid():
    return _tool("peer_grid")


def _refusal(capsys, call, argv) -> str:
    """The one line `call(argv)` prints on stderr as it exits with code 2."""
    with pytest.raises(SystemExit) as exit_info:
        call(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, message", [
    (["--pp", "0"], "--pp must be a positive integer, got 0"),
    (["--pp", "-1"], "--pp must be a positive integer, got -1"),
    (["--tp", "0"], "--tp must be a positive integer, got 0"),
    (["--cp", "0"], "--cp must be a positive integer, got 0"),
    (["--num-microbatches", "0"], "--num-microbatches must be a positive integer, got 0"),
    (["--chunks", "0"], "--chunks must be a positive integer, got 0"),
    (["--splits", "0"], "--splits must be a positive integer, got 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be a positive integer, got 0"),
    (["--seq-length", "0"], "--seq-length must be a positive integer, got 0"),
    (["--num-layers", "0"], "--num-layers must be a positive integer, got 0"),
    (["--vocab-size", "0"], "--vocab-size must be a positive integer, got 0"),
    (["--num-attention-heads", "0"], "--num-attention-heads must be a positive integer, got 0"),
    (["--num-query-groups", "0"], "--num-query-groups must be a positive integer, got 0"),
    (["--hidden-size", "30"], "--hidden-size 30 is not divisible by --num-attention-heads 4"),
    (["--init-method-std", "-1"], "--init-method-std must be > 0, got -1"),
    (["--loss-tolerance", "-1"], "--loss-tolerance must be >= 0, got -1"),
    (["--schedule-memory-cap", ""], "--schedule-memory-cap '': give bytes"),
    (["--splits", "30"], "--splits 30 is more than the 24 spans"),
    (["--chunks", "2"], "--chunks 2 does not fit schedule 'seq1f1b'"),
    (["--pp", "3"], "the model's 4 layers are not divisible by pp*chunks = 3*1"),
    (["--pp", "x"], "argument --pp: invalid int value: 'x'"),
    # --spread-output where pretrain_gpt.py refuses it, in the same words (naming --schedule)
    (["--spread-output"], "--spread-output: --schedule seq1f1b is not searched"),
    (["--schedule", "seq1f1b-zb-auto", "--pp", "2", "--splits", "2", "--spread-output",
      "--loss-backward-in-forward"],
     "--loss-backward-in-forward with --spread-output"),
    (["--pipeline-schedule-file", "order.csv", "--spread-output"],
     "--spread-output: a --pipeline-schedule-file has its O actions or not"),
    # the span alignment, named as the tools spell it (pretrain_gpt.py: --seq1f1b-span-alignment)
    (["--span-alignment", "0"], "--span-alignment must be a positive integer, got 0"),
    (["--splits", "2", "--span-alignment", "5"],
     "--seq-length 24: --span-alignment 5 must divide it into at least --splits 2 spans"),
    (["--splits", "2", "--span-lengths", "10", "14", "--span-alignment", "4"],
     "--span-lengths 10 14: --span-alignment 4 must divide every span"),
])
def test_check_equivalence_refuses_a_bad_number_in_one_line(check_equivalence, capsys, argv,
                                                            message):
    err = _refusal(capsys, check_equivalence.parse_args, argv)
    assert err.startswith("check_equivalence.py: error: ") and message in err, err


def test_check_equivalence_still_takes_a_good_case(check_equivalence):
    args = check_equivalence.parse_args(["--pp", "2", "--splits", "2", "--num-layers", "2"])
    assert (args.pp, args.splits, args.schedule) == (2, 2, "seq1f1b")


def test_the_tools_cut_spans_of_the_alignment_asked_for(check_equivalence):
    """--span-alignment 8: the compute cut of 96 tokens in 3 spans (37 31 28 without it) rounds
    each boundary to a multiple of 8, as the runtime cuts it (SpanSettings.align)."""
    from seq1f1b.equivalence import case_spans, cost_model
    from seq1f1b.runtime.forward_backward import SpanSettings, _spans
    argv = ["--splits", "3", "--partition", "compute", "--seq-length", "96"]
    plain = case_spans(check_equivalence.case_from_args(check_equivalence.parse_args(argv)))
    assert plain == [37, 31, 28]
    case = check_equivalence.case_from_args(check_equivalence.parse_args(
        argv + ["--span-alignment", "8"]))
    assert case_spans(case) == [40, 32, 24]
    settings = SpanSettings(3, "compute", align=case.span_alignment, cost_model=cost_model(case))
    assert [end - start for start, end in _spans(settings, 96, None, 1, False)] == [40, 32, 24]


def test_check_equivalence_takes_the_search_with_the_output_layer_spread(check_equivalence):
    """Tied embeddings too: every copy of the output layer is tied (runtime/tied_output.py)."""
    args = check_equivalence.parse_args(["--schedule", "seq1f1b-zb-auto", "--pp", "2",
                                         "--splits", "2", "--chunks", "2", "--spread-output"])
    from seq1f1b.equivalence import case_plan
    assert case_plan(check_equivalence.case_from_args(args)).spread_output


SEARCHED = ["--schedules", "1f1b", "seq1f1b-zb-auto", "--pp", "2", "--splits", "2",
            "--spread-output"]


@pytest.mark.parametrize("argv, message", [
    (["--schedules", "seq1f1b:2", "--span-alignment", "5"],
     "--schedules seq1f1b@even: --seq-length 512: --span-alignment 5 must divide it"),
    (["--schedules", "seq1f1b", "--spread-output"],
     "--spread-output: no searched schedule (seq1f1b-zb-auto) in --schedules"),
    (SEARCHED + ["--loss-backward-in-forward"],
     "--schedules seq1f1b-zb-auto: --loss-backward-in-forward with --spread-output"),
    # a searched entry is placed before the warm-up a fit measures: with or without a cap, by
    # its own @fit or a global --partition fit (it read "--method fit needs measured span
    # times (--calibration FILE)", a flag the benchmark does not have)
    (["--schedules", "seq1f1b-zb-auto@fit", "--splits", "2"],
     "--schedules seq1f1b-zb-auto@fit: a searched schedule is placed before the warm-up"),
    (["--schedules", "seq1f1b", "seq1f1b-zb-auto", "--splits", "2", "--partition", "fit"],
     "--schedules seq1f1b-zb-auto: a searched schedule is placed before the warm-up, with the "
     "compute or even cut's costs: use seq1f1b-zb-auto@compute"),
])
def test_benchmark_refuses_what_it_cannot_run_in_one_line(benchmark, argv,
                                                                          message):
    with pytest.raises(benchmark.UsageError) as refused:
        benchmark.parse_args(argv)
    assert str(refused.value).startswith(message), refused.value


def test_benchmark_gives_a_spread_search_model_chunks_of_its_own(benchmark):
    """--spread-output: the searched entry spreads the layer here, so it is not timed on the
    baseline's chunks (megatron's own schedules would run on them without the layer)."""
    _, runs = benchmark.parse_args(SEARCHED + ["--untie-embeddings-and-output-weights",
                                               "--chunks", "1"])
    assert [(run.spread, run.group) for run in runs] == [(False, (1, "loop", False)),
                                                       (True, (1, "loop", True))]


@pytest.mark.parametrize("argv, message", [
    (["--pp", "0"], "--pp must be a positive integer, got 0"),
    (["--pp", "2", "-2"], "--pp must be a positive integer, got -2"),
    (["--microbatches-per-rank", "0"], "--microbatches-per-rank must be a positive integer, got 0"),
    (["--microbatches-per-rank", "-1"],
     "--microbatches-per-rank must be a positive integer, got -1"),
    (["--splits", "0"], "--splits must be a positive integer, got 0"),
    (["--exact", "0"], "--exact must be a positive number of seconds, got 0"),
    (["--exact", "-1"], "--exact must be a positive number of seconds, got -1"),
    (["--exact-actions", "-5"], "--exact-actions must be a positive integer, got -5"),
    (["--costs", "nope"], "argument --costs: invalid choice: 'nope'"),
])
def test_peer_grid_refuses_a_bad_grid_in_one_line(peer_grid, capsys, argv, message):
    err = _refusal(capsys, peer_grid.main, argv)
    assert err.startswith("peer_grid.py: error: ") and message in err, err


@pytest.mark.parametrize("tool, argv, message", [
    ("check_equivalence.py", ["--pp", "x"], "argument --pp: invalid int value: 'x'"),
    ("check_equivalence.py", ["--num-query-groups", "0"],
     "--num-query-groups must be a positive integer, got 0"),
    ("peer_grid.py", ["--pp", "x"], "argument --pp: invalid int value: 'x'"),
])
def test_the_command_line_gets_exactly_one_line_and_exit_2(tool, argv, message):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / tool), *argv],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == f"{tool}: error: {message}\n", proc.stderr
