"""block_selection: block scores of xla and both Pallas kernels (interpret) vs the reference, both
remaps, and the properties of the selection (forced blocks, top-n up to ties, causality, padding,
order, decode with q_offset, documents), plus validation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aiinfra_jax.kernels._testing import assert_close
from aiinfra_jax.kernels.block_selection import (Remap, block_scores, block_scores_reference,
                                                 select_blocks, select_blocks_from_probs,
                                                 select_from_scores_reference)
from aiinfra_jax.kernels.block_selection.reference import doc_start_positions
from aiinfra_jax.kernels.flash_attention import AttentionMask, cached_attention, flash_attention
from aiinfra_jax.kernels.flash_attention.mask import visible

IMPLS = ("xla", "pallas_gpu", "pallas_tpu")


@functools.partial(jax.jit, static_argnames=("l", "d"))
def _compressed_lse(q, k_cmp, v_cmp, off, *, l, d):
    _, lse = flash_attention(q, k_cmp, v_cmp, mask=AttentionMask(compressed=(l, d)),
                             q_offset=off, return_lse=True, implementation="xla")
    return lse


def _problem(key, b=2, t=70, hkv=2, g=2, dk=16, l=8, d=4, dtype=jnp.float32, seq_len=None,
             q_offset=None, segments=False):
    """q, compressed keys of a length-`seq_len` sequence, and the lse of the compressed branch."""
    seq_len = t if seq_len is None else seq_len
    sc = (seq_len - l) // d + 1
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (b, t, hkv * g, dk), jnp.float32).astype(dtype)
    k_cmp = jax.random.normal(ks[1], (b, sc, hkv, dk), jnp.float32).astype(dtype)
    v_cmp = jax.random.normal(ks[2], (b, sc, hkv, dk), jnp.float32).astype(dtype)
    off = None if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    seg = (jnp.sort(jax.random.randint(ks[3], (b, t), 0, 3), axis=1) if segments else None)
    lse = _compressed_lse(q, k_cmp, v_cmp, off, l=l, d=d)
    return q, k_cmp, lse, off, seg, seq_len


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("remap, l, d, lp, segments, dtype", [
    ("overlap", 8, 4, 16, True, jnp.float32),
    ("eq9", 8, 4, 16, False, jnp.float32),
    ("overlap", 6, 4, 10, False, jnp.bfloat16),   # d does not divide l or l'
])
def test_scores_match_reference(impl, remap, l, d, lp, segments, dtype):
    key = jax.random.fold_in(jax.random.PRNGKey(0), hash((impl, remap, l, lp)) % 2**31)
    q, k_cmp, lse, off, seg, seq_len = _problem(key, l=l, d=d, dtype=dtype, segments=segments,
                                                q_offset=[0, 5], seq_len=80)
    kw = dict(seq_len=seq_len, cmp_block_len=l, cmp_stride=d, block_size=lp, remap=remap,
              q_offset=off, q_segment_ids=seg)
    got = jax.jit(lambda q, k, lse: block_scores(q, k, lse, implementation=impl,
                                                 interpret=impl != "xla", **kw))(q, k_cmp, lse)
    want = block_scores_reference(q, k_cmp, lse, seq_len=seq_len, remap=Remap(remap, l, d, lp),
                                  scale=q.shape[-1] ** -0.5, q_offset=off, q_segment_ids=seg)
    assert got.shape == (2, 70, 2, -(-seq_len // lp))
    assert float(jnp.max(want)) > 0.0
    assert_close(got, want, dtype, f"block scores ({remap})")


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_scores_many_block_tiles(impl):
    """nb = 138 blocks: several output block tiles per query tile (the TPU kernel's tiles are 128
    blocks), so token windows start mid-sequence and tiles past the queries are skipped."""
    from aiinfra_jax.kernels.block_selection.api import block_scores_unchecked
    l, d, lp = 8, 4, 8
    q, k_cmp, lse, off, seg, seq_len = _problem(jax.random.PRNGKey(9), b=1, t=1100, hkv=1, g=2,
                                                l=l, d=d, q_offset=[3], seq_len=1104)
    rm = Remap("overlap", l, d, lp)
    kw = dict(seq_len=seq_len, remap=rm, scale=0.3, q_offset=off, q_segment_ids=seg)
    got = jax.jit(lambda q, k, lse: block_scores_unchecked(
        q, k, lse, implementation=impl, interpret=True, block_q=128,
        block_n=16 if impl == "pallas_gpu" else 128, **kw))(q, k_cmp, lse)
    want = block_scores_reference(q, k_cmp, lse, **kw)
    assert got.shape == (1, 1100, 1, 138)
    assert_close(got, want, jnp.float32, "block scores")


@pytest.mark.parametrize("remap, l, d, lp, segments", [
    ("overlap", 8, 4, 8, False),   # strided windows (l' a multiple of d)
    ("eq9", 8, 4, 16, True),       # strided windows, documents
    ("overlap", 6, 4, 10, True),   # gathered windows (d does not divide l')
])
def test_xla_scores_many_query_and_token_tiles(remap, l, d, lp, segments):
    """The XLA path with small tiles: several query tiles, each scoring only the token tiles it
    can see (tiles past its last row or before its rows' documents skipped), equals the
    reference."""
    from aiinfra_jax.kernels.block_selection import xla as xla_impl
    q, k_cmp, lse, off, seg, seq_len = _problem(jax.random.PRNGKey(11), b=2, t=300, hkv=2, g=2,
                                                l=l, d=d, q_offset=[0, 7], seq_len=310,
                                                segments=segments)
    rm = Remap(remap, l, d, lp)
    got = jax.jit(lambda q, k, lse: xla_impl.block_scores(
        q, k, lse, off, seg, seq_len=seq_len, remap=rm, scale=0.3, block_q=64,
        block_k=16))(q, k_cmp, lse)
    want = block_scores_reference(q, k_cmp, lse, seq_len=seq_len, remap=rm, scale=0.3,
                                  q_offset=off, q_segment_ids=seg)
    assert got.shape == want.shape == (2, 300, 2, -(-seq_len // lp))
    assert_close(got, want, jnp.float32, f"block scores ({remap})")


def test_overlap_weights_conserve_probability():
    """Overlap remap: every compressed token's weights over blocks sum to 1; eq9 counts pairs."""
    for l, d, lp in [(32, 16, 64), (6, 4, 10), (7, 3, 5)]:
        rm = Remap("overlap", l, d, lp)
        i = np.arange(50)[:, None]
        j = np.arange((50 * d + l) // lp + 2)[None, :]
        np.testing.assert_allclose(rm.weight(i, j, xp=np).sum(1), 1.0, rtol=1e-6)
    rm = Remap("eq9", 32, 16, 64)   # l'/d = 4, l/d = 2: block j sums 8 (m, n) pairs
    w = rm.weight(np.arange(200)[:, None], np.arange(2, 40)[None, :], xp=np)
    np.testing.assert_allclose(w.sum(0), 8.0)


def _check_selection(idx, scores, q_pos, start, lp, n_sel, n_init, n_local):
    idx, scores = np.asarray(idx), np.asarray(scores)
    q_pos, start = np.asarray(q_pos), np.asarray(start)
    b, t, hkv, _ = idx.shape
    assert idx.dtype == np.int32
    for bi in range(b):
        for ti in range(t):
            own, first = q_pos[bi, ti] // lp, start[bi, ti] // lp
            cands = np.arange(first, own + 1)
            forced = {j for j in cands if j - first < n_init or own - j < n_local}
            for g in range(hkv):
                row = idx[bi, ti, g]
                sel = row[row >= 0]
                # sorted ascending, -1 only at the end, no duplicates
                assert np.all(row[len(sel):] == -1) and np.all(np.diff(sel) > 0)
                # never past the query's own block, never before its document
                assert np.all(sel <= own) and np.all(sel >= first)
                assert len(sel) == min(n_sel, len(cands))
                assert forced <= set(sel.tolist())
                # the unforced picks are a top-n by score (tie-aware: compare score multisets)
                rest = [j for j in cands if j not in forced]
                picked = sorted((scores[bi, ti, g, j] for j in sel if j not in forced),
                                reverse=True)
                best = sorted((scores[bi, ti, g, j] for j in rest), reverse=True)[:len(picked)]
                np.testing.assert_array_equal(picked, best)


@pytest.mark.parametrize("impl", IMPLS)
def test_selection_properties(impl):
    lp, n_sel, n_init, n_local = 8, 4, 1, 2
    q, k_cmp, lse, off, seg, seq_len = _problem(jax.random.PRNGKey(2), t=60, segments=True,
                                                q_offset=[0, 3], seq_len=64)
    kw = dict(seq_len=seq_len, cmp_block_len=8, cmp_stride=4, block_size=lp, q_offset=off,
              q_segment_ids=seg)
    idx = jax.jit(lambda q, k, lse: select_blocks(
        q, k, lse, n_selected=n_sel, n_init=n_init, n_local=n_local, implementation=impl,
        interpret=impl != "xla", **kw))(q, k_cmp, lse)
    scores = block_scores_reference(q, k_cmp, lse, seq_len=seq_len, remap=Remap("overlap", 8, 4,
                                    lp), scale=q.shape[-1] ** -0.5, q_offset=off,
                                    q_segment_ids=seg)
    q_pos = jnp.arange(60)[None, :] + off[:, None]
    start = doc_start_positions(seg, q_pos)
    _check_selection(idx, scores, q_pos, start, lp, n_sel, n_init, n_local)
    # also exactly the plain-numpy oracle (same tie rule: lower block index wins)
    want = select_from_scores_reference(scores, q_pos, start, block_size=lp, n_selected=n_sel,
                                        n_init=n_init, n_local=n_local)
    assert np.mean(np.asarray(idx) == want) > 0.99  # kernels' rounding may flip a near-tie


def test_ties_pick_lower_block_and_pad_with_minus_one():
    """Equal scores: the lower block index wins; early queries have fewer blocks -> -1 padding."""
    from aiinfra_jax.kernels.block_selection import select_from_scores
    scores = jnp.ones((1, 40, 1, 5), jnp.float32)
    q_pos = jnp.arange(40)[None, :]
    idx = np.asarray(select_from_scores(scores, q_pos, jnp.zeros_like(q_pos), block_size=8,
                                        n_selected=3, n_init=1, n_local=1))
    np.testing.assert_array_equal(idx[0, 0, 0], [0, -1, -1])       # only block 0 exists
    np.testing.assert_array_equal(idx[0, 9, 0], [0, 1, -1])        # blocks 0, 1
    np.testing.assert_array_equal(idx[0, 39, 0], [0, 1, 4])        # forced 0 and 4, tie -> 1


def test_decode_with_q_offset_matches_prefill():
    q, k_cmp, lse, _, _, seq_len = _problem(jax.random.PRNGKey(3), b=1, t=64)
    kw = dict(seq_len=seq_len, cmp_block_len=8, cmp_stride=4, block_size=8, n_selected=4)
    sel = jax.jit(lambda q, k, lse, off: select_blocks(q, k, lse, q_offset=off, **kw))
    full = sel(q, k_cmp, lse, None)
    for p in (5, 63):
        step = sel(q[:, p:p + 1], k_cmp, lse[:, p:p + 1], jnp.array([p], jnp.int32))
        np.testing.assert_array_equal(np.asarray(step[:, 0]), np.asarray(full[:, p]))


@pytest.mark.parametrize("remap, l, d, lp", [("overlap", 8, 4, 8), ("eq9", 8, 4, 16),
                                             ("overlap", 6, 4, 10)])
def test_select_from_group_probs_matches_select_blocks(remap, l, d, lp):
    """A decode step ranks blocks by the compressed branch's own probabilities
    (cached_attention's group probs): the same blocks as select_blocks from q, k_cmp and lse, at
    offsets in the first block, mid-sequence and the last position, per row."""
    q, k_cmp, _, _, _, seq_len = _problem(jax.random.PRNGKey(6), b=3, t=64, l=l, d=d)
    v_cmp = jax.random.normal(jax.random.PRNGKey(7), k_cmp.shape)
    kw = dict(seq_len=seq_len, cmp_block_len=l, cmp_stride=d, block_size=lp, n_selected=4,
              remap=remap)
    off = jnp.asarray([3, 37, 63], jnp.int32)
    qd = q[jnp.arange(3), off][:, None]
    lse = _compressed_lse(qd, k_cmp, v_cmp, off, l=l, d=d)
    want = select_blocks(qd, k_cmp, lse, q_offset=off, **kw)
    sc = k_cmp.shape[1]
    vis = visible(AttentionMask(compressed=(l, d)), off[:, None, None],
                  jnp.arange(sc)[None, None, :], sc)
    o, p = cached_attention(qd, k_cmp.swapaxes(1, 2), v_cmp.swapaxes(1, 2),
                            jnp.broadcast_to(vis, (3, 1, sc)), return_group_probs=True)
    assert p.shape == (3, 1, 2, sc) and not np.asarray(p[0]).any()  # no token visible at 3
    np.testing.assert_allclose(p.sum(-1)[1:], 2.0, rtol=1e-5)       # G = 2 heads, each sums to 1
    got = select_blocks_from_probs(p, q_offset=off, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="n_init"):
        select_blocks_from_probs(p, q_offset=off, **{**kw, "n_selected": 2, "n_local": 2})
    with pytest.raises(ValueError, match="group_probs"):
        select_blocks_from_probs(p[0], q_offset=off, **kw)


@pytest.mark.parametrize("kwargs, match", [
    (dict(remap="eq9", cmp_block_len=6, cmp_stride=4), "eq9"),
    (dict(remap="nearest"), "remap"),
    (dict(n_selected=2, n_init=1, n_local=2), "n_init"),
    (dict(cmp_block_len=2, cmp_stride=4), "cmp_block_len"),
    (dict(block_size=0), "block_size"),
    (dict(seq_len=0), "seq_len"),
    (dict(q_offset=jnp.zeros((3,), jnp.int32)), "q_offset"),
    (dict(q_segment_ids=jnp.zeros((2, 5), jnp.int32)), "q_segment_ids"),
    (dict(implementation="pallas_tpu"), "implementation"),
])
def test_bad_arguments_are_named(kwargs, match):
    q, k_cmp, lse, _, _, seq_len = _problem(jax.random.PRNGKey(4), t=16)
    base = dict(seq_len=seq_len, cmp_block_len=8, cmp_stride=4, block_size=8, n_selected=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        select_blocks(q, k_cmp, lse, **base)


def test_bad_shapes_are_named():
    q, k_cmp, lse, _, _, seq_len = _problem(jax.random.PRNGKey(5), t=16)
    with pytest.raises(ValueError, match="lse_cmp"):
        select_blocks(q, k_cmp, lse[:, :3], seq_len=seq_len)
    with pytest.raises(ValueError, match="k_cmp"):
        select_blocks(q, k_cmp[..., :4], lse, seq_len=seq_len)
    with pytest.raises(ValueError, match="q must have rank 4"):
        select_blocks(q[0], k_cmp, lse, seq_len=seq_len)
