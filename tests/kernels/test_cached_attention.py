"""cached_attention (kernels/flash_attention/cached.py) against the float32 oracle
flash_attention_reference: fresh random inputs, forward, lse and gradients, grouped heads,
arbitrary visibility (a cache's causal limit and random holes), rows that see nothing. Its use in
the dense mixer's prefill and decode (bfloat16 caches included) is checked against the full
forward pass in tests/core/test_generate.py and tests/models/test_attention.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aiinfra_jax.kernels.flash_attention import (AttentionMask, cached_attention,
                                                 flash_attention_reference)

B, S, H, K, D = 2, 24, 4, 2, 8
attend = jax.jit(cached_attention, static_argnames=("return_lse", "keys_transposed"))  # eager
# dispatch is slow


def _inputs(seed, t):
    kq, kk, kv, km = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, t, H, D))
    k = jax.random.normal(kk, (B, S, K, D))
    v = jax.random.normal(kv, (B, S, K, D))
    lengths = jnp.array([5, 17], jnp.int32)  # each row's cache length before the t new queries
    causal = jnp.arange(S)[None, None, :] <= (lengths[:, None] + jnp.arange(t))[:, :, None]
    holes = jax.random.bernoulli(km, 0.8, (B, t, S))
    visible = causal & holes
    visible = visible.at[1, 0].set(False)  # a row that sees nothing
    return q, k, v, visible


@jax.jit
def _oracle(q, k, v, visible):
    """The reference with the [B,T,S] visibility given as per-slot segment ids: one fresh segment
    per query (a query sees slot s iff visible[b, i, s]) is not expressible, so the reference is
    run query by query with kv segment ids 1 where visible and 0 elsewhere."""
    outs, lses = [], []
    for i in range(q.shape[1]):
        seg_q = jnp.ones((B, 1), jnp.int32)
        seg_kv = visible[:, i].astype(jnp.int32)
        o, lse = flash_attention_reference(q[:, i:i + 1], k, v, segment_ids=(seg_q, seg_kv),
                                           mask=AttentionMask(causal=False))
        outs.append(o)
        lses.append(lse)
    return jnp.concatenate(outs, 1), jnp.concatenate(lses, 1)


def _head_major(x):
    return x.swapaxes(1, 2)


def _keys(k, transposed):
    """[B,S,K,D] keys in cached_attention's layout: [B,K,S,D], or [B,K,D,S] transposed."""
    return k.transpose(0, 2, 3, 1) if transposed else _head_major(k)


@pytest.mark.parametrize("t,transposed", [(1, False), (3, False), (1, True), (3, True)])
def test_matches_the_reference_forward_lse_and_gradients(t, transposed):
    q, k, v, visible = _inputs(t, t)
    o, lse = attend(q, _keys(k, transposed), _head_major(v), visible, return_lse=True,
                    keys_transposed=transposed)
    o_ref, lse_ref = _oracle(q, k, v, visible)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, lse_ref, rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(o[1, 0]) == 0) and np.all(np.isneginf(np.asarray(lse[1, 0])))

    w = jax.random.normal(jax.random.key(9), o.shape)
    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)
    got = jax.jit(jax.grad(loss(lambda q, k, v: cached_attention(
        q, _keys(k, transposed), _head_major(v), visible, keys_transposed=transposed)),
        argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(lambda q, k, v: _oracle(q, k, v, visible)[0]),
                            argnums=(0, 1, 2)))(q, k, v)
    for name, g, r in zip("qkv", got, want):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def test_bad_shapes_are_named():
    q, k, v, visible = _inputs(0, 1)
    with pytest.raises(ValueError, match="head-major"):
        cached_attention(q, k[..., :4], v, visible)
    with pytest.raises(ValueError, match="visible"):
        cached_attention(q, _head_major(k), _head_major(v), visible[:, :, :5])
    with pytest.raises(ValueError, match=r"k \[B,K,D,S\] and v \[B,K,S,D\]"):
        cached_attention(q, _head_major(k), _head_major(v), visible, keys_transposed=True)
