"""Render docs/config.md from the declarations in cgcompile/config.py, the one source of
Config's fields, their defaults and their docs.

    python tools/config_docs.py > docs/config.md    # regenerate after changing a field
    python tools/config_docs.py --check             # exit 1 when docs/config.md is out of date

tests/test_config.py runs the check on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import pathlib
import sys

from cgcompile.config import Config

DOC_PATH = pathlib.Path(__file__).resolve().parents[1] / "docs" / "config.md"

_EXAMPLE = """\
```python
import cgcompile
from cgcompile.config import FullGraphOptions, Sizes

# flat names (aliases of the group fields), as torch.compile(..., options={...}) takes them
cgcompile.Config(capture_sizes=(1, 2, 4, 8), capturable_split_ops=("attention",), full_graph_compile=True)
# the same Config, by group
config = cgcompile.Config(sizes=Sizes(capture_sizes=(1, 2, 4, 8)), full_graph=FullGraphOptions(full_graph_compile=True))
# read through the groups only
config.sizes.capture_sizes
```"""


def render() -> str:
    """The text of docs/config.md."""
    parts = [_intro(), _overview(), *(_group(part) for part in dataclasses.fields(Config))]
    return "\n\n".join(parts) + "\n"


def _intro() -> str:
    return "\n\n".join([
        "# Config reference",
        "<!-- Generated from cgcompile/config.py by `python tools/config_docs.py > docs/config.md`; "
        "edit the field declarations there, not this file. -->",
        _paragraphs(Config.__doc__),
        _EXAMPLE,
        "What the options cost and gain, measured on GPUs, is in [performance](performance.md).",
    ])


def _overview() -> str:
    rows = ["| group | record | fields (also flat names of `Config(...)`) |", "|---|---|---|"]
    for part in dataclasses.fields(Config):
        names = ", ".join(f"`{f.name}`" for f in dataclasses.fields(part.metadata["group"]))
        cls = part.metadata["group"].__name__
        rows.append(f"| [`{part.name}`](#{part.name}) | `{cls}` | {names} |")
    return "\n".join(["## Groups", "", *rows])


def _group(part: dataclasses.Field) -> str:
    cls = part.metadata["group"]
    default = (f"`{part.default!r}` (automatic, see `Config.full_graph_for`; `None`: off)"
               if part.metadata.get("optional") else f"`{cls.__name__}()`")
    lines = [f'<a id="{part.name}"></a>', f"## `{part.name}`: `{cls.__name__}`", "",
             _paragraphs(cls.__doc__), "", f"Default: {default}."]
    for field in dataclasses.fields(cls):
        lines += ["", _field(part.name, field)]
    return "\n".join(lines)


def _field(part: str, field: dataclasses.Field) -> str:
    read = (f"`config.full_graph_for(cudagraphs).{field.name}`" if part == "full_graph"
            else f"`config.{part}.{field.name}`")
    return (f"### `{field.name}`\n\nWritten `Config({field.name}=...)` or `{part}=...`, read {read}; "
            f"default `{field.default!r}`.\n\n{field.metadata['doc']}")


def _paragraphs(doc: str | None) -> str:
    """A docstring as markdown: its paragraphs, each on one line."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc or "").split("\n\n"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help=f"compare with {DOC_PATH} instead of printing")
    if not parser.parse_args().check:
        sys.stdout.write(render())
        return 0
    if DOC_PATH.exists() and DOC_PATH.read_text() == render():
        return 0
    print(f"{DOC_PATH} is out of date: run python tools/config_docs.py > docs/config.md", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
