"""README.md and docs/*.md are true as written.

- every shell command in a page ends with one marker (`# [quick]`, `# [slow]`, `# [gpu]`,
  `# [cluster]`, `# [files]`; docs/testing.md), and the quick ones run as written from a scratch
  folder that links the repository's files; a `text` block right after a block of quick commands
  is their output, and every line of it must be in what they print;
- README's test command is what .ci/run runs, and README's and schedules.md's schedule tables are
  what `plan.py compare` prints;
- every relative link resolves (file and heading), and every repository path and module the pages
  name exists (a module's named attribute too).
"""
from __future__ import annotations

import functools
import importlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKERS = ("quick", "slow", "gpu", "cluster", "files")
MEGATRON_LM_PATHS = {"tests/unit_tests/pipeline_parallel/test_schedules.py",
                     "examples/llama/train_llama3_8b_h100_fp8.sh"}
"""Paths in Megatron-LM's tree that the pages name as such."""
REPO_ROOTS = ("seq1f1b/", "megatron/", "tools/", "tests/", "examples/", "docs/", ".ci/")
REPO_FILES = {"pretrain_gpt.py", "Makefile", "requirements.txt", "setup.py", "README.md"}


@dataclass(frozen=True)
class Block:
    lang: str
    lines: tuple[str, ...]
    line: int  # 1-based line of the opening fence


@dataclass(frozen=True)
class Command:
    text: str
    marker: str | None
    line: int


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def blocks(text: str) -> list[Block]:
    found, lang, body, start = [], None, [], 0
    for n, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)\s*$", line)
        if fence and lang is None:
            lang, body, start = fence.group(1), [], n
        elif fence:
            found.append(Block(lang, tuple(body), start))
            lang = None
        elif lang is not None:
            body.append(line)
    return found


def _complete(text: str) -> bool:
    if text.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quotation: the command goes on
        return False
    return True


def commands(block: Block) -> list[Command]:
    """The block's commands, continuation lines and multi-line quotes joined; comment lines
    between commands skipped."""
    found, current, first = [], [], 0
    for n, line in enumerate(block.lines, block.line + 1):
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not current:
            first = n
        current.append(line)
        joined = "\n".join(current)
        if _complete(joined):
            markers = re.findall(r"#\s*\[(\w+)\]", current[-1])
            found.append(Command(joined.strip(), markers[0] if len(markers) == 1 else None, first))
            current = []
    assert not current, f"line {first}: a command never ends: {current[0]}"
    return found


def _page_blocks(page: Path) -> list[Block]:
    return blocks(page.read_text())


def _shell_blocks(page: Path) -> list[Block]:
    return [b for b in _page_blocks(page) if b.lang in ("sh", "bash", "shell")]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_command_carries_one_marker(page):
    unmarked = [f"{_rel(page)}:{c.line}: {c.text.splitlines()[0]}"
                for b in _shell_blocks(page) for c in commands(b) if c.marker not in MARKERS]
    assert not unmarked, "commands without one of " + ", ".join(f"# [{m}]" for m in MARKERS) + \
        ":\n" + "\n".join(unmarked)


def test_every_page_starts_with_its_commands():
    for page in PAGES[1:]:
        first = _page_blocks(page)[0]
        assert first.lang == "sh", f"{_rel(page)}: the first block is not the page's commands"
        lines_before = page.read_text().splitlines()[:first.line - 1]
        assert sum(bool(line.strip()) for line in lines_before) <= 2, \
            f"{_rel(page)}: its commands come after prose"


def test_readme_test_command_is_what_ci_runs():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    command = ci[-1]
    assert command == "make test"
    readme = [c.text.split("#")[0].strip() for b in _shell_blocks(REPO / "README.md")
              for c in commands(b)]
    assert command in readme


# ------------------------------------------------------------------------- running the quick ones

def _scratch(tmp_path: Path) -> Path:
    """A folder whose entries link to the repository's, so a command's outputs land in it."""
    for entry in REPO.iterdir():
        if entry.name not in (".git", "runs", "data"):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def _as_run(command: str) -> str:
    """The command as written, with the repository's interpreter for `.venv/bin/python`, so the
    test runs where the suite runs whatever the venv is called."""
    return re.sub(r"(?<![\w/.])\.venv/bin/python(?=\s)", shlex.quote(sys.executable), command)


def _words(command: str) -> str:
    """The command's words, whatever its line breaks and indentation."""
    return " ".join(command.replace("\\\n", " ").split())


_OUTPUTS: dict[str, str] = {}
"""stdout of each quick command run so far: pages share commands (README's compare is
schedules.md's) and each runs once. A command's output depends on its text and on files the
commands before it in its page wrote, which are named in its text."""


