"""The package's shape: imports flow down, the passes are pure, test tools stay apart.

Read from the source with `ast` (nothing is imported), so a cycle or an import that runs
back up is caught even when it sits inside a function.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENGINE_ROOMS = ("cgcompile.breakable", "cgcompile.parallel")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for base, package in (("cgcompile", "cgcompile"), ("passes", "cgcompile.passes")):
        for path in (ROOT / base).rglob("*.py"):
            parts = list(path.relative_to(ROOT / base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The library modules `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            subs = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            targets |= subs if subs and len(subs) == len(node.names) else ({base} & modules.keys()) | subs
        elif isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names} & modules.keys()
    return targets - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_passes_import_nothing_from_the_library():
    up = {(a, b) for a, bs in _graph().items() if a.startswith("cgcompile.passes")
          for b in bs if not b.startswith("cgcompile.passes")}
    assert not up, f"passes/ must stay pure (GraphModule in, data out); these import the library: {sorted(up)}"


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    # The package's __init__ imports its submodules; only a submodule importing back is a cycle.
    cycles = [c for c in cycles if not (c[0] == c[-1] and c[0] in ("cgcompile", "cgcompile.breakable"))]
    assert not cycles, f"import cycles: {cycles}"


def test_the_engine_does_not_import_its_test_tools_or_orchestrators():
    graph = _graph()
    engine = [name for name in graph if name.startswith(ENGINE_ROOMS) or name.count(".") == 1
              and not name.startswith(("cgcompile.testing", "cgcompile.passes", "cgcompile.fuzz"))]
    tools = {(a, b) for a in engine for b in graph[a] if b.startswith("cgcompile.testing")}
    assert not tools, f"the engine imports the test tools: {sorted(tools)}"
    # Lower rooms never reach the orchestrators above them.
    above = {"cgcompile.backend", "cgcompile.manager", "cgcompile.phases"}
    lower = [name for name in engine if name not in above | {"cgcompile.inspect", "cgcompile.memory_plan"}]
    up = {(a, b) for a in lower for b in graph[a] & above}
    assert not up, f"imports that run back up to an orchestrator: {sorted(up)}"
