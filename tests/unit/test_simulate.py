"""The simulator: closed-form bubbles and memory peaks of the registry's schedules, latency, model
costs, deadlocks."""
import json
from dataclasses import replace

import pytest

from seq1f1b.plan import registry
from seq1f1b.plan.actions import Schedule, ScheduleError, dependencies
from seq1f1b.plan.costs import (ModelConfig, Recompute, activation_bytes, kv_cache_bytes,
                                layer_flops, layer_input_bytes, logits_flops, preset)
from seq1f1b.plan.partition import partition
from seq1f1b.plan.simulate import Efficiency, model_costs, simulate, uniform_costs

GRID = [(pp, m, k) for pp in (1, 2, 3, 4) for m in (1, 2, 3, 8) for k in (1, 2, 3, 4)]


def _uniform(schedule, *costs):
    return simulate(schedule, uniform_costs(schedule, *costs))


@pytest.mark.parametrize("pp, m, k", GRID)
def test_seq1f1b_bubble_and_rank0_peak(pp, m, k):
    report = _uniform(registry.build("seq1f1b", pp, m, k), 1, 2)
    assert report.bubble_ratio == (pp - 1) / (m * k + pp - 1)
    assert report.makespan == 3 * (m * k + pp - 1)
    assert report.ranks[0].peak_live_spans == min(pp + k - 1, m * k)


@pytest.mark.parametrize("pp, m", [(pp, m) for pp in (1, 2, 3, 4, 5) for m in (1, 2, 4, 8)])
def test_1f1b_bubble_and_peak(pp, m):
    report = _uniform(registry.build("1f1b", pp, m), 1, 2)
    assert report.bubble_ratio == (pp - 1) / (m + pp - 1)
    assert [r.peak_live_spans for r in report.ranks] == [min(pp - r, m) for r in range(pp)]


@pytest.mark.parametrize("pp, m, k, chunks", [(2, 4, 2, 2), (4, 8, 3, 2), (4, 4, 4, 3),
                                              (3, 3, 1, 2)])
def test_interleaved_bubble_shrinks_by_the_chunk_count(pp, m, k, chunks):
    report = _uniform(registry.build("seq1f1b-interleaved", pp, m, k, chunks), 1, 2)
    assert report.bubble_ratio == pytest.approx((pp - 1) / (chunks * m * k + pp - 1), abs=1e-12)


def test_timeline_respects_program_order_and_dependencies():
    schedule = registry.build("seq1f1b-interleaved", 3, 4, 2, 2)
    report = simulate(schedule, uniform_costs(schedule, 1, 2), p2p_latency=0.25)
    ends = {}
    for rank in report.ranks:
        assert [t.action for t in rank.timeline] == list(schedule.programs[rank.rank])
        for before, after in zip(rank.timeline, rank.timeline[1:]):
            assert before.end <= after.start
        ends.update({(rank.rank, t.action): t for t in rank.timeline})
    for (rank, action), timed in ends.items():
        for dep_rank, dep in dependencies(schedule, rank, action):
            latency = 0.25 if dep_rank != rank else 0.0
            assert ends[(dep_rank, dep)].end + latency <= timed.start
        assert rank < 3 and timed.end - timed.start == {"F": 1, "B": 2}[action.op]
    assert all(r.busy + r.idle == report.makespan for r in report.ranks)


def test_p2p_latency_is_paid_on_every_cross_rank_hop():
    schedule = registry.build("1f1b", 2, 1)
    # F on rank 0, hop, F and B on rank 1, hop, B on rank 0.
    assert simulate(schedule, uniform_costs(schedule, 1, 2), p2p_latency=0.5).makespan == 7.0


def test_split_backward_needs_w_costs_and_frees_kv_at_b():
    schedule = Schedule.from_text("rank 0: F0.0 B0.0 F1.0 W0.0 B1.0 W1.0", "w-toy")
    with pytest.raises(ScheduleError, match="--uniform-cost"):
        uniform_costs(schedule, 1, 2)
    report = _uniform(schedule, 1, 1, 1)
    assert report.makespan == 6
    assert report.ranks[0].peak_live_spans == 2          # span 0 lives until W0.0
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100)
    costs = model_costs(schedule, model, [32], flops_per_second=1e9)
    rank = simulate(schedule, costs).ranks[0]
    assert rank.peak_activation_bytes == 2 * 2 * activation_bytes(model, 32)
    assert rank.peak_kv_cache_bytes == 2 * kv_cache_bytes(model, 32)   # K/V freed at B0.0
    flops = layer_flops(model, 32, 32).scaled(2) + logits_flops(model, 32)
    assert costs.backward[0][0] == flops.input_grad / 1e9
    assert costs.weight[0][0] == flops.weight_grad / 1e9


