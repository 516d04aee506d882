"""Context parallelism in the plan layer (seq1f1b/plan/context_parallel.py): per CP rank the
estimator counts 1/C of the activations, logits and K/V (one group each when the K/V groups per TP
rank are fewer than C), the all-to-all buffers and the optimizer over DP x CP; the projection does
1/C of the FLOPs, prices the all-to-alls on NVLink or InfiniBand by megatron's tp-cp-dp-pp order;
plan.py memory/simulate take --cp; the README's 7B at 1M tokens on 64 A100s fits with CP 2."""
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.context_parallel import all_to_all_bytes, kv_replication
from seq1f1b.plan.costs import ModelConfig, preset
from seq1f1b.plan.memory import GIB, TrainingSetup, estimate_memory
from seq1f1b.plan.projection import A100, cp_crosses_nodes, project

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_cli_cp", REPO / "tools" / "plan.py")
plan_cli = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = plan_cli
_spec.loader.exec_module(plan_cli)

MODEL = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, vocab_size=1000)


def _setup(**kwargs) -> TrainingSetup:
    base = dict(model=MODEL, seq_length=4096, schedule="seq1f1b", pp=4, microbatches=8,
                splits=4, distributed_optimizer=True)
    return TrainingSetup(**{**base, **kwargs})


def test_a_cp_rank_holds_half_of_every_token_dependent_byte():
    one, two = estimate_memory(_setup()), estimate_memory(_setup(cp=2))
    assert two.span_lengths == one.span_lengths
    for a, b in zip(one.stages, two.stages):
        assert b.activation_bytes == pytest.approx(a.activation_bytes / 2)
        assert b.kv_cache_bytes == pytest.approx(a.kv_cache_bytes / 2)
        assert b.logits_bytes == pytest.approx(a.logits_bytes / 2)
        assert b.parameter_bytes == a.parameter_bytes
        assert b.optimizer_bytes_sharded == pytest.approx(a.optimizer_bytes_sharded / 2)
        assert b.workspace_bytes > one.stages[0].workspace_bytes / 2    # + all-to-all buffers


def test_fewer_kv_groups_than_cp_ranks_are_replicated():
    gqa = replace(MODEL, num_query_groups=2)
    assert kv_replication(gqa, tp=1, cp=2) == 1.0 and kv_replication(gqa, tp=1, cp=4) == 2.0
    assert kv_replication(gqa, tp=2, cp=4) == 4.0       # one group per TP rank, on 4 CP ranks
    one, four = estimate_memory(_setup(model=gqa)), estimate_memory(_setup(model=gqa, cp=4))
    assert four.stages[0].kv_cache_bytes == pytest.approx(one.stages[0].kv_cache_bytes / 2)
    assert all_to_all_bytes(gqa, 4096, 1, 1, 1) == 0.0
    # q, k, v, out of 1024 tokens: (2 x 8 + 2 x 4 heads (2 groups x 2)) x 32 channels, 3/4 leave
    assert all_to_all_bytes(gqa, 4096, 1, 1, 4) == 1024 * (16 + 8) * 32 * 2 * 3 / 4


@pytest.mark.parametrize("kwargs, needle", [
    ({"cp": 3}, "--cp 3 must divide the attention heads"),
    ({"model": replace(MODEL, num_attention_heads=12, hidden_size=384, num_query_groups=6),
      "cp": 4}, "--cp 4: the K/V groups"),
    ({"model": replace(MODEL, num_query_groups=8), "cp": 0}, "positive integer"),
    ({"cp": 2, "span_lengths": (1023, 1025, 1024, 1024), "partition": "explicit"}, "1023"),
])
def test_bad_cp_setups_are_refused(kwargs, needle):
    with pytest.raises(ScheduleError, match=needle):
        estimate_memory(_setup(**kwargs))


def test_cp_spans_are_multiples_of_cp_times_tp_under_sequence_parallelism():
    setup = _setup(tp=2, cp=2, sequence_parallel=True, seq_length=4100, splits=3,
                   partition="compute")
    assert all(n % 4 == 0 for n in setup.spans()) and sum(setup.spans()) == 4100


def test_the_projection_divides_the_flops_and_prices_the_all_to_alls():
    model = preset("7b")
    base = TrainingSetup(model=model, seq_length=131072, schedule="seq1f1b", pp=4,
                         microbatches=8, splits=8, tp=8, sequence_parallel=True,
                         distributed_optimizer=True)
    one, two = project(base), project(replace(base, cp=2))
    assert (one.gpus, two.gpus) == (32, 64)
    # half the FLOPs per rank, plus all-to-alls that cross nodes (TP 8 fills a node)
    assert cp_crosses_nodes(replace(base, cp=2), A100)
    assert not cp_crosses_nodes(replace(base, tp=4, cp=2), A100)
    assert one.pipeline_s / 2 < two.pipeline_s < one.pipeline_s
    free = project(replace(base, cp=2), replace(A100, infiniband=A100.infiniband.ideal()))
    assert free.pipeline_s < two.pipeline_s


def test_readme_7b_at_1m_tokens_on_64_a100s_fits_with_cp2_and_full_recompute():
    """README: `plan.py memory --cp 2` for 7B at 1M tokens, TP 8 x PP 4 x CP 2 = 64 GPUs."""
    setup = TrainingSetup(model=preset("7b"), seq_length=1 << 20, schedule="seq1f1b", pp=4,
                          microbatches=8, splits=32, tp=8, cp=2, sequence_parallel=True,
                          distributed_optimizer=True, recompute_granularity="full")
    fits, no_recompute = estimate_memory(setup), estimate_memory(
        replace(setup, recompute_granularity=None, recompute_method=None,
                recompute_num_layers=None))
    without_cp = estimate_memory(replace(setup, cp=1, dp=2))
    assert fits.fits(A100.memory_gib) and fits.peak_bytes / GIB == pytest.approx(53.72, abs=0.01)
    assert not no_recompute.fits(A100.memory_gib) and not without_cp.fits(A100.memory_gib)
    assert project(setup).gpus == 64


def test_plan_cli_takes_cp(capsys):
    args = ["memory", "--schedule", "seq1f1b", "--pp", "4", "--microbatches", "8", "--splits",
            "32", "--model", "7b", "--seq-length", "1048576", "--tp", "8",
            "--sequence-parallel", "--distributed-optimizer", "--recompute-granularity",
            "full", "--cp", "2"]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "CP=2" in out.splitlines()[0] and out.splitlines()[-1].startswith("peak 53.72 GiB")
    assert "fits" in out.splitlines()[-1]
    assert plan_cli.main(["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches",
                          "4", "--splits", "2", "--model", "7b", "--seq-length", "8192",
                          "--cp", "2", "--json"]) == 0
    halved = json.loads(capsys.readouterr().out)
    assert plan_cli.main(["simulate", "--schedule", "seq1f1b", "--pp", "2", "--microbatches",
                          "4", "--splits", "2", "--model", "7b", "--seq-length", "8192",
                          "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert halved["makespan"] == pytest.approx(whole["makespan"] / 2)
    assert plan_cli.main(args[:-1] + ["3"]) == 2
    assert "--cp 3 must divide" in capsys.readouterr().err
