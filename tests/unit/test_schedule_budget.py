"""The searched schedule the trainer places from its flags (megatron/training/schedule_budget.py,
seq1f1b/plan/budget.py's run_budget): valid and within NCCL's rules on a grid of shapes, caps and
measured fits, and the measured durations are the fit's."""
import itertools

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.schedule_budget import cost_model, schedule_budget, starting_span_lengths
from seq1f1b.plan import registry
from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.budget import MemoryCap, RunShape, run_budget
from seq1f1b.plan.communication import communication_plan
from seq1f1b.plan.costs import ModelConfig
from seq1f1b.plan.memory import TrainingSetup, plan_schedule
from seq1f1b.plan.nccl import validate_modes
from seq1f1b.plan.partition import span_bounds
from seq1f1b.plan.simulate import model_costs, simulate
from seq1f1b.plan.span_fit import OpFit, SpanTimeFit
from seq1f1b.plan.validate import validate

FIT = SpanTimeFit(OpFit(2e-5, 3e-8), OpFit(7e-5, 1e-7), 0.05, 8)
"""A measured fit whose backward costs 3.5x the forward (a CPU's proportions, not a GPU's)."""


def _args(pp: int, microbatches: int, splits: int, cap: str, cp: int = 1,
          extra: tuple[str, ...] = ()):
    layers = 2 * pp
    return validate_args(parse_args([
        "--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size",
        str(microbatches), "--train-iters", "10", "--lr", "1e-3", "--mock-data",
        "--pipeline-model-parallel-size", str(pp), "--num-layers-per-virtual-pipeline-stage",
        "1", "--untie-embeddings-and-output-weights", "--pipeline-schedule", "seq1f1b-zb-auto",
        "--seq1f1b-splits", str(splits), "--schedule-memory-cap", cap,
        "--context-parallel-size", str(cp), *extra]), pp * cp)


@pytest.mark.parametrize("pp, m, k, cap, fitted", [
    (pp, m, k, cap, fitted) for pp, m, k, cap, fitted in itertools.product(
        (2, 4), (4, 8), (1, 2, 4), ("0.75x", "1x"), (False, True))])
def test_the_trainers_searched_schedule_is_valid_and_passes_the_nccl_rules(pp, m, k, cap,
                                                                         fitted):
    args = _args(pp, m, k, cap)
    lengths = starting_span_lengths(args)
    budget = schedule_budget(args, lengths, FIT if fitted else None)
    schedule = registry.build("seq1f1b-zb-auto", pp, m, k, 2, budget=budget)
    validate(schedule)
    assert all(verdict.ok for verdict in validate_modes(communication_plan(schedule)).values())
    report = simulate(schedule, budget.costs)
    assert max(rank.peak_held_bytes for rank in report.ranks) <= budget.cap * (1 + 1e-9)


def test_measured_durations_are_the_fits_spread_over_the_stages_as_the_model_spreads_them():
    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=512)
    lengths = (96, 64, 48, 48)
    shape = RunShape(model, 256, lengths, bytes_per_element=4)
    modelled = run_budget("seq1f1b-zb-auto", 4, 8, 2, MemoryCap(1.0, True), shape).costs
    measured = run_budget("seq1f1b-zb-auto", 4, 8, 2, MemoryCap(1.0, True), shape, FIT).costs
    stages = range(8)
    for span, (start, end) in enumerate(span_bounds(list(lengths))):
        forward, backward = FIT.span_seconds(start, end)
        assert sum(measured.forward[v][span] for v in stages) == pytest.approx(forward)
        assert sum(measured.backward[v][span] + measured.weight[v][span]
                   for v in stages) == pytest.approx(backward)
        # the last stage (output layer) keeps its larger share
        assert measured.forward[7][span] / measured.forward[0][span] == pytest.approx(
            modelled.forward[7][span] / modelled.forward[0][span])
    assert measured.activation_bytes == modelled.activation_bytes     # bytes stay the model's


def test_measured_durations_with_the_output_layer_spread_sum_to_the_fits():
    """With --spread-output the fit's times price each span's O too: it counts a third to the
    span's F and two thirds to its B (as simulate.span_timings folds a measured O), so it is
    scaled a third by the span's forward factor and two thirds by its backward one, and the
    span's F, B, W and O sum to its fitted F + B; its bytes stay the model's."""
    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=4096)
    lengths = (96, 64, 48, 48)
    shape = RunShape(model, 256, lengths, bytes_per_element=4, spread_output=True)
    budget = run_budget("seq1f1b-zb-auto", 4, 8, 2, MemoryCap(1.0, True), shape, FIT)
    spread = [costs for _, costs in budget.options(restricted=False)
              if costs.output is not None]
    modelled = [costs for _, costs in run_budget(
        "seq1f1b-zb-auto", 4, 8, 2, MemoryCap(1.0, True), shape).options(restricted=False)
                if costs.output is not None]
    assert len(spread) == len(modelled) == 2           # a V and a loop, each spread
    stages = range(8)
    for measured, model_costs in zip(spread, modelled):
        for span, (start, end) in enumerate(span_bounds(list(lengths))):
            forward, backward = FIT.span_seconds(start, end)
            assert sum(measured.forward[v][span] + measured.backward[v][span]
                       + measured.weight[v][span] for v in stages) \
                + measured.output[span] == pytest.approx(forward + backward)
            # scaled a third by the span's forward factor, two thirds by its backward one
            f_scale = measured.forward[0][span] / model_costs.forward[0][span]
            b_scale = measured.backward[0][span] / model_costs.backward[0][span]
            assert f_scale != pytest.approx(b_scale)
            assert measured.output[span] == pytest.approx(
                model_costs.output[span] * (f_scale + 2 * b_scale) / 3)
        assert measured.output_bytes == model_costs.output_bytes