def test_kv_cache_of_a_micro_batch_is_held_whole_from_its_first_span():
    """P=1, k=4: F0.0 already holds the whole sequence's K/V; they stay until B0.0.

    From B0.3 (the micro-batch's first backward) to B0.0 the dK/dV accumulators of spans 0-2 (90
    tokens) are held too, in fp32: the bytes of 180 tokens of bf16 K/V. m=1: F0.0-F0.3 B0.3 ...:
    one sequence's K/V plus the accumulators. m=2: F0.0 F0.1 F0.2 F0.3 B0.3 F1.0 B0.2 F1.1 B0.1
    F1.2 B0.0 F1.3 ...; from F1.0 to B0.0 two whole sequences' K/V and micro-batch 0's
    accumulators are held (span by span the K/V would never exceed 140 of 200 tokens); the byte
    peak is at F1.1, with 2 x 70 tokens of activations.
    """
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100)
    spans = [40, 30, 20, 10]
    for m, tokens in ((1, 100 + 2 * 90), (2, 2 * 100 + 2 * 90)):
        schedule = registry.build("seq1f1b", 1, m, 4)
        rank = simulate(schedule, model_costs(schedule, model, spans,
                                              flops_per_second=1e9)).ranks[0]
        assert rank.peak_kv_cache_bytes == 2 * kv_cache_bytes(model, tokens)
    assert rank.held_at_peak["kv_cache"] == 2 * kv_cache_bytes(model, 380)      # at F1.1
    assert rank.held_at_peak["activation"] == pytest.approx(2 * 2 * activation_bytes(model, 70))


def test_kv_cache_is_freed_after_the_micro_batchs_last_backward():
    """Split backward, k=2: K/V of micro-batch 0 (and, from B0.1, its span 0's dK/dV
    accumulator, fp32: twice its bf16 K/V bytes) leave after B0.0 (W needs none), before F1.0."""
    schedule = Schedule.from_text("rank 0: F0.0 F0.1 B0.1 B0.0 F1.0 W0.1 W0.0 F1.1 B1.1 B1.0 "
                                  "W1.1 W1.0", "w-toy-k2")
    model = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=100)
    rank = simulate(schedule, model_costs(schedule, model, [24, 8],
                                          flops_per_second=1e9)).ranks[0]
    assert rank.peak_kv_cache_bytes == kv_cache_bytes(model, 32 + 2 * 24)
    # At F1.0 micro-batch 0's activations are still held (until its W), its K/V are not.
    assert rank.held_at_peak["activation"] == 2 * activation_bytes(model, 24) + \
        activation_bytes(model, 8)
    assert rank.held_at_peak["kv_cache"] == kv_cache_bytes(model, 32)


def test_span_efficiencies_divide_each_kind_of_flops_rate():
    """model_costs' `efficiency`: a span's GEMMs at gemm x the rate, its attention forward and
    backward at their own fractions; all 1 is the same as none."""
    model = preset("7b")
    spans = partition(32768, 2, "even", model)
    schedule = registry.build("seq1f1b", 2, 2, 2)
    plain = model_costs(schedule, model, spans, flops_per_second=1e12)
    assert model_costs(schedule, model, spans, flops_per_second=1e12,
                       efficiency=lambda start, end: Efficiency(1.0, 1.0, 1.0)) == plain
    slow = model_costs(schedule, model, spans, flops_per_second=1e12,
                       efficiency=lambda start, end: Efficiency(0.5, 0.25, 0.1))
    ends = [sum(spans[:j + 1]) for j in range(2)]
    for j, (length, end) in enumerate(zip(spans, ends)):
        flops = layer_flops(model, length, end).scaled(16)
        assert slow.forward[0][j] == pytest.approx(
            (flops.linear / 0.5 + flops.attention / 0.25) / 1e12)
        assert slow.backward[0][j] == pytest.approx(
            (2 * flops.linear / 0.5 + 2 * flops.attention / 0.1) / 1e12)


