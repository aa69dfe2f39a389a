"""The gated-delta state pass as Pallas kernels for TPUs (Mosaic lowering): forward and backward.

Letters: B batch, HV value heads, N chunks, C chunk length, K / V head dims.

What it covers: only the sequential part of the chunkwise algorithm, xla.state_pass (per chunk n,
u_n = u1_n - w_n S_n, o_n = qg_n S_n + m_n u_n, S_{n+1} = decay_n * S_n + kdt_n u_n), and its
VJP. The state-independent preparation (decay cumsums, the intra-chunk pair matrices, the UT
transform's triangular inverse) stays in XLA (xla.prepare) and is differentiated by JAX.

Forward, state_pass: grid (B, HV, N), the chunk axis innermost and "arbitrary": the BlockSpec
pipeline fetches one chunk's operands per step while the state [K, V] stays in a VMEM scratch; the
final state block is resident across the chunk axis and written at the last chunk.

Backward, state_pass_bwd (reverse over n, dS_N the final state's cotangent):
    du_n = m_n^T do_n + kdt_n^T dS_{n+1}
    dS_n = decay_n * dS_{n+1} + qg_n^T do_n - w_n^T du_n            (dS0 = dS_0, du1_n = du_n)
    dw_n = -du_n S_n^T,  dqg_n = do_n S_n^T,  dm_n = do_n u_n^T,  dkdt_n = dS_{n+1} u_n^T,
    ddecay_n = sum_V dS_{n+1} * S_n
The chunk states S_n are recomputed, not saved by the forward (fla's choice too): the custom
VJP's residuals stay the state pass's inputs (api.py), and no [B, HV, N, K, V] buffer lives from
the forward to the backward; the price is one more pass of the forward recurrence. Two kernels:
  1. gated_delta_states: the forward's grid and scratch, writing S_n per chunk (no o).
  2. gated_delta_state_bwd: grid (B, HV, N) with the chunk axis reversed by the index maps
     (step i visits chunk N-1-i), "arbitrary"; dS [K, V] in a VMEM scratch; every gradient of the
     chunk computed in the step (u = u1 - w S recomputed from S_n). A program owns the whole
     value width, so the products that contract V (dw, dqg, dm, dkdt, ddecay) are complete in
     VMEM: no per-V-block partial sums; dS0 is resident across the chunk axis and written at the
     last step.
All blocks are whole in their last two dims, so any C, K, V are accepted (Mosaic pads them to its
tiles). Transposed operands are contracted with lax.dot_general (Mosaic's matmul takes a
transposed right-hand side; the transposed left-hand sides are explicit .T, as in JAX's TPU
flash-attention backward).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .cost import backward_cost_estimate as _bwd_cost
from .cost import cost_estimate as _cost
from .cost import states_cost_estimate as _states_cost

_HI = jax.lax.Precision.HIGHEST


def unsupported_reason(*, C: int, K: int, V: int) -> str | None:
    """None when the kernel can take these shapes, else why not (api.py falls back or raises)."""
    del C, K, V
    return None


def _dot(a, b):
    return jnp.dot(a, b, precision=_HI, preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    """a b^T: contracts the last dims of a [M, R] and b [N, R] -> [M, N]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI,
                               preferred_element_type=jnp.float32)


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


# ----------------------------------------------------------------------------------------------
# Backward (see the module docstring).

def _states_kernel(w_ref, u1_ref, kdt_ref, decay_ref, s0_ref, h_ref, s_sc):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        s_sc[...] = s0_ref[...].astype(jnp.float32)

    S = s_sc[...]                                                              # [K, V]
    h_ref[...] = S
    u = u1_ref[...] - _dot(w_ref[...], S)                                      # [C, V]
    s_sc[...] = decay_ref[...] * S + _dot(kdt_ref[...], u)


