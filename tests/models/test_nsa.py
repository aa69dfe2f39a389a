"""NSA mixer: shapes, a dense-mask reference, gradients, decode == forward, documents, causality."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aiinfra_jax.generate import decode_step, prefill
from aiinfra_jax.kernels.block_selection import select_blocks
from aiinfra_jax.kernels.sparse_attention import sparse_attention
from aiinfra_jax.models import ModelConfig, Transformer, get_mixer
from aiinfra_jax.models.attention.nsa import NSAttention, n_compressed
from aiinfra_jax.models import NSAConfig

# Small sizes: compression blocks of 4 with stride 2, selection blocks of 8 (3 of them, so at
# T = 48 most blocks are dropped), a window of 6.
NSA = NSAConfig(cmp_block_len=4, cmp_stride=2, sel_block_size=8, n_selected=3, n_init=1,
                n_local=1, window=6, implementation="xla")
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mixers=("nsa",),
                  nsa=NSA, max_seq_len=128)
B, T = 2, 40


def _x(seed, t=T, b=B):
    return jax.random.normal(jax.random.key(seed), (b, t, CFG.d_model))


def _pos(t=T, b=B):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


@nnx.jit
def _apply_with_cache(layer, x, pos, seg=None):
    return layer(x, positions=pos, segment_ids=seg)


def _apply(layer, x, pos, seg=None):
    return _apply_with_cache(layer, x, pos, seg)[0]


@nnx.jit
def _logits(model, tokens, pos):
    return model(tokens, positions=pos)[0]


_LAYERS: dict = {}


def _layer(cfg=CFG, gates=None):
    """An NSA layer (built once per config, cloned); gates=(c, s, w) in {0, 1} pins the gates to
    those values (w_gate = 0, bias +-large)."""
    if cfg not in _LAYERS:
        _LAYERS[cfg] = NSAttention(cfg, rngs=nnx.Rngs(0))
    layer = nnx.clone(_LAYERS[cfg])
    if gates is not None:
        layer.w_gate[...] = jnp.zeros_like(layer.w_gate[...])
        bias = jnp.asarray([100.0 if g else -200.0 for g in gates])
        layer.b_gate[...] = jnp.broadcast_to(bias, layer.b_gate[...].shape)
    return layer


def test_registered_shapes_dtypes_and_cache_layout():
    assert get_mixer("nsa") is NSAttention
    bf16_shared = dataclasses.replace(CFG, dtype="bfloat16",
                                      nsa=dataclasses.replace(NSA, separate_kv=False))
    for cfg in (CFG, bf16_shared):
        layer = _layer(cfg)
        y, cache = _apply_with_cache(layer, _x(0), _pos())
        assert cache is None and y.shape == (B, T, CFG.d_model) and y.dtype == jnp.dtype(cfg.dtype)
        assert np.isfinite(np.asarray(y, np.float32)).all()
    cache = _layer().init_cache(3, 20)
    assert cache["k_cmp"].shape == (3, 2, 8, n_compressed(20, 4, 2)) == (3, 2, 8, 9)
    assert cache["v_cmp"].shape == (3, 2, 9, 8)
    assert {"k_src", "v_src", "k_slc", "v_slc", "k_win", "v_win", "lengths"} <= set(cache)
    assert cache["k_slc"].shape == cache["v_slc"].shape == (3, 2, 20, 8)
    # The window's ring of W = min(window, max_len) slots; its keys transposed (one run per row)
    assert cache["v_win"].shape == (3, 2, 6, 8) and cache["k_win"].shape == (3, 2, 8, 6)
    assert _layer().init_cache(1, 4)["v_win"].shape == (1, 2, 4, 8)
    assert cache["lengths"].dtype == jnp.int32
    assert cache["k_src"].shape == (3, 3, 2, 8)  # the last l - 1 compression inputs
    shared = _layer(bf16_shared)
    assert shared.wk[...].shape == (32, 1, 2, 8)
    assert {"k_src", "v_src", "k", "v", "k_cmp", "v_cmp", "lengths"} == set(
        shared.init_cache(1, 20))
    assert shared.init_cache(1, 20)["k"].dtype == jnp.bfloat16


def _masked_attention(q, k, v, mask_bts):
    """Plain softmax attention, GQA by repeating kv heads; rows without keys give 0."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    m = jnp.broadcast_to(mask_bts[:, None], s.shape) if mask_bts.ndim == 3 else mask_bts
    p = jax.nn.softmax(jnp.where(m, s, -jnp.inf), axis=-1)
    p = jnp.where(m.any(-1, keepdims=True), p, 0.0)
    return jnp.einsum("bhts,bshd->bthd", p, v)


