"""config.json of a Llama / Mistral / Qwen2 folder as the model's shape and Megatron-LM's flags.

Read without importing transformers (seconds of imports for a dictionary): fields a config may
omit take transformers 4.57's defaults of its family. What megatron-core cannot build exactly is
refused in one line naming config.json: other architectures, a head_dim other than
hidden/heads, biases outside Qwen2's QKV, activations other than SiLU, RoPE scaling other than
Llama 3's with megatron-core's fixed factors (RotaryEmbedding._apply_scaling: low 1, high 4,
original context 8192). A sliding window is reported, not refused: Seq1F1B attends over the
whole sequence, so the model is unchanged only while --seq-length <= the window.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from seq1f1b.hf import ConversionError
from seq1f1b.model_flags import shape_flags
from seq1f1b.plan.costs import padded_vocab_size

CONFIG_FILE = "config.json"
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2"}
# transformers 4.57's class defaults for the fields a config.json may leave out.
_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048, sliding_window=None),
    "mistral": dict(max_position_embeddings=4096 * 32, sliding_window=4096),
    "qwen2": dict(max_position_embeddings=32768, sliding_window=None),
}
_COMMON_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                        hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
                        mlp_bias=False, torch_dtype="float32")
LLAMA3_FACTORS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelSpec:
    """What a config.json says about the model, in megatron's terms."""

    family: str                         # llama | mistral | qwen2
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int               # K/V heads (= attention heads without GQA)
    ffn_hidden_size: int
    vocab_size: int                     # rows of the embedding and output layer
    max_position_embeddings: int        # the context the model was trained at
    tie_word_embeddings: bool
    qkv_bias: bool                      # Qwen2
    norm_epsilon: float
    rotary_base: int
    rope_scaling_factor: Optional[float]    # Llama 3 frequency scaling, or None
    sliding_window: Optional[int]
    dtype: str                          # the weights' dtype as config.json gives it

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def architecture(self):
        """The megatron_adapter.Architecture of this model."""
        from seq1f1b.megatron_adapter import Architecture

        return Architecture(
            num_query_groups=(self.num_query_groups
                              if self.num_query_groups != self.num_attention_heads else None),
            swiglu=True, normalization="RMSNorm", norm_epsilon=self.norm_epsilon,
            add_bias_linear=False, add_qkv_bias=self.qkv_bias, rotary_base=self.rotary_base,
            use_rope_scaling=self.rope_scaling_factor is not None,
            rope_scaling_factor=self.rope_scaling_factor or 8.0)

    def model_flags(self) -> list[str]:
        """pretrain_gpt.py's flags for this model (Megatron-LM's names)."""
        flags = shape_flags(num_layers=self.num_layers, hidden_size=self.hidden_size,
                            num_attention_heads=self.num_attention_heads,
                            ffn_hidden_size=self.ffn_hidden_size,
                            num_query_groups=self.num_query_groups, swiglu=True,
                            normalization="RMSNorm", add_bias_linear=False,
                            add_qkv_bias=self.qkv_bias)
        flags += ["--norm-epsilon", repr(self.norm_epsilon)]
        flags += ["--position-embedding-type", "rope", "--rotary-base", str(self.rotary_base)]
        if self.rope_scaling_factor is not None:
            flags += ["--use-rope-scaling", "--rope-scaling-factor",
                      repr(self.rope_scaling_factor)]
        if not self.tie_word_embeddings:
            flags.append("--untie-embeddings-and-output-weights")
        return flags + ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _fail(path: str, message: str) -> ConversionError:
    return ConversionError(f"{path}: {message}")


def read_json(path: str) -> dict:
    """A JSON object from `path`; ConversionError naming the file when missing or corrupt."""
    if not os.path.isfile(path):
        raise _fail(path, "no such file")
    try:
        with open(path, encoding="utf-8") as stream:
            value = json.load(stream)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise _fail(path, f"not readable JSON ({' '.join(str(err).split())})") from None
    if not isinstance(value, dict):
        raise _fail(path, f"should hold a JSON object, not {type(value).__name__}")
    return value


