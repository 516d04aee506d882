"""Hugging Face <-> Megatron checkpoints for Llama, Mistral and Qwen2 models.

    python tools/checkpoint/convert.py hf-to-megatron --hf-dir D --save DIR --tp T --pp P [--vpp V]
    python tools/checkpoint/convert.py megatron-to-hf --load DIR --save HF_DIR [--hf-dir D]

hf-to-megatron reads config.json and the safetensors of D and writes Megatron's release
checkpoint (`DIR/release`, tracker `release`), which `pretrain_gpt.py --load DIR` resumes as
iteration 0 with a fresh optimizer at any TP x PP x V; it prints the flags that run needs for
the layout --tp/--pp/--vpp (model, tokenizer and vocabulary padding flags). config.json and the
tokenizer files travel along in `DIR/release/huggingface`.

megatron-to-hf writes the newest checkpoint under DIR (release or a training iteration, any
layout) as a folder `transformers` loads: config.json, model.safetensors and the tokenizer files.
The model's description comes from --hf-dir, or from `DIR/release/huggingface` when DIR holds
the converted release checkpoint. A training checkpoint carries the flags it was trained with:
their architecture must be config.json's, and the RoPE base, the Llama 3 scaling and the context
length it was trained at are written (rope_theta, rope_scaling, max_position_embeddings; the
context only when longer than config.json's). --rotary-base and --max-position-embeddings give
them for a checkpoint that records none (a release); they must agree with one that does.

Bad input (an unsupported architecture, a missing or corrupt file, a layout the model does not
divide into) is refused in one line naming the file or flag, exit code 2, before anything is
written. Runs in one process on the CPU; the whole model is held in memory in fp32.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from seq1f1b.hf import ConversionError  # noqa: E402


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mg = sub.add_parser("hf-to-megatron", help="a Hugging Face folder to a release checkpoint")
    to_mg.add_argument("--hf-dir", required=True, help="folder with config.json and safetensors")
    to_mg.add_argument("--save", required=True, help="checkpoint directory to create")
    to_mg.add_argument("--tp", type=int, default=1, help="tensor-parallel size to train at")
    to_mg.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to train at")
    to_mg.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline rank")
    to_hf = sub.add_parser("megatron-to-hf", help="a checkpoint to a Hugging Face folder")
    to_hf.add_argument("--load", required=True, help="checkpoint directory (its newest checkpoint)")
    to_hf.add_argument("--save", required=True, help="Hugging Face folder to create")
    to_hf.add_argument("--hf-dir", help="the folder the model came from (config.json, tokenizer); "
                                        "default: the release checkpoint's copy")
    to_hf.add_argument("--rotary-base", type=int,
                       help="the --rotary-base the checkpoint was trained with (default: the "
                            "one it records, else config.json's rope_theta); written as "
                            "rope_theta")
    to_hf.add_argument("--max-position-embeddings", type=int,
                       help="the context the checkpoint was trained at, when longer than "
                            "config.json's max_position_embeddings (default: the one it "
                            "records, when longer): written there; a shorter one is refused")
    return parser.parse_args(argv)


def _single_process_world() -> None:
    """A gloo world of one (or torchrun's) and TP = PP = 1, for the whole model."""
    from megatron.core import parallel_state

    from seq1f1b.distributed import join_gloo_world

    join_gloo_world()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _tokenizer_vocab(hf_dir: str):
    """(the --tokenizer-model to print, its vocabulary size) or (None, None) without one."""
    from megatron.training.tokenizer import HF_TOKENIZER_FILE, HuggingFaceTokenizer

    if not os.path.isfile(os.path.join(hf_dir, HF_TOKENIZER_FILE)):
        return None, None
    try:
        return os.path.abspath(hf_dir), HuggingFaceTokenizer(hf_dir).vocab_size
    except ValueError as err:
        raise ConversionError(str(err).replace("--tokenizer-model: ", "")) from None


def check_save(args: argparse.Namespace) -> None:
    """Before anything is read: --save is a folder this run can write (an empty value is refused,
    not taken as the current folder), as each direction writes it: hf-to-megatron stages
    `release` inside it (writable.check_output_dir), megatron-to-hf stages the folder beside it
    and renames it into place (folder.check_new_folder). Otherwise the whole model is read and
    converted before the first write fails."""
    if args.direction == "megatron-to-hf":
        from seq1f1b.hf.folder import check_new_folder

        check_new_folder(args.save, "--save")
        return
    from seq1f1b.writable import check_output_dir

    try:
        check_output_dir(args.save, "--save")
    except ValueError as err:
        raise ConversionError(str(err)) from None


def hf_to_megatron(args: argparse.Namespace) -> str:
    """Validate everything, write the release checkpoint; returns the text to print."""
    from seq1f1b import checkpoint_layout
    from seq1f1b.hf import config as hf_config
    from seq1f1b.hf.folder import read_hf_weights

    check_save(args)
    raw, spec = hf_config.read_spec(args.hf_dir)
    config_path = os.path.join(args.hf_dir, hf_config.CONFIG_FILE)
    layout = hf_config.Layout(args.tp, args.pp, args.vpp)
    hf_config.check_layout(spec, layout, config_path)
    tokenizer_model, tokenizer_vocab = _tokenizer_vocab(args.hf_dir)
    flags = hf_config.training_flags(spec, layout, load_dir=os.path.abspath(args.save),
                                     tokenizer_model=tokenizer_model,
                                     tokenizer_vocab=tokenizer_vocab)
    if os.path.exists(checkpoint_layout.tracker_path(args.save)):
        raise ConversionError(f"--save: {args.save} already holds a checkpoint")
    tensors = read_hf_weights(args.hf_dir, spec)

    from seq1f1b.hf import checkpoint, weights

    _single_process_world()
    release = checkpoint.write_release(spec, weights.hf_to_megatron(spec, tensors), args.hf_dir,
                                       args.save)
    lines = [f"converted {spec.family} ({spec.num_layers} layers, hidden {spec.hidden_size}, "
             f"vocabulary {spec.vocab_size}) from {args.hf_dir} to {release}",
             "pretrain_gpt.py flags for it (add --seq-length and your data and optimizer flags; "
             f"the model was trained at {spec.max_position_embeddings} tokens):",
             "  " + shlex.join(flags)]
    if spec.sliding_window is not None:
        lines.append(f"warning: {config_path} sliding_window {spec.sliding_window}: Seq1F1B "
                     f"attends over the whole sequence, so the model is unchanged only with "
                     f"--seq-length <= {spec.sliding_window}")
    if tokenizer_model is None:
        lines.append(f"note: {args.hf_dir} has no tokenizer.json; the flags assume token ids "
                     f"0 .. {spec.vocab_size - 1} (NullTokenizer)")
    return "\n".join(lines)


def _template_dir(args: argparse.Namespace) -> str:
    from seq1f1b import checkpoint_layout

    if args.hf_dir is not None:
        return args.hf_dir
    from seq1f1b.hf.checkpoint import RELEASE_HF_SUBDIR

    copy = os.path.join(checkpoint_layout.release_dir(args.load), RELEASE_HF_SUBDIR)
    if not os.path.isdir(copy):
        raise ConversionError(f"--hf-dir is required: {args.load} holds no converted release "
                              f"checkpoint that records the model's config.json")
    return copy


def _trained_args(folder: str):
    """The flags the checkpoint in `folder` was trained with; None for a release (or a
    checkpoint that records none)."""
    from megatron.training import checkpoint_model

    try:
        checkpoint_model.check_complete(folder, "--load")
        return checkpoint_model.saved_args(folder, "--load")
    except ValueError as err:
        raise ConversionError(str(err)) from None


def _record_training(raw: dict, template_spec, trained, args: argparse.Namespace,
                     config_path: str) -> None:
    """Write into `raw` (config.json) the RoPE base, scaling and context the checkpoint was
    trained with; refuse a checkpoint of another architecture, or flags it contradicts."""
    from megatron.training import checkpoint_model
    from seq1f1b.hf import config as hf_config

    template = checkpoint_model.model_values(checkpoint_model.spec_namespace(template_spec))
    values = checkpoint_model.model_values(trained) if trained is not None else {}
    for field, mine, theirs in checkpoint_model.mismatches(template, values, context=False):
        raise ConversionError(f"--load: the checkpoint was trained with {field.flag} "
                              f"{checkpoint_model.shown(theirs)}, {config_path} describes "
                              f"{checkpoint_model.shown(mine)}: not this model")
    base = values.get("rotary_base")
    if args.rotary_base is not None:
        if base is not None and args.rotary_base != base:
            raise ConversionError(f"--rotary-base {args.rotary_base} contradicts the "
                                  f"checkpoint's, which was trained with {base}")
        base = args.rotary_base
    if base is not None and base != template_spec.rotary_base:
        raw["rope_theta"] = float(base)
    if trained is not None:
        factor = values["rope_scaling_factor"]
        if factor != template_spec.rope_scaling_factor:
            raw["rope_scaling"] = None if factor is None else {
                "rope_type": "llama3", "factor": factor, **hf_config.LLAMA3_FACTORS}
    longest = max(template_spec.max_position_embeddings,
                  getattr(trained, "max_position_embeddings", None) or 0)
    if args.max_position_embeddings is not None:
        if args.max_position_embeddings < longest:
            raise ConversionError(f"--max-position-embeddings {args.max_position_embeddings} is "
                                  f"shorter than the {longest} tokens the model already has "
                                  f"(config.json or the checkpoint); only a longer context is "
                                  f"written")
        longest = args.max_position_embeddings
    if longest != template_spec.max_position_embeddings:
        raw["max_position_embeddings"] = longest


def megatron_to_hf(args: argparse.Namespace) -> str:
    """Validate everything, write the Hugging Face folder; returns the text to print."""
    from seq1f1b import checkpoint_layout
    from seq1f1b.hf import config as hf_config
    check_save(args)
    if not os.path.isdir(args.load):
        raise ConversionError(f"--load: {args.load} is not a directory")
    try:
        folder = checkpoint_layout.latest_dir(args.load)
    except ValueError as err:
        raise ConversionError(str(err)) from None
    if folder is None:
        raise ConversionError(f"--load: {args.load} holds no checkpoint "
                              f"({checkpoint_layout.TRACKER_NAME} is missing)")
    for flag, value in (("--rotary-base", args.rotary_base),
                        ("--max-position-embeddings", args.max_position_embeddings)):
        if value is not None and value < 1:
            raise ConversionError(f"{flag} must be >= 1, got {value}")
    template = _template_dir(args)
    raw, template_spec = hf_config.read_spec(template)
    config_path = os.path.join(template, hf_config.CONFIG_FILE)
    _record_training(raw, template_spec, _trained_args(folder), args, config_path)
    spec = hf_config.spec_from_config(raw, config_path)

    from seq1f1b.hf import checkpoint, weights
    from seq1f1b.hf.folder import TORCH_DTYPES, write_hf_folder

    _single_process_world()
    model = checkpoint.load_whole_model(spec, folder)
    dtype = TORCH_DTYPES[spec.dtype]
    tensors = {name: tensor.to(dtype) for name, tensor in
               weights.megatron_to_hf(spec, model.state_dict()).items()}
    import torch.distributed as dist

    if dist.get_rank() == 0:
        write_hf_folder(args.save, raw, tensors, companions_from=template)
    dist.barrier()
    return f"wrote {args.save} ({spec.family}, {spec.dtype}) from {folder}"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        text = hf_to_megatron(args) if args.direction == "hf-to-megatron" else megatron_to_hf(args)
    except ConversionError as err:
        print(f"convert.py: error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    from seq1f1b.import_notices import hide_import_notices

    hide_import_notices(future_warnings=True)
    sys.exit(main())
