"""The repository layout the README promises, and that every package folder is installed."""

import re
import tomllib
from pathlib import Path

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


def test_kernels_and_models_do_not_import_grain_or_datasets():
    # the GPU machine has neither; only data code may import them
    for folder in ("kernels", "models"):
        for f in (ROOT / folder).rglob("*.py"):
            text = f.read_text()
            assert not re.search(r"^\s*(import|from)\s+(grain|datasets)\b", text, re.M), f
