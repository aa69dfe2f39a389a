"""Helpers shared by test files (importable as `helpers`: tests/conftest.py puts this folder on
sys.path, since the suite runs with --import-mode=importlib and tests/ is not a package)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
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


def assert_ffn_matches_reference(m, reference, x, seg, ct, *, atol: float) -> jax.Array:
    """An MoE-style FFN module m (moe / deamoe: params, an optional routing `bias`) against
    reference(params_dict, x, seg) -> y: outputs, and gradients of sum(y * ct) for every parameter
    and for x (rtol 1e-5 / 1e-4 on outputs / gradients, the given atol). Every parameter, router
    included, must get a nonzero gradient. Returns our y."""
    from flax import nnx

    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def ours(p, x):
        y = nnx.merge(graphdef, p, rest)(x, segment_ids=seg)
        return jnp.sum(y * ct), y

    def theirs(p, x):
        p = nnx.to_pure_dict(p)
        if m.bias is not None:
            p["bias"] = m.bias[...]
        y = reference(p, x, seg)
        return jnp.sum(y * ct), y

    (_, y1), g1 = jax.jit(jax.value_and_grad(ours, (0, 1), has_aux=True))(params, x)
    (_, y2), g2 = jax.jit(jax.value_and_grad(theirs, (0, 1), has_aux=True))(params, x)
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=atol)
    ref = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g2[0])))
    for path, a in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g1[0])):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, ref[path], rtol=1e-4, atol=atol, err_msg=name)
        assert float(jnp.abs(a).max()) > 0, name  # every weight (router included) gets gradient
    np.testing.assert_allclose(g1[1], g2[1], rtol=1e-4, atol=atol)
    return y1
