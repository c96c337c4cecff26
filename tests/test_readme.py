"""The README and docs/ name only things that exist: scripts, modules, files and links.

CPU only: files are checked on disk, `python -m` modules and dotted `cgcompile.` names by
import, `Config(...)` keywords against the dataclass, links by their target path.
"""

import dataclasses
import importlib
import pathlib
import re

import pytest

import cgcompile
from cgcompile.config import FLAT_NAMES

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 220
TOP_FOLDERS = ("benchmarks", "cgcompile", "docs", "examples", "passes", "tests")

MODULE_RUN = re.compile(r"python3? -m ([\w.]+)")
PATH = re.compile(r"(?<![\w/.])((?:%s)/[\w./-]*\w)" % "|".join(TOP_FOLDERS))
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
DOTTED = re.compile(r"`(cgcompile(?:\.\w+)+)")
CONFIG_CALL = re.compile(r"(?<![\w.])Config\(([^()]*)\)")
KEYWORD = re.compile(r"(?:^|,)\s*(\w+)\s*=")


def _text(page: pathlib.Path) -> str:
    return page.read_text(encoding="utf-8")


def _resolve(dotted: str):
    """Import the longest module prefix of `dotted`, then walk the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def _names(pattern: re.Pattern, page: pathlib.Path) -> set[str]:
    return {match.group(1) for match in pattern.finditer(_text(page))}


def test_readme_is_a_front_door():
    lines = _text(ROOT / "README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md: expected at most {README_MAX_LINES} lines, got {lines}"


def test_readme_keeps_the_ci_commands():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith(("python3", ".venv"))]
    readme = _text(ROOT / "README.md")
    assert ci and all(command in readme for command in ci), f"README.md: expected .ci/run's commands {ci}"


def test_readme_says_how_to_get_a_cpu_torch():
    setup = _text(ROOT / "README.md").split("## On a fresh machine")[1].split("\n## ")[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in setup, "README.md: expected the CPU wheel index"
    assert "torchvision" in setup, "README.md: expected the warning that an unpinned torchvision pulls a CUDA torch"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_paths_exist(page):
    missing = sorted(path for path in _names(PATH, page) if "<" not in path and not (ROOT / path).exists())
    assert not missing, f"{page.name}: expected these paths to exist, got none at {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_m_modules_import(page):
    for module in sorted(_names(MODULE_RUN, page) - {"venv", "pip", "pytest"}):
        importlib.import_module(module)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    targets = [t for t in _names(LINK, page) if not re.match(r"\w+://", t)]
    missing = sorted(t for t in targets if not (page.parent / t).exists())
    assert not missing, f"{page.name}: expected these links to point to files, got none at {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_dotted_names_resolve(page):
    for dotted in sorted(_names(DOTTED, page)):
        _resolve(dotted)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_config_keywords_exist(page):
    fields = {field.name for field in dataclasses.fields(cgcompile.Config)} | set(FLAT_NAMES)  # groups and flat names
    used = {kw for args in _names(CONFIG_CALL, page) for kw in KEYWORD.findall(args)}
    assert used <= fields, f"{page.name}: expected Config fields, got unknown keywords {sorted(used - fields)}"


def test_checks_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("run `python -m cgcompile.no_such_module` on `benchmarks/no_such.py`, see [x](gone.md)\n")
    assert _names(PATH, page) == {"benchmarks/no_such.py"}
    assert _names(LINK, page) == {"gone.md"}
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(_names(MODULE_RUN, page).pop())
    with pytest.raises(AttributeError):
        _resolve("cgcompile.no_such_name")


# A section the library's own text sends a reader to: `README "Title"`, `docs/x.md, "Title"`
# or `docs/x.md#anchor`, in a message, a docstring or a comment of cgcompile/ and passes/.
SOURCES = sorted([*(ROOT / "cgcompile").rglob("*.py"), *(ROOT / "passes").rglob("*.py")])
NAMED_SECTION = re.compile(r"\b(README|(?:%s)/[\w/-]+\.md)(?:,? \"([^\"]+)\"|#([\w-]+))" % "|".join(TOP_FOLDERS))


def _sections(page: pathlib.Path) -> set[str]:
    """The titles a reader can find in `page`: its headings and bold paragraph leads."""
    text = _text(page)
    headings = re.findall(r"^#+\s+(.+?)\s*$", text, re.MULTILINE)
    return {*headings, *re.findall(r"\*\*([^*]+)\*\*", text)}


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _missing_sections(text: str) -> list[str]:
    missing = []
    for file, title, anchor in NAMED_SECTION.findall(text):
        page = ROOT / ("README.md" if file == "README" else file)
        found = page.exists() and (title in _sections(page) if title else
                                   anchor in {_anchor(h) for h in _sections(page)})
        if not found:
            missing.append(f"{file} {title or '#' + anchor}")
    return missing


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_sections_named_in_the_library_exist(source):
    missing = _missing_sections(_text(source))
    assert not missing, f"{source.relative_to(ROOT)}: expected these sections to exist, got none for {missing}"


def test_named_section_check_can_fail():
    assert _missing_sections('see README "No such section" or docs/design.md#no-such-anchor') == [
        "README No such section", "docs/design.md #no-such-anchor"]
    assert not _missing_sections('see docs/design.md, "The capture dimension" or docs/design.md#the-split-rule')
