"""Data path end to end: JSONL -> tools/preprocess_data.py -> .bin/.idx -> megatron-core datasets
-> micro-batches per DP rank. Samples are checked against the tokenised corpus itself."""
import importlib.util
import json
import os
import shutil
import sys

import numpy
import pytest
import torch

from megatron.training import data
from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.tokenizer import ByteLevelTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_module(name, relpath):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pool workers unpickle the tool's functions by module name
    spec.loader.exec_module(module)
    return module


preprocess_data = _load_module("preprocess_data", "tools/preprocess_data.py")
make_corpus = _load_module("make_corpus", "examples/data/make_corpus.py")


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _preprocess(*argv):
    """Run the tool in-process; return its exit code."""
    return preprocess_data.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """80 generated stories, preprocessed with EOD; returns (records, prefix of the text key)."""
    out = tmp_path_factory.mktemp("corpus")
    records = make_corpus.generate(80, seed=7)
    for r in records:
        r["title"] = r["text"].split(".")[0]
    jsonl = _write_jsonl(out / "corpus.jsonl", records)
    assert _preprocess("--input", jsonl, "--output-prefix", out / "corpus", "--json-keys",
                       "text", "title", "--append-eod", "--log-interval", 25) == 0
    return records, str(out / "corpus_text_document")


