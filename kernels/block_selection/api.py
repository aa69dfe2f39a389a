"""Public NSA block selection: score selection blocks from the compressed branch, pick top-n.

Letters: B batch, T queries, Sc compressed tokens, Hq query heads, Hkv KV heads (G = Hq / Hkv),
Dk head dim, nb = ceil(seq_len / block_size) selection blocks, n = n_selected.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from aiinfra_jax.kernels import _dispatch, _sharding
from aiinfra_jax.kernels.block_selection import xla as xla_impl
from aiinfra_jax.kernels.block_selection.reference import (REMAPS, Remap,
                                                           doc_start_positions)

_OP = "select_blocks"
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _positive_int(x, name: str, minimum: int = 1):
    if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < minimum:
        raise ValueError(f"{_OP}: {name} must be an int >= {minimum}, got {x!r}")


def _validate_geometry(seq_len, cmp_block_len, cmp_stride, block_size, n_selected, n_init,
                       n_local, remap):
    _positive_int(seq_len, "seq_len")
    _positive_int(cmp_stride, "cmp_stride")
    _positive_int(cmp_block_len, "cmp_block_len", cmp_stride)
    _positive_int(block_size, "block_size")
    _positive_int(n_selected, "n_selected")
    _positive_int(n_init, "n_init", 0)
    _positive_int(n_local, "n_local", 0)
    if n_init + n_local > n_selected:
        raise ValueError(f"{_OP}: n_init + n_local = {n_init + n_local} forced blocks exceed "
                         f"n_selected={n_selected}; lower n_init/n_local or raise n_selected")
    if remap not in REMAPS:
        raise ValueError(f"{_OP}: remap must be one of {REMAPS}, got {remap!r}")


def _validate(q, k_cmp, lse_cmp, seq_len, cmp_block_len, cmp_stride, block_size, n_selected,
              n_init, n_local, remap, scale, q_offset, q_segment_ids):
    for name, x, rank, layout in (("q", q, 4, "[B,T,Hq,Dk]"), ("k_cmp", k_cmp, 4, "[B,Sc,Hkv,Dk]"),
                                  ("lse_cmp", lse_cmp, 3, "[B,T,Hq]")):
        if not hasattr(x, "shape"):
            raise ValueError(f"{_OP}: {name} must be an array, got {type(x).__name__}")
        if len(x.shape) != rank:
            raise ValueError(f"{_OP}: {name} must have rank {rank} {layout}, got shape "
                             f"{list(x.shape)}")
    b, t, hq, dk = q.shape
    if k_cmp.shape[0] != b or k_cmp.shape[3] != dk:
        raise ValueError(f"{_OP}: k_cmp shape {list(k_cmp.shape)} must be [B={b}, Sc, Hkv, "
                         f"Dk={dk}]")
    if k_cmp.shape[1] <= 0 or t <= 0:
        raise ValueError(f"{_OP}: q and k_cmp need non-empty T and Sc, got T={t}, "
                         f"Sc={k_cmp.shape[1]}")
    if hq % k_cmp.shape[2]:
        raise ValueError(f"{_OP}: q heads Hq={hq} must be a multiple of k_cmp heads "
                         f"Hkv={k_cmp.shape[2]}")
    if tuple(lse_cmp.shape) != (b, t, hq):
        raise ValueError(f"{_OP}: lse_cmp must have shape {[b, t, hq]} [B,T,Hq], got "
                         f"{list(lse_cmp.shape)}")
    for name, x in (("q", q), ("k_cmp", k_cmp)):
        if jnp.dtype(x.dtype).name not in _FLOAT_DTYPES:
            raise ValueError(f"{_OP}: {name}.dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    if k_cmp.dtype != q.dtype:
        raise ValueError(f"{_OP}: k_cmp.dtype {k_cmp.dtype} must match q.dtype {q.dtype}")
    _validate_geometry(seq_len, cmp_block_len, cmp_stride, block_size, n_selected, n_init,
                       n_local, remap)
    if remap == "eq9" and (cmp_block_len % cmp_stride or block_size % cmp_stride):
        raise ValueError(f"{_OP}: remap='eq9' needs cmp_stride | cmp_block_len and cmp_stride | "
                         f"block_size (got l={cmp_block_len}, d={cmp_stride}, l'={block_size}); "
                         f"use remap='overlap'")
    if scale is not None and (not isinstance(scale, (int, float, np.floating)) or scale <= 0):
        raise ValueError(f"{_OP}: scale must be a positive Python float, got {scale!r}")
    for name, x, shape in (("q_offset", q_offset, (b,)), ("q_segment_ids", q_segment_ids, (b, t))):
        if x is None:
            continue
        if tuple(getattr(x, "shape", ())) != shape:
            raise ValueError(f"{_OP}: {name} must have shape {list(shape)}, got "
                             f"{list(getattr(x, 'shape', ()))}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{_OP}: {name} must be an integer array, got dtype {x.dtype}")


def block_scores_unchecked(q, k_cmp, lse_cmp, *, seq_len: int, remap: Remap, scale: float,
                           q_offset=None, q_segment_ids=None, implementation: str,
                           interpret: bool = False, block_q: int | None = None,
                           block_n: int | None = None):
    """Per-group block scores [B, T, Hkv, nb] float32 running `implementation` on every platform,
    without the platform check (internal: tests use it for the tile sizes); inputs are not
    validated."""
    _dispatch.check_name(_OP, implementation)
    return _block_scores(q, k_cmp, lse_cmp, _dispatch.Selection.only(implementation),
                         seq_len=seq_len, remap=remap, scale=scale, q_offset=q_offset,
                         q_segment_ids=q_segment_ids, interpret=interpret, block_q=block_q,
                         block_n=block_n)


def _block_scores(q, k_cmp, lse_cmp, selection: _dispatch.Selection, *, seq_len: int,
                  remap: Remap, scale: float, q_offset, q_segment_ids, interpret: bool,
                  block_q: int | None, block_n: int | None):
    """Scores with the implementation `selection` picks for the lowering platform; the Pallas
    kernels run in a shard_map under a mesh (batch over the batch axes, KV heads over "tensor")."""
    b = q.shape[0]
    off = jnp.zeros((b,), jnp.int32) if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    seg = None if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32)
    plan = _dispatch.shard_plan(_OP, selection, batch=b, heads=k_cmp.shape[2])

    def specs(sh):
        x = sh.spec("batch", None, "heads", None)
        return ((x, x, sh.spec("batch", None, "heads"), sh.spec("batch"), sh.spec("batch", None)),
                x)

    def scores(implementation, q, k_cmp, lse_cmp, off, seg):
        if implementation == "xla":
            return xla_impl.block_scores(q, k_cmp, lse_cmp, off, seg, seq_len=seq_len,
                                         remap=remap, scale=scale, block_q=block_q or 256)
        if implementation == "pallas_gpu":
            from aiinfra_jax.kernels.block_selection import pallas_gpu as mod
        else:
            from aiinfra_jax.kernels.block_selection import pallas_tpu as mod
        kw = {k: v for k, v in (("block_q", block_q), ("block_n", block_n)) if v is not None}
        kernel = functools.partial(mod.block_scores, seq_len=seq_len, remap=remap, scale=scale,
                                   interpret=interpret, **kw)
        return _sharding.run(plan, kernel, (q, k_cmp, lse_cmp, off, seg), specs)

    return _dispatch.run(selection, scores, q, k_cmp, lse_cmp, off, seg)


def select_from_scores(scores, q_pos, doc_start, *, block_size: int, n_selected: int,
                       n_init: int, n_local: int):
    """Top-n block indices [B, T, Hkv, n] int32 from scores [B, T, Hkv, nb].

    Candidates for a query at position p: blocks j with doc_start // block_size <= j <= p //
    block_size (never past the query's own block). Forced: the first n_init candidate blocks and
    the n_local blocks ending at the query's own block. Forced blocks come first (score +inf),
    then the best remaining by score; jax.lax.top_k is stable, so among equal scores the lower
    block index wins. Output is sorted ascending by block index with -1 (empty slot) at the end.
    """
    nb = scores.shape[-1]
    j = jnp.arange(nb, dtype=jnp.int32)
    own = jnp.minimum(q_pos // block_size, nb - 1)[..., None, None]
    first = (doc_start // block_size)[..., None, None]
    valid = jnp.logical_and(j >= first, j <= own)
    forced = jnp.logical_and(valid, jnp.logical_or(j - first < n_init, own - j < n_local))
    key = jnp.where(forced, jnp.inf, jnp.where(valid, scores, -jnp.inf))
    if nb < n_selected:
        key = jnp.pad(key, [(0, 0)] * 3 + [(0, n_selected - nb)], constant_values=-jnp.inf)
    vals, idx = jax.lax.top_k(key, n_selected)
    big = jnp.int32(np.iinfo(np.int32).max)
    idx = jnp.where(vals == -jnp.inf, big, idx.astype(jnp.int32))
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx == big, -1, idx)


def select_blocks(q, k_cmp, lse_cmp, *, seq_len: int, cmp_block_len: int = 32,
                  cmp_stride: int = 16, block_size: int = 64, n_selected: int = 16,
                  n_init: int = 1, n_local: int = 2, remap: str = "overlap",
                  scale: float | None = None, q_offset=None, q_segment_ids=None,
                  implementation: str | None = None, interpret: bool = False,
                  block_q: int | None = None, block_n: int | None = None):
    """NSA top-n selection blocks per query and KV group.

    Args:
      q: [B, T, Hq, Dk] queries; k_cmp: [B, Sc, Hkv, Dk] compressed keys (token i covers raw
        positions [i*cmp_stride, i*cmp_stride + cmp_block_len)); lse_cmp: [B, T, Hq] float32, the
        compressed branch's log-sum-exp (flash_attention(..., return_lse=True)).
      seq_len: raw key length; nb = ceil(seq_len / block_size) selection blocks.
      remap: how compressed-token probabilities become block scores. "overlap" (default): token i
        adds its probability times the fraction of its span inside block j; exact for any l, d, l'.
        "eq9": the NSA paper's Eq. 9 index, which assumes d | l and d | l'.
      n_init / n_local: forced blocks (the document's first n_init blocks; the query's own block and
        the n_local - 1 before it). Forced blocks are included first, then the best by score.
      q_offset: int [B]: query row t sits at position t + q_offset[b] (decode).
      q_segment_ids: int [B, T] documents as contiguous runs; a query only scores compressed
        tokens and selects blocks from its own document (the run holding row 0 starts at 0).
      implementation / interpret: see kernels._dispatch (None: the best for the platform the call
        is lowered for). Under a mesh (jax.set_mesh) the Pallas kernels run in a shard_map: batch
        over "data"/"fsdp"/"expert", KV heads over "tensor" (kernels._sharding); a "context" axis
        > 1 is refused. block_q / block_n: kernel tiles.

    Returns block_indices [B, T, Hkv, n_selected] int32, ascending, -1 padding at the end (fewer
    candidates than n_selected). Ties: lower block index wins. No gradients (stop_gradient).
    """
    _validate(q, k_cmp, lse_cmp, seq_len, cmp_block_len, cmp_stride, block_size, n_selected,
              n_init, n_local, remap, scale, q_offset, q_segment_ids)
    selection = _dispatch.select(_OP, implementation, interpret=interpret)
    return _select_blocks(
        q, k_cmp, lse_cmp, selection, seq_len=seq_len, cmp_block_len=cmp_block_len,
        cmp_stride=cmp_stride, block_size=block_size, n_selected=n_selected, n_init=n_init,
        n_local=n_local, remap=remap, scale=scale, q_offset=q_offset,
        q_segment_ids=q_segment_ids, interpret=interpret, block_q=block_q, block_n=block_n)


def select_blocks_unchecked(q, k_cmp, lse_cmp, *, seq_len: int, cmp_block_len: int,
                            cmp_stride: int, block_size: int, n_selected: int, n_init: int,
                            n_local: int, remap: str, scale: float | None, q_offset,
                            q_segment_ids, implementation: str, interpret: bool = False,
                            block_q: int | None = None, block_n: int | None = None):
    """select_blocks running `implementation` on every platform, without validation or the
    platform check (internal; the public function lowers for any platform)."""
    _dispatch.check_name(_OP, implementation)
    return _select_blocks(
        q, k_cmp, lse_cmp, _dispatch.Selection.only(implementation), seq_len=seq_len,
        cmp_block_len=cmp_block_len, cmp_stride=cmp_stride, block_size=block_size,
        n_selected=n_selected, n_init=n_init, n_local=n_local, remap=remap, scale=scale,
        q_offset=q_offset, q_segment_ids=q_segment_ids, interpret=interpret, block_q=block_q,
        block_n=block_n)


def _select_blocks(q, k_cmp, lse_cmp, selection, *, seq_len, cmp_block_len, cmp_stride,
                   block_size, n_selected, n_init, n_local, remap, scale, q_offset,
                   q_segment_ids, interpret, block_q, block_n):
    q, k_cmp, lse_cmp = (jax.lax.stop_gradient(x) for x in (q, k_cmp, lse_cmp))
    rm = Remap(remap, int(cmp_block_len), int(cmp_stride), int(block_size))
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    scores = _block_scores(q, k_cmp, lse_cmp, selection, seq_len=seq_len, remap=rm, scale=scale,
                           q_offset=q_offset, q_segment_ids=q_segment_ids, interpret=interpret,
                           block_q=block_q, block_n=block_n)
    b, t = q.shape[:2]
    off = jnp.zeros((b,), jnp.int32) if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    q_pos = jnp.arange(t, dtype=jnp.int32)[None, :] + off[:, None]
    seg = None if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32)
    start = doc_start_positions(seg, q_pos)
    return select_from_scores(scores, q_pos, start, block_size=block_size,
                              n_selected=n_selected, n_init=n_init, n_local=n_local)


def select_blocks_from_probs(group_probs, *, seq_len: int, cmp_block_len: int = 32,
                             cmp_stride: int = 16, block_size: int = 64, n_selected: int = 16,
                             n_init: int = 1, n_local: int = 2, remap: str = "overlap",
                             q_offset=None):
    """select_blocks from the compressed branch's own probabilities instead of q, k_cmp and its
    lse: group_probs [B, T, Hkv, Sc] float32, each KV group's attention probabilities over the
    compressed tokens summed over its query heads (cached_attention(..., return_group_probs=True)),
    zero where a token is not visible. No segments (a query sees its row from position 0).

    The same selection as select_blocks up to float32 rounding of the probabilities, without
    computing the compressed logits a second time: for a decode step (T = 1), where the tiled
    score kernel's fixed cost is most of its time. Plain JAX on every backend (an elementwise
    window sum and a top-n over nb blocks). Returns block_indices as select_blocks does."""
    if getattr(group_probs, "ndim", None) != 4:
        raise ValueError(f"select_blocks_from_probs: group_probs must be [B,T,Hkv,Sc], got "
                         f"shape {list(getattr(group_probs, 'shape', ()))}")
    b, t = group_probs.shape[:2]
    _validate_geometry(seq_len, cmp_block_len, cmp_stride, block_size, n_selected, n_init,
                       n_local, remap)
    rm = Remap(remap, int(cmp_block_len), int(cmp_stride), int(block_size))
    scores = xla_impl.block_scores_from_probs(jax.lax.stop_gradient(group_probs), rm, seq_len)
    off = jnp.zeros((b,), jnp.int32) if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    q_pos = jnp.arange(t, dtype=jnp.int32)[None, :] + off[:, None]
    return select_from_scores(scores, q_pos, jnp.zeros_like(q_pos), block_size=block_size,
                              n_selected=n_selected, n_init=n_init, n_local=n_local)


def block_scores(q, k_cmp, lse_cmp, *, seq_len: int, cmp_block_len: int = 32,
                 cmp_stride: int = 16, block_size: int = 64, remap: str = "overlap",
                 scale: float | None = None, q_offset=None, q_segment_ids=None,
                 implementation: str | None = None, interpret: bool = False):
    """The per-group block scores [B, T, Hkv, nb] float32 that select_blocks ranks."""
    _validate(q, k_cmp, lse_cmp, seq_len, cmp_block_len, cmp_stride, block_size, 1, 0, 0, remap,
              scale, q_offset, q_segment_ids)
    selection = _dispatch.select(_OP, implementation, interpret=interpret)
    rm = Remap(remap, int(cmp_block_len), int(cmp_stride), int(block_size))
    return _block_scores(
        jax.lax.stop_gradient(q), jax.lax.stop_gradient(k_cmp), jax.lax.stop_gradient(lse_cmp),
        selection, seq_len=seq_len, remap=rm,
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale), q_offset=q_offset,
        q_segment_ids=q_segment_ids, interpret=interpret, block_q=None, block_n=None)
