"""The core test: loss and every parameter gradient of pipelined, split runs equal the unsplit
single-process model in fp32 (loss rel. diff <= 1e-6, max_rel_grad_diff <= 1e-5).

One torchrun launch per world size runs all of that size's cases. The matrix covers PP 1-4, TP 1-2
with and without sequence parallelism, DP 2, k 1-5 (k not dividing P too), even / compute /
explicit uneven spans, V=2 with k=3 (loop and V placements; the searched schedule on a loop of one
and of two chunks and on a V), RoPE and learned positions, Llama-class layers (GQA with
1 and 2 K/V heads, SwiGLU, RMSNorm, no bias, QKV bias, large RoPE bases, Llama 3 scaling, partial
and interpolated RoPE), every registered schedule, and
megatron-core's own 1F1B and interleaved schedules run on the same models and data; the `against`
cases compare our executor with megatron's schedule directly (same chunks, same data). Activation
recompute (full, selective) is exact against the unsplit model with dropout 0, and with dropout > 0
identical to the same run without recompute (same masks). Packed documents (`DOCS`: document
masking and reset positions over the packing `document_lengths`, the reference masked alike):
documents crossing one and several span boundaries, starting exactly at one, shorter than a span,
and one document per sample, across PP 1-4 (middle stages), TP with SP, k, V=2, GQA, the
zero-bubble schedule and both recomputes. A schedule written to a --pipeline-schedule-file and
read back from it runs exactly too (one that starts every rank with micro-batch 1), and so do uneven first / last stages on a loop and a V, and
a --pipeline-model-parallel-layout (any count per stage) on a loop, interleaved and a V.
Context parallelism (CP, the all-to-all around the span attention,
runtime/context_parallel.py) at CP 2 and 4: with PP 2, TP 2 with SP, DP 2, V 2
interleaved, the zero-bubble schedule, GQA with 2 K/V groups and 1 (replicated to every CP rank),
packed documents, full and selective recompute, the eager and sdpa kernels, k 2-4.
Weight gradients accumulate into main_grad inside the GEMM (gradient accumulation fusion, the
default) in every case but the `UNFUSED` ones. The `EARLY` cases run the output layer's backward
inside the last stage's forward (--loss-backward-in-forward, runtime/early_loss.py): tied on one
stage, untied with SwiGLU/RMSNorm and full recompute, PP 2 on a loop and on a V (split backward),
TP 2 with SP, CP 2 unfused, DP 2, and TP 2 x PP 2 interleaved with SP.

Every case runs in strict CUDA mode (SEQ1F1B_STRICT_CUDA=1, seq1f1b/strict_cuda.py): a batch or
gradient left on the host, a host tensor given to a collective or p2p, a host sync inside the
executor's run or an SDPA call CUDA would run with its math kernel raises, as on the first GPU
run. Strict mode adds checks around the same kernels; the training tests run without it.
"""
from dataclasses import replace

import pytest

from launch import STRICT_CUDA, run_worlds
from seq1f1b.plan import registry, schedule_file
from seq1f1b.plan.actions import Action, Schedule
from spread_orders import spread_cases

L8 = {"num_layers": 8}
FULL = {"recompute_granularity": "full"}
SELECTIVE = {"recompute_granularity": "selective"}
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "against_no_recompute": True}
# Llama-class layers: GQA (2 K/V heads for 4 query heads), SwiGLU, RMSNorm, no biases, a large
# RoPE base, untied output layer. QWEN2: one K/V head (groups = 1), QKV bias without the other
# biases, Llama 3 frequency scaling (the base puts low frequencies past its 8192-token wavelength).
LLAMA = {"num_query_groups": 2, "swiglu": True, "normalization": "RMSNorm",
         "disable_bias_linear": True, "rotary_base": 500000, "untie_embeddings": True}
QWEN2 = {"num_query_groups": 1, "swiglu": True, "normalization": "RMSNorm",
         "disable_bias_linear": True, "add_qkv_bias": True, "rotary_base": 1000000,
         "use_rope_scaling": True}
