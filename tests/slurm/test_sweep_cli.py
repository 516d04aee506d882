"""sweep.sh refuses bad input before it submits anything (one line on stderr, exit code 2), and
`--wait` waits through a failed squeue (a fake sbatch and squeue: no Slurm needed)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "examples/slurm/pretrain_gpt_2.7b_8gpu.sbatch"
GRID = {"SEQ_LENGTHS": "64", "MICRO_BATCHES": "4"}


def _clean_env() -> dict[str, str]:
    """This environment without the grid and wait settings sweep.sh reads from it."""
    return {key: value for key, value in os.environ.items()
            if key not in ("SEQ_LENGTHS", "MICRO_BATCHES", "SPLITS", "SCHEDULES", "SQUEUE_TRIES")}


@pytest.mark.parametrize("argv, env, names", [
    ([SCRIPT], {"MICRO_BATCHES": "4"}, "SEQ_LENGTHS"),
    ([SCRIPT], {"SEQ_LENGTHS": "64"}, "MICRO_BATCHES"),
    ([SCRIPT], {**GRID, "SPLITS": "two"}, "SPLITS"),
    ([SCRIPT], {**GRID, "SEQ_LENGTHS": "0"}, "SEQ_LENGTHS"),
    ([SCRIPT], {**GRID, "SQUEUE_TRIES": "0"}, "SQUEUE_TRIES"),
    (["-p", "gpu", SCRIPT], GRID, "-p"),
    ([], GRID, "no sbatch script"),
    (["examples/slurm/missing.sbatch"], GRID, "missing.sbatch"),
    (["--out"], GRID, "--out"),
    (["--collect"], {}, "--collect"),
])
def test_bad_input_is_refused_before_submitting(tmp_path, argv, env, names):
    result = subprocess.run(["bash", "examples/slurm/sweep.sh", "--out", str(tmp_path / "s"),
                             *argv], cwd=REPO,
                            env={**_clean_env(), **env, "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and names in result.stderr, result.stderr
    assert not (tmp_path / "s" / "jobs.tsv").exists()


FAKE_SBATCH = """#!/bin/bash
# job 7: remember where its output goes (--output=PATH, %j the id)
for arg; do case "$arg" in --output=*) echo "${arg#--output=}" > "$STATE/output" ;; esac; done
echo "7;cluster"
"""
FAKE_SQUEUE = """#!/bin/bash
# call 1 fails as a busy slurmctld does, call 2 lists the running job, then the job has ended
calls=$(( $(cat "$STATE/calls" 2>/dev/null || echo 0) + 1 )); echo $calls > "$STATE/calls"
case $calls in
    1) echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1 ;;
    2) echo 7 ;;
    *) output="$(cat "$STATE/output")"
       echo "SEQ1F1B_RESULT status=OK exit=0 iterations=3" > "${output//%j/7}" ;;
esac
"""


def _wait_with_fakes(tmp_path, squeue: str,
                     tries: int) -> tuple[subprocess.CompletedProcess, Path]:
    """sweep.sh --wait of one job against a fake sbatch and `squeue`; (its run, the fakes'
    state folder)."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("squeue", squeue)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return subprocess.run(
        ["bash", "examples/slurm/sweep.sh", "--out", str(tmp_path / "s"), "--wait", SCRIPT],
        cwd=REPO, env={**_clean_env(), **GRID, "SCHEDULES": "1f1b", "STATE": str(state),
                       "SQUEUE_TRIES": str(tries), "PATH": f"{bin_dir}:/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60), state


def test_wait_asks_a_failed_squeue_again_and_collects_the_ended_job(tmp_path):
    """`--wait` took a failed squeue for an empty queue and wrote the running jobs as FAILED."""
    result, state = _wait_with_fakes(tmp_path, FAKE_SQUEUE, tries=30)
    assert result.returncode == 0, result.stderr
    assert (state / "calls").read_text().strip() == "3"
    rows = (tmp_path / "s" / "results.csv").read_text().splitlines()
    assert len(rows) == 2 and ",OK," in rows[1], rows


def test_wait_gives_up_after_squeue_tries_failures_and_collects_nothing(tmp_path):
    result, _ = _wait_with_fakes(tmp_path, "#!/bin/bash\necho 'timed out' >&2; exit 1\n", tries=2)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("sweep.sh: error: squeue failed 2 times in a row") and \
        "--collect" in last, result.stderr
    assert not (tmp_path / "s" / "results.csv").exists()
