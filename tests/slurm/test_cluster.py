"""tests/slurm/cluster.py: when Slurm cannot be installed, and the up/down recipe of docs/slurm.md."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import cluster
from cluster import HOSTS_FILE, SlurmCluster, SlurmUnavailable, install_slurm, pid_alive

CLI = Path(cluster.__file__)


@pytest.mark.parametrize("euid, apt_get, reason", [(1000, "/usr/bin/apt-get", "needs root"),
                                                   (0, None, "no apt-get")])
def test_no_slurm_and_no_way_to_install_it(monkeypatch, euid, apt_get, reason):
    monkeypatch.setattr(cluster, "slurm_installed", lambda: False)
    monkeypatch.setattr(cluster.os, "geteuid", lambda: euid)
    monkeypatch.setattr(cluster.shutil, "which", lambda name, path=None: apt_get)
    with pytest.raises(SlurmUnavailable, match=reason):
        install_slurm()


def test_cli_up_then_down_leaves_nothing(slurm_cluster):
    """docs/slurm.md's by-hand recipe: `up` prints the SLURM_CONF to export, a job runs on two nodes,
    `down` stops every daemon (a second cluster beside the session's: own ports, own hosts line).
    The folder is made as docs/slurm.md's /tmp/slurm-ci would be (pytest's tmp_path is private to root,
    and munged, as the munge user, must reach its socket)."""
    root = Path(tempfile.mkdtemp(prefix="seq1f1b-slurm-cli-"))
    try:
        _up_job_down(root)
        assert slurm_cluster.hosts_mark in HOSTS_FILE.read_text()  # the session's is untouched
    finally:
        shutil.rmtree(root)


def _up_job_down(root: Path) -> None:
    up = subprocess.run([sys.executable, str(CLI), "up", str(root)], capture_output=True,
                        text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    assert up.stdout.strip() == f"export SLURM_CONF={root / 'slurm.conf'}"
    by_hand = SlurmCluster(root)
    pids = [int(f.read_text().split()[0]) for f in by_hand.pid_files()]
    try:
        nodes = by_hand.slurm("srun", "--nodes=2", "--ntasks-per-node=1", "printenv",
                              "SLURMD_NODENAME", timeout=60)
        assert len(set(nodes.split())) == 2, nodes
    finally:
        down = subprocess.run([sys.executable, str(CLI), "down", str(root)], capture_output=True,
                              text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not [pid for pid in pids if pid_alive(pid)]
    assert by_hand.hosts_mark not in HOSTS_FILE.read_text()
