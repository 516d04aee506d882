#!/usr/bin/env python3
"""A throwaway Slurm cluster on this one machine, so the sbatch scripts of examples/slurm run for
real in CI: munged, slurmctld and eight slurmd (an eight-node emulation on one host), every file
in one folder.

    tests/slurm/cluster.py up DIR      install Slurm if missing (Debian packages), start the
                                       daemons, print `export SLURM_CONF=DIR/slurm.conf`
    tests/slurm/cluster.py down DIR    cancel the jobs, stop the daemons by their pid files,
                                       remove the /etc/hosts line

Why it looks like this (see shared/reference/SLURM_ON_CI.md for what was observed):
- no systemd, cgroups or accounting database: proctrack/linuxproc, task/none, no accounting;
- the nodes are DGX-shaped (8 CPUs, 8 fake GPUs each, over-advertised with config_overrides) and
  there are 8 of them, so the paper scripts' headers (up to 8 nodes x 8 GPUs) are accepted as
  written; a slurmd costs ~6 MB and no CPU while idle;
- the slurmd run on one host under names in /etc/hosts, so `scontrol show hostnames` gives names
  that resolve, as on a real cluster;
- MinJobAge=5 so `sbatch --wait` polls every 2 s instead of 2, 10, 42, 74 ... s; MessageTimeout=60
  so client calls survive a machine loaded far beyond its 2 cores.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel",
            "munged")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# seq1f1b-slurm-ci"
POLICY_RC = Path("/usr/sbin/policy-rc.d")


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and this machine cannot install it (not root, or no apt-get)."""


@dataclass(frozen=True)
class ClusterSpec:
    """What the emulated cluster advertises."""

    nodes: tuple[str, ...] = tuple(f"seq1f1b-n{i}" for i in range(1, 9))
    cpus_per_node: int = 8
    gpus_per_node: int = 8
    partition: str = "ci"
    cluster_name: str = "seq1f1b-ci"


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, text=True, **kwargs)


def slurm_installed() -> bool:
    return all(shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
               for name in BINARIES)


