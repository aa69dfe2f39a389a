"""NSA block scores in plain JAX, chunked over query tiles (never a [T, Sc] tensor at long T).

Letters: B batch, T queries, Sc compressed tokens, Hkv KV heads, G query heads per KV head,
Dk head dim, bq query tile, nb selection blocks, m position in a block's token window.

Per query tile: compressed-branch probabilities [B, Hkv, G, bq, Sc] (summed over G), then each block
j gathers the few tokens that can touch it (a static window of Remap.window_len(1) tokens) and
weights them with Remap.weight; no [Sc, nb] matrix is formed.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from aiinfra_jax.kernels.block_selection.reference import (Remap, doc_start_positions,
                                                           token_visible)


def _block_windows(remap: Remap, n_tokens: int, n_blocks: int):
    """Static token indices [nb, m] touching each block and their weights (0 where padding)."""
    j = np.arange(n_blocks, dtype=np.int32)
    first = remap.token_window(j, xp=np)
    m = remap.window_len(1)
    idx = first[:, None] + np.arange(m, dtype=np.int32)[None, :]
    w = remap.weight(idx, j[:, None], xp=np)
    w = np.where(idx < n_tokens, w, 0.0).astype(np.float32)
    return np.minimum(idx, n_tokens - 1), w


def block_scores(q, k_cmp, lse_cmp, q_offset, q_segment_ids, *, seq_len: int, remap: Remap,
                 scale: float, block_q: int = 256):
    """Per-group block scores [B, T, Hkv, nb] float32."""
    b, t, hq, dk = q.shape
    sc, hkv = k_cmp.shape[1], k_cmp.shape[2]
    g = hq // hkv
    nb = -(-seq_len // remap.block_size)
    bq = min(block_q, -(-t // 8) * 8)
    nq = -(-t // bq)
    tp = nq * bq
    q_pos = jnp.arange(t, dtype=jnp.int32)[None, :] + q_offset[:, None]
    start = doc_start_positions(q_segment_ids, q_pos)
    pad = tp - t
    qg = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, tp, hkv, g, dk)
    lse = jnp.pad(lse_cmp.astype(jnp.float32), ((0, 0), (0, pad), (0, 0)),
                  constant_values=-jnp.inf).reshape(b, tp, hkv, g)
    q_pos = jnp.pad(q_pos, ((0, 0), (0, pad)))
    start = jnp.pad(start, ((0, 0), (0, pad)))
    idx, w = _block_windows(remap, sc, nb)
    i_tok = jnp.arange(sc, dtype=jnp.int32)

    def q_tile(ti):
        sl = lambda x: lax.dynamic_slice_in_dim(x, ti * bq, bq, axis=1)  # noqa: E731
        qc, lse_c, pos_c, start_c = sl(qg), sl(lse), sl(q_pos), sl(start)
        logits = jnp.einsum("bqhgd,bshd->bhgqs", qc, k_cmp,
                            preferred_element_type=jnp.float32) * scale
        lse_t = jnp.transpose(lse_c, (0, 2, 3, 1))[..., None]
        vis = token_visible(i_tok[None, None, :], pos_c[:, :, None], start_c[:, :, None], sc,
                            remap.cmp_block_len, remap.cmp_stride)[:, None, None]
        vis = jnp.logical_and(vis, jnp.isfinite(lse_t))
        p = jnp.where(vis, jnp.exp(jnp.where(vis, logits - lse_t, 0.0)), 0.0).sum(axis=2)
        win = jnp.take(p, jnp.asarray(idx), axis=-1)          # [B, Hkv, bq, nb, m]
        return jnp.einsum("bhqjm,jm->bqhj", win, jnp.asarray(w))

    scores = lax.map(q_tile, jnp.arange(nq, dtype=jnp.int32))  # [nq, B, bq, Hkv, nb]
    scores = jnp.moveaxis(scores, 0, 1).reshape(b, tp, hkv, nb)
    return scores[:, :t]
