"""RoPE, RMSNorm, SwiGLU and the token projection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from aiinfra_jax.models import ModelConfig
from aiinfra_jax.models.layers import RMSNorm, SwiGLU, apply_rope, project
from aiinfra_jax.sharding import RULES, activation_rules


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


@pytest.mark.parametrize("contract,w_transposed", [(1, False), (2, False), (1, True)])
def test_project_equals_the_einsum_forward_and_gradients(contract, w_transposed):
    """layers.project (one 2-D product over flattened tokens) against the einsum it replaces."""
    k = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(k[0], (2, 5, 3, 4) if contract == 2 else (2, 5, 12))
    w_shape = {1: (12, 3, 4), 2: (3, 4, 6)}[contract]
    w = jax.random.normal(k[1], w_shape)
    spec = {1: "btc,cho->btho", 2: "bthk,hko->bto"}[contract]
    if w_transposed:
        w = w.reshape(12, -1).T  # [*o, c]
        spec = "btc,oc->bto"
    ct = jax.random.normal(k[2], jnp.einsum(spec, x, w).shape)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) * ct)

    ours = lambda x, w: project(x, w, contract=contract, w_transposed=w_transposed)  # noqa: E731
    theirs = lambda x, w: jnp.einsum(spec, x, w)  # noqa: E731
    np.testing.assert_allclose(jax.jit(ours)(x, w), theirs(x, w), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.grad(loss(ours), (0, 1))(x, w), jax.grad(loss(theirs), (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _lhs_ranks(fn, *args) -> list[int]:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e.invars[0].aval.ndim for e in jaxpr.eqns if e.primitive.name == "dot_general"]


def test_project_flattens_tokens_unless_the_sequence_is_split():
    """Tokens are flattened into one dim on one device and under a batch split; not when the
    sequence is split over a mesh axis (a merge GSPMD could not do locally)."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py sets 8 simulated CPU devices)")
    x, w = jnp.ones((4, 8, 16)), jnp.ones((16, 6))
    # a new function per case: JAX's trace cache does not key on Flax's axis rules
    assert _lhs_ranks(lambda x, w: project(x, w), x, w) == [2]
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "context"))
    for rules, rank in ((RULES, 3), ({**RULES, "seq": ()}, 2)):
        with activation_rules(mesh, rules):
            assert _lhs_ranks(lambda x, w: project(x, w), x, w) == [rank], rules["seq"]