def test_without_a_cap_the_search_still_takes_the_models_costs():
    """Issue 26: the searched schedule runs on the model's costs whenever they are known; the
    cap is then the schedule's default (seq1f1b-zbv's peak on those costs)."""
    args = _args(2, 4, 2, "1x")
    capped = schedule_budget(args)
    args.schedule_memory_cap = None
    budget = schedule_budget(args)
    assert budget is not None and budget.cap is None
    assert budget.costs == capped.costs
    args.pipeline_schedule = "seq1f1b"
    assert schedule_budget(args) is None          # not searched: nothing to place


@pytest.mark.parametrize("pp, m, k, chunks", [(1, 1, 1, 1), (2, 3, 2, 1), (4, 8, 4, 1),
                                              (2, 1, 1, 2), (3, 5, 3, 2), (4, 8, 2, 2)])
def test_a_searched_schedules_shape_prices_like_its_order(pp, m, k, chunks):
    """The budget prices the searched schedule from registry.shape (a construction, no search):
    the same placement, backward split and model costs as the searched order of those sizes,
    and refused where that order is (a fourth chunk)."""
    model = ModelConfig(num_layers=4 * pp, hidden_size=64, num_attention_heads=4,
                        ffn_hidden_size=256, vocab_size=128)
    lengths = [64 // k] * k
    searched = registry.build("seq1f1b-zb-auto", pp, m, k, chunks)
    shape = registry.shape("seq1f1b-zb-auto", pp, m, k, chunks)
    assert (shape.placement, shape.split_backward) == (searched.placement, True)
    assert searched.split_backward
    assert model_costs(shape, model, lengths, flops_per_second=1e12) == \
        model_costs(searched, model, lengths, flops_per_second=1e12)
    with pytest.raises(ScheduleError, match="--chunks"):
        registry.shape("seq1f1b-zb-auto", pp, m, k, 3)


def test_under_context_parallelism_the_budget_counts_one_gpus_bytes():
    """A cap in bytes is per GPU, and under CP 2 a GPU holds half of every span's activations:
    the trainer's budget counts that share, not the whole span's."""
    alone, shared = schedule_budget(_args(2, 4, 2, "1x")), schedule_budget(_args(2, 4, 2, "1x", 2))
    assert shared.costs.activation_bytes[0][0] == pytest.approx(
        alone.costs.activation_bytes[0][0] / 2)


@pytest.mark.parametrize("pp, m, k, cap", [(2, 4, 2, "1x"), (4, 8, 1, "0.75x"), (4, 8, 4, "1x"),
                                           (4, 4, 1, "0.9x"), (2, 8, 4, "0.75x")])
def test_the_estimator_prices_the_order_the_trainer_searches(pp, m, k, cap):
    """plan.py memory, the planner and the projection build a searched schedule from a
    TrainingSetup (memory.plan_schedule); the trainer from its flags. Both must find the same
    order: the search's ties break by floating-point rounding, so both compute durations at
    one rate (budget.NOMINAL_FLOPS_PER_SECOND)."""
    args = _args(pp, m, k, cap)
    trainer = registry.build("seq1f1b-zb-auto", pp, m, k, 2, budget=schedule_budget(args))
    setup = TrainingSetup(cost_model(args), 256, schedule="seq1f1b-zb-auto", pp=pp,
                          microbatches=m, splits=k, chunks=2, precision="fp32",
                          partition=args.seq1f1b_partition, schedule_memory_cap=cap)
    assert starting_span_lengths(args) == tuple(setup.spans())
    estimated = plan_schedule(setup)
    assert (estimated.placement, estimated.programs) == (trainer.placement, trainer.programs)


def test_the_rank_that_logs_says_how_far_a_long_search_is(capsys, monkeypatch):
    """The trainer's search at start-up (validate_args) reports its stages on the last rank,
    the one that logs, once it has run for QUIET_SECONDS (here at once), after the line that
    says where it searches; the other ranks search in silence."""
    from seq1f1b.plan import search_progress
    monkeypatch.setattr(search_progress, "QUIET_SECONDS", 0.0)
    said = {}
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        registry._searched.cache_clear()      # searched again, not read from the last run
        _args(2, 4, 2, "1x")
        said[rank] = [line for line in capsys.readouterr().out.splitlines()
                      if line.startswith(" seq1f1b-zb-auto")]
    assert said["1"][0].startswith(" seq1f1b-zb-auto: searching orders of F, B and W for P=2 "
                                   "m=4 k=2 on a V and a loop of 2 chunks per rank"), said["1"]
    assert any("on a V: refined, makespan" in line for line in said["1"][1:])
    assert said["0"] == []
    # --search-layout's candidates say their makespans there too (8 layers on 4 stages: the
    # even split and six of its neighbours)
    monkeypatch.setenv("RANK", "1")
    registry._searched.cache_clear()
    _args(2, 4, 2, "1x", extra=("--num-layers", "8", "--num-layers-per-virtual-pipeline-stage",
                                "2", "--search-layout"))
    tried = [line.split(" (")[0] for line in capsys.readouterr().out.splitlines()
             if line.startswith(" --search-layout: layout ")]
    assert tried == [f" --search-layout: layout {n} of 7" for n in range(1, 8)], tried
