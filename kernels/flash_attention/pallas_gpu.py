"""flash_attention as Pallas kernels for NVIDIA GPUs (Triton lowering): forward, dQ, dK/dV.

Letters: B batch, T queries, S keys, Hq query heads, Hkv KV heads, G = Hq / Hkv (Gp: G rounded up
to a power of two), Dk / Dv head dims (padded to powers of two >= 16 for Triton), tq query
positions per tile, R = tq * Gp packed rows per tile, bk key tile length, Tp / Sp padded lengths,
nq / nk tile counts.

GQA packing: the G query heads sharing a KV head are processed together, so a program loads each
K/V tile once for all G heads. A query tile is the block q[b, t0:t0+tq, g, :, :] of the
[B, T, Hkv, Gp, D] view (a free reshape of [B, T, Hq, D]), flattened in-kernel to R = tq * Gp
rows; row r is query t0 + r // Gp. Grids:
  forward   (B, Hkv, nq): a query tile loops over the key tiles it can see
            (mask.key_block_range), so fully masked tiles are never loaded; writes o and
            lse [B, Tp, Hkv, Gp] (= [B, T, Hq] after a reshape).
  dQ        (B, Hkv, nq): the same loop, accumulating dq in registers.
  dK/dV     (B, Hkv, nk): a key tile loops over the query tiles that can see it
            (mask.query_block_range); dk/dv sum over the G heads inside the tile. No atomics.
Tiles in which every pair is visible (mask.full_key_block_range / full_query_block_range) run a
loop body without the mask arithmetic; only the edge tiles (diagonal, window start, padding) and,
with segment ids, all tiles apply the mask. delta = sum(o * dO) is computed by the caller (api.py).
`block_q` counts packed rows R (query positions times Gp), `block_k` keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from aiinfra_jax.kernels.flash_attention.mask import (AttentionMask, full_key_block_range,
                                                      full_query_block_range, key_block_range,
                                                      query_block_range, visible,
                                                      visible_counts)
from aiinfra_jax.kernels.flash_attention.tuning import next_pow2, round_up
from .._util import dot_precision, pad_axis as _pad


def _dot(a, b):
    """a @ b accumulated in float32; float32 operands at full precision (not TF32)."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=dot_precision(b.dtype))

_MIN = 16  # smallest Triton dot dimension




