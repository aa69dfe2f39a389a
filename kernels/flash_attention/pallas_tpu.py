"""flash_attention as Pallas kernels for TPUs (Mosaic lowering): forward, dQ, dK/dV.

Letters: B batch, T queries, S keys, Hq query heads, Hkv KV heads (G = Hq / Hkv), Dk / Dv head
dims, bq / bk tile lengths (bq a multiple of 8 sublanes, bk a multiple of 128 lanes), Tp / Sp padded
lengths, nq / nk tile counts.

The kernels work on [B, H, T, D] (the wrapper transposes) with the key (or query) tile as the
innermost, sequential grid axis and the running softmax state in VMEM scratch. A program holds
the G query heads of one KV group (blocks [G, bq, D]) and loops over them in-kernel, so each K/V
tile is fetched from HBM once per group rather than once per head:
  forward   grid (B, Hkv, nq, nk)
  dQ        grid (B, Hkv, nq, nk)
  dK/dV     grid (B, Hkv, nk, nq): the query tiles are the reduction axis and the G heads are
            summed in-kernel, so dk/dv accumulate in VMEM without atomics.
q_offset is a scalar-prefetch operand: the index maps clamp the streamed tile index into the
visible range (mask.key_block_range / query_block_range), so a fully masked tile is neither
fetched (the block index repeats, so no new DMA) nor computed (pl.when).
Tiles in which every pair is visible skip the mask arithmetic (a second pl.when branch).
Per-row statistics (lse, delta) and segment ids travel as [.., T, 1] columns and [.., 1, S] rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from aiinfra_jax.kernels.flash_attention.mask import (AttentionMask, full_key_block_range,
                                                      full_query_block_range, key_block_range,
                                                      query_block_range, visible,
                                                      visible_counts)
from aiinfra_jax.kernels.flash_attention.tuning import round_up
from .._util import pad_axis as _pad

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
_NN = (((1,), (0,)), ((), ()))  # a @ b




# A program holds [G, bq, .] blocks; cap the packed rows G * bq so the double-buffered blocks and
# the f32 scratch (per-row statistics pad to 128 lanes in VMEM) fit the default scoped VMEM.
_MAX_GROUP_ROWS = 2048


def _tiles(t: int, s: int, block_q: int, block_k: int, g: int):
    bq = round_up(min(block_q, max(8, _MAX_GROUP_ROWS // g), t), 8)
    bk = round_up(min(block_k, s), 128)
    return bq, bk, round_up(t, bq), round_up(s, bk)


def _cost(mask, b, t, s, hq, dk, dv, itemsize, flops_per_pair, kv_reads):
    pairs = int(visible_counts(mask, t, s).sum()) * b * hq
    bytes_ = itemsize * (b * t * hq * (dk + dv) * 2 + kv_reads * b * s * (dk + dv))
    return pl.CostEstimate(flops=int(flops_per_pair * pairs), transcendentals=int(pairs),
                           bytes_accessed=int(bytes_))


def _dot(a, b, dims):
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _to_bhtd(x, length: int):
    return jnp.transpose(_pad(x, 1, length), (0, 2, 1, 3))


def _visible_tile(mask, off, i, j, bq, bk, kv_len, qseg_ref, kvseg_ref):
    pos = i * bq + off + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    kidx = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    vis = visible(mask, pos, kidx, kv_len)
    if qseg_ref is not None:
        vis = jnp.logical_and(vis, qseg_ref[...] == kvseg_ref[...])  # (bq,1) vs (1,bk)
    return vis


def _clamp(x, lo, hi, n):
    """Tile index x clamped into [lo, hi) (and into [0, n)); repeats a fetched tile when skipped."""
    return jnp.minimum(jnp.maximum(jnp.minimum(x, hi - 1), lo), n - 1)


def _when_visible(idx, lo, hi, f_lo, f_hi, compute):
    """Runs compute(masked=...) for a tile index in [lo, hi): unmasked inside [f_lo, f_hi)."""
    in_range = jnp.logical_and(idx >= lo, idx < hi)
    full = jnp.logical_and(idx >= f_lo, idx < f_hi)
    pl.when(jnp.logical_and(in_range, full))(functools.partial(compute, masked=False))
    pl.when(jnp.logical_and(in_range, jnp.logical_not(full)))(
        functools.partial(compute, masked=True))


def _key_ranges(mask, off, i, bq, bk, nk, kv_len, has_seg):
    lo, hi = key_block_range(mask, i * bq + off, i * bq + bq - 1 + off, bk, nk)
    if has_seg:  # segment edges can fall anywhere: mask every tile
        return lo, hi, hi, hi
    f_lo, f_hi = full_key_block_range(mask, i * bq + off, i * bq + bq - 1 + off, bk, kv_len,
                                      lo, hi)
    return lo, hi, f_lo, f_hi


def _seg_operands(q_seg, kv_seg, tp, sp, q_map, kv_map, bq, bk):
    if q_seg is None:
        return [], []
    qs = _pad(q_seg.astype(jnp.int32), 1, tp)[:, :, None]          # [B, Tp, 1]
    kvs = _pad(kv_seg.astype(jnp.int32), 1, sp, -1)[:, None, :]    # [B, 1, Sp]
    return [qs, kvs], [pl.BlockSpec((None, bq, 1), q_map), pl.BlockSpec((None, 1, bk), kv_map)]


# ----------------------------------------------------------------------------- forward

def _fwd_kernel(off_ref, q_ref, k_ref, v_ref, *rest, mask, scale, bq, bk, nk, g, kv_len,
                has_seg):
    if has_seg:
        qseg_ref, kvseg_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr = rest
    else:
        qseg_ref = kvseg_ref = None
        o_ref, lse_ref, m_scr, l_scr, acc_scr = rest
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    off = off_ref[b]
    lo, hi, f_lo, f_hi = _key_ranges(mask, off, i, bq, bk, nk, kv_len, has_seg)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def _compute(masked: bool):
        k, v = k_ref[...], v_ref[...]
        vis = (_visible_tile(mask, off, i, j, bq, bk, kv_len, qseg_ref, kvseg_ref)
               if masked else None)

        def head(h, carry):
            s = _dot(q_ref[h], k, _NT) * scale
            if vis is not None:
                s = jnp.where(vis, s, -jnp.inf)
            m_prev = m_scr[h]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            corr = jnp.exp(m_prev - m_safe)
            e = jnp.exp(s - m_safe)
            l_scr[h] = l_scr[h] * corr + jnp.sum(e, axis=1, keepdims=True)
            acc_scr[h] = acc_scr[h] * corr + _dot(e.astype(v.dtype), v, _NN)
            m_scr[h] = m_new
            return carry

        lax.fori_loop(0, g, head, 0)

    _when_visible(j, lo, hi, f_lo, f_hi, _compute)

    @pl.when(j == nk - 1)
    def _finish():
        l = l_scr[...]
        nonempty = l > 0
        l_safe = jnp.where(nonempty, l, 1.0)
        o_ref[...] = (acc_scr[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(nonempty, m_scr[...] + jnp.log(l_safe), -jnp.inf)


def _kv_index_map(mask, bq, bk, nk):
    def kv_map(bi, h, i, j, off_ref):
        o = off_ref[bi]
        lo, hi = key_block_range(mask, i * bq + o, i * bq + bq - 1 + o, bk, nk)
        return bi, h, _clamp(j, lo, hi, nk), 0
    return kv_map


def flash_attention_fwd(q, k, v, q_seg, kv_seg, off, *, mask: AttentionMask, scale: float,
                        block_q: int, block_k: int, interpret: bool = False):
    """Returns (o [B,T,Hq,Dv] in q.dtype, lse [B,T,Hq] float32)."""
    b, t, hq, dk = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    bq, bk, tp, sp = _tiles(t, s, block_q, block_k, g)
    nq, nk = tp // bq, sp // bk
    kv_map = _kv_index_map(mask, bq, bk, nk)
    q_map = lambda bi, h, i, j, off_ref: (bi, h, i, 0)  # noqa: E731
    seg_args, seg_specs = _seg_operands(
        q_seg, kv_seg, tp, sp, lambda bi, h, i, j, off_ref: (bi, i, 0),
        lambda bi, h, i, j, off_ref: (bi, 0, kv_map(bi, h, i, j, off_ref)[2]), bq, bk)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, hkv, nq, nk),
        in_specs=[pl.BlockSpec((None, g, bq, dk), q_map),
                  pl.BlockSpec((None, None, bk, dk), kv_map),
                  pl.BlockSpec((None, None, bk, dv), kv_map)] + seg_specs,
        out_specs=[pl.BlockSpec((None, g, bq, dv), q_map),
                   pl.BlockSpec((None, g, bq, 1), q_map)],
        scratch_shapes=[pltpu.VMEM((g, bq, 1), jnp.float32), pltpu.VMEM((g, bq, 1), jnp.float32),
                        pltpu.VMEM((g, bq, dv), jnp.float32)],
    )
    kernel = functools.partial(_fwd_kernel, mask=mask, scale=scale, bq=bq, bk=bk, nk=nk, g=g,
                               kv_len=s, has_seg=q_seg is not None)
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, hq, tp, dv), q.dtype),
                   jax.ShapeDtypeStruct((b, hq, tp, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(mask, b, t, s, hq, dk, dv, q.dtype.itemsize, 2 * (dk + dv), 1),
        interpret=interpret,
        name="flash_attention_fwd",
    )(off, _to_bhtd(q, tp), _to_bhtd(k, sp), _to_bhtd(v, sp), *seg_args)
    o = jnp.transpose(o[:, :, :t], (0, 2, 1, 3))
    return o, jnp.transpose(lse[:, :, :t, 0], (0, 2, 1))


# ----------------------------------------------------------------------------- backward

def _probs(q, k, lse, vis, scale):
    """Probabilities of a tile; vis None means every pair is visible."""
    s = _dot(q, k, _NT) * scale
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # empty rows: p = 0
    p = jnp.exp(s - lse)
    return p if vis is None else jnp.where(vis, p, 0.0)


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, mask, scale,
               bq, bk, nk, g, kv_len, has_seg):
    if has_seg:
        qseg_ref, kvseg_ref, dq_ref, dq_scr = rest
    else:
        qseg_ref = kvseg_ref = None
        dq_ref, dq_scr = rest
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    off = off_ref[b]
    lo, hi, f_lo, f_hi = _key_ranges(mask, off, i, bq, bk, nk, kv_len, has_seg)

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def _compute(masked: bool):
        k, v = k_ref[...], v_ref[...]
        vis = (_visible_tile(mask, off, i, j, bq, bk, kv_len, qseg_ref, kvseg_ref)
               if masked else None)

        def head(h, carry):
            p = _probs(q_ref[h], k, lse_ref[h], vis, scale)
            dp = _dot(do_ref[h], v, _NT)
            ds = p * (dp - delta_ref[h]) * scale
            dq_scr[h] = dq_scr[h] + _dot(ds.astype(k.dtype), k, _NN)
            return carry

        lax.fori_loop(0, g, head, 0)

    _when_visible(j, lo, hi, f_lo, f_hi, _compute)

    @pl.when(j == nk - 1)
    def _finish():
        dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)


def _dkv_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, mask, scale,
                bq, bk, nq, g, kv_len, has_seg):
    if has_seg:
        qseg_ref, kvseg_ref, dk_ref, dv_ref, dk_scr, dv_scr = rest
    else:
        qseg_ref = kvseg_ref = None
        dk_ref, dv_ref, dk_scr, dv_scr = rest
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    off = off_ref[b]
    lo, hi = query_block_range(mask, j * bk, j * bk + bk - 1, off, off, bq, nq)
    if has_seg:
        f_lo = f_hi = hi
    else:
        f_lo, f_hi = full_query_block_range(mask, j * bk, j * bk + bk - 1, off, bq, lo, hi,
                                            (j + 1) * bk > kv_len)

    @pl.when(i == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def _compute(masked: bool):
        k, v = k_ref[...], v_ref[...]
        vis = (_visible_tile(mask, off, i, j, bq, bk, kv_len, qseg_ref, kvseg_ref)
               if masked else None)

        def head(h, carry):
            q, do = q_ref[h], do_ref[h]
            p = _probs(q, k, lse_ref[h], vis, scale)
            dv_scr[...] += _dot(p.astype(do.dtype), do, _TN)
            dp = _dot(do, v, _NT)
            ds = p * (dp - delta_ref[h]) * scale
            dk_scr[...] += _dot(ds.astype(q.dtype), q, _TN)
            return carry

        lax.fori_loop(0, g, head, 0)

    _when_visible(i, lo, hi, f_lo, f_hi, _compute)

    @pl.when(i == nq - 1)
    def _finish():
        dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def flash_attention_bwd(q, k, v, q_seg, kv_seg, off, lse, delta, do, *, mask: AttentionMask,
                        scale: float, block_sizes_dq: tuple[int, int],
                        block_sizes_dkv: tuple[int, int], interpret: bool = False):
    """Returns (dq, dk, dv); delta [B,T,Hq] f32 = sum(o * do, -1) (minus any lse cotangent)."""
    b, t, hq, dk = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    has_seg = q_seg is not None

    def rows(x, tp, value):  # [B,T,Hq] -> [B,Hq,Tp,1]
        return _pad(jnp.transpose(x, (0, 2, 1)), 2, tp, value)[..., None]

    # dQ: grid (B, Hkv, nq, nk)
    bq, bk, tp, sp = _tiles(t, s, *block_sizes_dq, g)
    nq, nk = tp // bq, sp // bk
    kv_map = _kv_index_map(mask, bq, bk, nk)
    q_map = lambda bi, h, i, j, off_ref: (bi, h, i, 0)  # noqa: E731
    seg_args, seg_specs = _seg_operands(
        q_seg, kv_seg, tp, sp, lambda bi, h, i, j, off_ref: (bi, i, 0),
        lambda bi, h, i, j, off_ref: (bi, 0, kv_map(bi, h, i, j, off_ref)[2]), bq, bk)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, mask=mask, scale=scale, bq=bq, bk=bk, nk=nk, g=g,
                          kv_len=s, has_seg=has_seg),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, nq, nk),
            in_specs=[pl.BlockSpec((None, g, bq, dk), q_map),
                      pl.BlockSpec((None, None, bk, dk), kv_map),
                      pl.BlockSpec((None, None, bk, dv), kv_map),
                      pl.BlockSpec((None, g, bq, dv), q_map),
                      pl.BlockSpec((None, g, bq, 1), q_map),
                      pl.BlockSpec((None, g, bq, 1), q_map)] + seg_specs,
            out_specs=pl.BlockSpec((None, g, bq, dk), q_map),
            scratch_shapes=[pltpu.VMEM((g, bq, dk), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((b, hq, tp, dk), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(mask, b, t, s, hq, dk, dv, q.dtype.itemsize, 2 * (2 * dk + dv), 1),
        interpret=interpret,
        name="flash_attention_dq",
    )(off, _to_bhtd(q, tp), _to_bhtd(k, sp), _to_bhtd(v, sp), _to_bhtd(do, tp),
      rows(lse, tp, -jnp.inf), rows(delta, tp, 0.0), *seg_args)
    dq = jnp.transpose(dq[:, :, :t], (0, 2, 1, 3))

    # dK/dV: grid (B, Hkv, nk, nq)
    bq, bk, tp, sp = _tiles(t, s, *block_sizes_dkv, g)
    nq, nk = tp // bq, sp // bk

    def qi(bi, j, i, off_ref):
        o = off_ref[bi]
        lo, hi = query_block_range(mask, j * bk, j * bk + bk - 1, o, o, bq, nq)
        return _clamp(i, lo, hi, nq)

    qg_map = lambda bi, h, j, i, off_ref: (bi, h, qi(bi, j, i, off_ref), 0)  # noqa: E731
    k_map = lambda bi, h, j, i, off_ref: (bi, h, j, 0)  # noqa: E731
    seg_args, seg_specs = _seg_operands(
        q_seg, kv_seg, tp, sp, lambda bi, h, j, i, off_ref: (bi, qi(bi, j, i, off_ref), 0),
        lambda bi, h, j, i, off_ref: (bi, 0, j), bq, bk)
    dk_out, dv_out = pl.pallas_call(
        functools.partial(_dkv_kernel, mask=mask, scale=scale, bq=bq, bk=bk, nq=nq, g=g,
                          kv_len=s, has_seg=has_seg),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, nk, nq),
            in_specs=[pl.BlockSpec((None, g, bq, dk), qg_map),
                      pl.BlockSpec((None, None, bk, dk), k_map),
                      pl.BlockSpec((None, None, bk, dv), k_map),
                      pl.BlockSpec((None, g, bq, dv), qg_map),
                      pl.BlockSpec((None, g, bq, 1), qg_map),
                      pl.BlockSpec((None, g, bq, 1), qg_map)] + seg_specs,
            out_specs=[pl.BlockSpec((None, None, bk, dk), k_map),
                       pl.BlockSpec((None, None, bk, dv), k_map)],
            scratch_shapes=[pltpu.VMEM((bk, dk), jnp.float32),
                            pltpu.VMEM((bk, dv), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((b, hkv, sp, dk), k.dtype),
                   jax.ShapeDtypeStruct((b, hkv, sp, dv), v.dtype)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(mask, b, t, s, hq, dk, dv, q.dtype.itemsize, 2 * (2 * dk + 2 * dv), 1),
        interpret=interpret,
        name="flash_attention_dkv",
    )(off, _to_bhtd(q, tp), _to_bhtd(k, sp), _to_bhtd(v, sp), _to_bhtd(do, tp),
      rows(lse, tp, -jnp.inf), rows(delta, tp, 0.0), *seg_args)
    dk_out = jnp.transpose(dk_out[:, :, :s], (0, 2, 1, 3))
    dv_out = jnp.transpose(dv_out[:, :, :s], (0, 2, 1, 3))
    return dq, dk_out, dv_out
