"""tools/hf_parity.py in one process (TP = PP = 1; the TP2 x PP2 runs are in
tests/distributed/test_hf.py): the converted Llama matches transformers with k = 3 spans, the
threshold catches a subtle error (the model built without Llama 3's RoPE scaling fails it), and
bad input is refused in one line before any work.
"""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from hf_models import make_model  # noqa: E402
from megatron_world import init_megatron  # noqa: E402

from megatron.training import hf_parity as parity  # noqa: E402
from seq1f1b.hf import ConversionError  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_model(family, root / family) for family in ("llama", "mistral")}


@pytest.fixture
def bare_world():
    """The session's world of one without parallel_state (run_parity builds its own layouts)."""
    from seq1f1b.distributed import release_model_parallel

    release_model_parallel()
    yield
    init_megatron()


def test_llama_with_spans_matches_transformers(folders, bare_world):
    result = parity.run_parity(parity.ParityCase(hf_dir=str(folders["llama"]), splits=3))
    assert result.passed, result
    assert result.max_abs_logit_diff <= parity.TOLERANCE * max(1.0, result.max_abs_logit)
    assert result.loss == pytest.approx(result.hf_loss, rel=1e-5)


def test_a_model_without_the_rope_scaling_fails(folders, bare_world, monkeypatch):
    checked = parity.check_case
    monkeypatch.setattr(parity, "check_case", lambda case, world: dataclasses.replace(
        checked(case, world), rope_scaling_factor=None))
    result = parity.run_parity(parity.ParityCase(hf_dir=str(folders["llama"]), splits=3))
    assert not result.passed
    assert result.max_abs_logit_diff > 100 * parity.TOLERANCE * max(1.0, result.max_abs_logit)


@pytest.mark.parametrize("changes,names", [
    (dict(tp=2), ["--tp 2", "world size 1"]),
    (dict(schedule="seq1f1b-interleaved"), ["--vpp 1", "seq1f1b-interleaved"]),
    (dict(schedule="megatron-1f1b", splits=2), ["--splits 2"]),
    (dict(schedule="nope"), ["--schedule"]),
    (dict(seq_length=80), ["--seq-length 80", "config.json", "sliding_window 64"]),
    (dict(seq_length=0), ["--seq-length must be a positive integer, got 0"]),
    (dict(micro_batch_size=0), ["--micro-batch-size must be a positive integer, got 0"]),
    (dict(micro_batch_size=-1), ["--micro-batch-size must be a positive integer, got -1"]),
])
def test_bad_cases_are_refused_before_any_work(folders, changes, names):
    case = parity.ParityCase(hf_dir=str(folders["mistral"]), **changes)
    with pytest.raises(ConversionError) as err:
        parity.check_case(case, 1)
    assert all(name in str(err.value) for name in names), str(err.value)


def test_cli_refuses_in_one_line_with_exit_code_2(folders, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "hf_parity.py"), "--hf-dir",
                           str(tmp_path / "missing"), "--json"], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"hf_parity.py: error: --hf-dir: {tmp_path / 'missing'} " \
                                  f"is not a directory"
