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


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (names for annotations, never run)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return found


def _imports(name: str, path: pathlib.Path, modules: dict, *, types: bool = True) -> set[str]:
    """The library modules `name` imports anywhere in its file (types: those imported for
    annotations only, under TYPE_CHECKING, too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    tree = ast.parse(path.read_text())
    skip = set() if types else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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


def _graph(*, types: bool = True) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, types=types) for name, path in modules.items()}


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


def _engine(graph) -> list[str]:
    """Every library module but the test tools, the passes and the fuzzer's command."""
    return [name for name in graph if name.startswith("cgcompile")
            and not name.startswith(("cgcompile.testing", "cgcompile.passes", "cgcompile.fuzz"))]


def test_the_engine_does_not_import_its_test_tools_or_orchestrators():
    graph = _graph()
    engine = _engine(graph)
    tools = {(a, b) for a in engine for b in graph[a] if b.startswith("cgcompile.testing")}
    assert not tools, f"the engine imports the test tools: {sorted(tools)}"
    # Lower rooms never reach the orchestrators above them.
    above = {"cgcompile", "cgcompile.backend", "cgcompile.manager", "cgcompile.build.phases"}
    lower = [name for name in engine if name not in above | {"cgcompile.inspect", "cgcompile.build"}]
    up = {(a, b) for a in lower for b in graph[a] & above}
    assert not up, f"imports that run back up to an orchestrator: {sorted(up)}"


# What each layer may not import (docs/architecture.md): compile time (build/) makes what runs
# per call (run/); the tools read both; nothing below reaches the Backend or the manager.
LAYER_RULES = {
    "cgcompile.run": ("cgcompile.build", "cgcompile.tools", "cgcompile.backend", "cgcompile.manager"),
    "cgcompile.build": ("cgcompile.tools", "cgcompile.backend", "cgcompile.manager"),
    "cgcompile.tools": ("cgcompile.backend", "cgcompile.manager"),
}


def test_each_layer_imports_only_what_lies_below_it():
    """Run-time imports; a name for an annotation (TYPE_CHECKING) is no dependency."""
    graph = _graph(types=False)
    wrong = sorted((a, b) for a, imported in graph.items() for layer, banned in LAYER_RULES.items()
                   if a == layer or a.startswith(layer + ".") for b in imported
                   if any(b == x or b.startswith(x + ".") for x in banned))
    assert not wrong, f"imports that cross a layer upward: {wrong}"


def test_the_top_level_holds_the_public_api_and_few_modules():
    top = sorted(p.stem for p in (ROOT / "cgcompile").glob("*.py") if p.stem != "__init__")
    assert len(top) <= 10, f"cgcompile/ holds {len(top)} modules ({top}); put new ones in a layer's folder"
    for layer in ("build", "run", "tools"):
        assert (ROOT / "cgcompile" / layer / "__init__.py").exists(), layer


def test_the_memory_plan_is_handed_what_it_reads():
    """Its functions take the session, runtimes, runners and a probe factory (`GraphOwner`),
    never the Backend: a parameter named `backend` is the Backend coming back in."""
    path = ROOT / "cgcompile" / "tools" / "memory_plan.py"
    taking = [f"{node.name} (line {node.lineno})" for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
              and "backend" in {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}]
    assert not taking, f"memory_plan functions that take the Backend: {taking}"


