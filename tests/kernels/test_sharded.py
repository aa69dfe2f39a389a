"""The Pallas kernels on a sharded mesh: 8 simulated CPU devices (tests/conftest.py) as
data=2 x fsdp=2 x tensor=2, inputs placed with NamedSharding (batch over data+fsdp, heads over
tensor), each op run in Pallas interpret mode under jit and `jax.set_mesh`. Forward and gradients
equal the unsharded float32 reference at the parity tolerances (kernels._testing), the jaxpr holds
the shard_map the op wraps its kernels in (kernels/_sharding.py), and a "context" axis > 1 is
refused by name.

Shapes are tiny: interpret mode is slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from aiinfra_jax.kernels import _sharding
from aiinfra_jax.kernels._testing import assert_close
from aiinfra_jax.kernels.block_selection import block_scores, block_scores_reference
from aiinfra_jax.kernels.block_selection.reference import Remap
from aiinfra_jax.kernels.depth_attention import depth_attention, depth_attention_reference
from aiinfra_jax.kernels.flash_attention import (AttentionMask, BlockSizes, flash_attention,
                                                 flash_attention_reference)
from aiinfra_jax.kernels.sparse_attention import sparse_attention, sparse_attention_reference

BATCH = ("data", "fsdp")
F32 = jnp.float32


def _mesh(shape=(2, 2, 2), names=("data", "fsdp", "tensor")) -> Mesh:
    """Auto-typed axes, as aiinfra_jax.sharding.make_mesh builds them."""
    n = int(np.prod(shape))
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices (tests/conftest.py sets 8 simulated CPU devices)")
    return Mesh(np.asarray(jax.devices()[:n]).reshape(shape), names)


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _count(jaxpr, name: str) -> int:
    """Equations named `name` in a jaxpr and every jaxpr nested in its equations' parameters."""
    def walk(j):
        j = getattr(j, "jaxpr", j)
        total = 0
        for eqn in j.eqns:
            total += eqn.primitive.name == name
            for value in eqn.params.values():
                for v in (value if isinstance(value, (tuple, list)) else (value,)):
                    if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"):
                        total += walk(v)
        return total
    return walk(jaxpr)


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32))


def _vjp(fn):
    """(outputs..., grads...) of fn(*args) -> (o, lse) with cotangents (do, dlse)."""
    def go(args, cotangents):
        out, pullback = jax.vjp(fn, *args)
        return out + pullback(cotangents)
    return go


def _check(name, got, want, finite_lse_at=1):
    for i, (g, w) in enumerate(zip(got, want)):
        if i == finite_lse_at:  # lse: -inf where a query sees no key
            finite = np.isfinite(np.asarray(w))
            np.testing.assert_array_equal(np.isfinite(np.asarray(g)), finite)
            g, w = jnp.where(finite, g, 0.0), jnp.where(finite, w, 0.0)
        assert_close(g, w, F32, f"{name}[{i}]")


def _sharded_vjp(mesh, fn, args, cotangents):
    """Under jax.set_mesh: the jaxpr's shard_map count and the jitted outputs and gradients."""
    with jax.set_mesh(mesh):
        maps = _count(jax.make_jaxpr(_vjp(fn))(args, cotangents), "shard_map")
        return maps, jax.jit(_vjp(fn))(args, cotangents)


# ----------------------------------------------------------------------------------------------
# Parity on data=2 x fsdp=2 x tensor=2.

def test_flash_attention_sharded():
    mesh, rng = _mesh(), np.random.default_rng()
    B, T, Hq, Hkv, D = 4, 24, 4, 2, 16
    q, k, v = _normal(rng, B, T, Hq, D), _normal(rng, B, T, Hkv, D), _normal(rng, B, T, Hkv, D)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)
    do, dlse = _normal(rng, B, T, Hq, D), _normal(rng, B, T, Hq)
    mask = AttentionMask(window=9)

    def sharded(q, k, v, seg):
        return flash_attention(q, k, v, mask=mask, segment_ids=seg, return_lse=True,
                               implementation="pallas_gpu", interpret=True,
                               block_sizes=BlockSizes(block_q=16, block_k=16))

    x = (BATCH, None, "tensor", None)
    args = (_put(mesh, q, *x), _put(mesh, k, *x), _put(mesh, v, *x), _put(mesh, seg, BATCH))
    maps, got = _sharded_vjp(mesh, sharded, args, (do, dlse))
    want = jax.jit(_vjp(lambda q, k, v, seg: flash_attention_reference(
        q, k, v, mask=mask, segment_ids=seg)))((q, k, v, seg), (do, dlse))
    assert maps == 2, f"expected the forward and the backward kernels in a shard_map, got {maps}"
    assert tuple(got[0].sharding.spec)[:3] == (BATCH, None, "tensor")
    _check("flash (o, lse, dq, dk, dv)", got[:5], want[:5])


