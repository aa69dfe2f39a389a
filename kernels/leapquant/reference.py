"""LeapQuant decode, the plainest definition (float32, a Python loop over tokens, the dense state
materialised every step): the oracle xla.py's record form is compared against.

Letters: B batch, T tokens, H query/key heads, HV value heads (HV = G * H), K key head dim,
V value head dim, P window.

    S = Deq(Enc(S_init))                       the first window's boundary state
    for t in 0..T-1:
        S   = Diag(exp(g_t)) S                 decay first (kernels/gated_delta/reference.py)
        u_t = v_t - S^T k_t
        S   = S + beta_t k_t u_t^T
        o_t = scale S^T q_t
        every P-th step of a window: S = Deq(Enc(S))    (re-quantize at the window end)

Enc / Deq are quantize.encode_boundary / decode_boundary (quantized residual, smoothing,
compensators). Per-step quantization is P = 1. The loop holds no records, so it ignores
spec.record_dtype: bfloat16 records (a bf16 rounding of each step's update in the record form) are
checked against the plain recurrence at a bf16 tolerance instead (tests/kernels/test_leapquant.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .quantize import LeapQuantSpec, decode_boundary, encode_boundary

_HI = jax.lax.Precision.HIGHEST


def leapquant_decode_reference(spec: LeapQuantSpec, initial_state: jax.Array, q: jax.Array,
                               k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                               scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Args: initial_state [B,HV,K,V] (dense, encoded before the first step); q, k [B,T,H,K];
    v [B,T,HV,V]; g [B,T,HV] (GDN) or [B,T,HV,K] (KDA) log-decays; beta [B,T,HV]; scale default
    K^-1/2. Returns (o [B,T,HV,V] float32, the dense effective state after the last step
    [B,HV,K,V] float32, i.e. what xla.materialize gives)."""
    f32 = jnp.float32
    T, H, K = q.shape[1:]
    G = v.shape[2] // H
    scale = K ** -0.5 if scale is None else scale
    q = jnp.repeat(q.astype(f32), G, axis=2)
    k = jnp.repeat(k.astype(f32), G, axis=2)
    v, g, beta = v.astype(f32), g.astype(f32), beta.astype(f32)

    @jax.jit
    def requant(S):  # jitted only because eager power iteration is slow; same arithmetic
        return decode_boundary(encode_boundary(spec, S))

    S = requant(initial_state.astype(f32))
    outs = []
    for t in range(T):
        a = jnp.exp(g[:, t])
        S = S * (a[..., :, None] if a.ndim == 3 else a[..., None, None])
        u = v[:, t] - jnp.einsum("bhkv,bhk->bhv", S, k[:, t], precision=_HI)
        S = S + (beta[:, t, :, None] * k[:, t])[..., :, None] * u[..., None, :]
        outs.append(scale * jnp.einsum("bhkv,bhk->bhv", S, q[:, t], precision=_HI))
        if (t + 1) % spec.window == 0:
            S = requant(S)
    return jnp.stack(outs, axis=1), S
