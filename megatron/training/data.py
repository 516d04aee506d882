"""Training data: megatron-core's GPT datasets, checked up front, fed as micro-batches per DP rank.

What is ours here and what is megatron-core's:
- `check_indexed_dataset` and `parse_data_path` validate the user's --data-path before any work
  (a missing or corrupt file would otherwise surface as an assert deep inside megatron-core, or, for
  a split with no documents, as an endless loop in GPTDataset's epoch count).
- `build_datasets` hands the blend to megatron-core's BlendedMegatronDatasetBuilder with
  GPTDataset (or MockGPTDataset for --mock-data); sampling, shuffling and blending are megatron's.
- `MicroBatchIterator` replaces Megatron's sampler + DataLoader: the same order (each step takes
  micro x DP consecutive samples, rank r the r-th slice), resumable from a consumed-samples count.

Sample-index cache (megatron-core writes one for every real dataset): with --data-cache-path it
goes there, otherwise megatron's default, `<prefix>/cache/GPTDataset_indices/` next to the data.
When torch.distributed is initialised, the builder builds on global rank 0 first, then barriers on
the default group (gloo on CPU works), then the other ranks read the cache, so `build_datasets` must
be called on every rank. Without a process group, megatron's BlendedDataset calls get_rank() when a
cache path is set, so blending with --data-cache-path then raises a ValueError naming the flag.

megatron.core and torch are imported inside the functions that need them (~4 s and ~1.5 s per
process): argument validation calls the checks here and must stay instant.
"""
from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import numpy

if TYPE_CHECKING:
    import torch

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8   # magic, version, dtype code, sequence count, doc count
# Token dtypes of megatron-core's IndexedDataset, by the code stored in the .idx header.
_IDX_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
               6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class IndexedDatasetInfo:
    """What the .idx header says about one --data-path prefix."""

    prefix: str
    num_sequences: int      # GPTDataset splits a dataset by sequence (one per document here)
    num_documents: int
    num_tokens: int
    dtype: type


def check_indexed_dataset(prefix: str, flag: str = "--data-path") -> IndexedDatasetInfo:
    """Check that `prefix`.bin/.idx exist and agree with each other, reading only the index.

    Raises ValueError with one line naming `flag` and the file.
    """
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            raise ValueError(f"{flag}: give the prefix without {ext}: {prefix[:-len(ext)]}")
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ValueError(f"{flag}: {path} does not exist")

    def corrupt(reason: str) -> ValueError:
        return ValueError(f"{flag}: {idx_path} is not a valid Megatron index: {reason}")

    try:
        with open(idx_path, "rb") as stream:
            header = stream.read(_IDX_HEADER_BYTES)
            if len(header) < _IDX_HEADER_BYTES or header[:9] != _IDX_MAGIC:
                raise corrupt("bad header")
            version, code, num_seq, num_doc_bounds = struct.unpack("<QBQQ", header[9:])
            if version != 1:
                raise corrupt(f"version {version}, expected 1")
            if code not in _IDX_DTYPES:
                raise corrupt(f"unknown token dtype code {code}")
            expected = _IDX_HEADER_BYTES + num_seq * (4 + 8) + num_doc_bounds * 8
            actual = os.path.getsize(idx_path)
            if actual != expected:
                raise corrupt(f"{actual} bytes, header implies {expected}")
            lengths = numpy.fromfile(stream, dtype=numpy.int32, count=num_seq)
            stream.seek(_IDX_HEADER_BYTES + num_seq * (4 + 8))
            doc_bounds = numpy.fromfile(stream, dtype=numpy.int64, count=num_doc_bounds)
    except OSError as err:
        raise ValueError(f"{flag}: cannot read {idx_path}: {err.strerror}") from None
    if num_seq == 0:
        raise ValueError(f"{flag}: {idx_path} holds no documents")
    if num_doc_bounds < 2 or doc_bounds[0] != 0 or doc_bounds[-1] != num_seq:
        raise corrupt("document boundaries do not match the sequence count")
    if (lengths < 0).any():
        raise corrupt("negative sequence length")
    dtype = _IDX_DTYPES[code]
    num_tokens = int(lengths.sum(dtype=numpy.int64))
    bin_bytes = os.path.getsize(bin_path)
    if bin_bytes != num_tokens * numpy.dtype(dtype).itemsize:
        raise ValueError(f"{flag}: {bin_path} has {bin_bytes} bytes, its index implies "
                         f"{num_tokens * numpy.dtype(dtype).itemsize}")
    return IndexedDatasetInfo(prefix, num_seq, num_doc_bounds - 1, num_tokens, dtype)


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """Megatron's --data-path: `PREFIX [PREFIX ...]` or `WEIGHT PREFIX [WEIGHT PREFIX ...]`.

    Returns (prefixes, weights or None). Raises ValueError naming --data-path.
    """
    items = list(data_path)
    if not items:
        raise ValueError("--data-path: no dataset prefix given")

    def as_weight(text: str) -> Optional[float]:
        try:
            return float(text)
        except ValueError:
            return None

    weights = [as_weight(x) for x in items[0::2]]
    if all(w is None for w in weights):
        return items, None
    if len(items) % 2 or any(w is None for w in weights):
        raise ValueError("--data-path: expected prefixes, or WEIGHT PREFIX pairs, got "
                         f"{' '.join(items)}")
    for weight, prefix in zip(weights, items[1::2]):
        if not 0 < weight < math.inf:
            raise ValueError(f"--data-path: weight {weight:g} of {prefix} must be a finite "
                             "positive number")
    if not math.isfinite(sum(weights)):      # normalised by their sum
        raise ValueError("--data-path: the weights' sum overflows; give relative weights")
    return items[1::2], weights


