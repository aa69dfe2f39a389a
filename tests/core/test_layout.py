"""The repository layout the README promises, that every package folder is installed, and that
imports point one way: kernels <- models <- core (aiinfra_jax: data, tasks, train, ...) <- eval."""

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_top_level_is_the_planned_layout():
    tracked = {"pyproject.toml", "README.md", "Makefile", "train.py", "aiinfra_jax", "models",
               "kernels", "eval", "configs", "tests", ".ci"}
    for name in tracked:
        assert (ROOT / name).exists(), name
    assert (ROOT / ".ci" / "run").exists()
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    for pkg_root, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            name = ".".join((pkg_root, *rel.parts)) if rel.parts else pkg_root
            assert name in listed, f"{name} ({init.parent}) is missing from pyproject's packages"


def test_one_namespace():
    import aiinfra_jax.eval
    import aiinfra_jax.kernels
    import aiinfra_jax.models
    assert Path(aiinfra_jax.models.__file__).parent == ROOT / "models"
    assert Path(aiinfra_jax.kernels.__file__).parent == ROOT / "kernels"
    assert Path(aiinfra_jax.eval.__file__).parent == ROOT / "eval"


# ----------------------------------------------------------------------------- import directions

# Where each subpackage lives (pyproject's package-dir).
PACKAGE_DIRS = {"aiinfra_jax": ROOT / "aiinfra_jax", "aiinfra_jax.models": ROOT / "models",
                "aiinfra_jax.kernels": ROOT / "kernels", "aiinfra_jax.eval": ROOT / "eval"}
STDLIB = frozenset(sys.stdlib_module_names)


def _module_name(path: Path) -> str:
    for pkg, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[1].parts)):
        if folder in path.parents:
            parts = list(path.relative_to(folder).with_suffix("").parts)
            return ".".join([pkg] + (parts[:-1] if parts[-1] == "__init__" else parts))
    raise ValueError(path)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file: at module level, inside functions and classes,
    under ``if TYPE_CHECKING``, relative ones resolved, ``from a import b`` as both ``a`` and
    ``a.b`` (b may be a submodule), and ``importlib.import_module("...")`` / ``__import__("...")``
    with a literal name."""
    module = _module_name(path)
    package = module if _is_package(path) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(folder: Path, allowed) -> list[str]:
    """Every import in folder's .py files that ``allowed(module_name)`` refuses, as path:line."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        for line, name in imports_of(path):
            if not allowed(name):
                out.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return out


def _third_party_ok(name: str, allowed_roots: set[str]) -> bool:
    root = name.split(".")[0]
    return root in STDLIB or root in allowed_roots


def test_kernels_import_only_jax_numpy_and_the_standard_library():
    def allowed(name):
        if _within(name, "aiinfra_jax"):
            return _within(name, "aiinfra_jax.kernels")
        return _third_party_ok(name, {"jax", "numpy"})

    assert _violations(ROOT / "kernels", allowed) == []


def test_models_import_only_kernels_jax_flax_numpy_and_the_standard_library():
    # Never the trainer, data (grain, datasets: the GPU machine has neither) or eval.
    def allowed(name):
        if _within(name, "aiinfra_jax"):
            return any(_within(name, p) for p in ("aiinfra_jax.models", "aiinfra_jax.kernels"))
        return _third_party_ok(name, {"jax", "flax", "numpy"})

    assert _violations(ROOT / "models", allowed) == []


def test_the_core_never_imports_eval():
    # aiinfra_jax/*.py, data/, tasks/ (...): in-loop evaluations reach the loop as hooks.
    assert _violations(ROOT / "aiinfra_jax", lambda n: not _within(n, "aiinfra_jax.eval")) == []


def test_the_import_reader_sees_every_form(tmp_path, monkeypatch):
    """The checks above are only as good as imports_of: each form of import is found."""
    pkg = tmp_path / "aiinfra_jax" / "sub"
    pkg.mkdir(parents=True)
    f = pkg / "mod.py"
    f.write_text("import os, grain.experimental\n"
                 "from . import sibling\n"
                 "from ..data import pipeline\n"
                 "from typing import TYPE_CHECKING\n"
                 "if TYPE_CHECKING:\n    import optax\n"
                 "def f():\n    from aiinfra_jax import eval as e\n"
                 "class C:\n    def g(self):\n        import importlib\n"
                 "        return importlib.import_module('aiinfra_jax.eval.longctx')\n")
    monkeypatch.setitem(PACKAGE_DIRS, "aiinfra_jax", tmp_path / "aiinfra_jax")
    names = {n for _, n in imports_of(f)}
    assert {"os", "grain.experimental", "aiinfra_jax.sub", "aiinfra_jax.sub.sibling",
            "aiinfra_jax.data", "aiinfra_jax.data.pipeline", "optax", "aiinfra_jax.eval",
            "aiinfra_jax.eval.longctx", "importlib"} <= names, names


def _loaded_after(statement: str, *packages: str) -> list[str]:
    """The modules of ``packages`` (each with its submodules) that ``statement`` loads, run in a
    fresh interpreter."""
    code = (f"import sys; {statement}; "
            f"print(' '.join(m for m in sys.modules for p in {packages!r} "
            f"if m == p or m.startswith(p + '.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
    return out.stdout.split()


def test_importing_the_trainer_loads_no_eval_module():
    assert _loaded_after("import aiinfra_jax.train", "aiinfra_jax.eval") == []


@pytest.mark.parametrize("package", ["aiinfra_jax.models", "aiinfra_jax.kernels"])
def test_models_and_kernels_load_no_data_stack(package):
    # the GPU machine has neither grain nor datasets; only data code may import them
    assert _loaded_after(f"import {package}", "grain", "datasets", "aiinfra_jax.data") == []


def test_loading_a_model_needs_no_grain():
    # load_model (and the export built on it) must run where grain is not installed: the config
    # and the tokenizer come from aiinfra_jax.data's submodules, whose package loads lazily.
    assert _loaded_after("import aiinfra_jax.load", "grain", "datasets") == []
