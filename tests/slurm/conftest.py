"""A real Slurm cluster for the session (tests/slurm/cluster.py), torn down by pid at the end.

Slurm is installed from Debian's packages when missing. Where it cannot be installed (not root,
no apt-get) the cluster tests skip with that reason, except under CI (CI set), where they fail:
CI must run them. A failing apt-get always fails.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import HOSTS_FILE, SlurmCluster, SlurmUnavailable, install_slurm  # noqa: E402


@pytest.fixture(scope="session")
def slurm_cluster():
    try:
        install_slurm()
    except SlurmUnavailable as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tests: {err}")
        pytest.skip(str(err))
    root = Path(tempfile.mkdtemp(prefix="seq1f1b-slurm-"))
    cluster = SlurmCluster(root)
    cluster.start()
    yield cluster
    survivors = cluster.stop()
    left = cluster.job_processes()
    assert not survivors and not left, f"left running: {survivors} {sorted(left)}"
    assert cluster.hosts_mark not in HOSTS_FILE.read_text()
    subprocess.run(["rm", "-rf", str(root)], check=True)
