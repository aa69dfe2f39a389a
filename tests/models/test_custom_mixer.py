"""A mixer registered from outside models/ plugs into the Transformer, its cache and generation.

The toy mixer here ("test_prev_token": y_t = x_{t-1} W within a segment, cache = the last real
token's input) has a cache layout unlike dense attention's, so the test checks that the stack,
the stacked caches and generate.py rely only on the registry interfaces.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.generate import decode_step, generate, prefill
from aiinfra_jax.models import ModelConfig, Transformer, register_mixer
from aiinfra_jax.models.layers import make_param


@register_mixer("test_prev_token")
class PrevToken(nnx.Module):
    def __init__(self, cfg, *, rngs):
        self.cfg = cfg
        self.w = make_param(rngs, (cfg.d_model, cfg.d_model), ("embed", "embed"), 0.2,
                            cfg.param_dtype)

    def __call__(self, x, *, positions, segment_ids=None, cache=None):
        del positions
        batch, seq, d = x.shape
        if cache is None:
            prev = jnp.concatenate([jnp.zeros((batch, 1, d), x.dtype), x[:, :-1]], axis=1)
            if segment_ids is not None:
                same = jnp.concatenate([jnp.zeros((batch, 1), bool),
                                        segment_ids[:, 1:] == segment_ids[:, :-1]], axis=1)
                prev = jnp.where(same[..., None], prev, 0)
            return prev @ self.w[...], None
        lengths = cache["lengths"]
        first = jnp.where((lengths > 0)[:, None], cache["prev"], 0)
        prev = jnp.concatenate([first[:, None].astype(x.dtype), x[:, :-1]], axis=1)
        n = (jnp.full_like(lengths, seq) if segment_ids is None
             else jnp.sum(segment_ids != 0, axis=1).astype(lengths.dtype))
        last = jnp.take_along_axis(x, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]
        new_prev = jnp.where((n > 0)[:, None], last, cache["prev"])
        return prev @ self.w[...], {"prev": new_prev, "lengths": lengths + n}

    def init_cache(self, batch, max_len, dtype=None):
        del max_len
        return {"prev": jnp.zeros((batch, self.cfg.d_model), dtype or self.cfg.dtype),
                "lengths": jnp.zeros((batch,), jnp.int32)}

    def flops_per_token(self, seq_len):
        del seq_len
        return 2.0 * self.cfg.d_model ** 2


CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64,
                  mixers=("dense", "test_prev_token"), max_seq_len=32)


def test_custom_mixer_decode_equals_forward():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    lengths = np.array([2, 5], np.int32)
    n_new, total = 3, 8
    full = np.asarray(jax.random.randint(jax.random.key(1), (2, total), 1, CFG.vocab_size))
    positions = jnp.broadcast_to(jnp.arange(total), (2, total))
    ref = np.asarray(jax.jit(lambda m, t: m(t, positions=positions)[0])(model, full))
    rows = np.arange(2)
    last, cache = prefill(model, full[:, :5], lengths, total)
    assert len(cache) == 2 and cache[1][1]["prev"].shape == (2, CFG.d_model)  # cache[r][p]: [B, D]
    np.testing.assert_allclose(last, ref[rows, lengths - 1], rtol=1e-5, atol=1e-5)
    for i in range(n_new):
        pos = lengths + i
        logits, cache = decode_step(model, cache, full[rows, pos], pos)
        np.testing.assert_allclose(logits, ref[rows, pos], rtol=1e-5, atol=1e-5)
    out = generate(model, [[3, 4], [5, 6, 7]], max_new_tokens=2)
    assert out.tokens.shape == (2, 2)
    # R = 2 blocks of (dense + SwiGLU, prev-token + SwiGLU) plus the output head.
    dense = 2 * 32 * 8 * (2 * 4 + 2 * 2) + 4 * 4 * 8 * (9 + 1) / 2
    block = dense + 2 * 32 ** 2 + 2 * (2 * 3 * 32 * 64)
    expected = 2 * block + 2 * 32 * 64
    assert abs(model.flops_per_token(9) - expected) < 1e-6 * expected
    assert dataclasses.replace(CFG, mixers=("test_prev_token",)).mixers == ("test_prev_token",)
