"""Tokenizers for training and preprocessing; none of them ever downloads anything.

Each class has the duck type megatron.core.datasets reads (`vocab_size`, `eod`, `pad`,
`unique_identifiers`) plus `tokenize(text) -> list[int]` and `detokenize(ids) -> str`. We do not
subclass megatron-core's `MegatronLegacyTokenizer`: it logs a deprecation warning on every
construction, and the datasets only need the attributes.

`pad` is `NO_PAD` (-1, the value megatron-core's datasets use for "no pad token") when the
vocabulary has no pad token of its own; byte-level has one.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

TOKENIZER_TYPES = ("ByteLevelTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
DEFAULT_TOKENIZER_TYPE = "ByteLevelTokenizer"


FLAG_READERS = {"vocab_file": "GPT2BPETokenizer", "merge_file": "GPT2BPETokenizer",
                "tokenizer_model": "HuggingFaceTokenizer", "vocab_size": "NullTokenizer"}
"""Each file-or-size tokenizer flag and the one --tokenizer-type that reads it."""


def unread_flag_error(args: object, tokenizer_type: str) -> Optional[str]:
    """The one-line error for a tokenizer flag `tokenizer_type` never reads (build_tokenizer
    ignores it, so the text would be tokenised otherwise than asked), or None."""
    for flag, reader in FLAG_READERS.items():
        if getattr(args, flag, None) is not None and tokenizer_type != reader:
            return (f"--{flag.replace('_', '-')} is only read by --tokenizer-type {reader}, "
                    f"not {tokenizer_type}")
    return None


def add_tokenizer_args(group) -> None:
    """Megatron's tokenizer flags, shared by pretrain_gpt.py and tools/preprocess_data.py."""
    group.add_argument("--tokenizer-type", default=DEFAULT_TOKENIZER_TYPE, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--tokenizer-model",
                       help="HuggingFaceTokenizer: a tokenizers JSON file, or a Hugging Face model "
                            "folder holding tokenizer.json")
    group.add_argument("--vocab-size", type=int,
                       help="NullTokenizer: token ids 0 .. N-1 (EOD is N)")
NO_PAD = -1

_GPT2_EOD = "<|endoftext|>"
# Tried in order for a tokenizers JSON, which has no notion of "the" end-of-document token.
_EOD_CANDIDATES = (_GPT2_EOD, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


@dataclass(frozen=True)
class TokenizerConfig:
    """The flags that choose a tokenizer (Megatron's names)."""

    tokenizer_type: str = DEFAULT_TOKENIZER_TYPE
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None

    @classmethod
    def from_args(cls, args: object) -> "TokenizerConfig":
        """Read the tokenizer flags from an argparse namespace (or anything with those names)."""
        return cls(
            tokenizer_type=getattr(args, "tokenizer_type", None) or DEFAULT_TOKENIZER_TYPE,
            vocab_file=getattr(args, "vocab_file", None),
            merge_file=getattr(args, "merge_file", None),
            tokenizer_model=getattr(args, "tokenizer_model", None),
            vocab_size=getattr(args, "vocab_size", None),
        )


def _identifiers(cls_name: str, **paths: Optional[str]) -> "OrderedDict[str, object]":
    """What megatron-core hashes (with the data config) to name its cached sample indices."""
    ids: "OrderedDict[str, object]" = OrderedDict(**{"class": cls_name})
    ids.update((k, os.path.abspath(v)) for k, v in paths.items() if v is not None)
    return ids


class ByteLevelTokenizer:
    """UTF-8 bytes as ids 0..255, then EOD (256) and PAD (257). Needs no files.

    `detokenize` drops the two special ids and decodes the bytes (invalid UTF-8 is replaced, as a
    byte window cut from a longer text may start or end inside a character).
    """

    eod = 256
    pad = 257

    def __init__(self) -> None:
        self.unique_identifiers = _identifiers(type(self).__name__)

    @property
    def vocab_size(self) -> int:
        return 258

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class _TokenizersLibraryTokenizer:
    """A `tokenizers.Tokenizer` plus the special ids the datasets need."""

    def __init__(self, tok: "object", eod: int, pad: int, unique_identifiers: OrderedDict) -> None:
        self._tok = tok
        self.eod = eod
        self.pad = pad
        self.unique_identifiers = unique_identifiers

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _first_known(tok: "object", candidates: Sequence[str]) -> Optional[int]:
    for token in candidates:
        token_id = tok.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def _pad_id(tok: "object", eod: int) -> int:
    """The vocabulary's own pad token, or NO_PAD (a pad equal to EOD would mask real EODs)."""
    pad = _first_known(tok, _PAD_CANDIDATES)
    return NO_PAD if pad is None or pad == eod else pad


def _require_readable(flag: str, path: Optional[str], tokenizer_type: str) -> str:
    if not path:
        raise ValueError(f"{flag} is required for --tokenizer-type {tokenizer_type}")
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: tokenizer file {path} does not exist")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag}: tokenizer file {path} is not readable")
    return path


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


