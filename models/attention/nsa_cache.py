"""The decoding cache of the "nsa" mixer (models/attention/nsa.py): its layout, the prefill / decode
write, and the decode step's selected-block read. NSAttention takes these methods from
NSACacheMixin; the attention arithmetic stays in nsa.py's _branches. Shape letters as in nsa.py.

The cache (prefill / decode, see models/registry.py) is head-major like the dense cache: raw K/V of the
selection branch [B,K,S,Dh], the window branch's ring of W = min(w, S) slots [B,K,W,Dh] (the token
at position p in slot p mod W; with separate_kv=False one K/V pair of S slots serves both branches),
the compression branch's last l - 1 un-rotated inputs ("k_src"/"v_src" [B,l-1,K,Dh]), compressed
K/V [B,K,C,Dh] (C = compressed tokens that fit in S), and lengths [B]. The window's and the
compressed keys are stored transposed, [B,K,Dh,W] and [B,K,Dh,C] (TRANSPOSED_KEYS): a decode
step's logits over them are then a plain product, which XLA:CPU runs 1.5-2x faster for a few query
rows than [S,Dh]^T. A call writes the T new tokens at each row's length (the window: its last W
tokens into the ring), then compresses every block that these tokens complete (at most ceil(T/d)
per row: a new compressed token every d tokens). A decode step reads the C compressed tokens, the
n selected blocks (gathered) and the whole window ring (no copy; a shared cache: a slice of the
last w keys): O(S/d + n*l' + w) work, each read in the layout cached_attention takes. The ring
also keeps the window's memory at W slots instead of S (at 64K context and w = 512, about half
of the cache). Sequence-major, every decode step copied the compressed and window keys and values
into that layout (16 copies, ~1 ms of an nsa_tiny step at batch 8, 1K context); a prefill chunk,
whose T queries share the copy, now transposes what the tiled kernels read instead.
Pass the cache as a donated argument (or loop inside one jit) so the O(1) writes happen in place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from aiinfra_jax.kernels.flash_attention import AttentionMask, cached_attention
from aiinfra_jax.kernels.flash_attention.mask import visible

from .dense import cache_room, refuse_rows, scatter_slots, write_cache

NSACache = dict[str, jax.Array]


def n_compressed(seq_len: int, block_len: int, stride: int) -> int:
    """Compressed tokens whose block fits in seq_len raw tokens (at least 1: a never-visible
    placeholder when seq_len < block_len keeps the kernels' key axis non-empty)."""
    return max(1, (seq_len - block_len) // stride + 1)


def attend_one(q, k, v, mask: AttentionMask, offset_b, **kwargs):
    """One query per row (decode) at position offset_b [B] over the head-major keys and values
    v [B,K,S,Dh] under `mask` (flash_attention's rule), through cached_attention (kwargs: its
    keys_transposed and return_* flags)."""
    slots = v.shape[2]
    vis = visible(mask, offset_b[:, None, None], jnp.arange(slots)[None, None, :], slots)
    vis = jnp.broadcast_to(vis, (q.shape[0], 1, slots))
    return cached_attention(q, k, v, vis, **kwargs)


# Key buffers stored transposed, [B,K,Dh,S]: those a decode step reads as one run per row (the
# window ring, all compressed tokens). The selection keys stay [B,K,S,Dh]: gathering blocks of
# transposed keys was a gather fused with a transpose, 3-4x slower than the dot it sped up.
TRANSPOSED_KEYS = ("k_win", "k_cmp")


def cache_layout(name: str) -> str:
    """write_cache layout of a cache entry."""
    return "bkds" if name in TRANSPOSED_KEYS else "bksd"


def cache_keys(separate_kv: bool) -> dict[str, tuple[str, str]]:
    """Branch -> its (key, value) raw cache entries (head-major; layouts: cache_layout)."""
    if separate_kv:
        return {"slc": ("k_slc", "v_slc"), "win": ("k_win", "v_win")}
    return {"slc": ("k", "v"), "win": ("k", "v")}


def tail_len(block_len: int) -> int:
    """Raw tokens of the compression branch kept in the cache: the l - 1 before the next token."""
    return max(block_len - 1, 1)


class NSACacheMixin:
    """The cached path of NSAttention (module docstring): uses its cfg, compress and _branches."""

    def _decode_selected(self, q, k, v, idx, lengths):
        """Selection branch of one decode step (T = 1) in O(n*l') over the head-major cache k, v
        [B,K,S,Dh]: the n selected blocks are gathered as contiguous slices into [B,K,n*l',Dh]
        and cached_attention runs on that short key axis, each slot visible when it lies in its
        block (a slice at the cache's end starts early, when S is not a multiple of l') and not
        after the query (its own block is partly written). A cache of at most n*l' slots is read
        whole instead, its unselected blocks masked: the same keys without the gather's copy."""
        size = self.cfg.nsa.sel_block_size
        batch, kv_heads, slots = v.shape[:3]
        idx = idx[:, 0]  # [B,K,n]
        if slots <= idx.shape[-1] * size:
            slot = jnp.arange(slots, dtype=jnp.int32)
            chosen = ((slot // size)[None, None, :, None] == idx[:, :, None, :]).any(-1)
            vis = chosen & (slot[None, :] <= lengths[:, None])[:, None, :]  # [B,K,S]
            return cached_attention(q, k, v, vis[:, :, None, :])
        starts = jnp.clip(idx * size, 0, slots - size)  # [B,K,n]
        # Per (row, head, block) one slice of l' contiguous slots, in bounds by the clip above
        # (take_along_axis on slot indices was a clamped element gather, 2x slower here; vmapped
        # dynamic slices clamp their starts again).
        dims = jax.lax.GatherDimensionNumbers(offset_dims=(3, 4), collapsed_slice_dims=(),
                                              start_index_map=(2,), operand_batching_dims=(0, 1),
                                              start_indices_batching_dims=(0, 1))
        k_sel, v_sel = (jax.lax.gather(a, starts[..., None], dims, (1, 1, size, a.shape[-1]),
                                       mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
                        .reshape(batch, kv_heads, -1, a.shape[-1]) for a in (k, v))
        pos = starts[..., None] + jnp.arange(size, dtype=jnp.int32)  # [B,K,n,P]
        vis = ((pos // size == idx[..., None]) & (pos <= lengths[:, None, None, None]))
        return cached_attention(q, k_sel, v_sel, vis.reshape(batch, kv_heads, 1, -1))

    def _cached(self, q, gates, new, positions, segment_ids, cache):
        """Prefill / decode: write the new tokens, compress the blocks they complete, attend."""
        c = self.cfg.nsa
        dt = jnp.dtype(self.cfg.dtype)
        names = cache_keys(c.separate_kv)
        lengths = cache["lengths"]
        batch, seq = q.shape[:2]
        slots = cache[names["slc"][1]].shape[2]
        n_cmp = cache["v_cmp"].shape[2]
        added, fits, write_at = cache_room(lengths, segment_ids, seq, slots)
        out = {"lengths": lengths + jnp.where(fits, added, 0)}
        ring = c.separate_kv  # the window has its own buffers: a ring (_ring_window)
        # sorted: a set's order changes with PYTHONHASHSEED, and with it the program, which then
        # misses JAX's persistent compilation cache in every new process
        for name in sorted({n for pair in names.values() for n in pair}):
            if not (ring and name in names["win"]):
                out[name] = write_cache(cache[name], new[name], write_at, layout=cache_layout(name))
        # Compression sources: the cached tail (rows [len - m, len)) followed by the new tokens;
        # index c of `src` is row len - m + c. Blocks end at rows e in [len, len + added) with
        # i*d + L - 1 = e (at most ceil(T / d) of them).
        d, blk = c.cmp_stride, c.cmp_block_len
        m = tail_len(blk)
        src = {n: jnp.concatenate([cache[n].astype(dt), new[n]], axis=1)
               for n in ("k_src", "v_src")}
        keep = (added[:, None] + jnp.arange(m, dtype=jnp.int32))[:, :, None, None]
        for n in ("k_src", "v_src"):
            tail = jnp.take_along_axis(src[n], keep, axis=1).astype(cache[n].dtype)
            out[n] = jnp.where(fits[:, None, None, None], tail, cache[n])
        n_new = -(-seq // d)
        first = jnp.maximum(-(-(lengths - blk + 1) // d), 0)
        idx_bj = first[:, None] + jnp.arange(n_new, dtype=jnp.int32)[None, :]
        ends = idx_bj * d + blk - 1
        valid = (ends < lengths[:, None] + added[:, None]) & (idx_bj < n_cmp) & fits[:, None]
        end_pos = jnp.take_along_axis(positions, jnp.clip(ends - lengths[:, None], 0, seq - 1),
                                      axis=1)
        k_new, v_new = self.compress(src["k_src"], src["v_src"],
                                     idx_bj * d - (lengths[:, None] - m), end_pos)
        target = jnp.where(valid, idx_bj, n_cmp)  # out of range: dropped
        for name, value in (("k_cmp", k_new), ("v_cmp", v_new)):
            out[name] = scatter_slots(cache[name], target, value, layout=cache_layout(name))
        kv = {b: tuple(out[n].astype(dt) for n in pair)
              for b, pair in {"cmp": ("k_cmp", "v_cmp"), "slc": names["slc"]}.items()}
        win_seg = None
        if ring:
            ring_out, kv["win"], win_offset, win_seg = self._ring_window(cache, new, lengths,
                                                                         added, fits)
            out.update(ring_out)
        else:  # the window branch reads only the last w + T - 1 slots of the shared cache
            win_len = min(slots, c.window + seq - 1)
            start = jnp.clip(lengths - (c.window - 1), 0, slots - win_len)
            # One contiguous slice per row (take_along_axis' clamped gather cost 2x more).
            take = jax.vmap(lambda a, s: jax.lax.dynamic_slice_in_dim(a, s, win_len, 1))
            kv["win"] = tuple(take(out[n], start).astype(dt) for n in names["win"])
            win_offset = lengths - start
        if seq > 1:  # a prefill chunk: the tiled kernels take [B,S,K,Dh]
            seq_major = {"bkds": (0, 3, 1, 2), "bksd": (0, 2, 1, 3)}
            kv = {b: tuple(a.transpose(seq_major[cache_layout(n)]) for a, n in zip(kv[b], pair))
                  for b, pair in {"cmp": ("k_cmp", "v_cmp"), **names}.items()}
        y = self._branches(q, gates, kv, seq_len=slots, q_offset=lengths, win_offset=win_offset,
                           win_segment_ids=win_seg)
        return refuse_rows(y, fits), out

    def _ring_window(self, cache, new, lengths, added, fits):
        """The window branch over its ring of W slots (position p in slot p mod W; W <= w):
        (the written ring buffers, the keys and values this call attends to in their cache
        layouts, their q_offset, their (q, kv) segment ids or None).

        A decode step attends to the whole ring as it is stored, no copy: after the write it
        holds exactly the last min(W, length + 1) positions, all inside the window, and slot j
        is written once j <= length (q_offset min(length, W - 1) under the window mask). A
        prefill chunk of T tokens attends to the ring before its write, gathered into position
        order (positions length - W ... length - 1), followed by the chunk's own T keys: q_offset
        W, and kv segment id -1 on the slots of negative positions (not yet written)."""
        dt = jnp.dtype(self.cfg.dtype)
        names = ("k_win", "v_win")
        ring = cache["v_win"].shape[2]
        seq = new["v_win"].shape[1]
        t = jnp.arange(seq, dtype=jnp.int32)[None, :]
        # Only each row's last W real tokens are written: earlier ones would share their slots,
        # and a scatter's order among duplicate indices is undefined (XLA:CPU happens to keep
        # the last one, so no test on this machine can tell).
        keep = fits[:, None] & (t < added[:, None]) & (t >= added[:, None] - ring)
        target = jnp.where(keep, (lengths[:, None] + t) % ring, ring)  # out of range: dropped
        out = {n: scatter_slots(cache[n], target, new[n], layout=cache_layout(n)) for n in names}
        if seq == 1:
            kv = tuple(out[n].astype(dt) for n in names)
            return out, kv, jnp.minimum(lengths, ring - 1), None
        s = jnp.arange(ring, dtype=jnp.int32)[None, :]
        order = (lengths[:, None] + s) % ring  # [B,W]: slot of position length - W + s
        kv = []
        for n in names:
            axis = cache_layout(n).index("s")
            idx = jnp.expand_dims(order, [a for a in (1, 2, 3) if a != axis])
            old = jnp.take_along_axis(cache[n], idx, axis=axis)
            chunk = new[n].transpose((0, 2, 3, 1) if axis == 3 else (0, 2, 1, 3))
            kv.append(jnp.concatenate([old.astype(dt), chunk.astype(dt)], axis=axis))
        q_seg = jnp.zeros((lengths.shape[0], seq), jnp.int32)
        kv_seg = jnp.concatenate([jnp.where(lengths[:, None] - ring + s >= 0, 0, -1), q_seg], 1)
        return out, tuple(kv), jnp.full_like(lengths, ring), (q_seg, kv_seg)

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> NSACache:
        c = self.cfg.nsa
        dtype = jnp.dtype(dtype or self.cfg.dtype)
        kv_shape = (self.cfg.n_kv_heads, self.cfg.resolved_head_dim)
        n_cmp = n_compressed(max_len, c.cmp_block_len, c.cmp_stride)
        k, dh = kv_shape
        names = sorted({n for pair in cache_keys(c.separate_kv).values() for n in pair})
        ring = min(c.window, max_len)  # the window's ring (_ring_window)
        slots = {n: ring if n in ("k_win", "v_win") else max_len for n in names}
        cache = {n: jnp.zeros((batch, k, dh, slots[n]) if cache_layout(n) == "bkds"
                              else (batch, k, slots[n], dh), dtype) for n in names}
        tail = (batch, tail_len(c.cmp_block_len)) + kv_shape
        cache["k_src"], cache["v_src"] = jnp.zeros(tail, dtype), jnp.zeros(tail, dtype)
        cache["k_cmp"] = jnp.zeros((batch, k, dh, n_cmp), dtype)  # cache_layout: transposed
        cache["v_cmp"] = jnp.zeros((batch, k, n_cmp, dh), dtype)
        cache["lengths"] = jnp.zeros((batch,), jnp.int32)
        return cache
