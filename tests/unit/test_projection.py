"""seq1f1b.plan.projection and overheads: each cost term that grows with k behaves as its docstring
says, k = 1 projects exactly as 1F1B, and the terms are what stops Seq1F1B's gain from growing
with k forever. Properties only: no number here is tuned to the paper's throughput."""
from dataclasses import replace

import pytest

from seq1f1b.plan import registry
from seq1f1b.plan.costs import preset
from seq1f1b.plan.memory import TrainingSetup
from seq1f1b.plan.overheads import GemmEfficiency, SpanFixedCost
from seq1f1b.plan.projection import A100, TERMS, pipeline_costs, project, stage_links

IDEAL = A100.without("span_fixed", "nvlink", "infiniband", "gemm", "attention")
"""The A100 with none of the k-dependent terms: FLOPs at saturated efficiencies and TP comm."""


def _setup(schedule: str = "seq1f1b", splits: int = 1, *, seq_length: int = 32768,
           microbatches: int = 4, tp: int = 8, pp: int = 4, dp: int = 1,
           chunks: int = 1) -> TrainingSetup:
    """The paper's 7B on TP x PP x DP GPUs, micro-batch 1, SP, balanced spans."""
    return TrainingSetup(model=preset("7b"), seq_length=seq_length, schedule=schedule, pp=pp,
                         microbatches=microbatches, splits=splits, chunks=chunks, tp=tp, dp=dp,
                         sequence_parallel=tp > 1, distributed_optimizer=True,
                         partition="compute" if splits > 1 else "even")


def _increasing(values: list[float]) -> bool:
    return all(a < b for a, b in zip(values, values[1:]))


def test_gemm_efficiency_rises_with_tokens_towards_saturation_and_sooner_when_wider():
    gemm = A100.gemm
    rates = [gemm.at(tokens, 512) for tokens in (128, 512, 2048, 8192, 65536)]
    assert _increasing(rates) and rates[-1] < gemm.saturated
    assert rates[-1] == pytest.approx(gemm.saturated, rel=0.02)
    assert gemm.at(gemm.half_tokens, gemm.width) == pytest.approx(gemm.saturated / 2)
    assert gemm.at(1024, 4096) > gemm.at(1024, 512)
    assert gemm.ideal().at(1, 512) == gemm.saturated


@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_attention_efficiency_rises_with_query_and_key_length(kernel):
    rate = getattr(A100.attention, kernel)
    lengths = (256, 1024, 4096, 16384)
    assert _increasing([rate(queries, 16384, 4) for queries in lengths])
    assert _increasing([rate(256, keys, 4) for keys in lengths])
    assert _increasing([rate(1024, 8192, heads) for heads in (1, 4, 32)])
    assert rate(16384, 131072, 32) < A100.attention.saturated
    assert getattr(A100.attention.ideal(), kernel)(1, 1, 1) == A100.attention.saturated


def test_a_short_query_against_long_keys_runs_below_a_square_block_of_the_same_flops():
    """Causal pairs of a span of sq queries ending at sk: sq*sk - sq^2/2; a square causal block
    of L tokens has L^2/2. At 4 heads per GPU (7B, TP = 8) the late span is slower both ways."""
    attention = A100.attention
    assert attention.half_rows / 4 >= attention.half_loop
    queries, keys = 1024, 32768
    square = (2 * (queries * keys - queries ** 2 / 2)) ** 0.5
    for kernel in (attention.forward, attention.backward):
        assert kernel(queries, keys, 4) < kernel(square, square, 4)


def test_fixed_cost_adds_its_seconds_to_every_span_of_every_layer():
    """Busy time with the fixed cost minus without it: per span and layer, the forward's
    s_per_layer and the backward's backward_factor times it, on every virtual stage: k x layers."""
    fixed = SpanFixedCost(s_per_layer=1e-3, backward_factor=3.0, source="test")
    for splits in (1, 4, 8):
        setup = _setup(splits=splits)
        without = project(setup, IDEAL).report
        added = project(setup, replace(IDEAL, span_fixed=fixed)).report
        busy = sum(r.busy for r in added.ranks) - sum(r.busy for r in without.ranks)
        layers = setup.model.num_layers          # over all stages
        assert busy == pytest.approx(setup.microbatches * splits * layers * 1e-3 * (1 + 3))


def _links(tp: int, dp: int, pp: int, chunks: int = 1) -> list[str]:
    setup = _setup("seq1f1b-interleaved" if chunks > 1 else "seq1f1b", 2, tp=tp, dp=dp, pp=pp,
                   chunks=chunks)
    schedule = registry.build(setup.plan_name, pp, setup.microbatches, 2, chunks)
    return ["ib" if link is A100.infiniband else "nvlink"
            for link in stage_links(setup, A100, schedule)]


