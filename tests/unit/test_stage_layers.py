"""Uneven first / last stages (seq1f1b/plan/stage_layers.py): on a loop the counts and layer
offsets are megatron-core's own (num_layers_in_first/last_pipeline_stage), on a V they are the
ones the V's layout builds; the cost model, the estimator and the projection count each stage's
own layers; bad counts are refused in one line naming the flag."""
import itertools
import re

import pytest

from megatron.core import parallel_state
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.training import arguments
from megatron.training.arguments import ArgumentError, parse_args, validate_args
from seq1f1b import megatron_adapter
from seq1f1b.plan import registry
from seq1f1b.plan.actions import ScheduleError, virtual_stage
from seq1f1b.plan.costs import ModelConfig, preset
from seq1f1b.plan.memory import TrainingSetup, estimate_memory
from seq1f1b.plan.projection import project
from seq1f1b.plan.simulate import model_costs
from seq1f1b.plan.bounds import lower_bound
from seq1f1b.plan.budget import ScheduleBudget
from seq1f1b.plan.layout_search import LAYOUT_TRIES, choose_layout, near_even
from seq1f1b.plan.simulate import simulate
from seq1f1b.plan.stage_layers import EVEN, StageLayers, layers_per_virtual_stage, parse_layout


def _config(num_layers, pp, chunks, placement, split):
    return megatron_adapter.make_transformer_config(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        placement=placement, stage_layers=split)


LOOP_GRID = [  # (layers, P, V, first, last)
    (8, 2, 1, 2, None), (8, 2, 1, None, 3), (8, 2, 1, 3, 5), (9, 3, 1, 1, 2), (10, 4, 1, 1, None),
    (8, 4, 1, 2, 2), (10, 4, 1, None, 1), (8, 2, 2, 2, None), (12, 2, 2, None, 4),
    (16, 4, 2, 2, 2), (14, 4, 2, 2, None)]


@pytest.mark.parametrize("num_layers, pp, chunks, first, last", LOOP_GRID)
def test_a_loop_deals_layers_as_megatron_core_does(num_layers, pp, chunks, first, last):
    split = StageLayers(first, last)
    counts = layers_per_virtual_stage(num_layers, pp, chunks, "loop", split)
    assert sum(counts) == num_layers and min(counts) >= 1
    config = _config(num_layers, pp, chunks, "loop", split)
    for rank, chunk in itertools.product(range(pp), range(chunks)):
        vp = chunk if chunks > 1 else None
        stage = virtual_stage("loop", pp, rank, chunk)
        assert get_num_layers_to_build(config, vp_stage=vp, pp_rank=rank) == counts[stage]
        assert get_transformer_layer_offset(config, vp_stage=vp, pp_rank=rank) == \
            sum(counts[:stage])


@pytest.mark.parametrize("num_layers, pp, first, last, expected", [
    (6, 2, 2, 2, (2, 1, 1, 2)), (8, 2, None, 2, (2, 2, 2, 2)), (10, 2, 1, None, (1, 3, 3, 3)),
    (32, 4, 1, 1, (1, 5, 5, 5, 5, 5, 5, 1)), (14, 4, 4, 4, (4, 1, 1, 1, 1, 1, 1, 4))])
def test_a_v_gives_the_counts_to_the_embedding_and_output_layer_stages(num_layers, pp, first,
                                                                        last, expected):
    split = StageLayers(first, last)
    assert layers_per_virtual_stage(num_layers, pp, 2, "vshape", split) == expected
    config = _config(num_layers, pp, 2, "vshape", split)
    layout = config.pipeline_model_parallel_layout
    for rank, chunk in itertools.product(range(pp), range(2)):
        stage = virtual_stage("vshape", pp, rank, chunk)
        assert layout.get_layer_offset(vp_stage=chunk, pp_rank=rank) == sum(expected[:stage])
        assert layout.layout[rank][chunk].count(layout.flatten_layout[0].__class__.decoder) == \
            expected[stage]


@pytest.mark.parametrize("num_layers, pp, chunks, placement, split, flag", [
    (8, 2, 1, "loop", StageLayers(0, None), "--decoder-first-pipeline-num-layers must be"),
    (8, 2, 1, "loop", StageLayers(None, 8), "leave 0 layers, which do not divide into 1"),
    (8, 3, 1, "loop", StageLayers(1, None), "leave 7 layers, which do not divide into 2"),
    (8, 2, 2, "loop", StageLayers(3, None), "--decoder-first-pipeline-num-layers 3 is not "
                                            "divisible by the 2 model chunks"),
    (8, 2, 1, "loop", StageLayers(2, 6), None),
    (8, 2, 1, "loop", StageLayers(3, 6), "leave -1 layers but no other"),
    (8, 2, 2, "vshape", StageLayers(1, 2), "leave 5 layers, which do not divide into 2 virtual "
                                           "stages"),
    (8, 1, 1, "loop", StageLayers(1, None), "need a pipeline of >= 2 ranks"),
])
def test_counts_that_cannot_be_dealt_are_refused_naming_the_flag(num_layers, pp, chunks,
                                                                 placement, split, flag):
    if flag is None:
        assert layers_per_virtual_stage(num_layers, pp, chunks, placement, split) == (2, 6)
        return
    with pytest.raises(ScheduleError) as err:
        layers_per_virtual_stage(num_layers, pp, chunks, placement, split)
    assert flag in str(err.value) and "--decoder-" in str(err.value), str(err.value)


