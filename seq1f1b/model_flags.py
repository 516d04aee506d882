"""Megatron-LM's model-shape flags: one argument group for pretrain_gpt.py and every tool that takes
a model (check_equivalence.py, benchmark.py, plan.py), so a model is spelled the same way everywhere
(grouped-query attention is `--group-query-attention --num-query-groups N`, as in Megatron-LM).

The flags, their types, choices and help are pretrain_gpt.py's; a tool may give its own defaults
(tiny models in the checking tools, "take the preset's" in the planner) and take the subset it
models. Pure argparse (the plan's ModelConfig is imported where a shape is built): the package's
tools and the trainer both import it, pretrain_gpt.py's --help without loading the plan.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from seq1f1b.plan.costs import ModelConfig

LOSS_BACKWARD_IN_FORWARD_HELP = (
    "run the output layer's backward inside the last stage's forward: each span's logits and "
    "fp32 softmax (span x vocab / TP floats) are freed at F instead of held until B, which "
    "keeps the input gradient (span x hidden) and, per micro-batch in flight, the output "
    "weights' gradient; exact (seq1f1b/runtime/early_loss.py)")
"""--loss-backward-in-forward, in pretrain_gpt.py and the tools that run a model."""

SPREAD_OUTPUT_HELP = (
    "searched schedules (seq1f1b-zb-auto): also search with the output layer and the loss of "
    "each span as an action of its own on any pipeline rank (every rank then holds a copy of "
    "the output layer), under the same cap, and run the shorter; needs "
    "--untie-embeddings-and-output-weights")
"""--spread-output, in pretrain_gpt.py and the tools that run a model."""

POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")

_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "num_layers": ("--num-layers", dict(type=int, help="transformer layers{required}")),
    "hidden_size": ("--hidden-size", dict(type=int, help="hidden size{required}")),
    "ffn_hidden_size": ("--ffn-hidden-size", dict(
        type=int, help="MLP hidden size (default: 4 x hidden)")),
    "num_attention_heads": ("--num-attention-heads", dict(
        type=int, help="attention heads{required}")),
    "seq_length": ("--seq-length", dict(type=int, help="tokens per sample{required}")),
    "max_position_embeddings": ("--max-position-embeddings", dict(
        type=int, help="position table size (default: --seq-length)")),
    "position_embedding_type": ("--position-embedding-type", dict(
        default="learned_absolute", choices=POSITION_EMBEDDINGS)),
    "untie_embeddings_and_output_weights": ("--untie-embeddings-and-output-weights", dict(
        action="store_true", help="separate input embedding and output layer weights")),
    "group_query_attention": ("--group-query-attention", dict(
        action="store_true", help="grouped-query attention: --num-query-groups K/V heads")),
    "num_query_groups": ("--num-query-groups", dict(
        type=int, help="K/V heads with --group-query-attention (divides the attention heads)")),
    "swiglu": ("--swiglu", dict(
        action="store_true", help="gated SiLU MLP (Llama); --ffn-hidden-size defaults to 8h/3 "
                                  "rounded down to a multiple of 64, as Megatron-LM does")),
    "normalization": ("--normalization", dict(
        default="LayerNorm", choices=NORMALIZATIONS,
        help="the layers' and the final norm (sequence-parallel capable either way)")),
    "norm_epsilon": ("--norm-epsilon", dict(type=float, default=1e-5, help="the norms' epsilon")),
    "disable_bias_linear": ("--disable-bias-linear", dict(
        action="store_true", help="no biases in the linear layers (Llama, Mistral)")),
    "add_qkv_bias": ("--add-qkv-bias", dict(
        action="store_true",
        help="bias in the QKV projection even with --disable-bias-linear (Qwen2)")),
    "kv_channels": ("--kv-channels", dict(
        type=int, help="channels per attention head; only hidden / heads (the default) is "
                       "supported")),
    "rotary_base": ("--rotary-base", dict(
        type=int, help="RoPE base (theta) (default: 10000; resuming, the checkpoint's must "
                       "match unless this is given)")),
    "rotary_percent": ("--rotary-percent", dict(
        type=float, default=1.0, help="fraction of each head's channels that RoPE rotates")),
    "rotary_seq_len_interpolation_factor": ("--rotary-seq-len-interpolation-factor", dict(
        type=int, help="linear position interpolation: positions divided by this")),
    "use_rope_scaling": ("--use-rope-scaling", dict(
        action="store_true", help="Llama 3.x RoPE frequency scaling (megatron-core's: low/high "
                                  "frequency factors 1/4, original context 8192)")),
    "rope_scaling_factor": ("--rope-scaling-factor", dict(
        type=float, help="the factor of --use-rope-scaling (default: 8)")),
}
SHAPE_FLAGS = tuple(_FLAGS)
"""Every model-shape flag, in pretrain_gpt.py's --help order."""
COST_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "group_query_attention", "num_query_groups", "swiglu", "normalization",
              "disable_bias_linear", "add_qkv_bias")
