"""Transformer: shapes/dtypes, logical axes, scan vs loop, remat, segments, FLOPs and params."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from aiinfra_jax.models import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  max_seq_len=64)
# P = 2 layers per block, R = 2 repeats.
PATTERN = dict(mixers=("dense", "dense"), n_layers=4)
B, T = 2, 12


def _batch(seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return tokens, positions


@functools.lru_cache(maxsize=None)
def _build_cached(items):
    return Transformer(dataclasses.replace(CFG, **dict(items)), rngs=nnx.Rngs(0))


def _build(**overrides):
    """Models are built once per config (tests must not modify them)."""
    return _build_cached(tuple(sorted(overrides.items())))


def _variant(model, **overrides):
    """The same parameters under a config that does not change them (remat, dtype)."""
    cfg = dataclasses.replace(model.cfg, **overrides)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


@jax.jit
def _forward_fn(graphdef, state, tokens, positions, segment_ids):
    return nnx.merge(graphdef, state)(tokens, positions=positions, segment_ids=segment_ids)


def _forward(model, tokens, positions, segment_ids=None):
    return _forward_fn(*nnx.split(model), tokens, positions, segment_ids)[0]


@jax.jit
def _loss_and_grads_fn(graphdef, state, tokens, positions):
    def loss_fn(state):
        logits, _, _ = nnx.merge(graphdef, state)(tokens, positions=positions)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
    return jax.value_and_grad(loss_fn)(state)


def _flat(state) -> dict:
    return {path: var[...] for path, var in nnx.to_flat_state(state)}


def test_shapes_dtypes_and_logical_axes():
    model = _build(**PATTERN)
    tokens, positions = _batch()
    logits, cache, aux = _forward_fn(*nnx.split(model), tokens, positions, None)
    assert logits.shape == (B, T, CFG.vocab_size) and logits.dtype == jnp.float32
    assert cache is None and aux == {"losses": {}, "metrics": {}, "intermediates": {}}
    assert np.all(np.isfinite(logits))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = var.get_metadata("logical_axes")
        assert len(axes) == var.ndim, (path, axes, var.shape)
        assert var.dtype == jnp.float32
        if path[0] == "blocks":
            assert axes[0] == "layers" and var.shape[0] == 2, (path, axes)
        else:
            assert "layers" not in axes


def test_bfloat16_compute_keeps_float32_logits():
    ref_model = _build()
    model = _variant(ref_model, dtype="bfloat16")
    tokens, positions = _batch()
    logits = _forward(model, tokens, positions)
    assert logits.dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    ref = _forward(ref_model, tokens, positions)
    rel = float(jnp.linalg.norm(logits - ref) / jnp.linalg.norm(ref))
    assert 0 < rel < 3e-2


def test_tied_embeddings_share_the_table():
    model = _build(tie_embeddings=True)
    assert model.head is None
    assert model.num_params() == _build().num_params() - CFG.d_model * CFG.vocab_size
    tokens, positions = _batch()
    logits, _, _ = _forward_fn(*nnx.split(model), tokens, positions, None)
    x, _, _ = model.features(tokens, positions=positions)
    np.testing.assert_allclose(logits, x @ model.embed.table[...].T, rtol=1e-5, atol=1e-5)


def test_scan_and_loop_give_the_same_params_and_logits():
    tokens, positions = _batch(1)
    scanned = _build(**PATTERN)
    looped = _build(scan_layers=False, **PATTERN)
    assert scanned.num_params() == looped.num_params()
    s_params = nnx.state(scanned.blocks, nnx.Param)
    for r, block in enumerate(looped.blocks):
        for a, b in zip(jax.tree.leaves(nnx.state(block, nnx.Param)), jax.tree.leaves(s_params)):
            np.testing.assert_array_equal(a, b[r])
    np.testing.assert_allclose(_forward(looped, tokens, positions),
                               _forward(scanned, tokens, positions), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mixers", [("dense", "dense"), ("nsa", "dense")])
def test_scanned_cached_chunks_equal_the_block_loop(mixers):
    """A layer-scanned model runs cached chunk calls in its scan (caches stacked, then split) and
    one-token calls in the block loop; the chunk calls must equal the unscanned model's loop,
    logits and every cache buffer, over two chunks and a decode step."""
    from aiinfra_jax.models.transformer import _scans_cached_chunk
    scanned = _build(mixers=mixers, n_layers=4, short_conv=4)
    looped = scanned.unscanned()
    tokens, _ = _batch(2)
    lengths = (0, 7, T, T + 1)  # chunks [0, 7) and [7, 12), then one token
    caches = [m.init_cache(B, CFG.max_seq_len) for m in (scanned, looped)]
    assert _scans_cached_chunk(caches[0], tokens[:, :7])
    assert not _scans_cached_chunk(caches[0], tokens[:, :1])
    steps = jnp.concatenate([tokens, tokens[:, :1]], axis=1)
    for start, stop in zip(lengths[:-1], lengths[1:]):
        pos = jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (B, stop - start))
        out = [m(steps[:, start:stop], positions=pos, cache=c)
               for m, c in zip((scanned, looped), caches)]
        np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5, atol=1e-5)
        caches = [o[1] for o in out]
        for a, b in zip(jax.tree.leaves(caches[0]), jax.tree.leaves(caches[1])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Blocks whose caches differ in shape keep the loop.
    uneven = (caches[0][0], jax.tree.map(lambda a: a[:1], caches[0][1]))
    assert not _scans_cached_chunk(uneven, tokens)


def test_remat_does_not_change_loss_or_grads():
    tokens, positions = _batch(2)
    scanned = _build(**PATTERN)
    loss0, grads0 = _loss_and_grads_fn(*nnx.split(scanned), tokens, positions)
    assert np.isfinite(loss0)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads0))
    flat0 = _flat(grads0)
    full = _variant(scanned, remat="full")
    loss, grads = _loss_and_grads_fn(*nnx.split(full), tokens, positions)
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    for path, g in _flat(grads).items():
        np.testing.assert_allclose(g, flat0[path], rtol=1e-5, atol=1e-7, err_msg=str(path))
    # The unscanned stack under a checkpoint policy: same loss and the same (unstacked) grads.
    looped = _variant(_build(scan_layers=False, **PATTERN), remat="dots_saveable")
    loss, grads = _loss_and_grads_fn(*nnx.split(looped), tokens, positions)
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    for path, g in _flat(grads).items():
        if path[0] == "blocks":
            expected = flat0[("blocks",) + path[2:]][path[1]]
        else:
            expected = flat0[path]
        np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-7, err_msg=str(path))


def test_unrolled_layer_scan_gives_the_same_loss_and_grads():
    """model.scan_unroll (a run-time setting: the same parameters) unrolls the layer scan (without
    remat only: under remat it stays looped, checked by tests/eval/test_benchmarks_smoke.py's
    memory test)."""
    tokens, positions = _batch(3)
    scanned = _build(**PATTERN)
    loss0, grads0 = _loss_and_grads_fn(*nnx.split(scanned), tokens, positions)
    flat0 = _flat(grads0)
    for unroll in (0, 2):
        loss, grads = _loss_and_grads_fn(*nnx.split(_variant(scanned, scan_unroll=unroll)),
                                         tokens, positions)
        np.testing.assert_allclose(loss, loss0, rtol=1e-6)
        for path, g in _flat(grads).items():
            np.testing.assert_allclose(g, flat0[path], rtol=1e-5, atol=1e-7, err_msg=str(path))
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="scan_unroll"):
            dataclasses.replace(CFG, scan_unroll=bad)


def test_packed_documents_do_not_see_each_other():
    model = _build()
    tokens, _ = _batch(3)
    seg = jnp.array([[1] * 5 + [2] * 7, [1] * 12])
    positions = jnp.array([list(range(5)) + list(range(7)), list(range(12))])
    logits = _forward(model, tokens, positions, seg)
    # Document 2 of row 0 alone gives the same logits as inside the packed row.
    alone = _forward(model, tokens[:, 5:], positions[:, 5:])
    np.testing.assert_allclose(logits[0, 5:], alone[0], rtol=1e-5, atol=1e-5)
    # Changing document 1 leaves document 2 unchanged.
    tokens2 = tokens.at[0, :5].set((tokens[0, :5] + 1) % CFG.vocab_size)
    logits2 = _forward(model, tokens2, positions, seg)
    np.testing.assert_allclose(logits2[0, 5:], logits[0, 5:], rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits2[0, :5], logits[0, :5], atol=1e-4)


def test_flops_and_num_params():
    model = _build()
    c = CFG
    dh, f = c.resolved_head_dim, c.resolved_d_ff
    per_layer = (2 * c.d_model * dh * (2 * c.n_heads + 2 * c.n_kv_heads)
                 + 4 * c.n_heads * dh * (T + 1) / 2 + 6 * c.d_model * f)
    assert model.flops_per_token(T) == pytest.approx(c.n_layers * per_layer
                                                     + 2 * c.d_model * c.vocab_size)
    attn = c.d_model * dh * (2 * c.n_heads + 2 * c.n_kv_heads)
    expected = (2 * c.vocab_size * c.d_model + c.d_model
                + c.n_layers * (attn + 3 * c.d_model * f + 2 * c.d_model))
    assert model.num_params() == expected


def test_bad_inputs_and_config():
    model = _build()
    tokens, positions = _batch()
    with pytest.raises(ValueError, match="positions"):
        model(tokens, positions=positions[:, :-1])
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(dataclasses.replace(CFG, vocab_size=0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.init_cache(1, CFG.max_seq_len + 1)
