"""Dense attention: GQA against an explicit repeat-kv reference, causality, segment masking."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aiinfra_jax.models import DenseConfig, ModelConfig
from aiinfra_jax.models.attention.dense import DenseAttention
from aiinfra_jax.models.layers import apply_rope

CFG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2)
B, T = 2, 10


def _inputs(seed=0):
    kx, kp = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (B, T, CFG.d_model))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T)) + jax.random.randint(kp, (B, 1), 0, 20)
    return x, pos


def _reference(attn, x, pos, seg):
    """Plain float32 attention with kv heads repeated explicitly."""
    q = apply_rope(jnp.einsum("btd,dhk->bthk", x, attn.wq[...]), pos, CFG.rope_theta)
    k = apply_rope(jnp.einsum("btd,dhk->bthk", x, attn.wk[...]), pos, CFG.rope_theta)
    v = jnp.einsum("btd,dhk->bthk", x, attn.wv[...])
    g = CFG.n_heads // CFG.n_kv_heads
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if seg is not None:
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    y = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return jnp.einsum("bthk,hkd->btd", y, attn.wo[...])


@pytest.mark.parametrize("with_segments", [False, True])
@pytest.mark.parametrize("dense", [DenseConfig(), DenseConfig(kernel="flash_attention"),
                                   DenseConfig(kernel="flash_attention",
                                               implementation="pallas_tpu", interpret=True)],
                         ids=["dot_product_attention", "flash_xla", "flash_pallas_interpret"])
def test_gqa_matches_repeat_kv_reference(with_segments, dense):
    attn = DenseAttention(dataclasses.replace(CFG, dense=dense), rngs=nnx.Rngs(0))
    x, pos = _inputs()
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3, 0, 0], [1] * 10]) if with_segments else None
    y, cache = attn(x, positions=pos, segment_ids=seg)
    assert cache is None and y.shape == x.shape
    np.testing.assert_allclose(y, _reference(attn, x, pos, seg), rtol=1e-4, atol=1e-5)


def test_causality():
    attn = DenseAttention(CFG, rngs=nnx.Rngs(1))
    x, pos = _inputs(1)
    y, _ = attn(x, positions=pos)
    x2 = x.at[:, 6:].set(jax.random.normal(jax.random.key(9), (B, T - 6, CFG.d_model)))
    y2, _ = attn(x2, positions=pos)
    np.testing.assert_allclose(y2[:, :6], y[:, :6], rtol=1e-5, atol=1e-6)
    assert not np.allclose(y2[:, 6:], y[:, 6:], atol=1e-4)


def test_segments_are_isolated():
    attn = DenseAttention(CFG, rngs=nnx.Rngs(2))
    x, pos = _inputs(2)
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0]] * B)
    y, _ = attn(x, positions=pos, segment_ids=seg)
    # Change segment 1's tokens: segment 2 (later in the row) must not notice.
    x2 = x.at[:, :4].set(jax.random.normal(jax.random.key(7), (B, 4, CFG.d_model)))
    y2, _ = attn(x2, positions=pos, segment_ids=seg)
    np.testing.assert_allclose(y2[:, 4:9], y[:, 4:9], rtol=1e-5, atol=1e-6)
    assert not np.allclose(y2[:, :4], y[:, :4], atol=1e-4)


def test_cache_layout_and_flops():
    attn = DenseAttention(CFG, rngs=nnx.Rngs(3))
    cache = attn.init_cache(3, 16, jnp.bfloat16)
    assert cache["k"].shape == (3, 2, 8, 16) and cache["k"].dtype == jnp.bfloat16  # [B,K,Dh,S]
    assert cache["v"].shape == (3, 2, 16, 8)  # [B,K,S,Dh]
    assert cache["lengths"].shape == (3,) and cache["lengths"].dtype == jnp.int32
    proj = 2 * 32 * 8 * (2 * 4 + 2 * 2)
    assert attn.flops_per_token(1) == pytest.approx(proj + 4 * 4 * 8)
    assert attn.flops_per_token(101) - attn.flops_per_token(1) == pytest.approx(4 * 4 * 8 * 50)


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_copies_no_whole_cache(batch):
    """A donated decode step updates the cache in place: the compiled program holds no copy of a
    whole cache buffer. (With one row, the write used to become a dynamic_update_slice that
    XLA:CPU fused into each of its readers with a copy of the cache apiece: 8 copies, a 10x
    slower step at 64K slots; write_cache keeps it a scatter.)"""
    attn = DenseAttention(CFG, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(attn)
    slots = 256
    cache = attn.init_cache(batch, slots, jnp.float32)

    def step(state, cache, x, pos):
        return nnx.merge(graphdef, state)(x, positions=pos, cache=cache)

    x = jnp.zeros((batch, 1, CFG.d_model))
    pos = jnp.zeros((batch, 1), jnp.int32)
    hlo = jax.jit(step, donate_argnums=(1,)).lower(state, cache, x, pos).compile().as_text()
    shape = f"f32[{batch},2,{slots},8]"
    copies = [line for line in hlo.splitlines() if f"{shape}" in line and " copy(" in line]
    assert not copies, copies[:3]


def test_backend_choice():
    from aiinfra_jax.models.attention.dense import choose_implementation
    assert choose_implementation(None, jnp.bfloat16, 64, backend="cpu") == "xla"
    assert choose_implementation(None, jnp.bfloat16, 64, backend="gpu") == "cudnn"
    assert choose_implementation(None, jnp.float32, 64, backend="gpu") == "xla"
    assert choose_implementation(None, jnp.bfloat16, 256, backend="gpu") == "xla"
    assert choose_implementation("xla", jnp.bfloat16, 64, backend="gpu") == "xla"
    with pytest.raises(ValueError, match="dense.implementation='cudnn' needs a GPU"):
        choose_implementation("cudnn", jnp.bfloat16, 64, backend="cpu")
    with pytest.raises(ValueError, match=r"DenseConfig.*implementation='tpu_magic'"):
        DenseConfig(implementation="tpu_magic")
    with pytest.raises(ValueError, match=r"DenseConfig \(kernel='flash_attention'\).*'cudnn'"):
        DenseConfig(kernel="flash_attention", implementation="cudnn")
    with pytest.raises(ValueError, match=r"DenseConfig.kernel='cudnn_flash'"):
        DenseConfig(kernel="cudnn_flash")
