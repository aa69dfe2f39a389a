"""Depth attention (Attention Residuals, arXiv 2603.15031): the plainest float32 definitions.

Letters: Q queries (pseudo-queries of sublayers), S depth sources (stored slots), B batch,
T sequence, D d_model.

For a query w [D] and sources v_0 .. v_{n-1} [.., D] of one token:

    k_s = v_s / sqrt(mean(v_s ** 2) + eps)          (RMSNorm without a scale: a scale would be
                                                      absorbed into w)
    z_s = w . k_s                                     (no 1/sqrt(D) factor, as in the paper)
    o   = sum_s softmax(z)_s v_s ,  lse = logsumexp(z)

Slots s >= n_valid of the fixed-size buffer are ignored (masked).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_inverse(v: jax.Array, eps: float) -> jax.Array:
    """1 / sqrt(mean(v**2, -1) + eps) in float32 (the RMSNorm factor of each key)."""
    v32 = v.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1) + eps)


def depth_attention_reference(queries: jax.Array, sources: jax.Array, n_valid=None, *,
                              eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """queries [Q,D], sources [S,B,T,D] -> (o [Q,B,T,D] float32, lse [Q,B,T] float32)."""
    q = queries.astype(jnp.float32)
    v = sources.astype(jnp.float32)
    k = v * rms_inverse(v, eps)[..., None]
    z = jnp.einsum("qd,sbtd->qsbt", q, k, precision=jax.lax.Precision.HIGHEST)
    S = sources.shape[0]
    n = S if n_valid is None else n_valid
    valid = (jnp.arange(S) < n)[None, :, None, None]
    z = jnp.where(valid, z, -jnp.inf)
    lse = jax.nn.logsumexp(z, axis=1)
    p = jnp.exp(z - lse[:, None])
    o = jnp.einsum("qsbt,sbtd->qbtd", p, v, precision=jax.lax.Precision.HIGHEST)
    return o, lse


def merge_partial_reference(o: jax.Array, lse: jax.Array, queries: jax.Array, partial: jax.Array,
                            has_partial=True, *, eps: float = 1e-6) -> jax.Array:
    """Phase 2 of Block AttnRes: folds one more source (the current block's partial sum
    partial [B,T,D]) into a phase-1 result (o [Q,B,T,D], lse [Q,B,T]) by an online-softmax merge.
    has_partial False returns o unchanged (the first sublayer of a block)."""
    q = queries.astype(jnp.float32)
    v = partial.astype(jnp.float32)
    z = jnp.einsum("qd,btd->qbt", q, v * rms_inverse(v, eps)[..., None],
                   precision=jax.lax.Precision.HIGHEST)
    m = jnp.maximum(lse, z)
    a, b = jnp.exp(lse - m), jnp.exp(z - m)
    merged = (o.astype(jnp.float32) * a[..., None] + v[None] * b[..., None]) / (a + b)[..., None]
    return jnp.where(has_partial, merged, o.astype(jnp.float32))


def block_depth_attention_reference(queries, blocks, n_finished, partial, has_partial=True, *,
                                    eps: float = 1e-6) -> jax.Array:
    """The naive Block AttnRes formula: one softmax over the finished blocks [0, n_finished) of
    blocks [N,B,T,D] and, when has_partial, the partial sum [B,T,D]. Returns [Q,B,T,D] float32."""
    S = blocks.shape[0]
    stacked = jnp.concatenate([blocks, partial[None].astype(blocks.dtype)], axis=0)
    # Move the partial sum right after the finished blocks so one prefix mask selects them.
    slot = jnp.arange(S + 1)
    order = jnp.where(slot < n_finished, slot, jnp.where(slot == n_finished, S, slot - 1))
    stacked = jnp.take(stacked, order, axis=0)
    n = n_finished + jnp.asarray(has_partial, jnp.int32)
    return depth_attention_reference(queries, stacked, n, eps=eps)[0]
