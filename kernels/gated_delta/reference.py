"""Gated delta rule (Gated DeltaNet, GDN) and Kimi Delta Attention (KDA): the step-by-step
recurrence in float32, the oracle the tests and the other implementations compare against.

Letters: B batch, T sequence, H query/key heads, HV value heads (HV = G * H; query/key head h
serves value heads [h*G, (h+1)*G)), K key head dim, V value head dim.

For one value head, with the state S [K, V] (S_{-1} = the initial state, or 0):

    S'  = Diag(a_t) S_{t-1}                        decay first (fla-org's convention) ...
    S_t = S' + b_t k_t (v_t - S'^T k_t)^T          ... then the delta-rule update reads S'
        = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T
    o_t = scale * S_t^T q_t

a_t = exp(g_t): GDN has one log-decay per head and step (g [B,T,HV], Diag(a_t) = a_t I); KDA one
per key channel (g [B,T,HV,K]). b_t = beta_t [B,T,HV]. For GDN the order of decay and delta update
does not matter (a scalar commutes); for KDA it does, and the decay comes first. g is meant to be
<= 0 (a decay in (0, 1]); the chunked implementation relies on it for its stability (xla.py).

Packed documents (segment_ids [B,T], integers): a document is a maximal run of equal ids, so ids
(1, 1, 2, 2, 1) are three documents. At the first position of every document but the row's first
one, the state is reset to zero before the step; the initial state is the state before position 0
and so belongs to the row's first document (a leading padding run carries it, and then no document
sees it). Id 0 marks padding: there beta and g count as 0 (the state passes unchanged, and no
document ever sees it, since entering or leaving padding is a boundary) and the output is 0. The
final state is the state after position T-1, i.e. that of the row's last document (zero if the row
ends in padding that follows a document).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def document_index(segment_ids: jax.Array) -> jax.Array:
    """[B,T] int32: the index of each position's document within its row (0, 1, ...), increasing
    by one at every boundary (a change of segment id)."""
    seg = segment_ids.astype(jnp.int32)
    boundary = jnp.concatenate([jnp.zeros_like(seg[:, :1]), (seg[:, 1:] != seg[:, :-1])], axis=1)
    return jnp.cumsum(boundary.astype(jnp.int32), axis=1)


def gated_delta_rule_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                               beta: jax.Array, *, initial_state: jax.Array | None = None,
                               segment_ids: jax.Array | None = None, scale: float | None = None
                               ) -> tuple[jax.Array, jax.Array]:
    """The recurrence above, one step at a time (lax.scan over T).

    Args:
      q, k: [B,T,H,K]; v: [B,T,HV,V]; g: [B,T,HV] (GDN) or [B,T,HV,K] (KDA) log-decays;
      beta: [B,T,HV]; initial_state: [B,HV,K,V] or None (zeros); segment_ids: [B,T] or None;
      scale: output scale, default K ** -0.5. Any float dtypes (used in float32).

    Returns:
      (o [B,T,HV,V] float32, final state [B,HV,K,V] float32).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    f32 = jnp.float32
    q = jnp.repeat(q.astype(f32), G, axis=2)
    k = jnp.repeat(k.astype(f32), G, axis=2)
    v, g, beta = v.astype(f32), g.astype(f32), beta.astype(f32)
    kda = g.ndim == 4
    if segment_ids is None:
        reset = jnp.zeros((B, T), bool)
        pad = jnp.zeros((B, T), bool)
    else:
        doc = document_index(segment_ids)
        reset = jnp.concatenate([jnp.zeros_like(doc[:, :1], bool), doc[:, 1:] != doc[:, :-1]], 1)
        pad = segment_ids == 0
    g = jnp.where(pad[:, :, None, None] if kda else pad[:, :, None], 0.0, g)
    beta = jnp.where(pad[:, :, None], 0.0, beta)
    S0 = (jnp.zeros((B, HV, K, V), f32) if initial_state is None
          else initial_state.astype(f32))

    def step(S, x):
        q_t, k_t, v_t, g_t, b_t, reset_t, pad_t = x        # [B,HV,K] ... [B,HV], [B]
        S = jnp.where(reset_t[:, None, None, None], 0.0, S)
        a_t = jnp.exp(g_t)
        S = S * (a_t[..., None] if kda else a_t[..., None, None])
        u = b_t[..., None] * (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=_HI))
        S = S + k_t[..., :, None] * u[..., None, :]
        o = scale * jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=_HI)
        return S, jnp.where(pad_t[:, None, None], 0.0, o)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset, pad))
    S, o = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 1), S
