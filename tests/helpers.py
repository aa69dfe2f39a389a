"""Helpers shared by test files (importable as `helpers`: tests/conftest.py puts this folder on
sys.path, since the suite runs with --import-mode=importlib and tests/ is not a package)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def assert_expert_parallel_matches_single_device(m, d: int) -> None:
    """An MoE-style FFN module m (moe / deamoe, with a sigmoid router's `bias`) on a data=2 x
    expert=2 x tensor=2 mesh (tokens split over all three, expert weights also over tensor,
    gathered inside the shard_map) against one device: the output, every gradient (router
    included), the aux losses and metrics, the routing trace and the bias update; with padding;
    and the forward of a batch of 15 tokens, a count no mesh axis divides (padded inside),
    replicated as a small decode batch would be. The compiled program must hold the all-to-alls
    (2 calls x 2 forward + 2 backward)."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from aiinfra_jax import sharding as shd
    from aiinfra_jax.config import MeshConfig
    from aiinfra_jax.models import auxiliary

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets 8 simulated CPU devices)")
    graphdef, state = nnx.split(m)
    params = nnx.to_pure_dict(nnx.split(m, nnx.Param, ...)[1])
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(8, 3, d)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(8, 3, d)), jnp.float32)
    x15 = jnp.asarray(rng.normal(size=(3, 5, d)), jnp.float32)
    seg = np.ones((8, 3), np.int32)
    seg[1, 1:] = 0
    seg[6, :] = 0
    seg = jnp.asarray(seg)

    def loss(p, x_btd, x15):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, p)
        model = nnx.merge(graphdef, st)
        y15 = jax.lax.stop_gradient(model(x15))  # no rngs: the bias stays
        auxiliary.pop_outputs(model)
        y = model(x_btd, segment_ids=seg, rngs=nnx.Rngs(0))  # training call: the bias moves
        out = auxiliary.pop_outputs(model)
        total = jnp.sum(y * ct) + sum(out["losses"].values())
        return total, (y, out, model.bias[...], y15)

    grad_fn = jax.value_and_grad(loss, (0, 1), has_aux=True)
    (l1, (y1, out1, bias1, y15_1)), g1 = jax.jit(grad_fn)(params, x, x15)

    mesh = shd.make_mesh(MeshConfig(data=2, expert=2, tensor=2, num_devices=8))
    p_sh = shd.param_shardings(nnx.split(m, nnx.Param, ...)[1], mesh)
    assert p_sh["w_gate"].spec == P("expert", None, "tensor")
    x_sh = NamedSharding(mesh, P(shd.BATCH_AXES))
    step = jax.jit(shd.with_activation_rules(grad_fn, mesh),
                   in_shardings=(p_sh, x_sh, NamedSharding(mesh, P())))
    args = jax.device_put(params, p_sh), jax.device_put(x, x_sh), x15
    compiled = step.lower(*args).compile()
    assert compiled.as_text().count("all-to-all") >= 8  # 2 calls x (2 forward + 2 backward)
    (l8, (y8, out8, bias8, y15_8)), g8 = compiled(*args)

    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y15_8, y15_1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    np.testing.assert_array_equal(bias8, bias1)
    np.testing.assert_array_equal(out8["intermediates"]["expert_ids"],
                                  out1["intermediates"]["expert_ids"])
    for kind in ("losses", "metrics"):
        assert set(out8[kind]) == set(out1[kind])
        for name, v in out1[kind].items():
            np.testing.assert_allclose(out8[kind][name], v, rtol=1e-5, atol=1e-7, err_msg=name)
    assert float(out8["metrics"]["dropped"]) == 0.0
    ref = dict(jax.tree_util.tree_leaves_with_path(g1[0]))
    for path, a in jax.tree_util.tree_leaves_with_path(g8[0]):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, ref[path], rtol=1e-4, atol=1e-6, err_msg=name)
        assert float(jnp.abs(a).max()) > 0, name
    np.testing.assert_allclose(g8[1], g1[1], rtol=1e-4, atol=1e-6)
