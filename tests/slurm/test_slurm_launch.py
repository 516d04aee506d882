"""The sbatch scripts of examples/slurm, submitted for real to the session's Slurm cluster.

Every job is a paper script with a tiny model on CPU (gloo), given through the same environment
variables and sbatch options a user of a real cluster sets (README, "Launch on a Slurm cluster").
All jobs are submitted at once (`sbatch --wait`, one process each) so they overlap; each test
waits for its own. Each job keeps `--time`, a p2p/gloo timeout, and an outer timeout here (the
job is cancelled when it passes).
"""
from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "examples" / "slurm"
OUTER_TIMEOUT_S = 420
TIME_LIMIT = "--time=6"

TINY_MODEL = {"NUM_LAYERS": "2", "HIDDEN_SIZE": "32", "NUM_ATTENTION_HEADS": "4",
              "SEQ_LENGTH": "64", "MICRO_BATCHES": "4", "TRAIN_ITERS": "4", "SCHEDULE": "seq1f1b",
              "SPLITS": "2", "TP": "1", "PP": "2", "P2P_TIMEOUT": "120"}
"""The tiny CPU model every job trains: PP=2 over the two ranks, Seq1F1B with k=2."""

CPU_MEMORY_KB = 3_000_000
"""The CPU stand-in for a GPU's memory: an address-space limit per rank (ulimit -v), which
Slurm's PropagateResourceLimits hands from the submitting shell to every task. Imports and a tiny
model fit; the 16K-token sweep cell's attention does not, and torch's allocator fails there as
it would on a full GPU."""


