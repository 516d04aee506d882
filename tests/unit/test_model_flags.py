"""One flag, one spelling: the same model command line, parsed by pretrain_gpt.py and by each tool
that takes a model shape (check_equivalence.py, benchmark.py, plan.py), names the same model
(seq1f1b.model_flags is their one argument group)."""
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from megatron.training.arguments import ArgumentError, parse_args, validate_args
from seq1f1b.model_flags import SHAPE_FLAGS, model_of_flags
from seq1f1b.plan.costs import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
LLAMA_LIKE = ["--num-layers", "4", "--hidden-size", "96", "--num-attention-heads", "4",
              "--group-query-attention", "--num-query-groups", "2", "--swiglu",
              "--normalization", "RMSNorm", "--disable-bias-linear", "--add-qkv-bias"]
ROPE = ["--seq-length", "32", "--position-embedding-type", "rope", "--rotary-base", "500000",
        "--rotary-percent", "0.5", "--use-rope-scaling", "--rope-scaling-factor", "4",
        "--norm-epsilon", "1e-6", "--untie-embeddings-and-output-weights"]
TRAINING = ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-3", "--mock-data"]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_cli", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # benchmark.py's dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tools():
    return {name: _tool(name) for name in ("check_equivalence", "benchmark", "plan")}


def _pretrain(argv):
    return validate_args(parse_args(argv + TRAINING), 1)


def _parsed(tools, argv) -> dict:
    """Each parser's namespace of `argv` (plus what the parser needs beyond the model)."""
    return {"pretrain_gpt.py": _pretrain(argv),
            "check_equivalence.py": tools["check_equivalence"].parse_args(argv),
            "benchmark.py": tools["benchmark"].parse_args(argv + ["--schedules", "seq1f1b"])[0]}


def _shape(model: ModelConfig) -> ModelConfig:
    return dataclasses.replace(model, vocab_size=1, seq_length=None)


def test_every_tool_reads_the_same_model_from_the_same_flags(tools):
    parsed = _parsed(tools, LLAMA_LIKE + ["--seq-length", "32"])
    shapes = {tool: _shape(ModelConfig.of_flags(args, vocab_size=1))
              for tool, args in parsed.items()}
    plan_args = tools["plan"].build_parser().parse_args(["simulate", *LLAMA_LIKE])
    shapes["plan.py"] = _shape(model_of_flags(plan_args))
    expected = ModelConfig(num_layers=4, hidden_size=96, num_attention_heads=4,
                           ffn_hidden_size=256, vocab_size=1, num_query_groups=2, swiglu=True,
                           normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=True)
    assert shapes == {tool: expected for tool in shapes}


def test_the_architecture_flags_parse_alike(tools):
    parsed = _parsed(tools, LLAMA_LIKE + ROPE)
    untie = {"pretrain_gpt.py": "untie_embeddings_and_output_weights"}
    values = {tool: {name: getattr(args, untie.get(tool, "untie_embeddings")
                                   if name == "untie_embeddings_and_output_weights" else name)
                     for name in SHAPE_FLAGS if name not in ("kv_channels",
                                                             "max_position_embeddings")}
              for tool, args in parsed.items()}
    assert values["check_equivalence.py"] == values["pretrain_gpt.py"]
    assert values["benchmark.py"] == values["pretrain_gpt.py"]


def test_grouped_query_attention_without_its_groups_is_refused_by_every_tool(tools, capsys):
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--group-query-attention", "--seq-length", "32"]
    message = "--group-query-attention needs --num-query-groups"
    with pytest.raises(ArgumentError, match=message):
        _pretrain(argv)
    with pytest.raises(SystemExit) as exit_info:
        tools["check_equivalence"].parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(tools["benchmark"].UsageError, match=message):
        tools["benchmark"].parse_args(argv)
    with pytest.raises(ValueError, match=message):
        model_of_flags(tools["plan"].build_parser().parse_args(["simulate", *argv[:-2]]))


@pytest.mark.parametrize("flags, message", [
    (["--kv-channels", "16"], "--kv-channels 16: only --hidden-size / --num-attention-heads"),
    (["--max-position-embeddings", "64"], "--max-position-embeddings 64: this tool builds"),
])
def test_a_shape_the_checking_tools_cannot_build_is_refused(tools, capsys, flags, message):
    with pytest.raises(SystemExit):
        tools["check_equivalence"].parse_args(flags)
    assert message in capsys.readouterr().err
    with pytest.raises(tools["benchmark"].UsageError, match=message):
        tools["benchmark"].parse_args(flags)


@pytest.mark.parametrize("flags, message", [
    (["--num-query-groups", "0"], "--num-query-groups must be a positive integer, got 0"),
    (["--group-query-attention", "--num-query-groups", "-2"],
     "--num-query-groups must be a positive integer, got -2"),
    (["--num-attention-heads", "0", "--kv-channels", "8"],
     "--num-attention-heads must be a positive integer, got 0"),
])
def test_a_head_count_below_one_is_refused_by_name_not_divided_by(tools, capsys, flags, message):
    """query_groups_error and kv_channels_error divide by the head counts: each checks them
    first, so every tool names the flag instead of raising ZeroDivisionError."""
    with pytest.raises(SystemExit) as exit_info:
        tools["check_equivalence"].parse_args(flags)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message in err and "\n" not in err, err
    with pytest.raises(tools["benchmark"].UsageError, match=message):
        tools["benchmark"].parse_args(flags + ["--schedules", "seq1f1b"])


def test_the_planner_names_a_zero_query_group_count(tools):
    argv = ["simulate", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--num-query-groups", "0"]
    with pytest.raises(ValueError, match="--num-query-groups must be a positive integer, got 0"):
        model_of_flags(tools["plan"].build_parser().parse_args(argv))
