"""Run many cases inside ONE torchrun launch per world size (imports cost ~5 s per process).

`run_cases(world_size, worker, cases)` writes the cases to a JSON file, launches
`torchrun --nproc-per-node W worker cases.json results.json` and returns the worker's list of
results (one dict per case, in order). The worker runs every case even if one fails. `env` adds
environment variables for the launch (e.g. SEQ1F1B_STRICT_CUDA=1: strict platform mode).

A launch that outlives `timeout_s` is stuck somewhere no test can see, and CI keeps only the
failure's text: every process of it runs with faulthandler on, so a SIGABRT to each process
of the launch, one after another, makes each print every thread's stack, and the error carries
those stacks.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cases(world_size: int, worker: str, cases: list[dict], timeout_s: int = 900,
              env: Optional[dict[str, str]] = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cases_path = Path(tmp) / "cases.json"
        results_path = Path(tmp) / "results.json"
        cases_path.write_text(json.dumps(cases))
        environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                   "PYTHONFAULTHANDLER": "1", **(env or {})}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(world_size), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(ROOT / "tests" / "distributed" / worker), str(cases_path), str(results_path)]
        proc = subprocess.Popen(cmd, env=environ, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stdout, stderr = _stacks_of_stuck(proc)
            raise RuntimeError(f"torchrun x{world_size} still running after {timeout_s} s; "
                               f"every process's stacks:\n{stdout[-4000:]}\n{stderr[-24000:]}")
        if proc.returncode != 0 or not results_path.exists():
            raise RuntimeError(f"torchrun x{world_size} failed ({proc.returncode}):\n"
                               f"{stdout[-4000:]}\n{stderr[-8000:]}")
        return json.loads(results_path.read_text())


def _stacks_of_stuck(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGABRT every process of the launch, one at a time: faulthandler prints each one's
    threads, and stacks printed at once interleave on the stderr they share (a clean-clone run
    once found none whole). torchrun's agent goes first, so that no rank's death makes it stop
    the others before they print; the ranks run in sessions of their own and are found by
    parent, in /proc. Then kill what is left, the processes that still write to the launch's
    output from outside its tree too; returns the output read so far, stacks included."""
    launched = [proc.pid] + _descendants(proc.pid)
    for pid in launched:
        _signal(pid, signal.SIGABRT)
        _wait_gone(pid, timeout_s=10)
    for pid in _writers_to(proc) - set(launched):   # orphans: no stacks of theirs to wait for
        _signal(pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for pid in launched:
            _signal(pid, signal.SIGKILL)
        return proc.communicate()


def _writers_to(proc: subprocess.Popen) -> set[int]:
    """Every process whose stdout or stderr is the launch's pipe: its descendants and any that
    left the tree. A rank's helper process orphaned before the timeout (a multiprocessing
    Manager's server, on a suite run) held the pipe open, and reading to its end never ended."""
    pipes = {f"pipe:[{os.fstat(stream.fileno()).st_ino}]" for stream in (proc.stdout, proc.stderr)}
    found = set()
    for fd in Path("/proc").glob("[0-9]*/fd/[12]"):
        try:
            if os.readlink(fd) in pipes:
                found.add(int(fd.parent.parent.name))
        except OSError:     # gone meanwhile, or not ours to read
            continue
    return found


def _wait_gone(pid: int, timeout_s: float) -> None:
    """Until process `pid` has ended (gone from /proc, or a zombie), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.05)


def _descendants(root: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:     # gone meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


STRICT_CUDA = {"SEQ1F1B_STRICT_CUDA": "1"}
"""A launch's environment for strict CUDA mode (seq1f1b/strict_cuda.py): CUDA's rules on the
CPU."""


def run_worlds(worker: str, cases: dict[int, list[dict]],
               extra: dict[int, list[tuple[object, dict]]],
               env: Optional[dict[str, str]] = None) -> dict:
    """Each world's `cases` and its `extra` (key, case) pairs in one launch per world (`env`
    added to each): the result's [world] is the list of the cases' results, in order, and
    [key] each extra's."""
    out: dict = {}
    for world, listed in cases.items():
        added = extra.get(world, [])
        ran = run_cases(world, worker, listed + [case for _, case in added], env=env)
        out[world] = ran[:len(listed)]
        out.update({key: result for (key, _), result in zip(added, ran[len(listed):])})
    return out
