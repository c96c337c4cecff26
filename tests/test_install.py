"""A regular (non-editable) install imports, from the repository root and from elsewhere.

From the root, the source folder `cgcompile/` shadows the installed package and has no
`passes/` inside (see `cgcompile/__init__.py`). The wheel is built offline from a copy of
the sources, so the checkout gets no build/ or egg-info folders.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMPORT = (
    "import cgcompile, cgcompile.passes, cgcompile.passes.split_rule; "
    "print(cgcompile.__file__); print(cgcompile.passes.__file__)"
)


def _run(args, cwd, env=None):
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()


def _install_wheel(tmp_path) -> pathlib.Path:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("cgcompile", "passes"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"), str(source)],
         cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("cgcompile-*.whl")
    target = tmp_path / "site"
    _run(pip + ["install", "--no-deps", "--no-index", "--target", str(target), str(wheel)], cwd=tmp_path)
    return target


def test_regular_install_imports_from_the_repository_root_and_elsewhere(tmp_path):
    target = _install_wheel(tmp_path)
    # -S: no .pth files, so the development venv's editable-install finder stays out;
    # torch comes from its site-packages folder on PYTHONPATH instead.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]]))
    python = [sys.executable, "-S", "-c", IMPORT]

    package, passes = _run(python, cwd=ROOT, env=env)
    assert pathlib.Path(package) == ROOT / "cgcompile" / "__init__.py"  # the source folder shadows the install
    assert pathlib.Path(passes) == ROOT / "passes" / "__init__.py"

    package, passes = _run(python, cwd=tmp_path, env=env)
    assert pathlib.Path(package) == target / "cgcompile" / "__init__.py"
    assert pathlib.Path(passes) == target / "cgcompile" / "passes" / "__init__.py"