# -- no object patched after construction ------------------------------------------------------
#
# An object is complete when its constructor returns: its owner sets its attributes, through
# `self` (or `cls`), and nobody else does. The scan below finds every attribute written on
# something that is not `self`/`cls` (`x.attr = ...`, `x.attr += ...`, `setattr(x, ...)`,
# `x.__dict__.update(...)`) in the engine (cgcompile/ minus the test tools in
# cgcompile/testing/). Each exception is listed with why it is not a patch.
PATCH_ALLOWED = {
    ("cgcompile/breakable/path.py", "runner.module.forward"):
        "installing a breakable path routes the user's module through its runner, and uninstall puts "
        "the module's own forward back: the manager's documented install/uninstall",
    ("cgcompile/breakable/signature.py", "state.last"): "SignatureRule's own per-size record (`_SizeState`)",
    ("cgcompile/breakable/signature.py", "state.observed"): "SignatureRule's own per-size record (`_SizeState`)",
    ("cgcompile/breakable/signature.py", "state.full_warned"): "SignatureRule's own per-size record (`_SizeState`)",
    ("cgcompile/breakable/transformers.py", "setattr(cache_utils.Cache, ...)"):
        "transformers' Cache methods hooked only while a call is recorded, restored after (the integration)",
    ("cgcompile/run/capture.py", "wrapped.device"): "as_pool builds a GraphPool around a raw handle (construction)",
    ("cgcompile/run/capture.py", "wrapped.handle"): "as_pool builds a GraphPool around a raw handle (construction)",
    ("cgcompile/parallel/distributed.py", "timer.daemon"): "a threading.Timer made daemon before it starts",
    ("cgcompile/run/replay_plan.py", "replay.source"): "a generated replay function keeps its source, where it is made",
    ("cgcompile/config.py", "__init__.__signature__"): "the signature help(Config) shows, set in the class body",
    ("cgcompile/run/fused_weights.py", "p.data"):
        "Config.fuse_sibling_linears: a parameter becomes a view of its rows of the fused weight, where no other "
        "tensor holds its memory (the documented sharing; torch's own way to move a parameter's data)",
    ("cgcompile/build/dependent_launch.py", "kernel_class._handle_pdl_before_access"):
        "Inductor's PDL wait decided as if no kernel came before, for one compile and put back after it",
    ("cgcompile/build/dependent_launch.py", "compiler_config.cache_key_tag"):
        "that compile keyed apart in Inductor's caches, the tag put back after it",
    ("cgcompile/build/dependent_launch.py", "scheduler.previous_node"):
        "hidden from Inductor's wait decision for one call, put back after it",
    ("cgcompile/build/dependent_launch.py", "handle.__wrapped__"): "the wrapper names what it wraps, where it is made",
    ("cgcompile/compat.py", "guards.inner"):
        "the guard set of the frame Dynamo is compiling, rebuilt without the DTensor spec guards cgcompile checks "
        "itself: no torch API removes single guards (remove_guards_with_source matches only root sources in 2.11)",
    ("cgcompile/compat.py", "guards.source_to_guards"): "that guard set's index by source (torch >= 2.12), rebuilt with it",
}


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _patches(tree: ast.AST) -> list[tuple[str, int]]:
    """(what is written, line) for every attribute written on an object that is not self/cls."""
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple)
                                                             else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if _root_name(node.args[0]) not in ("self", "cls"):
                found.append((f"setattr({ast.unparse(node.args[0])}, ...)", node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
              and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "__dict__"):
            if _root_name(node.func.value.value) not in ("self", "cls"):
                found.append((f"{ast.unparse(node.func.value)}.update(...)", node.lineno))
        for target in targets:
            if isinstance(target, ast.Attribute) and _root_name(target) not in ("self", "cls"):
                found.append((ast.unparse(target), node.lineno))
    return found


def test_the_patch_scan_finds_each_form_of_patching():
    source = ("def f(runner, top, stitch, ns, probe):\n"
              "    runner.session = probe\n    top.step.size += 1\n    setattr(stitch, 'piece_1', runner)\n"
              "    ns.__dict__.update({})\n    self.session = probe\n    self.plans.session = probe\n")
    assert [what for what, _ in _patches(ast.parse(source))] == [
        "runner.session", "top.step.size", "setattr(stitch, ...)", "ns.__dict__.update(...)"]


def test_no_object_is_patched_after_construction():
    found = []
    for path in sorted((ROOT / "cgcompile").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("cgcompile/testing/"):
            continue
        found += [f"{rel}:{line}: {what}" for what, line in _patches(ast.parse(path.read_text()))
                  if (rel, what) not in PATCH_ALLOWED]
    assert not found, ("attributes written on objects other than self (hand the value to the constructor, "
                       "or add a method the owner calls; an exception goes in PATCH_ALLOWED with why):\n"
                       + "\n".join(found))


def test_pytest_recurses_into_every_test_folder():
    """pytest skips folders that match `norecursedirs` (by default `build`, `dist`, `venv`,
    ...): a test folder named so would never run, in CI or anywhere, and nothing would say so."""
    import fnmatch
    import tomllib

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    patterns = options.get("norecursedirs", ["*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules",
                                             "venv", "{arch}"])
    folders = [p for p in (ROOT / "tests").rglob("*") if p.is_dir() and p.name != "__pycache__"
               and any(p.glob("test_*.py"))]
    skipped = [str(p.relative_to(ROOT)) for p in folders if any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]
    assert folders and not skipped, f"pytest would not collect these test folders: {skipped}"
