"""Depth attention as Pallas kernels for NVIDIA GPUs (Triton lowering).

Letters: Q queries, S sources (buffer slots), N tokens, D d_model (a power of two here), TN tokens
per program (a power of two dividing N, so no padding copy of the sources is ever made).

  forward   grid (N / TN,): a program walks the n_valid used slots of its tokens (a loop with a
            dynamic bound, so unused slots of the buffer are never read), computing the RMSNorm
            factor, the Q scores and an online softmax per query in registers -> o, lse.
  backward  grid (N / TN,): the same walk recomputes p from lse and writes dSources per slot (the
            RMSNorm derivative folded in, see xla.py) and zeros for the unused slots; the
            per-program dQueries [N / TN, Q, D] are summed in XLA (no atomics).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from .cost import cost_estimate as _cost

MAX_Q = 16             # queries are unrolled in the kernel
MAX_D = 8192
TILE_ELEMENTS = 16384  # TN * D * Q float32 accumulator elements per program (register budget)
MAX_TN = 64
NUM_WARPS = 4


def unsupported_reason(*, Q: int, S: int, D: int, dtype) -> str | None:
    """None when the kernel can take these shapes, else why not (api.py falls back or raises)."""
    del S, dtype
    if D & (D - 1) or D > MAX_D:
        return f"D={D} must be a power of two <= {MAX_D} for Triton blocks"
    if Q > MAX_Q:
        return f"Q={Q} queries exceed the GPU kernel's limit {MAX_Q}"
    return None


def token_tile(N: int, D: int, Q: int) -> int:
    """The largest power of two dividing N within the register budget."""
    tn = 1
    while (tn * 2 <= MAX_TN and N % (tn * 2) == 0 and tn * 2 * D * Q <= TILE_ELEMENTS):
        tn *= 2
    return tn


def _fwd_kernel(n_ref, q_ref, src_ref, o_ref, lse_ref, *, Q: int, D: int, eps: float):
    n = n_ref[0]
    TN = src_ref.shape[1]
    qs = [q_ref[j, :].astype(jnp.float32) for j in range(Q)]

    def body(s, carry):
        ms, ls, accs = carry
        v = src_ref[s].astype(jnp.float32)                                      # [TN, D]
        r = jax.lax.rsqrt(jnp.sum(v * v, axis=-1) / D + eps)                    # [TN]
        new_m, new_l, new_acc = [], [], []
        for j in range(Q):
            z = jnp.sum(v * qs[j][None, :], axis=-1) * r
            m = jnp.maximum(ms[j], z)
            a, b = jnp.exp(ms[j] - m), jnp.exp(z - m)
            new_m.append(m)
            new_l.append(ls[j] * a + b)
            new_acc.append(accs[j] * a[:, None] + v * b[:, None])
        return tuple(new_m), tuple(new_l), tuple(new_acc)

    init = (tuple(jnp.full((TN,), -jnp.inf, jnp.float32) for _ in range(Q)),
            tuple(jnp.zeros((TN,), jnp.float32) for _ in range(Q)),
            tuple(jnp.zeros((TN, D), jnp.float32) for _ in range(Q)))
    ms, ls, accs = jax.lax.fori_loop(0, n, body, init)
    for j in range(Q):
        o_ref[j] = (accs[j] / ls[j][:, None]).astype(o_ref.dtype)
        lse_ref[j] = ms[j] + jnp.log(ls[j])


def _bwd_kernel(n_ref, q_ref, src_ref, lse_ref, do_ref, delta_ref, ds_ref, dq_ref, *, Q: int,
                D: int, eps: float):
    n = n_ref[0]
    S, TN = src_ref.shape[0], src_ref.shape[1]
    qs = [q_ref[j, :].astype(jnp.float32) for j in range(Q)]
    dos = [do_ref[j].astype(jnp.float32) for j in range(Q)]
    lses = [lse_ref[j] for j in range(Q)]
    deltas = [delta_ref[j] for j in range(Q)]

    def body(s, dqs):
        v = src_ref[s].astype(jnp.float32)
        r = jax.lax.rsqrt(jnp.sum(v * v, axis=-1) / D + eps)
        dv = jnp.zeros((TN, D), jnp.float32)
        coef = jnp.zeros((TN,), jnp.float32)
        new_dq = []
        for j in range(Q):
            z = jnp.sum(v * qs[j][None, :], axis=-1) * r
            p = jnp.exp(z - lses[j])
            dz = p * (jnp.sum(dos[j] * v, axis=-1) - deltas[j])
            dv += p[:, None] * dos[j] + (r * dz)[:, None] * qs[j][None, :]
            coef += dz * z
            new_dq.append(dqs[j] + jnp.sum((dz * r)[:, None] * v, axis=0))
        dv -= (r * r / D * coef)[:, None] * v
        ds_ref[s] = dv.astype(ds_ref.dtype)
        return tuple(new_dq)

    dqs = jax.lax.fori_loop(0, n, body, tuple(jnp.zeros((D,), jnp.float32) for _ in range(Q)))

    def zero(s, c):
        ds_ref[s] = jnp.zeros((TN, D), ds_ref.dtype)
        return c

    jax.lax.fori_loop(n, S, zero, 0)
    for j in range(Q):
        dq_ref[0, j, :] = dqs[j]




def forward(queries, sources, n_valid, *, eps: float, interpret: bool = False):
    """queries [Q,D], sources [S,N,D], n_valid int32 [] -> (o [Q,N,D] float32, lse [Q,N])."""
    Q, D = queries.shape
    S, N, _ = sources.shape
    tn = token_tile(N, D, Q)
    kernel = functools.partial(_fwd_kernel, Q=Q, D=D, eps=eps)
    return pl.pallas_call(
        kernel, grid=(N // tn,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)),
                  pl.BlockSpec((Q, D), lambda i: (0, 0)),
                  pl.BlockSpec((S, tn, D), lambda i: (0, i, 0))],
        out_specs=[pl.BlockSpec((Q, tn, D), lambda i: (0, i, 0)),
                   pl.BlockSpec((Q, tn), lambda i: (0, i))],
        out_shape=[jax.ShapeDtypeStruct((Q, N, D), jnp.float32),
                   jax.ShapeDtypeStruct((Q, N), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        cost_estimate=_cost(Q, S, N, D, sources.dtype.itemsize, False),
        interpret=interpret, name="depth_attention_fwd",
    )(n_valid.reshape(1), queries.astype(jnp.float32), sources)


def backward(queries, sources, n_valid, o, lse, do, delta, *, eps: float,
             interpret: bool = False):
    """(dq [Q,D] float32, dsources [S,N,D]) given dO [Q,N,D] and delta [Q,N] (see api.py)."""
    del o
    Q, D = queries.shape
    S, N, _ = sources.shape
    tn = token_tile(N, D, Q)
    kernel = functools.partial(_bwd_kernel, Q=Q, D=D, eps=eps)
    ds, dq = pl.pallas_call(
        kernel, grid=(N // tn,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)),
                  pl.BlockSpec((Q, D), lambda i: (0, 0)),
                  pl.BlockSpec((S, tn, D), lambda i: (0, i, 0)),
                  pl.BlockSpec((Q, tn), lambda i: (0, i)),
                  pl.BlockSpec((Q, tn, D), lambda i: (0, i, 0)),
                  pl.BlockSpec((Q, tn), lambda i: (0, i))],
        out_specs=[pl.BlockSpec((S, tn, D), lambda i: (0, i, 0)),
                   pl.BlockSpec((1, Q, D), lambda i: (i, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((S, N, D), sources.dtype),
                   jax.ShapeDtypeStruct((N // tn, Q, D), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        cost_estimate=_cost(Q, S, N, D, sources.dtype.itemsize, True),
        interpret=interpret, name="depth_attention_bwd",
    )(n_valid.reshape(1), queries.astype(jnp.float32), sources, lse, do.astype(jnp.float32),
      delta.astype(jnp.float32))
    return jnp.sum(dq, axis=0), ds
