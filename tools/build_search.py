"""Compile the schedule search's three hottest modules with mypyc (`make setup` runs this).

    python tools/build_search.py
    -> .build/search/seq1f1b/plan/schedules/{greedy,refine,anneal}.<suffix> and
       .build/search/stamp.json

Why and how the package picks the build up: seq1f1b/plan/schedules/compiled.py. The build is
optional: without mypy or a C compiler this prints one line saying the search stays pure
Python, writes that reason as the stamp (so `make` does not retry until a source changes) and
exits 0; the search runs as it did, slower. The folder is replaced whole, and a build's stamp
is written last, only when the sources did not change while it ran.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from seq1f1b.plan.schedules import compiled  # noqa: E402

GROUP = "seq1f1b.plan.schedules.search"
"""mypyc's shared library for the modules: `search__mypyc`, inside the package's folder."""


def _build(build_temp: str) -> None:
    from mypyc.build import mypycify
    from setuptools import setup

    paths = [f"seq1f1b/plan/schedules/{name}.py" for name in compiled.MODULES]
    setup(name="seq1f1b-search", script_args=[
              "build_ext", "--build-lib", str(compiled.BUILD), "--build-temp", build_temp],
          # numpy, matplotlib and OR-Tools unread (Any): the compiled modules use none of them,
          # and reading their stubs made the build 159 s instead of 13
          ext_modules=mypycify(paths + ["--follow-imports=silent", "--no-site-packages",
                                        "--ignore-missing-imports",
                                        "--cache-dir", os.path.join(build_temp, "mypy")],
                               opt_level="3", group_name=GROUP,
                               target_dir=os.path.join(build_temp, "c")))


def main() -> int:
    start = time.perf_counter()
    os.chdir(compiled.PLAN.parents[1])      # mypy names the modules from the repo root
    digest = compiled.sources_digest()
    shutil.rmtree(compiled.BUILD, ignore_errors=True)
    printed = io.StringIO()
    with tempfile.TemporaryDirectory() as build_temp:
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                _build(build_temp)
        except (SystemExit, Exception) as err:    # optional: say why, and go on
            lines = [line for line in printed.getvalue().splitlines() if "error" in line]
            said = str(err) if isinstance(err, SystemExit) else f"{type(err).__name__}: {err}"
            if said.strip() in ("", "1") and lines:     # mypy's errors, then exit status 1
                said = lines[-1]
            reason = said.strip()[:200]
            shutil.rmtree(compiled.BUILD, ignore_errors=True)
            compiled.BUILD.mkdir(parents=True)      # the stamp says why: make does not retry
            (compiled.BUILD / compiled.STAMP).write_text(json.dumps({"unbuilt": reason}) + "\n")
            print(f"build_search: the search stays pure Python ({reason})")
            return 0
    if compiled.sources_digest() != digest:
        shutil.rmtree(compiled.BUILD, ignore_errors=True)
        print("build_search: a source changed during the build; run it again")
        return 1
    (compiled.BUILD / compiled.STAMP).write_text(json.dumps(compiled.stamp(digest)) + "\n")
    print(f"build_search: {', '.join(compiled.MODULES)} compiled by mypyc in "
          f"{time.perf_counter() - start:.0f} s ({compiled.BUILD})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