def _integer(raw: dict, name: str, path: str, minimum: int = 1) -> int:
    value = raw.get(name)
    if value is None:
        raise _fail(path, f"missing {name!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _family(raw: dict, path: str) -> str:
    names = raw.get("architectures")
    if not isinstance(names, list) or len(names) != 1 or names[0] not in FAMILIES:
        raise _fail(path, f"architectures {names!r} is not supported; convertible: "
                          f"{', '.join(FAMILIES)}")
    return FAMILIES[names[0]]


def _rope_scaling_factor(scaling, path: str) -> Optional[float]:
    """None for plain RoPE, the factor for Llama 3's scaling; anything else is refused."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind == "default":
        return None
    if kind != "llama3":
        raise _fail(path, f"rope_scaling {scaling!r}: only rope_type 'llama3' is supported")
    others = {name: scaling.get(name) for name in LLAMA3_FACTORS}
    if others != LLAMA3_FACTORS:
        raise _fail(path, f"rope_scaling llama3 with {others}: megatron-core's Llama 3 scaling "
                          f"has low_freq_factor 1, high_freq_factor 4 and "
                          f"original_max_position_embeddings 8192")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise _fail(path, f"rope_scaling factor must be a number > 0, got {factor!r}")
    return float(factor)


def _sliding_window(raw: dict, family: str, path: str) -> Optional[int]:
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window", _DEFAULTS[family]["sliding_window"])
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise _fail(path, f"sliding_window must be an integer or null, got {window!r}")
    return window


def spec_from_config(raw: dict, path: str) -> ModelSpec:
    """The ModelSpec of a parsed config.json (`path` names it in errors)."""
    family = _family(raw, path)
    get = {**_COMMON_DEFAULTS, **_DEFAULTS[family], **raw}.get
    hidden = _integer(raw, "hidden_size", path)
    heads = _integer(raw, "num_attention_heads", path)
    groups = raw.get("num_key_value_heads") or heads
    if family != "llama" and "num_key_value_heads" not in raw:
        raise _fail(path, "missing 'num_key_value_heads'")
    if not isinstance(groups, int) or heads % groups:
        raise _fail(path, f"num_attention_heads {heads} is not divisible by "
                          f"num_key_value_heads {groups!r}")
    if hidden % heads:
        raise _fail(path, f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise _fail(path, f"head_dim {head_dim} differs from hidden_size / num_attention_heads "
                          f"= {hidden // heads}; not supported")
    if get("hidden_act") != "silu":
        raise _fail(path, f"hidden_act {get('hidden_act')!r}: only 'silu' (SwiGLU) is supported")
    if family == "llama" and (get("attention_bias") or get("mlp_bias")):
        raise _fail(path, "attention_bias / mlp_bias: Llama with linear biases is not supported")
    theta = get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0 \
            or theta != math.floor(theta):
        raise _fail(path, f"rope_theta must be a positive whole number (--rotary-base is an "
                          f"integer), got {theta!r}")
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _fail(path, "partial_rotary_factor other than 1 is not supported")
    eps = get("rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise _fail(path, f"rms_norm_eps must be a number > 0, got {eps!r}")
    dtype = raw.get("torch_dtype", raw.get("dtype")) or "float32"
    if dtype not in DTYPES:
        raise _fail(path, f"torch_dtype {dtype!r}: one of {', '.join(DTYPES)} expected")
    return ModelSpec(
        family=family, num_layers=_integer(raw, "num_hidden_layers", path),
        hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=_integer(raw, "intermediate_size", path),
        vocab_size=_integer(raw, "vocab_size", path),
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(get("tie_word_embeddings")), qkv_bias=family == "qwen2",
        norm_epsilon=float(eps), rotary_base=int(theta),
        rope_scaling_factor=_rope_scaling_factor(get("rope_scaling"), path),
        sliding_window=_sliding_window(raw, family, path), dtype=dtype)


def read_spec(hf_dir: str) -> tuple[dict, ModelSpec]:
    """(config.json as parsed, its ModelSpec) of the Hugging Face folder `hf_dir`."""
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"--hf-dir: {hf_dir} is not a directory")
    path = os.path.join(hf_dir, CONFIG_FILE)
    raw = read_json(path)
    return raw, spec_from_config(raw, path)


@dataclass(frozen=True)
class Layout:
    """The parallel layout the user will train at (--tp --pp --vpp of the converter)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1


def check_layout(spec: ModelSpec, layout: Layout, config_path: str) -> None:
    """Refuse a layout megatron cannot build this model at (naming the flag)."""
    for flag, value in (("--tp", layout.tp), ("--pp", layout.pp), ("--vpp", layout.vpp)):
        if value < 1:
            raise ConversionError(f"{flag} must be >= 1, got {value}")
    for what, count in (("num_attention_heads", spec.num_attention_heads),
                        ("num_key_value_heads", spec.num_query_groups),
                        ("intermediate_size", spec.ffn_hidden_size),
                        ("vocab_size", spec.vocab_size)):
        if count % layout.tp:
            raise ConversionError(f"--tp {layout.tp} does not divide {config_path} "
                                  f"{what} {count}")
    if layout.vpp > 1 and layout.pp < 2:
        raise ConversionError(f"--vpp {layout.vpp} needs --pp >= 2 (interleaved pipelines)")
    chunks = layout.pp * layout.vpp
    if spec.num_layers % chunks:
        raise ConversionError(f"--pp {layout.pp} x --vpp {layout.vpp} does not divide "
                              f"{config_path} num_hidden_layers {spec.num_layers}")


def vocab_divisor(model_vocab: int, tokenizer_vocab: int, tp: int) -> int:
    """The --make-vocab-size-divisible-by that makes Megatron pad `tokenizer_vocab` to exactly
    `model_vocab` rows at TP `tp` (Megatron's own 128 when it does, else the largest power of two
    below it, else model_vocab / tp); ConversionError when none does.

    The rows beyond the tokenizer's ids are kept rather than cut or padded: they take part in the
    softmax, so any other row count changes the model's loss.
    """
    if tokenizer_vocab > model_vocab:
        raise ConversionError(f"the tokenizer has {tokenizer_vocab} tokens, more than "
                              f"config.json vocab_size {model_vocab}")
    for divisor in (128, 64, 32, 16, 8, 4, 2, 1, model_vocab // tp):
        if divisor >= 1 and padded_vocab_size(tokenizer_vocab, divisor, tp) == model_vocab:
            return divisor
    raise ConversionError(f"--tp {tp}: no --make-vocab-size-divisible-by pads the tokenizer's "
                          f"{tokenizer_vocab} tokens to config.json vocab_size {model_vocab}")


def training_flags(spec: ModelSpec, layout: Layout, *, load_dir: str, tokenizer_model: Optional[str],
                   tokenizer_vocab: Optional[int]) -> list[str]:
    """Everything pretrain_gpt.py needs to resume the converted checkpoint: model, layout,
    tokenizer and vocabulary padding flags and --load. Without a tokenizer in the folder the
    vocabulary is assumed to be the model's (NullTokenizer ids 0 .. vocab_size - 2 plus EOD)."""
    flags = spec.model_flags() + ["--tensor-model-parallel-size", str(layout.tp),
                                  "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.vpp > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage",
                  str(spec.num_layers // (layout.pp * layout.vpp))]
    if tokenizer_model is not None:
        flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                  tokenizer_model]
    else:
        flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(spec.vocab_size - 1)]
    vocab = tokenizer_vocab if tokenizer_vocab is not None else spec.vocab_size
    flags += ["--make-vocab-size-divisible-by", str(vocab_divisor(spec.vocab_size, vocab,
                                                                  layout.tp))]
    return flags + ["--load", load_dir]