def _bwd_kernel(w_ref, u1_ref, qg_ref, m_ref, kdt_ref, decay_ref, h_ref, do_ref, dsn_ref,
                dw_ref, du1_ref, dqg_ref, dm_ref, dkdt_ref, ddecay_ref, ds0_ref, ds_sc, *,
                n_chunks: int):
    i = pl.program_id(2)                                         # visits chunk n = N - 1 - i

    @pl.when(i == 0)
    def _init():
        ds_sc[...] = dsn_ref[...]

    dS = ds_sc[...]                                                            # dS_{n+1} [K, V]
    S = h_ref[...]                                                             # S_n [K, V]
    w, do = w_ref[...], do_ref[...]                                            # [C, K], [C, V]
    u = u1_ref[...] - _dot(w, S)                                               # [C, V]
    du = _dot(m_ref[...].T, do) + _dot(kdt_ref[...].T, dS)                     # [C, V]
    du1_ref[...] = du
    dw_ref[...] = -_dot_nt(du, S)
    dqg_ref[...] = _dot_nt(do, S)
    dm_ref[...] = _dot_nt(do, u)
    dkdt_ref[...] = _dot_nt(dS, u)
    ddecay_ref[...] = jnp.sum(dS * S, axis=1, keepdims=True)
    dS = decay_ref[...] * dS + _dot(qg_ref[...].T, do) - _dot(w.T, du)
    ds_sc[...] = dS

    @pl.when(i == n_chunks - 1)
    def _finish():
        ds0_ref[...] = dS


def state_pass_bwd(args, cotangents, *, interpret: bool = False):
    """The VJP of state_pass: args = (w, u1, qg, m, kdt, decay, S0) as state_pass takes them,
    cotangents = (do [B,HV,N,C,V], dS_N [B,HV,K,V]) -> (dw, du1, dqg, dm, dkdt, ddecay, dS0),
    shaped like args, float32 (what jax.vjp(xla.state_pass, *args) gives)."""
    w, u1, qg, m, kdt, decay, S0 = args
    do, dsn = (x.astype(jnp.float32) for x in cotangents)
    B, HV, N, C, K = w.shape
    V = u1.shape[-1]
    f32 = jnp.float32
    dims = dict(B=B, HV=HV, N=N, C=C, K=K, V=V)
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
    state = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))

    fwd = lambda *tail: pl.BlockSpec((None, None, None) + tail,                     # noqa: E731
                                     lambda b, h, n: (b, h, n, 0, 0))
    h = pl.pallas_call(
        _states_kernel,
        grid=(B, HV, N),
        in_specs=[fwd(C, K), fwd(C, V), fwd(K, C), fwd(K, 1), state],
        out_specs=fwd(K, V),
        out_shape=jax.ShapeDtypeStruct((B, HV, N, K, V), f32),
        scratch_shapes=[pltpu.VMEM((K, V), f32)],
        compiler_params=params,
        cost_estimate=_states_cost(**dims),
        interpret=interpret,
        name="gated_delta_states",
    )(w, u1, kdt, decay, S0.astype(f32))

    rev = lambda *tail: pl.BlockSpec((None, None, None) + tail,                     # noqa: E731
                                     lambda b, h, i: (b, h, N - 1 - i, 0, 0))
    chunk_specs = [rev(C, K), rev(C, V), rev(C, K), rev(C, C), rev(K, C), rev(K, 1)]
    grads = pl.pallas_call(
        functools.partial(_bwd_kernel, n_chunks=N),
        grid=(B, HV, N),
        in_specs=chunk_specs + [rev(K, V), rev(C, V), state],
        out_specs=chunk_specs + [state],
        out_shape=[jax.ShapeDtypeStruct(x.shape, f32) for x in (w, u1, qg, m, kdt, decay, S0)],
        scratch_shapes=[pltpu.VMEM((K, V), f32)],
        compiler_params=params,
        cost_estimate=_bwd_cost(**dims),
        interpret=interpret,
        name="gated_delta_state_bwd",
    )(w, u1, qg, m, kdt, decay, h, do, dsn)
    return tuple(grads)