def _run(command: str, cwd: Path) -> str:
    key = _words(command)
    if key not in _OUTPUTS:
        result = subprocess.run(["bash", "-c", _as_run(command)], cwd=cwd, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, \
            f"exit {result.returncode}: {command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        _OUTPUTS[key] = result.stdout
    return _OUTPUTS[key]


def _outputs_shown(page: Path) -> list[tuple[Block, Block]]:
    """(quick command block, the text block right after it) pairs."""
    text_lines = page.read_text().splitlines()
    found, page_blocks = [], _page_blocks(page)
    for block, after in zip(page_blocks, page_blocks[1:]):
        between = text_lines[block.line + len(block.lines) + 1:after.line - 1]
        if block.lang == "sh" and after.lang == "text" and not any(l.strip() for l in between):
            found.append((block, after))
    return found


QUICK_PAGES = [p for p in PAGES
               if any(c.marker == "quick" for b in _shell_blocks(p) for c in commands(b))]


@pytest.mark.parametrize("page", QUICK_PAGES, ids=_rel)
def test_quick_commands_run_as_written(page, tmp_path):
    cwd = _scratch(tmp_path)
    outputs: dict[int, str] = {}
    for block in _shell_blocks(page):
        quick = [c for c in commands(block) if c.marker == "quick"]
        outputs[block.line] = "".join(_run(c.text, cwd) for c in quick)
    for block, shown in _outputs_shown(page):
        assert all(c.marker == "quick" for c in commands(block)), \
            f"{_rel(page)}:{shown.line}: output shown for commands that are not all quick"
        printed = outputs[block.line]
        missing = [line for line in shown.lines if line.strip() and line.rstrip() not in printed]
        assert not missing, f"{_rel(page)}:{shown.line}: the shown output differs from what " \
                            f"the command prints now; not printed:\n" + "\n".join(missing)


COMPARE_K4 = (".venv/bin/python tools/plan.py compare --model 7b --seq-length 65536 --tp 8 "
              "--sequence-parallel --partition compute --pp 4 --microbatches 8 --splits 4")



@pytest.mark.parametrize("page", [REPO / "README.md", REPO / "docs" / "schedules.md"], ids=_rel)
def test_schedule_table_is_what_compare_prints(page, tmp_path):
    texts = [c.text for b in _shell_blocks(page) for c in commands(b)]
    command = next(t for t in texts if _words(t).startswith(COMPARE_K4))
    # compare's row: name k=K V=V placement makespan bubble gap peaks...; a table row: name,
    # chunks per rank when the table has them (the first digit), ..., bubble, the lower-bound
    # gap when the table has it, rank 0 / last rank peaks; a name without chunks is compare's
    # first row of that name
    printed: dict = {}
    for line in _run(command, _scratch(tmp_path)).splitlines()[1:]:
        fields = line.split()
        if fields and "@" not in line:
            printed[(fields[0], fields[2][2:])] = fields
            printed.setdefault((fields[0], ""), fields)
    rows = re.findall(r"^\| `([\w-]+)` \|(?: (\d)[^|%]*\|)?(?:.*?\|)? ([\d.]+%) \|"
                      r"(?: ([\d.]+%) \|)? ([\d.]+) / ([\d.]+) \|$", page.read_text(), re.M)
    assert len(rows) >= 9, f"{_rel(page)}: no schedule table"
    for name, chunks, bubble, gap, rank0, last in rows:
        fields = printed[(name, chunks)]
        shown = (bubble, gap or fields[6], rank0, last)   # a table without gaps: not checked
        assert (fields[5], fields[6], fields[7], fields[-1]) == shown, \
            f"{_rel(page)}: {name}'s row says {shown}, compare prints {fields}"


# ------------------------------------------------------------------------- links and names

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    prose = _without_blocks(page.read_text())
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", prose, re.M)}


def _without_blocks(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```\s*$", "", text, flags=re.M | re.S)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_blocks(page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{_rel(page)}:\n" + "\n".join(broken)


def _named(page: Path) -> list[str]:
    return re.findall(r"`([^`\s]+)`", page.read_text())


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_paths_exist(page):
    missing = []
    for name in _named(page):
        path = name.split(":")[0].rstrip(".,;)")
        if path in MEGATRON_LM_PATHS or not (path.startswith(REPO_ROOTS) or path in REPO_FILES):
            continue
        if not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"{_rel(page)} names paths that do not exist: {sorted(set(missing))}"


@functools.cache
def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        module = REPO.joinpath(*parts[:cut])
        if module.with_suffix(".py").exists() or (module / "__init__.py").exists():
            obj = importlib.import_module(".".join(parts[:cut]))
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_modules_exist(page):
    dotted = {m.group(1) for name in _named(page)
              for m in [re.match(r"^((?:seq1f1b|megatron\.training)(?:\.\w+)+)(?:\(\))?$", name)]
              if m}
    missing = sorted(d for d in dotted if not _resolves(d))
    assert not missing, f"{_rel(page)} names modules or attributes that do not exist: {missing}"
