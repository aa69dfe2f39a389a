"""Block-gather sparse attention as Pallas kernels for TPUs (Mosaic lowering).

Letters: B batch, T query tokens, S key tokens (padded by api.py to NB * P), Hkv KV heads, G query
heads per KV head, Gp = G padded to a multiple of the sublane tile (8 rows, 16 for 16-bit dtypes),
Dk / Dv head dims (whole, any size), n slots, P = block_size, NB = S / P, Tc query tokens and Ec
(query, slot) entries per call.

Group-centric scheme: one grid row per (b, KV head, token) with the G query heads of the group as
the rows of each dot, and the selected blocks fetched by the BlockSpec pipeline through scalar
prefetch of the block ids (the index_map reads them from SMEM). An empty slot (-1) re-uses the
previous slot's block id for the fetch, so the pipeline issues no DMA for it, and is skipped.

  forward   grid (B, Hkv, Tc, n), n innermost ("arbitrary"): online softmax in VMEM scratch.
  dQ        grid (B, Hkv, Tc, n): recompute p from lse, accumulate dq in VMEM scratch.
  dK / dV   no atomics: the (token, slot) entries of each (b, KV head) are sorted by block id in
            XLA; grid (B, Hkv, Ec) walks them so that the entries of a block are consecutive; a
            run of entries of one block accumulates into VMEM scratch, seeded from (and written
            back to) a float32 dK / dV carried across calls through input_output_aliases.

SMEM is small, so the prefetched tables are split: the queries into chunks of Tc tokens (one
pallas_call each, lax.map) and the sorted entries into chunks of Ec entries (lax.scan carrying
dK / dV), each table at most TUNING.tpu_max_prefetch int32 values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .tuning import TUNING
from .._util import pad_axis as _pad_axis

_NEG_INF = float("-inf")
_LANES = 128


def _sublanes(dtype) -> int:
    return TUNING.tpu_row_multiple * (2 if jnp.dtype(dtype).itemsize == 2 else 1)


def unsupported_reason(*, G: int, Dk: int, Dv: int, block_size: int, dtype) -> str | None:
    """None when the kernel can take these shapes, else why not (api.py falls back or raises)."""
    del G, Dk, Dv
    tile = max(_sublanes(dtype), TUNING.tpu_min_block_size)
    if block_size % tile:
        return f"block_size={block_size} must be a multiple of {tile} on TPU"
    return None


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m




def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, ca, cb, precision):
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _fetch_ids(idx: jax.Array) -> jax.Array:
    """Block id to DMA for each slot: its own, or for -1 the nearest earlier valid slot's (the
    first valid one for leading -1s; 0 when the row has none), so empty slots cost no DMA."""
    n = idx.shape[-1]
    valid = idx >= 0
    slot = jnp.arange(n, dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(valid, slot, -1), axis=idx.ndim - 1)
    first = jnp.argmax(valid, axis=-1)[..., None]
    src = jnp.where(last >= 0, last, first)
    return jnp.maximum(jnp.take_along_axis(idx, src, axis=-1), 0)


def _layout(q, k, v, dtype):
    """q [B,T,Hq,Dk] -> [B,Hkv,T,Gp,Dk]; k, v [B,S,Hkv,D] -> [B,Hkv,S,D]."""
    B, T, Hq, Dk = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    Gp = _round_up(G, _sublanes(dtype))
    q5 = _pad_axis(q.reshape(B, T, Hkv, G, Dk).transpose(0, 2, 1, 3, 4), 3, Gp)
    return q5, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), G, Gp


def _per_head_rows(x, B, T, Hkv, G, Gp, fill):
    """[B,T,Hq] -> [B,Hkv,T,Gp,1] (float32)."""
    x = x.reshape(B, T, Hkv, G).transpose(0, 2, 1, 3).astype(jnp.float32)
    return _pad_axis(x, 3, Gp, fill)[..., None]


def _query_chunks(T: int, n: int, B: int, Hkv: int) -> tuple[int, int]:
    """(Tc, number of chunks) so that each prefetched table holds <= tpu_max_prefetch values."""
    tc = max(1, TUNING.tpu_max_prefetch // max(B * Hkv * n, B))
    tc = min(tc, T)
    return tc, -(-T // tc)


def _split_queries(x, axis, tc, nc, fill):
    """Pads `axis` (a T axis) to nc * tc and moves the chunk axis to the front."""
    x = _pad_axis(x, axis, nc * tc, fill)
    shape = x.shape[:axis] + (nc, tc) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _merge_queries(x, axis, T):
    x = jnp.moveaxis(x, 0, axis)
    shape = x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:]
    return jax.lax.slice_in_dim(x.reshape(shape), 0, T, axis=axis)


def _mask(pos, limit, qseg, kvseg_ref):
    mask = pos <= limit
    if kvseg_ref is not None:
        mask &= kvseg_ref[...] == qseg                                         # [1, P]
    return mask


# ----------------------------------------------------------------------------------------------
# Forward and dQ: grid (B, Hkv, Tc, n).

def _query_major_kernel(idx_ref, fetch_ref, lim_ref, qseg_ref, *refs, P, n, scale, precision,
                        grad: bool, seg: bool):
    b, g, t, j = (pl.program_id(i) for i in range(4))
    Hkv, Tc = pl.num_programs(1), pl.num_programs(2)
    if grad:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest = refs
    else:
        q_ref, k_ref, v_ref, *rest = refs
    kvseg_ref = rest.pop(0) if seg else None
    if grad:
        dq_ref, dq_scr = rest
    else:
        o_ref, lse_out_ref, acc_scr, m_scr, l_scr = rest

    @pl.when(j == 0)
    def _init():
        if grad:
            dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
        else:
            acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
            m_scr[...] = jnp.full(m_scr.shape, _NEG_INF, jnp.float32)
            l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)

    row = (b * Hkv + g) * Tc + t
    blk = idx_ref[row * n + j]
    limit = lim_ref[b * Tc + t]
    qseg = qseg_ref[b * Tc + t] if seg else None

    @pl.when(blk >= 0)
    def _compute():
        q = q_ref[...]                                                          # [Gp, Dk]
        kb = k_ref[...]                                                         # [P, Dk]
        vb = v_ref[...]                                                         # [P, Dv]
        pos = blk * P + jax.lax.broadcasted_iota(jnp.int32, (1, P), 1)
        mask = _mask(pos, limit, qseg, kvseg_ref)                               # [1, P]
        s = _dot(q, kb, 1, 1, precision) * scale                                # [Gp, P]
        if grad:
            lse = lse_ref[...]                                                  # [Gp, 1]
            live = lse > _NEG_INF
            p = jnp.where(mask & live, jnp.exp(s - jnp.where(live, lse, 0.0)), 0.0)
            dp = _dot(do_ref[...], vb, 1, 1, precision)
            ds = p * (dp - delta_ref[...]) * scale
            dq_scr[...] += _dot(ds.astype(kb.dtype), kb, 1, 0, precision)
        else:
            s = jnp.where(mask, s, _NEG_INF)
            m_prev = m_scr[:, :1]                                               # [Gp, 1]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
            l_new = l_scr[:, :1] * alpha + jnp.sum(p, axis=1, keepdims=True)
            acc_scr[...] = acc_scr[...] * alpha + _dot(p.astype(vb.dtype), vb, 1, 0, precision)
            m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
            l_scr[...] = jnp.broadcast_to(l_new, l_scr.shape)

    @pl.when(j == n - 1)
    def _finish():
        if grad:
            dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)
        else:
            l = l_scr[:, :1]
            ok = l > 0
            l_safe = jnp.where(ok, l, 1.0)
            o_ref[...] = (acc_scr[...] / l_safe).astype(o_ref.dtype)
            lse_out_ref[...] = jnp.where(ok, m_scr[:, :1] + jnp.log(l_safe), _NEG_INF)


def _query_major_call(q5c, kT, vT, kvs, idx_c, lim_c, qseg_c, extra, *, P, scale, precision,
                      grad, interpret, out_dtype, Dv):
    """One pallas_call over a chunk of Tc tokens; `extra` = (do, lse, delta) chunks when grad."""
    B, Hkv, Tc, Gp, Dk = q5c.shape
    n = idx_c.shape[-1]
    seg = qseg_c is not None
    fetch = _fetch_ids(idx_c)
    prefetch = [idx_c.reshape(-1), fetch.reshape(-1), lim_c.reshape(-1)]
    if seg:
        prefetch.append(qseg_c.reshape(-1))

    def at_token(b, g, t, j, *_):
        return (b, g, t, 0, 0)

    def at_block(b, g, t, j, idx_ref, fetch_ref, *_):
        return (b, g, fetch_ref[((b * Hkv + g) * Tc + t) * n + j], 0)

    def at_seg_block(b, g, t, j, idx_ref, fetch_ref, *_):
        return (b, fetch_ref[((b * Hkv + g) * Tc + t) * n + j], 0, 0)

    in_specs = [pl.BlockSpec((None, None, None, Gp, Dk), at_token),
                pl.BlockSpec((None, None, P, Dk), at_block),
                pl.BlockSpec((None, None, P, Dv), at_block)]
    args = [q5c, kT, vT]
    if grad:
        do_c, lse_c, delta_c = extra
        in_specs += [pl.BlockSpec((None, None, None, Gp, Dv), at_token),
                     pl.BlockSpec((None, None, None, Gp, 1), at_token),
                     pl.BlockSpec((None, None, None, Gp, 1), at_token)]
        args += [do_c, lse_c, delta_c]
    if seg:
        in_specs.append(pl.BlockSpec((None, None, 1, P), at_seg_block))
        args.append(kvs)
    if grad:
        out_specs = pl.BlockSpec((None, None, None, Gp, Dk), at_token)
        out_shape = jax.ShapeDtypeStruct((B, Hkv, Tc, Gp, Dk), out_dtype)
        scratch = [pltpu.VMEM((Gp, Dk), jnp.float32)]
    else:
        out_specs = [pl.BlockSpec((None, None, None, Gp, Dv), at_token),
                     pl.BlockSpec((None, None, None, Gp, 1), at_token)]
        out_shape = [jax.ShapeDtypeStruct((B, Hkv, Tc, Gp, Dv), out_dtype),
                     jax.ShapeDtypeStruct((B, Hkv, Tc, Gp, 1), jnp.float32)]
        scratch = [pltpu.VMEM((Gp, Dv), jnp.float32), pltpu.VMEM((Gp, _LANES), jnp.float32),
                   pltpu.VMEM((Gp, _LANES), jnp.float32)]
    kernel = functools.partial(_query_major_kernel, P=P, n=n, scale=scale, precision=precision,
                               grad=grad, seg=seg)
    if not seg:
        kernel = _drop_qseg(kernel, 3)
    itemsize = jnp.dtype(q5c.dtype).itemsize
    keys = B * Hkv * Tc * Gp * n * P
    gathered = itemsize * B * Hkv * Tc * n * P * (Dk + Dv)
    per_query = itemsize * B * Hkv * Tc * Gp * (Dk + Dv) * (2 if grad else 1)
    cost = pl.CostEstimate(flops=int(2 * keys * ((2 * Dk + Dv) if grad else (Dk + Dv))),
                           transcendentals=int(keys), bytes_accessed=int(gathered + per_query))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(B, Hkv, Tc, n), in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="sparse_attention_dq" if grad else "sparse_attention_fwd",
    )(*prefetch, *args)


def _drop_qseg(kernel, position):
    """Inserts None for the absent q-segment prefetch ref at `position`."""
    def wrapped(*refs):
        return kernel(*refs[:position], None, *refs[position:])
    return wrapped


def _segment_blocks(kv_seg, P):
    if kv_seg is None:
        return None
    B, S = kv_seg.shape
    return kv_seg.reshape(B, S // P, 1, P)


def forward(q, k, v, idx, limit, q_seg, kv_seg, *, block_size: int, scale: float,
            interpret: bool = False):
    """Returns (o [B,T,Hq,Dv] in q.dtype, lse [B,T,Hq] float32); see module docstring."""
    B, T, Hq, _ = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    q5, kT, vT, G, Gp = _layout(q, k, v, q.dtype)
    kvs = _segment_blocks(kv_seg, block_size)
    tc, nc = _query_chunks(T, idx.shape[-1], B, Hkv)
    idx_t = idx.transpose(0, 2, 1, 3)                                           # [B,Hkv,T,n]
    xs = (_split_queries(q5, 2, tc, nc, 0), _split_queries(idx_t, 2, tc, nc, -1),
          _split_queries(limit, 1, tc, nc, -1),
          None if q_seg is None else _split_queries(q_seg, 1, tc, nc, 0))
    call = functools.partial(_query_major_call, kT=kT, vT=vT, kvs=kvs, extra=None, P=block_size,
                             scale=scale, precision=_precision(q.dtype), grad=False,
                             interpret=interpret, out_dtype=q.dtype, Dv=Dv)
    o, lse = jax.lax.map(lambda a: call(a[0], idx_c=a[1], lim_c=a[2], qseg_c=a[3]), xs)
    o = _merge_queries(o, 2, T)[:, :, :, :G]                                   # [B,Hkv,T,G,Dv]
    lse = _merge_queries(lse, 2, T)[:, :, :, :G, 0]
    return (o.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, Dv),
            lse.transpose(0, 2, 1, 3).reshape(B, T, Hq))


# ----------------------------------------------------------------------------------------------
# dK / dV: grid (B, Hkv, Ec) over the selection sorted by block id.

_VALID, _FIRST, _LAST = 1, 2, 4


def _entry_tables(idx, limit, q_seg, NB, ec):
    """Sorted (token, slot) entries per (b, KV head), split into chunks of ec entries.

    Returns [nchunks, B*Hkv*ec] int32 tables: token, block to fetch, flags (valid / first / last
    entry of a run of one block within the chunk), limit and q segment of the entry's token.
    Invalid entries (slot -1) sort last and join the run of the chunk's last valid block (or form
    a run on block 0 when the chunk has none, which copies that block through unchanged).
    """
    B, T, Hkv, n = idx.shape
    E = T * n
    flat = idx.transpose(0, 2, 1, 3).reshape(B, Hkv, E)
    key = jnp.where(flat >= 0, flat, NB)
    order = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
    blk = jnp.take_along_axis(key, order, axis=-1)
    tok = order // n
    nc = -(-E // ec)
    blk = _pad_axis(blk, 2, nc * ec, NB).reshape(B, Hkv, nc, ec)
    tok = _pad_axis(tok, 2, nc * ec, 0).reshape(B, Hkv, nc, ec)
    valid = blk < NB
    # Fetch id: own block when valid, else the chunk's last valid block (runs stay contiguous).
    pos = jnp.arange(ec, dtype=jnp.int32)
    last_valid = jax.lax.cummax(jnp.where(valid, pos, -1), axis=3)
    fetch = jnp.where(last_valid >= 0,
                      jnp.take_along_axis(blk, jnp.maximum(last_valid, 0), axis=3), 0)
    fetch = jnp.where(valid, blk, fetch)
    prev = jnp.pad(fetch, ((0, 0), (0, 0), (0, 0), (1, 0)), constant_values=-1)[..., :-1]
    nxt = jnp.pad(fetch, ((0, 0), (0, 0), (0, 0), (0, 1)), constant_values=-1)[..., 1:]
    flags = (valid * _VALID + (fetch != prev) * _FIRST + (fetch != nxt) * _LAST).astype(jnp.int32)
    b_ar = jnp.arange(B)[:, None, None, None]
    lim = limit[b_ar, tok]
    qs = None if q_seg is None else q_seg[b_ar, tok]

    def table(x):                                                               # -> [nc, B*Hkv*ec]
        return None if x is None else jnp.moveaxis(x, 2, 0).reshape(nc, B * Hkv * ec)

    return table(tok), table(fetch), table(flags), table(lim), table(qs), nc


def _dkv_kernel(tok_ref, fetch_ref, flag_ref, lim_ref, qseg_ref, q_ref, k_ref, v_ref, do_ref,
                lse_ref, delta_ref, *refs, P, scale, precision, seg: bool):
    b, g, e = (pl.program_id(i) for i in range(3))
    Hkv, Ec = pl.num_programs(1), pl.num_programs(2)
    refs = list(refs)
    kvseg_ref = refs.pop(0) if seg else None
    dk_in, dv_in, dk_out, dv_out, dk_scr, dv_scr = refs
    i = (b * Hkv + g) * Ec + e
    flags = flag_ref[i]
    blk = fetch_ref[i]

    @pl.when((flags & _FIRST) != 0)
    def _seed():
        dk_scr[...] = dk_in[...]
        dv_scr[...] = dv_in[...]

    @pl.when((flags & _VALID) != 0)
    def _accumulate():
        q = q_ref[...]                                                          # [Gp, Dk]
        do = do_ref[...]                                                        # [Gp, Dv]
        kb = k_ref[...]
        vb = v_ref[...]
        lse = lse_ref[...]                                                      # [Gp, 1]
        live = lse > _NEG_INF
        pos = blk * P + jax.lax.broadcasted_iota(jnp.int32, (1, P), 1)
        qseg = qseg_ref[i] if seg else None
        mask = _mask(pos, lim_ref[i], qseg, kvseg_ref) & live                   # [Gp, P]
        s = _dot(q, kb, 1, 1, precision) * scale
        p = jnp.where(mask, jnp.exp(s - jnp.where(live, lse, 0.0)), 0.0)
        dp = _dot(do, vb, 1, 1, precision)
        ds = p * (dp - delta_ref[...]) * scale
        dk_scr[...] += _dot(ds.astype(q.dtype), q, 0, 0, precision)             # [P, Dk]
        dv_scr[...] += _dot(p.astype(do.dtype), do, 0, 0, precision)            # [P, Dv]

    @pl.when((flags & _LAST) != 0)
    def _write():
        dk_out[...] = dk_scr[...]
        dv_out[...] = dv_scr[...]


def _dkv_call(tables, q5, kT, vT, do5, lse5, delta5, kvs, dk, dv, *, P, scale, precision,
              interpret, ec):
    tok, fetch, flags, lim, qs = tables
    B, Hkv, T, Gp, Dk = q5.shape
    Dv = vT.shape[-1]
    seg = qs is not None
    prefetch = [tok, fetch, flags, lim] + ([qs] if seg else [])

    def at_token(b, g, e, tok_ref, *_):
        return (b, g, tok_ref[(b * Hkv + g) * ec + e], 0, 0)

    def at_block(b, g, e, tok_ref, fetch_ref, *_):
        return (b, g, fetch_ref[(b * Hkv + g) * ec + e], 0)

    def at_seg_block(b, g, e, tok_ref, fetch_ref, *_):
        return (b, fetch_ref[(b * Hkv + g) * ec + e], 0, 0)

    kblock, vblock = (pl.BlockSpec((None, None, P, D), at_block) for D in (Dk, Dv))
    in_specs = [pl.BlockSpec((None, None, None, Gp, Dk), at_token), kblock, vblock,
                pl.BlockSpec((None, None, None, Gp, Dv), at_token),
                pl.BlockSpec((None, None, None, Gp, 1), at_token),
                pl.BlockSpec((None, None, None, Gp, 1), at_token)]
    args = [q5, kT, vT, do5, lse5, delta5]
    if seg:
        in_specs.append(pl.BlockSpec((None, None, 1, P), at_seg_block))
        args.append(kvs)
    in_specs += [kblock, vblock]
    args += [dk, dv]
    kernel = functools.partial(_dkv_kernel, P=P, scale=scale, precision=precision, seg=seg)
    if not seg:
        kernel = _drop_qseg(kernel, 4)
    itemsize = jnp.dtype(q5.dtype).itemsize
    keys = B * Hkv * ec * Gp * P
    cost = pl.CostEstimate(
        flops=int(2 * keys * (2 * Dk + 2 * Dv)), transcendentals=int(keys),
        bytes_accessed=int(B * Hkv * ec * (itemsize * (Gp + P) * (Dk + Dv) + 8 * Gp
                                           + 8 * P * (Dk + Dv))))
    alias_base = len(prefetch) + len(args) - 2
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(B, Hkv, ec), in_specs=in_specs,
            out_specs=[kblock, vblock],
            scratch_shapes=[pltpu.VMEM((P, Dk), jnp.float32), pltpu.VMEM((P, Dv), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(dk.shape, jnp.float32),
                   jax.ShapeDtypeStruct(dv.shape, jnp.float32)],
        input_output_aliases={alias_base: 0, alias_base + 1: 1},
        compiler_params=pltpu.CompilerParams(
            # (b, KV head) rows touch disjoint dK / dV blocks: safe to split across cores.
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="sparse_attention_dkv",
    )(*prefetch, *args)


def backward(q, k, v, idx, limit, q_seg, kv_seg, o, lse, do, delta, *, block_size: int,
             scale: float, interpret: bool = False):
    """Gradients (dq, dk, dv); delta = sum(do * o, -1) - dlse [B,T,Hq] float32."""
    del o
    B, T, Hq, Dk = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    n = idx.shape[-1]
    precision = _precision(q.dtype)
    q5, kT, vT, G, Gp = _layout(q, k, v, q.dtype)
    do5 = _pad_axis(do.reshape(B, T, Hkv, G, Dv).transpose(0, 2, 1, 3, 4), 3, Gp)
    lse5 = _per_head_rows(lse, B, T, Hkv, G, Gp, _NEG_INF)
    delta5 = _per_head_rows(delta, B, T, Hkv, G, Gp, 0.0)
    kvs = _segment_blocks(kv_seg, block_size)

    # dQ over query chunks.
    tc, nc = _query_chunks(T, n, B, Hkv)
    split = lambda x, fill: _split_queries(x, 2, tc, nc, fill)
    xs = (split(q5, 0), split(idx.transpose(0, 2, 1, 3), -1),
          _split_queries(limit, 1, tc, nc, -1),
          None if q_seg is None else _split_queries(q_seg, 1, tc, nc, 0),
          split(do5, 0), split(lse5, _NEG_INF), split(delta5, 0))
    call = functools.partial(_query_major_call, kT=kT, vT=vT, kvs=kvs, P=block_size, scale=scale,
                             precision=precision, grad=True, interpret=interpret,
                             out_dtype=q.dtype, Dv=Dv)
    dq = jax.lax.map(lambda a: call(a[0], idx_c=a[1], lim_c=a[2], qseg_c=a[3], extra=a[4:]), xs)
    dq = _merge_queries(dq, 2, T)[:, :, :, :G]                                 # [B,Hkv,T,G,Dk]
    dq = dq.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, Dk)

    # dK / dV over chunks of the sorted entries, carrying float32 accumulators.
    ec = max(1, min(T * n, TUNING.tpu_max_prefetch // (B * Hkv)))
    *tables, nchunks = _entry_tables(idx, limit, q_seg, S // block_size, ec)
    call = functools.partial(_dkv_call, q5=q5, kT=kT, vT=vT, do5=do5, lse5=lse5, delta5=delta5,
                             kvs=kvs, P=block_size, scale=scale, precision=precision,
                             interpret=interpret, ec=ec)

    def step(carry, tabs):
        dk, dv = call(tabs, dk=carry[0], dv=carry[1])
        return (dk, dv), None

    init = (jnp.zeros(kT.shape, jnp.float32), jnp.zeros(vT.shape, jnp.float32))
    (dk, dv), _ = jax.lax.scan(step, init, tuple(tables))
    return (dq, dk.transpose(0, 2, 1, 3).astype(k.dtype), dv.transpose(0, 2, 1, 3).astype(v.dtype))
