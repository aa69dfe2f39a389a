"""Chunkwise gated delta rule (GDN) and Kimi Delta Attention (KDA) in plain JAX: the WY / UT
transform inside chunks of C positions, a lax.scan over the chunks carrying the state.

Letters: B batch, T sequence, H query/key heads, HV value heads (G = HV // H), K / V head dims,
C chunk length, N = ceil(T / C) chunks, c sub-chunk length (KDA), n = C // c sub-chunks.
The recurrence and the segment conventions are those of reference.py (decay first, then the delta
update).

Within one chunk (positions t = 0 .. C-1, S0 the state before it), with gam_t = sum_{s<=t} g_s
(per key channel for KDA) and D(t, s) = Diag(exp(gam_t - gam_s)):

    u_t = b_t (v_t - S'_t^T k_t)              (the per-step write: S_t = S'_t + k_t u_t^T)
        = b_t v_t - b_t S0^T (exp(gam_t) k_t) - b_t sum_{s<t} (k_t^T D(t,s) k_s) u_s
    => (I + L) U = diag(b) V - diag(b) (K exp(gam)) S0,   L_ts = b_t k_t^T D(t,s) k_s  (s < t)
    => U = U1 - W S0 with [U1 | W] = (I + L)^{-1} diag(b) [V | K exp(gam)]
    o_t = scale * (S0^T (exp(gam_t) q_t) + sum_{s<=t} (q_t^T D(t,s) k_s) u_s)
    S_C = Diag(exp(gam_{C-1})) S0 + sum_s D(C-1, s) k_s u_s^T

Everything but the three state products is independent of S0 and is computed for all chunks at
once (prepare); the scan (state_pass) does U = U1 - W S, O = Qg S + M U, S <- decay * S + Kd^T U
per chunk; it is the part the Pallas kernels replace. Buffers are linear in T, never [T, T]: the
largest are [B, HV, N, C, C] and, for KDA, the within-sub-chunk product [B, HV, N, n, c, c, K]
(C * c * K per chunk, 8x the size of q at c = 8: exp(gam_t - gam_s) y_s, written once and
reduced against k and q; autodiff keeps it for the backward).

Stability: with g <= 0, gam is non-increasing, so every exponent used is <= 0. For GDN the decay
matrix is exp(gam_t - gam_s), masked to s <= t before the exponential. For KDA the per-channel
product sum_k x_t[k] y_s[k] exp(gam_t[k] - gam_s[k]) cannot be split into exp(gam_t) x_t times
exp(-gam_s) y_s without overflow, so the chunk is cut into sub-chunks of c positions: pairs within
one sub-chunk are summed exactly over a [c, c, K] tensor; for row sub-chunk i against all earlier
columns, the reference point r = i*c - 1 (the last position before sub-chunk i) splits the
exponent into (gam_t - gam_r) <= 0 and (gam_r - gam_s) <= 0, so both factors lie in (0, 1] and
the product is one matmul.

Packed documents: positions get a document index (reference.document_index). Within a chunk the
pair terms (L and the M of the output) are masked to pairs of the same document; S0 reaches only
the positions of the document that was running before the chunk ("first" mask), and the chunk's
final state collects only its last document's writes ("last" mask), with S0's decayed copy kept
only if no boundary fell inside the chunk. This equals resetting the state at every boundary.
T is padded up to N*C with g = 0, beta = 0, q = k = v = 0 (no decay, no write) and the document of
the last position, which leaves the outputs and the final state unchanged.

(I + L)^{-1} is unit_lower_inverse: block forward substitution by recursive doubling, then one
matmul with the right-hand sides (LAPACK's batched trsm was ~10x slower on the CPU).

Gradients: plain JAX autodiff through everything here (the scan over chunks keeps one
[B, HV, K, V] state per chunk for its backward), except the closed-form VJP of
unit_lower_inverse; no hand-written backward otherwise. The public function (api.py)
differentiates prepare() and finish() this way and wraps state_pass in a custom VJP whose
backward is this scan's VJP, recomputed, for implementation "xla"; the Pallas implementations
have their own backward kernels (pallas_gpu.py, pallas_tpu.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .._util import pad_axis
from .reference import document_index

_HI = jax.lax.Precision.HIGHEST
# KDA sub-chunk length c (gcd with the chunk length, a multiple of 8: so c = 8). 8 rather than 16:
# at T=2K, 16 heads of 128, forward+backward with gradients for q, k, v and g 971 against 2156 ms
# and 1.1 against 1.8 GiB of temporaries, forward 431 against 406 ms (quiet 2-core CPU,
# 2026-12-03, one scratch process timing both): the [c, c, K] products and their gate gradients
# halve, the extra inter-sub-chunk matmuls are cheap. With q, k, v gradients only, the time did
# not move at 2K (eval/BENCHMARKS.md, issue 22).
SUB_CHUNK = 8


def _mm(spec, *xs):
    return jnp.einsum(spec, *xs, precision=_HI, preferred_element_type=jnp.float32)


def _chunked(x: jax.Array, C: int) -> jax.Array:
    """[B, N*C, HV, ...] -> [B, HV, N, C, ...]."""
    B, Tp, HV = x.shape[:3]
    return jnp.moveaxis(x.reshape((B, Tp // C, C, HV) + x.shape[3:]), 3, 1)


def _masked_exp(diff: jax.Array, mask: jax.Array) -> jax.Array:
    """exp(diff) where mask, else 0 (the exponential never sees a masked-out entry)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def _pairs_scalar(xs, y, gam):
    """For each x in xs, [..., C, C]: (x_t . y_s) exp(gam_t - gam_s) for s <= t, 0 above the
    diagonal. x, y [..., C, K]; gam [..., C] (one decay per position: GDN); equal leading dims.
    The decay matrix is built once for all xs, and no operand is stacked or broadcast (a stacked
    [2, ...] operand cost XLA:CPU a concatenate and a broadcast copy of y, each as long as the
    matmul, and their transposes in the backward)."""
    C, K = y.shape[-2:]
    shape = y.shape[:-2]
    # Leading dims flattened into one, as in _pairs_channel (an XLA:CPU crash with unit dims).
    y = y.reshape(-1, C, K)
    gam = gam.reshape(-1, C)
    tril = jnp.tril(jnp.ones((C, C), bool))
    decay = _masked_exp(gam[:, :, None] - gam[:, None, :], tril)
    return tuple((_mm("ltk,lsk->lts", x.reshape(-1, C, K), y) * decay).reshape(shape + (C, C))
                 for x in xs)


