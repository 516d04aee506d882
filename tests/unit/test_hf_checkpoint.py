"""Hugging Face checkpoints in and out (tools/checkpoint/convert.py), in one process.

- HF -> megatron -> HF is bit-identical for Llama (GQA, Llama 3 RoPE scaling), Mistral (sliding
  window) and Qwen2 (QKV bias, tied embeddings), from one safetensors file or a sharded index, and
  transformers loads the result;
- the printed flags are accepted by pretrain_gpt.py's validation and pad the vocabulary to the
  model's rows;
- bad input is refused in one line naming the file or flag, exit code 2, nothing written.
The models are tiny random ones made with transformers' own config classes (tests/hf_models.py).
"""
import importlib.util
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from hf_models import FAMILIES, TOKENIZER_VOCAB, VOCAB, make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")


def _load_tool(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = _load_tool("convert_tool", ROOT / "tools" / "checkpoint" / "convert.py")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_model(family, root / family, seed=i) for i, family in enumerate(FAMILIES)}


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = convert.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    return {name: t for f in files for name, t in load_file(str(f)).items()}


def _flags(out: str) -> list[str]:
    return shlex.split(next(line for line in out.splitlines() if line.startswith("  --")))


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_identical_and_transformers_loads_it(models, family, tmp_path, capsys):
    source = models[family]
    code, out, err = _run(capsys, "hf-to-megatron", "--hf-dir", source, "--save",
                          tmp_path / "ckpt", "--tp", 2, "--pp", 2)
    assert code == 0, err
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "release\n"
    assert ("sliding_window 64" in out) == (family == "mistral")
    code, out, err = _run(capsys, "megatron-to-hf", "--load", tmp_path / "ckpt", "--save",
                          tmp_path / "back")
    assert code == 0, err
    original, back = _tensors(source), _tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        json.loads((source / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (source / name).read_bytes()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    assert type(model).__name__ == json.loads((source / "config.json").read_text())[
        "architectures"][0]


def test_export_records_a_context_extension(models, tmp_path, capsys):
    assert _run(capsys, "hf-to-megatron", "--hf-dir", models["qwen2"], "--save",
                tmp_path / "ckpt")[0] == 0
    code, out, err = _run(capsys, "megatron-to-hf", "--load", tmp_path / "ckpt", "--save",
                          tmp_path / "back", "--rotary-base", 4000000,
                          "--max-position-embeddings", 256)
    assert code == 0, err
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    original = json.loads((models["qwen2"] / "config.json").read_text())
    assert (written.pop("rope_theta"), written.pop("max_position_embeddings")) == (4000000.0, 256)
    assert written == {k: v for k, v in original.items()
                       if k not in ("rope_theta", "max_position_embeddings")}
    _refused(capsys, tmp_path, ["megatron-to-hf", "--load", tmp_path / "ckpt", "--save",
                                tmp_path / "out", "--rotary-base", 0], ["--rotary-base"])


def test_sharded_safetensors_index_converts_the_same(models, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(models["llama"])).save_pretrained(
        str(sharded), max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models["llama"] / name, sharded / name)
    assert _run(capsys, "hf-to-megatron", "--hf-dir", sharded, "--save", tmp_path / "ckpt")[0] == 0
    assert _run(capsys, "megatron-to-hf", "--load", tmp_path / "ckpt", "--save",
                tmp_path / "back")[0] == 0
    back, original = _tensors(tmp_path / "back"), _tensors(models["llama"])
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[name], original[name]) for name in original)


@pytest.mark.parametrize("family,tp,pp,vpp", [("llama", 2, 2, 1), ("qwen2", 1, 2, 2),
                                              ("mistral", 1, 1, 1)])