def parse_split(split: str) -> list[float]:
    """Megatron's --split ("949,50,1"; "/" also separates): normalised train/valid/test fractions.

    Raises ValueError naming --split.
    """
    try:
        values = [float(part) for part in re.split(r"[,/]", split.strip())]
    except ValueError:
        raise ValueError(f"--split: expected up to three numbers like 949,50,1, got {split!r}") \
            from None
    if not 1 <= len(values) <= 3 or any(not 0 <= v < math.inf for v in values) or \
            not 0 < sum(values) < math.inf:
        raise ValueError(f"--split: expected up to three finite non-negative numbers with a "
                         f"positive sum, got {split!r}")
    vector = numpy.array(values + [0.0] * (3 - len(values)), dtype=numpy.float64)
    return (vector / numpy.sum(vector)).tolist()


def split_document_ranges(split: str, num_sequences: int) -> list[Optional[range]]:
    """The sequence indices each split of one dataset gets, None for an empty fraction.

    The same rule as megatron-core's builder (cumulative fractions, rounded bookends), so that a
    split which would receive no documents can be rejected before megatron loops forever on it.
    """
    ranges: list[Optional[range]] = []
    start = 0.0
    for fraction in parse_split(split):
        end = start + fraction
        ranges.append(None if end <= start else
                      range(int(round(start * num_sequences)), int(round(end * num_sequences))))
        start = end
    return ranges


def check_splits_have_documents(split: str, infos: Sequence[IndexedDatasetInfo]) -> None:
    """Every split with a non-zero fraction must get at least one document of every dataset."""
    for info in infos:
        for name, docs in zip(SPLIT_NAMES, split_document_ranges(split, info.num_sequences)):
            if docs is not None and len(docs) == 0:
                raise ValueError(f"--split: the {name} split of {info.prefix} gets no documents "
                                 f"({info.num_sequences} in all); give that split 0 or more data")