"""The flags that change a model's FLOPs, bytes and parameters (seq1f1b.plan.costs.ModelConfig)."""


def add_model_shape_args(group, names: tuple[str, ...] = SHAPE_FLAGS,
                         dests: Optional[dict[str, str]] = None, required: str = " (required)",
                         **defaults: Any) -> None:
    """Add the flags `names` (by dest) to `group` (a parser or an argument group), each under the
    dest `dests` maps it to (default: its own), with `defaults` (by flag dest) in place of
    pretrain_gpt.py's; `required` ends the help of the flags without a default (the size
    flags and --seq-length)."""
    for name in names:
        flag, kwargs = _FLAGS[name]
        kwargs = dict(kwargs)
        if "help" in kwargs:
            kwargs["help"] = kwargs["help"].replace("{required}", required)
        if name in defaults:
            kwargs["default"] = defaults[name]
        if dests and name in dests:
            kwargs["dest"] = dests[name]
        group.add_argument(flag, **kwargs)


def shape_flags(*, num_layers: int, hidden_size: int, num_attention_heads: int,
                ffn_hidden_size: int, num_query_groups: int, swiglu: bool, normalization: str,
                add_bias_linear: bool, add_qkv_bias: bool) -> list[str]:
    """pretrain_gpt.py's flags for a model of this shape, in one spelling for every writer of a
    command line (the planner's launch, the HF importer's): the three sizes first (Slurm's
    launch_pretrain.sh takes those as variables), then the FFN width, grouped-query attention
    where the K/V heads are fewer, SwiGLU, the normalization other than LayerNorm and the
    biases."""
    flags = ["--num-layers", str(num_layers), "--hidden-size", str(hidden_size),
             "--num-attention-heads", str(num_attention_heads),
             "--ffn-hidden-size", str(ffn_hidden_size)]
    if num_query_groups != num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(num_query_groups)]
    if swiglu:
        flags.append("--swiglu")
    if normalization != "LayerNorm":
        flags += ["--normalization", normalization]
    if not add_bias_linear:
        flags.append("--disable-bias-linear")
    if add_qkv_bias:
        flags.append("--add-qkv-bias")
    return flags


SIZE_FLAG_TOKENS = 6
"""How many leading entries of `shape_flags` the three sizes take (flag and value each)."""


SIZE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings",
              "rotary_base", "rotary_seq_len_interpolation_factor")
"""The shape flags that count something: each, when given, must be at least 1."""


def flag_of(dest: str) -> str:
    """The command-line spelling of an argparse dest (num_query_groups -> --num-query-groups)."""
    return "--" + dest.replace("_", "-")


def positive_error(flag: str, value: Optional[float]) -> Optional[str]:
    """The one-line error of a count below 1 (None: fine, or not given). A 0 or a negative size
    otherwise reaches a modulo, a division or a tensor shape far from the flag and ends in a
    traceback that does not name it."""
    if value is not None and value < 1:
        return f"{flag} must be a positive integer, got {value!r}"
    return None


def sizes_error(args: argparse.Namespace, names: tuple[str, ...] = SIZE_FLAGS) -> Optional[str]:
    """positive_error of the first of the flags `names` (by dest; absent ones skipped) that is
    below 1, or None."""
    for name in names:
        error = positive_error(flag_of(name), getattr(args, name, None))
        if error is not None:
            return error
    return None