def test_sparse_attention_sharded():
    mesh, rng = _mesh(), np.random.default_rng()
    B, T, S, Hkv, G, Dk, Dv, bs, n = 4, 20, 37, 2, 2, 16, 32, 16, 3
    q = _normal(rng, B, T, Hkv * G, Dk)
    k, v = _normal(rng, B, S, Hkv, Dk), _normal(rng, B, S, Hkv, Dv)
    idx = rng.integers(-1, -(-S // bs), (B, T, Hkv, n))
    idx[:, :, :, 0] = 0
    idx = jnp.asarray(idx, jnp.int32)
    segs = (jnp.asarray(np.sort(rng.integers(0, 2, (B, T)), axis=1), jnp.int32),
            jnp.asarray(np.sort(rng.integers(0, 2, (B, S)), axis=1), jnp.int32))
    do, dlse = _normal(rng, B, T, Hkv * G, Dv), _normal(rng, B, T, Hkv * G)

    def run(fn):
        return lambda q, k, v, idx, qs, ks: fn(q, k, v, idx, block_size=bs, causal=False,
                                               segment_ids=(qs, ks))

    sharded = run(lambda *a, **kw: sparse_attention(*a, return_lse=True,
                                                    implementation="pallas_gpu", interpret=True,
                                                    **kw))
    x = (BATCH, None, "tensor", None)
    args = (_put(mesh, q, *x), _put(mesh, k, *x), _put(mesh, v, *x), _put(mesh, idx, *x),
            _put(mesh, segs[0], BATCH), _put(mesh, segs[1], BATCH))
    maps, got = _sharded_vjp(mesh, sharded, args, (do, dlse))
    want = jax.jit(_vjp(run(sparse_attention_reference)))((q, k, v, idx) + segs, (do, dlse))
    assert maps == 2, f"expected the forward and the backward kernels in a shard_map, got {maps}"
    _check("sparse (o, lse, dq, dk, dv)", got[:5], want[:5])


def test_depth_attention_sharded():
    mesh, rng = _mesh(), np.random.default_rng()
    Q, S, B, T, D, n_valid = 2, 5, 4, 3, 32, 4
    queries = _normal(rng, Q, D)
    sources = _normal(rng, S, B, T, D) * jnp.asarray(rng.uniform(0.3, 3.0, (S, B, T, 1)), F32)
    do, dlse = _normal(rng, Q, B, T, D), _normal(rng, Q, B, T)
    n = jnp.int32(n_valid)

    def sharded(queries, sources):
        return depth_attention(queries, sources, n, return_lse=True, implementation="pallas_tpu",
                               interpret=True)

    args = (_put(mesh, queries), _put(mesh, sources, None, BATCH))
    maps, got = _sharded_vjp(mesh, sharded, args, (do, dlse))
    want = jax.jit(_vjp(lambda qs, src: depth_attention_reference(qs, src, n)))(
        (queries, sources), (do, dlse))
    assert maps == 2, f"expected the forward and the backward kernels in a shard_map, got {maps}"
    _check("depth (o, lse, dqueries, dsources)", got, want, finite_lse_at=None)


def test_block_scores_sharded_heads_replicated():
    """One KV head: "tensor" does not divide it, so heads stay whole and the kernel repeats over
    the tensor axis (batch still split over data+fsdp)."""
    mesh, rng = _mesh(), np.random.default_rng()
    B, T, Hkv, G, D, l, d, lp = 4, 40, 1, 4, 16, 8, 4, 16
    sc = (T - l) // d + 1
    q, k_cmp = _normal(rng, B, T, Hkv * G, D), _normal(rng, B, sc, Hkv, D)
    lse = _normal(rng, B, T, Hkv * G) + 3.0
    seg = jnp.asarray(np.sort(rng.integers(0, 2, (B, T)), axis=1), jnp.int32)
    kw = dict(seq_len=T, q_segment_ids=seg)
    remap = dict(cmp_block_len=l, cmp_stride=d, block_size=lp)

    def sharded(q, k_cmp, lse, seg):
        return block_scores(q, k_cmp, lse, seq_len=T, q_segment_ids=seg, **remap,
                            implementation="pallas_gpu", interpret=True)

    args = (_put(mesh, q, BATCH, None, "tensor", None), _put(mesh, k_cmp, BATCH),
            _put(mesh, lse, BATCH, None, "tensor"), _put(mesh, seg, BATCH))
    with jax.set_mesh(mesh):
        assert _count(jax.make_jaxpr(sharded)(*args), "shard_map") == 1
        got = jax.jit(sharded)(*args)
    want = block_scores_reference(q, k_cmp, lse, remap=Remap("overlap", l, d, lp),
                                  scale=D ** -0.5, **kw)
    assert_close(got, want, F32, "block scores")


# ----------------------------------------------------------------------------------------------
# The split itself, the trainer's abstract-mesh context, and what is refused.

@pytest.mark.parametrize("shape, names, batch, heads, want_batch, want_heads", [
    ((2, 2, 2), ("data", "fsdp", "tensor"), 4, 2, ("data", "fsdp"), "tensor"),
    ((2, 2, 2), ("data", "fsdp", "tensor"), 2, 4, ("data",), "tensor"),       # fsdp skipped
    ((2, 2, 2), ("data", "fsdp", "tensor"), 6, 3, ("data",), None),           # odd heads whole
    ((2, 2, 2), ("data", "fsdp", "tensor"), 3, None, (), None),
    ((2, 2, 2), ("data", "expert", "tensor"), 8, 1, ("data", "expert"), None),
    ((1, 4, 2), ("data", "fsdp", "tensor"), 4, 2, ("fsdp",), "tensor"),
    ((2, 1, 4), ("fsdp", "context", "tensor"), 2, 8, ("fsdp",), "tensor"),    # context of size 1
])
def test_plan(shape, names, batch, heads, want_batch, want_heads):
    with jax.set_mesh(_mesh(shape, names)):
        plan = _sharding.plan("op", batch=batch, heads=heads)
    assert (plan.batch, plan.heads) == (want_batch, want_heads)
    assert plan.axis_names == frozenset(names)


def test_no_split_without_a_mesh_or_inside_a_manual_shard_map():
    assert _sharding.plan("op", batch=4, heads=2) is None
    with jax.set_mesh(_mesh((1,), ("data",))):
        assert _sharding.plan("op", batch=4, heads=2) is None
    mesh = _mesh()
    seen = []

    def inner(x):
        seen.append(_sharding.plan("op", batch=x.shape[0], heads=2))
        return x

    with jax.set_mesh(mesh):
        jax.make_jaxpr(jax.shard_map(inner, in_specs=P(BATCH), out_specs=P(BATCH)))(
            jnp.zeros((8, 2)))
    assert seen == [None]


def test_trainer_abstract_mesh_context_shards_too():
    """aiinfra_jax.sharding.activation_rules sets only the abstract mesh
    (jax.sharding.use_abstract_mesh); the kernels read it the same way."""
    mesh, rng = _mesh(), np.random.default_rng()
    q, k = _normal(rng, 4, 16, 2, 16), _normal(rng, 4, 16, 2, 16)

    def fn(q, k):
        return flash_attention(q, k, k, implementation="pallas_tpu", interpret=True)

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert _count(jax.make_jaxpr(fn)(q, k), "shard_map") == 1


def test_explicit_axes_mesh():
    """jax.make_mesh's Explicit axes: inputs are resharded onto the kernel's layout first."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    rng = np.random.default_rng()
    queries, sources = _normal(rng, 2, 16), _normal(rng, 3, 4, 2, 16)
    do, dlse = _normal(rng, 2, 4, 2, 16), _normal(rng, 2, 4, 2)

    def sharded(queries, sources):
        return depth_attention(queries, sources, return_lse=True, implementation="pallas_gpu",
                               interpret=True)

    args = (_put(mesh, queries), _put(mesh, sources, None, BATCH))
    maps, got = _sharded_vjp(mesh, sharded, args, (do, dlse))
    want = jax.jit(_vjp(lambda qs, src: depth_attention_reference(qs, src)))(
        (queries, sources), (do, dlse))
    assert maps == 2
    _check("depth, Explicit axes (o, lse, dqueries, dsources)", got, want, finite_lse_at=None)


def _context_mesh():
    return _mesh((2, 2, 2), ("data", "context", "tensor"))


_OPS = {
    "flash_attention": lambda q, k, idx, **kw: flash_attention(q, k, k, **kw),
    "sparse_attention": lambda q, k, idx, **kw: sparse_attention(q, k, k, idx, block_size=16,
                                                                 **kw),
    "select_blocks": lambda q, k, idx, **kw: block_scores(
        q, k, jnp.zeros(q.shape[:3], F32), seq_len=40, cmp_block_len=8, cmp_stride=4,
        block_size=16, **kw),
    "depth_attention": lambda q, k, idx, **kw: depth_attention(q[0, 0], k, **kw),
}


@pytest.mark.parametrize("op", sorted(_OPS))
def test_context_axis_is_refused_by_name(op):
    q, k = jnp.ones((4, 40, 2, 16), F32), jnp.ones((4, 9, 2, 16), F32)
    idx = jnp.zeros((4, 40, 2, 1), jnp.int32)
    fn = _OPS[op]
    with jax.set_mesh(_context_mesh()):
        with pytest.raises(ValueError, match=f"{op}.*'context' axis of size 2.*context-parallel"):
            jax.make_jaxpr(lambda q, k, i: fn(q, k, i, implementation="pallas_tpu",
                                              interpret=True))(q, k, idx)
        # implementation=None: the XLA path (CPU) still lowers; the kernels' platforms refuse.
        auto = jax.jit(lambda q, k, i: fn(q, k, i)).trace(q, k, idx)
        cpu = auto.lower(lowering_platforms=("cpu",)).as_text()
        assert "custom_call @tpu_custom_call" not in cpu
        with pytest.raises(ValueError, match="context-parallel"):
            auto.lower(lowering_platforms=("tpu",))