def train_valid_test_num_samples(train_iters: int, global_batch_size: int, eval_interval: int,
                                 eval_iters: int) -> tuple[int, int, int]:
    """Samples each split must provide (Megatron's rule: an evaluation of eval_iters global
    batches every eval_interval iterations and one at the end; one for the test set)."""
    evaluations = train_iters // eval_interval + 1
    return (train_iters * global_batch_size,
            evaluations * eval_iters * global_batch_size,
            eval_iters * global_batch_size)


@dataclass(frozen=True)
class DataConfig:
    """The data flags, as the dataset builder needs them."""

    seq_length: int
    seed: int = 1234
    data_path: tuple[str, ...] = ()
    split: str = "969,30,1"
    mock_data: bool = False
    data_cache_path: Optional[str] = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    mmap_bin_files: bool = True

    @classmethod
    def from_args(cls, args: object) -> "DataConfig":
        return cls(seq_length=args.seq_length, seed=args.seed,
                   data_path=tuple(args.data_path or ()), split=args.split,
                   mock_data=args.mock_data, data_cache_path=args.data_cache_path,
                   eod_mask_loss=args.eod_mask_loss,
                   reset_position_ids=args.reset_position_ids,
                   reset_attention_mask=args.reset_attention_mask,
                   mmap_bin_files=getattr(args, "mmap_bin_files", True))


def check_data_config(config: DataConfig) -> list[IndexedDatasetInfo]:
    """All checks that need only the flags and the .idx files; raises ValueError naming the flag."""
    if config.mock_data:
        return []
    prefixes, _ = parse_data_path(config.data_path)
    infos = [check_indexed_dataset(prefix) for prefix in prefixes]
    check_splits_have_documents(config.split, infos)
    return infos


TOKEN_SCAN_CHUNK = 1 << 24
"""Tokens read at a time when scanning a .bin for its largest id."""


def check_token_ids(infos: Sequence[IndexedDatasetInfo], vocab_rows: int,
                    flag: str = "--data-path") -> None:
    """Refuse a dataset holding a token id outside the model's `vocab_rows` embedding rows (on a
    GPU, a device-side assert in the first forward; on the CPU an IndexError), before any work.

    Reads every .bin once, in chunks (about a second per GB).
    """
    for info in infos:
        tokens = numpy.memmap(info.prefix + ".bin", dtype=info.dtype, mode="r")
        for start in range(0, len(tokens), TOKEN_SCAN_CHUNK):
            chunk = tokens[start:start + TOKEN_SCAN_CHUNK]
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= vocab_rows:
                bad = low if low < 0 else high
                raise ValueError(f"{flag}: {info.prefix}.bin holds token id {bad}, outside the "
                                 f"model's vocabulary of {vocab_rows} rows (0 to "
                                 f"{vocab_rows - 1}): tokenized with another tokenizer?")


def _every_rank() -> bool:
    return True


def build_datasets(config: DataConfig, tokenizer: object, num_samples: Sequence[int],
                   is_built_on_rank: Callable[[], bool] = _every_rank) -> list:
    """[train, valid, test] megatron-core datasets (None for a split with fraction 0).

    Each item is a dict of 1-D tensors: tokens, labels, loss_mask, position_ids (restarting
    after each EOD with --reset-position-ids); never megatron's [s, s] attention mask: with
    --reset-attention-mask `collate` derives the compact document ids instead. Call on every rank
    when torch.distributed is initialised.
    """
    check_data_config(config)
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    blend = None if config.mock_data else parse_data_path(config.data_path)
    if (blend is not None and config.data_cache_path and (len(blend[0]) > 1 or blend[1])
            and not torch.distributed.is_initialized()):
        raise ValueError("--data-cache-path: blending several datasets with a cache path needs an "
                         "initialised torch.distributed process group")
    dataset_config = GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.seq_length,
        blend=blend,
        split=None if config.mock_data else config.split,
        path_to_cache=config.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=config.mmap_bin_files,
    )
    dataset_cls = MockGPTDataset if config.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_cls, list(num_samples), is_built_on_rank,
                                         dataset_config).build()


