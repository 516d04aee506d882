"""The search's three hottest modules compiled by mypyc, used where a build of these sources
exists.

A searched schedule's time goes to replaying orders: `Orders.timing` (refine.py) prices every
move the refinement and the annealing walk (anneal.py) try, about half of a search in itself,
and the greedy replays (greedy.py) most of the rest. mypyc compiles the three modules, as they
are, to C extensions that keep Python's float arithmetic and `random.Random`'s stream, and the
budgets count actions timed, not seconds: the same orders, 1.3-1.7x faster (`plan.py search`
at 7B/64K, TP 8, SP, on two chunks: P4 m4 k2 at Seq1F1B's peak 5.4-5.6 -> 3.3-3.4 s, P4 m8 k4
10.6-10.7 -> 8.0-8.4 s). The greedy replay compiles well as a class of typed fields and methods
(`greedy._Replay`): 2.3x faster replays than as Python, 4-12% shorter searches than with refine
and anneal compiled alone (as closures it had made the search 2.7x slower: they crossed
between compiled and Python code at every call).

`make setup` builds them (tools/build_search.py) into `.build/search/` and writes a stamp beside
them: the sha256 of every source of `seq1f1b/plan/` (what the build type-checked) and the
interpreter's extension suffix. `use_current_build(__path__)`, which the package calls before it
imports a schedule, puts the build's folder first on the package's path only when the stamp
matches the sources as they are now and this interpreter: a source edited since the build,
another Python (the GPU machine's 3.12), no build (no C compiler) or `SEQ1F1B_PURE_PYTHON=1`
runs the Python modules, the same orders, slower.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
from pathlib import Path
from typing import Optional

MODULES = ("greedy", "refine", "anneal")
"""The modules of this package that the build compiles."""
PLAN = Path(__file__).resolve().parents[1]
BUILD = PLAN.parents[1] / ".build" / "search"
"""The build's `--build-lib`: the extensions lie in its seq1f1b/plan/schedules/."""
STAMP = "stamp.json"
PURE_PYTHON_ENV = "SEQ1F1B_PURE_PYTHON"


def sources_digest(plan: Path = PLAN) -> str:
    """sha256 over every .py file under `plan`, with its path: what a build was made from."""
    digest = hashlib.sha256()
    for path in sorted(plan.rglob("*.py")):
        digest.update(str(path.relative_to(plan)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def stamp(digest: str) -> dict[str, str]:
    """What a build of sources with `digest` records, for this interpreter."""
    return {"sources": digest, "suffix": importlib.machinery.EXTENSION_SUFFIXES[0]}


def current_build(build: Path = BUILD, plan: Path = PLAN) -> Optional[Path]:
    """The folder holding compiled `MODULES` made from the sources as they are now, for this
    interpreter; None when there is none (or `SEQ1F1B_PURE_PYTHON=1`)."""
    folder = build / "seq1f1b" / "plan" / "schedules"
    if os.environ.get(PURE_PYTHON_ENV) == "1":
        return None
    try:
        recorded = json.loads((build / STAMP).read_text())
    except (OSError, ValueError):
        return None
    wanted = stamp(sources_digest(plan))
    if recorded != wanted:
        return None
    if not all((folder / f"{name}{wanted['suffix']}").is_file() for name in MODULES):
        return None
    return folder


def use_current_build(package_path: list[str]) -> None:
    """Put the current build's folder first on `package_path` (the schedules package's
    `__path__`), if there is one."""
    folder = current_build()
    if folder is not None and str(folder) not in package_path:
        package_path.insert(0, str(folder))
