"""The attention mask object and the visibility arithmetic every flash_attention backend shares.

Letters: B batch, T queries, S keys, bq / bk query / key tile lengths.

A query row t of batch b sits at position p = t + q_offset[b]. A key index s has a *key position*
kpos(s) = s * d + e, where (d, e) = (1, 0) for raw keys and (stride, block_len - 1) for compressed
tokens (the last raw position the compressed token covers). Then

  causal      visible iff kpos(s) <= p
  window=w    visible iff p - w < kpos(s) <= p   (exactly w raw keys, the query itself included)
  compressed  visible iff s*stride + block_len - 1 <= p   (only whole blocks in the past)

and the conditions combine with AND. `window` and `compressed` both imply the causal bound
kpos(s) <= p (a window of w keys ends at the query itself; a compressed block is visible only once
complete), so `causal=False` changes the result only when both are unset (bidirectional attention).

The functions here work on jnp scalars/arrays and are used inside XLA code and Pallas kernels alike.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
import numpy as np


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys a query sees (static; hashable).

    Attributes:
      causal: key s visible only if s <= p (p = query position).
      window: if set, exactly `window` keys including the query itself: p - window < s <= p.
      compressed: (block_len l, stride d): key i is a compressed token covering raw positions
        [i*d, i*d + l); visible iff i*d + l - 1 <= p. The key axis length S then differs from T.
    """

    causal: bool = True
    window: int | None = None
    compressed: tuple[int, int] | None = None

    def __post_init__(self):
        if not isinstance(self.causal, (bool, np.bool_)):
            raise ValueError(f"AttentionMask.causal must be a bool, got {self.causal!r}")
        if self.window is not None and (not isinstance(self.window, (int, np.integer))
                                        or isinstance(self.window, bool) or self.window <= 0):
            raise ValueError(f"AttentionMask.window must be a positive int or None, got "
                             f"{self.window!r}")
        if self.compressed is not None:
            c = self.compressed
            ok = (isinstance(c, tuple) and len(c) == 2
                  and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in c))
            if not ok or not (c[0] >= c[1] > 0):
                raise ValueError(
                    f"AttentionMask.compressed must be (block_len, stride) ints with "
                    f"block_len >= stride > 0, got {c!r}")

    @property
    def key_stride(self) -> int:
        """d in kpos(s) = s*d + e."""
        return 1 if self.compressed is None else int(self.compressed[1])

    @property
    def key_end(self) -> int:
        """e in kpos(s) = s*d + e."""
        return 0 if self.compressed is None else int(self.compressed[0]) - 1

    @property
    def bounded_above(self) -> bool:
        """True if keys past the query are hidden (kpos(s) <= p)."""
        return self.causal or self.window is not None or self.compressed is not None


def _div(a, b: int):
    """a // b for a traced non-negative int32 `a` and a positive Python int `b`."""
    a = jnp.asarray(a, jnp.int32)
    return a if b == 1 else lax.div(a, jnp.int32(b))


def visible(mask: AttentionMask, q_pos, k_idx, kv_len: int):
    """Boolean visibility of keys `k_idx` for queries at positions `q_pos` (broadcasting).

    Keys at index >= kv_len (tile padding) are never visible. Segment ids are handled by callers.
    """
    kpos = k_idx * mask.key_stride + mask.key_end
    vis = k_idx < kv_len
    if mask.bounded_above:
        vis = jnp.logical_and(vis, kpos <= q_pos)
    if mask.window is not None:
        vis = jnp.logical_and(vis, kpos > q_pos - mask.window)
    return vis


def key_block_range(mask: AttentionMask, pos_lo, pos_hi, block_k: int, num_k_blocks: int):
    """Half-open range [lo, hi) of key tiles with any key visible to positions in [pos_lo, pos_hi].

    Works on traced int32 scalars (only non-negative integer divisions, valid on every backend).
    """
    d, e = mask.key_stride, mask.key_end
    if mask.bounded_above:
        a = pos_hi - e  # last visible key index = floor(a / d), none if a < 0
        last_tile = _div(_div(jnp.maximum(a, 0), d), block_k)
        hi = jnp.where(a < 0, 0, jnp.minimum(last_tile + 1, num_k_blocks))
    else:
        hi = jnp.int32(num_k_blocks) + 0 * pos_hi
    if mask.window is not None:
        a = jnp.maximum(pos_lo - mask.window + 1 - e, 0)  # first visible key = ceil(a / d)
        lo = jnp.minimum(_div(_div(a + d - 1, d), block_k), hi)
    else:
        lo = 0 * pos_lo
    return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)


