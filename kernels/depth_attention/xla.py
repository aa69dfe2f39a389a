"""Depth attention in plain JAX: runs on every backend (the fallback of the Pallas kernels).

Letters: Q queries, S sources (buffer slots), N tokens (B*T flattened), D d_model.

The keys k_s = r_s v_s (r_s the RMSNorm factor) are never materialised: z = r_s (w . v_s), and the
backward folds the RMSNorm derivative into dV:

    dz_s = p_s (dO . v_s - delta),  delta = dO . o - dlse
    dv_s = sum_q [ p_qs dO_q + r_s dz_qs w_q - (r_s^2 / D) dz_qs z_qs v_s ]
    dw_q = sum_{s,n} dz_qs r_s v_s
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _scores(queries, sources, n_valid, eps):
    v = sources
    v32 = v.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1) + eps)                     # [S,N]
    z = jnp.einsum("qd,snd->qsn", queries.astype(jnp.float32), v32, precision=_HI) * r[None]
    valid = (jnp.arange(v.shape[0]) < n_valid)[None, :, None]
    return jnp.where(valid, z, -jnp.inf), r, valid


def forward(queries: jax.Array, sources: jax.Array, n_valid: jax.Array, *,
            eps: float) -> tuple[jax.Array, jax.Array]:
    """queries [Q,D], sources [S,N,D], n_valid int32 [] -> (o [Q,N,D] float32, lse [Q,N])."""
    z, _, _ = _scores(queries, sources, n_valid, eps)
    lse = jax.nn.logsumexp(z, axis=1)                                         # [Q,N]
    p = jnp.exp(z - lse[:, None])
    o = jnp.einsum("qsn,snd->qnd", p, sources.astype(jnp.float32), precision=_HI)
    return o, lse


def backward(queries, sources, n_valid, o, lse, do, delta, *, eps: float):
    """Gradients (dq [Q,D] float32, dsources [S,N,D] sources.dtype) given dO [Q,N,D] and
    delta = sum(dO * o, -1) - dlse [Q,N]."""
    del o
    D = sources.shape[-1]
    v32 = sources.astype(jnp.float32)
    z, r, valid = _scores(queries, sources, n_valid, eps)
    p = jnp.where(valid, jnp.exp(z - lse[:, None]), 0.0)                       # [Q,S,N]
    do32 = do.astype(jnp.float32)
    dpv = jnp.einsum("qnd,snd->qsn", do32, v32, precision=_HI)
    dz = p * (dpv - delta[:, None])
    zs = jnp.where(valid, z, 0.0)
    dv = (jnp.einsum("qsn,qnd->snd", p, do32, precision=_HI)
          + r[..., None] * jnp.einsum("qsn,qd->snd", dz, queries.astype(jnp.float32),
                                      precision=_HI)
          - (r * r / D * jnp.sum(dz * zs, axis=0))[..., None] * v32)
    dq = jnp.einsum("qsn,snd->qd", dz * r[None], v32, precision=_HI)
    return dq, dv.astype(sources.dtype)
