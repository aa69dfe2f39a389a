"""Reference block-gather (NSA selection-branch) attention: the plainest float32 definition.

Letters: B batch, T query tokens, S key tokens, Hq query heads, Hkv key/value heads, G = Hq // Hkv
query heads per KV head, Dk / Dv head dims, n selected-block slots per (query, KV head).

It builds the full [B, T, Hq, S] visibility mask from the block indices, so it is O(T * S) and only
for small shapes: it is the oracle the tests and the other implementations compare against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visibility_mask(block_indices: jax.Array, *, T: int, S: int, Hq: int, block_size: int,
                    causal: bool = True, q_segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None,
                    q_offset: jax.Array | None = None) -> jax.Array:
    """Boolean [B, T, Hq, S]: may query t of head h see key s.

    Selected = key s lies in a block listed in block_indices[b, t, h // G] (-1 and out-of-range
    entries select nothing; a repeated block is selected once, since this is a set membership test).
    """
    B, _, Hkv, _ = block_indices.shape
    G = Hq // Hkv
    key_block = jnp.arange(S) // block_size                                     # [S]
    sel = jnp.any(block_indices[..., :, None] == key_block[None, None, None, None, :], axis=-2)
    mask = jnp.repeat(sel, G, axis=2)                                           # [B, T, Hq, S]
    if causal:
        off = jnp.zeros((B,), jnp.int32) if q_offset is None else q_offset.astype(jnp.int32)
        q_pos = jnp.arange(T)[None, :] + off[:, None]                           # [B, T]
        mask &= (jnp.arange(S)[None, None, :] <= q_pos[:, :, None])[:, :, None, :]
    if q_segment_ids is not None:
        same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]          # [B, T, S]
        mask &= same[:, :, None, :]
    return mask


def sparse_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                               block_indices: jax.Array, *, block_size: int,
                               scale: float | None = None, causal: bool = True,
                               segment_ids=None, q_offset: jax.Array | None = None
                               ) -> tuple[jax.Array, jax.Array]:
    """Returns (o [B,T,Hq,Dv] in q's dtype, lse [B,T,Hq] float32); see api.sparse_attention.

    A query with no visible key gets o = 0 and lse = -inf (and zero gradients, no NaN).
    """
    B, T, Hq, Dk = q.shape
    S = k.shape[1]
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = Dk ** -0.5 if scale is None else scale
    if segment_ids is None:
        q_seg = kv_seg = None
    elif isinstance(segment_ids, (tuple, list)):
        q_seg, kv_seg = segment_ids
    else:
        q_seg = kv_seg = segment_ids
    mask = visibility_mask(block_indices, T=T, S=S, Hq=Hq, block_size=block_size, causal=causal,
                           q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_offset=q_offset)
    qf = q.astype(jnp.float32)
    kf = jnp.repeat(k.astype(jnp.float32), G, axis=2)                           # [B, S, Hq, Dk]
    vf = jnp.repeat(v.astype(jnp.float32), G, axis=2)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bthd,bshd->bths", qf, kf, precision=hi) * scale
    m = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bths,bshd->bthd", p / jnp.where(l > 0, l, 1.0), vf, precision=hi)
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)),
                    -jnp.inf)
    return o.astype(q.dtype), lse
