"""Block-gather sparse attention in plain JAX, block-centric: never a [T, S] buffer.

Letters: B batch, T query tokens, S key tokens, Hkv KV heads, G query heads per KV head
(Hq = G * Hkv), Dk / Dv head dims, n block slots, P = block_size keys per block,
NB = ceil(S / P) key blocks per (batch, KV head), R = B * T * Hkv query rows (one row = the G query
heads of one KV-head group at one token), E = entries per tile (per shape: tuning.xla_tile_size).

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
most once in a tile (indices are unique per row). Each loop step takes C tiles at once (one batched
matmul; C from tuning.xla_step_scores, so small tiles do not leave the loop's per-step overhead in
charge), where a row can recur across tiles: the step scatter-maxes its rows' maxima, rescales
each row once (duplicate writes carry equal values) and scatter-adds the tiles' sums.
Backward: the same steps; dQ rows are scatter-added, dK / dV per block accumulated.
Empty slots (-1) make no entry, so they cost nothing. Both passes loop (lax.fori_loop with a traced
trip count) over the steps in use only.

Live memory: the float32 accumulators (R * G * Dv for o, R * G * Dk for dQ, dK / dV like K / V) plus
the tile plan (about B * T * Hkv * n int32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .tuning import TUNING, xla_tile_size


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
    """Entries sorted by key block and cut into tiles of E entries of one block each, C tiles per
    loop step.

    rows    [NT * E] int32: query row of each tile slot; padding slots hold R + slot (unique, out
            of range, so scatters drop them and the per-tile indices stay sorted and unique).
    blocks  [NT] int32: the global key block (b, h, block) of each tile.
    used    int32 scalar: number of tiles in use (the rest are padding).
    steps   int32 scalar: loop steps of C tiles that cover them.
    """

    def __init__(self, idx: jax.Array, nb: int, tile: int, per_step: int):
        B, T, Hkv, n = idx.shape
        R, nbt = B * T * Hkv, B * Hkv * nb
        N = R * n
        tiles = -(-N // tile) + nbt                                            # at most in use
        per_step = min(per_step, tiles)
        self.tile, self.per_step = tile, per_step
        self.num_tiles = -(-tiles // per_step) * per_step
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
        self.steps = -(-self.used // per_step)
        valid = sblock < nbt
        sb = jnp.minimum(sblock, nbt - 1)
        slots = self.num_tiles * tile
        dest = jnp.where(valid, tstarts[sb] * tile + jnp.arange(N) - starts[sb], slots)
        self.rows = (R + jnp.arange(slots, dtype=jnp.int32)).at[dest].set(srow, mode="drop")
        self.blocks = jnp.zeros((self.num_tiles,), jnp.int32).at[dest // tile].set(
            sb, mode="drop")
        self.R = R

    def step(self, i):
        """rows [C * E] and blocks [C] of loop step i. Within one tile the rows are sorted and
        unique; across the C tiles of a step a row can recur (its other blocks)."""
        c, e = self.per_step, self.tile
        return (jax.lax.dynamic_slice_in_dim(self.rows, i * c * e, c * e),
                jax.lax.dynamic_slice_in_dim(self.blocks, i * c, c))

    def scatter_kw(self) -> dict:
        """Scatter flags for a step's rows: sorted and unique only when a step is one tile."""
        one = self.per_step == 1
        return dict(mode="drop", indices_are_sorted=one, unique_indices=one)