def test_printed_flags_are_accepted_by_pretrain_gpt(models, family, tp, pp, vpp, tmp_path,
                                                    capsys):
    from megatron.training.arguments import parse_args, validate_args

    code, out, err = _run(capsys, "hf-to-megatron", "--hf-dir", models[family], "--save",
                          tmp_path / "ckpt", "--tp", tp, "--pp", pp, "--vpp", vpp)
    assert code == 0, err
    flags = _flags(out)
    schedule = "seq1f1b-interleaved" if vpp > 1 else "seq1f1b"
    args = validate_args(parse_args(flags + [
        "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--mock-data", "--train-iters", "1", "--lr", "1e-4", "--pipeline-schedule", schedule]),
        tp * pp)
    assert args.padded_vocab_size == VOCAB
    assert args.load == str(tmp_path / "ckpt")
    assert ("--untie-embeddings-and-output-weights" in flags) == (family != "qwen2")
    assert ("--add-qkv-bias" in flags) == (family == "qwen2")
    assert ("--use-rope-scaling" in flags) == (family == "llama")
    config = json.loads((models[family] / "config.json").read_text())
    assert args.num_query_groups in (None, config["num_key_value_heads"])
    assert args.rotary_base == int(config["rope_theta"])


def _refused(capsys, tmp_path, argv, names):
    """Exit code 2, one line on stderr naming `names`, and no output folder."""
    code, out, err = _run(capsys, *argv)
    assert code == 2, (out, err)
    line = err.strip()
    assert "\n" not in line and line.startswith("convert.py: error: "), err
    assert all(str(name) in line for name in names), line
    assert not (tmp_path / "out").exists()
    return line


def _copy(models, family, tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(models[family], folder)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


BAD_CONFIGS = {
    "architecture": dict(architectures=["GPT2LMHeadModel"]),
    "rope_type": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
    "llama3_factors": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}),
    "head_dim": dict(head_dim=16),
    "activation": dict(hidden_act="gelu"),
    "bias": dict(attention_bias=True),
}


@pytest.mark.parametrize("problem", BAD_CONFIGS)
def test_unsupported_configs_are_refused(models, tmp_path, capsys, problem):
    folder = _copy(models, "llama", tmp_path)
    _edit_config(folder, **BAD_CONFIGS[problem])
    _refused(capsys, tmp_path, ["hf-to-megatron", "--hf-dir", folder, "--save", tmp_path / "out"],
             [folder / "config.json"])


def test_missing_and_corrupt_files_are_refused(models, tmp_path, capsys):
    folder = _copy(models, "qwen2", tmp_path)
    argv = ["hf-to-megatron", "--hf-dir", folder, "--save", tmp_path / "out"]
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:len(weights) // 2])       # truncated
    _refused(capsys, tmp_path, argv, [folder / "model.safetensors"])
    (folder / "model.safetensors").write_bytes(b"not safetensors at all")
    _refused(capsys, tmp_path, argv, [folder / "model.safetensors"])
    (folder / "model.safetensors").unlink()
    _refused(capsys, tmp_path, argv, [folder / "model.safetensors"])
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    _refused(capsys, tmp_path, argv, [folder / "model-00001-of-00002.safetensors"])
    (folder / "model.safetensors.index.json").write_text("{ not json")
    _refused(capsys, tmp_path, argv, [folder / "model.safetensors.index.json"])
    (folder / "config.json").write_text("{ not json")
    _refused(capsys, tmp_path, argv, [folder / "config.json"])
    (folder / "config.json").unlink()
    _refused(capsys, tmp_path, argv, [folder / "config.json"])


def test_weights_that_do_not_fit_config_are_refused(models, tmp_path, capsys):
    folder = _copy(models, "llama", tmp_path)
    _edit_config(folder, num_key_value_heads=4)     # k_proj / v_proj are 2 heads wide
    _refused(capsys, tmp_path, ["hf-to-megatron", "--hf-dir", folder, "--save",
                                tmp_path / "out"], [folder / "model.safetensors", "k_proj"])


def test_bad_layouts_and_outputs_are_refused(models, tmp_path, capsys):
    source = models["llama"]
    config = source / "config.json"
    save = ["hf-to-megatron", "--hf-dir", source, "--save", tmp_path / "out"]
    _refused(capsys, tmp_path, save + ["--tp", "3"], ["--tp 3", config])
    _refused(capsys, tmp_path, save + ["--pp", "3"], ["--pp 3", config])
    _refused(capsys, tmp_path, save + ["--vpp", "2"], ["--vpp 2", "--pp"])
    assert _run(capsys, "hf-to-megatron", "--hf-dir", source, "--save", tmp_path / "ckpt")[0] == 0
    line = _refused(capsys, tmp_path, ["hf-to-megatron", "--hf-dir", source, "--save",
                                       tmp_path / "ckpt"], ["--save", tmp_path / "ckpt"])
    assert "already holds a checkpoint" in line
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    _refused(capsys, tmp_path, ["megatron-to-hf", "--load", tmp_path / "ckpt", "--save",
                                tmp_path / "busy"], ["--save", tmp_path / "busy"])
    (tmp_path / "empty").mkdir()
    _refused(capsys, tmp_path, ["megatron-to-hf", "--load", tmp_path / "empty", "--save",
                                tmp_path / "out"], ["--load", tmp_path / "empty"])
    # another model's description does not fit the checkpoint's tensors
    _refused(capsys, tmp_path, ["megatron-to-hf", "--load", tmp_path / "ckpt", "--save",
                                tmp_path / "out", "--hf-dir", models["qwen2"]],
             [tmp_path / "ckpt" / "release"])