def _documents(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_preprocess_writes_each_key_as_megatron_names_it(corpus, capsys):
    records, prefix = corpus
    tok = ByteLevelTokenizer()
    assert _documents(prefix) == [tok.tokenize(r["text"]) + [tok.eod] for r in records]
    title_prefix = prefix.replace("_text_document", "_title_document")
    assert _documents(title_prefix) == [tok.tokenize(r["title"]) + [tok.eod] for r in records]
    info = data.check_indexed_dataset(prefix)
    assert (info.num_documents, info.dtype) == (len(records), numpy.uint16)


def test_preprocess_with_workers_writes_the_same_bytes(corpus, tmp_path, capsys):
    records, prefix = corpus
    jsonl = _write_jsonl(tmp_path / "c.jsonl", [{"text": r["text"]} for r in records])
    assert _preprocess("--input", jsonl, "--output-prefix", tmp_path / "w", "--append-eod",
                       "--workers", 2, "--log-interval", 20) == 0
    progress = [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("Processed")]
    assert len(progress) >= len(records) // 20 and "MB/s" in progress[0]
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as a, open(tmp_path / f"w_text_document{ext}", "rb") as b:
            assert a.read() == b.read()


@pytest.mark.parametrize("lines, extra, flag, detail", [
    (None, [], "--input", "missing.jsonl"),
    (['{"text": "ok"}', '{"text": "broken"'], [], "--input", "line 2"),
    (['{"text": "ok"}'] * 300 + ['{"text": "broken"'], ["--workers", "2"], "--input", "line 301"),
    (['{"text": "ok"}', "", '{"body": "no text key"}'], [], "--json-keys", "line 3"),
    (['{"text": 5}'], [], "--json-keys", "line 1"),
    (['["not", "an", "object"]'], [], "--input", "line 1"),
    (['{"text": "ok"}'], ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                          "nope.json"], "--tokenizer-model", "nope.json"),
    (['{"text": "ok"}'], ["--output-prefix", "no/such/dir/x"], "--output-prefix", "no/such/dir"),
    (['{"text": "ok"}'], ["--output-prefix", "/proc/x"], "--output-prefix",
     "/proc is not writable"),
    (['{"text": "ok"}'], ["--output-prefix", ""], "--output-prefix", "empty path"),
    (['{"text": "ok"}'], ["--output-prefix", "./"], "--output-prefix", "names a folder"),
    (['{"text": "ok"}'], ["--vocab-size", "7"], "--vocab-size", "ByteLevelTokenizer"),
    (['{"text": "ok"}'], ["--tokenizer-model", "/nonexistent/x"], "--tokenizer-model",
     "ByteLevelTokenizer"),
    (['{"text": "ok"}'], ["--tokenizer-type", "NullTokenizer", "--vocab-size", "9",
                          "--vocab-file", "v.json"], "--vocab-file", "NullTokenizer"),
])
def test_preprocess_bad_input_is_one_line_exit_2_and_leaves_nothing(
        tmp_path, capsys, monkeypatch, lines, extra, flag, detail):
    monkeypatch.chdir(tmp_path)
    jsonl = "missing.jsonl"
    if lines is not None:
        jsonl = "in.jsonl"
        (tmp_path / jsonl).write_text("\n".join(lines + [""] * 50) + "\n")
    before = sorted(os.listdir(tmp_path))
    argv = ["--input", jsonl, "--output-prefix", "out", "--append-eod"] + extra
    assert _preprocess(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and detail in err, err
    assert sorted(os.listdir(tmp_path)) == before


def _stream(dataset):
    """The token stream GPTDataset cuts its samples from: documents in document-index order."""
    return numpy.concatenate([dataset.dataset.get(int(d)) for d in dataset.document_index])


def test_gpt_dataset_samples_are_windows_of_the_tokenised_corpus(corpus):
    records, prefix = corpus
    seq = 32
    config = data.DataConfig(seq_length=seq, seed=3, data_path=(prefix,), split="1,0,0")
    train, valid, test = data.build_datasets(config, ByteLevelTokenizer(), (300, 0, 0))
    assert valid is None and test is None and len(train) >= 300
    tok = ByteLevelTokenizer()
    corpus_tokens = sorted(t for r in records for t in tok.tokenize(r["text"]) + [tok.eod])
    stream = _stream(train)
    assert len(stream) % len(corpus_tokens) == 0  # whole epochs of the corpus
    assert sorted(stream[:len(corpus_tokens)].tolist()) == corpus_tokens
    for idx in range(len(train)):
        sample, j = train[idx], int(train.shuffle_index[idx])
        assert sample["tokens"].tolist() == stream[j * seq:(j + 1) * seq].tolist()
        assert sample["labels"].tolist() == stream[j * seq + 1:(j + 1) * seq + 1].tolist()
        assert sample["loss_mask"].tolist() == [1.0] * seq
        assert sample["position_ids"].tolist() == list(range(seq))
        assert "attention_mask" not in sample


def test_split_ranges_match_megatron_and_empty_splits_are_refused(corpus):
    _, prefix = corpus
    config = data.DataConfig(seq_length=16, data_path=(prefix,), split="80,15,5")
    datasets = data.build_datasets(config, ByteLevelTokenizer(), (10, 10, 10))
    ranges = data.split_document_ranges("80,15,5", 80)
    for dataset, expected in zip(datasets, ranges):
        assert dataset.indices.tolist() == list(expected)
    empty_test = data.DataConfig(seq_length=16, data_path=(prefix,), split="949,50,1")
    with pytest.raises(ValueError, match="--split: the test split"):
        data.build_datasets(empty_test, ByteLevelTokenizer(), (10, 10, 10))


def test_blending_follows_the_weights(tmp_path):
    prefixes = []
    for letter in "ab":
        jsonl = _write_jsonl(tmp_path / f"{letter}.jsonl",
                             [{"text": letter * (20 + i % 7)} for i in range(40)])
        assert _preprocess("--input", jsonl, "--output-prefix", tmp_path / letter,
                           "--append-eod") == 0
        prefixes.append(str(tmp_path / f"{letter}_text_document"))
    config = data.DataConfig(seq_length=8, data_path=("30", prefixes[0], "70", prefixes[1]),
                             split="1,0,0")
    train = data.build_datasets(config, ByteLevelTokenizer(), (1000, 0, 0))[0]
    from_a = sum(1 for i in range(len(train)) if ord("a") in train[i]["tokens"].tolist())
    assert len(train) == 1000
    assert abs(from_a / len(train) - 0.3) < 0.01


def test_micro_batches_split_over_dp_ranks_and_resume(corpus):
    _, prefix = corpus
    seq, micro, dp = 16, 2, 2
    config = data.DataConfig(seq_length=seq, data_path=(prefix,), split="1,0,0")
    train = data.build_datasets(config, ByteLevelTokenizer(), (40, 0, 0))[0]
    ranks = [list(data.MicroBatchIterator(train, micro, r, dp)) for r in range(dp)]
    steps = len(train) // (micro * dp)
    assert [len(batches) for batches in ranks] == [steps, steps]
    batch = ranks[0][0]
    assert batch["attention_mask"] is None
    assert {k: tuple(v.shape) for k, v in batch.items() if v is not None} == {
        "tokens": (micro, seq), "labels": (micro, seq), "loss_mask": (micro, seq),
        "position_ids": (micro, seq)}
    assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    # step t: rank 0 has samples [4t, 4t+2), rank 1 [4t+2, 4t+4)
    seen = torch.cat([torch.cat([ranks[0][t]["tokens"], ranks[1][t]["tokens"]])
                      for t in range(steps)])
    expected = torch.stack([train[i]["tokens"] for i in range(steps * micro * dp)])
    assert torch.equal(seen, expected)

    it = data.MicroBatchIterator(train, micro, 1, dp)
    for _ in range(3):
        next(it)
    assert it.consumed_samples == 3 * micro * dp
    resumed = data.MicroBatchIterator(train, micro, 1, dp, consumed_samples=it.consumed_samples)
    assert torch.equal(next(resumed)["tokens"], ranks[1][3]["tokens"])
    with pytest.raises(ValueError, match="multiple"):
        data.MicroBatchIterator(train, micro, 0, dp, consumed_samples=3)


def _corrupt(tmp_path, prefix, name):
    """Copy the dataset under a new prefix and damage it the named way; return the new prefix."""
    bad = str(tmp_path / name)
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as src:
            content = src.read()
        if name == "bad_magic" and ext == ".idx":
            content = b"NOTANIDX!" + content[9:]
        if name == "short_idx" and ext == ".idx":
            content = content[:-8]
        if name == "short_bin" and ext == ".bin":
            content = content[:-2]
        if name == "bad_version" and ext == ".idx":
            content = content[:9] + (7).to_bytes(8, "little") + content[17:]
        if not (name == "no_bin" and ext == ".bin") and not (name == "no_idx" and ext == ".idx"):
            with open(bad + ext, "wb") as dst:
                dst.write(content)
    return bad


@pytest.mark.parametrize("damage", ["no_bin", "no_idx", "bad_magic", "short_idx", "short_bin",
                                    "bad_version"])
def test_missing_or_corrupt_files_are_named(corpus, tmp_path, damage):
    _, prefix = corpus
    bad = _corrupt(tmp_path, prefix, damage)
    with pytest.raises(ValueError) as err:
        data.check_indexed_dataset(bad)
    message = str(err.value)
    assert message.startswith("--data-path") and bad in message and "\n" not in message


@pytest.mark.parametrize("paths, match", [
    ([], "no dataset prefix"),
    (["0.5", "a", "b"], "WEIGHT PREFIX"),
    (["1", "a", "x", "b"], "WEIGHT PREFIX"),
    (["-1", "a", "2", "b"], "must be a finite positive"),
    (["inf", "a", "2", "b"], "must be a finite positive"),
    (["1e308", "a", "1e308", "b"], "sum overflows"),
])
def test_bad_data_path_forms(paths, match):
    with pytest.raises(ValueError, match=match):
        data.parse_data_path(paths)


def test_data_path_forms():
    assert data.parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert data.parse_data_path(["0.3", "a", "7", "b"]) == (["a", "b"], [0.3, 7.0])
    assert data.parse_data_path(["a.bin/x"]) == (["a.bin/x"], None)


def test_num_samples_follow_megatrons_rule():
    # 100 iterations x 8 samples; 2 eval batches at iterations 10, 20, ..., 100 and at the end
    assert data.train_valid_test_num_samples(100, 8, 10, 2) == (800, 11 * 2 * 8, 2 * 8)


def test_iterators_from_validated_flags_with_mock_data():
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 24 "
            "--micro-batch-size 3 --global-batch-size 12 --train-iters 5 --lr 1e-3 --mock-data "
            "--eval-interval 5 --eval-iters 1").split()
    args = validate_args(parse_args(argv), world_size=2)
    train, valid, test = data.build_data_iterators(args, ByteLevelTokenizer(), 1, 2,
                                                   consumed_train_samples=12)
    batch = next(train)
    assert tuple(batch["tokens"].shape) == (3, 24) and train.consumed_samples == 18
    assert tuple(next(valid)["labels"].shape) == (3, 24) and test.consumed_samples == 0
    assert batch["attention_mask"] is None