Batch = "dict[str, Optional[torch.Tensor]]"
"""tokens, labels (int64), loss_mask (float32), position_ids (int64): [micro, seq];
attention_mask: None (causal), or with --reset-attention-mask the document ids (int32
[micro, 1, 1, seq], seq1f1b/runtime/documents.py)."""


class MicroBatchIterator:
    """Micro-batches of one data-parallel rank, in Megatron's pretraining-sampler order.

    Step t takes dataset samples [c, c + micro x DP) with c = consumed_samples, and rank r gets the
    slice [c + r x micro, c + (r+1) x micro). `consumed_samples` counts samples taken by all DP
    ranks together, so it is the same on every rank and is what a checkpoint stores; a new iterator
    built with it continues exactly where the old one stopped. Stops when a full step no longer
    fits. `document_eod`: the EOD token when documents are masked (--reset-attention-mask).
    """

    def __init__(self, dataset: object, micro_batch_size: int, data_parallel_rank: int = 0,
                 data_parallel_size: int = 1, consumed_samples: int = 0,
                 document_eod: Optional[int] = None) -> None:
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError("micro_batch_size and data_parallel_size must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is outside "
                             f"[0, {data_parallel_size})")
        step = micro_batch_size * data_parallel_size
        if consumed_samples < 0 or consumed_samples % step:
            raise ValueError(f"consumed_samples {consumed_samples} is not a multiple of "
                             f"micro x DP = {step}")
        if consumed_samples > len(dataset):
            raise ValueError(f"consumed_samples {consumed_samples} exceeds the dataset's "
                             f"{len(dataset)} samples")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.document_eod = document_eod
        self._consumed = consumed_samples

    @property
    def consumed_samples(self) -> int:
        return self._consumed

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        step = self.micro_batch_size * self.data_parallel_size
        if self._consumed + step > len(self.dataset):
            raise StopIteration
        first = self._consumed + self.data_parallel_rank * self.micro_batch_size
        samples = [self.dataset[i] for i in range(first, first + self.micro_batch_size)]
        self._consumed += step
        return collate(samples, self.document_eod)


def collate(samples: Sequence[dict], document_eod: Optional[int] = None) -> Batch:
    """Stack megatron-core dataset samples into a [micro, seq] batch; attention_mask is None
    (causal), or the tokens' document ids when `document_eod` is given (megatron-core's
    reset-attention-mask rule: the EOD closes its document)."""
    import torch

    from seq1f1b.runtime.documents import document_ids

    batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
             for key in ("tokens", "labels", "loss_mask", "position_ids")}
    batch["attention_mask"] = (None if document_eod is None else
                               document_ids(batch["tokens"], document_eod))
    return batch


def build_data_iterators(args: object, tokenizer: object, data_parallel_rank: int,
                         data_parallel_size: int, consumed_train_samples: int = 0,
                         consumed_valid_samples: int = 0,
                         is_built_on_rank: Callable[[], bool] = _every_rank
                         ) -> tuple[Optional[MicroBatchIterator], ...]:
    """(train, valid, test) iterators of this DP rank from validated args (None for an empty split).

    Sizes follow `train_valid_test_num_samples`; the test iterator always starts at 0.
    """
    num_samples = train_valid_test_num_samples(args.train_iters, args.global_batch_size,
                                               args.eval_interval, args.eval_iters)
    datasets = build_datasets(DataConfig.from_args(args), tokenizer, num_samples,
                              is_built_on_rank)
    starts = (consumed_train_samples, consumed_valid_samples, 0)
    return tuple(
        None if dataset is None else
        MicroBatchIterator(dataset, args.micro_batch_size, data_parallel_rank,
                           data_parallel_size, start,
                           tokenizer.eod if args.reset_attention_mask else None)
        for dataset, start in zip(datasets, starts))
