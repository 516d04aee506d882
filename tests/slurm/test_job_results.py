"""job_results.py: the status every job and sweep row reports (no Slurm needed).

The log lines are made by the trainer's own formatter (megatron.training.logging_utils), so a
change of the log line that breaks the parser fails here.
"""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.logging_utils import IntervalReport, Throughput

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "slurm"
sys.path.insert(0, str(EXAMPLES))

import job_results  # noqa: E402


def _line(iteration: int, loss: float, ms: float, peaks=(3.0, 7.5)) -> str:
    return IntervalReport(
        iteration=iteration, train_iters=4, consumed_samples=8 * iteration,
        seconds_per_iteration=ms / 1000, learning_rate=1e-3, global_batch_size=8, lm_loss=loss,
        loss_scale=1.0, grad_norm=0.5, skipped_iterations=0,
        throughput=Throughput(tokens_per_second=64000 / ms, tflops_per_gpu=1e-4),
        peak_memory_mb=peaks, memory_source="MB held for backward").line()


TRAINING_LOG = "\n".join(["> training with 2 processes", _line(1, 5.5, 900.0), _line(2, 5.25, 100.0),
                          _line(3, 5.0, 300.0), _line(4, 4.75, 200.0)])

OOM_LOGS = {
    "cuda": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "cpu": "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
           "allocate memory: you tried to allocate 4294967296 bytes.",
    "c++": "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  "
           "std::bad_alloc",
    "errno": "OSError: [Errno 12] Cannot allocate memory",
    "slurm": "slurmstepd: error: StepId=3.0 exceeded memory limit (702582784 > 524288000), "
             "being killed\nslurmstepd: error: Exceeded job memory limit",
}


@pytest.mark.parametrize("source", sorted(OOM_LOGS))
def test_out_of_memory_is_oom(source):
    log = TRAINING_LOG + "\n" + OOM_LOGS[source]
    assert job_results.classify(log, 1) == "OOM"
    assert job_results.classify(log, 137) == "OOM"


def test_exit_code_decides_ok_and_failed():
    assert job_results.classify(TRAINING_LOG, 0) == "OK"
    assert job_results.classify(TRAINING_LOG, 3) == "FAILED"
    assert job_results.classify("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-01-01T00:00"
                                ":00 DUE TO TIME LIMIT ***", None) == "TIMEOUT"


def test_a_host_oom_kill_is_oom_and_a_missing_log_is_missing(tmp_path):
    """The kernel's OOM killer sends SIGKILL and leaves no message in the job's log."""
    assert job_results.classify(TRAINING_LOG, 137) == "OOM"
    assert job_results.classify(TRAINING_LOG + "\nSignal 9 (SIGKILL) received by PID 7", 1) == \
        "OOM"
    assert job_results.classify(TRAINING_LOG + "\nDUE TO TIME LIMIT ***", 137) == "TIMEOUT"
    for code in ("0", "1"):
        result = subprocess.run([sys.executable, str(EXAMPLES / "job_results.py"), "summarize",
                                 "--log", str(tmp_path / "absent.log"), "--exit-code", code],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"SEQ1F1B_RESULT status=MISSING exit={code}")


def test_metrics_of_the_trainer_log_line():
    figures = job_results.metrics(TRAINING_LOG)
    assert figures["iterations"] == "4" and figures["train_iters"] == "4"
    assert float(figures["first_lm_loss"]) == 5.5 and float(figures["lm_loss"]) == 4.75
    assert float(figures["ms_per_iteration"]) == 200.0      # median of 100, 300, 200: no warm-up
    assert float(figures["peak_mem_mb"]) == 7.5              # the largest stage


def test_summary_line_round_trip():
    line = job_results.summary_line(TRAINING_LOG + "\n" + OOM_LOGS["cuda"], 1,
                                    {"schedule": "seq1f1b", "splits": "4"})
    assert line.startswith("SEQ1F1B_RESULT status=OOM exit=1 schedule=seq1f1b splits=4 ")
    parsed = job_results.parse_summary("noise\n" + line + "\nmore noise")
    assert parsed["status"] == "OOM" and parsed["iterations"] == "4"


def test_collect_gives_one_row_per_job(tmp_path):
    done = tmp_path / "done-11.out"
    done.write_text(TRAINING_LOG + "\n" + job_results.summary_line(TRAINING_LOG, 0, {}) + "\n")
    killed = tmp_path / "killed-12.out"
    killed.write_text(_line(1, 5.5, 900.0) + "\nslurmstepd: error: *** JOB 12 ON n1 CANCELLED AT "
                      "2026-01-01T00:00:00 DUE TO TIME LIMIT ***\n")
    (tmp_path / "jobs.tsv").write_text(
        "job_id\toutput\tschedule\tsplits\tseq_length\tmicro_batches\n"
        f"11\t{tmp_path}/done-%j.out\tseq1f1b\t4\t64\t2\n"
        f"12\t{tmp_path}/killed-%j.out\t1f1b\t1\t64\t2\n"
        f"13\t{tmp_path}/never-%j.out\t1f1b\t1\t128\t2\n")
    result = subprocess.run([sys.executable, str(EXAMPLES / "job_results.py"), "collect",
                             str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [(r["job_id"], r["status"]) for r in rows] == [
        ("11", "OK"), ("12", "TIMEOUT"), ("13", "PENDING")]
    assert rows[0]["lm_loss"] == "4.750000E+00" and rows[1]["iterations"] == "1"


def test_bad_input_is_one_line_exit_2(tmp_path):
    for argv in (["collect", str(tmp_path)], ["summarize", "--log", "x", "--exit-code", "0", "k v"]):
        result = subprocess.run([sys.executable, str(EXAMPLES / "job_results.py"), *argv],
                                capture_output=True, text=True)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