def test_mock_data_with_packed_document_flags():
    """--mock-data's documents (random lengths, each closed by the tokenizer's EOD) get the
    document ids and the restarting positions from the flags, in training and validation."""
    from seq1f1b.runtime.documents import document_ids, document_positions

    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 4096 "
            "--micro-batch-size 2 --global-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data "
            "--eval-interval 1 --eval-iters 1 --reset-attention-mask --reset-position-ids "
            "--eod-mask-loss").split()
    args = validate_args(parse_args(argv), world_size=1)
    tokenizer = ByteLevelTokenizer()
    for iterator in data.build_data_iterators(args, tokenizer, 0, 1)[:2]:
        batch = next(iterator)
        ids = batch["attention_mask"]
        assert torch.equal(ids, document_ids(batch["tokens"], tokenizer.eod))
        assert int(ids.max()) > 0                         # a sample of 4096 holds documents
        assert torch.equal(batch["position_ids"], document_positions(ids))
        assert not batch["loss_mask"][batch["tokens"] == tokenizer.eod].any()


def test_packed_documents_reach_the_batch_as_megatron_defines_them(corpus):
    """--reset-position-ids / --reset-attention-mask / --eod-mask-loss go to megatron-core's
    GPTDatasetConfig (its positions and loss mask), and the collated attention mask is the
    document ids whose per-span masks are megatron's [s, s] mask, which is never built."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from seq1f1b.runtime.documents import span_document_mask

    _, prefix = corpus
    seq, tokenizer = 64, ByteLevelTokenizer()
    config = data.DataConfig(seq_length=seq, data_path=(prefix,), split="1,0,0",
                             eod_mask_loss=True, reset_position_ids=True,
                             reset_attention_mask=True)
    train = data.build_datasets(config, tokenizer, (8, 0, 0))[0]
    assert "attention_mask" not in train[0]
    batch = next(iter(data.MicroBatchIterator(train, 4, document_eod=tokenizer.eod)))
    assert batch["attention_mask"].shape == (4, 1, 1, seq)
    assert int((batch["tokens"] == tokenizer.eod).sum()) > 0          # documents do end here
    for row in range(4):
        tokens = batch["tokens"][row]
        mask, loss_mask, positions = _get_ltor_masks_and_position_ids(
            tokens, tokenizer.eod, True, True, True, True)
        assert torch.equal(batch["position_ids"][row], positions)
        assert torch.equal(batch["loss_mask"][row], loss_mask)
        ids = batch["attention_mask"][row:row + 1]
        assert torch.equal(span_document_mask(ids, 16, 48)[0], mask[:, 16:48, :48])


def test_token_ids_beyond_the_vocabulary_are_refused_at_validation(corpus, tmp_path):
    """On a GPU an out-of-vocabulary id is a device-side assert in the first forward."""
    _, prefix = corpus
    copy = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, copy + ext)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--data-path", copy, "--split", "80,20,0"]
    rows = validate_args(parse_args(argv), 1).padded_vocab_size
    tokens = numpy.memmap(copy + ".bin", dtype=numpy.uint16, mode="r+")
    tokens[7] = rows
    tokens.flush()
    del tokens
    with pytest.raises(ArgumentError, match=rf"^--data-path: {copy}.bin holds token id {rows}, "
                                            rf"outside the model's vocabulary of {rows} rows"):
        validate_args(parse_args(argv), 1)


@pytest.mark.parametrize("split", ["inf,1,1", "1e400,1", "nan,1,1", "1e308,1e308"])
def test_a_split_of_infinite_or_overflowing_parts_is_refused(split):
    """An infinite part normalised to NaN fractions (a message naming no flag, or a run that
    trained on them with --mock-data)."""
    with pytest.raises(ValueError, match="--split: expected up to three finite"):
        data.parse_split(split)
