"""The search's mypyc build (seq1f1b/plan/schedules/compiled.py, tools/build_search.py): used
only where it was made from the sources as they are and for this Python, and it builds the
Python modules' orders."""
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from seq1f1b.plan.schedules import compiled

SEARCH = """
import hashlib, json, sys
from seq1f1b.plan import registry
from seq1f1b.plan.costs import preset
from seq1f1b.plan.schedules import greedy, refine
from seq1f1b.schedule_compare import CostModel, row, searched_schedule
model = CostModel(model=preset("7b"), seq_length=65536, tp=8, sequence_parallel=True)
cap = max(row(registry.build("seq1f1b", 4, 4, 2, 1), model).peaks)
found = searched_schedule(4, 4, 2, model, cap, 2)
print(json.dumps([sorted({type(module.__loader__).__name__ for module in (greedy, refine)}),
                  hashlib.sha256(repr(found.programs).encode()).hexdigest(),
                  row(found, model).makespan]))
"""
"""The worst case of issue 26 item 2 (7B/64K, P4 m4 k2 on a V at Seq1F1B's peak): the search
refines, then anneals (the walk's random numbers included)."""


def _fake_build(tmp_path):
    plan, build = tmp_path / "plan", tmp_path / "build"
    (plan / "schedules").mkdir(parents=True)
    (plan / "schedules" / "refine.py").write_text("X = 1\n")
    folder = build / "seq1f1b" / "plan" / "schedules"
    folder.mkdir(parents=True)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for name in compiled.MODULES:
        (folder / f"{name}{suffix}").write_bytes(b"")
    (build / compiled.STAMP).write_text(json.dumps(compiled.stamp(compiled.sources_digest(plan))))
    return plan, build, folder


def test_a_build_is_used_only_for_the_sources_and_the_python_it_was_made_from(tmp_path,
                                                                              monkeypatch):
    plan, build, folder = _fake_build(tmp_path)
    monkeypatch.delenv(compiled.PURE_PYTHON_ENV, raising=False)
    assert compiled.current_build(build, plan) == folder
    monkeypatch.setenv(compiled.PURE_PYTHON_ENV, "1")
    assert compiled.current_build(build, plan) is None
    monkeypatch.delenv(compiled.PURE_PYTHON_ENV)
    (plan / "schedules" / "refine.py").write_text("X = 2\n")           # edited since
    assert compiled.current_build(build, plan) is None
    plan, build, folder = _fake_build(tmp_path / "other")
    recorded = json.loads((build / compiled.STAMP).read_text())
    (build / compiled.STAMP).write_text(json.dumps({**recorded, "suffix": ".cpython-312-x.so"}))
    assert compiled.current_build(build, plan) is None                # another Python's
    plan, build, folder = _fake_build(tmp_path / "third")
    next(folder.iterdir()).unlink()                                    # a module missing
    assert compiled.current_build(build, plan) is None
    (build / compiled.STAMP).write_text(json.dumps({"unbuilt": "no C compiler"}))
    assert compiled.current_build(build, plan) is None


def _can_build() -> bool:
    return (importlib.util.find_spec("mypyc") is not None
            and any(shutil.which(cc) for cc in ("cc", "gcc", "clang")))


@pytest.mark.skipif(not _can_build(), reason="no mypyc or no C compiler here: the search runs "
                                             "as Python (the build is optional)")
def test_the_compiled_search_is_current_here_and_finds_the_python_searchs_order():
    assert compiled.current_build() is not None, \
        "no current build of the search: `make setup` (tools/build_search.py) builds it"

    def search(pure: bool) -> list:
        env = {**os.environ, compiled.PURE_PYTHON_ENV: "1" if pure else "0"}
        out = subprocess.run([sys.executable, "-c", SEARCH], env=env, check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.splitlines()[-1])

    compiled_run, python_run = search(pure=False), search(pure=True)
    assert compiled_run[0] == ["ExtensionFileLoader"] and python_run[0] == ["SourceFileLoader"]
    assert compiled_run[1:] == python_run[1:]

