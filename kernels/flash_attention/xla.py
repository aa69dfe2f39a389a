"""Chunked flash attention in plain JAX: online softmax over key tiles, hand-written backward.

Letters: B batch, T queries, S keys, Hkv KV heads, G query heads per KV head (Hq = G * Hkv),
Dk / Dv head dims, bq / bk query / key tile lengths, nq / nk tile counts.

No [T, S] buffer exists: a query tile loops (lax.fori_loop with traced bounds) over only the key
tiles it can see (causal / window / compressed ranges from mask.key_block_range); the dK/dV pass
loops a key tile over only the query tiles that can see it. The backward recomputes probabilities
from the saved o and lse. Rows with no visible key give o = 0, lse = -inf and zero gradients.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from aiinfra_jax.kernels.flash_attention.mask import (AttentionMask, key_block_range,
                                                      query_block_range, visible)
from aiinfra_jax.kernels.flash_attention.tuning import round_up
from .._util import pad_axis as _pad_axis




def _tiles(q_len: int, kv_len: int, block_q: int, block_k: int):
    bq = min(block_q, round_up(q_len, 8))
    bk = min(block_k, round_up(kv_len, 8))
    return bq, bk, -(-q_len // bq), -(-kv_len // bk)


def _tile_visible(mask, pos_c, k0, bk, kv_len, qseg_c, kvseg_c):
    """[B, 1, 1, bq, bk] visibility of the key tile starting at k0 for positions pos_c [B, bq]."""
    kidx = k0 + jnp.arange(bk, dtype=jnp.int32)
    vis = visible(mask, pos_c[:, :, None], kidx[None, None, :], kv_len)
    if qseg_c is not None:
        vis = jnp.logical_and(vis, qseg_c[:, :, None] == kvseg_c[:, None, :])
    return vis[:, None, None]


def _logits(qc, kc, scale):  # [B,bq,Hkv,G,Dk] x [B,bk,Hkv,Dk] -> [B,Hkv,G,bq,bk] f32
    return jnp.einsum("bqhgd,bkhd->bhgqk", qc, kc, preferred_element_type=jnp.float32) * scale


class _Prepared:
    """Padded, grouped operands shared by forward and backward."""

    def __init__(self, q, k, v, q_seg, kv_seg, off, block_q, block_k):
        b, t, hq, dk = q.shape
        s, hkv = k.shape[1], k.shape[2]
        self.b, self.t, self.s, self.hq, self.hkv, self.g = b, t, s, hq, hkv, hq // hkv
        self.bq, self.bk, self.nq, self.nk = _tiles(t, s, block_q, block_k)
        self.tp, self.sp = self.nq * self.bq, self.nk * self.bk
        self.q = _pad_axis(q, 1, self.tp).reshape(b, self.tp, hkv, self.g, dk)
        self.k = _pad_axis(k, 1, self.sp)
        self.v = _pad_axis(v, 1, self.sp)
        self.q_seg = _pad_axis(q_seg, 1, self.tp)
        self.kv_seg = _pad_axis(kv_seg, 1, self.sp, value=-1)
        self.off = off
        self.off_lo, self.off_hi = jnp.min(off), jnp.max(off)

    def q_tile(self, x, i):  # x [B, Tp, ...] -> [B, bq, ...]
        return lax.dynamic_slice_in_dim(x, i * self.bq, self.bq, axis=1)

    def k_tile(self, x, j):
        return lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, axis=1)

    def pos(self, i):  # [B, bq] int32
        return i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)[None, :] + self.off[:, None]

    def seg(self, i, j):
        if self.q_seg is None:
            return None, None
        return self.q_tile(self.q_seg, i), self.k_tile(self.kv_seg, j)

    def key_range(self, mask, i):
        return key_block_range(mask, i * self.bq + self.off_lo,
                               i * self.bq + self.bq - 1 + self.off_hi, self.bk, self.nk)

    def query_range(self, mask, j):
        return query_block_range(mask, j * self.bk, j * self.bk + self.bk - 1, self.off_lo,
                                 self.off_hi, self.bq, self.nq)


def _stack_q_tiles(x, p: _Prepared):  # [nq, B, bq, ...] -> [B, T, ...]
    x = jnp.moveaxis(x, 0, 1)
    x = x.reshape((p.b, p.tp) + x.shape[3:])
    return x[:, :p.t]


def _stack_k_tiles(x, p: _Prepared):
    x = jnp.moveaxis(x, 0, 1)
    x = x.reshape((p.b, p.sp) + x.shape[3:])
    return x[:, :p.s]


def flash_attention_fwd(q, k, v, q_seg, kv_seg, off, *, mask: AttentionMask, scale: float,
                        block_q: int, block_k: int):
    """Returns (o [B,T,Hq,Dv] in q.dtype, lse [B,T,Hq] float32)."""
    p = _Prepared(q, k, v, q_seg, kv_seg, off, block_q, block_k)
    dv = v.shape[-1]

    def q_tile(i):
        qc, pos_c = p.q_tile(p.q, i), p.pos(i)
        lo, hi = p.key_range(mask, i)

        def body(j, carry):
            m, l, acc = carry
            kc, vc = p.k_tile(p.k, j), p.k_tile(p.v, j)
            qseg_c, kvseg_c = p.seg(i, j)
            vis = _tile_visible(mask, pos_c, j * p.bk, p.bk, p.s, qseg_c, kvseg_c)
            s = jnp.where(vis, _logits(qc, kc, scale), -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            corr = jnp.exp(m - m_safe)
            e = jnp.exp(s - m_safe[..., None])
            l = l * corr + jnp.sum(e, axis=-1)
            pv = jnp.einsum("bhgqk,bkhd->bhgqd", e.astype(v.dtype), vc,
                            preferred_element_type=jnp.float32)
            return m_new, l, acc * corr[..., None] + pv

        shape = (p.b, p.hkv, p.g, p.bq)
        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(shape + (dv,), jnp.float32))
        m, l, acc = lax.fori_loop(lo, hi, body, init)
        nonempty = l > 0
        o_c = acc / jnp.where(nonempty, l, 1.0)[..., None]
        lse_c = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)
        o_c = jnp.transpose(o_c, (0, 3, 1, 2, 4)).reshape(p.b, p.bq, p.hq, dv)
        lse_c = jnp.transpose(lse_c, (0, 3, 1, 2)).reshape(p.b, p.bq, p.hq)
        return o_c.astype(q.dtype), lse_c

    o, lse = lax.map(q_tile, jnp.arange(p.nq, dtype=jnp.int32))
    return _stack_q_tiles(o, p), _stack_q_tiles(lse, p)


def flash_attention_bwd(q, k, v, q_seg, kv_seg, off, lse, delta, do, *, mask: AttentionMask,
                        scale: float, block_sizes_dq: tuple[int, int],
                        block_sizes_dkv: tuple[int, int]):
    """Returns (dq, dk, dv) in the dtypes of q, k, v, recomputing probabilities from lse.

    delta [B,T,Hq] float32 = sum(o * do, -1) (minus any lse cotangent), computed by the caller.
    """
    dq = _dq_pass(q, k, v, q_seg, kv_seg, off, lse, delta, do, mask, scale, *block_sizes_dq)
    dk, dv = _dkv_pass(q, k, v, q_seg, kv_seg, off, lse, delta, do, mask, scale,
                       *block_sizes_dkv)
    return dq, dk, dv


def _grouped_rows(x, p: _Prepared, value):
    """[B,T,Hq] -> padded [B,Tp,Hkv,G] with `value` in padding rows."""
    return _pad_axis(x, 1, p.tp, value).reshape(p.b, p.tp, p.hkv, p.g)


def _probs(p: _Prepared, mask, scale, qc, kc, i, j, lse_c):
    """Recomputed probabilities [B,Hkv,G,bq,bk] of query tile i against key tile j."""
    qseg_c, kvseg_c = p.seg(i, j)
    vis = _tile_visible(mask, p.pos(i), j * p.bk, p.bk, p.s, qseg_c, kvseg_c)
    lse_t = jnp.transpose(lse_c, (0, 2, 3, 1))[..., None]  # [B,Hkv,G,bq,1]
    lse_t = jnp.where(lse_t == -jnp.inf, jnp.inf, lse_t)  # empty rows: p = 0
    return jnp.where(vis, jnp.exp(_logits(qc, kc, scale) - lse_t), 0.0)


def _dq_pass(q, k, v, q_seg, kv_seg, off, lse, delta, do, mask, scale, block_q, block_k):
    p = _Prepared(q, k, v, q_seg, kv_seg, off, block_q, block_k)
    lse_g = _grouped_rows(lse, p, -jnp.inf)
    delta_g = _grouped_rows(delta, p, 0.0)
    do_g = _pad_axis(do, 1, p.tp).reshape(p.b, p.tp, p.hkv, p.g, -1)
    dk_dim = q.shape[-1]

    def q_tile(i):
        qc, do_c = p.q_tile(p.q, i), p.q_tile(do_g, i)
        lse_c, delta_c = p.q_tile(lse_g, i), p.q_tile(delta_g, i)
        delta_t = jnp.transpose(delta_c, (0, 2, 3, 1))[..., None]
        lo, hi = p.key_range(mask, i)

        def body(j, dq):
            kc, vc = p.k_tile(p.k, j), p.k_tile(p.v, j)
            pr = _probs(p, mask, scale, qc, kc, i, j, lse_c)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_c, vc, preferred_element_type=jnp.float32)
            ds = pr * (dp - delta_t) * scale
            return dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), kc,
                                   preferred_element_type=jnp.float32)

        dq = lax.fori_loop(lo, hi, body, jnp.zeros((p.b, p.bq, p.hkv, p.g, dk_dim), jnp.float32))
        return dq.reshape(p.b, p.bq, p.hq, dk_dim).astype(q.dtype)

    return _stack_q_tiles(lax.map(q_tile, jnp.arange(p.nq, dtype=jnp.int32)), p)


def _dkv_pass(q, k, v, q_seg, kv_seg, off, lse, delta, do, mask, scale, block_q, block_k):
    p = _Prepared(q, k, v, q_seg, kv_seg, off, block_q, block_k)
    lse_g = _grouped_rows(lse, p, -jnp.inf)
    delta_g = _grouped_rows(delta, p, 0.0)
    do_g = _pad_axis(do, 1, p.tp).reshape(p.b, p.tp, p.hkv, p.g, -1)
    dk_dim, dv_dim = k.shape[-1], v.shape[-1]

    def k_tile(j):
        kc, vc = p.k_tile(p.k, j), p.k_tile(p.v, j)
        lo, hi = p.query_range(mask, j)

        def body(i, carry):
            dk, dv = carry
            qc, do_c = p.q_tile(p.q, i), p.q_tile(do_g, i)
            lse_c, delta_c = p.q_tile(lse_g, i), p.q_tile(delta_g, i)
            delta_t = jnp.transpose(delta_c, (0, 2, 3, 1))[..., None]
            pr = _probs(p, mask, scale, qc, kc, i, j, lse_c)
            dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", pr.astype(do.dtype), do_c,
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_c, vc, preferred_element_type=jnp.float32)
            ds = pr * (dp - delta_t) * scale
            dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), qc,
                                 preferred_element_type=jnp.float32)
            return dk, dv

        init = (jnp.zeros((p.b, p.bk, p.hkv, dk_dim), jnp.float32),
                jnp.zeros((p.b, p.bk, p.hkv, dv_dim), jnp.float32))
        dk, dv = lax.fori_loop(lo, hi, body, init)
        return dk.astype(k.dtype), dv.astype(v.dtype)

    dk, dv = lax.map(k_tile, jnp.arange(p.nk, dtype=jnp.int32))
    return _stack_k_tiles(dk, p), _stack_k_tiles(dv, p)