def test_unwritable_or_empty_save_is_refused_before_reading(models, tmp_path, capsys,
                                                            monkeypatch):
    """--save '' would write into the current folder; an unwritable --save failed only after
    the whole model was read and converted."""
    monkeypatch.chdir(tmp_path)
    source = models["llama"]
    assert _run(capsys, "hf-to-megatron", "--hf-dir", source, "--save", tmp_path / "ckpt")[0] == 0
    monkeypatch.setattr("seq1f1b.hf.folder.read_hf_weights",
                        lambda *a: pytest.fail("read the weights"))
    monkeypatch.setattr("seq1f1b.hf.checkpoint.load_whole_model",
                        lambda *a: pytest.fail("read the checkpoint"))
    (tmp_path / "a_file").write_text("x")
    for direction, given in (("hf-to-megatron", ["--hf-dir", source]),
                             ("megatron-to-hf", ["--load", tmp_path / "ckpt"])):
        for save, names in (("/proc/x", ["--save", "/proc/x", "/proc is not writable"]),
                            ("", ["--save", "empty path"]),
                            (tmp_path / "a_file", ["--save", "a_file", "not"])):
            _refused(capsys, tmp_path, [direction, *given, "--save", save], names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "ckpt"]


def test_tokenizer_flag_takes_the_folder(models):
    from megatron.training.tokenizer import HuggingFaceTokenizer

    folder = models["llama"]
    tok = HuggingFaceTokenizer(str(folder))
    by_file = HuggingFaceTokenizer(str(folder / "tokenizer.json"))
    assert tok.vocab_size == by_file.vocab_size == TOKENIZER_VOCAB
    assert tok.eod == tok._tok.token_to_id("</s>")
    assert tok.detokenize(tok.tokenize("the red fox")) == "the red fox"


# ----------------------------------------------------------------------------- the model travels

def _release_flags(models, family, tmp_path, capsys) -> list[str]:
    code, out, err = _run(capsys, "hf-to-megatron", "--hf-dir", models[family], "--save",
                          tmp_path / "ckpt")
    assert code == 0, err
    return _flags(out)


_RUN = ["--seq-length", "32", "--micro-batch-size", "1", "--mock-data", "--train-iters", "1",
        "--lr", "1e-4"]


def _without(flags: list[str], flag: str, values: int = 1) -> list[str]:
    at = flags.index(flag)
    return flags[:at] + flags[at + 1 + values:]


def _validate(flags):
    from megatron.training.arguments import parse_args, validate_args

    return validate_args(parse_args(_RUN + [str(f) for f in flags]), 1)   # later flags win


def _refused_by_validation(flags, names):
    from megatron.training.arguments import ArgumentError

    with pytest.raises(ArgumentError) as err:
        _validate(flags)
    line = str(err.value)
    assert "\n" not in line and all(str(name) in line for name in names), line
    return line


def test_a_release_refuses_flags_of_another_model(models, tmp_path, capsys):
    flags = _release_flags(models, "llama", tmp_path, capsys)
    _validate(flags)
    _refused_by_validation(_without(flags, "--rotary-base"), ["--rotary-base", "10000", "500000"])
    _refused_by_validation(_without(flags, "--untie-embeddings-and-output-weights", 0),
                           ["--untie-embeddings-and-output-weights", "off", "on"])
    heads = flags.index("--num-attention-heads") + 1
    _refused_by_validation(flags[:heads] + ["2"] + flags[heads + 1:],
                           ["--num-attention-heads", "2", "4", "config.json"])
    _refused_by_validation(_without(flags, "--use-rope-scaling", 0), ["--use-rope-scaling"])
    extended = _validate(flags + ["--rotary-base", "2000000"])     # on purpose: a context extension
    assert extended.rotary_base == 2000000