@dataclass
class Job:
    """One `sbatch --wait` in flight."""

    name: str
    process: subprocess.Popen
    output: Path
    run_dir: Path
    started: float

    def wait(self, cluster) -> int:
        try:
            return self.process.wait(timeout=max(1.0, OUTER_TIMEOUT_S -
                                                 (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            cluster.slurm("scancel", "--name", self.name)
            self.process.kill()
            pytest.fail(f"job {self.name} still running after {OUTER_TIMEOUT_S} s:\n"
                        + self.log()[-3000:])

    def job_id(self) -> str:
        """From sbatch's "Submitted batch job N" (printed when the job has finished)."""
        return re.search(r"Submitted batch job (\d+)", self.process.stdout.read()).group(1)

    def log(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def summary(self) -> dict[str, str]:
        lines = [line for line in self.log().splitlines() if line.startswith("SEQ1F1B_RESULT ")]
        assert lines, f"no summary line in {self.output}:\n{self.log()[-3000:]}"
        return dict(item.split("=", 1) for item in lines[-1].split()[1:])


def _submit(cluster, work: Path, name: str, script: str, env: dict[str, str],
            sbatch_options: list[str], args: list[str] = ()) -> Job:
    """sbatch --wait SCRIPT as a user would, from the repository root."""
    output, run_dir = work / f"{name}.out", work / name
    argv = ["sbatch", "--wait", f"--job-name={name}", f"--output={output}", TIME_LIMIT,
            *sbatch_options, str(SLURM / script), *args]
    process = subprocess.Popen(argv, cwd=REPO, env={**cluster.env, **TINY_MODEL, **env,
                                                    "RUN_DIR": str(run_dir)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return Job(name, process, output, run_dir, time.monotonic())


SWEEP_GRID = {"SCHEDULES": "seq1f1b", "SPLITS": "2", "SEQ_LENGTHS": "64 16384",
              "MICRO_BATCHES": "4", "TRAIN_ITERS": "3"}
"""Two cells: 64 tokens train; 16384 tokens do not fit CPU_MEMORY_KB (logits alone: 16384 x
the mock vocabulary's 50304 entries)."""


def _sweep(cluster, work: Path) -> Job:
    """sweep.sh --wait over SWEEP_GRID under the memory limit, as one process."""
    out = work / "sweep"
    command = (f"ulimit -v {CPU_MEMORY_KB} && exec examples/slurm/sweep.sh --out {out} --wait "
               f"{TIME_LIMIT} --nodes=1 --ntasks-per-node=2 --gpus-per-node=2 "
               "examples/slurm/pretrain_gpt_2.7b_8gpu.sbatch")
    env = {**cluster.env, **TINY_MODEL, **SWEEP_GRID, "LAUNCHER": "srun",
           "PYTHON": str(REPO / ".venv" / "bin" / "python")}
    process = subprocess.Popen(["bash", "-c", command], cwd=REPO, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return Job("sweep-", process, out / "results.csv", out, time.monotonic())


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """Every job of this module, submitted at once."""
    work = tmp_path_factory.mktemp("jobs")
    submitted = {
        "srun": _submit(slurm_cluster, work, "srun-ranks", "pretrain_gpt_2.7b_8gpu.sbatch",
                        {"LAUNCHER": "srun", "SAVE_INTERVAL": "2"},
                        ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2"]),
        "torchrun": _submit(slurm_cluster, work, "torchrun-2nodes", "pretrain_gpt_7b_32gpu.sbatch",
                            {"LAUNCHER": "torchrun", "SAVE_INTERVAL": "2"},
                            ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1"]),
        "killed": _submit(slurm_cluster, work, "killed-rank", "pretrain_gpt_2.7b_8gpu.sbatch",
                          {"LAUNCHER": "srun", "TRAIN_ITERS": "100000"},
                          ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1"]),
        "sweep": _sweep(slurm_cluster, work),
    }
    yield submitted
    for job in submitted.values():
        if job.process.poll() is None:
            slurm_cluster.slurm("scancel", "--name", job.name)
            job.process.wait(timeout=60)


def _loss_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(r"iteration\s+\d+/.*lm loss:", line)]


def _assert_checkpoint(folder: Path, iteration: int) -> None:
    """megatron's layout: the latest iteration's number, and its dist_checkpointing shards."""
    assert (folder / "latest_checkpointed_iteration.txt").read_text().strip() == str(iteration)
    assert list((folder / f"iter_{iteration:07d}").glob("*.distcp"))


def test_srun_started_ranks_train_and_save(jobs, slurm_cluster):
    job = jobs["srun"]
    assert job.wait(slurm_cluster) == 0, job.log()[-3000:]
    assert len(_loss_lines(job.log())) == int(TINY_MODEL["TRAIN_ITERS"]), job.log()[-3000:]
    summary = job.summary()
    assert summary["status"] == "OK" and summary["exit"] == "0"
    assert summary["iterations"] == TINY_MODEL["TRAIN_ITERS"]
    _assert_checkpoint(job.run_dir / "checkpoints", int(TINY_MODEL["TRAIN_ITERS"]))


def test_torchrun_on_two_nodes_trains(jobs, slurm_cluster):
    job = jobs["torchrun"]
    assert job.wait(slurm_cluster) == 0, job.log()[-3000:]
    log = job.log()
    assert len(_loss_lines(log)) == int(TINY_MODEL["TRAIN_ITERS"]), log[-3000:]
    assert _nodes_that_ran(slurm_cluster, job.job_id(), step=0) == {"seq1f1b-n1", "seq1f1b-n2"}
    summary = job.summary()
    assert summary["status"] == "OK" and summary["nodes"] == "2"
    _assert_checkpoint(job.run_dir / "checkpoints", int(TINY_MODEL["TRAIN_ITERS"]))


def _nodes_that_ran(cluster, job_id: str, step: int) -> set[str]:
    """The nodes whose slurmd launched a task of step `step` of the job (from their logs)."""
    launch = f"launch task StepId={job_id}.{step} "
    return {node for node in cluster.spec.nodes
            if launch in (cluster.root / "log" / f"slurmd-{node}.log").read_text()}


def _rank_pid(job_id: str, rank: int) -> Optional[int]:
    """The pid of the Python process of Slurm rank `rank` of job `job_id` (on this host)."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode()}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            cmdline = (environ.parent / "cmdline").read_bytes()
            if b"pretrain_gpt.py" not in cmdline or b"python" not in cmdline.split(b"\0")[0]:
                continue
            if wanted <= set(environ.read_bytes().split(b"\0")):
                return int(environ.parent.name)
        except OSError:
            continue
    return None


def test_a_dead_rank_fails_the_job_with_its_exit_code(jobs, slurm_cluster):
    """Rank 1 (on the second node) dies by SIGKILL mid-training, as a crashed rank does: the job
    fails with that rank's status (137), the summary says FAILED, and rank 0 is taken down by
    srun instead of waiting out its timeout."""
    job = jobs["killed"]
    deadline = time.monotonic() + OUTER_TIMEOUT_S
    while not _loss_lines(job.log()):
        assert job.process.poll() is None, job.log()[-3000:]
        assert time.monotonic() < deadline, "no iteration logged"
        time.sleep(1)
    job_id = slurm_cluster.slurm("squeue", "-h", "--name", job.name, "-o", "%i").strip()
    pid = _rank_pid(job_id, 1)
    assert pid is not None, "rank 1's process not found"
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert job.wait(slurm_cluster) == 137, job.log()[-3000:]
    assert time.monotonic() - killed_at < float(TINY_MODEL["P2P_TIMEOUT"])
    summary = job.summary()
    assert summary["status"] == "FAILED" and summary["exit"] == "137"


def test_sweep_gives_one_row_per_job_oom_included(jobs, slurm_cluster):
    """The 2-job grid: the first cell trains, the second runs out of (emulated) device memory;
    both come back as rows of results.csv, the second as OOM with a non-zero exit code."""
    sweep = jobs["sweep"]
    assert sweep.wait(slurm_cluster) == 0, sweep.process.stdout.read()
    rows = list(csv.DictReader(open(sweep.output)))
    assert [(r["seq_length"], r["status"]) for r in rows] == [("64", "OK"), ("16384", "OOM")], rows
    ok, oom = rows
    assert ok["exit"] == "0" and ok["iterations"] == SWEEP_GRID["TRAIN_ITERS"]
    assert float(ok["lm_loss"]) > 0
    assert oom["exit"] not in ("", "0")
