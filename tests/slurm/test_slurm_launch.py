"""The sbatch scripts of examples/slurm, submitted for real to the session's Slurm cluster.

Every job is a paper script with a tiny model on CPU (gloo), set through the environment
variables and sbatch options a user of a real cluster sets; docs/slurm.md shows the
same commands, rendered from the constants below (test_readme_shows_what_ci_runs). All jobs are
submitted at once (`sbatch --wait`, one process each) so they overlap; each test waits for its
own. Every job keeps `--time`, a p2p/gloo timeout (P2P_TIMEOUT) and an outer timeout here (the
job is cancelled when it passes).
"""
from __future__ import annotations

import csv
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
OUTER_TIMEOUT_S = 420
TIME_LIMIT = "--time=6"

TINY_MODEL = {"NUM_LAYERS": "2", "HIDDEN_SIZE": "32", "NUM_ATTENTION_HEADS": "4",
              "SEQ_LENGTH": "64", "MICRO_BATCHES": "4", "TRAIN_ITERS": "4", "SPLITS": "2",
              "TP": "1", "PP": "2", "P2P_TIMEOUT": "120"}
"""The tiny CPU model every job trains: PP=2 over the two ranks, Seq1F1B (the scripts' default
schedule) with k=2; everything else is the scripts' paper defaults (bf16, GPT-2 vocabulary)."""

CPU_MEMORY_KB = 4_000_000
"""The CPU stand-in for a GPU's memory: an address-space limit per rank (ulimit -v), which
Slurm's PropagateResourceLimits hands from the submitting shell to every task. Imports and the
tiny model fit (a rank peaks near 2.4 GB of address space); the 16K-token sweep cell does not
(its logits alone: 16384 x 50257 entries, 1.6 GB in bf16, twice that in fp32), and
torch's allocator fails there as it would on a full GPU."""


