"""Block-gather sparse attention in plain JAX, block-centric: never a [T, S] buffer.

Letters: B batch, T query tokens, S key tokens, Hkv KV heads, G query heads per KV head
(Hq = G * Hkv), Dk / Dv head dims, n block slots, P = block_size keys per block,
NB = ceil(S / P) key blocks per (batch, KV head), R = B * T * Hkv query rows (one row = the G query
heads of one KV-head group at one token), E = entries per tile.

Inputs are the normalized ones built by api.py: `idx` [B,T,Hkv,n] int32 holds unique block ids in
[0, NB) or -1 (uniqueness is required: a tile's scatters assume each row appears once in it);
`limit` [B,T] int32 is the last key position a query may see (causal / padding); `q_seg` [B,T] and
`kv_seg` [B,S] are both None or both int32 segment ids.

The layout is the NSA paper's query-group-centric one (all G heads of a group share one matmul)
turned around: every (query row, selected block) pair is an entry; the entries are sorted by block
and cut into tiles of E entries that all read the same key block (each block's list padded to a
multiple of E). One tile is one matmul of [E * G, Dk] x [Dk, P]: the key / value block is loaded
once per tile, only the E query rows are gathered (G * Dk elements each instead of P * (Dk + Dv)
key / value elements per entry), and dK / dV of the tile's block are two dense matmuls accumulated
in place (no per-entry scatter).

Forward: an online softmax over the tiles, keeping float32 (o, m, l) per query row; a row appears at
most once in a tile (indices are unique per row), so each tile gathers and writes back its rows.
Backward: the same tiles; dQ rows are scatter-added (unique rows), dK / dV per block accumulated.
Empty slots (-1) make no entry, so they cost nothing. Both passes loop (lax.fori_loop with a traced
trip count) over the tiles in use only.

Live memory: the float32 accumulators (R * G * Dv for o, R * G * Dk for dQ, dK / dV like K / V) plus
the tile plan (about B * T * Hkv * n int32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .tuning import TUNING


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
    """[B, S, H, D] -> [B * H * NB, P, D] (zero-padded keys past S)."""
    B, S, H, D = x.shape
    nb = -(-S // block_size)
    x = jnp.pad(x, ((0, 0), (0, nb * block_size - S), (0, 0), (0, 0)))
    x = x.reshape(B, nb, block_size, H, D)
    if H > 1:
        x = x.transpose(0, 3, 1, 2, 4)
    return x.reshape(B * H * nb, block_size, D)


def _unblocks(xb: jax.Array, B: int, S: int, H: int) -> jax.Array:
    """[B * H * NB, P, D] -> [B, S, H, D]."""
    _, P, D = xb.shape
    nb = xb.shape[0] // (B * H)
    x = xb.reshape(B, H, nb, P, D)
    if H > 1:
        x = x.transpose(0, 2, 3, 1, 4)
    return x.reshape(B, nb * P, H, D)[:, :S]


class _Plan:
    """Entries sorted by key block and cut into tiles of E entries of one block each.

    rows    [NT * E] int32: query row of each tile slot; padding slots hold R + slot (unique, out
            of range, so scatters drop them and the per-tile indices stay sorted and unique).
    blocks  [NT] int32: the global key block (b, h, block) of each tile.
    used    int32 scalar: number of tiles in use (the rest are padding).
    """

    def __init__(self, idx: jax.Array, nb: int, tile: int):
        B, T, Hkv, n = idx.shape
        R, nbt = B * T * Hkv, B * Hkv * nb
        N = R * n
        self.tile = tile
        self.num_tiles = -(-N // tile) + nbt
        bh = (jnp.arange(B)[:, None, None, None] * Hkv + jnp.arange(Hkv)[None, None, :, None])
        gblock = jnp.where(idx >= 0, bh * nb + idx, nbt).reshape(N)           # nbt = no block
        row = jnp.arange(N, dtype=jnp.int32) // n                               # (b, t, h) order
        order = jnp.argsort(gblock, stable=True)
        sblock, srow = gblock[order], row[order]
        counts = jnp.zeros((nbt + 1,), jnp.int32).at[gblock].add(1)[:nbt]
        starts = jnp.cumsum(counts) - counts
        ntiles = -(-counts // tile)
        tstarts = jnp.cumsum(ntiles) - ntiles
        self.used = jnp.sum(ntiles)
        valid = sblock < nbt
        sb = jnp.minimum(sblock, nbt - 1)
        slots = self.num_tiles * tile
        dest = jnp.where(valid, tstarts[sb] * tile + jnp.arange(N) - starts[sb], slots)
        self.rows = (R + jnp.arange(slots, dtype=jnp.int32)).at[dest].set(srow, mode="drop")
        self.blocks = jnp.zeros((self.num_tiles,), jnp.int32).at[dest // tile].set(
            sb, mode="drop")
        self.R = R

    def tile_rows(self, t):
        return jax.lax.dynamic_slice_in_dim(self.rows, t * self.tile, self.tile)


def _row_view(x: jax.Array, Hkv: int) -> jax.Array:
    """[B, T, Hkv * G, ...] -> [R, G, ...]."""
    B, T, H = x.shape[:3]
    return x.reshape((B * T * Hkv, H // Hkv) + x.shape[3:])


def _tile_mask(rows, blk, limit_rows, qseg_rows, kvseg_blocks, nb, block_size):
    """[E, 1, P] visibility of the tile's keys for each of its entries."""
    safe = jnp.minimum(rows, limit_rows.shape[0] - 1)
    pos = (blk % nb) * block_size + jnp.arange(block_size)                     # [P]
    mask = (rows < limit_rows.shape[0])[:, None] & (pos[None, :] <= limit_rows[safe][:, None])
    if qseg_rows is not None:
        mask &= kvseg_blocks[blk][None, :] == qseg_rows[safe][:, None]
    return mask[:, None, :]


