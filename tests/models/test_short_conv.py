"""The short causal convolution on mixer inputs (models/short_conv.py): the formula, segments,
cached prefill / decode against the full forward (dense and NSA), and config errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aiinfra_jax.generate import decode_step, prefill
from aiinfra_jax.models import ModelConfig, Transformer
from aiinfra_jax.models import NSAConfig
from aiinfra_jax.models.short_conv import ShortConv

W = 4
CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32,
                  short_conv=W, max_seq_len=64)
NSA = NSAConfig(cmp_block_len=4, cmp_stride=2, sel_block_size=8, n_selected=3, n_init=1,
                n_local=1, window=6)


def _reference(x, w, seg):
    """y_t = x_t + sum_k w_k x_{t-k} over t - k >= 0 in the same segment, by loops."""
    x, w, seg = np.asarray(x, np.float64), np.asarray(w, np.float64), np.asarray(seg)
    y = x.copy()
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for k in range(w.shape[0]):
                if t - k >= 0 and seg[b, t - k] == seg[b, t]:
                    y[b, t] += w[k] * x[b, t - k]
    return y


def test_formula_and_segments():
    conv = ShortConv(CFG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 13, CFG.d_model)).astype(np.float32)
    seg = np.array([[1] * 5 + [2] * 2 + [3] * 4 + [0] * 2, [1] * 13], np.int32)
    y, state = conv(jnp.asarray(x), segment_ids=jnp.asarray(seg))
    assert state is None
    np.testing.assert_allclose(y, _reference(x, conv.weight[...], seg), rtol=1e-5, atol=1e-5)
    # Without segment ids the whole row is one document.
    y1, _ = conv(jnp.asarray(x))
    np.testing.assert_allclose(y1, _reference(x, conv.weight[...], np.ones_like(seg)),
                               rtol=1e-5, atol=1e-5)
    # Gradient with respect to the filter, against central differences of the loop formula.
    def loss(m):
        return jnp.sum(jnp.sin(m(jnp.asarray(x), segment_ids=jnp.asarray(seg))[0]))

    grad = nnx.grad(loss)(conv).weight[...]
    w0 = np.asarray(conv.weight[...], np.float64)
    for k, d in ((0, 3), (2, 5), (3, 0)):
        eps = 1e-4
        wp, wm = w0.copy(), w0.copy()
        wp[k, d] += eps
        wm[k, d] -= eps
        num = (np.sin(_reference(x, wp, seg)).sum() - np.sin(_reference(x, wm, seg)).sum()) / (2 * eps)
        np.testing.assert_allclose(grad[k, d], num, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mixer", ["dense", "nsa"])
def test_prefill_and_decode_equal_the_full_forward(mixer):
    cfg = dataclasses.replace(CFG, mixers=(mixer,), nsa=NSA)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    total = 24
    tokens = jax.random.randint(jax.random.key(2), (2, total), 1, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(total), tokens.shape)
    full = np.asarray(model(tokens, positions=pos)[0])
    lengths = np.array([3, 10])
    # Right padding holds junk that must not reach the convolution state; chunks of 4 tokens put
    # several prefill calls at nonzero lengths, the last one all padding for row 0.
    prompt = np.where(np.arange(12)[None, :] < lengths[:, None], np.asarray(tokens[:, :12]), 9)
    logits, cache = prefill(model, jnp.asarray(prompt), jnp.asarray(lengths), total, chunk_size=4)
    assert sorted(cache[0][0]) == ["conv", "mixer"] and cache[0][0]["conv"].shape == (2, W - 1, 16)
    rows = np.arange(2)
    errs = [np.abs(np.asarray(logits) - full[rows, lengths - 1]).max()]
    for i in range(total - lengths.max()):
        cur = lengths + i
        logits, cache = decode_step(model, cache, tokens[rows, cur], jnp.asarray(cur))
        errs.append(np.abs(np.asarray(logits) - full[rows, cur]).max())
    assert max(errs) < 2e-4, errs


def test_packed_documents_do_not_see_each_other():
    model = Transformer(CFG, rngs=nnx.Rngs(3))
    a = jax.random.randint(jax.random.key(4), (1, 7), 1, 64)
    b = jax.random.randint(jax.random.key(5), (1, 9), 1, 64)
    packed = jnp.concatenate([a, b], 1)
    seg = jnp.asarray([[1] * 7 + [2] * 9])
    pos = jnp.asarray([list(range(7)) + list(range(9))])
    out = model(packed, positions=pos, segment_ids=seg)[0]
    alone = model(b, positions=jnp.arange(9)[None])[0]
    np.testing.assert_allclose(out[:, 7:], alone, rtol=1e-5, atol=1e-5)


def test_config_and_flops():
    with pytest.raises(ValueError, match=r"short_conv=-1: must be an int >= 0"):
        dataclasses.replace(CFG, short_conv=-1)
    plain = Transformer(dataclasses.replace(CFG, short_conv=0), rngs=nnx.Rngs(0))
    conv = Transformer(CFG, rngs=nnx.Rngs(0))
    assert conv.flops_per_token(32) - plain.flops_per_token(32) == 2 * (2.0 * W * CFG.d_model)
    assert conv.num_params() - plain.num_params() == 2 * W * CFG.d_model