@dataclass(frozen=True)
class Launch:
    """One example script with its environment and sbatch options, as a user types it."""

    script: str
    env: dict[str, str]
    sbatch: tuple[str, ...]

    def command(self) -> str:
        """The shell line (docs/slurm.md shows it after `export` of TINY_MODEL)."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), "sbatch",
                         "--wait", TIME_LIMIT, *self.sbatch, f"examples/slurm/{self.script}"])


SRUN = Launch("pretrain_gpt_2.7b_8gpu.sbatch", {"LAUNCHER": "srun", "SAVE_INTERVAL": "2"},
              ("--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2"))
"""One node, one srun task per (emulated) GPU, checkpoints every 2 iterations."""
TORCHRUN = Launch("pretrain_gpt_7b_32gpu.sbatch", {"LAUNCHER": "torchrun", "SAVE_INTERVAL": "2"},
                  ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1"))
"""Two (emulated) nodes, one torchrun per node: the pipeline crosses the node boundary."""
KILLED = replace(SRUN, env={"LAUNCHER": "srun", "TRAIN_ITERS": "100000"},
                 sbatch=("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1"))
"""srun ranks on two nodes, training until rank 1 is killed."""

SWEEP_GRID = {"SCHEDULES": "seq1f1b", "SPLITS": "2", "SEQ_LENGTHS": "64 16384",
              "MICRO_BATCHES": "4", "TRAIN_ITERS": "3", "LAUNCHER": "srun"}
"""Two cells: 64 tokens train; 16384 tokens do not fit CPU_MEMORY_KB."""


def sweep_command(out: Optional[Path] = None) -> str:
    """The sweep under the memory limit (docs/slurm.md shows it without --out)."""
    grid = " ".join(f"{k}={shlex.quote(v)}" for k, v in SWEEP_GRID.items())
    return (f"ulimit -v {CPU_MEMORY_KB} && {grid} examples/slurm/sweep.sh "
            + (f"--out {out} " if out else "") + f"--wait {TIME_LIMIT} "
            + " ".join(SRUN.sbatch) + f" examples/slurm/{SRUN.script}")


@dataclass
class Job:
    """One `sbatch --wait` (or sweep) in flight."""

    name: str
    process: subprocess.Popen
    output: Path
    run_dir: Path
    started: float = field(default_factory=time.monotonic)

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


NO_EARLY_SIGNAL = {"SBATCH_SIGNAL": "TERM@1"}
"""For jobs that are about launching, not preemption (test_slurm_preemption is): sbatch's
environment overrides the scripts' `#SBATCH --signal=TERM@120`, so that on a slow machine a job
nearing its 6-minute limit is not stopped early by the warning."""


def _shell(cluster, command: str, early_signal: bool = False) -> subprocess.Popen:
    """`command` in bash from the repository root, after `export` of TINY_MODEL (and, unless
    `early_signal`, of NO_EARLY_SIGNAL)."""
    env = {**cluster.env, **TINY_MODEL, **({} if early_signal else NO_EARLY_SIGNAL)}
    return subprocess.Popen(["bash", "-c", command], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _submit(cluster, work: Path, name: str, launch: Launch, run_dir: Optional[Path] = None,
            early_signal: bool = False) -> Job:
    """The launch's command line, with a job name, output file and run folder (default: one
    named after the job) of this test."""
    output, run_dir = work / f"{name}.out", run_dir or work / name
    command = launch.command().replace(
        " sbatch ", f" RUN_DIR={run_dir} sbatch --job-name={name} --output={output} ", 1)
    return Job(name, _shell(cluster, command, early_signal), output, run_dir)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """Every job of this module, submitted at once."""
    work = tmp_path_factory.mktemp("jobs")
    sweep = work / "sweep"
    submitted = {
        "srun": _submit(slurm_cluster, work, "srun-ranks", SRUN),
        "torchrun": _submit(slurm_cluster, work, "torchrun-2nodes", TORCHRUN),
        "killed": _submit(slurm_cluster, work, "killed-rank", KILLED),
        "sweep": Job("sweep-", _shell(slurm_cluster, sweep_command(sweep)),
                     sweep / "results.csv", sweep),
    }
    yield submitted
    for job in submitted.values():
        if job.process.poll() is None:
            slurm_cluster.slurm("scancel", "--name", job.name)
            job.process.wait(timeout=60)


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "examples" / "slurm")
                                           .glob("pretrain_gpt_*.sbatch")))
def test_paper_scripts_are_accepted_as_written(slurm_cluster, script):
    """Each paper script, unmodified, on DGX-shaped nodes: Slurm accepts its header and would
    give it its nodes x 8 GPUs (sbatch --test-only: nothing runs)."""
    text = (REPO / "examples" / "slurm" / script).read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    result = subprocess.run(["sbatch", "--test-only", f"examples/slurm/{script}"], cwd=REPO,
                            env=slurm_cluster.env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"using {8 * nodes} processors" in result.stderr, result.stderr


def test_readme_shows_what_ci_runs():
    readme = (REPO / "docs" / "slurm.md").read_text()
    export = "export " + " ".join(f"{k}={v}" for k, v in TINY_MODEL.items())
    for line in (export, SRUN.command(), TORCHRUN.command(), sweep_command()):
        assert line in readme, f"docs/slurm.md lacks: {line}"


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
    assert len(_nodes_that_ran(slurm_cluster, job.job_id(), step=0)) == 2
    summary = job.summary()
    assert summary["status"] == "OK" and summary["nodes"] == "2"
    _assert_checkpoint(job.run_dir / "checkpoints", int(TINY_MODEL["TRAIN_ITERS"]))


def _nodes_that_ran(cluster, job_id: str, step: int) -> set[str]:
    """The nodes whose slurmd launched a task of step `step` of the job (from their logs)."""
    launch = f"launch task StepId={job_id}.{step} "
    return {node for node in cluster.spec.nodes
            if launch in (cluster.root / "log" / f"slurmd-{node}.log").read_text()}


def _rank_pid(cluster, job_id: str, rank: int) -> Optional[int]:
    """The pid of the Python process of Slurm rank `rank` of job `job_id` of this cluster."""
    wanted = {f"SLURM_CONF={cluster.conf}".encode(), f"SLURM_JOB_ID={job_id}".encode(),
              f"SLURM_PROCID={rank}".encode()}
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
    """Rank 1 (on the second node) crashes mid-training (SIGSEGV): the job fails with that
    rank's status (139), the summary says FAILED, and rank 0 is taken down by srun instead of
    waiting out its timeout. (A SIGKILL short of the time limit is the host's OOM killer to the
    summary: tests/slurm/test_job_results.py.)"""
    job = jobs["killed"]
    deadline = time.monotonic() + OUTER_TIMEOUT_S
    while not _loss_lines(job.log()):
        assert job.process.poll() is None, job.log()[-3000:]
        assert time.monotonic() < deadline, "no iteration logged"
        time.sleep(1)
    job_id = slurm_cluster.slurm("squeue", "-h", "--name", job.name, "-o", "%i").strip()
    pid = _rank_pid(slurm_cluster, job_id, 1)
    assert pid is not None, "rank 1's process not found"
    os.kill(pid, signal.SIGSEGV)
    killed_at = time.monotonic()
    assert job.wait(slurm_cluster) == 139, job.log()[-3000:]
    assert time.monotonic() - killed_at < float(TINY_MODEL["P2P_TIMEOUT"])
    summary = job.summary()
    assert summary["status"] == "FAILED" and summary["exit"] == "139"


def test_sweep_gives_one_row_per_job_oom_included(jobs, slurm_cluster):
    """The 2-job grid: the first cell trains, the second runs out of (emulated) device memory;
    both come back as rows of results.csv, the second as OOM with a non-zero exit code."""
    sweep = jobs["sweep"]
    assert sweep.wait(slurm_cluster) == 0, sweep.process.stdout.read()
    rows = list(csv.DictReader(open(sweep.output)))
    cell_logs = {path.parent.name: path.read_text()[-3000:]
                 for path in sorted(sweep.run_dir.glob("sweep-*/train.log"))}
    assert [(r["seq_length"], r["status"]) for r in rows] == [("64", "OK"), ("16384", "OOM")], \
        (rows, cell_logs)
    ok, oom = rows
    assert ok["exit"] == "0" and ok["iterations"] == SWEEP_GRID["TRAIN_ITERS"]
    assert float(ok["lm_loss"]) > 0
    assert oom["exit"] not in ("", "0")
    assert (sweep.run_dir / "sweep-seq1f1b-k2-L64-m4" / "train.log").exists()   # all in --out
