"""Document masking of packed samples (--reset-attention-mask / --reset-position-ids) over spans.

- the document ids, per-span masks and reset positions are megatron-core's own (its dataset's
  `_get_ltor_masks_and_position_ids`), a mask sliced per span;
- attention with document ids run span by span through the KV cache equals the unsplit run,
  for every CPU backend (flex forward only) and GQA; flash's varlen packing, run through a
  stand-in kernel written from flash-attn's documented semantics, equals eager;
- no leak: a token's loss is unchanged when another document of its sample changes, in the
  unsplit model and split into spans (keys in the cache and in the span); without document
  masking the same change does move it, so the check can fail;
- the GPT model with per-token RoPE trained span by span equals the unsplit model;
- a backend that cannot mask documents is refused in one line.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from seq1f1b.megatron_adapter import build_model_chunk, make_transformer_config
from seq1f1b.runtime.documents import (
    document_ids,
    document_positions,
    span_document_mask,
    varlen_layout,
)
from seq1f1b.runtime.kv_cache import MicrobatchKVCache, SpanContext, span_context
from test_attention import (
    BATCH,
    HEAD_DIM,
    HEADS,
    SEQ,
    assert_same,
    make_attention,
    random_qkv,
    rel_err,
    span_bounds,
)

pytestmark = pytest.mark.usefixtures("megatron_world")

EOD, VOCAB = 0, 100
# Per row of the micro-batch: documents crossing one and several span boundaries, starting exactly
# at a boundary (10 with spans [10, 14]), shorter than a span; and one document for the row.
PACKINGS = [[3, 7, 9, 5], [24]]
SPLITS = [[24], [10, 14], [5, 11, 8], [1, 6, 9, 8]]


def packed_tokens(packings=PACKINGS, seed: int = 1) -> torch.Tensor:
    """[rows, SEQ + 1] random non-EOD tokens, an EOD closing each document (the extra column is
    the last label)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (len(packings), SEQ + 1), generator=gen)
    for row, lengths in enumerate(packings):
        ends = torch.tensor(lengths).cumsum(0) - 1
        tokens[row, ends] = EOD
    return tokens


def test_ids_masks_and_positions_are_megatrons():
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 4, (6, SEQ), generator=gen)          # EOD = 0: frequent, adjacent
    rows[0, 0], rows[1, -1], rows[2] = EOD, EOD, 5                 # first, last, none
    ids = document_ids(rows, EOD)
    for row, row_ids in zip(rows, ids):
        mask, _, positions = _get_ltor_masks_and_position_ids(row, EOD, True, True, False, True)
        assert torch.equal(document_positions(row_ids[None])[0], positions)
        full = span_document_mask(row_ids[None], 0, SEQ)[0]
        assert torch.equal(full, mask)
        for start, end in span_bounds([5, 11, 8]):
            assert torch.equal(span_document_mask(row_ids[None], start, end)[0],
                               mask[:, start:end, :end])


def _attention_runs(backend: str, groups: int, lengths, ids):
    attn = make_attention(backend, groups)
    qkv, grad_out = random_qkv(groups)
    if backend == "flex":       # torch's FlexAttention has no CPU backward: forward only
        return _spans_forward(attn, [t.detach() for t in qkv], lengths, ids)
    cache = MicrobatchKVCache(0, SEQ)
    q, k, v = qkv
    outs = []
    for j, (start, end) in enumerate(span_bounds(lengths)):
        with span_context(SpanContext(0, j, start, end, cache)):
            outs.append(attn(q[start:end], k[start:end], v[start:end], ids))
    for j, (start, end) in reversed(list(enumerate(span_bounds(lengths)))):
        with span_context(SpanContext(0, j, start, end, cache)):
            outs[j].backward(grad_out[start:end])
    return torch.cat([o.detach() for o in outs]), [t.grad for t in qkv]


def _spans_forward(attn, qkv, lengths, ids):
    cache, outs = MicrobatchKVCache(0, SEQ, requires_grad=False), []
    q, k, v = qkv
    for j, (start, end) in enumerate(span_bounds(lengths)):
        with span_context(SpanContext(0, j, start, end, cache)):
            outs.append(attn(q[start:end], k[start:end], v[start:end], ids))
    return torch.cat(outs)


