"""A regular (non-editable) install ships `passes/` as `cgcompile.passes` by packaging alone.

From the repository root, the source folder `cgcompile/` shadows an installed package and
has no `passes/` inside: that case gets an ImportError saying to install editable. The
wheel is built offline from a copy of the sources, so the checkout gets no build/ or
egg-info folders.
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


def test_regular_install_imports_elsewhere_and_explains_the_checkout_root(tmp_path):
    target = _install_wheel(tmp_path)
    # -S: no .pth files, so the development venv's editable-install finder stays out;
    # torch comes from its site-packages folder on PYTHONPATH instead.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]]))
    python = [sys.executable, "-S", "-c", IMPORT]

    package, passes = _run(python, cwd=tmp_path, env=env)
    assert pathlib.Path(package) == target / "cgcompile" / "__init__.py"
    assert pathlib.Path(passes) == target / "cgcompile" / "passes" / "__init__.py"

    shadowed = subprocess.run(python, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert shadowed.returncode != 0  # the source folder shadows the install, and says what to do
    assert "install it editable (pip install -e .)" in shadowed.stderr