@nnx.jit
def _reference(layer, x, pos):
    """The layer rebuilt with explicit boolean masks and plain softmax attention per branch."""
    q, gates, new = layer._project(x, pos)
    c = NSA
    n_cmp = n_compressed(T, c.cmp_block_len, c.cmp_stride)
    starts = jnp.broadcast_to(jnp.arange(n_cmp) * c.cmp_stride, (B, n_cmp))
    k_cmp, v_cmp = layer.compress(new["k_src"], new["v_src"], starts, starts + c.cmp_block_len - 1)
    t = jnp.arange(T)[:, None]
    cmp_vis = jnp.arange(n_cmp)[None, :] * 2 + 3 <= t  # whole block of 4 in the past
    o_cmp = _masked_attention(q, k_cmp, v_cmp, cmp_vis[None])
    lse = _lse_reference(q, k_cmp, cmp_vis)
    idx = select_blocks(q, k_cmp, lse, seq_len=T, cmp_block_len=4, cmp_stride=2, block_size=8,
                        n_selected=3, n_init=1, n_local=1)
    s = jnp.arange(T)
    sel = (idx[..., None] == (s // 8)[None, None, None, None]).any(3)  # [B,T,K,S]
    sel = sel & (s[None, None, None, :] <= jnp.arange(T)[None, :, None, None])
    sel_bhts = jnp.repeat(jnp.transpose(sel, (0, 2, 1, 3)), 2, axis=1)
    o_slc = _masked_attention(q, new["k_slc"], new["v_slc"], sel_bhts)
    win = (s[None, :] <= t) & (s[None, :] > t - c.window)
    o_win = _masked_attention(q, new["k_win"], new["v_win"], win[None])
    mix = gates[..., 0, None] * o_cmp + gates[..., 1, None] * o_slc + gates[..., 2, None] * o_win
    return jnp.einsum("bthk,hkd->btd", mix, layer.wo[...]), idx


def test_layer_matches_dense_mask_reference():
    layer = _layer()
    x, pos = _x(3), _pos()
    ref, idx = _reference(layer, x, pos)
    np.testing.assert_allclose(_apply(layer, x, pos), ref, rtol=2e-4, atol=2e-5)
    assert (np.asarray(idx)[:, -1] >= 0).sum() == B * 2 * 3  # 3 of the 5 blocks were chosen


def _lse_reference(q, k_cmp, mask_ts):
    g = q.shape[2] // k_cmp.shape[2]
    s = jnp.einsum("bthd,bshd->bths", q, jnp.repeat(k_cmp, g, axis=2)) / np.sqrt(q.shape[-1])
    return jax.nn.logsumexp(jnp.where(mask_ts[None, :, None, :], s, -jnp.inf), axis=-1)


def test_gradients_reach_every_parameter():
    layer = _layer()
    x, pos = _x(1), _pos()
    w = jax.random.normal(jax.random.key(7), (B, T, CFG.d_model))
    graphdef, params = nnx.split(layer, nnx.Param)

    def loss(params):
        y, _ = nnx.merge(graphdef, params)(x, positions=pos)
        return jnp.sum(y * w)

    grads = jax.jit(jax.grad(loss))(params)
    flat = dict(nnx.to_flat_state(grads))
    assert {"cmp_w1", "cmp_w2", "cmp_b1", "cmp_b2", "cmp_pe", "w_gate", "b_gate", "wk", "wv"} <= {
        k[0] for k in flat}
    for path, g in flat.items():
        g = np.asarray(g[...] if hasattr(g, "__getitem__") and not isinstance(g, jax.Array)
                       else g)
        assert np.isfinite(g).all(), path
        assert np.abs(g).max() > 0, f"zero gradient for {path}"
    # every K/V branch slice (cmp, slc, win) gets its own gradient
    gk = np.asarray(flat[("wk",)][...])
    assert all(np.abs(gk[:, b]).max() > 0 for b in range(3))


@pytest.mark.parametrize("slots", [40, 37, 24])
def test_decode_selection_matches_kernel_on_full_cache(slots):
    """The decode step's selection branch over the head-major cache, by
    gathering the selected blocks (40 and 37 slots > n*l' = 24; at 37 the last block is partial)
    or by masking a short cache read whole (24 slots): with or without the query's own (partly
    written) block selected it equals sparse_attention on the whole sequence-major cache."""
    kq, kk, kv = jax.random.split(jax.random.key(8), 3)
    q = jax.random.normal(kq, (B, 1, 4, 8))
    k, v = (jax.random.normal(key, (B, slots, 2, 8)) for key in (kk, kv))
    lengths = jnp.asarray([17, slots - 1], jnp.int32)  # own blocks 2 and `last`
    last = (slots - 1) // 8
    idx = jnp.asarray([[[[0, 1, -1], [2, -1, -1]]],
                       [[[0, last - 1, last], [last - 2, last - 1, last]]]], jnp.int32)
    want = jax.jit(lambda *a: sparse_attention(*a, block_size=8, q_offset=lengths))(q, k, v, idx)
    got = jax.jit(_layer()._decode_selected)(q, k.swapaxes(1, 2), v.swapaxes(1, 2), idx,
                                             lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_copies_no_cache_buffer(batch):
    """A donated decode step updates every cache buffer in place (raw, compressed, tails): its
    compiled program copies none of them whole. With one row, the compressed cache's one-token
    write became a dynamic_update_slice that XLA:CPU copied the buffer for, once per reader."""
    layer = _layer()
    graphdef, state = nnx.split(layer)
    cache = layer.init_cache(batch, 64, jnp.float32)

    def step(state, cache, x, pos):
        return nnx.merge(graphdef, state)(x, positions=pos, cache=cache)

    x = jnp.zeros((batch, 1, CFG.d_model))
    pos = jnp.full((batch, 1), 40, jnp.int32)
    hlo = jax.jit(step, donate_argnums=(1,)).lower(state, cache, x, pos).compile().as_text()
    shapes = {f"f32[{','.join(map(str, v.shape))}]" for k, v in cache.items() if k != "lengths"}
    copies = [line for line in hlo.splitlines() if " copy(" in line
              and any(f"= {s}" in line for s in shapes)]
    assert not copies, copies[:3]


def _model(cfg=CFG):
    return Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("separate_kv,chunk", [(True, 8), (False, 8), (True, 3)])
def test_prefill_then_decode_equals_forward(separate_kv, chunk):
    """Right-padded prompts of lengths 5 and 13 prefilled in chunks of 8 (several new tokens per
    call at nonzero lengths, one all-padding chunk), then token-by-token decoding up to 48 tokens:
    crosses many compression (stride 2) and selection (8) block boundaries and the window (6).
    Both cache layouts: K/V per branch (the window in a ring of 6 slots: a chunk of 8 writes only
    its last 6 tokens; chunks of 3 start inside a partly written ring), and one K/V shared by the
    selection and window branches."""
    model = _model(dataclasses.replace(CFG, nsa=dataclasses.replace(NSA, separate_kv=separate_kv)))
    total = 48
    tokens = jax.random.randint(jax.random.key(5), (B, total), 1, CFG.vocab_size)
    full = _logits(model, tokens, _pos(total))
    lengths = np.array([5, 13])
    prompt = np.where(np.arange(16)[None, :] < lengths[:, None], np.asarray(tokens[:, :16]), 0)
    logits, cache = prefill(model, jnp.asarray(prompt), jnp.asarray(lengths), total,
                            chunk_size=chunk)
    rows = np.arange(B)
    errs = [np.abs(np.asarray(logits) - np.asarray(full)[rows, lengths - 1]).max()]
    pos = lengths.copy()
    while pos.min() < total:
        cur = np.minimum(pos, total - 1)
        logits, cache = decode_step(model, cache, tokens[rows, cur], jnp.asarray(cur))
        for b in range(B):
            if pos[b] < total:
                errs.append(np.abs(np.asarray(logits[b]) - np.asarray(full[b, pos[b]])).max())
        pos = pos + 1
    assert max(errs) < 2e-4, max(errs)
    assert np.asarray(cache[0][0]["lengths"])[0] == total


def test_no_leakage_across_documents():
    """Rows hold docs [0, 13), [13, 37), [37, 48): changing docs 1 and 3 leaves doc 2 unchanged
    (doc 2 is long enough for compressed, selected and windowed keys, and blocks cross its ends)."""
    layer = _layer()
    t = 48
    seg = jnp.asarray(np.repeat([1, 2, 3], [13, 24, 11])[None].repeat(B, 0))
    pos = jnp.asarray(np.concatenate([np.arange(13), np.arange(24), np.arange(11)])[None]
                      .repeat(B, 0))
    x = _x(4, t)
    y = _apply(layer, x, pos, seg)
    other = jax.random.normal(jax.random.key(11), x.shape)
    x2 = jnp.where((seg != 2)[..., None], other, x)
    y2 = _apply(layer, x2, pos, seg)
    np.testing.assert_allclose(y2[:, 13:37], y[:, 13:37], rtol=1e-5, atol=1e-6)
    assert not np.allclose(y2[:, :13], y[:, :13], atol=1e-4)
    assert not np.allclose(y2[:, 37:], y[:, 37:], atol=1e-4)


@pytest.mark.parametrize("gates", [(1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1)],
                         ids=["all", "cmp", "slc", "win"])
def test_causality_through_each_branch(gates):
    """Changing tokens from row 23 on never changes rows < 23, with each branch alone and all."""
    layer = _layer(gates=gates)
    x = _x(5)
    y = _apply(layer, x, _pos())
    x2 = x.at[:, 23:].set(jax.random.normal(jax.random.key(12), (B, T - 23, CFG.d_model)))
    y2 = _apply(layer, x2, _pos())
    np.testing.assert_allclose(y2[:, :23], y[:, :23], rtol=1e-5, atol=1e-6)
    # the branch is live: later rows do change (the compressed branch first sees row 23's block
    # at row 23 + 3 = 26)
    assert not np.allclose(y2[:, 26:], y[:, 26:], atol=1e-4)


def test_window_heads_read_only_through_compression_and_selection():
    """window_heads=2: heads 0-1 are the ordinary gated sum, heads 2-3 the same without the window
    branch (read through wo, one pair of heads at a time); the window gate of heads 2-3 is 0."""
    nsa_nw = dataclasses.replace(NSA, window_heads=2)
    cfg_nw = dataclasses.replace(CFG, nsa=nsa_nw)
    x = _x(6)
    gates = _layer(cfg_nw)._project(x, _pos())[1]
    np.testing.assert_array_equal(np.asarray(gates[..., 2:, 2]), 0.0)
    assert (np.asarray(gates[..., :2, 2]) > 0).all()

    def heads_only(layer, heads):
        wo = layer.wo[...]
        keep = jnp.zeros((wo.shape[0], 1, 1)).at[jnp.asarray(heads)].set(1.0)
        layer.wo[...] = wo * keep
        return _apply(layer, x, _pos())

    for heads, ref_gates in (([0, 1], (1, 1, 1)), ([2, 3], (1, 1, 0))):
        got = heads_only(_layer(cfg_nw, gates=(1, 1, 1)), heads)
        want = heads_only(_layer(CFG, gates=ref_gates), heads)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # and the window branch does matter to heads 2-3 when they keep it
    assert not np.allclose(heads_only(_layer(CFG, gates=(1, 1, 1)), [2, 3]), want, atol=1e-4)
    with pytest.raises(ValueError, match="window_heads=5 exceeds n_heads=4"):
        dataclasses.replace(CFG, nsa=dataclasses.replace(NSA, window_heads=5))


def test_flops_per_token_counts_three_branches():
    layer = nnx.eval_shape(lambda: NSAttention(CFG, rngs=nnx.Rngs(0)))
    keys = layer.attended_keys(T)
    p = np.arange(T)
    assert keys["win"] == pytest.approx(np.minimum(p + 1, 6).mean())
    assert keys["cmp"] == pytest.approx(np.maximum((p - 3) // 2 + 1, 0).mean())
    assert keys["slc"] <= 3 * 8
    long = nnx.eval_shape(lambda: NSAttention(dataclasses.replace(CFG, nsa=NSAConfig()),
                                              rngs=nnx.Rngs(0)))
    dense = nnx.eval_shape(lambda: get_mixer("dense")(CFG, rngs=nnx.Rngs(0)))
    # at 64K tokens NSA's default sizes attend ~1/13 of dense's keys
    assert long.flops_per_token(65536) < dense.flops_per_token(65536) / 5
    assert long.flops_per_token(65536) > long.flops_per_token(4096)


@pytest.mark.parametrize("kwargs, field", [
    (dict(cmp_stride=8, cmp_block_len=4), "cmp_stride"),
    (dict(n_selected=2, n_init=1, n_local=2), "n_selected"),
    (dict(remap="eq9", cmp_block_len=6, cmp_stride=4), "remap"),
    (dict(gate_bias=(0.0, 1.0)), "gate_bias"),
    (dict(cmp_mlp_hidden=0), "cmp_mlp_hidden"),
    (dict(implementation="cuda"), "implementation"),
    (dict(window=0), "window"),
    (dict(window_heads=-1), "window_heads"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"NSAConfig.{field}"):
        NSAConfig(**kwargs)
