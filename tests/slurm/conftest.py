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

from cluster import (HOSTS_FILE, SlurmCluster, SlurmUnavailable, install_slurm,  # noqa: E402
                     pid_alive)

SLURM_PROCESSES = ("slurmctld", "slurmd", "slurmstepd", "munged")


def _processes_named(names: tuple[str, ...]) -> dict[int, str]:
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name = stat.read_text().split("(", 1)[1].rsplit(")", 1)[0]
        except (OSError, IndexError):
            continue
        pid = int(stat.parent.name)
        if any(name.startswith(wanted) for wanted in names) and pid_alive(pid):
            found[pid] = name
    return found


def _processes_of(conf: Path) -> set[int]:
    """Live processes started by the cluster: Slurm passes SLURM_CONF into every job."""
    marker = f"SLURM_CONF={conf}".encode()
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0") and pid_alive(int(environ.parent.name)):
                found.add(int(environ.parent.name))
        except OSError:
            continue
    return found - {os.getpid()}


@pytest.fixture(scope="session")
def slurm_cluster():
    try:
        install_slurm()
    except SlurmUnavailable as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tests: {err}")
        pytest.skip(str(err))
    before = _processes_named(SLURM_PROCESSES)
    root = Path(tempfile.mkdtemp(prefix="seq1f1b-slurm-"))
    cluster = SlurmCluster(root)
    cluster.start()
    yield cluster
    survivors = cluster.stop()
    left = {pid: name for pid, name in _processes_named(SLURM_PROCESSES).items()
            if pid not in before}
    jobs_left = _processes_of(cluster.conf)
    assert not survivors and not left and not jobs_left, \
        f"left running: daemons {survivors} {left}, job processes {sorted(jobs_left)}"
    assert cluster.hosts_mark not in HOSTS_FILE.read_text()
    subprocess.run(["rm", "-rf", str(root)], check=True)