def _reference(groups: int):
    """Eager attention with megatron's full bool mask, unsplit."""
    qkv, grad_out = random_qkv(groups)
    ids = document_ids(packed_tokens()[:, :-1], EOD)
    out = make_attention("eager", groups)(*qkv, span_document_mask(ids, 0, SEQ))
    out.backward(grad_out)
    return out.detach(), [t.grad for t in qkv]


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
@pytest.mark.parametrize("groups", [HEADS, 2], ids=["mha", "gqa2"])
@pytest.mark.parametrize("lengths", SPLITS, ids=lambda ls: "-".join(map(str, ls)))
def test_document_spans_equal_unsplit_masked_attention(backend, groups, lengths):
    ids = document_ids(packed_tokens()[:, :-1], EOD)
    result = _attention_runs(backend, groups, lengths, ids)
    reference = _reference(groups)
    if backend == "flex":
        assert rel_err(result, reference[0]) <= 1e-5
    else:
        assert_same(result, reference)


def test_span_forms_are_built_once_per_span():
    """Three layers, two spans: one (span x prefix) mask per span, shared by the layers."""
    ids = document_ids(packed_tokens()[:, :-1], EOD)
    layers = [make_attention("sdpa") for _ in range(3)]
    (q, k, v), _ = random_qkv()
    cache = MicrobatchKVCache(0, SEQ, requires_grad=False)
    with torch.no_grad():
        for j, (start, end) in enumerate(span_bounds([10, 14])):
            with span_context(SpanContext(0, j, start, end, cache)):
                for attn in layers:
                    attn(q[start:end], k[start:end], v[start:end], ids)
    shapes = sorted(tuple(form.shape) for form in cache.derived.values())
    assert shapes == [(BATCH, 1, 10, 10), (BATCH, 1, SEQ - 10, SEQ)]   # not s x s per span


def _stand_in_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
                           softmax_scale=None, causal=False):
    """flash-attn's documented varlen semantics: sequence i is rows cu[i]:cu[i+1] of the packed
    q / k / v ([tokens, heads, d]); causal is bottom-right aligned; GQA by head groups."""
    from seq1f1b.runtime.attention import _eager

    assert causal and dropout_p == 0 and max_q == int((cu_q[1:] - cu_q[:-1]).max())
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (t[a:b][:, None] for t, a, b in ((q, cu_q[i], cu_q[i + 1]),
                                                       (k, cu_k[i], cu_k[i + 1]),
                                                       (v, cu_k[i], cu_k[i + 1])))
        outs.append(_eager(qs, ks, vs, None, softmax_scale, 0.0)[:, 0])
    return torch.cat(outs).view(q.shape)


@pytest.mark.parametrize("groups", [HEADS, 2], ids=["mha", "gqa2"])
@pytest.mark.parametrize("lengths", SPLITS[1:], ids=lambda ls: "-".join(map(str, ls)))
def test_flash_varlen_packing_equals_eager(monkeypatch, groups, lengths):
    """The GPU kernel itself is untested here; its inputs (packed queries, each row's keys from
    its first document on, cu_seqlens per (row, document) over the cached prefix) are."""
    from seq1f1b.runtime import attention

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_varlen_func=_stand_in_flash_varlen))
    ids = document_ids(packed_tokens()[:, :-1], EOD)
    qkv, _ = random_qkv(groups)
    q, k, v = (t.detach() for t in qkv)
    scale = HEAD_DIM ** -0.5
    for start, end in span_bounds(lengths):
        layout = varlen_layout(ids, start, end, ids.device)
        got = attention._flash_varlen(q[start:end], k[:end], v[:end], layout, scale, 0.0)
        want = attention._eager(q[start:end], k[:end], v[:end],
                                span_document_mask(ids, start, end), scale, 0.0)
        assert rel_err(got, want) <= 1e-6
    # the span [10, 24) of row 0 needs keys from 10 on (documents 0-1 ended before it)
    assert varlen_layout(ids, 10, SEQ, ids.device).rows[0].first == 10


def test_backend_that_cannot_mask_documents_is_refused():
    attn = make_attention("sdpa")
    attn.backend = attn.requested_backend = "te"
    (q, k, v), _ = random_qkv()
    ids = document_ids(packed_tokens()[:, :-1], EOD)
    with pytest.raises(ValueError, match="--attention-backend te cannot mask documents"):
        attn(q, k, v, ids)
    with pytest.raises(ValueError, match="document ids hold 10 tokens, attention sees 24"):
        make_attention("eager")(q, k, v, ids[..., :10])


# ----------------------------------------------------------------------------- the GPT model

