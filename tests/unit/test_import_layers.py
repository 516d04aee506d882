"""The layers of docs/design.md point down: every import in `seq1f1b/` (at module level or inside
a function) is read from the source, so a layer that reaches up fails here rather than in review
(seq1f1b/hf/folder.py once imported megatron.training's path checks)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imports(path: Path, root: Path) -> set[str]:
    """Every module `path` (a file under `root`) imports, relative imports made absolute."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = path.relative_to(root).with_suffix("").parts[:-node.level]
                found.add(".".join(parts + ((node.module,) if node.module else ())))
            else:
                found.add(node.module)
    return found


def _importing(folder: Path, prefixes: tuple[str, ...], root: Path = REPO) -> list[str]:
    """"file: module" for each import under `folder` of a module in one of `prefixes`."""
    return [f"{path.relative_to(root)}: {name}" for path in sorted(folder.rglob("*.py"))
            for name in sorted(_imports(path, root))
            if any(name == p or name.startswith(p + ".") for p in prefixes)]


def test_the_package_never_imports_the_trainer():
    assert _importing(REPO / "seq1f1b", ("megatron.training",)) == []


def test_the_plan_imports_neither_torch_nor_megatron():
    assert _importing(REPO / "seq1f1b" / "plan", ("torch", "megatron")) == []


def test_the_reader_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The check itself can fail."""
    plan = tmp_path / "seq1f1b" / "plan"
    plan.mkdir(parents=True)
    (plan / "probe.py").write_text("def f():\n    import torch.nn\n"
                                   "    from ..runtime import executor\n")
    assert _importing(plan, ("torch", "seq1f1b.runtime"), root=tmp_path) == [
        "seq1f1b/plan/probe.py: seq1f1b.runtime", "seq1f1b/plan/probe.py: torch.nn"]