def heads_error(args: argparse.Namespace) -> Optional[str]:
    """The one-line error of a hidden size the attention heads do not divide (None: fine): each
    head takes hidden / heads channels, so a remainder has no head to go to."""
    error = sizes_error(args, ("hidden_size", "num_attention_heads"))
    if error is not None or args.hidden_size is None or args.num_attention_heads is None:
        return error
    if args.hidden_size % args.num_attention_heads:
        return (f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{args.num_attention_heads}")
    return None


def query_groups_error(args: argparse.Namespace) -> Optional[str]:
    """The one-line error of Megatron-LM's grouped-query flags (None: they are consistent):
    --group-query-attention needs --num-query-groups, which must divide the attention heads.
    The tools also take --num-query-groups alone, as they did before they took Megatron's
    spelling; pretrain_gpt.py refuses it (arguments._validate_architecture). A head count below
    1 is refused first: the divisibility test would divide by it."""
    error = sizes_error(args, ("num_attention_heads", "num_query_groups"))
    if error is not None:
        return error
    if getattr(args, "group_query_attention", False):
        if args.num_query_groups is None:
            return "--group-query-attention needs --num-query-groups"
    if args.num_query_groups is not None and args.num_attention_heads is not None and \
            args.num_attention_heads % args.num_query_groups:
        return (f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                f"--num-query-groups {args.num_query_groups}")
    return None


def kv_channels_error(args: argparse.Namespace) -> Optional[str]:
    """The one-line error of a --kv-channels other than hidden / heads (None: fine); sizes
    below 1 first, which hidden / heads would divide by or turn into a meaningless width."""
    if args.kv_channels is None:
        return None
    error = sizes_error(args, ("hidden_size", "num_attention_heads", "kv_channels"))
    if error is not None:
        return error
    head_channels = args.hidden_size // args.num_attention_heads
    if args.kv_channels != head_channels:
        return (f"--kv-channels {args.kv_channels}: only --hidden-size / --num-attention-heads "
                f"= {head_channels} is supported (the span attention sizes its heads so)")
    return None


def swiglu_ffn_error(args: argparse.Namespace) -> Optional[str]:
    """The one-line error of --swiglu whose default FFN width rounds to 0 (None: fine)."""
    error = sizes_error(args, ("hidden_size",))
    if error is not None:
        return error
    if args.swiglu and args.ffn_hidden_size is None and args.hidden_size < 48:
        return (f"--swiglu with --hidden-size {args.hidden_size}: the default FFN size rounds "
                "to 0; give --ffn-hidden-size")
    return None


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's MLP width without --ffn-hidden-size: 4h, or with SwiGLU 8h/3 rounded down
    to a multiple of 64 (about the parameters of the 4h MLP in three matrices)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


def model_of_flags(args: argparse.Namespace) -> Optional[ModelConfig]:
    """The cost shape the planner's flags name: `--model` (a preset, alone) or the dimensions
    (num_layers, hidden_size and num_attention_heads at least; flags left None take
    ModelConfig's defaults; the SwiGLU FFN width as pretrain_gpt.py derives it); None when
    neither is given. ValueError (one line naming the flag) for a bad combination."""
    from seq1f1b.plan.costs import ModelConfig, preset

    dims = {name: getattr(args, name) for name in COST_FLAGS + ("vocab_size",)}
    given = {name: value for name, value in dims.items() if value is not None}
    if args.model:
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"--model {args.model} cannot be combined with {flags}")
        return preset(args.model)
    if not given:
        return None
    missing = [name for name in ("num_layers", "hidden_size", "num_attention_heads")
               if name not in given]
    if missing:
        raise ValueError(f"--{missing[0].replace('_', '-')} is required without --model")
    error = query_groups_error(args) or swiglu_ffn_error(args)
    if error is not None:
        raise ValueError(error)
    given.pop("group_query_attention", None)
    if given.get("swiglu") and "ffn_hidden_size" not in given:
        given["ffn_hidden_size"] = default_ffn_hidden_size(args.hidden_size, swiglu=True)
    if given.pop("disable_bias_linear", False):
        given["add_bias_linear"] = False
    return ModelConfig(**given)
