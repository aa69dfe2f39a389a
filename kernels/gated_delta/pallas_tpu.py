"""The gated-delta state pass as a Pallas kernel for TPUs (Mosaic lowering).

Letters: B batch, HV value heads, N chunks, C chunk length, K / V head dims.

What it covers: only the sequential part of the chunkwise algorithm, xla.state_pass (per chunk
u = u1 - w S, o = qg S + m u, S <- decay * S + kdt u). The state-independent preparation (decay
cumsums, the intra-chunk pair matrices, the UT transform's triangular inverse) stays in XLA
(xla.prepare), and the backward is the XLA state pass's VJP, recomputed (api.py).

grid (B, HV, N), the chunk axis innermost and "arbitrary": the BlockSpec pipeline fetches one
chunk's operands per step while the state [K, V] stays in a VMEM scratch; the final state block is
resident across the chunk axis and written at the last chunk. All blocks are whole in their last
two dims, so any C, K, V are accepted (Mosaic pads them to its tiles).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .cost import cost_estimate as _cost

_HI = jax.lax.Precision.HIGHEST


def unsupported_reason(*, C: int, K: int, V: int) -> str | None:
    """None when the kernel can take these shapes, else why not (api.py falls back or raises)."""
    del C, K, V
    return None


def _dot(a, b):
    return jnp.dot(a, b, precision=_HI, preferred_element_type=jnp.float32)


def _kernel(w_ref, u1_ref, qg_ref, m_ref, kdt_ref, decay_ref, s0_ref, o_ref, s_ref, s_sc, *,
            n_chunks: int):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _init():
        s_sc[...] = s0_ref[...].astype(jnp.float32)

    S = s_sc[...]                                                              # [K, V]
    u = u1_ref[...] - _dot(w_ref[...], S)                                      # [C, V]
    o_ref[...] = _dot(qg_ref[...], S) + _dot(m_ref[...], u)
    S = decay_ref[...] * S + _dot(kdt_ref[...], u)
    s_sc[...] = S

    @pl.when(n == n_chunks - 1)
    def _finish():
        s_ref[...] = S


def state_pass(w, u1, qg, m, kdt, decay, S0, *, interpret: bool = False):
    """Same contract as xla.state_pass: w [B,HV,N,C,K], u1 [B,HV,N,C,V], qg [B,HV,N,C,K],
    m [B,HV,N,C,C], kdt [B,HV,N,K,C], decay [B,HV,N,K,1], S0 [B,HV,K,V] (float32) ->
    (o [B,HV,N,C,V], final state [B,HV,K,V]), float32."""
    B, HV, N, C, K = w.shape
    V = u1.shape[-1]
    chunk = lambda *tail: pl.BlockSpec((None, None, None) + tail,                   # noqa: E731
                                       lambda b, h, n: (b, h, n, 0, 0))
    state = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))
    return pl.pallas_call(
        functools.partial(_kernel, n_chunks=N),
        grid=(B, HV, N),
        in_specs=[chunk(C, K), chunk(C, V), chunk(C, K), chunk(C, C), chunk(K, C), chunk(K, 1),
                  state],
        out_specs=[chunk(C, V), state],
        out_shape=[jax.ShapeDtypeStruct((B, HV, N, C, V), jnp.float32),
                   jax.ShapeDtypeStruct((B, HV, K, V), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(B=B, HV=HV, N=N, C=C, K=K, V=V),
        interpret=interpret,
        name="gated_delta_state_fwd",
    )(w, u1, qg, m, kdt, decay, S0.astype(jnp.float32))
