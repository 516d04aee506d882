"""The training, equivalence, benchmark and recompute runs once more under CUDA's rules
(SEQ1F1B_STRICT_CUDA=1, seq1f1b/strict_cuda.py): what would fail on the first GPU run fails here.

- equivalence: every world-2 case of test_equivalence (every registered schedule and megatron's
  own 1F1B; TP with and without sequence parallelism, DP, full and selective activation
  recompute, with dropout too) and its TP2 x PP2 cases with sequence parallelism, exact against
  the unsplit model; and orders with the output layer spread over the ranks (O actions, from a
  file) on a V at PP 2 and at TP2 x PP2 with sequence parallelism;
- training: pretrain_gpt.py's PP2 x DP2 layout with the distributed optimizer, 2 x N iterations
  straight and N + N resumed from a checkpoint, bit for bit (batches reach the device on the
  stages that use them; the checkpoint's collectives pass NCCL's rules);
- benchmark: tools/benchmark.py on a traced schedule that defers weight gradients (its trace and
  saved-tensor meter too) and on megatron's own 1F1B.
"""
import json
import subprocess
import sys

import pytest

from launch import ROOT, _free_port, run_cases
from test_benchmark import ENV
from spread_orders import spread_order
from seq1f1b.plan import schedule_file
from test_equivalence import CASES
from test_training import N, _resume_flags, data_prefix  # noqa: F401 (a fixture)

STRICT = {"SEQ1F1B_STRICT_CUDA": "1"}
EQUIVALENCE = {2: CASES[2],
               4: [case for case in CASES[4] if case.get("tp") == 2 and case.get("pp") == 2
                   and case.get("sequence_parallel")]}


SPREAD = {2: {}, 4: {"tp": 2, "sequence_parallel": True}}
"""world -> the case's other fields, for a V order with O's on both ranks (P 2, m 4, k 2)."""


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory):
    path = tmp_path_factory.mktemp("spread") / "spread.csv"
    path.write_text(schedule_file.write(spread_order(2, 4, 2, 2, "vshape")))
    spread = {"pipeline_schedule_file": str(path), "pp": 2, "num_microbatches": 4, "splits": 2,
              "chunks": 2, "untie_embeddings": True}
    out = {world: run_cases(world, "equivalence_worker.py",
                            cases + [{**spread, **SPREAD[world]}], env=STRICT)
           for world, cases in EQUIVALENCE.items()}
    out["spread"] = {world: out[world].pop() for world in SPREAD}
    return out


PARAMS = [(world, n) for world, cases in EQUIVALENCE.items() for n in range(len(cases))]


@pytest.mark.parametrize("param", PARAMS, ids=[f"w{w}-{n}" for w, n in PARAMS])
def test_strict_equivalence(equivalence, param):
    world, n = param
    result = equivalence[world][n]
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert result["passed"], result


@pytest.mark.parametrize("world", sorted(SPREAD))
def test_strict_equivalence_with_the_output_layer_spread(equivalence, world):
    result = equivalence["spread"][world]
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert result["case"]["schedule"].startswith("file:") and result["passed"], result


def test_strict_training_resumes_bit_for_bit(data_prefix, tmp_path):  # noqa: F811
    flags = _resume_flags(data_prefix, "dp2_distopt")
    checkpoints = str(tmp_path / "checkpoints")
    straight, first, resumed = run_cases(4, "training_worker.py", [
        {"argv": flags},
        {"argv": flags + ["--save", checkpoints, "--exit-interval", str(N)]},
        {"argv": flags + ["--load", checkpoints, "--save", checkpoints]}], env=STRICT)
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
    proc = subprocess.run(cmd, env={**ENV, **STRICT}, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    runs = json.loads(output.read_text())["runs"]
    assert [run["schedule"] for run in runs] == ["seq1f1b-zb-h1", "megatron-1f1b"]
    assert all(run["iteration_s"] > 0 for run in runs)
