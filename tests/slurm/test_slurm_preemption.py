"""A Slurm job ended by its time limit resumes on resubmission and continues exactly.

The job is the 2.7B paper script (tiny CPU model, two srun ranks, as test_slurm_launch runs it)
with SAVE_INTERVAL=2, so it saves into and resumes from RUN_DIR/checkpoints, and a TRAIN_ITERS it
cannot reach. Its first save precedes the signal: megatron-core's checkpoint writer then has its
helper process running, which Slurm signals too and which must survive for the next save. The script asks Slurm for SIGTERM 120 s before its time limit (`#SBATCH
--signal=TERM@120`) and trains with --exit-signal-handler. Slurm counts limits in minutes and
checks them every 30 s, so instead of waiting out a limit set at submission (the ranks must be up
before the signal), the test shortens the running job's limit with `scontrol update TimeLimit=`
to two to three minutes from now: Slurm itself then sends the warning signal, the ranks finish their
iteration, save and exit 0, before the limit. The same job submitted again resumes from that
checkpoint; a reference job with the same flags and a fresh folder trains without interruption.
Both stop 3 iterations after the one the first job reached (--exit-interval, which leaves the
LR schedule alone). Every logged learning rate, loss and grad norm of the resumed job equals the
reference's at the same iteration, and so do the first job's before it.
"""
from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path

from test_slurm_launch import OUTER_TIMEOUT_S, SRUN, Job, _assert_checkpoint, _loss_lines, _submit

PREEMPTIBLE = replace(SRUN, env={"LAUNCHER": "srun", "TRAIN_ITERS": "100000",
                                 "SAVE_INTERVAL": "2"}, sbatch=SRUN.sbatch + ("--time=15",))
"""Trains until stopped, saving every 2 iterations and when stopped. Its limit at submission
(15 minutes, replacing the launch tests' 6) is far enough that only the shortened one warns,
however slowly the ranks start."""
FIGURES = ("learning rate", "lm loss", "grad norm")
AFTER = 3
"""Iterations the resumed and the reference job train past the preempted one's last."""


def _figures(log: str) -> dict[int, tuple[str, ...]]:
    """iteration -> its logged learning rate, loss and grad norm (as printed)."""
    figures = {}
    for line in _loss_lines(log):
        iteration = int(re.search(r"iteration\s+(\d+)/", line).group(1))
        figures[iteration] = tuple(re.search(rf"{name}: (\S+) \|", line).group(1)
                                   for name in FIGURES)
    return figures


def _run_seconds(cluster, job_id: str) -> int:
    text = cluster.slurm("scontrol", "show", "job", job_id)
    fields = [int(x) for x in re.search(r"RunTime=(?:(\d+)-)?(\d+):(\d+):(\d+)", text)
              .groups(default="0")]
    days, hours, minutes, seconds = fields
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def _shorten_time_limit(cluster, job: Job) -> None:
    """Once the job has saved, set its limit to the whole minute 2 to 3 minutes from now: Slurm,
    checking every 30 s, sends the warning within a minute (it may be up to 30 s early), and the
    ranks have two minutes to finish the iteration, save and exit."""
    deadline = job.started + OUTER_TIMEOUT_S
    while "saved checkpoint at iteration" not in job.log():
        assert job.process.poll() is None, job.log()[-3000:]
        assert time.monotonic() < deadline, "the job saved no checkpoint"
        time.sleep(1)
    job_id = cluster.slurm("squeue", "-h", "--name", job.name, "-o", "%i").strip()
    assert "TimeLimit=00:15:00" in cluster.slurm("scontrol", "show", "job", job_id)
    minutes = _run_seconds(cluster, job_id) // 60 + 3
    cluster.slurm("scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}")


def test_a_job_stopped_by_its_time_limit_resumes_exactly(slurm_cluster, tmp_path: Path):
    run_dir = tmp_path / "preempted"
    first = _submit(slurm_cluster, tmp_path, "preempted", PREEMPTIBLE, run_dir,
                    early_signal=True)
    _shorten_time_limit(slurm_cluster, first)
    assert first.wait(slurm_cluster) == 0, first.log()[-3000:]
    stopped = re.search(r"exiting program at iteration (\d+) \(received SIGTERM\)", first.log())
    assert stopped, first.log()[-3000:]
    reached = int(stopped.group(1))
    assert first.summary()["status"] == "OK" and first.summary()["iterations"] == str(reached)
    _assert_checkpoint(run_dir / "checkpoints", reached)

    stop_at = replace(PREEMPTIBLE, env={**PREEMPTIBLE.env,
                                        "EXTRA_ARGS": f"--exit-interval {reached + AFTER}"})
    resumed = _submit(slurm_cluster, tmp_path, "resubmitted", stop_at, run_dir,
                      early_signal=True)
    reference = _submit(slurm_cluster, tmp_path, "reference", stop_at, early_signal=True)
    assert resumed.wait(slurm_cluster) == 0, resumed.log()[-3000:]
    assert reference.wait(slurm_cluster) == 0, reference.log()[-3000:]
    assert f"starting at iteration {reached}" in resumed.log()
    expected = _figures(reference.log())
    assert sorted(expected) == list(range(1, reached + AFTER + 1))
    after = _figures(resumed.log())
    assert sorted(after) == list(range(reached + 1, reached + AFTER + 1))
    assert after == {i: expected[i] for i in after}
    before = _figures(first.log())
    assert before == {i: expected[i] for i in range(1, reached + 1)}
    _assert_checkpoint(run_dir / "checkpoints", reached + AFTER)