DOCS = {"reset_attention_mask": True, "reset_position_ids": True}
# Every case accumulates weight gradients into main_grad inside the GEMM (Megatron-LM's default,
# gradient_accumulation_fusion); UNFUSED cases take DDP's separate add instead.
UNFUSED = {"gradient_accumulation_fusion": False}
# The output layer's backward in the last stage's F (--loss-backward-in-forward): scaled at B.
EARLY = {"loss_backward_in_forward": True}
SPREAD_SEARCHED = [
    {"schedule": "seq1f1b-zb-auto", "pp": 2, "chunks": 2, "splits": 2, "untie_embeddings": True,
     "spread_output": True},
    {"schedule": "seq1f1b-zb-auto", "pp": 2, "chunks": 2, "splits": 2, "spread_output": True,
     "vocab_size": 512},
]
"""seq1f1b-zb-auto with the output layer's placement searched too (--spread-output of
check_equivalence.py and benchmark.py, as pretrain_gpt.py's), at world 2; the V's output layer
tied to the embedding (every copy of it, runtime/tied_output.py), the loop's untied."""
SPREAD_AGAINST = {"schedule": "seq1f1b-zb-auto", "pp": 2, "splits": 2, "spread_output": True,
                  "against": "megatron-1f1b"}
"""Tied: the copies' gradients against megatron's own tying of a loop."""
CASES: dict[int, list[dict]] = {
    1: [
        {"schedule": "seq1f1b", "splits": 1},
        {"schedule": "seq1f1b", "splits": 4, "span_lengths": [3, 9, 5, 7]},
        {"schedule": "seq1f1b", "splits": 3, "partition": "compute",
         "position_embedding_type": "learned_absolute"},
        {"schedule": "gpipe", "splits": 2},
        {"schedule": "1f1b", "splits": 1, "untie_embeddings": True},
        {"schedule": "megatron-1f1b"},
        {"schedule": "seq1f1b", "splits": 3, **LLAMA},
        {"schedule": "seq1f1b", "splits": 4, "span_lengths": [3, 9, 5, 7], **QWEN2},
        # spans [0,3) [3,12) [12,17) [17,24): [2,19) crosses three boundaries
        {"schedule": "seq1f1b", "splits": 4, "span_lengths": [3, 9, 5, 7], **DOCS,
         "document_lengths": [2, 17, 5]},
        # spans [0,8) [8,16) [16,24): [8,12) starts at a boundary, shorter than a span; GQA
        {"schedule": "seq1f1b", "splits": 3, **DOCS, "document_lengths": [8, 4, 12],
         "num_query_groups": 2, "attention_backend": "eager"},
        {"schedule": "seq1f1b", "splits": 4, "span_lengths": [3, 9, 5, 7], **UNFUSED},
        # one stage: the output layer shares the embedding's weight (tied), fused and not
        {"schedule": "seq1f1b", "splits": 4, "span_lengths": [3, 9, 5, 7], **EARLY},
        {"schedule": "seq1f1b", "splits": 3, **EARLY, **UNFUSED, **LLAMA, **FULL},
    ],
    2: [
        {"schedule": "1f1b", "pp": 2},
        {"schedule": "seq1f1b", "pp": 2, "splits": 2},
        {"schedule": "seq1f1b", "pp": 2, "splits": 3, "span_lengths": [4, 13, 7]},
        {"schedule": "seq1f1b", "pp": 2, "splits": 5, "partition": "compute",
         "position_embedding_type": "learned_absolute"},
        {"schedule": "seq1f1b", "pp": 2, "splits": 4, "untie_embeddings": True},
        {"schedule": "gpipe", "pp": 2, "splits": 3},
        {"schedule": "interleaved-1f1b", "pp": 2, "chunks": 2},
        {"schedule": "seq1f1b-interleaved", "pp": 2, "chunks": 2, "splits": 3},
        {"schedule": "seq1f1b", "tp": 2, "splits": 3},
        {"schedule": "seq1f1b", "tp": 2, "splits": 3, "sequence_parallel": True,
         "span_lengths": [6, 10, 8]},
        {"schedule": "seq1f1b", "splits": 2, "num_microbatches": 2},          # DP 2
        {"schedule": "megatron-1f1b", "pp": 2},
        {"schedule": "seq1f1b", "pp": 2, "splits": 3, **FULL},
        {"schedule": "seq1f1b", "pp": 2, "splits": 4, **SELECTIVE,
         "position_embedding_type": "learned_absolute"},
        {"schedule": "seq1f1b-interleaved", "pp": 2, "chunks": 2, "splits": 3, **FULL,
         "recompute_method": "block"},
        {"schedule": "seq1f1b", "pp": 2, "splits": 3, **FULL, **DROPOUT},
        {"schedule": "seq1f1b", "tp": 2, "splits": 2, "sequence_parallel": True, **SELECTIVE,
         **DROPOUT},
        {"schedule": "zb-h1", "pp": 2},
        {"schedule": "seq1f1b-zb-h1", "pp": 2, "splits": 3, "span_lengths": [4, 13, 7]},
        {"schedule": "seq1f1b-zb-h1", "tp": 2, "splits": 2, "sequence_parallel": True},
        {"schedule": "1f1b", "pp": 2, "against": "megatron-1f1b"},
        {"schedule": "seq1f1b", "pp": 2, "splits": 3, "against": "megatron-1f1b"},
        {"schedule": "seq1f1b", "pp": 2, "splits": 3, **LLAMA},
        {"schedule": "seq1f1b-zb-h1", "tp": 2, "splits": 2, "sequence_parallel": True, **LLAMA},
        {"schedule": "seq1f1b", "pp": 2, "splits": 3, **DOCS, "document_lengths": [5, 9, 10]},
        {"schedule": "seq1f1b", "tp": 2, "splits": 3, "sequence_parallel": True,
         "span_lengths": [6, 10, 8], **DOCS, "document_lengths": [6, 11, 7]},
        {"schedule": "seq1f1b-zb-h1", "pp": 2, "splits": 4, **DOCS, "document_lengths": [24]},
        {"schedule": "seq1f1b-interleaved", "pp": 2, "chunks": 2, "splits": 3, **SELECTIVE,
         **DOCS, "document_lengths": [3, 3, 14, 4]},
        {"schedule": "seq1f1b", "pp": 2, "splits": 4, **FULL, **DOCS,
         "document_lengths": [1, 12, 11], "num_query_groups": 2},
        # A V (chunk 1 of rank r is stage 2P-1-r): the embedding and the loss on rank 0, a chunk
        # hand-over in memory on rank 1, layers numbered in stage order; untied output layer,
        # then tied to the embedding beside it (runtime/tied_output.py).
        {"schedule": "seq1f1b-zbv", "pp": 2, "chunks": 2, "splits": 3,
         "span_lengths": [4, 13, 7], "untie_embeddings": True},
        {"schedule": "zbv", "pp": 2, "chunks": 2, "splits": 2,
         "position_embedding_type": "learned_absolute"},
        {"schedule": "seq1f1b-zb-auto", "pp": 2, "chunks": 2, "splits": 3, "partition": "compute",
         **LLAMA},
        # the search on a loop of one chunk per rank, each W split off on the loop's chunks;
        # on two with tied embeddings (it chooses a V)
        {"schedule": "seq1f1b-zb-auto", "pp": 2, "splits": 3, "num_microbatches": 5},
        {"schedule": "seq1f1b-zb-auto", "pp": 2, "chunks": 2, "splits": 2},
        # context parallelism: one K/V group replicated to both CP ranks, then two (one each)
        {"schedule": "seq1f1b", "cp": 2, "splits": 2, **QWEN2},
        {"schedule": "seq1f1b", "cp": 2, "splits": 4, "span_lengths": [4, 8, 6, 6], **LLAMA},
        {"schedule": "seq1f1b", "cp": 2, "splits": 3, **DOCS, "document_lengths": [5, 9, 10]},
        {"schedule": "seq1f1b", "cp": 2, "splits": 3, **FULL, "attention_backend": "eager"},
        {"schedule": "seq1f1b-zb-h1", "cp": 2, "splits": 2},
        {"schedule": "seq1f1b-zb-h1", "tp": 2, "splits": 2, "sequence_parallel": True,
         **UNFUSED},
        {"schedule": "seq1f1b", "pp": 2, "splits": 3, "span_lengths": [4, 13, 7], **EARLY},
        {"schedule": "seq1f1b-zbv", "pp": 2, "chunks": 2, "splits": 3, "untie_embeddings": True,
         **EARLY},
        {"schedule": "seq1f1b", "tp": 2, "splits": 3, "sequence_parallel": True, **EARLY},
        {"schedule": "seq1f1b", "cp": 2, "splits": 2, **EARLY, **UNFUSED},
        {"schedule": "seq1f1b", "splits": 2, "num_microbatches": 2, **EARLY},        # DP 2
        # --pipeline-model-parallel-layout: any count per stage, on a loop (megatron's own
        # layout), interleaved, and a V whose output-layer stage sheds layers to the middle
        {"schedule": "seq1f1b", "pp": 2, "splits": 2, "pipeline_model_parallel_layout": "Et*3|tL"},
        {"schedule": "seq1f1b-interleaved", "pp": 2, "chunks": 2, "splits": 2, "num_layers": 6,
         "pipeline_model_parallel_layout": "Et|t*2|t*2|tL"},
        {"schedule": "seq1f1b-zb-auto", "pp": 2, "chunks": 2, "splits": 2, "num_layers": 6,
         "pipeline_model_parallel_layout": "Et*2|t*2|t|tL", "untie_embeddings": True},
        # --spread-output: the search places the output layer's O's on both ranks, on a loop
        # of two chunks and (a larger vocabulary) on a V
        *SPREAD_SEARCHED,
        # the same --against megatron's own schedule: rank 0's copy of the output layer is held
        # against the baseline's last stage (its gradients gathered from every rank)
        SPREAD_AGAINST,
    ],
    3: [
        {"schedule": "seq1f1b", "pp": 3, "splits": 2, "num_layers": 6},
        {"schedule": "seq1f1b", "pp": 3, "splits": 4, "partition": "compute", "num_layers": 6},
        {"schedule": "1f1b", "pp": 3, "num_layers": 6},
        {"schedule": "seq1f1b", "pp": 3, "splits": 2, "num_layers": 6, **SELECTIVE},
        {"schedule": "seq1f1b-zb-h1", "pp": 3, "splits": 4, "num_layers": 6,
         "partition": "compute"},
        {"schedule": "seq1f1b-interleaved", "pp": 3, "chunks": 2, "splits": 2, "num_layers": 6,
         "num_microbatches": 6},
    ],
    4: [
        {"schedule": "seq1f1b", "pp": 4, "splits": 4},
        {"schedule": "seq1f1b", "pp": 4, "splits": 3, "span_lengths": [5, 11, 8]},
        {"schedule": "seq1f1b", "pp": 4, "splits": 5, "position_embedding_type": "learned_absolute"},
        {"schedule": "seq1f1b", "tp": 2, "pp": 2, "splits": 3, "sequence_parallel": True,
         "span_lengths": [6, 10, 8]},
        {"schedule": "seq1f1b", "pp": 2, "splits": 2, "num_microbatches": 2,
         "position_embedding_type": "learned_absolute"},                      # PP 2 x DP 2
        {"schedule": "seq1f1b-interleaved", "pp": 4, "chunks": 2, "splits": 3, **L8},
        {"schedule": "interleaved-1f1b", "tp": 2, "pp": 2, "chunks": 2},
        {"schedule": "gpipe", "pp": 4, "splits": 2},
        {"schedule": "seq1f1b", "pp": 4, "splits": 4, **FULL},
        {"schedule": "zb-h1", "pp": 4, "splits": 2},
        {"schedule": "seq1f1b-zb-h1", "pp": 4, "splits": 3, "span_lengths": [5, 11, 8]},
        {"schedule": "seq1f1b-zb-h1", "tp": 2, "pp": 2, "splits": 4, "sequence_parallel": True,
         "span_lengths": [4, 8, 6, 6]},
        {"schedule": "seq1f1b-zb-h1", "tp": 2, "pp": 2, "splits": 1,
         "position_embedding_type": "learned_absolute"},
        {"schedule": "seq1f1b-zb-h1", "pp": 2, "splits": 3, **FULL, **DROPOUT},
        {"schedule": "seq1f1b", "tp": 2, "pp": 2, "splits": 1, **FULL},
        {"schedule": "seq1f1b-interleaved", "pp": 4, "chunks": 2, "splits": 2, **SELECTIVE,
         **DROPOUT, **L8},
        {"schedule": "1f1b", "pp": 4},
        {"schedule": "megatron-1f1b", "pp": 4},
        {"schedule": "1f1b", "pp": 4, "against": "megatron-1f1b"},
        # megatron's interleaved at PP=4: at PP=2 with m=4 megatron's batched p2p on gloo sends
        # activations and grads between the same two ranks with one tag, and they can cross.
        {"schedule": "megatron-interleaved-1f1b", "pp": 4, "chunks": 2, **L8},
        {"schedule": "interleaved-1f1b", "pp": 4, "chunks": 2, "against":
         "megatron-interleaved-1f1b", **L8},
        {"schedule": "seq1f1b", "tp": 2, "pp": 2, "splits": 3, "sequence_parallel": True,
         **LLAMA},
        {"schedule": "seq1f1b-zb-h1", "pp": 4, "splits": 3, **QWEN2},
        {"schedule": "seq1f1b-interleaved", "pp": 2, "chunks": 2, "splits": 3, **LLAMA,
         **SELECTIVE},
        {"schedule": "seq1f1b", "tp": 2, "pp": 2, "splits": 4, "rotary_percent": 0.5,
         "rotary_seq_len_interpolation_factor": 4, "swiglu": True, **FULL},
        {"schedule": "seq1f1b", "pp": 4, "splits": 4, **DOCS, "document_lengths": [7, 10, 7]},
        {"schedule": "seq1f1b", "tp": 2, "pp": 2, "splits": 4, "sequence_parallel": True,
         **DOCS, "document_lengths": [13, 2, 9]},
        {"schedule": "seq1f1b-zbv", "pp": 4, "chunks": 2, "splits": 3, "num_microbatches": 5,
         "untie_embeddings": True, **L8},
        {"schedule": "seq1f1b-zb-auto", "tp": 2, "pp": 2, "chunks": 2, "splits": 2,
         "sequence_parallel": True, "untie_embeddings": True},
        # uneven stages: a loop rank 0 with 3 of the 4 layers; a V with 2, 1, 1, 2 layers on
        # its stages (the first and the last, the output layer's, on rank 0)
        {"schedule": "seq1f1b", "tp": 2, "pp": 2, "splits": 2, "sequence_parallel": True,
         "decoder_first_pipeline_num_layers": 3},
        {"schedule": "seq1f1b-zbv", "tp": 2, "pp": 2, "chunks": 2, "splits": 2, "num_layers": 6,
         "decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 2,
         "untie_embeddings": True},
        # context parallelism (CP 4 with one K/V group: replicated to all four ranks; TP 2 with
        # two groups: one per TP rank, replicated to both CP ranks)
        {"schedule": "seq1f1b", "cp": 2, "pp": 2, "splits": 3, **SELECTIVE},
        {"schedule": "seq1f1b", "cp": 2, "tp": 2, "splits": 3, "sequence_parallel": True,
         "span_lengths": [4, 12, 8], "num_query_groups": 2},
        {"schedule": "seq1f1b", "cp": 2, "splits": 2, "num_microbatches": 2},      # CP 2 x DP 2
        {"schedule": "seq1f1b", "cp": 4, "splits": 2},
        {"schedule": "seq1f1b", "cp": 4, "splits": 3, **QWEN2},
        {"schedule": "seq1f1b-interleaved", "cp": 2, "pp": 2, "chunks": 2, "splits": 3},
        {"schedule": "seq1f1b-zb-h1", "cp": 2, "pp": 2, "splits": 4, "span_lengths": [4, 8, 6, 6]},
        {"schedule": "seq1f1b-interleaved", "tp": 2, "pp": 2, "chunks": 2, "splits": 2,
         "sequence_parallel": True, **EARLY},
    ],
}