def test_use_checkpoint_args_takes_the_model_from_the_release(models, tmp_path, capsys):
    flags = _release_flags(models, "llama", tmp_path, capsys)
    full = _validate(flags)
    only = _validate(["--load", tmp_path / "ckpt", "--use-checkpoint-args", "--tokenizer-type",
                      "NullTokenizer", "--vocab-size", "95"])
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "rotary_base", "use_rope_scaling", "rope_scaling_factor",
                 "untie_embeddings_and_output_weights", "swiglu", "normalization",
                 "norm_epsilon", "disable_bias_linear", "position_embedding_type"):
        assert getattr(only, name) == getattr(full, name), name


def _trained_checkpoint(models, tmp_path, capsys, **trained) -> Path:
    """The llama release, re-labelled as iteration 3 of a run whose flags are `trained`."""
    flags = _release_flags(models, "llama", tmp_path, capsys)
    args = _validate(flags + [item for flag, value in trained.items()
                              for item in ("--" + flag.replace("_", "-"), value)])
    root = tmp_path / "trained"
    shutil.copytree(tmp_path / "ckpt" / "release", root / "iter_0000003")
    common = torch.load(root / "iter_0000003" / "common.pt", weights_only=False)
    common.update(args=args, iteration=3)
    torch.save(common, root / "iter_0000003" / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")
    return root


def test_export_writes_the_context_the_checkpoint_was_trained_with(models, tmp_path, capsys):
    root = _trained_checkpoint(models, tmp_path, capsys, rotary_base=2000000,
                               max_position_embeddings=32768)
    code, out, err = _run(capsys, "megatron-to-hf", "--load", root, "--save", tmp_path / "back",
                          "--hf-dir", models["llama"])
    assert code == 0, err
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (written["rope_theta"], written["max_position_embeddings"]) == (2000000.0, 32768)
    assert written["rope_scaling"]["factor"] == 8.0
    export = ["megatron-to-hf", "--load", root, "--save", tmp_path / "out", "--hf-dir",
              models["llama"]]
    _refused(capsys, tmp_path, export + ["--rotary-base", 500000], ["--rotary-base 500000",
                                                                     "2000000"])
    _refused(capsys, tmp_path, export + ["--max-position-embeddings", 16],
             ["--max-position-embeddings 16", "32768"])
    _refused(capsys, tmp_path, ["megatron-to-hf", "--load", root, "--save", tmp_path / "out",
                                "--hf-dir", models["qwen2"]], ["trained with", "config.json",
                                                               "not this model"])


def test_a_release_shorter_context_flag_is_refused(models, tmp_path, capsys):
    _release_flags(models, "qwen2", tmp_path, capsys)
    _refused(capsys, tmp_path, ["megatron-to-hf", "--load", tmp_path / "ckpt", "--save",
                                tmp_path / "out", "--max-position-embeddings", 16],
             ["--max-position-embeddings 16", "64"])


def test_resuming_another_model_or_a_damaged_checkpoint_is_refused(models, tmp_path, capsys):
    root = _trained_checkpoint(models, tmp_path, capsys)
    flags = _without(_release_flags(models, "llama", tmp_path / "again", capsys), "--load")
    resume = flags + ["--load", root, "--train-iters", "5"]
    _validate(resume)
    learned = _without(_without(_without(_without(resume, "--position-embedding-type"),
                                         "--rotary-base"), "--use-rope-scaling", 0),
                       "--rope-scaling-factor")
    _refused_by_validation(learned,
                           ["--position-embedding-type", "learned_absolute", "rope",
                            "checkpoint's args"])
    folder = root / "iter_0000003"
    shard = sorted(folder.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    _refused_by_validation(resume, [shard.name, "cut short"])
    shard.unlink()
    _refused_by_validation(resume, ["--load", shard.name, "missing"])
    shard.write_bytes(data)
    common = (folder / "common.pt").read_bytes()
    (folder / "common.pt").write_bytes(common[:len(common) // 2])
    _refused_by_validation(resume, ["--load", "common.pt"])
