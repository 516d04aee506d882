"""The layout planner (seq1f1b/plan/tune, plan.py tune): its compiled replays agree with the
simulator, its winner is the best of an exhaustive evaluation, its memory verdicts are plan.py
memory's, and its flags pass the trainer's validation."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.schedule_budget import schedule_budget
from seq1f1b.plan import registry
from seq1f1b.plan.actions import ScheduleError
from seq1f1b.plan.budget import MemoryCap
from seq1f1b.plan.costs import ModelConfig
from seq1f1b.plan.memory import TrainingSetup, estimate_memory
from seq1f1b.plan.projection import A100, project, pipeline_costs
from seq1f1b.plan.simulate import simulate
from seq1f1b.plan.tune.devices import resolve_gpu
from seq1f1b.plan.tune.held import HeldProfile
from seq1f1b.plan.tune.launch import pretrain_flags, sbatch_script
from seq1f1b.plan.tune.replay import CompiledSchedule
from seq1f1b.plan.tune.search import layout_name, tune
from seq1f1b.plan.tune import searched
from seq1f1b.plan.tune.searched import search_top, searched_twin
from seq1f1b.plan.tune.space import Query, candidates, default_schedules

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plan.py"
sys.path.insert(0, str(TOOL.parent))
import plan  # noqa: E402

TINY = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                   ffn_hidden_size=512, vocab_size=1000, swiglu=True, normalization="RMSNorm",
                   add_bias_linear=False)
TINY_FLAGS = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
              "--num-query-groups", "4", "--ffn-hidden-size", "512", "--vocab-size", "1000",
              "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear"]
QUERY = Query(TINY, seq_length=8192, gpus=8, gpus_per_node=4, global_batch_size=8,
              max_splits=4, min_span=1024, chunks=(2,))
SMALL = replace(QUERY, gpus=4, global_batch_size=8, max_splits=2, partitions=("compute",))
"""The exhaustive evaluation's case: 4 GPUs, every schedule, k <= 2, all recomputes."""


@pytest.mark.parametrize("name", default_schedules())
def test_compiled_replay_and_held_profile_are_the_simulators(name):
    info = registry.get(name)
    setup = TrainingSetup(model=TINY, seq_length=8192, schedule=name, pp=4, microbatches=8,
                          splits=4 if name.startswith("seq1f1b") else 1,
                          chunks=2 if info.chunked else 1, tp=2, dp=1, cp=2,
                          sequence_parallel=True, distributed_optimizer=True,
                          partition="compute" if name.startswith("seq1f1b") else "even",
                          recompute_granularity="selective")
    schedule = registry.build(name, setup.pp, setup.microbatches, setup.splits, setup.chunks)
    costs = pipeline_costs(setup, A100, schedule)
    reference = simulate(schedule, costs)
    fast = CompiledSchedule.of(schedule).simulate(costs)
    assert fast.makespan == reference.makespan
    assert fast.bubble_ratio == pytest.approx(reference.bubble_ratio, rel=1e-12, abs=1e-15)
    exact = estimate_memory(setup)
    held = HeldProfile.of(schedule)
    quick = estimate_memory(setup, held_peaks=lambda _, costs: held.peaks(costs),
                            schedule=schedule)
    for a, b in zip(exact.stages, quick.stages):
        assert b.total_bytes == pytest.approx(a.total_bytes, rel=1e-12)
        assert b.peak_live_spans == a.peak_live_spans


def _exhaustive(query, gpu):
    """Every candidate judged and projected the plain way: (iteration s, layout) that fit, and
    with the query's "both", the twin with the loss's backward at F of each that does not."""
    fitting = []
    for setup in candidates(query):
        for candidate in (setup, replace(setup, loss_backward_in_forward=True)):
            try:
                estimate = estimate_memory(candidate)
            except ScheduleError:   # refused by its schedule: the planner skips it too
                break
            if estimate.fits(gpu.memory_gib):
                fitting.append((project(candidate, gpu.device).iteration_s,
                                layout_name(candidate)))
                break
            if query.loss_backward_in_forward != "both":
                break
    return sorted(fitting)


def test_winner_is_the_best_of_an_exhaustive_evaluation():
    gpu = resolve_gpu("a100", gpus_per_node=SMALL.gpus_per_node)
    # a memory limit just under the fastest layout's peak: pruning by memory decides the winner
    fastest = min(candidates(SMALL), key=lambda s: project(s, gpu.device).iteration_s)
    limit = replace(gpu, memory_gib=0.999 * estimate_memory(fastest).peak_bytes / 2 ** 30)
    expected = _exhaustive(SMALL, limit)
    result = tune(SMALL, limit, top=5)
    assert result.counts.oom > 0 and result.counts.projected < len(expected)
    assert [r.projection.iteration_s for r in result.ranked] == pytest.approx(
        [seconds for seconds, _ in expected[:5]], rel=1e-12)
    if expected[1][0] > expected[0][0] * (1 + 1e-9):        # no tie for first place
        assert result.ranked[0].name == expected[0][1]