def install_slurm() -> None:
    """Debian's Slurm and munge packages, unless already there.

    The packages' init scripts must not start daemons (there is no config yet): a policy-rc.d
    that denies it is put in place for the install when none exists, and removed after.
    Raises SlurmUnavailable only when installing is impossible here; a failing apt-get raises
    CalledProcessError (a real failure, not a reason to skip).
    """
    if slurm_installed():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    added_policy = not POLICY_RC.exists()
    if added_policy:
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        _run(["apt-get", "update", "-qq"], env=env, stdout=subprocess.DEVNULL)
        _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES], env=env,
             stdout=subprocess.DEVNULL)
    finally:
        if added_policy:
            POLICY_RC.unlink()
    if not slurm_installed():
        raise RuntimeError(f"apt-get installed {' '.join(PACKAGES)} but a binary is missing")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _first_job_id(ports: int = 32) -> int:
    """A first job id N whose jobs' default rendezvous ports (MASTER_PORT = 20000 + id mod 20000
    in examples/slurm/launch_pretrain.sh) are free, below the kernel's ephemeral range (where the
    daemons' ports are), and differ from those of another cluster on this host."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 32000 - ports)
        if all(_port_free(port) for port in range(first, first + ports)):
            return first
    raise RuntimeError("no free port range for the jobs' rendezvous in 20000-32000")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


class SlurmCluster:
    """The daemons of one cluster whose every file lives under `root`.

    `start()` and `stop()` are separate so a CLI can start in one process and stop in another:
    all state (ports, pids) is in files under `root`.
    """

    def __init__(self, root: Path, spec: ClusterSpec = ClusterSpec()) -> None:
        self.root = Path(root).resolve()
        self.spec = spec
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge-run" / "munge.socket"
        self._children: list[subprocess.Popen] = []

    # -- what clients need ---------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """The environment for sbatch/srun/squeue against this cluster."""
        path = os.environ.get("PATH", "")
        for extra in ("/usr/sbin", "/sbin"):
            if extra not in path.split(":"):
                path += ":" + extra
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": path}

    def slurm(self, *argv: str, timeout: float = 30) -> str:
        """Run a Slurm client command against this cluster; its stdout."""
        return _run(list(argv), env=self.env, capture_output=True, timeout=timeout).stdout

    # -- start ---------------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> None:
        """Start every daemon and wait until the nodes are idle; on failure, undo what started."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)     # munged, as the munge user, must reach its socket below
        for sub in ("state", "log", "dev"):
            (self.root / sub).mkdir(exist_ok=True)
        self._write_config()
        self._add_hosts()
        self._start_munged()
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.spec.nodes:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._wait_idle(timeout)

    def _spawn(self, name: str, argv: list[str]) -> None:
        """A daemon in the foreground as our child, in its own session: this process reaps it
        at stop() (an init that reaps no orphans would keep a daemonised one as a zombie)."""
        with open(self.root / "log" / f"{name}.stderr", "ab") as stderr:
            self._children.append(subprocess.Popen(
                argv, env=self.env, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                start_new_session=True))

    def _write_config(self) -> None:
        spec, root = self.spec, self.root
        ctld_port, *node_ports = _free_ports(1 + len(spec.nodes))
        for gpu in range(spec.gpus_per_node):
            (root / "dev" / f"gpu{gpu}").touch()
        memory = max(1024, _memory_mb() - 1024)
        gpus = f"Gres=gpu:{spec.gpus_per_node}" if spec.gpus_per_node else ""
        lines = [
            f"ClusterName={spec.cluster_name}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"FirstJobId={_first_job_id()}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "MpiDefault=none", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill", "ReturnToService=2", "MinJobAge=5",
            "KillWait=5", "MessageTimeout=60", "MailProg=/bin/true",
            "SlurmdParameters=config_overrides",
            "GresTypes=gpu",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd-%n.log",
        ]
        for node, port in zip(spec.nodes, node_ports):
            lines.append(f"NodeName={node} NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={spec.cpus_per_node} RealMemory={memory} {gpus}".rstrip())
        lines.append(f"PartitionName={spec.partition} Nodes=ALL Default=YES "
                     "MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        gres = [f"NodeName={node} Name=gpu File={root}/dev/gpu[0-{spec.gpus_per_node - 1}]"
                for node in spec.nodes] if spec.gpus_per_node else []
        (root / "gres.conf").write_text("\n".join(gres) + "\n")

    @property
    def hosts_mark(self) -> str:
        """The comment that ends this cluster's /etc/hosts line."""
        return f"{HOSTS_MARK} {self.root}"

    def _add_hosts(self) -> None:
        """Name the emulated nodes 127.0.0.1 (one marked line, removed by stop())."""
        kept = [line for line in HOSTS_FILE.read_text().splitlines()
                if not line.endswith(self.hosts_mark)]
        kept.append(f"127.0.0.1 {' '.join(self.spec.nodes)} {self.hosts_mark}")
        HOSTS_FILE.write_text("\n".join(kept) + "\n")

    def _start_munged(self) -> None:
        """munged as the munge user with its own key and socket (munge checks that the key's
        folder is private and the socket's folder is reachable by all)."""
        secret, run = self.root / "munge-etc", self.munge_socket.parent
        secret.mkdir(mode=0o700, exist_ok=True)
        run.mkdir(mode=0o755, exist_ok=True)
        key = secret / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        for path in (secret, key, run):
            shutil.chown(path, "munge", "munge")
        self._spawn("munged", ["setpriv", "--reuid=munge", "--regid=munge", "--clear-groups",
                               "munged", "--foreground", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={run}/munged.pid",
                               f"--log-file={secret}/munged.log",
                               f"--seed-file={secret}/munged.seed"])
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or self._children[-1].poll() is not None:
                raise RuntimeError(f"munged did not start; see {secret}/munged.log")
            time.sleep(0.1)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            try:
                states = self.slurm("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
                states = ""
            ready = {line.split()[0] for line in states.splitlines()
                     if line.split()[1] in ("idle", "mix", "alloc")}
            if ready >= set(self.spec.nodes):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s: {states!r}; "
                           f"logs in {self.root / 'log'}")

    # -- stop ----------------------------------------------------------------------------------
    def pid_files(self) -> list[Path]:
        """Every daemon's pid file, slurmd first (they go before slurmctld and munged)."""
        return ([self.root / f"slurmd-{node}.pid" for node in self.spec.nodes]
                + [self.root / "slurmctld.pid", self.munge_socket.parent / "munged.pid"])

    def stop(self, timeout: float = 30) -> list[int]:
        """Cancel every job and wait for its processes (slurmstepd outlives slurmd), then stop
        the daemons by pid; returns the pids still alive (none when all went well)."""
        daemons = {pid for pid in map(_read_pid, self.pid_files()) if pid is not None}
        daemons |= {child.pid for child in self._children}
        if self.conf.exists():
            try:
                self.slurm("scancel", "--full", "--user", "root", timeout=10)
                self._wait_no_jobs(timeout / 2)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError):
                pass            # daemons may be half up; stopping them by pid still works
        def of_jobs() -> set[int]:      # not a daemon nor a daemon's helper (slurmscriptd)
            return {pid for pid in self.job_processes() - daemons if _parent(pid) not in daemons}

        deadline = time.monotonic() + timeout / 2
        while of_jobs() and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [pid for pid in sorted(of_jobs()) if not _stop_pid(pid, timeout / 4)]
        survivors += [pid for pid in sorted(daemons) if not _stop_pid(pid, timeout / 4)]
        survivors += [pid for pid in sorted(self.job_processes()) if not _stop_pid(pid, 5.0)]
        for child in self._children:
            child.poll()
        self._remove_hosts()
        return survivors

    def job_processes(self) -> set[int]:
        """Live processes of this cluster other than this one: the daemons, slurmstepd and every
        job process (Slurm hands SLURM_CONF, unique to the cluster, to all of them)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = set()
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                pid = int(environ.parent.name)
                if marker in environ.read_bytes().split(b"\0") and pid_alive(pid):
                    found.add(pid)
            except OSError:
                continue
        return found - {os.getpid()}

    def _wait_no_jobs(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.slurm("squeue", "-h", "-o", "%i", timeout=10).strip():
                return
            time.sleep(0.5)
        raise RuntimeError("jobs still listed after scancel")

    def _remove_hosts(self) -> None:
        lines = HOSTS_FILE.read_text().splitlines()
        kept = [line for line in lines if not line.endswith(self.hosts_mark)]
        if kept != lines:
            HOSTS_FILE.write_text("\n".join(kept) + "\n")


def _read_pid(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _parent(pid: int) -> Optional[int]:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, IndexError, ValueError):
        return None


def _stop_pid(pid: int, timeout: float) -> bool:
    """SIGTERM, then SIGKILL after `timeout`; True once the process is gone."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return True
            time.sleep(0.1)
    return not pid_alive(pid)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("root", help="folder that holds every file of the cluster")
    args = parser.parse_args(argv)
    cluster = SlurmCluster(Path(args.root))
    try:
        if args.action == "up":
            install_slurm()
            cluster.start()
            print(f"export SLURM_CONF={cluster.conf}")
            return 0
        survivors = cluster.stop()
    except (SlurmUnavailable, RuntimeError, subprocess.CalledProcessError) as err:
        print(f"cluster.py: error: {err}", file=sys.stderr)
        return 1
    if survivors:
        print(f"cluster.py: error: still running: {survivors}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