def _prepare(q, k, v, idx, limit, q_seg, kv_seg, block_size, tile):
    """The tile plan, K / V as [B*Hkv*NB, P, D] blocks, and per-row limits / segment ids."""
    B, T, Hq, _ = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    nb = -(-S // block_size)
    plan = _Plan(idx, nb, min(tile or TUNING.xla_tile_entries, B * T * Hkv * idx.shape[-1]))
    kb, vb = _blocks(k, block_size), _blocks(v, block_size)
    # Per-row limit / segment (a row is one (b, t, h)).
    limit_rows = jnp.broadcast_to(limit[:, :, None], (B, T, Hkv)).reshape(-1)
    if q_seg is None:
        qseg_rows = kvseg_blocks = None
    else:
        qseg_rows = jnp.broadcast_to(q_seg[:, :, None], (B, T, Hkv)).reshape(-1)
        kvseg_blocks = _blocks(kv_seg[:, :, None, None], block_size)[..., 0]   # [B*NB, P]
        if Hkv > 1:
            kvseg_blocks = jnp.broadcast_to(kvseg_blocks.reshape(B, 1, nb, block_size),
                                            (B, Hkv, nb, block_size)).reshape(-1, block_size)
    return plan, kb, vb, limit_rows, qseg_rows, kvseg_blocks, nb


def forward(q, k, v, idx, limit, q_seg, kv_seg, *, block_size: int, scale: float,
            tile: int | None = None):
    """Returns (o [B,T,Hq,Dv] in q.dtype, lse [B,T,Hq] float32)."""
    B, T, Hq, _ = q.shape
    Hkv, Dv = v.shape[2], v.shape[3]
    G = Hq // Hkv
    plan, kb, vb, limit_rows, qseg_rows, kvsb, nb = _prepare(q, k, v, idx, limit, q_seg, kv_seg,
                                                          block_size, tile)
    prec = _precision(q.dtype)
    q_rows = _row_view(q, Hkv)                                                  # [R, G, Dk]
    R = plan.R

    def body(t, carry):
        o, m, l = carry
        rows = plan.tile_rows(t)
        blk = plan.blocks[t]
        qt = jnp.take(q_rows, rows, axis=0, mode="clip")                        # [E, G, Dk]
        s = jnp.einsum("egd,pd->egp", qt, kb[blk], precision=prec,
                       preferred_element_type=jnp.float32) * scale
        mask = _tile_mask(rows, blk, limit_rows, qseg_rows, kvsb, nb, block_size)
        m_old = jnp.take(m, rows, axis=0, mode="clip")                          # [E, G]
        m_new = jnp.maximum(m_old, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m_old - m_safe)                                         # 0 when m_old=-inf
        l_new = alpha * jnp.take(l, rows, axis=0, mode="clip") + jnp.sum(p, axis=-1)
        pv = jnp.einsum("egp,pf->egf", p.astype(v.dtype), vb[blk], precision=prec,
                        preferred_element_type=jnp.float32)
        o_new = alpha[..., None] * jnp.take(o, rows, axis=0, mode="clip") + pv
        kw = dict(mode="drop", indices_are_sorted=True, unique_indices=True)
        return (o.at[rows].set(o_new, **kw), m.at[rows].set(m_new, **kw),
                l.at[rows].set(l_new, **kw))

    init = (jnp.zeros((R, G, Dv), jnp.float32), jnp.full((R, G), -jnp.inf, jnp.float32),
            jnp.zeros((R, G), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, plan.used, body, init)
    has = l > 0
    l_safe = jnp.where(has, l, 1.0)
    o = (o / l_safe[..., None]).astype(q.dtype).reshape(B, T, Hq, Dv)
    lse = jnp.where(has, m + jnp.log(l_safe), -jnp.inf).reshape(B, T, Hq)
    return o, lse


def backward(q, k, v, idx, limit, q_seg, kv_seg, o, lse, do, delta, *, block_size: int,
             scale: float, tile: int | None = None):
    """Gradients (dq, dk, dv) given the cotangent `do` and delta = sum(do*o, -1) - dlse [B,T,Hq]."""
    del o
    B, T, Hq, Dk = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    plan, kb, vb, limit_rows, qseg_rows, kvsb, nb = _prepare(q, k, v, idx, limit, q_seg, kv_seg,
                                                          block_size, tile)
    prec = _precision(q.dtype)
    q_rows, do_rows = _row_view(q, Hkv), _row_view(do, Hkv)
    lse_rows = _row_view(jnp.where(jnp.isfinite(lse), lse, 0.0), Hkv)            # [R, G]
    delta_rows = _row_view(delta, Hkv)
    R = plan.R

    def body(t, carry):
        dq, dkb, dvb = carry
        rows = plan.tile_rows(t)
        blk = plan.blocks[t]
        take = lambda x: jnp.take(x, rows, axis=0, mode="clip")
        qt, dot = take(q_rows), take(do_rows)
        kt, vt = kb[blk], vb[blk]
        s = jnp.einsum("egd,pd->egp", qt, kt, precision=prec,
                       preferred_element_type=jnp.float32) * scale
        mask = _tile_mask(rows, blk, limit_rows, qseg_rows, kvsb, nb, block_size)
        p = jnp.where(mask, jnp.exp(s - take(lse_rows)[..., None]), 0.0)       # [E, G, P]
        dp = jnp.einsum("egf,pf->egp", dot, vt, precision=prec,
                        preferred_element_type=jnp.float32)
        ds = p * (dp - take(delta_rows)[..., None]) * scale
        dq_t = jnp.einsum("egp,pd->egd", ds.astype(k.dtype), kt, precision=prec,
                          preferred_element_type=jnp.float32)
        dk_t = jnp.einsum("egp,egd->pd", ds.astype(q.dtype), qt, precision=prec,
                          preferred_element_type=jnp.float32)
        dv_t = jnp.einsum("egp,egf->pf", p.astype(do.dtype), dot, precision=prec,
                          preferred_element_type=jnp.float32)
        dq = dq.at[rows].add(dq_t, mode="drop", indices_are_sorted=True, unique_indices=True)
        dkb = dkb.at[blk].add(dk_t)
        dvb = dvb.at[blk].add(dv_t)
        return dq, dkb, dvb

    nbt = kb.shape[0]
    init = (jnp.zeros((R, G, Dk), jnp.float32), jnp.zeros((nbt, block_size, Dk), jnp.float32),
            jnp.zeros((nbt, block_size, Dv), jnp.float32))
    dq, dkb, dvb = jax.lax.fori_loop(0, plan.used, body, init)
    return (dq.reshape(B, T, Hq, Dk).astype(q.dtype), _unblocks(dkb, B, S, Hkv).astype(k.dtype),
            _unblocks(dvb, B, S, Hkv).astype(v.dtype))