def query_block_range(mask: AttentionMask, k_first, k_last, off_lo, off_hi, block_q: int,
                      num_q_blocks: int):
    """Half-open range [lo, hi) of query tiles that can see any key index in [k_first, k_last].

    Queries are rows t at positions t + off with off in [off_lo, off_hi] (traced int32 scalars).
    """
    d, e = mask.key_stride, mask.key_end
    if mask.bounded_above:
        # p >= kpos(k_first)  <=>  t >= kpos(k_first) - off (smallest with the largest offset)
        t_lo = jnp.maximum(k_first * d + e - off_hi, 0)
        lo = jnp.minimum(_div(t_lo, block_q), num_q_blocks)
    else:
        lo = 0 * k_first
    if mask.window is not None:
        # p < kpos(k_last) + window  <=>  t <= kpos(k_last) + window - 1 - off
        t_hi = k_last * d + e + mask.window - 1 - off_lo
        last_tile = _div(jnp.maximum(t_hi, 0), block_q)
        hi = jnp.where(t_hi < 0, 0, jnp.minimum(last_tile + 1, num_q_blocks))
        hi = jnp.maximum(hi, lo)
    else:
        hi = jnp.int32(num_q_blocks) + 0 * k_first
    return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)


def visible_counts(mask: AttentionMask, q_len: int, kv_len: int, q_offset: int = 0) -> np.ndarray:
    """Number of visible keys for each query row (numpy, exact; ignores segment ids)."""
    p = np.arange(q_len, dtype=np.int64) + int(q_offset)
    d, e = mask.key_stride, mask.key_end
    hi = np.full_like(p, kv_len - 1)
    if mask.bounded_above:
        hi = np.minimum(hi, np.floor_divide(p - e, d))
    lo = np.zeros_like(p)
    if mask.window is not None:
        lo = np.maximum(lo, -np.floor_divide(-(p - mask.window + 1 - e), d))
    return np.maximum(hi - lo + 1, 0)


def full_key_block_range(mask: AttentionMask, pos_lo, pos_hi, block_k: int, kv_len: int, lo, hi):
    """Sub-range [f_lo, f_hi) of the key tiles [lo, hi) in which *every* key is visible to every
    position in [pos_lo, pos_hi] (no padding, no mask edge), so kernels can skip the mask there.
    Segment ids are not considered: with segments, callers treat every tile as masked."""
    d, e = mask.key_stride, mask.key_end
    f_hi = jnp.asarray(kv_len // block_k, jnp.int32)  # tiles without padded keys
    if mask.bounded_above:
        # last key of tile j: ((j+1)*bk - 1)*d + e <= pos_lo  <=>  (j+1)*bk <= floor((pos_lo-e)/d)+1
        a = pos_lo - e
        n_keys = jnp.where(a < 0, 0, _div(jnp.maximum(a, 0), d) + 1)
        f_hi = jnp.minimum(f_hi, _div(n_keys, block_k))
    f_lo = jnp.asarray(lo, jnp.int32)
    if mask.window is not None:
        # first key of tile j: j*bk*d + e > pos_hi - window  <=>  j*bk*d >= pos_hi - window - e + 1
        a = pos_hi - mask.window - e + 1
        first = _div(jnp.maximum(a, 0) + block_k * d - 1, block_k * d)
        f_lo = jnp.maximum(f_lo, first)
    f_lo = jnp.minimum(f_lo, hi)
    f_hi = jnp.maximum(jnp.minimum(f_hi, hi), f_lo)
    return f_lo, f_hi


def full_query_block_range(mask: AttentionMask, k_first, k_last, off, block_q: int, lo, hi,
                           tile_has_padding):
    """Sub-range [f_lo, f_hi) of the query tiles [lo, hi) (rows t at positions t + off) that see
    every key index in [k_first, k_last]. Empty when the key tile holds padding keys."""
    d, e = mask.key_stride, mask.key_end
    f_lo = jnp.asarray(lo, jnp.int32)
    if mask.bounded_above:
        # first row of tile i: i*bq + off >= kpos(k_last)  <=>  i >= ceil((kpos(k_last) - off) / bq)
        a = jnp.maximum(k_last * d + e - off, 0)
        f_lo = jnp.maximum(f_lo, _div(a + block_q - 1, block_q))
    f_hi = jnp.asarray(hi, jnp.int32)
    if mask.window is not None:
        # last row of tile i: i*bq + bq - 1 + off <= kpos(k_first) + window - 1
        a = k_first * d + e + mask.window - block_q - off
        f_hi = jnp.minimum(f_hi, jnp.where(a < 0, 0, _div(jnp.maximum(a, 0), block_q) + 1))
    f_hi = jnp.where(tile_has_padding, f_lo, f_hi)
    f_lo = jnp.minimum(f_lo, hi)
    f_hi = jnp.maximum(jnp.minimum(f_hi, hi), f_lo)
    return f_lo, f_hi
