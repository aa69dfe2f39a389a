"""Chunked flash attention in plain JAX: online softmax over key tiles, hand-written backward.

Letters: B batch, T queries, S keys, Hkv KV heads, G query heads per KV head (Hq = G * Hkv),
Dk / Dv head dims, bq / bk query / key tile lengths, nq / nk tile counts, R = B * Hkv.

No [T, S] buffer exists: a query tile loops (lax.fori_loop with traced bounds) over only the key
tiles it can see (causal / window / compressed ranges from mask.key_block_range). The backward is
one pass: a key tile loops over only the query tiles that can see it, accumulating dK / dV in
registers of the loop and adding each tile's dQ into a float32 buffer, so QK^T, the
probabilities and dP are computed once per tile pair (five matmuls per pair, not seven as with
separate dQ and dK/dV passes). Rows with no visible key give o = 0, lse = -inf and zero
gradients.

Shaped for XLA:CPU, where each op of the loop body is a pass over the [R, G*bq, bk] score tile
(measured in eval/BENCHMARKS.md, "Dense flash_attention on the CPU"):
  - operands are made head-major once per call ([R, G, T, D] queries, [R, S, D] keys), so a tile
    is a contiguous slice and the G query heads of a KV group form one matmul of G*bq rows;
  - tiles that every query of the tile sees whole (mask.full_key_block_range) skip the mask;
  - the softmax scale is applied inside the exp (max commutes with a positive scale), not as a
    pass of its own;
  - V carries a column of ones, so the PV matmul also sums the probabilities (no sum pass).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from aiinfra_jax.kernels.flash_attention.mask import (AttentionMask, full_key_block_range,
                                                      full_query_block_range, key_block_range,
                                                      query_block_range, visible)
from aiinfra_jax.kernels.flash_attention.tuning import round_up
from .._util import pad_axis as _pad_axis


def _tiles(q_len: int, kv_len: int, block_q: int, block_k: int):
    bq = min(block_q, round_up(q_len, 8))
    bk = min(block_k, round_up(kv_len, 8))
    return bq, bk, -(-q_len // bq), -(-kv_len // bk)


def _logits(qc, kc):  # [R, G*bq, Dk] x [R, bk, Dk] -> [R, G*bq, bk] float32, unscaled
    return jnp.einsum("rqd,rkd->rqk", qc, kc, preferred_element_type=jnp.float32)


class _Prepared:
    """Padded, head-major operands and the tile arithmetic shared by forward and backward."""

    def __init__(self, q, k, v, q_seg, kv_seg, off, block_q, block_k):
        b, t, hq, _ = q.shape
        s, hkv = k.shape[1], k.shape[2]
        self.b, self.t, self.s, self.hq, self.hkv, self.g = b, t, s, hq, hkv, hq // hkv
        self.bq, self.bk, self.nq, self.nk = _tiles(t, s, block_q, block_k)
        self.tp, self.sp = self.nq * self.bq, self.nk * self.bk
        self.q = self.heads_q(q)
        self.k = self.heads_k(k)
        self.v = self.heads_k(v)
        self.q_seg = _pad_axis(q_seg, 1, self.tp)
        self.kv_seg = _pad_axis(kv_seg, 1, self.sp, value=-1)
        self.off = off
        self.off_lo, self.off_hi = jnp.min(off), jnp.max(off)

    # Layouts. Queries and per-row values go to [R, G, Tp(, D)], keys to [R, Sp, D]; a query tile
    # is [R, G*bq(, D)], a key tile [R, bk, D].
    def heads_q(self, x, value=0):
        """[B, T, Hq(, D)] -> [R, G, Tp(, D)], padded with `value`."""
        x = _pad_axis(x, 1, self.tp, value)
        x = x.reshape((self.b, self.tp, self.hkv, self.g) + x.shape[3:])
        x = jnp.moveaxis(x, 1, 3)
        return x.reshape((self.b * self.hkv, self.g, self.tp) + x.shape[4:])

    def heads_k(self, x):
        """[B, S, Hkv, D] -> [R, Sp, D]."""
        x = jnp.moveaxis(_pad_axis(x, 1, self.sp), 2, 1)
        return x.reshape((self.b * self.hkv, self.sp) + x.shape[3:])

    def unheads_q(self, x):
        """[R, G, Tp(, D)] -> [B, T, Hq(, D)]."""
        x = x.reshape((self.b, self.hkv, self.g, self.tp) + x.shape[3:])
        x = jnp.moveaxis(x, 3, 1).reshape((self.b, self.tp, self.hq) + x.shape[4:])
        return x[:, :self.t]

    def unheads_k(self, x):
        """[R, Sp, D] -> [B, S, Hkv, D]."""
        x = x.reshape((self.b, self.hkv) + x.shape[1:])
        return jnp.moveaxis(x, 1, 2)[:, :self.s]

    def q_tile(self, x, i):
        """Rows of query tile i from [R, G, Tp(, D)], as [R, G*bq(, D)]."""
        x = lax.dynamic_slice_in_dim(x, i * self.bq, self.bq, axis=2)
        return x.reshape((x.shape[0], self.g * self.bq) + x.shape[3:])

    def k_tile(self, x, j):
        return lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, axis=1)

    def add_q_tile(self, buf, i, x):
        """buf [R, G, Tp, D] with x [R, G*bq, D] added into query tile i's rows (in place)."""
        x = x.reshape((x.shape[0], self.g, self.bq) + x.shape[2:])
        start = (0, 0, i * self.bq, 0)
        return lax.dynamic_update_slice(buf, lax.dynamic_slice(buf, start, x.shape) + x, start)

    # Masks and tile ranges.
    def visible(self, mask, i, j):
        """[B or R, G*bq, bk] visibility of key tile j for the rows of query tile i (broadcasts
        over the score tile)."""
        pos = i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)[None, :] + self.off[:, None]
        kidx = j * self.bk + jnp.arange(self.bk, dtype=jnp.int32)
        vis = visible(mask, pos[:, :, None], kidx[None, None, :], self.s)  # [B, bq, bk]
        if self.q_seg is not None:
            qs = lax.dynamic_slice_in_dim(self.q_seg, i * self.bq, self.bq, axis=1)
            ks = lax.dynamic_slice_in_dim(self.kv_seg, j * self.bk, self.bk, axis=1)
            vis = jnp.logical_and(vis, qs[:, :, None] == ks[:, None, :])
        vis = jnp.broadcast_to(vis, (self.b, self.bq, self.bk))
        if self.hkv * self.g > 1:
            vis = jnp.broadcast_to(vis[:, None, None], (self.b, self.hkv, self.g) + vis.shape[1:])
        return vis.reshape(self.b * self.hkv, self.g * self.bq, self.bk)

    def key_ranges(self, mask, i):
        """(lo, f_lo, f_hi, hi): query tile i sees key tiles [lo, hi), of which [f_lo, f_hi)
        whole (mask skipped); no whole tiles under segment ids, which are data."""
        pos_lo, pos_hi = i * self.bq + self.off_lo, i * self.bq + self.bq - 1 + self.off_hi
        lo, hi = key_block_range(mask, pos_lo, pos_hi, self.bk, self.nk)
        if self.q_seg is not None:
            return lo, hi, hi, hi
        f_lo, f_hi = full_key_block_range(mask, pos_lo, pos_hi, self.bk, self.s, lo, hi)
        return lo, f_lo, f_hi, hi

    def query_ranges(self, mask, j):
        """(lo, f_lo, f_hi, hi): query tiles [lo, hi) see key tile j, [f_lo, f_hi) whole."""
        k_first, k_last = j * self.bk, j * self.bk + self.bk - 1
        lo, hi = query_block_range(mask, k_first, k_last, self.off_lo, self.off_hi, self.bq,
                                   self.nq)
        if self.q_seg is not None:
            return lo, hi, hi, hi
        padded = k_last >= self.s
        # Every row must see the tile: the causal bound from the smallest offset, the window
        # bound from the largest.
        f_lo, _ = full_query_block_range(mask, k_first, k_last, self.off_lo, self.bq, lo, hi,
                                         padded)
        _, f_hi = full_query_block_range(mask, k_first, k_last, self.off_hi, self.bq, lo, hi,
                                         padded)
        f_lo = jnp.minimum(f_lo, hi)
        return lo, f_lo, jnp.maximum(f_hi, f_lo), hi


