"""Layers only point down (docs/design.md's table): nothing in seq1f1b/ imports megatron.training
(the trainer built on the package), seq1f1b/plan imports neither torch nor megatron (plans are
pure data), and seq1f1b/runtime does not import the adapter that is built on it.

Every .py file is parsed with ast, so imports inside functions count, as do module names
handed to importlib.import_module or __import__ as string literals.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "seq1f1b"
RULES = [(PACKAGE, "megatron.training"), (PACKAGE / "plan", "torch"),
         (PACKAGE / "plan", "megatron"), (PACKAGE / "runtime", "seq1f1b.megatron_adapter")]


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module name) of every import in `tree`, at any depth; a `from X import Y` names
    both X and X.Y (Y may be a submodule)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def violations(folder: Path, forbidden: str) -> list[str]:
    """'path:line imports module' for each import of `forbidden` (or below it) under `folder`."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, module in imported_modules(tree):
            if module == forbidden or module.startswith(forbidden + "."):
                found.append(f"{path}:{line} imports {module}")
    return found


@pytest.mark.parametrize("folder, forbidden", RULES,
                         ids=[f"{rule[0].name}-{rule[1]}" for rule in RULES])
def test_no_import_points_up(folder, forbidden):
    assert violations(folder, forbidden) == []


@pytest.mark.parametrize("source", [
    "import megatron.training.tokenizer",
    "from megatron.training import checkpoint_layout",
    "from megatron import training",
    "def f():\n    from megatron.training.checkpointing import load_model_weights\n",
    "import importlib\nimportlib.import_module('megatron.training.arguments')",
    "__import__('megatron.training')",
])
def test_each_spelling_of_an_upward_import_is_caught(tmp_path, source):
    (tmp_path / "module.py").write_text(source)
    assert len(violations(tmp_path, "megatron.training")) >= 1


def test_neighbours_are_not_mistaken_for_the_trainer(tmp_path):
    (tmp_path / "module.py").write_text(
        "import megatron.core\nfrom megatron.core import parallel_state\n"
        "import megatron.training_extras\nimport torch\nfrom torch import nn\n")
    assert violations(tmp_path, "megatron.training") == []
    assert violations(tmp_path, "torch.distributed") == []
