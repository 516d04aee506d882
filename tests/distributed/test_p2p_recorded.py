"""The runtime's real p2p calls, recorded on gloo and replayed under NCCL's rules (lazy and eager):
every registry schedule, TP 2 and sequence parallelism included (and the searched one placed under
a memory cap with the model's costs), finishes; our schedules issue
exactly their communication plan's groups; megatron-core's own 1F1B is recorded as a baseline; the
runtime's old prefetch order, which gloo runs without complaint, is caught. Context parallelism
(PP 2 x CP 2: seq1f1b and the interleaved span schedule): every CP rank issues
the same all-to-alls and all-reduces in the same order, as many as the layers, spans and
micro-batches call for, and the p2p and CP collectives of all four ranks replayed together, each
on its communicator, finish under both modes (eager: every communicator on one device stream).
An order the search's greedy places keeping no promises, run from a file, finishes too, and so
do runs with the output layer's backward in F (--loss-backward-in-forward: TP collectives move
into F, the p2p and CP calls must not change), and orders with the output layer spread over the
ranks (O actions: the last stage's hidden states to the O's rank and their gradient back), on a
loop and a V, with TP 2 and SP, and with CP 2 (every rank replayed together)."""
import pytest

from launch import run_worlds
from seq1f1b.plan import registry, schedule_file
from seq1f1b.plan.actions import Schedule
from seq1f1b.plan.costs import preset
from seq1f1b.plan.registry import build
from seq1f1b.plan.schedules.greedy import Placer, Policy, Problem
from seq1f1b.plan.schedules.zero_bubble_v import default_cap
from seq1f1b.schedule_compare import CostModel
from spread_orders import spread_cases

L8 = {"num_layers": 8}
EARLY = {"loss_backward_in_forward": True}    # the output layer's backward in F (early_loss.py)
CP_CASES = [{"schedule": "seq1f1b", "cp": 2, "pp": 2, "splits": 3},
            {"schedule": "seq1f1b-interleaved", "cp": 2, "pp": 2, "chunks": 2, "splits": 3},
            {"schedule": "seq1f1b", "cp": 2, "pp": 2, "splits": 3, **EARLY}]
CASES = {
    2: [{"schedule": "1f1b", "pp": 2},
        {"schedule": "seq1f1b", "pp": 2, "splits": 3, "span_lengths": [4, 13, 7]},
        {"schedule": "gpipe", "pp": 2, "splits": 2},
        {"schedule": "interleaved-1f1b", "pp": 2, "chunks": 2},
        {"schedule": "seq1f1b-interleaved", "pp": 2, "chunks": 2, "splits": 3},
        {"schedule": "zb-h1", "pp": 2, "splits": 2},
        {"schedule": "seq1f1b-zb-h1", "pp": 2, "splits": 3},
        {"schedule": "megatron-1f1b", "pp": 2},
        {"schedule": "zbv", "pp": 2, "chunks": 2, "splits": 2, "untie_embeddings": True},
        {"schedule": "seq1f1b-zbv", "pp": 2, "chunks": 2, "splits": 3, "untie_embeddings": True},
        {"schedule": "seq1f1b-zb-auto", "pp": 2, "chunks": 2, "splits": 2,
         "untie_embeddings": True},
        # the search on a loop: one chunk per rank, and two with tied embeddings
        {"schedule": "seq1f1b-zb-auto", "pp": 2, "splits": 3, "num_microbatches": 5},
        {"schedule": "seq1f1b-zb-auto", "pp": 2, "chunks": 2, "splits": 2},
        {"schedule": "seq1f1b", "pp": 2, "splits": 3, **EARLY},
        {"schedule": "seq1f1b-zbv", "pp": 2, "chunks": 2, "splits": 3, "untie_embeddings": True,
         **EARLY},
        # searched with the costs of the loss's backward at F
        {"schedule": "seq1f1b-zb-auto", "pp": 2, "chunks": 2, "splits": 2,
         "untie_embeddings": True, **EARLY},
        {"schedule": "1f1b", "pp": 2, "prefetch_order": True}],
    4: [{"schedule": "seq1f1b", "pp": 4, "splits": 3, "num_microbatches": 5},
        {"schedule": "seq1f1b", "tp": 2, "pp": 2, "splits": 3, "sequence_parallel": True,
         "span_lengths": [6, 10, 8]},
        {"schedule": "seq1f1b-zb-h1", "tp": 2, "pp": 2, "splits": 2, "sequence_parallel": True},
        {"schedule": "seq1f1b-interleaved", "pp": 4, "chunks": 2, "splits": 3, **L8},
        {"schedule": "interleaved-1f1b", "tp": 2, "pp": 2, "chunks": 2},
        {"schedule": "seq1f1b-zbv", "tp": 2, "pp": 2, "chunks": 2, "splits": 3,
         "sequence_parallel": True, "span_lengths": [6, 10, 8], "untie_embeddings": True},
        {"schedule": "seq1f1b-zbv", "tp": 2, "pp": 2, "chunks": 2, "splits": 3,
         "sequence_parallel": True, "untie_embeddings": True, **EARLY},
        # placed with the model's costs under a cap, as the trainer and benchmark place it
        {"schedule": "seq1f1b-zb-auto", "tp": 2, "pp": 2, "chunks": 2, "splits": 3,
         "sequence_parallel": True, "untie_embeddings": True, "schedule_memory_cap": "0.75x"},
        *CP_CASES],
}
PARAMS = [(world, n) for world, cases in CASES.items() for n in range(len(cases))
          if not cases[n].get("prefetch_order")]