def _three_loops(body, lo, f_lo, f_hi, hi, carry):
    """fori over [lo, hi): masked edges [lo, f_lo) and [f_hi, hi), unmasked [f_lo, f_hi)."""
    carry = lax.fori_loop(lo, f_lo, body(True), carry)
    carry = lax.fori_loop(f_lo, f_hi, body(False), carry)
    return lax.fori_loop(f_hi, hi, body(True), carry)


def flash_attention_fwd(q, k, v, q_seg, kv_seg, off, *, mask: AttentionMask, scale: float,
                        block_q: int, block_k: int):
    """Returns (o [B,T,Hq,Dv] in q.dtype, lse [B,T,Hq] float32)."""
    p = _Prepared(q, k, v, q_seg, kv_seg, off, block_q, block_k)
    dv = v.shape[-1]
    v1 = jnp.concatenate([p.v, jnp.ones(p.v.shape[:-1] + (1,), v.dtype)], axis=-1)

    def q_tile(i):
        qc = p.q_tile(p.q, i)

        def body(masked):
            def step(j, carry):
                m, acc = carry
                s = _logits(qc, p.k_tile(p.k, j))
                if masked:
                    s = jnp.where(p.visible(mask, i, j), s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                e = jnp.exp((s - m_safe[..., None]) * scale)
                pv = jnp.einsum("rqk,rkd->rqd", e.astype(v.dtype), p.k_tile(v1, j),
                                preferred_element_type=jnp.float32)
                return m_new, acc * jnp.exp((m - m_safe) * scale)[..., None] + pv
            return step

        rows = (p.b * p.hkv, p.g * p.bq)
        init = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows + (dv + 1,), jnp.float32))
        m, acc = _three_loops(body, *p.key_ranges(mask, i), init)
        l = acc[..., dv]
        nonempty = l > 0
        o_c = acc[..., :dv] / jnp.where(nonempty, l, 1.0)[..., None]
        lse_c = jnp.where(nonempty, m * scale + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)
        shape = (rows[0], p.g, p.bq)
        return o_c.astype(q.dtype).reshape(shape + (dv,)), lse_c.reshape(shape)

    o, lse = lax.map(q_tile, jnp.arange(p.nq, dtype=jnp.int32))  # [nq, R, G, bq(, Dv)]
    o, lse = (jnp.moveaxis(x, 0, 2) for x in (o, lse))  # [R, G, nq, bq(, Dv)]
    o = o.reshape(o.shape[:2] + (p.tp, dv))
    return p.unheads_q(o), p.unheads_q(lse.reshape(lse.shape[:2] + (p.tp,)))