def _row_view(x: jax.Array, Hkv: int) -> jax.Array:
    """[B, T, Hkv * G, ...] -> [R, G, ...]."""
    B, T, H = x.shape[:3]
    return x.reshape((B * T * Hkv, H // Hkv) + x.shape[3:])


def _tile_mask(rows, blk, limit_rows, qseg_rows, kvseg_blocks, nb, block_size):
    """[C, E, 1, P] visibility of the step's keys for each entry (rows [C * E], blk [C])."""
    c = blk.shape[0]
    rows = rows.reshape(c, -1)
    safe = jnp.minimum(rows, limit_rows.shape[0] - 1)
    pos = (blk % nb)[:, None] * block_size + jnp.arange(block_size)             # [C, P]
    mask = ((rows < limit_rows.shape[0])[:, :, None]
            & (pos[:, None, :] <= limit_rows[safe][:, :, None]))
    if qseg_rows is not None:
        mask &= kvseg_blocks[blk][:, None, :] == qseg_rows[safe][:, :, None]
    return mask[:, :, None, :]


def _prepare(q, k, v, idx, limit, q_seg, kv_seg, block_size, tile):
    """The tile plan, K / V as [B*Hkv*NB, P, D] blocks, and per-row limits / segment ids."""
    B, T, Hq, _ = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    nb = -(-S // block_size)
    n = idx.shape[-1]
    tile = min(tile or xla_tile_size(TUNING, T, n, nb), B * T * Hkv * n)
    plan = _Plan(idx, nb, tile,
                 max(1, TUNING.xla_step_scores // (tile * (Hq // Hkv) * block_size)))
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
    B, T, Hq, Dk = q.shape
    Hkv, Dv = v.shape[2], v.shape[3]
    G = Hq // Hkv
    plan, kb, vb, limit_rows, qseg_rows, kvsb, nb = _prepare(q, k, v, idx, limit, q_seg, kv_seg,
                                                          block_size, tile)
    prec = _precision(q.dtype)
    q_rows = _row_view(q, Hkv)                                                  # [R, G, Dk]
    R, C, E = plan.R, plan.per_step, plan.tile
    kw = plan.scatter_kw()

    def body(i, carry):
        o, m, l = carry
        rows, blk = plan.step(i)                                                # [C*E], [C]
        take = lambda x: jnp.take(x, rows, axis=0, mode="clip")
        qt = take(q_rows).reshape(C, E, G, Dk)
        s = jnp.einsum("cegd,cpd->cegp", qt, kb[blk], precision=prec,
                       preferred_element_type=jnp.float32) * scale
        mask = _tile_mask(rows, blk, limit_rows, qseg_rows, kvsb, nb, block_size)
        m_old = take(m)                                                         # [C*E, G]
        # A row recurs across the step's tiles (its other blocks): the scatter-max gives its
        # maximum over all of them, and the rescaling below writes the same value for each copy.
        m = m.at[rows].max(jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1).reshape(C * E, G),
                           **kw)
        m_new = take(m)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - m_safe.reshape(C, E, G, 1)), 0.0)
        alpha = jnp.exp(m_old - m_safe)                                         # 0 when m_old=-inf
        pv = jnp.einsum("cegp,cpf->cegf", p.astype(v.dtype), vb[blk], precision=prec,
                        preferred_element_type=jnp.float32)
        o = o.at[rows].set(alpha[..., None] * take(o), **kw)
        l = l.at[rows].set(alpha * take(l), **kw)
        return (o.at[rows].add(pv.reshape(C * E, G, Dv), **kw),
                m, l.at[rows].add(jnp.sum(p, axis=-1).reshape(C * E, G), **kw))

    init = (jnp.zeros((R, G, Dv), jnp.float32), jnp.full((R, G), -jnp.inf, jnp.float32),
            jnp.zeros((R, G), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, plan.steps, body, init)
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
    R, C, E = plan.R, plan.per_step, plan.tile

    def body(i, carry):
        dq, dkb, dvb = carry
        rows, blk = plan.step(i)
        take = lambda x: jnp.take(x, rows, axis=0, mode="clip").reshape((C, E) + x.shape[1:])
        qt, dot = take(q_rows), take(do_rows)
        kt, vt = kb[blk], vb[blk]                                               # [C, P, D]
        s = jnp.einsum("cegd,cpd->cegp", qt, kt, precision=prec,
                       preferred_element_type=jnp.float32) * scale
        mask = _tile_mask(rows, blk, limit_rows, qseg_rows, kvsb, nb, block_size)
        p = jnp.where(mask, jnp.exp(s - take(lse_rows)[..., None]), 0.0)       # [C, E, G, P]
        dp = jnp.einsum("cegf,cpf->cegp", dot, vt, precision=prec,
                        preferred_element_type=jnp.float32)
        ds = p * (dp - take(delta_rows)[..., None]) * scale
        dq_t = jnp.einsum("cegp,cpd->cegd", ds.astype(k.dtype), kt, precision=prec,
                          preferred_element_type=jnp.float32)
        dk_t = jnp.einsum("cegp,cegd->cpd", ds.astype(q.dtype), qt, precision=prec,
                          preferred_element_type=jnp.float32)
        dv_t = jnp.einsum("cegp,cegf->cpf", p.astype(do.dtype), dot, precision=prec,
                          preferred_element_type=jnp.float32)
        dq = dq.at[rows].add(dq_t.reshape(C * E, G, Dk), **plan.scatter_kw())
        # Consecutive tiles of one block share its index: the scatter-add sums them.
        return dq, dkb.at[blk].add(dk_t), dvb.at[blk].add(dv_t)

    nbt = kb.shape[0]
    init = (jnp.zeros((R, G, Dk), jnp.float32), jnp.zeros((nbt, block_size, Dk), jnp.float32),
            jnp.zeros((nbt, block_size, Dv), jnp.float32))
    dq, dkb, dvb = jax.lax.fori_loop(0, plan.steps, body, init)
    return (dq.reshape(B, T, Hq, Dk).astype(q.dtype), _unblocks(dkb, B, S, Hkv).astype(k.dtype),
            _unblocks(dvb, B, S, Hkv).astype(v.dtype))