def test_p2p_crosses_to_infiniband_exactly_where_neighbouring_stages_sit_on_other_nodes():
    """megatron's rank order (TP, then DP, then PP) on 8-GPU nodes: a stage of TP x DP GPUs."""
    assert _links(tp=8, dp=1, pp=4) == ["ib"] * 3                    # one stage per node
    assert _links(tp=1, dp=1, pp=8) == ["nvlink"] * 7                # one node
    assert _links(tp=2, dp=1, pp=8) == ["nvlink"] * 3 + ["ib"] + ["nvlink"] * 3
    assert _links(tp=2, dp=2, pp=4) == ["nvlink", "ib", "nvlink"]
    assert _links(tp=4, dp=4, pp=2) == ["ib"]                        # 16-GPU stages
    # Interleaved: the hop from rank P-1's first chunk back to rank 0 crosses when they do.
    assert _links(tp=2, dp=1, pp=4, chunks=2) == ["nvlink"] * 7
    assert _links(tp=4, dp=1, pp=4, chunks=2) == ["nvlink", "ib", "nvlink", "ib", "nvlink",
                                                  "ib", "nvlink"]


def test_a_slower_inter_node_link_costs_only_setups_whose_hops_cross_nodes():
    slow = replace(A100, infiniband=replace(A100.infiniband, gbps=1.0))
    inside = _setup(tp=1, pp=8)
    across = _setup(tp=8, pp=4)
    assert project(inside, slow).pipeline_s == project(inside).pipeline_s
    assert project(across, slow).pipeline_s > project(across).pipeline_s


def test_k_1_projects_exactly_as_1f1b_and_the_ideal_device_as_flops_at_saturation():
    seq1f1b, plain = project(_setup("seq1f1b", 1)), project(_setup("1f1b"))
    assert seq1f1b.pipeline_s == plain.pipeline_s
    assert seq1f1b.overheads() == plain.overheads()
    assert set(plain.overheads()) == set(TERMS)
    assert all(seconds >= 0 for seconds in plain.overheads().values())
    assert project(_setup("1f1b"), IDEAL).pipeline_s < plain.pipeline_s
    assert all(seconds == 0 for seconds in project(_setup("1f1b"), IDEAL).overheads().values())


def _gains(device, splits: tuple[int, ...]) -> list[float]:
    """Seq1F1B's TFLOPS over 1F1B's at each k."""
    base = project(_setup("1f1b"), device).tflops_per_gpu
    return [project(_setup("seq1f1b", k), device).tflops_per_gpu / base for k in splits]


def test_seq1f1b_gains_less_once_many_short_spans_cost_more_than_the_bubble_they_save():
    """Without the k-dependent terms the gain only grows with k (the bubble shrinks); with them
    it peaks at some k and falls after it, with the fixed cost alone too."""
    splits = (2, 4, 8, 16, 32, 64)
    assert _increasing(_gains(IDEAL, splits))
    only_fixed = replace(IDEAL, span_fixed=A100.span_fixed)
    for device in (A100, only_fixed):
        gains = _gains(device, splits)
        best = gains.index(max(gains))
        assert 0 < best < len(splits) - 1, gains
        assert _increasing(gains[best:][::-1]), gains         # falling after the peak


def test_describe_prints_each_terms_values_and_source():
    lines = A100.describe()
    for term in ("gemm", "attention", "span_fixed", "nvlink", "infiniband"):
        line = next(line for line in lines if line.startswith(f"{term}: "))
        assert line.endswith(f"[{getattr(A100, term).source}]")
    assert "name = A100-SXM4-80GB" in lines
    custom = GemmEfficiency(saturated=0.5, half_tokens=10, width=64, source="S")
    assert replace(A100, gemm=custom).describe()[2] == \
        "gemm: saturated 0.5, half_tokens 10, width 64 [S]"


def test_a_split_backward_schedule_projects_its_w_actions():
    """zb-h1 defers W: its projection runs the same work as 1F1B with W filling the bubble."""
    one, zero = project(_setup("1f1b")), project(_setup("zb-h1"))
    assert zero.report.bubble_ratio < one.report.bubble_ratio
    busy = [sum(r.busy for r in p.report.ranks) for p in (one, zero)]
    assert busy[1] == pytest.approx(busy[0], rel=1e-9)


def test_the_loss_backward_in_forward_moves_the_output_layers_backward_into_the_last_forward():
    """--loss-backward-in-forward: the same work on every rank; the last stage's forwards are
    longer by what its backwards are shorter (the output layer's backward), the other ranks'
    actions unchanged."""
    stock = project(_setup("seq1f1b", 4))
    early = project(replace(_setup("seq1f1b", 4), loss_backward_in_forward=True))
    for a, b in zip(stock.report.ranks, early.report.ranks):
        assert b.busy == pytest.approx(a.busy, rel=1e-9)
    costs = [pipeline_costs(p.setup, A100, p.schedule) for p in (stock, early)]
    last = stock.schedule.num_stages - 1
    for j in range(4):
        moved = costs[1].forward[last][j] - costs[0].forward[last][j]
        assert moved > 0
        assert costs[0].backward[last][j] - costs[1].backward[last][j] == pytest.approx(moved)
        assert costs[1].forward[0][j] == costs[0].forward[0][j]
