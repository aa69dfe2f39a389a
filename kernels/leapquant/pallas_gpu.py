"""The LeapQuant window read as a Pallas kernel for NVIDIA GPUs (Triton lowering).

Letters: B batch, HV value heads, K key head dim, V value head dim, r compensators, P window
records, Dg decay width (1 = GDN, K = KDA).

What it covers: xla.read, the memory-bound part of a decode step (it runs twice a step):

    S^T x = s * (Q^T (c * y)) + sum_i m_i (l_i . y) + sum_{j valid} u_j (k~_j . exp(G - G_j) x),
    y = exp(G) x

straight from the stored boundary (Q int8 / bf16 / f32 [K,V] read once, converted in registers:
no dequantized copy of the state is ever written to memory), the float16 compensators and the
records (float32, or k~ and u in bfloat16: LeapQuantSpec.record_dtype; widened in registers
too). The record append and the re-quantization every P steps stay in XLA (xla.py): they are
O(P (K + V)) per step and O(K V) once per window.

grid (B, HV): one program per state. Triton needs power-of-two block dims, so K, V >= 16, P and r
(when r > 0) must be powers of two; otherwise the op falls back to XLA (implementation=None) or
refuses (implementation="pallas_gpu"). The matvecs are broadcast-multiply-reduce (a [1,K] x [K,V]
product is below tl.dot's 16-row minimum).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NUM_WARPS = 4


def _pow2(x: int, low: int = 1) -> bool:
    return x >= low and x & (x - 1) == 0


def unsupported_reason(*, K: int, V: int, P: int, r: int) -> str | None:
    """None when the kernel can take these shapes, else why not."""
    if not (_pow2(K, 16) and _pow2(V, 16)):
        return f"K={K} and V={V} must be powers of two >= 16 for Triton tiles"
    if not _pow2(P) or (r and not _pow2(r)):
        return f"the window P={P} and the rank r={r} (when > 0) must be powers of two"
    return None


def _kernel(q_ref, scale_ref, smooth_ref, ck_ref, cu_ref, rk_ref, ru_ref, rg_ref, g_ref, x_ref,
            valid_ref, o_ref, *, rank: int):
    f32 = jnp.float32
    x = x_ref[...]                                                    # [K]
    G = g_ref[...]                                                    # [Dg]
    y = jnp.exp(G) * x                                                # [K]
    qy = jnp.sum(q_ref[...].astype(f32) * (smooth_ref[...] * y)[:, None], axis=0)   # [V]
    out = scale_ref[...] * qy
    if rank:
        c = jnp.sum(ck_ref[...].astype(f32) * y[None, :], axis=1)                   # [r]
        out = out + jnp.sum(cu_ref[...].astype(f32) * c[:, None], axis=0)
    # records: float32 or bfloat16 (LeapQuantSpec.record_dtype), widened in registers
    w = jnp.exp(G[None, :] - rg_ref[...].astype(f32)) * x[None, :]    # [P,K]
    coef = jnp.sum(rk_ref[...].astype(f32) * w, axis=1) * valid_ref[...]             # [P]
    o_ref[...] = out + jnp.sum(ru_ref[...].astype(f32) * coef[:, None], axis=0)


def read(q, scale, smooth, comp_k, comp_u, rec_k, rec_u, rec_g, G, x, valid, *,
         interpret: bool = False):
    """Same contract as xla.read, on the state's arrays: q [B,HV,K,V], scale [B,HV,V], smooth
    [B,HV,K], comp_k [B,HV,r,K], comp_u [B,HV,r,V], rec_k [B,HV,P,K], rec_u [B,HV,P,V], rec_g
    [B,HV,P,Dg], G [B,HV,Dg], x [B,HV,K], valid [B,HV,P] float32 (1 = record held) ->
    S^T x [B,HV,V] float32."""
    B, HV, K, V = q.shape
    P, Dg, r = rec_k.shape[2], rec_g.shape[3], comp_k.shape[2]

    def spec(*tail):
        return pl.BlockSpec((None, None) + tail, lambda b, h: (b, h) + (0,) * len(tail))

    if not r:  # a zero-size block cannot be loaded: pass a dummy the kernel never reads
        comp_k = jnp.zeros((B, HV, 1, K), jnp.float16)
        comp_u = jnp.zeros((B, HV, 1, V), jnp.float16)
    rb = max(r, 1)
    bytes_read = (sum(a.size * a.dtype.itemsize for a in (q, rec_k, rec_u, rec_g))
                  + 4 * (scale.size + smooth.size + x.size) + 2 * (comp_k.size + comp_u.size))
    return pl.pallas_call(
        functools.partial(_kernel, rank=r),
        grid=(B, HV),
        in_specs=[spec(K, V), spec(V), spec(K), spec(rb, K), spec(rb, V), spec(P, K), spec(P, V),
                  spec(P, Dg), spec(Dg), spec(K), spec(P)],
        out_specs=spec(V),
        out_shape=jax.ShapeDtypeStruct((B, HV, V), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        cost_estimate=pl.CostEstimate(
            flops=B * HV * (2 * K * V + 2 * r * (K + V) + 2 * P * (K + V) + 2 * K),
            transcendentals=B * HV * (Dg + P * Dg),
            bytes_accessed=int(bytes_read + 4 * B * HV * V)),
        interpret=interpret,
        name="leapquant_read",
    )(q, scale, smooth, comp_k, comp_u, rec_k, rec_u, rec_g, G, x, valid)