def test_hops_replace_the_flat_latency_between_ranks():
    """SpanCosts.hop times each crossing by the pair of virtual stages and the span; equal hops
    replay as the flat latency, and a slower hop delays only what crosses it."""
    schedule = registry.build("seq1f1b-interleaved", 2, 4, 2, 2)
    costs = uniform_costs(schedule, 1.0, 2.0)

    def with_hops(*rows: float):
        return simulate(schedule, replace(costs, hop=tuple((h, h) for h in rows)))

    assert with_hops(0.25, 0.25, 0.25).makespan == simulate(schedule, costs, 0.25).makespan
    slower = [with_hops(0.25, 0.25, 0.25)] + [
        with_hops(*[1.0 if row == slow else 0.25 for row in range(3)]) for slow in range(3)]
    assert all(report.makespan > slower[0].makespan for report in slower[1:])


def test_model_costs_follow_the_cost_formula():
    model = preset("7b")
    spans = partition(65536, 4, "compute", model, tp=2, sequence_parallel=True)
    schedule = registry.build("seq1f1b", 4, 8, 4)
    costs = model_costs(schedule, model, spans, flops_per_second=312e12, tp=2,
                        sequence_parallel=True)
    ends = [sum(spans[:j + 1]) for j in range(4)]
    for stage in range(4):
        for j, (length, end) in enumerate(zip(spans, ends)):
            flops = layer_flops(model, length, end).scaled(8)
            if stage == 3:
                flops = flops + logits_flops(model, length)
            assert costs.forward[stage][j] == pytest.approx(flops.forward / 2 / 312e12)
            assert costs.backward[stage][j] == pytest.approx(2 * costs.forward[stage][j])
            assert costs.activation_bytes[stage][j] == 8 * activation_bytes(
                model, length, tp=2, sequence_parallel=True)
    assert costs.weight is None
    report = simulate(schedule, costs)
    assert report.ranks[0].peak_live_spans == 7

    def peak(table):
        """Bytes of rank 0's live spans, maximised over its program (a set-based replay)."""
        live, best = set(), 0.0
        for action in schedule.programs[0]:
            if action.op == "F":
                live.add(action.key())
                best = max(best, sum(table(spans[j]) for _, j, _ in live))
            else:
                live.discard(action.key())
        return best

    assert report.ranks[0].peak_activation_bytes == pytest.approx(
        peak(lambda n: 8 * activation_bytes(model, n, tp=2, sequence_parallel=True)))
    # K/V: a micro-batch holds the whole sequence's from F(i,0) to B(i,0). Rank 0 runs
    # F0.0-F0.3 F1.0 F1.1 (warm-up P - 1 + k - 1 = 6), then alternates F and B: F1.2 B0.3 F1.3
    # B0.2 F2.0 -- micro-batches 0 (spans 0, 1), 1 and 2 in flight -- B0.1 F2.1 B0.0; never four,
    # since 7 live spans cannot cover three whole micro-batches plus a fourth's first span. Since
    # B0.3, micro-batch 0's dK/dV accumulators hold the rows of its spans 0-2 (fp32: twice).
    assert report.ranks[0].peak_kv_cache_bytes == pytest.approx(
        8 * kv_cache_bytes(model, 3 * 65536 + 2 * sum(spans[:3]), tp=2))
    # The byte peak is not where the span count first peaks (all of micro-batch 0 and three
    # spans of micro-batch 1): the first span is the longest, so a later window holding two
    # first spans is heavier.
    first_window = spans + spans[:3]
    assert report.ranks[0].peak_activation_bytes > sum(
        8 * activation_bytes(model, n, tp=2, sequence_parallel=True) for n in first_window)
    # Fewer live spans further down the pipe.
    peaks = [r.peak_activation_bytes for r in report.ranks]
    assert peaks == sorted(peaks, reverse=True)