def _sub_chunk_exp(gb):
    """[L, n, c, c, K]: exp(gam_t - gam_s) for s <= t within each sub-chunk, 0 above."""
    c = gb.shape[-2]
    tril = jnp.tril(jnp.ones((c, c), bool))[:, :, None]
    return _masked_exp(gb[..., :, None, :] - gb[..., None, :, :], tril)


@jax.custom_vjp
def _sub_chunk_pairs(xs, yb, gb):
    """For each x in xs, [L, n, c, c]: sum_k x_t[k] y_s[k] exp(gam_t[k] - gam_s[k]) for s <= t
    within each sub-chunk, exactly, over a [L, n, c, c, K] product (c times the size of q).
    x, yb, gb [L, n, c, K]. exp(gam_t - gam_s) y_s is written once and reduced against every x:
    XLA:CPU fused neither an x-stacked product (its reduction ran 6x slower, measured at T=2K, 16
    heads of 128) nor a per-x product (it wrote the exponentials once per x instead). The VJP is
    written out below, recomputing the exponentials, because autodiff kept and re-read several
    [L, n, c, c, K] tensors (KDA's backward took 2.2x GDN's, and 12 GiB of temporaries at 16K)."""
    ye = yb[..., None, :, :] * _sub_chunk_exp(gb)
    return tuple(jnp.sum(x[..., :, None, :] * ye, axis=-1) for x in xs)


def _sub_chunk_pairs_fwd(xs, yb, gb):
    return _sub_chunk_pairs(xs, yb, gb), (xs, yb, gb)


