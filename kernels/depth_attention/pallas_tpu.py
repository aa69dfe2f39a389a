"""Depth attention as Pallas kernels for TPUs (Mosaic lowering).

Letters: Q queries, S sources (buffer slots), N tokens (padded to Np, a multiple of TN), D d_model
(whole), TN tokens per grid row.

  forward   grid (Np / TN, S), S innermost ("arbitrary"): the BlockSpec pipeline fetches one source
            tile [TN, D] per step; the used-slot count n_valid is scalar-prefetched and the
            index_map clamps the slot to n_valid - 1, so unused slots repeat the previous block
            index and cost no DMA (and no compute: pl.when). RMSNorm factor, scores (an MXU dot
            [TN,D] x [D,Q]) and an online softmax per query live in VMEM scratch.
  backward  grid (Np / TN, S): recompute p from lse, write dSources per slot (zeros for unused
            slots), accumulate the per-row-tile dQueries in the resident output block; XLA sums
            the tiles.

Scores are kept tokens-on-sublanes [TN, Q] so every per-token factor is a [TN, 1] column.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from .._util import pad_axis as _pad_tokens
from .cost import cost_estimate as _cost

MAX_Q = 16
VMEM_BUDGET = 8 * 1024 * 1024  # bytes of float32 accumulators per grid row (Q * TN * D * 4)
MAX_TN = 512


def unsupported_reason(*, Q: int, S: int, D: int, dtype) -> str | None:
    """None when the kernel can take these shapes, else why not (api.py falls back or raises)."""
    del S, dtype
    if Q > MAX_Q:
        return f"Q={Q} queries exceed the TPU kernel's limit {MAX_Q}"
    if 4 * Q * 8 * D > VMEM_BUDGET:
        return f"D={D} with Q={Q} does not fit the VMEM budget even at 8 tokens per tile"
    return None


def token_tile(N: int, D: int, Q: int, dtype) -> tuple[int, int]:
    """(TN, Np): the token tile and the padded token count."""
    row = 16 if jnp.dtype(dtype).itemsize == 2 else 8
    cap = MAX_TN
    while cap > row and 4 * Q * cap * D * 2 > VMEM_BUDGET:
        cap //= 2
    if N <= cap:
        return N, N                                  # one tile: the block is the whole axis
    tn = cap
    while tn > row and N % tn:
        tn //= 2
    if N % tn == 0:
        return tn, N
    return cap, -(-N // cap) * cap


def _rms_col(v, D, eps):
    return jax.lax.rsqrt(jnp.sum(v * v, axis=-1, keepdims=True) / D + eps)        # [TN, 1]


def _scores(v, q, r):
    z = jax.lax.dot_general(v, q, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)                 # [TN, Q]
    return z * r


def _fwd_kernel(n_ref, q_ref, src_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, Q, D, S, eps):
    s = pl.program_id(1)

    @pl.when(s == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(s < n_ref[0])
    def _step():
        v = src_ref[...].astype(jnp.float32)                                    # [TN, D]
        z = _scores(v, q_ref[...], _rms_col(v, D, eps))                         # [TN, Q]
        m_old = m_sc[...]
        m = jnp.maximum(m_old, z)
        a, b = jnp.exp(m_old - m), jnp.exp(z - m)
        m_sc[...] = m
        l_sc[...] = l_sc[...] * a + b
        for j in range(Q):
            acc_sc[j] = acc_sc[j] * a[:, j:j + 1] + v * b[:, j:j + 1]

    @pl.when(s == S - 1)
    def _finish():
        l = l_sc[...]
        for j in range(Q):
            o_ref[j] = (acc_sc[j] / l[:, j:j + 1]).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l)


def _bwd_kernel(n_ref, q_ref, src_ref, lse_ref, do_ref, delta_ref, ds_ref, dq_ref, *, Q, D, eps):
    s = pl.program_id(1)

    @pl.when(s == 0)
    def _init():
        dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    @pl.when(s < n_ref[0])
    def _step():
        v = src_ref[...].astype(jnp.float32)
        q = q_ref[...]
        r = _rms_col(v, D, eps)
        z = _scores(v, q, r)
        p = jnp.exp(z - lse_ref[...])                                           # [TN, Q]
        delta = delta_ref[...]
        dv = jnp.zeros(v.shape, jnp.float32)
        coef = jnp.zeros(r.shape, jnp.float32)
        for j in range(Q):
            do = do_ref[j].astype(jnp.float32)                                  # [TN, D]
            pj = p[:, j:j + 1]
            dz = pj * (jnp.sum(do * v, axis=-1, keepdims=True) - delta[:, j:j + 1])
            dv = dv + pj * do + (r * dz) * q[j:j + 1, :]
            coef = coef + dz * z[:, j:j + 1]
            dq_ref[0, j:j + 1, :] += jnp.sum((dz * r) * v, axis=0, keepdims=True)
        ds_ref[...] = (dv - (r * r / D * coef) * v).astype(ds_ref.dtype)

    @pl.when(s >= n_ref[0])
    def _unused():
        ds_ref[...] = jnp.zeros(ds_ref.shape, ds_ref.dtype)


def _src_map(i, s, n_ref):
    return (jnp.minimum(s, n_ref[0] - 1), i, 0)






def forward(queries, sources, n_valid, *, eps: float, interpret: bool = False):
    """queries [Q,D], sources [S,N,D], n_valid int32 [] -> (o [Q,N,D] float32, lse [Q,N])."""
    Q, D = queries.shape
    S, N, _ = sources.shape
    tn, Np = token_tile(N, D, Q, sources.dtype)
    src = _pad_tokens(sources, 1, Np)
    kernel = functools.partial(_fwd_kernel, Q=Q, D=D, S=S, eps=eps)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(Np // tn, S),
        in_specs=[pl.BlockSpec((Q, D), lambda i, s, n: (0, 0)),
                  pl.BlockSpec((None, tn, D), _src_map)],
        out_specs=[pl.BlockSpec((Q, tn, D), lambda i, s, n: (0, i, 0)),
                   pl.BlockSpec((tn, Q), lambda i, s, n: (i, 0))],
        scratch_shapes=[pltpu.VMEM((tn, Q), jnp.float32), pltpu.VMEM((tn, Q), jnp.float32),
                        pltpu.VMEM((Q, tn, D), jnp.float32)])
    o, lse = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((Q, Np, D), jnp.float32),
                   jax.ShapeDtypeStruct((Np, Q), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=_cost(Q, S, Np, D, sources.dtype.itemsize, False),
        interpret=interpret, name="depth_attention_fwd",
    )(n_valid.reshape(1), queries.astype(jnp.float32), src)
    return o[:, :N], lse[:N].T


def backward(queries, sources, n_valid, o, lse, do, delta, *, eps: float,
             interpret: bool = False):
    """(dq [Q,D] float32, dsources [S,N,D]) given dO [Q,N,D] and delta [Q,N] (see api.py)."""
    del o
    Q, D = queries.shape
    S, N, _ = sources.shape
    tn, Np = token_tile(N, D, Q, sources.dtype)
    src = _pad_tokens(sources, 1, Np)
    lse_t = _pad_tokens(lse.T, 0, Np)
    delta_t = _pad_tokens(delta.astype(jnp.float32).T, 0, Np)
    do = _pad_tokens(do, 1, Np)
    kernel = functools.partial(_bwd_kernel, Q=Q, D=D, eps=eps)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(Np // tn, S),
        in_specs=[pl.BlockSpec((Q, D), lambda i, s, n: (0, 0)),
                  pl.BlockSpec((None, tn, D), _src_map),
                  pl.BlockSpec((tn, Q), lambda i, s, n: (i, 0)),
                  pl.BlockSpec((Q, tn, D), lambda i, s, n: (0, i, 0)),
                  pl.BlockSpec((tn, Q), lambda i, s, n: (i, 0))],
        out_specs=[pl.BlockSpec((None, tn, D), lambda i, s, n: (s, i, 0)),
                   pl.BlockSpec((1, Q, D), lambda i, s, n: (i, 0, 0))])
    ds, dq = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((S, Np, D), sources.dtype),
                   jax.ShapeDtypeStruct((Np // tn, Q, D), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=_cost(Q, S, Np, D, sources.dtype.itemsize, True),
        interpret=interpret, name="depth_attention_bwd",
    )(n_valid.reshape(1), queries.astype(jnp.float32), src, lse_t, do, delta_t)
    return jnp.sum(dq, axis=0), ds[:, :N]
