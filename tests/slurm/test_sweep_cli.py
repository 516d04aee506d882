"""sweep.sh refuses bad input before it submits anything: one line on stderr, exit code 2."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "examples/slurm/pretrain_gpt_2.7b_8gpu.sbatch"
GRID = {"SEQ_LENGTHS": "64", "MICRO_BATCHES": "4"}


@pytest.mark.parametrize("argv, env, names", [
    ([SCRIPT], {"MICRO_BATCHES": "4"}, "SEQ_LENGTHS"),
    ([SCRIPT], {"SEQ_LENGTHS": "64"}, "MICRO_BATCHES"),
    ([SCRIPT], {**GRID, "SPLITS": "two"}, "SPLITS"),
    ([SCRIPT], {**GRID, "SEQ_LENGTHS": "0"}, "SEQ_LENGTHS"),
    (["-p", "gpu", SCRIPT], GRID, "-p"),
    ([], GRID, "no sbatch script"),
    (["examples/slurm/missing.sbatch"], GRID, "missing.sbatch"),
    (["--out"], GRID, "--out"),
    (["--collect"], {}, "--collect"),
])
def test_bad_input_is_refused_before_submitting(tmp_path, argv, env, names):
    clean = {key: value for key, value in os.environ.items()
             if key not in ("SEQ_LENGTHS", "MICRO_BATCHES", "SPLITS", "SCHEDULES")}
    result = subprocess.run(["bash", "examples/slurm/sweep.sh", "--out", str(tmp_path / "s"),
                             *argv], cwd=REPO, env={**clean, **env, "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and names in result.stderr, result.stderr
    assert not (tmp_path / "s" / "jobs.tsv").exists()