class GPT2BPETokenizer(_TokenizersLibraryTokenizer):
    """GPT-2 byte-level BPE from Megatron's --vocab-file (vocab.json) and --merge-file
    (merges.txt); EOD is `<|endoftext|>`, as in Megatron."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        kind = type(self).__name__
        _require_readable("--vocab-file", vocab_file, kind)
        _require_readable("--merge-file", merge_file, kind)
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as err:  # the library raises plain Exception for unparsable files
            raise ValueError(f"--vocab-file/--merge-file: cannot read BPE files {vocab_file}, "
                             f"{merge_file}: {_one_line(err)}") from None
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        eod = tok.token_to_id(_GPT2_EOD)
        if eod is None:
            raise ValueError(f"--vocab-file: {vocab_file} has no {_GPT2_EOD} token")
        super().__init__(tok, eod, _pad_id(tok, eod),
                         _identifiers(kind, vocab_file=vocab_file, merge_file=merge_file))


class HuggingFaceTokenizer(_TokenizersLibraryTokenizer):
    """Any tokenizer saved by the `tokenizers` library (--tokenizer-model): its JSON file, or a
    Hugging Face model folder holding `tokenizer.json` (what `save_pretrained` writes).

    EOD: in a folder, the `eos_token` of its `tokenizer_config.json` (the model's own end of
    text); otherwise, or when that token is absent, the first of `_EOD_CANDIDATES` the vocabulary
    has. Pad likewise from `_PAD_CANDIDATES`.
    """

    def __init__(self, tokenizer_model: str) -> None:
        from tokenizers import Tokenizer

        kind = type(self).__name__
        folder = tokenizer_model if tokenizer_model and os.path.isdir(tokenizer_model) else None
        path = os.path.join(folder, HF_TOKENIZER_FILE) if folder else tokenizer_model
        _require_readable("--tokenizer-model", path, kind)
        try:
            tok = Tokenizer.from_file(path)
        except Exception as err:  # the library raises plain Exception for unparsable files
            raise ValueError(f"--tokenizer-model: cannot read tokenizer file {path}: "
                             f"{_one_line(err)}") from None
        eos = _folder_eos_token(folder) if folder else None
        eod = tok.token_to_id(eos) if eos is not None else None
        if eod is None:
            eod = _first_known(tok, _EOD_CANDIDATES)
        if eod is None:
            raise ValueError(f"--tokenizer-model: {path} has none of the end-of-document tokens "
                             f"{', '.join(((eos,) if eos else ()) + _EOD_CANDIDATES)}")
        super().__init__(tok, eod, _pad_id(tok, eod),
                         _identifiers(kind, tokenizer_model=path))


HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"


def _folder_eos_token(folder: str) -> Optional[str]:
    """The `eos_token` of a Hugging Face folder's tokenizer_config.json (a string or an
    AddedToken dict), or None when the file or the entry is missing."""
    path = os.path.join(folder, HF_TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as stream:
            eos = json.load(stream).get("eos_token")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"--tokenizer-model: cannot read {path}: {_one_line(err)}") from None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class NullTokenizer:
    """Megatron's NullTokenizer: text is already token ids ("12 7 31"); --vocab-size ids plus EOD
    (id --vocab-size). For --mock-data at a real model's vocabulary size (e.g. GPT-2's 50257)."""

    pad = NO_PAD

    def __init__(self, vocab_size: Optional[int]) -> None:
        if vocab_size is None:
            raise ValueError("--vocab-size is required for --tokenizer-type NullTokenizer")
        if vocab_size < 1:
            raise ValueError(f"--vocab-size must be >= 1, got {vocab_size}")
        self.eod = vocab_size
        self.unique_identifiers = _identifiers(type(self).__name__)
        self.unique_identifiers["vocab_size"] = vocab_size

    @property
    def vocab_size(self) -> int:
        return self.eod + 1

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(token) for token in text.split()]
        except ValueError:
            raise ValueError("NullTokenizer: text must be whitespace-separated token ids") from None
        if any(not 0 <= i < self.eod for i in ids):
            raise ValueError(f"NullTokenizer: token ids must lie in [0, {self.eod})")
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


AnyTokenizer = ByteLevelTokenizer | GPT2BPETokenizer | HuggingFaceTokenizer | NullTokenizer


def build_tokenizer(args: object) -> AnyTokenizer:
    """The tokenizer the flags ask for. `args` is a TokenizerConfig or anything with the flag
    attributes (an argparse namespace). Raises ValueError naming the flag on bad input."""
    cfg = args if isinstance(args, TokenizerConfig) else TokenizerConfig.from_args(args)
    if cfg.tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if cfg.tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if cfg.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(cfg.tokenizer_model)
    if cfg.tokenizer_type == "NullTokenizer":
        return NullTokenizer(cfg.vocab_size)
    raise ValueError(f"--tokenizer-type: unknown tokenizer {cfg.tokenizer_type!r}; "
                     f"choose from {', '.join(TOKENIZER_TYPES)}")
