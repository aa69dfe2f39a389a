"""NSA block scoring: the plain float32 reference and the remap arithmetic every backend shares.

Letters: B batch, T queries, Sc compressed tokens, Hq query heads, Hkv KV heads (G = Hq / Hkv),
Dk head dim, nb selection blocks (nb = ceil(seq_len / l')). Compressed token i covers raw positions
[i*d, i*d + l) (l = cmp_block_len, d = cmp_stride); selection block j covers [j*l', (j+1)*l')
(l' = block_size).

Compressed-branch probabilities p[t, i] = exp(q_t . k_i * scale - lse[t]) where token i is visible
(i*d + l - 1 <= p_t, i.e. its whole block is in the past, and, with segment ids, i*d >= the start of
the query's document). The score of block j for KV group g is
  score[t, g, j] = sum_{h in group g} sum_i p_h[t, i] * W[i, j]
with the remap matrix W:
  "overlap": W[i, j] = |[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / l (exact for any l, d, l').
  "eq9":     the NSA paper's Eq. 9, p_slc[j] = sum_{m<l'/d} sum_{n<l/d} p_cmp[(l'/d) j - m - n],
             i.e. W[i, j] = #{(m, n)} with i = (l'/d) j - m - n (needs d | l and d | l').
W is a function of (i, j) computed elementwise (`remap_weight`), never stored at long T.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

REMAPS = ("overlap", "eq9")


@dataclasses.dataclass(frozen=True)
class Remap:
    """Static geometry of compressed tokens and selection blocks."""

    kind: str          # "overlap" | "eq9"
    cmp_block_len: int  # l
    cmp_stride: int     # d
    block_size: int     # l'

    def weight(self, i, j, xp=jnp):
        """W[i, j] for int32 arrays i (token) and j (block), broadcasting; float32.

        xp=np evaluates on host (static tables); xp=jnp traces (kernels)."""
        l, d, lp = self.cmp_block_len, self.cmp_stride, self.block_size
        if self.kind == "overlap":
            ov = xp.minimum(i * d + l, (j + 1) * lp) - xp.maximum(i * d, j * lp)
            return xp.maximum(ov, 0).astype(xp.float32) * xp.float32(1.0 / l)
        a, c = lp // d, l // d
        x = a * j - i
        cnt = xp.minimum(a - 1, x) - xp.maximum(0, x - c + 1) + 1
        return xp.maximum(cnt, 0).astype(xp.float32)

    def token_window(self, j_first, xp=jnp):
        """First token index (>= 0) that can touch block j_first; tokens touching blocks
        [j_first, j_first + nbt) lie in [first, first + window_len(nbt))."""
        l, d, lp = self.cmp_block_len, self.cmp_stride, self.block_size
        div = _div if xp is jnp else (lambda x, y: x // y)
        if self.kind == "overlap":  # i*d + l - 1 >= j*l'  <=>  i >= ceil((j*l' - l + 1) / d)
            a = xp.maximum(j_first * lp - l + 1, 0)
            return div(a + d - 1, d)
        a, c = lp // d, l // d   # i >= a*j - (a + c - 2)
        return xp.maximum(j_first * a - (a + c - 2), 0)

    def window_len(self, nbt: int) -> int:
        """Static upper bound on the number of tokens touching nbt consecutive blocks."""
        l, d, lp = self.cmp_block_len, self.cmp_stride, self.block_size
        if self.kind == "overlap":
            return (nbt * lp + l - 2) // d + 2
        a, c = lp // d, l // d
        return a * nbt + c - 1


def _div(a, b: int):
    a = jnp.asarray(a, jnp.int32)
    return a if b == 1 else lax.div(a, jnp.int32(b))


def doc_start_positions(q_segment_ids, q_pos):
    """Position where each query's document starts [B, T] (int32).

    Documents are contiguous runs of equal q_segment_ids along T. The run containing row 0 is taken
    to start at position 0 (a continuation chunk or decode step sees its whole past); other runs
    start at the position of their first row. Without segment ids every start is 0.
    """
    if q_segment_ids is None:
        return jnp.zeros_like(q_pos)
    t = q_pos.shape[1]
    rows = jnp.arange(t, dtype=jnp.int32)[None, :]
    new_run = jnp.concatenate([jnp.ones_like(q_segment_ids[:, :1], bool),
                               q_segment_ids[:, 1:] != q_segment_ids[:, :-1]], axis=1)
    run_start = lax.cummax(jnp.where(new_run, rows, 0), axis=1)
    return jnp.where(run_start == 0, 0, jnp.take_along_axis(q_pos, run_start, axis=1))


def token_visible(i, q_pos, doc_start, n_tokens: int, cmp_block_len: int, cmp_stride: int):
    """Compressed token i visible to a query at q_pos (broadcasting)."""
    vis = jnp.logical_and(i < n_tokens, i * cmp_stride + cmp_block_len - 1 <= q_pos)
    return jnp.logical_and(vis, i * cmp_stride >= doc_start)


def block_scores_reference(q, k_cmp, lse_cmp, *, seq_len: int, remap: Remap, scale: float,
                           q_offset=None, q_segment_ids=None):
    """Per-group block scores [B, T, Hkv, nb] float32 with full [T, Sc] matrices (small shapes)."""
    b, t, hq, dk = q.shape
    sc, hkv = k_cmp.shape[1], k_cmp.shape[2]
    g = hq // hkv
    nb = -(-seq_len // remap.block_size)
    off = jnp.zeros((b,), jnp.int32) if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    q_pos = jnp.arange(t, dtype=jnp.int32)[None, :] + off[:, None]
    start = doc_start_positions(q_segment_ids, q_pos)
    logits = jnp.einsum("bthgd,bshd->bhgts", q.astype(jnp.float32).reshape(b, t, hkv, g, dk),
                        k_cmp.astype(jnp.float32), precision=lax.Precision.HIGHEST) * scale
    lse = jnp.transpose(lse_cmp.reshape(b, t, hkv, g), (0, 2, 3, 1))[..., None]
    i = jnp.arange(sc, dtype=jnp.int32)
    vis = token_visible(i[None, None, :], q_pos[:, :, None], start[:, :, None], sc,
                        remap.cmp_block_len, remap.cmp_stride)[:, None, None]
    vis = jnp.logical_and(vis, jnp.isfinite(lse))
    p = jnp.where(vis, jnp.exp(jnp.where(vis, logits - lse, 0.0)), 0.0)
    w = remap.weight(i[:, None], jnp.arange(nb, dtype=jnp.int32)[None, :])  # [Sc, nb]
    scores = jnp.einsum("bhgts,sj->bthj", p, w, precision=lax.Precision.HIGHEST)
    return jax.lax.stop_gradient(scores)


def forced_blocks(own: int, first: int, *, n_init: int, n_local: int) -> list[int]:
    """The blocks every selection takes (ascending): the document's first n_init blocks (from
    block ``first``) and the query's own block ``own`` with the n_local - 1 before it."""
    return [j for j in range(first, own + 1) if j - first < n_init or own - j < n_local]


def select_from_scores_reference(scores, q_pos, doc_start, *, block_size: int, n_selected: int,
                                 n_init: int, n_local: int):
    """Plain numpy selection (the oracle for api.select_from_scores): per (b, t, g) the forced
    blocks, then the best remaining candidates by score (lower index wins ties), sorted, -1 padded.
    """
    scores = np.asarray(scores)
    q_pos, doc_start = np.asarray(q_pos), np.asarray(doc_start)
    b, t, hkv, nb = scores.shape
    out = np.full((b, t, hkv, n_selected), -1, np.int32)
    for bi in range(b):
        for ti in range(t):
            own = min(q_pos[bi, ti] // block_size, nb - 1)
            first = doc_start[bi, ti] // block_size
            forced = forced_blocks(own, first, n_init=n_init, n_local=n_local)
            rest = [j for j in range(first, own + 1) if j not in forced]
            for g in range(hkv):
                order = sorted(rest, key=lambda j: (-scores[bi, ti, g, j], j))
                chosen = sorted((forced + order)[:n_selected])
                out[bi, ti, g, :len(chosen)] = chosen
    return out