def test_the_loss_backward_in_forward_is_chosen_where_only_it_makes_the_fastest_layout_fit():
    gpu = resolve_gpu("a100", gpus_per_node=SMALL.gpus_per_node)
    fastest = min(candidates(SMALL), key=lambda s: project(s, gpu.device).iteration_s)
    twin = replace(fastest, loss_backward_in_forward=True)
    stock, early = estimate_memory(fastest).peak_bytes, estimate_memory(twin).peak_bytes
    assert early < stock
    limit = replace(gpu, memory_gib=(stock + early) / 2 / 2 ** 30)
    result = tune(SMALL, limit, top=3)
    assert result.ranked[0].name == layout_name(twin) and layout_name(twin).endswith(" loss@F")
    without = tune(replace(SMALL, loss_backward_in_forward="no"), limit, top=3)
    assert not any(row.setup.loss_backward_in_forward for row in without.ranked)
    assert without.ranked[0].projection.iteration_s > result.ranked[0].projection.iteration_s
    # its pipelined layout is searched too, with the output layer kept (an O would run it)
    pipelined = next(row for row in result.ranked
                     if row.setup.pp > 1 and row.setup.loss_backward_in_forward)
    searched_early = searched_twin(pipelined, limit)
    assert searched_early.setup.loss_backward_in_forward and not searched_early.setup.spread_output
    # where the layout fits without the flag, it is listed without
    roomy = tune(SMALL, gpu, top=3)
    assert roomy.ranked[0].name == layout_name(fastest)
    args = validate_args(parse_args(pretrain_flags(twin, SMALL.global_batch_size)), SMALL.gpus)
    assert args.loss_backward_in_forward


def _memory_argv(setup, gpu_memory):
    argv = ["memory", *TINY_FLAGS, "--schedule", setup.schedule, "--pp", str(setup.pp),
            "--microbatches", str(setup.microbatches), "--splits", str(setup.splits),
            "--chunks", str(setup.chunks), "--tp", str(setup.tp), "--cp", str(setup.cp),
            "--dp", str(setup.dp), "--seq-length", str(setup.seq_length),
            "--partition", setup.partition, "--distributed-optimizer",
            "--gpu-memory", str(gpu_memory), "--json"]
    if setup.sequence_parallel:
        argv.append("--sequence-parallel")
    if setup.recompute_granularity:
        argv += ["--recompute-granularity", setup.recompute_granularity]
    if setup.decoder_first_pipeline_num_layers:
        argv += ["--decoder-first-pipeline-num-layers",
                 str(setup.decoder_first_pipeline_num_layers)]
    if setup.decoder_last_pipeline_num_layers:
        argv += ["--decoder-last-pipeline-num-layers",
                 str(setup.decoder_last_pipeline_num_layers)]
    if setup.loss_backward_in_forward:
        argv.append("--loss-backward-in-forward")
    if setup.schedule_memory_cap:
        argv += ["--schedule-memory-cap", setup.schedule_memory_cap]
    if setup.spread_output:
        argv.append("--spread-output")
    return argv


def test_memory_verdicts_are_plan_memory_s(capsys):
    gpu = resolve_gpu("a100", 3.0, gpus_per_node=4)
    result = tune(QUERY, gpu, top=3)
    rows = result.ranked + [r for r in tune(replace(QUERY, recomputes=("full",)), gpu, 2).ranked]
    rows += tune(replace(QUERY, loss_backward_in_forward="yes"), gpu, 1).ranked
    assert rows[-1].setup.loss_backward_in_forward
    assert rows
    for row in rows:
        assert plan.main(_memory_argv(row.setup, gpu.memory_gib)) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["peak_bytes"] == pytest.approx(row.estimate.peak_bytes, rel=1e-12)
        assert [s["total_bytes"] for s in shown["stages"]] == pytest.approx(
            [s.total_bytes for s in row.estimate.stages], rel=1e-12)
        assert shown["oom"] is False


WINNERS = [
    QUERY,
    replace(QUERY, schedules=("seq1f1b-interleaved",), recomputes=("full",)),
    replace(QUERY, schedules=("seq1f1b-zbv",), recomputes=("selective",)),
]