def _sub_chunk_pairs_bwd(res, dds):
    """With e = exp(gam_t - gam_s) (s <= t) and each output D = sum_k x_t y_s e:
    dx_t = sum_s dD_ts e_ts y_s;  dy_s = sum_t e_ts sum_x dD_ts x_t;
    dgam = sum_x x dx - y dy (d e_ts / d gam_t = e_ts = -d e_ts / d gam_s), all per channel k."""
    xs, yb, gb = res
    e = _sub_chunk_exp(gb)
    ye = yb[..., None, :, :] * e
    dxs = tuple(jnp.sum(ye * dd[..., None], axis=-2) for dd in dds)
    px = sum(dd[..., None] * x[..., :, None, :] for dd, x in zip(dds, xs))
    dy = jnp.sum(px * e, axis=-3)
    dg = sum(x * dx for x, dx in zip(xs, dxs)) - yb * dy
    return dxs, dy, dg


_sub_chunk_pairs.defvjp(_sub_chunk_pairs_fwd, _sub_chunk_pairs_bwd)


def _pairs_channel(xs, y, gam, c: int):
    """For each x in xs, [..., C, C]: sum_k x_t[k] y_s[k] exp(gam_t[k] - gam_s[k]) for s <= t,
    0 above the diagonal. x, y, gam [..., C, K] (per-channel decay: KDA), equal leading dims,
    evaluated stably by sub-chunks of c (see the module docstring): exactly over [c, c, K] within
    each sub-chunk, and for row sub-chunk i against every earlier column s < i*c through the
    reference point r_i = i*c - 1. The exponentials of y's side are computed once for all xs."""
    C, K = y.shape[-2:]
    n = C // c
    shape = y.shape[:-2]
    # The leading dims are flattened into one: XLA:CPU (jaxlib 0.10.2) segfaulted running the
    # backward of this function for leading dims (2, 1, 6) (a unit dim in the middle, e.g.
    # B = 1), and not for (12,).
    y, gam = (a.reshape(-1, C, K) for a in (y, gam))
    xs = tuple(x.reshape(-1, C, K) for x in xs)
    lead = y.shape[:1]
    yb, gb = (a.reshape(lead + (n, c, K)) for a in (y, gam))
    # Within sub-chunks, exactly: [L, n, c, c] from a [L, n, c, c, K] product.
    eye = jnp.eye(n, dtype=y.dtype)[:, None, :, None]
    diags = _sub_chunk_pairs(tuple(x.reshape(lead + (n, c, K)) for x in xs), yb, gb)
    outs = [(d[..., :, :, None, :] * eye).reshape(lead + (C, C)) for d in diags]  # block diagonal
    if n == 1:
        return tuple(o.reshape(shape + (C, C)) for o in outs)
    # Row sub-chunk i against columns s < i*c: exp(gam_t - gam_r) * exp(gam_r - gam_s), r = i*c-1.
    rows = [[o[..., :c, :]] for o in outs]
    for i in range(1, n):
        g_r = gam[..., i * c - 1:i * c, :]                                     # [..., 1, K]
        yf = y[..., :i * c, :] * jnp.exp(g_r - gam[..., :i * c, :])
        e_row = jnp.exp(gb[..., i, :, :] - g_r)
        for x, o, r in zip(xs, outs, rows):
            xf = x.reshape(lead + (n, c, K))[..., i, :, :] * e_row
            off = _mm("...tk,...sk->...ts", xf, yf)                             # [..., c, i*c]
            r.append(o[..., i * c:(i + 1) * c, :] + jnp.pad(
                off, [(0, 0)] * (off.ndim - 1) + [(0, C - i * c)]))
    return tuple(jnp.concatenate(r, axis=-2).reshape(shape + (C, C)) for r in rows)


