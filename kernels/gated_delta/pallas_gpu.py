"""The gated-delta state pass as a Pallas kernel for NVIDIA GPUs (Triton lowering).

Letters: B batch, HV value heads, N chunks, C chunk length, K / V head dims, BV value columns per
program.

What it covers: only the sequential part of the chunkwise algorithm, xla.state_pass (per chunk
u = u1 - w S, o = qg S + m u, S <- decay * S + kdt u). The state-independent preparation (decay
cumsums, the intra-chunk pair matrices, the UT transform's triangular inverse) stays in XLA
(xla.prepare), and the backward is the XLA state pass's VJP, recomputed (api.py).

grid (B, HV, V / BV): the value columns of the state evolve independently (every product above
acts on S from the left), so each program owns a [K, BV] slice of the state, kept in registers
across a loop over the N chunks. Triton needs power-of-two tiles: C, K and V must be powers of
two >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .cost import cost_estimate as _cost

_HI = jax.lax.Precision.HIGHEST
BLOCK_V = 32
NUM_WARPS = 4


def _pow2(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def unsupported_reason(*, C: int, K: int, V: int) -> str | None:
    """None when the kernel can take these shapes, else why not (api.py falls back or raises)."""
    if not (_pow2(C) and _pow2(K) and _pow2(V)):
        return (f"chunk C={C}, K={K} and V={V} must be powers of two >= 16 for Triton tiles "
                f"(a sequence shorter than the chunk uses a chunk of T rounded up to 8)")
    return None


def _dot(a, b):
    return jnp.dot(a, b, precision=_HI, preferred_element_type=jnp.float32)


def _kernel(w_ref, u1_ref, qg_ref, m_ref, kdt_ref, decay_ref, s0_ref, o_ref, s_ref, *,
            n_chunks: int):
    def body(n, S):                                                            # S [K, BV]
        u = u1_ref[n] - _dot(w_ref[n], S)                                      # [C, BV]
        o_ref[n] = _dot(qg_ref[n], S) + _dot(m_ref[n], u)
        return decay_ref[n][:, None] * S + _dot(kdt_ref[n], u)

    s_ref[...] = jax.lax.fori_loop(0, n_chunks, body, s0_ref[...])


def state_pass(w, u1, qg, m, kdt, decay, S0, *, interpret: bool = False):
    """Same contract as xla.state_pass: w [B,HV,N,C,K], u1 [B,HV,N,C,V], qg [B,HV,N,C,K],
    m [B,HV,N,C,C], kdt [B,HV,N,K,C], decay [B,HV,N,K,1], S0 [B,HV,K,V] (float32) ->
    (o [B,HV,N,C,V], final state [B,HV,K,V]), float32."""
    B, HV, N, C, K = w.shape
    V = u1.shape[-1]
    bv = min(V, BLOCK_V)
    whole = lambda *tail: pl.BlockSpec((None, None, N) + tail,                      # noqa: E731
                                       lambda b, h, j: (b, h) + (0,) * (len(tail) + 1))
    cols = pl.BlockSpec((None, None, N, C, bv), lambda b, h, j: (b, h, 0, 0, j))
    state = pl.BlockSpec((None, None, K, bv), lambda b, h, j: (b, h, 0, j))
    return pl.pallas_call(
        functools.partial(_kernel, n_chunks=N),
        grid=(B, HV, V // bv),
        in_specs=[whole(C, K), cols, whole(C, K), whole(C, C), whole(K, C), whole(K), state],
        out_specs=[cols, state],
        out_shape=[jax.ShapeDtypeStruct((B, HV, N, C, V), jnp.float32),
                   jax.ShapeDtypeStruct((B, HV, K, V), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        cost_estimate=_cost(B=B, HV=HV, N=N, C=C, K=K, V=V),
        interpret=interpret,
        name="gated_delta_state_fwd",
    )(w, u1, qg, m, kdt, decay[..., 0], S0.astype(jnp.float32))