PARAMS = [(world, n) for world, cases in CASES.items() for n in range(len(cases))]


def _case_id(param):
    world, n = param
    spec = CASES[world][n]
    return f"w{world}-{n}-" + "-".join(
        "docs" if k == "document_lengths" else f"{k}{v}" for k, v in spec.items()
        if k not in ("span_lengths", "num_layers", *DOCS))


FILE_PLAN = ("seq1f1b-interleaved", 2, 4, 2, 2)
"""The schedule written to a --pipeline-schedule-file and run from it, at world 2 (an extra case
after CASES[2]'s), with micro-batches 0 and 1 swapped: every rank starts with micro-batch 1, as
a searched order or a hand-written file may (the data is still read in order)."""


def _swapped(schedule: Schedule) -> Schedule:
    """`schedule` with micro-batches 0 and 1 trading places (a valid schedule: the rules treat
    every micro-batch alike)."""
    swap = {0: 1, 1: 0}
    return replace(schedule, programs=tuple(
        tuple(Action(a.op, swap.get(a.microbatch, a.microbatch), a.span, a.chunk)
              for a in program) for program in schedule.programs))


SPREAD = [
    (2, (2, 2, 2, 1, "loop"), {}),
    (2, (2, 4, 2, 2, "vshape"), {}),
    (2, (2, 4, 3, 2, "loop"), L8),
    (4, (4, 4, 2, 1, "loop"), {**LLAMA, "ffn_hidden_size": 64}),
    (4, (2, 4, 2, 2, "vshape"), {"tp": 2, "sequence_parallel": True}),
    (4, (2, 4, 2, 2, "vshape"), {}),                        # DP 2
    (4, (2, 2, 2, 1, "loop"), {"cp": 2}),
    (4, (2, 2, 2, 1, "loop"), {"tp": 2, **UNFUSED}),
]
"""The output layer spread over the ranks (O actions: every rank's last chunk holds a copy,
megatron_adapter.OutputHead): (world, (P, m, k, V, placement) of a searched order, the case's
other fields). Each order is the greedy's with O's on several ranks (spread_orders.py),
written to a file and run from it: PP 2 and 4, a loop of one and two chunks and a V (split
backward), Llama layers, TP 2 with SP, DP 2, CP 2, unfused weight gradients."""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("schedule_file")
    name, pp, m, k, v = FILE_PLAN
    path = folder / f"{name}.csv"
    path.write_text(schedule_file.write(_swapped(registry.build(name, pp, m, k, v))))
    first = [("file", {"pipeline_schedule_file": str(path), "pp": pp, "num_microbatches": m,
                        "splits": k, "chunks": v})]
    extra = spread_cases(folder, SPREAD)
    extra[2] = first + extra.get(2, [])
    return run_worlds("equivalence_worker.py", CASES, extra, env=STRICT_CUDA)


