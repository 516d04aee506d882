"""The Hugging Face folder: read its safetensors (one file or a sharded index), write one back.

Reading validates everything before anything is written: every file named, readable, holding the
tensors config.json implies with their shapes. Writing stages the folder next to its target and
renames it into place, so a failed export leaves no half-written model.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from seq1f1b.hf import ConversionError
from seq1f1b.hf.config import CONFIG_FILE, ModelSpec, read_json
from seq1f1b.hf.weights import check_hf_tensors
from seq1f1b.writable import check_output_dir

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Copied with the model both ways: what AutoTokenizer and generate() read.
COMPANION_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _weight_files(hf_dir: str) -> dict[str, Optional[set]]:
    """{file: the tensor names the index assigns it (None without an index)}."""
    index = os.path.join(hf_dir, SAFETENSORS_INDEX)
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ConversionError(f"{index}: 'weight_map' should map tensor names to file names")
        files: dict[str, Optional[set]] = {}
        for name, file in weight_map.items():
            files.setdefault(os.path.join(hf_dir, file), set()).add(name)
        return files
    single = os.path.join(hf_dir, SAFETENSORS_FILE)
    if not os.path.exists(single):
        raise ConversionError(f"{single}: no such file (nor {SAFETENSORS_INDEX}); only "
                              f"safetensors weights are read")
    return {single: None}


def _open(path: str):
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise ConversionError(f"{path}: no such file")
    try:
        return safe_open(path, framework="pt")
    except Exception as err:    # SafetensorError, OSError: a corrupt or unreadable file
        raise ConversionError(f"{path}: not a readable safetensors file "
                              f"({' '.join(str(err).split())})") from None


def read_hf_weights(hf_dir: str, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every tensor of the folder, checked against `spec` (ConversionError naming the file)."""
    files = _weight_files(hf_dir)
    shapes, source = {}, {}
    for path, listed in files.items():
        with _open(path) as handle:
            names = set(handle.keys())
            if listed is not None and not listed <= names:
                raise ConversionError(f"{path}: lacks {sorted(listed - names)[0]}, which "
                                      f"{SAFETENSORS_INDEX} places there")
            for name in names if listed is None else listed:
                shapes[name] = tuple(handle.get_slice(name).get_shape())
                source[name] = path
    where = os.path.join(hf_dir, SAFETENSORS_INDEX) if len(files) > 1 or \
        next(iter(files.values())) is not None else next(iter(files))
    check_hf_tensors(spec, shapes, where)
    tensors = {}
    for path in files:
        with _open(path) as handle:
            for name in (n for n, p in source.items() if p == path):
                try:
                    tensors[name] = handle.get_tensor(name)
                except Exception as err:    # a truncated or damaged data section
                    raise ConversionError(f"{path}: cannot read {name} "
                                          f"({' '.join(str(err).split())})") from None
    return tensors


def copy_companions(source_dir: str, target_dir: str, with_config: bool = False) -> list[str]:
    """Copy the tokenizer and generation files (and config.json) present in `source_dir`."""
    copied = []
    for name in ((CONFIG_FILE,) if with_config else ()) + COMPANION_FILES:
        path = os.path.join(source_dir, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(target_dir, name))
            copied.append(name)
    return copied


def check_new_folder(path: str, flag: str) -> None:
    """Refuse, before any work, an output folder write_hf_folder could not put in place: empty
    (it would stage into the current folder's parent), existing with something in it (nothing
    is overwritten), or one whose parent this user cannot write (it is staged beside `path` and
    renamed there: writable.check_output_dir)."""
    try:
        check_output_dir(path, flag)
        check_output_dir(os.path.dirname(os.path.abspath(path)), flag)
    except ValueError as err:
        raise ConversionError(str(err)) from None
    if os.path.exists(path) and os.listdir(path):
        raise ConversionError(f"{flag}: {path} exists and is not an empty directory")


def write_hf_folder(target: str, config: dict, tensors: dict[str, torch.Tensor],
                    companions_from: Optional[str]) -> None:
    """Write config.json, model.safetensors and the companion files of `companions_from`
    into a staging folder beside `target`, then rename it to `target`."""
    from safetensors.torch import save_file

    staging = f"{target.rstrip(os.sep)}.incomplete-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        if companions_from is not None:
            copy_companions(companions_from, staging)
        with open(os.path.join(staging, CONFIG_FILE), "w", encoding="utf-8") as stream:
            stream.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, os.path.join(staging, SAFETENSORS_FILE), metadata={"format": "pt"})
        os.replace(staging, target)     # an empty `target` directory is replaced too
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
