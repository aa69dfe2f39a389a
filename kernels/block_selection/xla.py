"""NSA block scores in plain JAX, chunked over query tiles (never a [T, Sc] tensor at long T).

Letters: B batch, T queries, Sc compressed tokens, Hkv KV heads, G query heads per KV head,
R = B * Hkv, Dk head dim, bq query tile, bk compressed-token tile, nb selection blocks, m position
in a block's token window.

Per query tile: the compressed-branch probabilities [R, bq, Sc] (summed over G) are computed only
for the compressed-token tiles the tile can see (a loop with traced bounds: tokens that end past
the tile's last position, or start before its rows' documents, are never scored); then each block
j sums the few tokens that can touch it with Remap.weight. When the block size is a multiple of
the stride (every NSA setting in use), token j's window starts at a * j - P, so the windows are M
strided slices of the probabilities (a = l'/d, M = Remap.window_len(1)); otherwise a static
gather. No [Sc, nb] matrix is formed.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from aiinfra_jax.kernels.block_selection.reference import (Remap, doc_start_positions,
                                                           token_visible)
from .._util import pad_axis as _pad_axis


def _block_windows(remap: Remap, n_tokens: int, n_blocks: int):
    """Static token indices [nb, m] touching each block and their weights (0 where padding)."""
    j = np.arange(n_blocks, dtype=np.int32)
    first = remap.token_window(j, xp=np)
    m = remap.window_len(1)
    idx = first[:, None] + np.arange(m, dtype=np.int32)[None, :]
    w = remap.weight(idx, j[:, None], xp=np)
    w = np.where(idx < n_tokens, w, 0.0).astype(np.float32)
    return np.minimum(idx, n_tokens - 1), w


def _strided_windows(remap: Remap, n_blocks: int):
    """(a, P, weights [M, nb]) when block j's token window is [a*j - P, a*j - P + M) for every j
    (tokens below 0 then carry zero probability), else None."""
    lp, d = remap.block_size, remap.cmp_stride
    if lp % d:
        return None
    a, m = lp // d, remap.window_len(1)
    j_far = np.arange(remap.cmp_block_len // d + 4, remap.cmp_block_len // d + 8)
    pad = j_far * a - remap.token_window(j_far, xp=np)
    if np.any(pad != pad[0]) or pad[0] < 0:
        return None
    j = np.arange(n_blocks, dtype=np.int32)
    idx = j[None, :] * a - int(pad[0]) + np.arange(m, dtype=np.int32)[:, None]  # [M, nb]
    return a, int(pad[0]), remap.weight(idx, j[None, :], xp=np).astype(np.float32)


def _window_sums(p, remap: Remap, n_tokens: int, n_blocks: int):
    """Block scores [..., nb] from token probabilities p [..., Sp] (zero past n_tokens)."""
    strided = _strided_windows(remap, n_blocks)
    if strided is None:
        idx, w = _block_windows(remap, n_tokens, n_blocks)
        win = jnp.take(p, jnp.asarray(idx), axis=-1)  # [..., nb, m]
        return jnp.einsum("...jm,jm->...j", win, jnp.asarray(w))
    a, pad, w = strided
    m = w.shape[0]
    need = a * (n_blocks - 1) + m  # padded length the last window reaches
    pp = jnp.pad(p, [(0, 0)] * (p.ndim - 1) + [(pad, max(need - pad - p.shape[-1], 0))])
    total = 0.0
    for i in range(m):
        win = lax.slice_in_dim(pp, i, i + a * (n_blocks - 1) + 1, stride=a, axis=p.ndim - 1)
        total = total + win * jnp.asarray(w[i])
    return total


def block_scores_from_probs(p, remap: Remap, seq_len: int):
    """Block scores [..., nb] from compressed-token probabilities p [..., Sc] already summed over
    a group's heads (zero where a token is not visible), e.g. cached_attention's group probs."""
    return _window_sums(p.astype(jnp.float32), remap, p.shape[-1],
                        -(-seq_len // remap.block_size))


# The score tile [R, G*bq, bk] float32 is written, exponentiated, masked and summed over G in
# separate passes on XLA:CPU, so its size decides the speed: measured at T = 8K, G = 16, R = 1
# (eval/BENCHMARKS.md), 4 MiB and up 340-370 ms, 1 MiB and below 30-50 ms. The default token tile
# keeps it at TILE_ELEMENTS (1 MiB, inside a core's L2).
TILE_ELEMENTS = 1 << 18


def block_scores(q, k_cmp, lse_cmp, q_offset, q_segment_ids, *, seq_len: int, remap: Remap,
                 scale: float, block_q: int = 256, block_k: int | None = None):
    """Per-group block scores [B, T, Hkv, nb] float32. block_k: compressed tokens per tile,
    default the largest power of two (32 to 512) keeping the score tile within TILE_ELEMENTS."""
    b, t, hq, dk = q.shape
    sc, hkv = k_cmp.shape[1], k_cmp.shape[2]
    g, r = hq // hkv, b * hkv
    l, d = remap.cmp_block_len, remap.cmp_stride
    nb = -(-seq_len // remap.block_size)
    bq = min(block_q, t)  # (a decode step's one row is not padded to 8: no layout needs it)
    if block_k is None:
        block_k = 1 << max(min((TILE_ELEMENTS // (r * g * bq)).bit_length() - 1, 9), 5)
    bk = min(block_k, -(-sc // 8) * 8)
    nq, nk = -(-t // bq), -(-sc // bk)
    tp = nq * bq
    q_pos = jnp.arange(t, dtype=jnp.int32)[None, :] + q_offset[:, None]
    start = doc_start_positions(q_segment_ids, q_pos)
    # Head-major, as in flash_attention's XLA path: a query tile is [R, G*bq, Dk] (one matmul for
    # the group), a token tile [R, bk, Dk].
    qh = jnp.moveaxis(_pad_axis(q, 1, tp).reshape(b, tp, hkv, g, dk), 1, 3).reshape(r, g, tp, dk)
    kh = jnp.moveaxis(_pad_axis(k_cmp, 1, nk * bk), 2, 1).reshape(r, nk * bk, dk)
    lse = _pad_axis(lse_cmp.astype(jnp.float32), 1, tp, -jnp.inf).reshape(b, tp, hkv, g)
    lse = jnp.moveaxis(lse, 1, 3).reshape(r, g, tp)
    q_pos = _pad_axis(q_pos, 1, tp)
    start = _pad_axis(start, 1, tp)
    off_hi = jnp.max(q_offset)

    def q_tile(ti):
        qc = lax.dynamic_slice_in_dim(qh, ti * bq, bq, axis=2).reshape(r, g * bq, dk)
        lse_c = lax.dynamic_slice_in_dim(lse, ti * bq, bq, axis=2).reshape(r, g * bq, 1)
        pos_c = lax.dynamic_slice_in_dim(q_pos, ti * bq, bq, axis=1)
        start_c = lax.dynamic_slice_in_dim(start, ti * bq, bq, axis=1)
        # Token tiles with a token visible to some row: i*d + l - 1 <= last position, and
        # i*d >= the earliest document start.
        last = ti * bq + bq - 1 + off_hi - (l - 1)
        n_vis = jnp.where(last < 0, 0, jnp.minimum(jnp.maximum(last, 0) // d + 1, sc))
        lo = jnp.minimum((jnp.min(start_c) + d - 1) // d // bk, nk)
        hi = jnp.maximum((n_vis + bk - 1) // bk, lo)

        def body(u, pbuf):
            kc = lax.dynamic_slice_in_dim(kh, u * bk, bk, axis=1)
            logits = jnp.einsum("rqd,rkd->rqk", qc, kc, preferred_element_type=jnp.float32)
            vis = token_visible(u * bk + jnp.arange(bk, dtype=jnp.int32)[None, None, :],
                                pos_c[:, :, None], start_c[:, :, None], sc, l, d)  # [B, bq, bk]
            vis = jnp.broadcast_to(vis[:, None, None], (b, hkv, g, bq, bk))
            vis = jnp.logical_and(vis.reshape(r, g * bq, bk), jnp.isfinite(lse_c))
            pr = jnp.where(vis, jnp.exp(logits * scale - lse_c), 0.0)
            pr = pr.reshape(r, g, bq, bk).sum(axis=1)
            return lax.dynamic_update_slice_in_dim(pbuf, pr, u * bk, axis=2)

        pbuf = lax.fori_loop(lo, hi, body, jnp.zeros((r, bq, nk * bk), jnp.float32))
        return _window_sums(pbuf, remap, sc, nb)  # [R, bq, nb]

    scores = lax.map(q_tile, jnp.arange(nq, dtype=jnp.int32))  # [nq, R, bq, nb]
    scores = scores.reshape(nq, b, hkv, bq, nb)
    scores = jnp.transpose(scores, (1, 0, 3, 2, 4)).reshape(b, tp, hkv, nb)
    return scores[:, :t]