def test_the_cost_model_estimator_and_projection_count_each_stages_layers():
    model = preset("7b")            # 32 layers
    schedule = registry.build("seq1f1b-zbv", 4, 8, 4, 2)
    split = StageLayers(1, 1)
    spans = [16384] * 4
    even = model_costs(schedule, model, spans, flops_per_second=1e12)
    uneven = model_costs(schedule, model, spans, flops_per_second=1e12, stage_layers=split)
    # stage 0: 1 layer instead of 4; a middle stage: 5 instead of 4
    assert uneven.forward[0][2] == pytest.approx(even.forward[0][2] / 4)
    assert uneven.forward[3][2] == pytest.approx(even.forward[3][2] * 5 / 4)
    assert uneven.activation_bytes[0][0] == pytest.approx(even.activation_bytes[0][0] / 4)
    assert uneven.kv_cache_bytes[7][0] == pytest.approx(even.kv_cache_bytes[7][0] / 4)
    setup = dict(model=model, seq_length=65536, schedule="seq1f1b-zbv", pp=4, microbatches=8,
                 splits=4, chunks=2, tp=8, sequence_parallel=True)
    plain = estimate_memory(TrainingSetup(**setup))
    lighter = estimate_memory(TrainingSetup(**setup, decoder_first_pipeline_num_layers=1,
                                            decoder_last_pipeline_num_layers=1))
    assert lighter.stages[0].parameters < plain.stages[0].parameters
    assert lighter.stages[1].parameters > plain.stages[1].parameters
    assert lighter.stages[0].activation_bytes < plain.stages[0].activation_bytes
    assert project(TrainingSetup(**setup, decoder_first_pipeline_num_layers=1,
                                 decoder_last_pipeline_num_layers=1)).report.ranks[0].busy < \
        project(TrainingSetup(**setup)).report.ranks[0].busy


def _flags(*extra):
    return ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "2", "--lr", "1e-3", "--mock-data", *extra]


@pytest.mark.parametrize("extra, message", [
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"], None),
    (["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "2",
      "--decoder-last-pipeline-num-layers", "2"], None),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
      "--pipeline-schedule", "zbv", "--untie-embeddings-and-output-weights",
      "--decoder-last-pipeline-num-layers", "2"], None),
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1"],
     "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers leave 7 layers"),
    (["--decoder-first-pipeline-num-layers", "1"], "need a pipeline of >= 2 ranks"),
    (["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "3",
      "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "2"],
     "--recompute-num-layers 2 must divide the 5 layers"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*3|t*5L"],
     None),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
      "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-layout",
      "Et*3|t*2|t*2|tL"], None),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*3|t*4L"],
     "--pipeline-model-parallel-layout holds 7 decoder layers but the model has 8"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*3|t*5L",
      "--decoder-first-pipeline-num-layers", "3"], "drop --decoder-first-pipeline-num-layers"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*2|t*3|t*3L"],
     "lists 3 stages, not a multiple of --pipeline-model-parallel-size 2"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*3|t*5x"],
     "unknown layer 'x'"),
    (["--pipeline-model-parallel-layout", "Et*3|t*5L"],
     "--pipeline-model-parallel-layout (V x P stages): --pipeline-schedule seq1f1b runs one "
     "model chunk per rank"),
])
def test_the_trainer_validates_the_flags_in_one_line(monkeypatch, extra, message):
    monkeypatch.setattr(arguments, "schedule_catalog", arguments.schedule_catalog)
    argv = _flags(*extra)
    world = int(extra[extra.index("--pipeline-model-parallel-size") + 1]) \
        if "--pipeline-model-parallel-size" in extra else 1
    if message is None:
        args = validate_args(parse_args(argv), world)
        config = megatron_adapter.make_transformer_config(
            num_layers=8, hidden_size=32, num_attention_heads=4,
            pipeline_model_parallel_size=world,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            placement=registry.get(args.pipeline_schedule).placement,
            stage_layers=StageLayers.of_flags(args))
        assert config.num_layers == 8
        return
    with pytest.raises(ArgumentError) as err:
        validate_args(parse_args(argv), world)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_even_is_the_default_everywhere():
    assert layers_per_virtual_stage(8, 2, 2, "vshape", EVEN) == (2, 2, 2, 2)
    assert ModelConfig(num_layers=8, hidden_size=32, num_attention_heads=4).num_layers == 8