def flash_attention_bwd(q, k, v, q_seg, kv_seg, off, lse, delta, do, *, mask: AttentionMask,
                        scale: float, block_sizes_dq: tuple[int, int],
                        block_sizes_dkv: tuple[int, int]):
    """Returns (dq, dk, dv) in the dtypes of q, k, v, recomputing probabilities from lse.

    delta [B,T,Hq] float32 = sum(o * do, -1) (minus any lse cotangent), computed by the caller.
    One fused pass over the dK/dV tiles (`block_sizes_dkv`); `block_sizes_dq` is accepted for
    the backends with a separate dQ kernel and unused here.
    """
    del block_sizes_dq
    p = _Prepared(q, k, v, q_seg, kv_seg, off, *block_sizes_dkv)
    do_h = p.heads_q(do)
    # Rows with no visible key (lse = -inf, also the padding rows) get p = exp(s - inf) = 0.
    lse_h = p.heads_q(jnp.where(lse == -jnp.inf, jnp.inf, lse), jnp.inf)
    delta_h = p.heads_q(delta)
    dk_dim, dv_dim = k.shape[-1], v.shape[-1]

    def k_tile(j, bufs):
        kc, vc = p.k_tile(p.k, j), p.k_tile(p.v, j)

        def body(masked):
            def step(i, carry):
                dk, dv, dq = carry
                qc, do_c = p.q_tile(p.q, i), p.q_tile(do_h, i)
                lse_c, delta_c = p.q_tile(lse_h, i), p.q_tile(delta_h, i)
                pr = jnp.exp(_logits(qc, kc) * scale - lse_c[..., None])
                if masked:
                    pr = jnp.where(p.visible(mask, i, j), pr, 0.0)
                dv = dv + jnp.einsum("rqk,rqd->rkd", pr.astype(do.dtype), do_c,
                                     preferred_element_type=jnp.float32)
                dp = jnp.einsum("rqd,rkd->rqk", do_c, vc, preferred_element_type=jnp.float32)
                ds = (pr * (dp - delta_c[..., None]) * scale).astype(q.dtype)
                dk = dk + jnp.einsum("rqk,rqd->rkd", ds, qc, preferred_element_type=jnp.float32)
                dq_c = jnp.einsum("rqk,rkd->rqd", ds, kc, preferred_element_type=jnp.float32)
                return dk, dv, p.add_q_tile(dq, i, dq_c)
            return step

        dq_buf, dk_buf, dv_buf = bufs
        init = (jnp.zeros((p.b * p.hkv, p.bk, dk_dim), jnp.float32),
                jnp.zeros((p.b * p.hkv, p.bk, dv_dim), jnp.float32), dq_buf)
        dk, dv, dq_buf = _three_loops(body, *p.query_ranges(mask, j), init)
        start = (0, j * p.bk, 0)
        return (dq_buf, lax.dynamic_update_slice(dk_buf, dk.astype(k.dtype), start),
                lax.dynamic_update_slice(dv_buf, dv.astype(v.dtype), start))

    bufs = (jnp.zeros(p.q.shape, jnp.float32),
            jnp.zeros((p.b * p.hkv, p.sp, dk_dim), k.dtype),
            jnp.zeros((p.b * p.hkv, p.sp, dv_dim), v.dtype))
    dq, dk, dv = lax.fori_loop(0, p.nk, k_tile, bufs)
    return p.unheads_q(dq).astype(q.dtype), p.unheads_k(dk), p.unheads_k(dv)
