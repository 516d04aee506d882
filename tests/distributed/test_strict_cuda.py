"""The training and benchmark runs once more under CUDA's rules (SEQ1F1B_STRICT_CUDA=1,
seq1f1b/strict_cuda.py): what would fail on the first GPU run fails here. (Every equivalence
case, test_equivalence.py, runs under them already.)

- training: pretrain_gpt.py's PP2 x DP2 layout with the distributed optimizer, 2 x N iterations
  straight and N + N resumed from a checkpoint, bit for bit (batches reach the device on the
  stages that use them; the checkpoint's collectives pass NCCL's rules);
- benchmark: tools/benchmark.py on a traced schedule that defers weight gradients (its trace and
  saved-tensor meter too) and on megatron's own 1F1B.
"""
import json
import subprocess
import sys

from launch import ROOT, STRICT_CUDA, _free_port, run_cases
from test_benchmark import ENV
from test_training import N, _resume_flags, data_prefix  # noqa: F401 (a fixture)


def test_strict_training_resumes_bit_for_bit(data_prefix, tmp_path):  # noqa: F811
    flags = _resume_flags(data_prefix, "dp2_distopt")
    checkpoints = str(tmp_path / "checkpoints")
    straight, first, resumed = run_cases(4, "training_worker.py", [
        {"argv": flags},
        {"argv": flags + ["--save", checkpoints, "--exit-interval", str(N)]},
        {"argv": flags + ["--load", checkpoints, "--save", checkpoints]}], env=STRICT_CUDA)
    for result in (straight, first, resumed):
        assert "error" not in result, result["traceback"]
    assert resumed["start_iteration"] == N and resumed["iteration"] == 2 * N
    assert first["history"] + resumed["history"] == straight["history"]


def test_strict_benchmark(tmp_path):
    output = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(ROOT / "tools" / "benchmark.py"), "--pp", "2", "--num-layers", "4",
           "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
           "--vocab-size", "64", "--num-microbatches", "2", "--splits", "2", "--warmup", "0",
           "--iterations", "1", "--schedules", "seq1f1b-zb-h1", "megatron-1f1b",
           "--output", str(output)]
    proc = subprocess.run(cmd, env={**ENV, **STRICT_CUDA}, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    runs = json.loads(output.read_text())["runs"]
    assert [run["schedule"] for run in runs] == ["seq1f1b-zb-h1", "megatron-1f1b"]
    assert all(run["iteration_s"] > 0 for run in runs)
