"""Helpers shared by test files (importable as `helpers`: tests/conftest.py puts this folder on
sys.path, since the suite runs with --import-mode=importlib and tests/ is not a package)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from aiinfra_jax.config import load_config

ROOT = Path(__file__).resolve().parents[1]

# configs/tiny.py shrunk to seconds per run on 2 cores.
TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
    "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=2", "optim.lr=3e-3",
    "eval.every=0", "eval.batches=2", "eval.final_batches=2", "run.progress=false",
    "mesh.num_devices=1",  # one device unless a test asks for the mesh: much faster on 2 cores
]


def tiny(tmp_path, *extra):
    """configs/tiny.py with TINY, writing its runs under tmp_path, plus ``extra`` overrides."""
    return load_config(str(ROOT / "configs" / "tiny.py"),
                       TINY + [f"run.output_dir={tmp_path}"] + list(extra))


def data_files(step_dir):
    """The array data files of a checkpoint step folder."""
    return sorted(p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d")


def flip_byte_of(step_dir, array, shard: int = 0) -> None:
    """Flips one bit in the middle of ``array``'s shard ``shard`` where the data files hold it."""
    needle = np.asarray(array.addressable_shards[shard].data).tobytes()
    for path in data_files(step_dir):
        raw = bytearray(path.read_bytes())
        at = raw.find(needle)
        if at >= 0:
            raw[at + len(needle) // 2] ^= 0x10
            path.write_bytes(bytes(raw))
            return
    raise AssertionError(f"the bytes of that shard are not stored verbatim under {step_dir}")


def cli_args(tmp_path, *extra) -> list[str]:
    """train.py's command line for ``tiny(tmp_path, *extra)``."""
    args = ["--config", str(ROOT / "configs" / "tiny.py")]
    for kv in TINY + [f"run.output_dir={tmp_path}"] + list(extra):
        args += ["--set", kv]
    return args
