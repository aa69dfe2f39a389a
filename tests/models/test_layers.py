"""RoPE, RMSNorm and SwiGLU."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.models import ModelConfig
from aiinfra_jax.models.layers import RMSNorm, SwiGLU, apply_rope


def _dots(q, k, pq, pk):
    """q.k after rotating q to position pq and k to position pk: [H]."""
    rq = apply_rope(q[None, None], jnp.array([[pq]]), 10000.0)[0, 0]
    rk = apply_rope(k[None, None], jnp.array([[pk]]), 10000.0)[0, 0]
    return jnp.sum(rq * rk, axis=-1)


def test_rope_depends_only_on_relative_position():
    kq, kk = jax.random.split(jax.random.key(0))
    q = jax.random.normal(kq, (3, 16))
    k = jax.random.normal(kk, (3, 16))
    base = _dots(q, k, 7, 3)
    for shift in (1, 50, 1000):
        np.testing.assert_allclose(_dots(q, k, 7 + shift, 3 + shift), base, rtol=2e-4, atol=2e-4)
    # ... and does depend on the difference.
    assert not np.allclose(_dots(q, k, 8, 3), base, atol=1e-3)


def test_rope_is_a_rotation_and_identity_at_zero():
    x = jax.random.normal(jax.random.key(1), (2, 5, 3, 8))
    pos = jax.random.randint(jax.random.key(2), (2, 5), 0, 500)
    y = apply_rope(x, pos, 10000.0)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(apply_rope(x, jnp.zeros((2, 5), jnp.int32), 10000.0), x, rtol=1e-6)


def test_rmsnorm_normalises_and_keeps_dtype():
    norm = RMSNorm(16, eps=1e-6)
    x = 3.0 * jax.random.normal(jax.random.key(3), (2, 4, 16))
    y = norm(x)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(y * y, axis=-1)), 1.0, rtol=1e-4)
    assert norm(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    assert norm.scale.get_metadata("logical_axes") == ("norm",)


def test_swiglu_matches_formula():
    cfg = ModelConfig(vocab_size=64, d_model=16, d_ff=32)
    ffn = SwiGLU(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(4), (2, 3, 16))
    expected = (jax.nn.silu(x @ ffn.w_gate[...]) * (x @ ffn.w_up[...])) @ ffn.w_down[...]
    np.testing.assert_allclose(ffn(x), expected, rtol=1e-5, atol=1e-6)
    assert ffn.flops_per_token() == 2 * 3 * 16 * 32
