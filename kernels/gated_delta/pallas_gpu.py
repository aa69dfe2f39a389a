"""The gated-delta state pass as Pallas kernels for NVIDIA GPUs (Triton lowering): forward and
backward.

Letters: B batch, HV value heads, N chunks, C chunk length, K / V head dims, BV value columns per
program.

What it covers: only the sequential part of the chunkwise algorithm, xla.state_pass (per chunk n,
u_n = u1_n - w_n S_n, o_n = qg_n S_n + m_n u_n, S_{n+1} = decay_n * S_n + kdt_n u_n), and its
VJP. The state-independent preparation (decay cumsums, the intra-chunk pair matrices, the UT
transform's triangular inverse) stays in XLA (xla.prepare) and is differentiated by JAX.

Forward, state_pass: grid (B, HV, V / BV). The value columns of the state evolve independently
(every product above acts on S from the left), so each program owns a [K, BV] slice of the state,
kept in registers across a loop over the N chunks.

Backward, state_pass_bwd (reverse over n, dS_N the final state's cotangent):
    du_n = m_n^T do_n + kdt_n^T dS_{n+1}
    dS_n = decay_n * dS_{n+1} + qg_n^T do_n - w_n^T du_n            (dS0 = dS_0, du1_n = du_n)
    dw_n = -du_n S_n^T,  dqg_n = do_n S_n^T,  dm_n = do_n u_n^T,  dkdt_n = dS_{n+1} u_n^T,
    ddecay_n = sum_V dS_{n+1} * S_n
It needs the chunk states S_n, which are recomputed, not saved by the forward (fla's choice too):
the custom VJP's residuals stay the state pass's inputs (api.py), the training forward writes no
[B, HV, N, K, V] buffer and nothing of that size lives from the forward to the backward; the
price is one more pass of the forward recurrence (2 of its 3 products) in the backward. Three
kernels:
  1. gated_delta_states (grid (B, HV, V / BV), sequential over n): the forward recurrence again,
     writing S_n [B, HV, N, K, V].
  2. gated_delta_state_bwd (grid (B, HV, V / BV), reverse over n): the dS recurrence, which needs
     neither S nor u; writes du (= du1) and dS_{n+1} per chunk, and dS0. Like the forward, value
     columns are independent here, so each program owns [K, BV] of dS.
  3. gated_delta_chunk_grads (grid (B, HV, N), chunks in parallel): dw, dqg, dm, dkdt and ddecay,
     the products that contract V, from S_n, dS_{n+1}, du, do and u = u1 - w S (recomputed).
Why the split: a grid over V blocks would leave those five products as per-V-block partial sums
(a leading V-block axis summed in XLA: V / BV copies of w, qg, m and kdt's sizes), and one program
owning the whole [K, V] state (plus dS) in registers across the sequential loop would spill for
K = V = 128. Kernel 3 holds no loop-carried state, so it owns a whole chunk and loops over V in
blocks, accumulating in float32; it writes each gradient once. The extra traffic is dS_{n+1}
(written once, read once, K * V per chunk) instead of the partial sums.

Triton needs power-of-two tiles: C, K and V must be powers of two >= 16. Float32 dots run at
precision HIGHEST (IEEE; Triton would otherwise use TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .cost import chunk_grads_cost_estimate as _grads_cost
from .cost import cost_estimate as _cost
from .cost import dstate_cost_estimate as _dstate_cost
from .cost import states_cost_estimate as _states_cost

_HI = jax.lax.Precision.HIGHEST
BLOCK_V = 32          # value columns per program of the sequential kernels
GRADS_BLOCK_V = 32    # value columns per step of kernel 3's loop over V
NUM_WARPS = 4
# Kernel 3 keeps four float32 accumulators of a whole chunk ([C,K] x 2, [C,C], [K,C]: ~29K values
# at C = 64, K = 128) plus w: 8 warps keep that near 150 registers a thread. Untuned (no GPU yet).
GRADS_NUM_WARPS = 8


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


def _dot_tn(a, b):
    """a^T b: contracts the first dims of a [R, M] and b [R, N] -> [M, N]."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI,
                               preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    """a b^T: contracts the last dims of a [M, R] and b [N, R] -> [M, N]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI,
                               preferred_element_type=jnp.float32)


def _kernel(w_ref, u1_ref, qg_ref, m_ref, kdt_ref, decay_ref, s0_ref, o_ref, s_ref, *,
            n_chunks: int):
    def body(n, S):                                                            # S [K, BV]
        u = u1_ref[n] - _dot(w_ref[n], S)                                      # [C, BV]
        o_ref[n] = _dot(qg_ref[n], S) + _dot(m_ref[n], u)
        return decay_ref[n][:, None] * S + _dot(kdt_ref[n], u)

    s_ref[...] = jax.lax.fori_loop(0, n_chunks, body, s0_ref[...])


def _specs(N, K, bv):
    """BlockSpecs of the sequential kernels (grid (B, HV, V / bv)): whole per-(b, h) arrays, their
    value-column slices, and the state slices."""
    whole = lambda *tail: pl.BlockSpec((None, None, N) + tail,                      # noqa: E731
                                       lambda b, h, j: (b, h) + (0,) * (len(tail) + 1))
    cols = lambda rows: pl.BlockSpec((None, None, N, rows, bv),                     # noqa: E731
                                     lambda b, h, j: (b, h, 0, 0, j))
    state = pl.BlockSpec((None, None, K, bv), lambda b, h, j: (b, h, 0, j))
    return whole, cols, state


def state_pass(w, u1, qg, m, kdt, decay, S0, *, interpret: bool = False,
               block_v: int = BLOCK_V, num_warps: int = NUM_WARPS):
    """Same contract as xla.state_pass: w [B,HV,N,C,K], u1 [B,HV,N,C,V], qg [B,HV,N,C,K],
    m [B,HV,N,C,C], kdt [B,HV,N,K,C], decay [B,HV,N,K,1], S0 [B,HV,K,V] (float32) ->
    (o [B,HV,N,C,V], final state [B,HV,K,V]), float32. block_v / num_warps: the tile and warps
    of each program (eval/tune_gated_delta_gpu.py times the choices; the defaults are untuned)."""
    B, HV, N, C, K = w.shape
    V = u1.shape[-1]
    bv = min(V, block_v)
    whole, cols, state = _specs(N, K, bv)
    cols = cols(C)
    return pl.pallas_call(
        functools.partial(_kernel, n_chunks=N),
        grid=(B, HV, V // bv),
        in_specs=[whole(C, K), cols, whole(C, K), whole(C, C), whole(K, C), whole(K), state],
        out_specs=[cols, state],
        out_shape=[jax.ShapeDtypeStruct((B, HV, N, C, V), jnp.float32),
                   jax.ShapeDtypeStruct((B, HV, K, V), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        cost_estimate=_cost(B=B, HV=HV, N=N, C=C, K=K, V=V),
        interpret=interpret,
        name="gated_delta_state_fwd",
    )(w, u1, qg, m, kdt, decay[..., 0], S0.astype(jnp.float32))


# ----------------------------------------------------------------------------------------------
# Backward (see the module docstring).

def _states_kernel(w_ref, u1_ref, kdt_ref, decay_ref, s0_ref, h_ref, *, n_chunks: int):
    def body(n, S):                                                            # S [K, BV]
        h_ref[n] = S
        u = u1_ref[n] - _dot(w_ref[n], S)
        return decay_ref[n][:, None] * S + _dot(kdt_ref[n], u)

    jax.lax.fori_loop(0, n_chunks, body, s0_ref[...])


def _dstate_kernel(w_ref, qg_ref, m_ref, kdt_ref, decay_ref, do_ref, dsn_ref, du_ref, dh_ref,
                   ds0_ref, *, n_chunks: int):
    def body(i, dS):                                                           # dS [K, BV]
        n = n_chunks - 1 - i
        dh_ref[n] = dS                                                         # dS_{n+1}
        do = do_ref[n]                                                         # [C, BV]
        du = _dot_tn(m_ref[n], do) + _dot_tn(kdt_ref[n], dS)
        du_ref[n] = du
        return decay_ref[n][:, None] * dS + _dot_tn(qg_ref[n], do) - _dot_tn(w_ref[n], du)

    ds0_ref[...] = jax.lax.fori_loop(0, n_chunks, body, dsn_ref[...])


def _grads_kernel(w_ref, u1_ref, h_ref, dh_ref, du_ref, do_ref, dw_ref, dqg_ref, dm_ref,
                  dkdt_ref, ddecay_ref, *, block_v: int):
    C, K = w_ref.shape
    V = u1_ref.shape[-1]
    w = w_ref[...]
    dw = jnp.zeros((C, K), jnp.float32)
    dqg = jnp.zeros((C, K), jnp.float32)
    dm = jnp.zeros((C, C), jnp.float32)
    dkdt = jnp.zeros((K, C), jnp.float32)
    ddecay = jnp.zeros((K,), jnp.float32)
    for j in range(V // block_v):                        # static: a few blocks of value columns
        cols = pl.ds(j * block_v, block_v)
        S, dS = h_ref[:, cols], dh_ref[:, cols]                                # [K, BV]
        u = u1_ref[:, cols] - _dot(w, S)                                       # [C, BV]
        du, do = du_ref[:, cols], do_ref[:, cols]
        dw -= _dot_nt(du, S)
        dqg += _dot_nt(do, S)
        dm += _dot_nt(do, u)
        dkdt += _dot_nt(dS, u)
        ddecay += jnp.sum(dS * S, axis=1)
    dw_ref[...] = dw
    dqg_ref[...] = dqg
    dm_ref[...] = dm
    dkdt_ref[...] = dkdt
    ddecay_ref[...] = ddecay


def state_pass_bwd(args, cotangents, *, interpret: bool = False, block_v: int = BLOCK_V,
                   num_warps: int = NUM_WARPS):
    """The VJP of state_pass: args = (w, u1, qg, m, kdt, decay, S0) as state_pass takes them,
    cotangents = (do [B,HV,N,C,V], dS_N [B,HV,K,V]) -> (dw, du1, dqg, dm, dkdt, ddecay, dS0),
    shaped like args, float32 (what jax.vjp(xla.state_pass, *args) gives). block_v / num_warps:
    those of the two sequential kernels (as state_pass's)."""
    w, u1, qg, m, kdt, decay, S0 = args
    do, dsn = (x.astype(jnp.float32) for x in cotangents)
    B, HV, N, C, K = w.shape
    V = u1.shape[-1]
    f32 = jnp.float32
    decay_k = decay[..., 0]                                                    # [B,HV,N,K]
    bv = min(V, block_v)
    whole, cols, state = _specs(N, K, bv)
    seq_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    dims = dict(B=B, HV=HV, N=N, C=C, K=K, V=V)

    h = pl.pallas_call(
        functools.partial(_states_kernel, n_chunks=N),
        grid=(B, HV, V // bv),
        in_specs=[whole(C, K), cols(C), whole(K, C), whole(K), state],
        out_specs=cols(K),
        out_shape=jax.ShapeDtypeStruct((B, HV, N, K, V), f32),
        compiler_params=seq_params,
        cost_estimate=_states_cost(**dims),
        interpret=interpret,
        name="gated_delta_states",
    )(w, u1, kdt, decay_k, S0.astype(f32))

    du, dh, dS0 = pl.pallas_call(
        functools.partial(_dstate_kernel, n_chunks=N),
        grid=(B, HV, V // bv),
        in_specs=[whole(C, K), whole(C, K), whole(C, C), whole(K, C), whole(K), cols(C), state],
        out_specs=[cols(C), cols(K), state],
        out_shape=[jax.ShapeDtypeStruct((B, HV, N, C, V), f32),
                   jax.ShapeDtypeStruct((B, HV, N, K, V), f32),
                   jax.ShapeDtypeStruct((B, HV, K, V), f32)],
        compiler_params=seq_params,
        cost_estimate=_dstate_cost(**dims),
        interpret=interpret,
        name="gated_delta_state_bwd",
    )(w, qg, m, kdt, decay_k, do, dsn)

    chunk = lambda *tail: pl.BlockSpec((None, None, None) + tail,                   # noqa: E731
                                       lambda b, h, n: (b, h, n) + (0,) * len(tail))
    dw, dqg, dm, dkdt, ddecay = pl.pallas_call(
        functools.partial(_grads_kernel, block_v=min(V, GRADS_BLOCK_V)),
        grid=(B, HV, N),
        in_specs=[chunk(C, K), chunk(C, V), chunk(K, V), chunk(K, V), chunk(C, V), chunk(C, V)],
        out_specs=[chunk(C, K), chunk(C, K), chunk(C, C), chunk(K, C), chunk(K)],
        out_shape=[jax.ShapeDtypeStruct(x.shape, f32) for x in (w, qg, m, kdt, decay_k)],
        compiler_params=plgpu.CompilerParams(num_warps=GRADS_NUM_WARPS, num_stages=2),
        cost_estimate=_grads_cost(**dims),
        interpret=interpret,
        name="gated_delta_chunk_grads",
    )(w, u1, h, dh, du, do)
    return dw, du, dqg, dm, dkdt, ddecay[..., None], dS0
