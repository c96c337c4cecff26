"""Docstrings and comments of the library name only modules that exist.

A module that is renamed, split or removed leaves its name behind in the prose of the
modules around it, and a reader then looks for a file that is not there. This test reads
every docstring and comment in cgcompile/ and passes/ and resolves each name of the
forms a module is named by: a file (`graph_piece.py`, `breakable/runner.py`), a dotted
path (`cgcompile.breakable.record`, `cgcompile.run.capture.weak_alias`) and, in backticks, a
name relative to the library (`breakable_segments.OpReplay`: the flat name of a module
that now lives in a folder).
"""

import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("cgcompile/**/*.py"), *ROOT.glob("passes/**/*.py")])
PACKAGE_DIRS = {"cgcompile.passes": ROOT / "passes", "cgcompile": ROOT / "cgcompile"}  # pyproject's package-dir

# A file name not preceded by a path or attribute character (`DUMP_DIR/graph_<i>/split.py` is
# a file the dump writes, named from its folder); a dotted path that is not an attribute of
# something else (`torch.ops.cgcompile.all_reduce` is an op).
FILE_NAME = re.compile(r"(?<![\w./<>-])((?:[\w-]+/)*[\w-]+\.py)\b")
DOTTED_PATH = re.compile(r"(?<![\w.])cgcompile(?:\.[A-Za-z_]\w*)+")
# A module in backticks, alone or with a name in it: `breakable_record`, `breakable_segments.OpReplay`.
RELATIVE = re.compile(r"`([a-z][a-z0-9]*_[a-z_0-9]+)(?:`|\.(?!py\b)\w)")
DEFINED = {m for p in SOURCES for m in re.findall(r"^\s*(?:def|class) (\w+)", p.read_text(), re.M)}
FOLDERS = {p.name for p in (ROOT / "cgcompile").iterdir() if (p / "__init__.py").exists()}  # breakable, parallel, ...


def prose(path: pathlib.Path):
    """(line, text) of every comment and docstring in the file at `path`."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                yield node.body[0].lineno, docstring


def file_exists(name: str, near: pathlib.Path) -> bool:
    """A file name resolves beside the module that names it, from the repository root, or,
    given without a folder, anywhere in the library (`mutation.py` for passes/mutation.py)."""
    if (near.parent / name).exists() or (ROOT / name).exists() or (ROOT / "cgcompile" / name).exists():
        return True
    if "/" not in name:  # a bare file name: any folder of the library (run/graph_piece.py, passes/split.py)
        return any(ROOT.glob(f"cgcompile/**/{name}")) or (ROOT / "passes" / name).exists()
    return False


def module_file(dotted: str) -> pathlib.Path | None:
    """The file of module `dotted` (a package's __init__.py), or None."""
    for package, folder in PACKAGE_DIRS.items():
        if dotted == package or dotted.startswith(package + "."):
            base = folder.joinpath(*dotted[len(package) + 1:].split(".")) if dotted != package else folder
            for candidate in (base / "__init__.py", base.with_suffix(".py")):
                if candidate.exists():
                    return candidate
            return None
    return None


def path_exists(dotted: str) -> bool:
    """The longest module prefix of `dotted` exists, and the name after it, if any, is
    defined or imported in that module (`cgcompile.run.capture.weak_alias`, `cgcompile.eager_break`)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        found = module_file(".".join(parts[:end]))
        if found is not None:
            return end == len(parts) or re.search(rf"\b{re.escape(parts[end])}\b", found.read_text()) is not None
    return False


def relative_exists(module: str) -> bool:
    """A module named in backticks is not the flat name of a module now in a folder
    (`breakable_segments` for breakable/segments.py). Other names (`graph_piece`, a Config
    group's `split.splitting_ops`) are left alone."""
    folder, _, rest = module.partition("_")
    flat = folder in FOLDERS and (ROOT / "cgcompile" / folder / f"{rest}.py").exists()
    return not flat or module in DEFINED  # `breakable_path` is also a function of the integrations


def stale_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, name) of each name in the prose of `path` that does not resolve."""
    stale = []
    for line, text in prose(path):
        stale += [(line, m) for m in FILE_NAME.findall(text) if not file_exists(m, path)]
        stale += [(line, m) for m in DOTTED_PATH.findall(text) if not path_exists(m)]
        stale += [(line, m) for m in RELATIVE.findall(text) if not relative_exists(m)]
    return stale


def test_docstrings_and_comments_name_only_modules_that_exist():
    stale = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in SOURCES for line, name in stale_names(path)]
    assert not stale, "names of modules that do not exist:\n" + "\n".join(stale)


@pytest.mark.parametrize("text, stale", [
    ('"""Runs the pieces (see `breakable/old_runner.py`)."""', "breakable/old_runner.py"),
    ("# moved from signature_v2.py", "signature_v2.py"),
    ('"""The rule lives in `cgcompile.passes.split_rules`."""', "cgcompile.passes.split_rules"),
    ('"""`cgcompile.run.capture.no_such_function` makes it."""', "cgcompile.run.capture.no_such_function"),
    ('"""Replays an op (`breakable_segments.OpReplay`)."""', "breakable_segments"),
    ('"""The recorder (see `breakable_record`)."""', "breakable_record"),
])
def test_a_stale_name_is_found(tmp_path, text, stale):
    module = tmp_path / "module.py"
    module.write_text(text + "\n")
    assert stale_names(module) == [(1, stale)]


@pytest.mark.parametrize("text", [
    '"""See `graph_piece.py`, `breakable/runner.py`, passes/split.py and `cgcompile.run.capture.weak_alias`."""',
    '"""Writes DUMP_DIR/graph_<i>/split.py; calls torch.ops.cgcompile.all_reduce."""',
    '"""Binds `capture.weak_alias` and `breakable.segments` beside `torch.cat` and `self.graphs`."""',
])
def test_names_that_exist_pass(tmp_path, text):
    module = tmp_path / "module.py"
    module.write_text(text + "\n")
    assert stale_names(module) == []