class _Geometry:
    """Tile sizes and padded shapes for one kernel launch."""

    def __init__(self, q_shape, k_shape, dv: int, block_q: int, block_k: int):
        b, t, hq, dk = q_shape
        s, hkv = k_shape[1], k_shape[2]
        self.b, self.t, self.s, self.hq, self.hkv, self.g = b, t, s, hq, hkv, hq // hkv
        self.gp = next_pow2(self.g)
        rows = max(next_pow2(block_q), _MIN, self.gp)
        self.tq = min(rows // self.gp, next_pow2(t))
        self.tq = max(self.tq, -(-_MIN // self.gp))
        self.rows = self.tq * self.gp
        self.bk = max(_MIN, min(next_pow2(block_k), next_pow2(s)))
        self.tp, self.sp = round_up(t, self.tq), round_up(s, self.bk)
        self.nq, self.nk = self.tp // self.tq, self.sp // self.bk
        self.dk, self.dv = dk, dv
        self.dkp, self.dvp = max(_MIN, next_pow2(dk)), max(_MIN, next_pow2(dv))

    def pack_q(self, x, d_pad: int):
        """[B, T, Hq, D] -> [B, Tp, Hkv, Gp, Dpad] (zero padding)."""
        x = _pad(_pad(x, 3, d_pad), 1, self.tp)
        return _pad(x.reshape(self.b, self.tp, self.hkv, self.g, d_pad), 3, self.gp)

    def pack_rows(self, x, value):
        """[B, T, Hq] -> [B, Tp, Hkv, Gp] (`value` in padding)."""
        x = _pad(x, 1, self.tp, value).reshape(self.b, self.tp, self.hkv, self.g)
        return _pad(x, 3, self.gp, value)

    def pad_kv(self, x, d_pad: int):
        return _pad(_pad(x, 3, d_pad), 1, self.sp)

    def unpack_q(self, x, d: int):
        """[B, Tp, Hkv, Gp, Dpad] -> [B, T, Hq, D]."""
        return x[:, :self.t, :, :self.g, :d].reshape(self.b, self.t, self.hq, d)


def _cost(geo: _Geometry, mask, itemsize, flops_per_pair, kv_reads):
    pairs = int(visible_counts(mask, geo.t, geo.s).sum()) * geo.b * geo.hq
    bytes_ = itemsize * (geo.b * geo.t * geo.hq * (geo.dk + geo.dv) * 2
                         + kv_reads * geo.b * geo.hkv * geo.s * (geo.dk + geo.dv))
    return pl.CostEstimate(flops=int(flops_per_pair * pairs), transcendentals=int(pairs),
                           bytes_accessed=int(bytes_))


def _seg_specs(q_seg, q_block, kv_block, q_map, kv_map):
    if q_seg is None:
        return [None, None]
    return [pl.BlockSpec(q_block, q_map), pl.BlockSpec(kv_block, kv_map)]


def _row_positions(t0, off, rows: int, gp: int):
    """Position of each packed row (row r is query t0 + r // gp)."""
    return t0 + off + lax.div(jnp.arange(rows, dtype=jnp.int32), jnp.int32(gp))


def _row_segments(qseg_ref, rows: int, tq: int, gp: int):
    if qseg_ref is None:
        return None
    return jnp.broadcast_to(qseg_ref[...][:, None], (tq, gp)).reshape(rows)


def _flat(ref, rows: int):
    """Loads a packed [tq, Gp, ...] block as [rows, ...]."""
    x = ref[...]
    return x.reshape((rows,) + x.shape[2:])


def _full_range(mask, pos_lo, pos_hi, bk, kv_len, lo, hi, seg_ref):
    if seg_ref is not None:  # segment edges can fall anywhere: mask every tile
        return hi, hi
    return full_key_block_range(mask, pos_lo, pos_hi, bk, kv_len, lo, hi)


def _three_loops(lo, f_lo, f_hi, hi, body, carry):
    """Tiles [lo, f_lo) and [f_hi, hi) apply the mask; [f_lo, f_hi) are fully visible."""
    carry = lax.fori_loop(lo, f_lo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(f_lo, f_hi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(f_hi, hi, functools.partial(body, masked=True), carry)


def _tile_visible(mask, pos, k0, bk, kv_len, qseg, kvseg):
    vis = visible(mask, pos[:, None], (k0 + jnp.arange(bk, dtype=jnp.int32))[None, :], kv_len)
    if qseg is not None:
        vis = jnp.logical_and(vis, qseg[:, None] == kvseg[None, :])
    return vis


# ----------------------------------------------------------------------------- forward

def _fwd_kernel(off_ref, q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, o_ref, lse_ref, *,
                mask: AttentionMask, scale: float, tq: int, gp: int, bk: int, nk: int,
                kv_len: int):
    rows = tq * gp
    off = off_ref[...]
    t0 = pl.program_id(2) * tq
    pos = _row_positions(t0, off, rows, gp)
    lo, hi = key_block_range(mask, t0 + off, t0 + tq - 1 + off, bk, nk)
    f_lo, f_hi = _full_range(mask, t0 + off, t0 + tq - 1 + off, bk, kv_len, lo, hi, qseg_ref)
    q = _flat(q_ref, rows)
    qseg = _row_segments(qseg_ref, rows, tq, gp)

    def body(j, carry, masked: bool):
        m, l, acc = carry
        ks = pl.ds(j * bk, bk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s = _dot(q, k.T) * scale
        if masked:
            kvseg = None if qseg is None else kvseg_ref[ks]
            s = jnp.where(_tile_visible(mask, pos, j * bk, bk, kv_len, qseg, kvseg), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        corr = jnp.exp(m - m_safe)
        e = jnp.exp(s - m_safe[:, None])
        l = l * corr + jnp.sum(e, axis=1)
        acc = acc * corr[:, None] + _dot(e.astype(v.dtype), v)
        return m_new, l, acc

    dvp = v_ref.shape[-1]
    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, dvp), jnp.float32))
    m, l, acc = _three_loops(lo, f_lo, f_hi, hi, body, init)
    nonempty = l > 0
    l_safe = jnp.where(nonempty, l, 1.0)
    o = (acc / l_safe[:, None]).astype(o_ref.dtype)
    o_ref[...] = o.reshape(tq, gp, dvp)
    lse_ref[...] = jnp.where(nonempty, m + jnp.log(l_safe), -jnp.inf).reshape(tq, gp)


def flash_attention_fwd(q, k, v, q_seg, kv_seg, off, *, mask: AttentionMask, scale: float,
                        block_q: int, block_k: int, interpret: bool = False,
                        num_warps: int | None = None, num_stages: int = 2):
    """Returns (o [B,T,Hq,Dv] in q.dtype, lse [B,T,Hq] float32)."""
    geo = _Geometry(q.shape, k.shape, v.shape[-1], block_q, block_k)
    tq, gp, dkp, dvp = geo.tq, geo.gp, geo.dkp, geo.dvp
    q_map = lambda bi, h, i: (bi, i, h, 0, 0)  # noqa: E731
    kv_map = lambda bi, h, i: (bi, 0, h, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((None,), lambda bi, h, i: (bi,)),
        pl.BlockSpec((None, tq, None, gp, dkp), q_map),
        pl.BlockSpec((None, geo.sp, None, dkp), kv_map),
        pl.BlockSpec((None, geo.sp, None, dvp), kv_map),
    ] + _seg_specs(q_seg, (None, tq), (None, geo.sp), lambda bi, h, i: (bi, i),
                   lambda bi, h, i: (bi, 0))
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, mask=mask, scale=scale, tq=tq, gp=gp, bk=geo.bk,
                          nk=geo.nk, kv_len=geo.s),
        grid=(geo.b, geo.hkv, geo.nq),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, tq, None, gp, dvp), q_map),
                   pl.BlockSpec((None, tq, None, gp), lambda bi, h, i: (bi, i, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((geo.b, geo.tp, geo.hkv, gp, dvp), q.dtype),
                   jax.ShapeDtypeStruct((geo.b, geo.tp, geo.hkv, gp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or (4 if max(dkp, dvp) <= 64 else 8), num_stages=num_stages),
        cost_estimate=_cost(geo, mask, q.dtype.itemsize, 2 * (geo.dk + geo.dv), kv_reads=1),
        interpret=interpret,
        name="flash_attention_fwd",
    )(off, geo.pack_q(q, dkp), geo.pad_kv(k, dkp), geo.pad_kv(v, dvp),
      _pad(q_seg, 1, geo.tp), _pad(kv_seg, 1, geo.sp, -1))
    lse = lse[:, :geo.t, :, :geo.g].reshape(geo.b, geo.t, geo.hq)
    return geo.unpack_q(o, geo.dv), lse


# ----------------------------------------------------------------------------- backward

def _probs(q, k, lse, scale, masked: bool, vis_fn):
    s = _dot(q, k.T) * scale
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # empty rows: p = 0
    p = jnp.exp(s - lse[:, None])
    return jnp.where(vis_fn(), p, 0.0) if masked else p


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref,
               dq_ref, *, mask, scale, tq, gp, bk, nk, kv_len):
    rows = tq * gp
    off = off_ref[...]
    t0 = pl.program_id(2) * tq
    pos = _row_positions(t0, off, rows, gp)
    lo, hi = key_block_range(mask, t0 + off, t0 + tq - 1 + off, bk, nk)
    f_lo, f_hi = _full_range(mask, t0 + off, t0 + tq - 1 + off, bk, kv_len, lo, hi, qseg_ref)
    q, do = _flat(q_ref, rows), _flat(do_ref, rows)
    lse, delta = _flat(lse_ref, rows), _flat(delta_ref, rows)
    qseg = _row_segments(qseg_ref, rows, tq, gp)

    def body(j, dq, masked: bool):
        ks = pl.ds(j * bk, bk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        kvseg = None if qseg is None else kvseg_ref[ks]
        p = _probs(q, k, lse, scale, masked,
                   lambda: _tile_visible(mask, pos, j * bk, bk, kv_len, qseg, kvseg))
        dp = _dot(do, v.T)
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = _three_loops(lo, f_lo, f_hi, hi, body, jnp.zeros((rows, q.shape[-1]), jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype).reshape(tq, gp, q.shape[-1])


def _dkv_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref,
                dk_ref, dv_ref, *, mask, scale, tq, gp, bk, nq, kv_len):
    rows = tq * gp
    j = pl.program_id(2)
    off = off_ref[...]
    k, v = k_ref[...], v_ref[...]
    kvseg = None if kvseg_ref is None else kvseg_ref[...]
    lo, hi = query_block_range(mask, j * bk, j * bk + bk - 1, off, off, tq, nq)
    if kvseg_ref is None:
        f_lo, f_hi = full_query_block_range(mask, j * bk, j * bk + bk - 1, off, tq, lo, hi,
                                            (j + 1) * bk > kv_len)
    else:
        f_lo = f_hi = hi

    def body(i, carry, masked: bool):
        dk, dv = carry
        sl = pl.ds(i * tq, tq)
        q = q_ref[sl, :, :].reshape(rows, q_ref.shape[-1])
        do = do_ref[sl, :, :].reshape(rows, do_ref.shape[-1])
        lse = lse_ref[sl, :].reshape(rows)
        delta = delta_ref[sl, :].reshape(rows)
        pos = _row_positions(i * tq, off, rows, gp)

        def vis_fn():
            qseg = (None if kvseg is None else
                    jnp.broadcast_to(qseg_ref[sl][:, None], (tq, gp)).reshape(rows))
            return _tile_visible(mask, pos, j * bk, bk, kv_len, qseg, kvseg)

        p = _probs(q, k, lse, scale, masked, vis_fn)
        dv = dv + _dot(p.astype(do.dtype).T, do)
        dp = _dot(do, v.T)
        ds = p * (dp - delta[:, None])
        dk = dk + _dot(ds.astype(q.dtype).T, q)
        return dk, dv

    init = (jnp.zeros(k_ref.shape, jnp.float32), jnp.zeros(v_ref.shape, jnp.float32))
    dk, dv = _three_loops(lo, f_lo, f_hi, hi, body, init)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def flash_attention_bwd(q, k, v, q_seg, kv_seg, off, lse, delta, do, *, mask: AttentionMask,
                        scale: float, block_sizes_dq: tuple[int, int],
                        block_sizes_dkv: tuple[int, int], interpret: bool = False,
                        num_warps: int | None = None, num_stages: int = 2):
    """Returns (dq, dk, dv); delta [B,T,Hq] f32 = sum(o * do, -1) (minus any lse cotangent)."""
    dv_dim = v.shape[-1]
    outs = []
    for kind, (block_q, block_k) in (("dq", block_sizes_dq), ("dkv", block_sizes_dkv)):
        geo = _Geometry(q.shape, k.shape, dv_dim, block_q, block_k)
        tq, gp, dkp, dvp = geo.tq, geo.gp, geo.dkp, geo.dvp
        warps = num_warps or (4 if max(dkp, dvp) <= 64 else 8)
        args = (off, geo.pack_q(q, dkp), geo.pad_kv(k, dkp), geo.pad_kv(v, dvp),
                geo.pack_q(do, dvp), geo.pack_rows(lse, -jnp.inf), geo.pack_rows(delta, 0.0),
                _pad(q_seg, 1, geo.tp), _pad(kv_seg, 1, geo.sp, -1))
        if kind == "dq":
            q_map = lambda bi, h, i: (bi, i, h, 0, 0)  # noqa: E731
            row_map = lambda bi, h, i: (bi, i, h, 0)  # noqa: E731
            kv_map = lambda bi, h, i: (bi, 0, h, 0)  # noqa: E731
            in_specs = [
                pl.BlockSpec((None,), lambda bi, h, i: (bi,)),
                pl.BlockSpec((None, tq, None, gp, dkp), q_map),
                pl.BlockSpec((None, geo.sp, None, dkp), kv_map),
                pl.BlockSpec((None, geo.sp, None, dvp), kv_map),
                pl.BlockSpec((None, tq, None, gp, dvp), q_map),
                pl.BlockSpec((None, tq, None, gp), row_map),
                pl.BlockSpec((None, tq, None, gp), row_map),
            ] + _seg_specs(q_seg, (None, tq), (None, geo.sp), lambda bi, h, i: (bi, i),
                           lambda bi, h, i: (bi, 0))
            dq = pl.pallas_call(
                functools.partial(_dq_kernel, mask=mask, scale=scale, tq=tq, gp=gp, bk=geo.bk,
                                  nk=geo.nk, kv_len=geo.s),
                grid=(geo.b, geo.hkv, geo.nq),
                in_specs=in_specs,
                out_specs=pl.BlockSpec((None, tq, None, gp, dkp), q_map),
                out_shape=jax.ShapeDtypeStruct((geo.b, geo.tp, geo.hkv, gp, dkp), q.dtype),
                compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=num_stages),
                cost_estimate=_cost(geo, mask, q.dtype.itemsize, 2 * (2 * geo.dk + geo.dv),
                                    kv_reads=1),
                interpret=interpret,
                name="flash_attention_dq",
            )(*args)
            outs.append(geo.unpack_q(dq, geo.dk))
        else:
            qg_map = lambda bi, h, j: (bi, 0, h, 0, 0)  # noqa: E731
            rowg_map = lambda bi, h, j: (bi, 0, h, 0)  # noqa: E731
            k_map = lambda bi, h, j: (bi, j, h, 0)  # noqa: E731
            in_specs = [
                pl.BlockSpec((None,), lambda bi, h, j: (bi,)),
                pl.BlockSpec((None, geo.tp, None, gp, dkp), qg_map),
                pl.BlockSpec((None, geo.bk, None, dkp), k_map),
                pl.BlockSpec((None, geo.bk, None, dvp), k_map),
                pl.BlockSpec((None, geo.tp, None, gp, dvp), qg_map),
                pl.BlockSpec((None, geo.tp, None, gp), rowg_map),
                pl.BlockSpec((None, geo.tp, None, gp), rowg_map),
            ] + _seg_specs(q_seg, (None, geo.tp), (None, geo.bk), lambda bi, h, j: (bi, 0),
                           lambda bi, h, j: (bi, j))
            dk_out, dv_out = pl.pallas_call(
                functools.partial(_dkv_kernel, mask=mask, scale=scale, tq=tq, gp=gp, bk=geo.bk,
                                  nq=geo.nq, kv_len=geo.s),
                grid=(geo.b, geo.hkv, geo.nk),
                in_specs=in_specs,
                out_specs=[pl.BlockSpec((None, geo.bk, None, dkp), k_map),
                           pl.BlockSpec((None, geo.bk, None, dvp), k_map)],
                out_shape=[jax.ShapeDtypeStruct((geo.b, geo.sp, geo.hkv, dkp), k.dtype),
                           jax.ShapeDtypeStruct((geo.b, geo.sp, geo.hkv, dvp), v.dtype)],
                compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=num_stages),
                cost_estimate=_cost(geo, mask, q.dtype.itemsize,
                                    2 * (2 * geo.dk + 2 * geo.dv), kv_reads=1),
                interpret=interpret,
                name="flash_attention_dkv",
            )(*args)
            outs += [dk_out[:, :geo.s, :, :geo.dk], dv_out[:, :geo.s, :, :geo.dv]]
    return tuple(outs)
