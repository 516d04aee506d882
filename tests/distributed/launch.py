"""Run many cases inside ONE torchrun launch per world size (imports cost ~5 s per process).

`run_cases(world_size, worker, cases)` writes the cases to a JSON file, launches
`torchrun --nproc-per-node W worker cases.json results.json` and returns the worker's list of
results (one dict per case, in order). The worker runs every case even if one fails. `env` adds
environment variables for the launch (e.g. SEQ1F1B_STRICT_CUDA=1: strict platform mode).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
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
        environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(world_size), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(ROOT / "tests" / "distributed" / worker), str(cases_path), str(results_path)]
        proc = subprocess.run(cmd, env=environ, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)
        if proc.returncode != 0 or not results_path.exists():
            raise RuntimeError(f"torchrun x{world_size} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        return json.loads(results_path.read_text())


def run_worlds(worker: str, cases: dict[int, list[dict]],
               extra: dict[int, list[tuple[object, dict]]]) -> dict:
    """Each world's `cases` and its `extra` (key, case) pairs in one launch per world: the
    result's [world] is the list of the cases' results, in order, and [key] each extra's."""
    out: dict = {}
    for world, listed in cases.items():
        added = extra.get(world, [])
        ran = run_cases(world, worker, listed + [case for _, case in added])
        out[world] = ran[:len(listed)]
        out.update({key: result for (key, _), result in zip(added, ran[len(listed):])})
    return out