def test_a_schedule_from_a_file_is_exact(results):
    result = results["file"]
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert result["case"]["schedule"].startswith("file:") and result["params_compared"] > 0
    assert result["loss_rel_diff"] <= 1e-6 and result["max_rel_grad_diff"] <= 1e-5, result
    assert result["passed"]


@pytest.mark.parametrize("n", range(len(SPREAD)))
def test_the_output_layer_spread_over_the_ranks_is_exact(results, n):
    """O actions on several ranks: the loss, every gradient, and each rank's copy of the output
    layer's gradients (summed over the pipeline ranks) equal the unsplit model's."""
    result = results[("spread", n)]
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert result["case"]["schedule"].startswith("file:") and result["params_compared"] > 0
    assert result["loss_rel_diff"] <= 1e-6 and result["max_rel_grad_diff"] <= 1e-5, result
    assert result["passed"]


def test_matrix_covers_every_schedule():
    used = {case["schedule"] for cases in CASES.values() for case in cases}
    assert set(registry.names()) <= used
    assert sum(len(c) for c in CASES.values()) >= 24


def test_matrix_runs_the_search_on_every_placement_it_chooses():
    """seq1f1b-zb-auto's cases, as the harness places them: a loop of one chunk, a loop of two
    (the output layer spread) and a V."""
    from seq1f1b.equivalence import EquivalenceCase, case_placement
    layouts = {(case.get("chunks", 1), case_placement(EquivalenceCase(**case)))
               for cases in CASES.values() for case in cases
               if case["schedule"] == "seq1f1b-zb-auto"}
    assert layouts == {(1, "loop"), (2, "loop"), (2, "vshape")}


def test_matrix_runs_the_search_with_the_output_layer_spread():
    """The --spread-output cases' searched plans run O's on both ranks, on a loop and a V: their
    exactness is that of the spread search's orders, not of an order that kept the layer; the
    --against case's spreads it too."""
    from seq1f1b.equivalence import EquivalenceCase, case_plan
    plans = [case_plan(EquivalenceCase(**case)) for case in SPREAD_SEARCHED]
    assert [plan.placement for plan in plans] == ["loop", "vshape"]
    assert all(plan.spread_output and set(plan.output_ranks.values()) == {0, 1}
               for plan in plans)
    assert case_plan(EquivalenceCase(**SPREAD_AGAINST)).spread_output     # a copy on rank 0


@pytest.mark.parametrize("param", PARAMS, ids=[_case_id(p) for p in PARAMS])
def test_pipelined_split_run_equals_unsplit_model(results, param):
    world, n = param
    result = results[world][n]
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert result["strict"] and result["params_compared"] > 0
    assert result["loss_rel_diff"] <= 1e-6, result
    assert result["max_rel_grad_diff"] <= 1e-5, result
    assert result["passed"]
