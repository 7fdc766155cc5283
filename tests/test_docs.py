"""README.md and docs/*.md say only what exists: links, make targets, modules and comm's names; nothing in the
project cites a file outside it.

Fast and in-process: it reads files and resolves modules without importing them (except `comm`
itself, for the API summary).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
MAKE = re.compile(r"\bmake\s+([A-Za-z0-9_./-]+)")
PYTHON_M = re.compile(r"\bpython[\d.]*\s+-m\s+([A-Za-z_][\w.]*)")
TORCHRUN_M = re.compile(r"\btorchrun\b[^\n#]*?\s-m\s+([A-Za-z_][\w.]*)")
# Modules the docs run that are neither comm's nor torch's: the test extras' tools.
TOOLS = {"pytest"}
COMM_NAME = re.compile(r"\bcomm((?:\.[A-Za-z_]\w*)+)")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def _code(text: str) -> List[str]:
    """The fenced blocks and inline code spans of a markdown text."""
    blocks = [match.group(0) for match in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    return blocks + [match.group(2) for match in INLINE_CODE.finditer(prose)]


def _prose(text: str) -> str:
    """The text without code, where a link is a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(page: Path) -> Set[str]:
    found: Set[str] = set()
    seen: Dict[str, int] = {}
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> Iterator[str]:
    for match in LINK.finditer(_prose(page.read_text())):
        yield match.group(1)


def broken_links(page: Path) -> List[str]:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {_rel(file)}")
    return broken


def make_targets() -> Set[str]:
    variables = {"VENV": ".venv", "CLIENTS_VENV": ".venv-clients"}
    targets: Set[str] = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([^\s#=:][^=:]*?):(?!=)", line)
        if match:
            for name in match.group(1).split():
                targets.add(re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), name))
    return targets


def module_exists(name: str) -> bool:
    """Whether ``name`` is a module of this repository or of torch, found without importing it;
    a tool the docs run from the venv (pytest) is found by its top-level name."""
    top = name.split(".")[0]
    if top in TOOLS:
        return name == top and importlib.util.find_spec(top) is not None
    if top == "torch":
        spec = importlib.util.find_spec("torch")
        assert spec is not None and spec.submodule_search_locations
        base = Path(list(spec.submodule_search_locations)[0]).parent
    else:
        base = ROOT
    path = base.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def api_summary() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^## API in brief\n(.*?)(?=^## )", readme, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no '## API in brief' section"
    return match.group(1)


def resolve(dotted: str) -> object:
    """``comm.<a>.<b>``'s object, importing comm's submodules on the way; AttributeError if absent."""
    obj: object = importlib.import_module("comm")
    path = "comm"
    for part in dotted.split("."):
        path = f"{path}.{part}"
        if not hasattr(obj, part) and importlib.util.find_spec(path) is not None:
            importlib.import_module(path)
        obj = getattr(obj, part)
    return obj


def _commands(pattern: re.Pattern) -> List[Tuple[str, str]]:
    found = []
    for page in PAGES:
        for code in _code(page.read_text()):
            found += [(_rel(page), match.group(1)) for match in pattern.finditer(code)]
    return found


def test_the_pages_exist():
    assert (ROOT / "README.md") in PAGES and len(PAGES) > 1
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_every_make_target_exists():
    found = _commands(MAKE)
    assert ("README.md", "demo") in found and ("README.md", "test") in found
    targets = make_targets()
    assert [(page, target) for page, target in found if target not in targets] == []


def test_every_python_m_module_exists():
    found = _commands(PYTHON_M) + _commands(TORCHRUN_M)
    assert ("README.md", "comm.build") in found
    assert [(page, module) for page, module in found if not module_exists(module)] == []


def test_every_comm_name_in_the_api_summary_exists():
    names = set()
    for code in _code(api_summary()):
        names.update(match.group(1)[1:] for match in COMM_NAME.finditer(code))
    assert {"all_reduce", "equip", "patch", "testing.simulate_accelerator"} <= names
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except AttributeError:
            missing.append(f"comm.{name}")
    assert missing == []


# Places a reader of this repository cannot open: the folders beside a checkout on the machine the
# project is developed on (its notes, its tools), named by a path that climbs out or is absolute.
OUTSIDE = re.compile(r"(?:\.\./)+shared\b|(?<![\w.])/w[o]rk/|\.\./\.library\b")  # [o]: this line is no hit itself
# What the project is made of: its code, tests, docs, examples, benchmarks and top-level files.
CITING = ("comm", "tests", "docs", "examples", "benchmarks")
CITING_SUFFIXES = {".py", ".md", ".cpp", ".h", ".cfg", ".toml", ".txt", ".sh", ".yaml", ".yml"}


def project_files() -> Iterator[Path]:
    for path in sorted(ROOT.iterdir()):
        if path.is_file() and (path.suffix in CITING_SUFFIXES or path.name == "Makefile"):
            yield path
    for folder in CITING:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in CITING_SUFFIXES and "__pycache__" not in path.parts:
                yield path


def outside_citations(path: Path) -> List[str]:
    """Each line of ``path`` that names a file outside the repository, as ``path:line: text``."""
    lines = path.read_text(errors="replace").splitlines()
    return [f"{_rel(path)}:{number}: {line.strip()}" for number, line in enumerate(lines, 1) if OUTSIDE.search(line)]


def test_nothing_cites_a_file_outside_the_repository():
    """Code, tests and docs cite public sources (repository, commit, path, line), never notes beside a checkout."""
    checked = list(project_files())
    assert Path(__file__).resolve() in checked and len(checked) > 100
    assert [hit for path in checked for hit in outside_citations(path)] == []


# The checks themselves: each finds what it is for.


def test_the_checks_catch_what_they_are_for(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## The `torch.compile` part's end\n")
    page.write_text("[ok](other.md#the-torchcompile-parts-end) [file](missing.md) [anchor](other.md#nowhere)\n"
                    "`[not a link](missing.md)`\n")
    assert broken_links(page) == ["missing.md: no file missing.md", "other.md#nowhere: no heading #nowhere in other.md"]
    assert not module_exists("comm.no_such_module") and module_exists("torch.distributed.run")
    assert "no-such-target" not in make_targets() and "test" in make_targets()
    with pytest.raises(AttributeError):
        resolve("no_such_name")
    cited = tmp_path / "cited.cpp"
    beside = "/".join(["..", "shared", "reference", "notes.md"])  # joined here, so that this file cites nothing
    machine = "/".join(["", "work", "main", "comm"])
    cited.write_text(f"// as {beside} says\n// torch.library.Library is fine\n// see {machine}\n")
    assert [hit.split(": ")[0] for hit in outside_citations(cited)] == ["cited.cpp:1", "cited.cpp:3"]