def build_gpt(backend: str = "sdpa", groups: int = 2):
    torch.manual_seed(0)
    config = make_transformer_config(num_layers=3, hidden_size=32, num_attention_heads=4,
                                     num_query_groups=groups, ffn_hidden_size=64,
                                     init_method_std=0.2)
    return build_model_chunk(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                             attention_backend=backend, reset_position_ids=True)


def gpt_batch(tokens: torch.Tensor, documents: bool = True):
    ids = document_ids(tokens[:, :-1], EOD)
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], position_ids=document_positions(ids),
                attention_mask=ids if documents else None)


def token_losses(model, batch, lengths, backward: bool = False):
    """Per-token losses of the micro-batch run span by span (the spans of `lengths`) through
    one KV cache, as the executor runs them; backward in reverse when asked."""
    cache = MicrobatchKVCache(0, SEQ)
    losses = []
    for j, (start, end) in enumerate(span_bounds(lengths)):
        with span_context(SpanContext(0, j, start, end, cache)):
            losses.append(model(batch["tokens"][:, start:end], batch["position_ids"][:, start:end],
                                batch["attention_mask"], labels=batch["labels"][:, start:end]))
    if backward:
        for j, (start, end) in reversed(list(enumerate(span_bounds(lengths)))):
            with span_context(SpanContext(0, j, start, end, cache)):
                (losses[j].sum() / batch["labels"].numel()).backward()
    return torch.cat([loss.detach() for loss in losses], dim=1)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("lengths", SPLITS[1:], ids=lambda ls: "-".join(map(str, ls)))
def test_gpt_spans_with_documents_equal_unsplit(backend, lengths):
    model = build_gpt(backend)
    batch = gpt_batch(packed_tokens())
    grads = []
    for split in ([SEQ], lengths):
        model.zero_grad(set_to_none=True)
        losses = token_losses(model, batch, split, backward=True)
        grads.append((losses, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (losses, split_grads), (ref_losses, ref_grads) = grads[1], grads[0]
    assert rel_err(losses, ref_losses) <= 1e-6
    for name, ref in ref_grads.items():
        assert rel_err(split_grads[name], ref) <= 1e-5, name


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("lengths", [[SEQ], [10, 14], [1, 6, 9, 8]],
                         ids=lambda ls: "-".join(map(str, ls)))
def test_no_leak_across_documents(backend, lengths):
    """Row 0 packs documents [0, 3) [3, 10) [10, 19) [19, 24); document 1's tokens change. Every
    token outside it whose label did not change keeps its loss bit for bit: document 1's keys
    sit in the cache (spans after it) and in the same span as later documents (span [1, 7) of
    1-6-9-8). Document 1's own losses move, and without document masking later ones do too."""
    model = build_gpt(backend)
    tokens = packed_tokens()
    altered = tokens.clone()
    altered[0, 3:9] = (altered[0, 3:9] + 7) % (VOCAB - 1) + 1       # stays non-EOD
    with torch.no_grad():
        before = token_losses(model, gpt_batch(tokens), lengths)
        after = token_losses(model, gpt_batch(altered), lengths)
        leaky_before = token_losses(model, gpt_batch(tokens, documents=False), lengths)
        leaky_after = token_losses(model, gpt_batch(altered, documents=False), lengths)
    same_label = tokens[:, 1:] == altered[:, 1:]
    outside = torch.ones_like(same_label)
    outside[0, 3:10] = False
    keep = same_label & outside
    assert torch.equal(before[keep], after[keep])
    assert not torch.equal(before[0, 3:9], after[0, 3:9])
    assert not torch.equal(leaky_before[0, 10:], leaky_after[0, 10:])


_spec = importlib.util.spec_from_file_location(
    "check_equivalence_cli", Path(__file__).resolve().parents[2] / "tools" / "check_equivalence.py")
check_equivalence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_equivalence)


@pytest.mark.parametrize("argv, message", [
    (["--reset-attention-mask", "--document-lengths", "5", "9"],
     "--document-lengths sum to 14, not --seq-length 24"),
    (["--reset-position-ids"], "need --document-lengths"),
    (["--document-lengths", "24", "0"], "--document-lengths must all be >= 1"),
    (["--reset-attention-mask", "--document-lengths", "24", "--attention-backend", "te"],
     "--attention-backend te cannot mask documents"),
])
def test_check_equivalence_refuses_bad_document_flags_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        check_equivalence.parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert message in err and "\n" not in err, err
