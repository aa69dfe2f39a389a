"""Block-gather sparse attention as Pallas kernels for NVIDIA GPUs (Triton lowering).

Letters: B batch, T query tokens, S key tokens (padded by api.py to NB * P), Hkv KV heads, G query
heads per KV head, Gp = G padded to >= 16 rows and a power of two (a Triton dot needs >= 16 rows),
Dk / Dv head dims (Dkp / Dvp padded to a power of two >= 16), n slots (np padded to a power of two),
P = block_size, NB = S / P key blocks, E = T * n (query, slot) entries.

Group-centric scheme of the NSA paper: one program per (b, t, KV head) loads each selected key /
value block once and processes the G query heads of the group together as the rows of its dots.

  forward   grid (B, T, Hkv): online softmax over the n selected blocks -> o, lse.
  dQ        grid (B, T, Hkv): recompute p from lse, dq = sum_blocks ds K.
  dK / dV   no atomics: the selection is inverted in XLA before the kernel (stable argsort of
            the flattened (t, slot) entries by block id -> per-block ranges [start, end) of a
            token list), each range cut into pieces of at most TUNING.gpu_dkv_max_queries
            entries; grid (B, Hkv, pieces): a program walks its piece's queries, accumulating the
            block's dK, dV in registers, and XLA sums the pieces of each block (sorted segment
            sum). Splitting keeps a block every query selects from becoming a straggler.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .tuning import TUNING, next_power_of_2
from .._util import dot_precision as _precision, pad_axis as _pad_axis

_NEG_INF = float("-inf")


def unsupported_reason(*, G: int, Dk: int, Dv: int, block_size: int, dtype) -> str | None:
    """None when the kernel can take these shapes, else why not (api.py falls back or raises)."""
    del G, dtype
    if block_size < 16 or block_size & (block_size - 1):
        return f"block_size={block_size} must be a power of two >= 16 for Triton dots"
    for name, d in (("Dk", Dk), ("Dv", Dv)):
        if next_power_of_2(d) > TUNING.gpu_max_head_dim:
            return f"{name}={d} exceeds the GPU kernel's head-dim limit {TUNING.gpu_max_head_dim}"
    return None


def _rows(G: int) -> int:
    return max(TUNING.gpu_min_rows, next_power_of_2(G))


def _dim(D: int) -> int:
    return max(16, next_power_of_2(D))




def _dot(a, b, ca, cb, precision):
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _params():
    return plgpu.CompilerParams(num_warps=TUNING.gpu_num_warps, num_stages=TUNING.gpu_num_stages)


def _key_mask(start, P, limit, qseg, kvseg_ref):
    pos = start + jnp.arange(P, dtype=jnp.int32)
    mask = pos <= limit
    if kvseg_ref is not None:
        mask &= kvseg_ref[pl.ds(start, P)] == qseg
    return mask[None, :]                                                        # [1, P]


# ----------------------------------------------------------------------------------------------
# Forward.

def _fwd_kernel(idx_ref, lim_ref, qseg_ref, q_ref, k_ref, v_ref, kvseg_ref, o_ref, lse_ref, *,
                P, n, scale, precision):
    q = q_ref[...]                                                              # [Gp, Dkp]
    Gp, Dvp = o_ref.shape
    limit = lim_ref[...]
    qseg = None if qseg_ref is None else qseg_ref[...]

    def update(carry, blk):
        acc, m, l = carry
        start = blk * P
        kb = k_ref[pl.ds(start, P), :]                                          # [P, Dkp]
        vb = v_ref[pl.ds(start, P), :]                                          # [P, Dvp]
        mask = _key_mask(start, P, limit, qseg, kvseg_ref)
        s = _dot(q, kb, 1, 1, precision) * scale                                # [Gp, P]
        s = jnp.where(mask, s, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.where(mask, jnp.exp(s - m_safe[:, None]), 0.0)
        acc = acc * alpha[:, None] + _dot(p.astype(vb.dtype), vb, 1, 0, precision)
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    def body(j, carry):                 # empty slots (-1) load nothing
        blk = idx_ref[j]
        return jax.lax.cond(blk >= 0, update, lambda c, _: c, carry, blk)

    init = (jnp.zeros((Gp, Dvp), jnp.float32), jnp.full((Gp,), _NEG_INF, jnp.float32),
            jnp.zeros((Gp,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n, body, init)
    ok = l > 0
    l_safe = jnp.where(ok, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(ok, m + jnp.log(l_safe), _NEG_INF)


def _prepare(q, k, v, idx, kv_seg):
    B, T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    G = Hq // Hkv
    Gp, Dkp, Dvp = _rows(G), _dim(Dk), _dim(Dv)
    q5 = _pad_axis(_pad_axis(q.reshape(B, T, Hkv, G, Dk), 3, Gp), 4, Dkp)
    kp = _pad_axis(k, 3, Dkp)
    vp = _pad_axis(v, 3, Dvp)
    n = idx.shape[-1]
    idxp = _pad_axis(idx, 3, next_power_of_2(n), -1)
    return q5, kp, vp, idxp, (B, T, Hq, Hkv, G, Gp, Dk, Dkp, Dv, Dvp)


def _specs_seq(S, Dp):
    return pl.BlockSpec((None, S, None, Dp), lambda b, t, g: (b, 0, g, 0))


def forward(q, k, v, idx, limit, q_seg, kv_seg, *, block_size: int, scale: float,
            interpret: bool = False):
    """Returns (o [B,T,Hq,Dv] in q.dtype, lse [B,T,Hq] float32); see module docstring."""
    q5, kp, vp, idxp, dims = _prepare(q, k, v, idx, kv_seg)
    B, T, Hq, Hkv, G, Gp, Dk, Dkp, Dv, Dvp = dims
    S = k.shape[1]
    n_p = idxp.shape[-1]
    seg = q_seg is not None
    kernel = functools.partial(_fwd_kernel, P=block_size, n=n_p, scale=scale,
                               precision=_precision(q.dtype))
    if not seg:
        kernel = _without_segments(kernel, n_before=2, n_mid=3)
    in_specs = [pl.BlockSpec((None, None, None, n_p), lambda b, t, g: (b, t, g, 0)),
                pl.BlockSpec((None, None), lambda b, t, g: (b, t))]
    args = [idxp, limit]
    if seg:
        in_specs.append(pl.BlockSpec((None, None), lambda b, t, g: (b, t)))
        args.append(q_seg)
    in_specs += [pl.BlockSpec((None, None, None, Gp, Dkp), lambda b, t, g: (b, t, g, 0, 0)),
                 _specs_seq(S, Dkp), _specs_seq(S, Dvp)]
    args += [q5, kp, vp]
    if seg:
        in_specs.append(pl.BlockSpec((None, S), lambda b, t, g: (b, 0)))
        args.append(kv_seg)
    n = idx.shape[-1]
    itemsize = jnp.dtype(q.dtype).itemsize
    cost = pl.CostEstimate(
        flops=int(2 * B * T * Hq * n * block_size * (Dk + Dv)),
        transcendentals=int(B * T * Hq * n * block_size),
        bytes_accessed=int(itemsize * (B * T * Hkv * n * block_size * (Dk + Dv)
                                       + B * T * Hq * (Dk + Dv)) + 4 * B * T * (Hq + Hkv * n)))
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, T, Hkv),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, Gp, Dvp), lambda b, t, g: (b, t, g, 0, 0)),
                   pl.BlockSpec((None, None, None, Gp), lambda b, t, g: (b, t, g, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, T, Hkv, Gp, Dvp), q.dtype),
                   jax.ShapeDtypeStruct((B, T, Hkv, Gp), jnp.float32)],
        compiler_params=_params(),
        cost_estimate=cost,
        interpret=interpret,
        name="sparse_attention_fwd",
    )(*args)
    o = o[:, :, :, :G, :Dv].reshape(B, T, Hq, Dv)
    lse = lse[:, :, :, :G].reshape(B, T, Hq)
    return o, lse


def _without_segments(kernel, *, n_before, n_mid):
    """Adapts a kernel written with (..., qseg_ref, ..., kvseg_ref, ...) to calls without them:
    the refs are n_before refs, [qseg], n_mid refs, [kvseg], outputs."""
    def wrapped(*refs):
        refs = list(refs)
        return kernel(*refs[:n_before], None, *refs[n_before:n_before + n_mid], None,
                      *refs[n_before + n_mid:])
    return wrapped


# ----------------------------------------------------------------------------------------------
# Backward: dQ (query-major) and dK / dV (key-block-major over the inverted selection).

def _dq_kernel(idx_ref, lim_ref, qseg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               kvseg_ref, dq_ref, *, P, n, scale, precision):
    q = q_ref[...]                                                              # [Gp, Dkp]
    do = do_ref[...]                                                            # [Gp, Dvp]
    lse = lse_ref[...]
    live = lse > _NEG_INF
    lse = jnp.where(live, lse, 0.0)[:, None]
    delta = delta_ref[...][:, None]
    limit = lim_ref[...]
    qseg = None if qseg_ref is None else qseg_ref[...]

    def update(dq, blk):
        start = blk * P
        kb = k_ref[pl.ds(start, P), :]
        vb = v_ref[pl.ds(start, P), :]
        mask = _key_mask(start, P, limit, qseg, kvseg_ref) & live[:, None]
        s = _dot(q, kb, 1, 1, precision) * scale
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dp = _dot(do, vb, 1, 1, precision)
        ds = p * (dp - delta) * scale
        return dq + _dot(ds.astype(kb.dtype), kb, 1, 0, precision)

    def body(j, dq):
        blk = idx_ref[j]
        return jax.lax.cond(blk >= 0, update, lambda c, _: c, dq, blk)

    dq = jax.lax.fori_loop(0, n, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(blk_ref, start_ref, end_ref, tok_ref, lim_ref, qseg_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, kvseg_ref, dk_ref, dv_ref, *, P, scale, precision):
    kstart = blk_ref[...] * P
    kb = k_ref[pl.ds(kstart, P), :]                                             # [P, Dkp]
    vb = v_ref[pl.ds(kstart, P), :]                                             # [P, Dvp]
    pos = kstart + jnp.arange(P, dtype=jnp.int32)
    kseg = None if kvseg_ref is None else kvseg_ref[pl.ds(kstart, P)]

    def body(e, carry):
        dk, dv = carry
        t = tok_ref[e]
        q = q_ref[t, :, :]                                                      # [Gp, Dkp]
        do = do_ref[t, :, :]                                                    # [Gp, Dvp]
        lse = lse_ref[t, :]
        live = lse > _NEG_INF
        lse = jnp.where(live, lse, 0.0)[:, None]
        delta = delta_ref[t, :][:, None]
        mask = (pos <= lim_ref[t])[None, :] & live[:, None]
        if kseg is not None:
            mask &= (kseg == qseg_ref[t])[None, :]
        s = _dot(q, kb, 1, 1, precision) * scale                                # [Gp, P]
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dp = _dot(do, vb, 1, 1, precision)
        ds = p * (dp - delta) * scale
        dk = dk + _dot(ds.astype(q.dtype), q, 0, 0, precision)                  # [P, Dkp]
        dv = dv + _dot(p.astype(do.dtype), do, 0, 0, precision)                 # [P, Dvp]
        return dk, dv

    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(start_ref[...], end_ref[...], body, init)
    dk_ref[...] = dk
    dv_ref[...] = dv


def invert_selection(idx: jax.Array, num_blocks: int):
    """Per (b, KV head), the query tokens that selected each key block, as ranges of one list.

    Returns (starts [B,Hkv,NB], ends [B,Hkv,NB], tokens [B,Hkv,T*n]) int32: the queries that
    selected block i are tokens[b, g, starts[b,g,i]:ends[b,g,i]] (sorted by token; -1 slots sort
    past every block). Needs unique ids per row (api.normalize_indices).
    """
    B, T, Hkv, n = idx.shape
    flat = jnp.transpose(idx, (0, 2, 1, 3)).reshape(B, Hkv, T * n)
    key = jnp.where(flat >= 0, flat, num_blocks)
    order = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
    tokens = order // n
    counts = jax.vmap(jax.vmap(lambda x: jnp.bincount(x, length=num_blocks + 1)))(key)
    ends = jnp.cumsum(counts, axis=-1)[..., :num_blocks].astype(jnp.int32)
    starts = ends - counts[..., :num_blocks].astype(jnp.int32)
    return starts, ends, tokens


def work_items(starts: jax.Array, ends: jax.Array, num_entries: int, max_queries: int):
    """Splits each block's range of queries into pieces of at most `max_queries` entries so that
    no dK / dV program is a straggler (a block every query selects, like the first one, would
    otherwise loop over all T queries alone).

    Returns (block, start, end), each int32 [B, Hkv, W] with W = ceil(E / L) + NB a static bound
    on the number of pieces; pieces past the real ones are empty (start == end) on block NB - 1
    (so `block` stays sorted).
    """
    B, Hkv, NB = starts.shape
    L = max_queries
    counts = ends - starts
    pieces = (counts + L - 1) // L
    piece_end = jnp.cumsum(pieces, axis=-1)                                     # [B, Hkv, NB]
    W = -(-num_entries // L) + NB
    w = jnp.arange(W, dtype=jnp.int32)
    search = jax.vmap(jax.vmap(lambda ends_, w_: jnp.searchsorted(ends_, w_, side="right")))
    blk = search(piece_end, jnp.broadcast_to(w, (B, Hkv, W))).astype(jnp.int32)
    real = blk < NB
    blk = jnp.minimum(blk, NB - 1)
    first_piece = jnp.take_along_axis(piece_end - pieces, blk, axis=-1)
    start = jnp.take_along_axis(starts, blk, axis=-1) + (w - first_piece) * L
    end = jnp.minimum(start + L, jnp.take_along_axis(ends, blk, axis=-1))
    start = jnp.where(real, start, 0)
    end = jnp.where(real, end, 0)
    return blk, start.astype(jnp.int32), end.astype(jnp.int32)


def backward(q, k, v, idx, limit, q_seg, kv_seg, o, lse, do, delta, *, block_size: int,
             scale: float, interpret: bool = False):
    """Gradients (dq, dk, dv); delta = sum(do * o, -1) - dlse [B,T,Hq] float32."""
    del o
    q5, kp, vp, idxp, dims = _prepare(q, k, v, idx, kv_seg)
    B, T, Hq, Hkv, G, Gp, Dk, Dkp, Dv, Dvp = dims
    S = k.shape[1]
    NB = S // block_size
    n, n_p = idx.shape[-1], idxp.shape[-1]
    seg = q_seg is not None
    precision = _precision(q.dtype)
    do5 = _pad_axis(_pad_axis(do.reshape(B, T, Hkv, G, Dv), 3, Gp), 4, Dvp)
    lse4 = _pad_axis(lse.reshape(B, T, Hkv, G), 3, Gp, _NEG_INF)
    delta4 = _pad_axis(delta.reshape(B, T, Hkv, G).astype(jnp.float32), 3, Gp)
    itemsize = jnp.dtype(q.dtype).itemsize
    keys = B * T * Hq * n * block_size
    gathered = itemsize * B * T * Hkv * n * block_size * (Dk + Dv)
    per_query = itemsize * B * T * Hq * (Dk + Dv) + 8 * B * T * Hq

    # dQ: same grid and gathers as the forward pass.
    kernel = functools.partial(_dq_kernel, P=block_size, n=n_p, scale=scale, precision=precision)
    if not seg:
        kernel = _without_segments(kernel, n_before=2, n_mid=6)
    row = lambda D: pl.BlockSpec((None, None, None, Gp, D), lambda b, t, g: (b, t, g, 0, 0))
    vec = pl.BlockSpec((None, None, None, Gp), lambda b, t, g: (b, t, g, 0))
    in_specs = [pl.BlockSpec((None, None, None, n_p), lambda b, t, g: (b, t, g, 0)),
                pl.BlockSpec((None, None), lambda b, t, g: (b, t))]
    args = [idxp, limit]
    if seg:
        in_specs.append(pl.BlockSpec((None, None), lambda b, t, g: (b, t)))
        args.append(q_seg)
    in_specs += [row(Dkp), _specs_seq(S, Dkp), _specs_seq(S, Dvp), row(Dvp), vec, vec]
    args += [q5, kp, vp, do5, lse4, delta4]
    if seg:
        in_specs.append(pl.BlockSpec((None, S), lambda b, t, g: (b, 0)))
        args.append(kv_seg)
    dq = pl.pallas_call(
        kernel,
        grid=(B, T, Hkv),
        in_specs=in_specs,
        out_specs=row(Dkp),
        out_shape=jax.ShapeDtypeStruct(q5.shape, q.dtype),
        compiler_params=_params(),
        cost_estimate=pl.CostEstimate(flops=int(2 * keys * (2 * Dk + Dv)),
                                      transcendentals=int(keys),
                                      bytes_accessed=int(gathered + per_query)),
        interpret=interpret,
        name="sparse_attention_dq",
    )(*args)
    dq = dq[:, :, :, :G, :Dk].reshape(B, T, Hq, Dk)

    # dK / dV: one program per (b, KV head, piece of a key block's query list); the pieces of a
    # block are summed in XLA afterwards (a sorted segment sum, no atomics).
    starts, ends, tokens = invert_selection(idx, NB)
    E = tokens.shape[-1]
    blk, start, end = work_items(starts, ends, E, TUNING.gpu_dkv_max_queries)
    W = blk.shape[-1]
    kernel = functools.partial(_dkv_kernel, P=block_size, scale=scale, precision=precision)
    if not seg:
        kernel = _without_segments(kernel, n_before=5, n_mid=6)
    scal = pl.BlockSpec((None, None, None), lambda b, g, w: (b, g, w))
    whole = lambda *tail: pl.BlockSpec((None, T, None) + tail,
                                       lambda b, g, w: (b, 0, g) + (0,) * len(tail))
    seq = lambda D: pl.BlockSpec((None, S, None, D), lambda b, g, w: (b, 0, g, 0))
    piece = lambda D: pl.BlockSpec((None, None, None, block_size, D),
                                   lambda b, g, w: (b, g, w, 0, 0))
    in_specs = [scal, scal, scal, pl.BlockSpec((None, None, E), lambda b, g, w: (b, g, 0)),
                pl.BlockSpec((None, T), lambda b, g, w: (b, 0))]
    args = [blk, start, end, tokens, limit]
    if seg:
        in_specs.append(pl.BlockSpec((None, T), lambda b, g, w: (b, 0)))
        args.append(q_seg)
    in_specs += [whole(Gp, Dkp), seq(Dkp), seq(Dvp), whole(Gp, Dvp), whole(Gp), whole(Gp)]
    args += [q5, kp, vp, do5, lse4, delta4]
    if seg:
        in_specs.append(pl.BlockSpec((None, S), lambda b, g, w: (b, 0)))
        args.append(kv_seg)
    dk_parts, dv_parts = pl.pallas_call(
        kernel,
        grid=(B, Hkv, W),
        in_specs=in_specs,
        out_specs=[piece(Dkp), piece(Dvp)],
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, W, block_size, Dkp), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hkv, W, block_size, Dvp), jnp.float32)],
        compiler_params=_params(),
        cost_estimate=pl.CostEstimate(flops=int(2 * keys * (2 * Dk + 2 * Dv)),
                                      transcendentals=int(keys),
                                      bytes_accessed=int(itemsize * B * S * Hkv * (Dk + Dv)
                                                         + 4 * B * Hkv * W * block_size
                                                         * (Dkp + Dvp)
                                                         + per_query * n + 4 * B * Hkv * E)),
        interpret=interpret,
        name="sparse_attention_dkv",
    )(*args)

    def gather_pieces(parts, D):                    # [B,Hkv,W,P,D] -> [B,S,Hkv,D]
        summed = jax.vmap(jax.vmap(lambda x, i: jax.ops.segment_sum(
            x, i, num_segments=NB, indices_are_sorted=True)))(parts, blk)
        return summed.transpose(0, 2, 3, 1, 4).reshape(B, S, Hkv, -1)[..., :D]

    return dq, gather_pieces(dk_parts, Dk).astype(k.dtype), gather_pieces(dv_parts, Dv).astype(
        v.dtype)