@pytest.mark.parametrize("query", WINNERS, ids=["any", "interleaved-full", "zbv-selective"])
def test_winner_flags_pass_the_trainers_validation(query, tmp_path):
    result = tune(query, resolve_gpu("a100", gpus_per_node=4), top=1)
    setup = result.ranked[0].setup
    args = validate_args(parse_args(pretrain_flags(setup, query.global_batch_size)),
                         query.gpus)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size, args.data_parallel_size) == (
        setup.tp, setup.pp, setup.cp, setup.dp)
    assert args.num_micro_batches == setup.microbatches
    assert args.pipeline_schedule == setup.schedule and args.seq1f1b_splits == setup.splits
    script = tmp_path / "run.sbatch"
    script.write_text(sbatch_script(setup, query.gpus, query.gpus_per_node, "test"))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # the layout as launch_pretrain.sh reads it: its DP (world / TP x PP x CP) and global batch
    settings = "\n".join(line for line in script.read_text().splitlines()
                         if line.startswith(": "))
    batch = subprocess.run(["bash", "-c", settings + f"\necho $(( MICRO_BATCHES * {query.gpus}"
                            " / (TP * PP * CP) * MICRO_BATCH )) $CP"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert batch == [str(query.global_batch_size), str(setup.cp)]


def test_the_searched_schedule_on_the_top_layouts_is_the_trainers_order_and_fits(monkeypatch,
                                                                                 capsys):
    """The twins are searched with the output layer kept or spread (--spread-output): here the
    first keeps it and the last spreads it, pretrain_gpt.py builds each one's order from its
    flags, and plan.py memory given them estimates the same bytes. Where the spread order does not fit the GPU, the twin keeps the layer, searched
    without the flag, and the trainer builds that order too."""
    # V layouts on two and four ranks between one-rank ones, which are not searched
    query = replace(QUERY, schedules=("seq1f1b-zbv", "zbv", "seq1f1b-zb-h1", "seq1f1b"))
    gpu = resolve_gpu("a100", 3.0, gpus_per_node=4)
    result = tune(query, gpu, top=4)
    search_top(result, 4)
    assert list(result.searched) == [0, 1, 2, 3]
    twins = {i: twin for i, twin in result.searched.items() if twin is not None}
    assert {result.ranked[i].setup.pp for i in twins} == {2, 4}
    assert {result.ranked[i].setup.chunks for i in twins} == {2}
    assert [twins[i].projection.schedule.spread_output for i in (0, 3)] == [False, True]
    for index, twin in twins.items():
        listed = result.ranked[index]
        assert twin.setup == replace(listed.setup, schedule="seq1f1b-zb-auto",
                                     schedule_memory_cap=twin.setup.schedule_memory_cap,
                                     spread_output=twin.setup.spread_output)
        cap = MemoryCap.parse(twin.setup.schedule_memory_cap)
        assert not cap.relative and cap.value <= listed.estimate.held_room(gpu.memory_gib,
                                                                     gpu.reserve_ratio)
        assert all(stage.held_for_backward_bytes <= cap.value for stage in twin.estimate.stages)
        assert twin.estimate.fits(gpu.memory_gib, gpu.reserve_ratio)
        assert twin.estimate.peak_bytes == pytest.approx(
            estimate_memory(twin.setup).peak_bytes, rel=1e-12)
        assert plan.main(_memory_argv(twin.setup, gpu.memory_gib)) == 0
        shown = json.loads(capsys.readouterr().out)
        assert [s["total_bytes"] for s in shown["stages"]] == pytest.approx(
            [s.total_bytes for s in twin.estimate.stages], rel=1e-12)
        _trainer_builds_the_twins_order(twin, query)
    for index in set(result.searched) - set(twins):
        assert result.ranked[index].setup.pp == 1
    # here the search beats the listed zbv on its own layout, and so wins
    assert result.winner is twins[0]
    assert twins[0].projection.iteration_s < result.ranked[0].projection.iteration_s
    # a GPU that leaves the layout no room for held bytes: nothing to search under
    assert searched_twin(result.ranked[0], replace(gpu, memory_gib=1.0)) is None
    # the spread order judged out of memory (its copies of the layer beside the weights)
    judged = searched._judged

    def spread_out_of_memory(setup, gpu):
        found, schedule = judged(setup, gpu)
        return (None if schedule.spread_output else found), schedule
    monkeypatch.setattr(searched, "_judged", spread_out_of_memory)
    kept = searched_twin(result.ranked[3], gpu)
    assert not kept.setup.spread_output and not kept.projection.schedule.spread_output
    assert "--spread-output" not in pretrain_flags(kept.setup, query.global_batch_size)
    _trainer_builds_the_twins_order(kept, query)


def _trainer_builds_the_twins_order(twin, query):
    """pretrain_gpt.py, given the twin's flags, searches the same order."""
    args = validate_args(parse_args(pretrain_flags(twin.setup, query.global_batch_size)),
                         query.gpus)
    schedule = twin.projection.schedule
    assert args.pipeline_placement == schedule.placement
    assert args.spread_output == twin.setup.spread_output
    built = registry.build("seq1f1b-zb-auto", args.pipeline_model_parallel_size,
                           args.num_micro_batches, args.seq1f1b_splits,
                           args.virtual_pipeline_model_parallel_size or 1,
                           budget=schedule_budget(args))
    assert built.programs == schedule.programs


def test_only_a_searched_schedule_spreads_the_output_layer():
    with pytest.raises(ScheduleError, match="--spread-output: seq1f1b is not searched"):
        TrainingSetup(TINY, 8192, schedule="seq1f1b", pp=2, splits=2, spread_output=True)


def test_uneven_stages_and_cp_reach_the_flags():
    found = {(s.cp > 1, s.stage_layers.uneven) for s in candidates(QUERY)}
    assert (True, True) in found
    setup = next(s for s in candidates(QUERY) if s.cp > 1 and s.stage_layers.uneven
                 and s.chunks == 1)
    args = validate_args(parse_args(pretrain_flags(setup, QUERY.global_batch_size)), 8)
    assert args.context_parallel_size == setup.cp
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (
        setup.decoder_first_pipeline_num_layers, setup.decoder_last_pipeline_num_layers)


TUNE = ["tune", *TINY_FLAGS, "--seq-length", "8192", "--gpus", "8", "--gpus-per-node", "4",
        "--global-batch-size", "8", "--max-splits", "4"]


def test_cli_json_top_and_sbatch(tmp_path, capsys):
    out = tmp_path / "tuned.sbatch"
    assert plan.main(TUNE + ["--top", "2", "--json", "--emit-sbatch", str(out),
                             "--gpu-memory", "80GiB"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown["layouts"]) == 2 and shown["gpu"]["memory_gib"] == 80
    assert shown["winner_flags"][:2] == ["--num-layers", "8"]
    # seq1f1b-zb-auto on the top 3 (the default): each beside the listed layout it searched
    assert [row["on_layout"] for row in shown["searched"]] == [1, 2]
    assert all(row["why"].startswith("one pipeline rank") for row in shown["searched"]
               if shown["layouts"][row["on_layout"] - 1]["pp"] == 1)
    fastest = min([shown["layouts"][0]] + [row for row in shown["searched"] if row["layout"]],
                  key=lambda row: row["iteration_s"])
    assert shown["winner"] == fastest["layout"]
    assert (fastest.get("schedule_memory_cap") is not None) == (
        "--schedule-memory-cap" in shown["winner_flags"])
    assert "launch_pretrain.sh" in out.read_text()
    # the query as searched: every knob, defaults included
    assert {key: shown["query"][key] for key in (
        "max_splits", "min_span", "chunks", "partitions", "recomputes", "uneven",
        "loss_backward_in_forward")} == {
        "max_splits": 4, "min_span": 1024, "chunks": [2, 4], "partitions": ["even", "compute"],
        "recomputes": ["none", "selective", "full"], "uneven": True,
        "loss_backward_in_forward": "both"}


@pytest.mark.parametrize("extra, message", [
    (["--gpus", "0"], "--gpus"),
    (["--gpu-memory", "lots"], "--gpu-memory"),
    (["--gpu", "nowhere.json"], "--gpu"),
    (["--schedules", "bogus"], "--schedule"),
    (["--partitions", "odd"], "--partitions"),
    (["--recompute", "half"], "--recompute"),
    (["--top", "0"], "--top"),
    (["--searched", "-1"], "--searched"),
    (["--gpus", "6"], "--gpus"),
    (["--emit-sbatch", "/nonexistent/dir/x.sbatch"], "--emit-sbatch"),
])
def test_bad_input_is_one_line_and_exit_2(extra, message, capsys):
    assert plan.main(TUNE + extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_bad_input_without_a_model_exits_2(capsys):
    assert plan.main(["tune", "--seq-length", "8192", "--gpus", "8"]) == 2
    assert "model" in capsys.readouterr().err


def test_gpu_from_a_device_check_judges_reserved_bytes(tmp_path):
    from test_calibration import _device_check, _spans
    path = _device_check(tmp_path, _spans(0.5, 0.3), ratios=(1.05, 1.2, 1.1))
    gpu = resolve_gpu(str(path), 80.0, gpus_per_node=4)
    assert gpu.reserve_ratio == pytest.approx(1.2)
    assert gpu.device.peak_tflops == 989.0 and gpu.device.gemm.saturated == pytest.approx(0.5)
    result = tune(QUERY, gpu, top=1)
    row = result.ranked[0]
    assert row.estimate.reserved_peak_bytes(1.2) <= 80.0 * 2 ** 30
    assert row.projection.device == gpu.device
