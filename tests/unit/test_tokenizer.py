"""Tokenizers round-trip text, expose what megatron-core's datasets read, and reject bad files with
the flag's name. The BPE files are trained here with the `tokenizers` library (nothing downloaded).
"""
import json
import types

import pytest

from megatron.training.tokenizer import (
    NO_PAD, ByteLevelTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, TokenizerConfig,
    build_tokenizer)
from seq1f1b.plan.costs import padded_vocab_size

TEXTS = ["the red fox sees a small cat.", "héllo wörld, naïve café ☃ 日本語 🙂", "", "a\nb\tc  "]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    """A tiny byte-level BPE saved both as vocab.json/merges.txt and as one tokenizer JSON."""
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("bpe")
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(["the red fox sees the small cat near the old barn."] * 20,
                                vocab_size=300, min_frequency=2,
                                special_tokens=["<|endoftext|>", "<pad>"])
    trainer.save_model(str(out))
    trainer.save(str(out / "tokenizer.json"))
    return types.SimpleNamespace(vocab=str(out / "vocab.json"), merges=str(out / "merges.txt"),
                                 json=str(out / "tokenizer.json"), dir=out)


def _all_tokenizers(bpe_files):
    return [ByteLevelTokenizer(), GPT2BPETokenizer(bpe_files.vocab, bpe_files.merges),
            HuggingFaceTokenizer(bpe_files.json)]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(bpe_files, text):
    for tok in _all_tokenizers(bpe_files):
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text, type(tok).__name__


def test_byte_level_ids_are_utf8_bytes_and_specials_are_dropped():
    tok = ByteLevelTokenizer()
    text = "naïve ☃"
    assert tok.tokenize(text) == list(text.encode("utf-8"))
    assert tok.detokenize(tok.tokenize(text) + [tok.eod, tok.pad]) == text
    assert len({tok.eod, tok.pad}) == 2 and min(tok.eod, tok.pad) >= 256
    assert tok.vocab_size > max(tok.eod, tok.pad)


def test_special_tokens_and_identifiers(bpe_files):
    gpt2 = GPT2BPETokenizer(bpe_files.vocab, bpe_files.merges)
    vocab = json.load(open(bpe_files.vocab))
    assert gpt2.eod == vocab["<|endoftext|>"] and gpt2.pad == vocab["<pad>"]
    hf = HuggingFaceTokenizer(bpe_files.json)
    assert (hf.eod, hf.pad, hf.vocab_size) == (gpt2.eod, gpt2.pad, gpt2.vocab_size)
    # the BPE merges something: fewer ids than bytes
    assert len(gpt2.tokenize("the small cat near the old barn")) < len(
        "the small cat near the old barn")
    for tok in _all_tokenizers(bpe_files):
        json.dumps(tok.unique_identifiers)  # megatron-core hashes it for its cache names
        assert tok.unique_identifiers["class"] == type(tok).__name__


def test_vocab_without_pad_reports_no_pad(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(["abc abc"] * 5, vocab_size=270, special_tokens=["<|endoftext|>"])
    trainer.save(str(tmp_path / "t.json"))
    assert HuggingFaceTokenizer(str(tmp_path / "t.json")).pad == NO_PAD


def test_build_tokenizer_from_flags(bpe_files):
    args = types.SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file=bpe_files.vocab,
                                 merge_file=bpe_files.merges, tokenizer_model=None)
    assert isinstance(build_tokenizer(args), GPT2BPETokenizer)
    assert isinstance(build_tokenizer(TokenizerConfig()), ByteLevelTokenizer)
    assert isinstance(build_tokenizer(TokenizerConfig("HuggingFaceTokenizer",
                                                      tokenizer_model=bpe_files.json)),
                      HuggingFaceTokenizer)


def test_bad_tokenizer_files_name_the_flag(bpe_files):
    garbage = bpe_files.dir / "garbage.json"
    garbage.write_text("{not json")
    no_eod = bpe_files.dir / "no_eod.json"
    from tokenizers import ByteLevelBPETokenizer
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(["xyz"] * 3, vocab_size=260)
    trainer.save(str(no_eod))
    missing = str(bpe_files.dir / "missing.json")
    cases = [
        (TokenizerConfig("GPT2BPETokenizer", missing, bpe_files.merges), "--vocab-file", missing),
        (TokenizerConfig("GPT2BPETokenizer", bpe_files.vocab, missing), "--merge-file", missing),
        (TokenizerConfig("GPT2BPETokenizer", None, bpe_files.merges), "--vocab-file", ""),
        (TokenizerConfig("GPT2BPETokenizer", str(garbage), bpe_files.merges), "--vocab-file",
         str(garbage)),
        (TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=missing), "--tokenizer-model",
         missing),
        (TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(garbage)),
         "--tokenizer-model", str(garbage)),
        (TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(no_eod)),
         "--tokenizer-model", str(no_eod)),
        (TokenizerConfig("NoSuchTokenizer"), "--tokenizer-type", "NoSuchTokenizer"),
    ]
    for config, flag, path in cases:
        with pytest.raises(ValueError) as err:
            build_tokenizer(config)
        message = str(err.value)
        assert flag in message and path in message and "\n" not in message, message


@pytest.mark.parametrize("vocab, divisible_by, tp, expected",
                         [(258, 128, 1, 384), (256, 128, 1, 256), (258, 128, 2, 512),
                          (50257, 128, 1, 50304), (258, 1, 1, 258), (258, 8, 4, 288)])
def test_padded_vocab_size_is_megatrons_rule(vocab, divisible_by, tp, expected):
    assert padded_vocab_size(vocab, divisible_by, tp) == expected


def test_hugging_face_folder_is_accepted_as_tokenizer_model(bpe_files, tmp_path):
    """--tokenizer-model D reads D/tokenizer.json; its tokenizer_config.json's eos_token is EOD."""
    by_folder = HuggingFaceTokenizer(str(bpe_files.dir))
    by_file = HuggingFaceTokenizer(bpe_files.json)
    assert (by_folder.eod, by_folder.pad, by_folder.vocab_size) == \
        (by_file.eod, by_file.pad, by_file.vocab_size)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(open(bpe_files.json, "rb").read())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert HuggingFaceTokenizer(str(folder)).eod == by_file.pad
    with pytest.raises(ValueError, match=f"--tokenizer-model: tokenizer file "
                                         f"{tmp_path / 'empty' / 'tokenizer.json'} does not exist"):
        (tmp_path / "empty").mkdir()
        HuggingFaceTokenizer(str(tmp_path / "empty"))
