"""Convert a JSONL corpus into Megatron's indexed dataset (.bin/.idx), one pair per JSON key.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --append-eod --workers 2
    -> data/corpus_text_document.bin, data/corpus_text_document.idx   (use data/corpus_text_document
       as --data-path)

Megatron's flags and file names; the files are written by megatron-core's IndexedDatasetBuilder.
Outputs are written under temporary names and renamed only when the whole input was read, so a bad
line (reported with its number: one line on stderr, exit code 2) leaves no partial dataset behind.
Documents that tokenise to nothing are skipped (and counted).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
import warnings
from typing import Iterable, Iterator, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.arguments import ArgumentParser  # noqa: E402
from megatron.training.tokenizer import (  # noqa: E402
    TokenizerConfig, add_tokenizer_args, build_tokenizer, unread_flag_error)
from seq1f1b.writable import check_output_prefix  # noqa: E402


class InputError(ValueError):
    """Bad user input; the message is one line naming the flag."""


def get_args(argv: Optional[Sequence[str]] = None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each JSON object (default: text)")
    group = parser.add_argument_group("tokenizer")
    add_tokenizer_args(group)
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes <prefix>_<key>_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="print progress every this many documents")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    return args


class Encoder:
    """Parses and tokenises one JSONL line; one per process."""

    def __init__(self, tokenizer_config: TokenizerConfig, json_keys: Sequence[str],
                 append_eod: bool, input_name: str) -> None:
        self.tokenizer = build_tokenizer(tokenizer_config)
        self.json_keys = tuple(json_keys)
        self.append_eod = append_eod
        self.input_name = input_name

    def __call__(self, numbered_line: tuple[int, str]) -> tuple[int, dict | str]:
        """(bytes read, {key: token ids}), or (bytes read, a one-line error naming the line)."""
        lineno, line = numbered_line
        nbytes = len(line.encode("utf-8"))
        where = f"line {lineno} of {self.input_name}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            return nbytes, f"--input: {where} is not valid JSON: {err.msg}"
        if not isinstance(record, dict):
            return nbytes, f"--input: {where} is not a JSON object"
        ids = {}
        for key in self.json_keys:
            if key not in record:
                return nbytes, f"--json-keys: {where} has no key {key!r}"
            if not isinstance(record[key], str):
                return nbytes, f"--json-keys: {where}: {key!r} is not a string"
            ids[key] = self.tokenizer.tokenize(record[key])
            if self.append_eod:
                ids[key].append(self.tokenizer.eod)
        return nbytes, ids


_worker_encoder: Optional[Encoder] = None


def _start_worker(*encoder_args) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(*encoder_args)


def _encode_in_worker(numbered_line: tuple[int, str]) -> tuple[int, dict | str]:
    return _worker_encoder(numbered_line)


def numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines."""
    with open(path, encoding="utf-8") as stream:
        for lineno, line in enumerate(stream, 1):
            if line.strip():
                yield lineno, line


def output_prefixes(output_prefix: str, json_keys: Sequence[str]) -> dict[str, str]:
    """Megatron's names: <prefix>_<key>_document."""
    return {key: f"{output_prefix}_{key}_document" for key in json_keys}


def check_tokenizer_flags(args) -> None:
    """Refuse a tokenizer flag the chosen tokenizer never reads (e.g. --vocab-size under the
    default byte-level tokenizer), as pretrain_gpt.py does."""
    unread = unread_flag_error(args, TokenizerConfig.from_args(args).tokenizer_type)
    if unread is not None:
        raise InputError(unread)


def check_paths(args) -> None:
    """Before any work: the input exists, the output prefix names files in a writable folder
    (writable.check_output_prefix), the keys are distinct and every tokenizer flag is read."""
    if not os.path.isfile(args.input):
        raise InputError(f"--input: {args.input} does not exist")
    try:
        check_output_prefix(args.output_prefix, "--output-prefix")
    except ValueError as err:
        raise InputError(str(err)) from None
    check_tokenizer_flags(args)
    if len(set(args.json_keys)) != len(args.json_keys):
        raise InputError(f"--json-keys: repeated key in {' '.join(args.json_keys)}")


class Progress:
    """Megatron-style progress lines: documents, documents/s, MB/s."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.start = time.time()
        self.docs = 0
        self.bytes = 0

    def update(self, nbytes: int) -> None:
        self.docs += 1
        self.bytes += nbytes
        if self.docs % self.interval == 0:
            print(self.line(), flush=True)

    def line(self) -> str:
        elapsed = max(time.time() - self.start, 1e-9)
        return (f"Processed {self.docs} documents ({self.docs / elapsed:.1f} docs/s, "
                f"{self.bytes / elapsed / 1024 / 1024:.2f} MB/s).")


def encode_all(encoder_args: tuple, lines: Iterable[tuple[int, str]], workers: int):
    """Encoded lines in input order, tokenised in `workers` processes when > 1."""
    if workers == 1:
        yield from map(Encoder(*encoder_args), lines)
        return
    with multiprocessing.Pool(workers, initializer=_start_worker, initargs=encoder_args) as pool:
        yield from pool.imap(_encode_in_worker, lines, chunksize=64)


def preprocess(args) -> dict[str, str]:
    """Writes the datasets; returns {key: output prefix}. Raises InputError on bad input."""
    check_paths(args)
    tokenizer_config = TokenizerConfig.from_args(args)
    try:
        tokenizer = build_tokenizer(tokenizer_config)
    except ValueError as err:
        raise InputError(str(err)) from None
    with warnings.catch_warnings():  # megatron.core's import warns that TE/Apex are absent
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    encoder_args = (tokenizer_config, args.json_keys, args.append_eod, args.input)
    finals = output_prefixes(args.output_prefix, args.json_keys)
    partial = {key: f"{prefix}.partial-{os.getpid()}" for key, prefix in finals.items()}
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {key: IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
                for key, prefix in partial.items()}
    progress, skipped, tokens = Progress(args.log_interval), 0, 0
    results = encode_all(encoder_args, numbered_lines(args.input), args.workers)
    try:
        for nbytes, result in results:
            if isinstance(result, str):
                raise InputError(result)
            for key, ids in result.items():
                if ids:
                    builders[key].add_document(ids, [len(ids)])
                    tokens += len(ids)
                else:
                    skipped += 1
            progress.update(nbytes)
        if progress.docs == 0:
            raise InputError(f"--input: {args.input} holds no JSON lines")
        for key, builder in builders.items():
            builder.finalize(partial[key] + ".idx")
            for ext in (".bin", ".idx"):
                os.replace(partial[key] + ext, finals[key] + ext)
    except UnicodeDecodeError as err:
        raise InputError(f"--input: {args.input} is not UTF-8 text ({err.reason})") from None
    finally:
        results.close()  # stops the worker pool early on a bad line
        for builder in builders.values():
            builder.data_file.close()
        for prefix in partial.values():
            for ext in (".bin", ".idx"):
                if os.path.exists(prefix + ext):
                    os.remove(prefix + ext)
    print(f"{progress.line()} Done: {tokens} tokens, {skipped} empty documents skipped -> "
          + ", ".join(f"{p}.bin/.idx" for p in finals.values()), flush=True)
    return finals


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args(argv)
    try:
        preprocess(args)
    except InputError as err:
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
