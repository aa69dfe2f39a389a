"""Block-gather sparse attention in plain JAX: chunked over queries, never a [T, S] buffer.

Letters: B batch, T query tokens, S key tokens, Hkv KV heads, G query heads per KV head
(Hq = G * Hkv), Dk / Dv head dims, n block slots, P = block_size keys per block,
NB = ceil(S / P) key blocks, C query tokens per chunk.

Inputs are the normalized ones built by api.py: `idx` [B,T,Hkv,n] int32 holds unique block ids in
[0, NB) or -1; `limit` [B,T] int32 is the last key position a query may see (causal / padding);
`q_seg` [B,T] and `kv_seg` [B,S] are both None or both int32 segment ids.

Forward and backward each walk the queries in chunks of C tokens (lax.map / lax.scan) and gather the
selected key / value blocks of the chunk: live memory is C * Hkv * n * P * (Dk + Dv) elements, plus
(backward) float32 dK / dV accumulators of the size of K / V, filled with a scatter-add.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .tuning import TUNING


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
    """[B, S, H, D] -> [B, H, NB, P, D] (zero-padded keys past S)."""
    B, S, H, D = x.shape
    nb = -(-S // block_size)
    x = jnp.pad(x, ((0, 0), (0, nb * block_size - S), (0, 0), (0, 0)))
    return x.reshape(B, nb, block_size, H, D).transpose(0, 3, 1, 2, 4)


def _chunked(x: jax.Array, chunk: int, fill) -> jax.Array:
    """[B, T, ...] -> [T/C, B, C, ...] with T padded up to a multiple of C using `fill`."""
    B, T = x.shape[:2]
    nc = -(-T // chunk)
    pad = [(0, 0), (0, nc * chunk - T)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pad, constant_values=fill)
    return jnp.moveaxis(x.reshape((B, nc, chunk) + x.shape[2:]), 1, 0)


def _unchunked(x: jax.Array, T: int) -> jax.Array:
    """[T/C, B, C, ...] -> [B, T, ...]."""
    nc, B, C = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape((B, nc * C) + x.shape[3:])[:, :T]


def _gather(blocks, idx_c, b_ar, g_ar):
    """blocks [B,Hkv,NB,P,D], idx [B,C,Hkv,n] -> [B,C,Hkv,n,P,D] (slot -1 reads block 0)."""
    return blocks[b_ar, g_ar, jnp.maximum(idx_c, 0)]


def _mask(idx_c, limit_c, qseg_c, kvseg_blocks, b_ar, g_ar, block_size):
    """[B, C, Hkv, 1, n, P] visibility of each gathered key."""
    safe = jnp.maximum(idx_c, 0)
    pos = safe[..., None] * block_size + jnp.arange(block_size)               # [B,C,Hkv,n,P]
    mask = (idx_c >= 0)[..., None] & (pos <= limit_c[:, :, None, None, None])
    if qseg_c is not None:
        kseg = kvseg_blocks[b_ar, safe]                                         # [B,C,Hkv,n,P]
        mask &= kseg == qseg_c[:, :, None, None, None]
    return mask[:, :, :, None]


def _segment_blocks(kv_seg, block_size):
    if kv_seg is None:
        return None
    B, S = kv_seg.shape
    nb = -(-S // block_size)
    return jnp.pad(kv_seg, ((0, 0), (0, nb * block_size - S)), constant_values=-1).reshape(
        B, nb, block_size)


def _index_grids(B, Hkv):
    return (jnp.arange(B)[:, None, None, None], jnp.arange(Hkv)[None, None, :, None])


def _inputs(q, idx, limit, q_seg, chunk):
    B, T, Hq, Dk = q.shape
    Hkv = idx.shape[2]
    qc = _chunked(q.reshape(B, T, Hkv, Hq // Hkv, Dk), chunk, 0)
    idxc = _chunked(idx, chunk, -1)
    limc = _chunked(limit, chunk, -1)
    qsegc = None if q_seg is None else _chunked(q_seg, chunk, 0)
    return qc, idxc, limc, qsegc


def forward(q, k, v, idx, limit, q_seg, kv_seg, *, block_size: int, scale: float,
            chunk: int | None = None):
    """Returns (o [B,T,Hq,Dv] in q.dtype, lse [B,T,Hq] float32)."""
    B, T, Hq, _ = q.shape
    Hkv, Dv = v.shape[2], v.shape[3]
    chunk = min(chunk or TUNING.xla_query_chunk, T)
    kb, vb = _blocks(k, block_size), _blocks(v, block_size)
    kvsb = _segment_blocks(kv_seg, block_size)
    b_ar, g_ar = _index_grids(B, Hkv)
    prec = _precision(q.dtype)
    qc, idxc, limc, qsegc = _inputs(q, idx, limit, q_seg, chunk)

    def one_chunk(args):
        q_c, idx_c, lim_c, qseg_c = args
        kg = _gather(kb, idx_c, b_ar, g_ar)                                    # [B,C,Hkv,n,P,Dk]
        vg = _gather(vb, idx_c, b_ar, g_ar)
        mask = _mask(idx_c, lim_c, qseg_c, kvsb, b_ar, g_ar, block_size)
        s = jnp.einsum("bcghd,bcgjpd->bcghjp", q_c, kg, precision=prec,
                       preferred_element_type=jnp.float32) * scale
        m = jnp.max(jnp.where(mask, s, -jnp.inf), axis=(-2, -1), keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(mask, jnp.exp(s - m), 0.0)
        l = jnp.sum(p, axis=(-2, -1))                                          # [B,C,Hkv,G]
        o = jnp.einsum("bcghjp,bcgjpe->bcghe", p.astype(v.dtype), vg, precision=prec,
                       preferred_element_type=jnp.float32)
        o = o / jnp.where(l > 0, l, 1.0)[..., None]
        lse = jnp.where(l > 0, m[..., 0, 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        return o.astype(q.dtype), lse

    o, lse = jax.lax.map(one_chunk, (qc, idxc, limc, qsegc))
    return (_unchunked(o, T).reshape(B, T, Hq, Dv), _unchunked(lse, T).reshape(B, T, Hq))


def backward(q, k, v, idx, limit, q_seg, kv_seg, o, lse, do, delta, *, block_size: int,
             scale: float, chunk: int | None = None):
    """Gradients (dq, dk, dv) given the cotangent `do` and delta = sum(do*o, -1) - dlse [B,T,Hq]."""
    del o
    B, T, Hq, Dk = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    chunk = min(chunk or TUNING.xla_query_chunk, T)
    kb, vb = _blocks(k, block_size), _blocks(v, block_size)
    kvsb = _segment_blocks(kv_seg, block_size)
    b_ar, g_ar = _index_grids(B, Hkv)
    prec = _precision(q.dtype)
    qc, idxc, limc, qsegc = _inputs(q, idx, limit, q_seg, chunk)
    doc = _chunked(do.reshape(B, T, Hkv, G, Dv), chunk, 0)
    lsec = _chunked(lse.reshape(B, T, Hkv, G), chunk, -jnp.inf)
    deltac = _chunked(delta.reshape(B, T, Hkv, G), chunk, 0)

    def one_chunk(carry, args):
        dkb, dvb = carry
        q_c, idx_c, lim_c, qseg_c, do_c, lse_c, delta_c = args
        kg = _gather(kb, idx_c, b_ar, g_ar)
        vg = _gather(vb, idx_c, b_ar, g_ar)
        mask = _mask(idx_c, lim_c, qseg_c, kvsb, b_ar, g_ar, block_size)
        s = jnp.einsum("bcghd,bcgjpd->bcghjp", q_c, kg, precision=prec,
                       preferred_element_type=jnp.float32) * scale
        lse_safe = jnp.where(jnp.isfinite(lse_c), lse_c, 0.0)[..., None, None]
        p = jnp.where(mask, jnp.exp(s - lse_safe), 0.0)                        # [B,C,Hkv,G,n,P]
        dp = jnp.einsum("bcghe,bcgjpe->bcghjp", do_c, vg, precision=prec,
                        preferred_element_type=jnp.float32)
        ds = p * (dp - delta_c[..., None, None]) * scale
        dq_c = jnp.einsum("bcghjp,bcgjpd->bcghd", ds.astype(k.dtype), kg, precision=prec,
                          preferred_element_type=jnp.float32)
        dkg = jnp.einsum("bcghjp,bcghd->bcgjpd", ds.astype(q.dtype), q_c, precision=prec,
                         preferred_element_type=jnp.float32)
        dvg = jnp.einsum("bcghjp,bcghe->bcgjpe", p.astype(do.dtype), do_c, precision=prec,
                         preferred_element_type=jnp.float32)
        safe = jnp.maximum(idx_c, 0)
        dkb = dkb.at[b_ar, g_ar, safe].add(dkg)
        dvb = dvb.at[b_ar, g_ar, safe].add(dvg)
        return (dkb, dvb), dq_c.astype(q.dtype)

    nb = kb.shape[2]
    init = (jnp.zeros((B, Hkv, nb, block_size, Dk), jnp.float32),
            jnp.zeros((B, Hkv, nb, block_size, Dv), jnp.float32))
    (dkb, dvb), dq = jax.lax.scan(one_chunk, init, (qc, idxc, limc, qsegc, doc, lsec, deltac))

    def unblock(xb, D):
        return xb.transpose(0, 2, 3, 1, 4).reshape(B, nb * block_size, Hkv, D)[:, :S]

    return (_unchunked(dq, T).reshape(B, T, Hq, Dk), unblock(dkb, Dk).astype(k.dtype),
            unblock(dvb, Dv).astype(v.dtype))