@jax.custom_vjp
def unit_lower_inverse(L: jax.Array) -> jax.Array:
    """(I + L)^{-1} for strictly lower-triangular L [..., C, C], by recursive doubling: the
    inverses of the diagonal blocks of size s give those of size 2s through
    [[A, 0], [B, D]]^{-1} = [[A^-1, 0], [-D^-1 B A^-1, D^-1]] (block forward substitution, all
    blocks of a level at once: log2(C) levels of batched matmuls, no loop over rows; on the CPU
    ~10x faster than LAPACK's batched trsm here). C is padded to a power of two with zeros (an
    identity block that does not touch the rest). Its VJP is the closed form
    dL = -tril(T^T dT T^T, -1) (differentiating the levels compiled slowly)."""
    C = L.shape[-1]
    P = 1 << (C - 1).bit_length()
    lead = L.shape[:-2]
    if P != C:
        L = jnp.pad(L, [(0, 0)] * len(lead) + [(0, P - C), (0, P - C)])
    inv = jnp.ones(lead + (P, 1, 1), L.dtype)          # inverses of the 1x1 diagonal blocks
    s = 1
    while s < P:
        # Block (2j+1, 2j) of L for every pair j: [..., P/(2s), s, s].
        blocks = L.reshape(lead + (P // s, s, P // s, s))
        low = jnp.moveaxis(jnp.diagonal(blocks[..., 1::2, :, 0::2, :], axis1=-4, axis2=-2), -1, -3)
        a, d = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        c = -_mm("...ab,...bc->...ac", d, _mm("...ab,...bc->...ac", low, a))
        top = jnp.concatenate([a, jnp.zeros_like(a)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([c, d], axis=-1)], axis=-2)
        s *= 2
    return inv.reshape(lead + (P, P))[..., :C, :C]


def _unit_lower_inverse_fwd(L):
    T = unit_lower_inverse(L)
    return T, T


def _unit_lower_inverse_bwd(T, dT):
    C = T.shape[-1]
    dL = -_mm("...ts,...su,...uv->...tv", jnp.swapaxes(T, -1, -2), dT, jnp.swapaxes(T, -1, -2))
    return (jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), dL, 0.0),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def chunk_length(T: int, chunk_size: int) -> int:
    """The chunk length used for a sequence of T: chunk_size, or T rounded up to a multiple of 8
    when that is shorter."""
    return min(chunk_size, -(-T // 8) * 8)


class Prepared(NamedTuple):
    """The chunked operands of the state pass (everything that does not depend on the state),
    all float32, plus what finish() needs.

    w [B,HV,N,C,K], u1 [B,HV,N,C,V]: the UT transform's two halves (u = u1 - w S per chunk);
    qg [B,HV,N,C,K]: scale * exp(gam) q, zero outside the chunk's first document;
    m [B,HV,N,C,C]: the intra-chunk output weights (scale * q_t^T D(t,s) k_s, s <= t, same doc);
    kdt [B,HV,N,K,C]: (exp(gam_end - gam) k)^T, zero outside the chunk's last document;
    decay [B,HV,N,K,1]: exp(gam_end) per key channel (GDN: broadcast over K), zero when a
      boundary falls inside the chunk; pad [B,T] bool or None: the padding positions (id 0).
    """

    w: jax.Array
    u1: jax.Array
    qg: jax.Array
    m: jax.Array
    kdt: jax.Array
    decay: jax.Array
    pad: jax.Array | None


def prepare(q, k, v, g, beta, segment_ids, *, scale: float, chunk_size: int) -> Prepared:
    """The state-independent part of the chunkwise algorithm, for all chunks at once.
    q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV] (GDN) or [B,T,HV,K] (KDA); beta [B,T,HV];
    segment_ids [B,T] int or None."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    kda = g.ndim == 4
    f32 = jnp.float32
    C = chunk_length(T, chunk_size)
    N = -(-T // C)
    Tp = N * C
    c = math.gcd(C, SUB_CHUNK)

    q = jnp.repeat(q.astype(f32), HV // H, axis=2)
    k = jnp.repeat(k.astype(f32), HV // H, axis=2)
    v, g, beta = v.astype(f32), g.astype(f32), beta.astype(f32)
    if segment_ids is None:
        doc = jnp.zeros((B, T), jnp.int32)
        pad = None
    else:
        doc = document_index(segment_ids)
        pad = segment_ids == 0
        g = jnp.where(pad[:, :, None, None] if kda else pad[:, :, None], 0.0, g)
        beta = jnp.where(pad[:, :, None], 0.0, beta)
    q, k, v, g, beta = (pad_axis(x, 1, Tp) for x in (q, k, v, g, beta))
    doc = jnp.pad(doc, ((0, 0), (0, Tp - T)), mode="edge")

    qc, kc, vc, gc, bc = (_chunked(x, C) for x in (q, k, v, g, beta))   # [B,HV,N,C,...]
    doc = doc.reshape(B, 1, N, C)                                       # broadcasts over HV
    gam = jnp.cumsum(gc, axis=3)                                        # [B,HV,N,C(,K)]

    same = doc[..., :, None] == doc[..., None, :]                       # [B,1,N,C,C]
    strict = same & jnp.tril(jnp.ones((C, C), bool), -1)
    causal = same & jnp.tril(jnp.ones((C, C), bool))
    doc_prev = jnp.concatenate([doc[:, :, :1, 0], doc[:, :, :-1, -1]], axis=2)   # [B,1,N]
    first = (doc == doc_prev[..., None]).astype(f32)                    # [B,1,N,C]
    last = (doc == doc[..., -1:]).astype(f32)

    if kda:
        A, M = _pairs_channel((kc, qc), kc, gam, c)
        e_gam = jnp.exp(gam)                                            # [B,HV,N,C,K]
        e_end = jnp.exp(gam[..., -1:, :] - gam)
        decay = jnp.exp(gam[..., -1, :])                                # [B,HV,N,K]
    else:
        A, M = _pairs_scalar((kc, qc), kc, gam)
        e_gam = jnp.exp(gam)[..., None]                                 # [B,HV,N,C,1]
        e_end = jnp.exp(gam[..., -1:] - gam)[..., None]
        decay = jnp.broadcast_to(jnp.exp(gam[..., -1:]), (B, HV, N, K))
    decay = (decay * first[..., -1:])[..., None]                        # [B,HV,N,K,1]
    L = jnp.where(strict, A, 0.0) * bc[..., None]
    M = jnp.where(causal, M, 0.0) * scale
    kg = kc * e_gam * first[..., None]
    qg = qc * e_gam * (first[..., None] * scale)
    kd = kc * e_end * last[..., None]

    # Two products with the inverse rather than one with [V | K exp(gam)] concatenated: XLA:CPU
    # spent as long on that concatenate as on the product.
    inv = unit_lower_inverse(L)
    u1 = _mm("...ts,...sd->...td", inv, vc * bc[..., None])
    w = _mm("...ts,...sd->...td", inv, kg * bc[..., None])
    return Prepared(w=w, u1=u1, qg=qg, m=M, kdt=jnp.swapaxes(kd, -1, -2), decay=decay, pad=pad)


def state_pass(w, u1, qg, m, kdt, decay, S0) -> tuple[jax.Array, jax.Array]:
    """The sequential part: a lax.scan over the N chunks carrying the state S [B,HV,K,V].
    Per chunk: u = u1 - w S;  o = qg S + m u;  S <- decay * S + kdt u.
    Returns (o [B,HV,N,C,V], final state [B,HV,K,V]), float32."""
    def step(S, xs):
        w, u1, qg, m, kdt, decay = xs
        u = u1 - _mm("...ck,...kv->...cv", w, S)
        o = _mm("...ck,...kv->...cv", qg, S) + _mm("...ts,...sv->...tv", m, u)
        S = decay * S + _mm("...kc,...cv->...kv", kdt, u)
        return S, o

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (w, u1, qg, m, kdt, decay))
    S, o = jax.lax.scan(step, S0.astype(jnp.float32), xs)               # o [N,B,HV,C,V]
    return jnp.moveaxis(o, 0, 2), S


def finish(o: jax.Array, pad: jax.Array | None, T: int) -> jax.Array:
    """o [B,HV,N,C,V] -> [B,T,HV,V], zero at padding positions."""
    B, HV, N, C, V = o.shape
    o = jnp.moveaxis(o.reshape(B, HV, N * C, V)[:, :, :T], 1, 2)
    return o if pad is None else jnp.where(pad[:, :, None, None], 0.0, o)


def forward(q, k, v, g, beta, initial_state, segment_ids, *, scale: float,
            chunk_size: int) -> tuple[jax.Array, jax.Array]:
    """q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV] (GDN) or [B,T,HV,K] (KDA); beta [B,T,HV];
    initial_state [B,HV,K,V] or None; segment_ids [B,T] int or None.
    Returns (o [B,T,HV,V] float32, final state [B,HV,K,V] float32)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    p = prepare(q, k, v, g, beta, segment_ids, scale=scale, chunk_size=chunk_size)
    S0 = jnp.zeros((B, HV, K, V), jnp.float32) if initial_state is None else initial_state
    o, S = state_pass(p.w, p.u1, p.qg, p.m, p.kdt, p.decay, S0)
    return finish(o, p.pad, T), S