NO_PROMISES = {"pp": 2, "num_microbatches": 2, "splits": 3, "chunks": 2,
               "untie_embeddings": True}


def no_promises_order() -> Schedule:
    """A V order the greedy places keeping no promises (Policy.promises = "none": each allocation
    waits only until it fits) under 7B costs at Seq1F1B's peak, P = 2, m = 2, k = 3: shorter
    than, and other than, what the same policy places keeping promises at once or in turn. The
    search takes such orders where they are shorter; none of the registry cases above does."""
    shape = build("seq1f1b-zbv", 2, 2, 3, 2)
    costs = CostModel(model=preset("7b"), seq_length=65536, tp=8,
                      sequence_parallel=True).costs(shape)
    problem = Problem(2, 2, 3, 2, "vshape")
    placer, cap = Placer(problem, costs), default_cap(problem, costs)
    placed = {way: placer.place(cap, Policy(True, None, False, True, True, way))
              for way in ("at once", "in turn", "none")}
    assert all(placed["none"].makespan < placed[way].makespan for way in ("at once", "in turn"))
    return Schedule("no-promises", 2, 2, 3, 2, tuple(map(tuple, placed["none"].programs)),
                    "vshape")


SPREAD = [(2, (2, 4, 2, 1, "loop"), {}), (2, (2, 4, 2, 2, "vshape"), {}),
          (4, (2, 4, 2, 2, "vshape"), {"tp": 2, "sequence_parallel": True}),
          (4, (2, 2, 2, 1, "loop"), {"cp": 2})]
"""(world, (P, m, k, V, placement) of an order with O's on both ranks, other fields)."""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("no_promises")
    path = folder / "no_promises.csv"
    path.write_text(schedule_file.write(no_promises_order()))
    first = [("no_promises", {"pipeline_schedule_file": str(path), **NO_PROMISES})]
    extra = spread_cases(folder, SPREAD)
    extra[2] = first + extra.get(2, [])
    return run_worlds("p2p_record_worker.py", CASES, extra)


def test_cases_cover_every_registry_schedule_with_tp_and_sp():
    used = {case["schedule"] for cases in CASES.values() for case in cases}
    assert set(registry.names()) <= used
    assert any(case.get("sequence_parallel") for case in CASES[4])


@pytest.mark.parametrize("param", PARAMS, ids=[f"w{w}-{CASES[w][n]['schedule']}-{n}"
                                               for w, n in PARAMS])
def test_recorded_calls_finish_under_nccl_rules(results, param):
    world, n = param
    result = results[world][n]
    assert result["error"] is None, result["error"]
    assert result["passed"]                       # the run was exact, too
    assert result["groups"] > 0 and result["pipeline_groups"] == world // CASES[world][n]["pp"]
    assert result["problems"] == {"lazy": [], "eager": []}
    assert result["plan_equal"]


def test_an_order_placed_keeping_no_promises_finishes_under_nccl_rules(results):
    result = results["no_promises"]
    assert result["error"] is None, result["error"]
    assert result["case"].startswith("file:") and result["passed"]     # exact, too
    assert result["groups"] > 0 and result["pipeline_groups"] == 1
    assert result["problems"] == {"lazy": [], "eager": []}
    assert result["plan_equal"]


@pytest.mark.parametrize("n", range(len(SPREAD)))
def test_orders_with_the_output_layer_spread_finish_under_nccl_rules(results, n):
    world, _, fields = SPREAD[n]
    result = results[("spread", n)]
    assert result["error"] is None, result["error"]
    assert result["case"].startswith("file:") and result["passed"]     # exact, too
    assert result["groups"] > 0 and result["pipeline_groups"] == world // 2
    assert result["problems"] == {"lazy": [], "eager": []}
    assert result["plan_equal"]
    if fields.get("cp"):
        assert result["cp_same_order"]
        assert result["global_problems"] == {"lazy": [], "eager": []}


def test_the_old_order_passes_on_gloo_and_its_recorded_calls_deadlock(results):
    (result,) = [r for r, case in zip(results[2], CASES[2]) if case.get("prefetch_order")]
    assert result["error"] is None and result["passed"]          # gloo forgives
    assert not result["plan_equal"]
    for mode in ("lazy", "eager"):
        (problem,) = result["problems"][mode]
        assert problem.startswith("deadlock among ranks 0, 1: ")
        assert "recv float32 [24, 2, 32] from rank 1" in problem


@pytest.mark.parametrize("n", range(len(CP_CASES)), ids=[c["schedule"] for c in CP_CASES])
def test_cp_ranks_issue_the_same_collectives_and_no_cross_communicator_order_hangs(results, n):
    case = CP_CASES[n]
    result = results[4][CASES[4].index(case)]
    assert result["error"] is None and result["passed"]
    assert result["cp_same_order"]
    # per rank: four all-to-alls per layer and span each way; on the last stage one all-reduce
    # of each micro-batch's token count, and everywhere the equivalence run's loss reduction
    layers, microbatches = 4 // case["pp"], 4
    all_to_alls = 8 * layers * microbatches * case["splits"]
    counts = sorted(result["cp_collectives"].values())
    assert counts == [[all_to_alls + 1] * 2, [all_to_alls + 1 + microbatches] * 2]
    assert result["cp_kinds"] == ["all_reduce", "all_to_all_single"]
    assert result["global_problems"] == {"lazy": [], "eager": []}
