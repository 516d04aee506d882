"""`make test`'s worker groups (pytest-xdist, --dist loadgroup), a hook that tests/conftest.py
takes in. A module of its own that imports no torch: tests/unit/test_suite_groups.py runs a
pytest with two workers on it, and each of them would otherwise import torch and megatron-core
(conftest.py's fixtures) only to find three groups."""
from __future__ import annotations

import pytest

LAUNCHING = ("distributed", "slurm")
"""The test folders whose tests start several processes each (torchrun's 4 ranks, a Slurm job)."""


@pytest.hookimpl(tryfirst=True)     # before xdist's own hook, which reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for `make test`'s two workers (pytest-xdist, --dist loadgroup). Every test that
    launches processes is in one group, run in order on one worker: two launches at once would
    put 8 ranks on the 2 cores and their gloo timeouts at risk. Each unit test file is a group
    of its own (its module fixtures built once), taken by whichever worker is free: a launch
    leaves about 30% of the 2 cores idle (its ranks wait on each other), which the other
    worker's unit tests fill. Without xdist the marks change nothing.

    xdist's worker appends each test's group to its id in this same hook, and its hook ran
    before this one: `tryfirst`, or it finds no marks. With pytest 9.2 the appended group does
    not take either (requirements.txt pins 9.1.1). Either way the groups silently did nothing
    and both workers ran launches at once (8 ranks on 2 cores: CI's stop 52 timed out)."""
    for item in items:
        folder = item.path.parent.name
        group = "launches" if folder in LAUNCHING else item.path.stem
        item.add_marker(pytest.mark.xdist_group(group))
