"""Plain float32 oracle for flash_attention: builds the full [T, S] mask (small shapes only).

Letters: B batch, T queries, S keys, Hq query heads, Hkv KV heads (Hq = G * Hkv), Dk / Dv head dims.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aiinfra_jax.kernels.flash_attention.mask import AttentionMask, visible


def split_segment_ids(segment_ids, q_len: int, kv_len: int):
    """Returns (q_segment_ids [B,T], kv_segment_ids [B,S]) or (None, None)."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        return segment_ids[0], segment_ids[1]
    return segment_ids, segment_ids


def mask_bts(mask: AttentionMask, batch: int, q_len: int, kv_len: int, q_offset=None,
             segment_ids=None):
    """The full boolean visibility matrix [B, T, S]."""
    off = jnp.zeros((batch,), jnp.int32) if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    q_pos = jnp.arange(q_len, dtype=jnp.int32)[None, :, None] + off[:, None, None]
    k_idx = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
    vis = jnp.broadcast_to(visible(mask, q_pos, k_idx, kv_len), (batch, q_len, kv_len))
    q_seg, kv_seg = split_segment_ids(segment_ids, q_len, kv_len)
    if q_seg is not None:
        vis = jnp.logical_and(vis, q_seg[:, :, None] == kv_seg[:, None, :])
    return vis


def flash_attention_reference(q, k, v, *, mask: AttentionMask = AttentionMask(),
                              segment_ids=None, q_offset=None, scale: float | None = None):
    """Returns (o [B,T,Hq,Dv] float32, lse [B,T,Hq] float32); rows with no visible key give 0, -inf.

    Differentiable without NaNs (fully masked rows get zero gradients).
    """
    b, t, hq, dk = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = dk ** -0.5 if scale is None else scale
    qf = q.astype(jnp.float32).reshape(b, t, hkv, g, dk)
    logits = jnp.einsum("bthgd,bshd->bhgts", qf, k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * scale
    vis = mask_bts(mask, b, t, s, q_offset, segment_ids)[:, None, None]
    m = jnp.max(jnp.where(vis, logits, -jnp.inf), axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.where(vis, jnp.exp(jnp.where(vis, logits, m) - m), 0.0)
    l = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(l > 0, l, 1.0)
    o = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(l > 0, jnp.log(jnp.where(l > 0, l, 1.0)) + m, -jnp.inf)[..., 0]
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, hq)
    return o.reshape(b, t, hq, -1), lse
