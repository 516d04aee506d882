"""`make test`'s worker groups take effect (tests/worker_groups.py, which tests/conftest.py takes
in): every test of tests/distributed runs on one worker, each unit file on one. Nothing fails
when they don't (pytest 9.2, or a hook order that hides the marks from xdist): the launches then
run two at once, 8 ranks on 2 cores."""
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CONFTEST = f"""
import sys

sys.path.insert(0, {str(TESTS)!r})
from worker_groups import pytest_collection_modifyitems  # noqa: F401  (the suite's own hook)
"""
TESTS_OF_A_FILE = "".join(f"def test_{n}():\n    pass\n\n\n" for n in range(4))


def test_make_tests_xdist_groups_reach_the_scheduler(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for folder, name in (("distributed", "test_launch_a"), ("distributed", "test_launch_b"),
                         ("unit", "test_plan")):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / f"{name}.py").write_text(TESTS_OF_A_FILE)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadgroup", "-v", str(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True).stdout
    ran = re.findall(r"\[(gw\d)\] .*PASSED (\S+)", out)
    assert len(ran) == 12, out
    groups = {test.split("/")[0]: set() for _, test in ran}
    for worker, test in ran:
        folder, group = test.split("/")[0], test.rpartition("@")[2]
        assert group == ("launches" if folder == "distributed" else "test_plan"), test
        groups[folder].add(worker)
    assert all(len(workers) == 1 for workers in groups.values()), ran
