"""The model a checkpoint holds, compared with the model the flags describe.

A checkpoint carries its model: ours and Megatron-LM's store the run's flags (`args` in the common
state), a converted release stores the Hugging Face `config.json` it came from. Resuming,
fine-tuning and exporting compare those with the flags, so that a forgotten flag stops the run in
one line instead of training (or exporting) another model: megatron-core loads weights by name and
shape, so a different head count of the same width, another position embedding, a tied output
layer or another RoPE base load silently.

Two kinds of fields:
- architecture (shapes and the function the layers compute): they must agree;
- context (RoPE base, scaling, interpolation): a context extension changes them on purpose, so
  they may differ when the flag is given on the command line; left at its default, a checkpoint's
  other value is refused like an architecture field.

`--use-checkpoint-args` fills the model flags in from the checkpoint before validation, as
Megatron-LM's `load_args_from_checkpoint` does (the sizes only where the flag was not given).
`check_complete` reads a torch_dist checkpoint's index (`.metadata`) and refuses a checkpoint whose
shard files are missing or shorter than the index says, before any model is built.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable, Optional

from megatron.training.checkpoint_common import StartingPoint, read_common_state

DCP_INDEX = ".metadata"
"""torch.distributed.checkpoint's index of a torch_dist checkpoint: every tensor's shard file."""


def _bias_linear(ns: argparse.Namespace) -> bool:
    """Ours stores --disable-bias-linear; Megatron-LM stores its dest, add_bias_linear."""
    if hasattr(ns, "disable_bias_linear"):
        return not ns.disable_bias_linear
    return bool(getattr(ns, "add_bias_linear", True))


def _query_groups(ns: argparse.Namespace) -> int:
    if getattr(ns, "group_query_attention", False) and getattr(ns, "num_query_groups", None):
        return ns.num_query_groups
    return ns.num_attention_heads


def _rope(ns: argparse.Namespace) -> bool:
    return getattr(ns, "position_embedding_type", "learned_absolute") == "rope"


def _rope_scaling(ns: argparse.Namespace) -> Optional[float]:
    if not (_rope(ns) and getattr(ns, "use_rope_scaling", False)):
        return None
    return float(getattr(ns, "rope_scaling_factor", None) or 8.0)


@dataclass(frozen=True)
class ModelField:
    """One model property: how to read it from a flags namespace (ours or Megatron-LM's), the
    flag that sets it, and whether a context extension may change it on purpose."""

    name: str
    flag: str
    read: Callable[[argparse.Namespace], object]
    context: bool = False


def _attr(name: str, default: object = None) -> Callable[[argparse.Namespace], object]:
    return lambda ns: getattr(ns, name, default)


def _rope_only(read: Callable[[argparse.Namespace], object]) -> Callable:
    return lambda ns: read(ns) if _rope(ns) else None


MODEL_FIELDS = (
    ModelField("num_layers", "--num-layers", _attr("num_layers")),
    ModelField("hidden_size", "--hidden-size", _attr("hidden_size")),
    ModelField("ffn_hidden_size", "--ffn-hidden-size", _attr("ffn_hidden_size")),
    ModelField("num_attention_heads", "--num-attention-heads", _attr("num_attention_heads")),
    ModelField("num_query_groups", "--num-query-groups", _query_groups),
    ModelField("kv_channels", "--kv-channels",
               lambda ns: getattr(ns, "kv_channels", None)
               or ns.hidden_size // ns.num_attention_heads),
    ModelField("position_embedding_type", "--position-embedding-type",
               _attr("position_embedding_type", "learned_absolute")),
    ModelField("max_position_embeddings", "--max-position-embeddings",
               lambda ns: None if _rope(ns) or getattr(ns, "position_embedding_type", "") == "none"
               else getattr(ns, "max_position_embeddings", None)),
    ModelField("swiglu", "--swiglu", lambda ns: bool(getattr(ns, "swiglu", False))),
    ModelField("normalization", "--normalization", _attr("normalization", "LayerNorm")),
    ModelField("norm_epsilon", "--norm-epsilon", lambda ns: float(getattr(ns, "norm_epsilon",
                                                                          1e-5))),
    ModelField("add_bias_linear", "--disable-bias-linear", _bias_linear),
    ModelField("add_qkv_bias", "--add-qkv-bias", lambda ns: bool(getattr(ns, "add_qkv_bias",
                                                                         False))),
    ModelField("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights",
               lambda ns: bool(getattr(ns, "untie_embeddings_and_output_weights", False))),
    ModelField("rotary_percent", "--rotary-percent",
               _rope_only(lambda ns: float(getattr(ns, "rotary_percent", 1.0)))),
    ModelField("rotary_base", "--rotary-base",
               _rope_only(lambda ns: int(getattr(ns, "rotary_base", None) or 10000)), True),
    ModelField("rope_scaling_factor", "--use-rope-scaling / --rope-scaling-factor",
               _rope_scaling, True),
    ModelField("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor",
               _rope_only(_attr("rotary_seq_len_interpolation_factor")), True),
)
CONTEXT_FLAGS = {"rotary_base": ("rotary_base",),
                 "rope_scaling_factor": ("use_rope_scaling",),
                 "rotary_seq_len_interpolation_factor": ("rotary_seq_len_interpolation_factor",)}
"""Each context field's flags (dests); given on the command line, the field may differ."""


def model_values(ns: argparse.Namespace) -> dict[str, object]:
    """Every MODEL_FIELDS value of a (validated, or stored) flags namespace."""
    return {field.name: field.read(ns) for field in MODEL_FIELDS}


def explicit_context(args: argparse.Namespace) -> frozenset[str]:
    """The context fields whose flags were given (before validation fills in defaults)."""
    return frozenset(name for name, dests in CONTEXT_FLAGS.items()
                     if any(getattr(args, dest, None) not in (None, False) for dest in dests))


@dataclass(frozen=True)
class StoredModel:
    """The model a checkpoint holds: its flags namespace and where that came from."""

    args: argparse.Namespace
    source: str          # "the checkpoint's args" or the path of the release's config.json


def _release_model(folder: str) -> Optional[StoredModel]:
    """A converted release's model, from the config.json it carries (None without one)."""
    from seq1f1b.hf import ConversionError
    from seq1f1b.hf.checkpoint import RELEASE_HF_SUBDIR
    from seq1f1b.hf.config import CONFIG_FILE, read_spec

    hf_dir = os.path.join(folder, RELEASE_HF_SUBDIR)
    if not os.path.isfile(os.path.join(hf_dir, CONFIG_FILE)):
        return None
    try:
        _, spec = read_spec(hf_dir)
    except ConversionError as err:
        raise ValueError(str(err)) from None
    return StoredModel(spec_namespace(spec), os.path.join(hf_dir, CONFIG_FILE))


def spec_namespace(spec) -> argparse.Namespace:
    """The flags namespace of a config.json's model (seq1f1b.hf.config.ModelSpec): the flags the
    converter prints, parsed as pretrain_gpt.py parses them, and the context it was trained at."""
    from megatron.training.arguments import parse_args

    ns = parse_args(spec.model_flags())
    ns.max_position_embeddings = spec.max_position_embeddings
    return ns


def saved_args(folder: str, flag: str) -> Optional[argparse.Namespace]:
    """The flags a training checkpoint in `folder` stored (None when its common state has none);
    ValueError naming `flag` when the common state cannot be read."""
    try:
        common = read_common_state(folder)
    except ValueError as err:
        raise ValueError(f"{flag}: {err}") from None
    saved = common.get("args") if isinstance(common, dict) else None
    return saved if isinstance(saved, argparse.Namespace) else None


def stored_model(start: StartingPoint) -> Optional[StoredModel]:
    """The model the checkpoint `start` names holds, after checking its files are complete.

    None for a checkpoint that records no model (a release without config.json, a common state
    without `args`). Raises ValueError (one line naming the flag) for a missing or short shard
    file, an unreadable common state or config.json.
    """
    check_complete(start.folder, start.flag)
    if start.release:
        return _release_model(start.folder)
    saved = saved_args(start.folder, start.flag)
    return None if saved is None else StoredModel(saved, f"the checkpoint's args "
                                                         f"({start.folder})")


def check_complete(folder: str, flag: str) -> None:
    """Refuse a torch_dist checkpoint whose index or shard files are missing or cut short."""
    index = os.path.join(folder, DCP_INDEX)
    if not os.path.isfile(index):
        raise ValueError(f"{flag}: {folder} has no {DCP_INDEX}: not a complete torch_dist "
                         f"checkpoint")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(folder).read_metadata()
    except Exception as err:  # a truncated or foreign index: one line, not a traceback
        raise ValueError(f"{flag}: cannot read {index}: {type(err).__name__}") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ValueError(f"{flag}: {folder} is missing its shard file {name}")
        if os.path.getsize(path) < size:
            raise ValueError(f"{flag}: {path} is cut short ({os.path.getsize(path)} bytes, the "
                             f"index needs {size})")


def shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def mismatches(mine: dict[str, object], theirs: dict[str, object],
               explicit: frozenset[str] = frozenset(), context: bool = True
               ) -> list[tuple[ModelField, object, object]]:
    """(field, my value, their value) for each field that differs; context fields only when
    `context` and not given explicitly. An architecture value None on either side is unknown (a
    field an older writer left out) and not compared."""
    found = []
    for field in MODEL_FIELDS:
        if field.context and (not context or field.name in explicit):
            continue
        a, b = mine.get(field.name), theirs.get(field.name)
        known = field.context or (a is not None and b is not None)   # a context None is "off"
        if known and a != b:
            found.append((field, a, b))
    return found


def check_model(args: argparse.Namespace, stored: StoredModel, flag: str,
                explicit: frozenset[str]) -> None:
    """Refuse flags whose model differs from the checkpoint's: one line naming the flag and
    both values."""
    found = mismatches(model_values(args), model_values(stored.args), explicit)
    if found:
        field, mine, theirs = found[0]
        hint = (f"give {field.flag} to change it on purpose" if field.context
                else "the architecture must match")
        raise ValueError(f"{flag}: {field.flag} is {shown(mine)} here but {shown(theirs)} in "
                         f"{stored.source} ({hint}, or give --use-checkpoint-args to take the "
                         f"checkpoint's model)")


def fill_from_checkpoint(args: argparse.Namespace, stored: StoredModel,
                         explicit: frozenset[str]) -> None:
    """--use-checkpoint-args: the checkpoint's model flags, before validation. As Megatron-LM,
    the sizes are taken where the flag was not given and the rest is forced; context fields the
    command line gives stay (a context extension)."""
    values, saved = model_values(stored.args), stored.args
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "kv_channels", "seq_length", "max_position_embeddings"):
        value = getattr(saved, name, None)
        if getattr(args, name, None) is None and value is not None:
            setattr(args, name, value)
    groups = values["num_query_groups"]
    args.group_query_attention = groups != values["num_attention_heads"]
    args.num_query_groups = groups if args.group_query_attention else None
    for name in ("position_embedding_type", "swiglu", "normalization", "norm_epsilon",
                 "add_qkv_bias", "untie_embeddings_and_output_weights"):
        setattr(args, name, values[name])
    args.disable_bias_linear = not values["add_bias_linear"]
    if values["rotary_percent"] is not None:
        args.rotary_percent = values["rotary_percent"]
    if "rotary_base" not in explicit and values["rotary_base"] is not None:
        args.rotary_base = values["rotary_base"]
    if "rope_scaling_factor" not in explicit:
        args.use_rope_scaling = values["rope_scaling_factor"] is not None
        args.rope_scaling_factor = values["rope_scaling_factor"]
    if "rotary_seq_len_interpolation_factor" not in explicit:
        args.rotary_seq_len_interpolation_factor = values["rotary_seq_len_interpolation_factor"]
