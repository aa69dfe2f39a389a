"""The LeapQuant window read as a Pallas kernel for TPUs (Mosaic lowering).

Letters: B batch, HV value heads, K key head dim, V value head dim, r compensators, P window
records, Dg decay width (1 = GDN, K = KDA).

Same contract and arithmetic as pallas_gpu.read (the docstring there; xla.read_arrays is the
oracle): one program per state, grid (B, HV), the stored boundary Q [K,V] (int8 / bf16 / f32)
converted in vregs, never written back dequantized (the records, float32 or bfloat16, are widened
there too). Mosaic wants 2-D operands, so vectors travel as columns [n,1] (reduced over sublanes
against Q) and rows [1,n] (against the records), and the products are broadcast-multiply-reduce
(no matmul with a 1-row operand). TPUs have no float16:
the compensators are widened to float32 before the call (r (K + V) numbers per state).
Shapes: K a multiple of 32 (int8 sublane tiling) and V a multiple of 128 (lanes), else XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def unsupported_reason(*, K: int, V: int, P: int, r: int) -> str | None:
    """None when the kernel can take these shapes, else why not."""
    del P, r
    if K % 32 or V % 128:
        return f"K={K} must be a multiple of 32 and V={V} a multiple of 128 for TPU tiles"
    return None


def _kernel(q_ref, scale_ref, smooth_ref, ck_ref, cu_ref, rk_ref, ru_ref, rg_ref, gcol_ref,
            grow_ref, xcol_ref, xrow_ref, valid_ref, o_ref, *, rank: int):
    f32 = jnp.float32
    ycol = jnp.exp(gcol_ref[...]) * xcol_ref[...]                           # [K,1]
    qy = jnp.sum(q_ref[...].astype(f32) * (smooth_ref[...] * ycol), axis=0, keepdims=True)
    out = scale_ref[...] * qy                                               # [1,V]
    xrow = xrow_ref[...]                                                    # [1,K]
    if rank:
        yrow = jnp.exp(grow_ref[...]) * xrow
        c = jnp.sum(ck_ref[...] * yrow, axis=1, keepdims=True)               # [r,1]
        out = out + jnp.sum(cu_ref[...] * c, axis=0, keepdims=True)
    # records: float32 or bfloat16 (LeapQuantSpec.record_dtype), widened in vregs
    w = jnp.exp(grow_ref[...] - rg_ref[...].astype(f32)) * xrow              # [P,K]
    coef = jnp.sum(rk_ref[...].astype(f32) * w, axis=1, keepdims=True) * valid_ref[...]  # [P,1]
    o_ref[...] = out + jnp.sum(ru_ref[...].astype(f32) * coef, axis=0, keepdims=True)


def read(q, scale, smooth, comp_k, comp_u, rec_k, rec_u, rec_g, G, x, valid, *,
         interpret: bool = False):
    """Same contract as xla.read_arrays (and pallas_gpu.read) -> S^T x [B,HV,V] float32."""
    B, HV, K, V = q.shape
    P, Dg, r = rec_k.shape[2], rec_g.shape[3], comp_k.shape[2]
    f32 = jnp.float32
    if not r:  # a zero-size block cannot be loaded: a dummy the kernel never reads
        comp_k, comp_u = jnp.zeros((B, HV, 1, K), f32), jnp.zeros((B, HV, 1, V), f32)
    rb = max(r, 1)

    def spec(*tail):
        return pl.BlockSpec((None, None) + tail, lambda b, h: (b, h) + (0,) * len(tail))

    args = (q, scale[:, :, None, :], smooth[..., None], comp_k.astype(f32), comp_u.astype(f32),
            rec_k, rec_u, rec_g, G[..., None], G[:, :, None, :], x[..., None], x[:, :, None, :],
            valid[..., None])
    out = pl.pallas_call(
        functools.partial(_kernel, rank=r),
        grid=(B, HV),
        in_specs=[spec(K, V), spec(1, V), spec(K, 1), spec(rb, K), spec(rb, V), spec(P, K),
                  spec(P, V), spec(P, Dg), spec(Dg, 1), spec(1, Dg), spec(K, 1), spec(1, K),
                  spec(P, 1)],
        out_specs=spec(1, V),
        out_shape=jax.ShapeDtypeStruct((B, HV, 1, V), f32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=pl.CostEstimate(
            flops=B * HV * (2 * K * V + 2 * r * (K + V) + 2 * P * (K + V) + 2 * K),
            transcendentals=B * HV * (Dg + P * Dg),
            bytes_accessed=int(sum(a.size * a.dtype.itemsize for a in (q, rec_k, rec_u, rec_g))
                               + 4 * B * HV * (2 * V + 2 * K))),
        interpret=interpret,
        name="leapquant_read_tpu",
    )(*args)
    return out[:, :, 0, :]