def test_recompute_is_counted_per_model_chunk():
    """Interleaved, P=2, V=2, 8 layers: each virtual stage is a chunk of 2 layers; block N=1
    checkpoints the first layer of every chunk, not of every rank; K/V are untouched."""
    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=100)
    schedule = registry.build("seq1f1b-interleaved", 2, 2, 2, 2)
    spans = [48, 16]
    plain = model_costs(schedule, model, spans, flops_per_second=1e9)
    block = model_costs(schedule, model, spans, flops_per_second=1e9,
                        recompute=Recompute("full", "block", 1))
    for stage in range(4):
        for j, n in enumerate(spans):
            assert block.activation_bytes[stage][j] == layer_input_bytes(model, n) + \
                activation_bytes(model, n)
            assert plain.activation_bytes[stage][j] == 2 * activation_bytes(model, n)
    assert block.kv_cache_bytes == plain.kv_cache_bytes
    assert block.forward == plain.forward
    for stage in range(4):      # B re-runs the first layer of the chunk: one layer's forward
        for j, (n, end) in enumerate(zip(spans, (48, 64))):
            assert block.backward[stage][j] == pytest.approx(
                plain.backward[stage][j] + layer_flops(model, n, end).forward / 1e9)
    for less, more in zip(simulate(schedule, block).ranks, simulate(schedule, plain).ranks):
        assert less.peak_activation_bytes < more.peak_activation_bytes
        assert less.peak_kv_cache_bytes == more.peak_kv_cache_bytes


def test_balanced_spans_beat_even_spans():
    model = preset("7b")
    schedule = registry.build("seq1f1b", 4, 8, 4)

    def makespan(method):
        spans = partition(131072, 4, method, model, tp=2, sequence_parallel=True)
        return simulate(schedule, model_costs(schedule, model, spans, flops_per_second=312e12,
                                              tp=2, sequence_parallel=True)).makespan

    assert makespan("compute") < 0.97 * makespan("even")


def test_layers_must_divide_over_virtual_stages():
    schedule = registry.build("seq1f1b", 3, 2, 2)
    with pytest.raises(ScheduleError, match="--pp"):
        model_costs(schedule, preset("7b"), [8, 8], flops_per_second=1e12)


def test_deadlock_and_incomplete_schedules_are_refused():
    deadlock = Schedule.from_text("rank 0: F0.0 B0.0\nrank 1: B0.0 F0.0", "bad-order")
    with pytest.raises(ScheduleError, match="F0.0"):
        _uniform(deadlock, 1, 2)
    crossed = Schedule.from_text("rank 0: F0.0 B0.0 F1.0 B1.0\nrank 1: F1.0 F0.0 B0.0 B1.0",
                                 "crossed")
    with pytest.raises(ScheduleError, match="deadlock"):
        _uniform(crossed, 1, 2)
    missing = Schedule.from_text("rank 0: F0.0 B0.0\nrank 1: F0.0", "missing")
    with pytest.raises(ScheduleError, match="B0.0"):
        _uniform(missing, 1, 2)


def test_report_to_dict_is_json():
    report = _uniform(registry.build("seq1f1b", 2, 2, 2), 1, 2)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["makespan"] == report.makespan and data["bubble_ratio"] == report.bubble_ratio
    assert data["ranks"][0]["actions"][0] == {"action": "F0.0", "start": 0.0, "end": 1.0}
    assert data["ranks"][1]["peak_live_spans"] == 2
    assert data["ranks"][0]["peak_activation_bytes"] is None
    assert "actions" not in report.to_dict(timeline=False)["ranks"][0]


def test_recompute_lengthens_the_backward_by_the_forward_it_re_runs():
    """B re-runs every layer's forward (full, uniform), the first N layers' (block) or the core
    attention's (selective); F and the bytes' bookkeeping are untouched by the durations."""
    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=100)
    schedule = registry.build("seq1f1b", 2, 2, 2)
    spans = [40, 24]

    def costs(recompute=None):
        return model_costs(schedule, model, spans, flops_per_second=1e9, recompute=recompute)

    plain = costs()
    layer = [layer_flops(model, 40, 40), layer_flops(model, 24, 64)]
    cases = {Recompute("full", "uniform", 2): [f.forward * 4 for f in layer],
             Recompute("full", "block", 1): [f.forward for f in layer],
             Recompute("selective"): [f.attention * 4 for f in layer]}
    for recompute, extra_flops in cases.items():
        got = costs(recompute)
        assert got.forward == plain.forward
        for stage in range(2):
            for j in range(2):
                assert got.backward[stage][j] == pytest.approx(
                    plain.backward[stage][j] + extra_flops[j] / 1e9)