@pytest.mark.parametrize("num_layers, pp, chunks, placement, text", [
    (8, 2, 1, "loop", "Et*3|t*5L"), (8, 2, 2, "loop", "Et|t*3|t*3|tL"),
    (8, 2, 2, "vshape", "Et*3|t*2|t*2|tL"), (10, 4, 1, "loop", "Et|(t*3|)*2,t*3L"),
    (32, 4, 2, "vshape", "Et*4|(t*5|)*2(t*4|)*4t*2L")])
def test_a_layout_gives_every_stage_its_count_as_megatron_core_builds_it(
        monkeypatch, num_layers, pp, chunks, placement, text):
    """--pipeline-model-parallel-layout: any count per virtual stage, in stage order; the
    config megatron-core builds from it has those layers at those offsets (a loop through
    megatron's own PipelineParallelLayerLayout, a V through the V's), as a run with V chunks
    (megatron's virtual pipeline size set) asks them."""
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size",
                        lambda: chunks if chunks > 1 else None)
    split = StageLayers(counts=parse_layout(text))
    counts = layers_per_virtual_stage(num_layers, pp, chunks, placement, split)
    assert counts == split.counts and parse_layout(split.layout) == counts
    layout = _config(num_layers, pp, chunks, placement, split).pipeline_model_parallel_layout
    for rank, chunk in itertools.product(range(pp), range(chunks)):
        stage = virtual_stage(placement, pp, rank, chunk)
        assert layout.get_num_layers_to_build(vp_stage=chunk, pp_rank=rank) == counts[stage]
        assert layout.get_layer_offset(vp_stage=chunk, pp_rank=rank) == sum(counts[:stage])


@pytest.mark.parametrize("text, message", [
    ("Et*3|t*5", "the loss L must close the last stage"), ("t*3|t*5L", "the embedding E must"),
    ("Et*3|Et*5L", "the embedding E must open the first stage, once"),
    ("Et*3|(t*5L", "'(' without ')'"), ("Et*3)|t*5L", "')' without '('"),
    ("Et*3|m|t*5L", "unknown layer 'm'")])
def test_a_bad_layout_is_refused_in_one_line_naming_the_flag(text, message):
    with pytest.raises(ScheduleError, match=re.escape(message)) as err:
        parse_layout(text)
    assert str(err.value).startswith("--pipeline-model-parallel-layout")


@pytest.mark.parametrize("counts, message", [
    ((3, 5, 0), "lists 3 stages but the pipeline has pp*chunks = 4"),
    ((3, 5, 0, 0), "stage 2 holds no decoder layer"), ((3, 5, 1, 1), "holds 10 decoder layers")])
def test_layout_counts_must_fit_the_pipeline(counts, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        layers_per_virtual_stage(8, 2, 2, "vshape", StageLayers(counts=counts))


def test_the_layout_search_never_loses_to_the_even_split_and_keeps_the_cap():
    """plan.py search --search-layout at 7B/64K, P=4, m=8, k=4, cap 0.5x: the layout chosen
    makes the searched schedule no longer than with even stages, every stage keeps a layer, and
    the estimate's costs honour the same cap in bytes."""
    model, spans = preset("7b"), [16384] * 4
    shape = registry.build("seq1f1b-zbv", 4, 8, 4, 2)

    def costs(split):
        return model_costs(shape, model, spans, flops_per_second=1e12, tp=8,
                           sequence_parallel=True, stage_layers=split)

    one = registry.build("1f1b", 4, 8, 1, 1)
    cap = 0.5 * simulate(one, model_costs(one, model, [65536], flops_per_second=1e12, tp=8,
                                          sequence_parallel=True)).ranks[0].peak_held_bytes

    def search(split):
        on = costs(split)
        schedule = registry.build("seq1f1b-zb-auto", 4, 8, 4, 2,
                                  budget=ScheduleBudget(on, cap, anneal=False))
        report = simulate(schedule, on)
        assert max(r.peak_held_bytes for r in report.ranks) <= cap
        return schedule, report.makespan

    choice = choose_layout(32, 8, lambda split: lower_bound(shape, costs(split)), search)
    assert choice.makespan <= choice.start_makespan and choice.tried == 1 + LAYOUT_TRIES
    assert sum(choice.stage_layers.counts) == 32 and min(choice.stage_layers.counts) >= 1
    assert near_even(32, 8) == (4,) * 8 and near_even(10, 4) == (2, 3, 3, 2)
