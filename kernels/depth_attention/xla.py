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

# Layout notes (measured on the CPU): every pass here reads the [S,N,D] buffer with D minor and
# never transposes it. Einsums that keep N as a batch dimension ("qsn,snd->qnd") make XLA transpose
# the whole buffer first (S=9, N=4096, D=256: forward 60 -> 7.5 ms, backward 90 -> 52 ms without
# them). The per-slot passes (the weighted sum over depth, the backward's dO . v_s) loop over the
# valid slots one [N,D] slot at a time: XLA:CPU is ~10x slower on a multiply-reduce with an
# operand broadcast over the slots, and copies static slot slices it hands to one library fusion.
# At S=9, N=D=1024 inside a jitted forward + backward through api.py: 56 -> 29 ms. The contractions
# over (S,N) are plain [S*N, D] matrix-vector products.


def _scores(q32, v32, n_valid, eps):
    S, N, D = v32.shape
    r = jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1) + eps)                      # [S,N]
    zq = jnp.dot(v32.reshape(S * N, D), q32.T, precision=_HI)                  # [S*N,Q]
    z = zq.T.reshape(-1, S, N) * r[None]                                       # [Q,S,N]
    valid = (jnp.arange(S) < n_valid)[None, :, None]
    return jnp.where(valid, z, -jnp.inf), r, valid


def _depth_sum(w_sn: jax.Array, v32: jax.Array, n_valid: jax.Array) -> jax.Array:
    """sum_s w[s,n] v[s,n,:] over the valid slots s < n_valid (w is zero beyond them) for w [S,N],
    v [S,N,D], one slot per loop step (no transpose; masked slots are not read). Unrolled
    over static slices, XLA:CPU may hand the slots to one library fusion as separate operands and
    copy each of them first (measured inside a training step's backward: 2x the kernel's time)."""
    def body(s, acc):
        vs = jax.lax.dynamic_index_in_dim(v32, s, 0, keepdims=False)
        ws = jax.lax.dynamic_index_in_dim(w_sn, s, 0, keepdims=False)
        return acc + ws[:, None] * vs

    return jax.lax.fori_loop(0, n_valid, body, jnp.zeros(v32.shape[1:], jnp.float32))


def _slot_dots(v32: jax.Array, x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """[S,N] dots v[s,n,:] . x[n,:] for the valid slots s < n_valid (zero beyond), one slot per
    loop step. XLA:CPU runs a multiply-reduce whose
    operand is broadcast over the slots (or S unrolled ones, which it fuses into one) ~10x slower
    than S separate [N,D] reductions: 30 / 16 ms against 2.8 ms at S=9, N=D=1024."""
    def body(s, acc):
        vs = jax.lax.dynamic_index_in_dim(v32, s, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(acc, jnp.sum(vs * x, axis=-1), s, 0)

    return jax.lax.fori_loop(0, n_valid, body, jnp.zeros(v32.shape[:2], jnp.float32))


def forward(queries: jax.Array, sources: jax.Array, n_valid: jax.Array, *,
            eps: float) -> tuple[jax.Array, jax.Array]:
    """queries [Q,D], sources [S,N,D], n_valid int32 [] -> (o [Q,N,D] float32, lse [Q,N])."""
    v32, q32 = sources.astype(jnp.float32), queries.astype(jnp.float32)
    z, _, _ = _scores(q32, v32, n_valid, eps)
    lse = jax.nn.logsumexp(z, axis=1)                                         # [Q,N]
    p = jnp.exp(z - lse[:, None])
    o = jnp.stack([_depth_sum(p[i], v32, n_valid) for i in range(q32.shape[0])])
    return o, lse


def backward(queries, sources, n_valid, o, lse, do, delta, *, eps: float):
    """Gradients (dq [Q,D] float32, dsources [S,N,D] sources.dtype) given dO [Q,N,D] and
    delta = sum(dO * o, -1) - dlse [Q,N]."""
    del o
    S, N, D = sources.shape
    v32, q32 = sources.astype(jnp.float32), queries.astype(jnp.float32)
    z, r, valid = _scores(q32, v32, n_valid, eps)
    p = jnp.where(valid, jnp.exp(z - lse[:, None]), 0.0)                       # [Q,S,N]
    do32 = do.astype(jnp.float32)
    dpv = jnp.stack([_slot_dots(v32, do32[i], n_valid)
                     for i in range(q32.shape[0])])                            # [Q,S,N]
    dz = p * (dpv - delta[:, None])
    zs = jnp.where(valid, z, 0.0)
    c = r * r / D * jnp.sum(dz * zs, axis=0)                                   # [S,N]
    rdz = r[None] * dz
    dv = -c[..., None] * v32
    for i in range(q32.shape[0]):
        dv = dv + p[i][..., None] * do32[i][None] + rdz[i][..., None] * q32[i]
    dq = jnp.dot(rdz.reshape(-1, S * N), v32.reshape(S * N, D), precision=_HI)
    return dq, dv.astype(sources.dtype)
