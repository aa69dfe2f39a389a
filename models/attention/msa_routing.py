"""The pure functions of MSA (models/attention/msa.py, whose module docstring defines the batch
convention and the routing): the document layout of a packed row, chunk pooling, routing scores,
top-k selection, the InfoNCE routing loss and recall; and their memory-bank forms, which score a
bank of pre-encoded documents (aiinfra_jax/memory_bank.py) in tiles and gather the chosen
documents' pooled chunks into a query's cache.

Shape letters as in msa.py; for a bank: Cb pooled routing chunks of N documents (Cp: Cb padded to
a multiple of the scoring tile), Ckv pooled key/value chunks, M memory slots of a query's cache
(top_k * the longest document's key/value chunks).

Training and the bank share one scoring rule (chunk_scores, then accumulate_document_scores): the
bank only splits the chunks into tiles, so a query scores a bank exactly as the same documents in
a packed row. Ties: lower document index first, everywhere (document_ranks counts explicitly;
jax.lax.top_k documents the same rule).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..partitioning import mesh_axis_sizes, shard_map_over

ANSWER_BIT = 1 << 30  # set in a document's segment id: the document holds the answer
BANK_TILE = 4096  # bank chunks scored per step of the tiled scan ([B,T,H,tile] floats live)


def num_chunk_slots(seq: int, chunk: int, max_documents: int) -> int:
    """C: chunk slots per row (every document has ceil(len / L) chunks: at most T // L + N)."""
    return max(1, min(seq, seq // chunk + max_documents))


def document_layout(segment_ids: jax.Array, chunk: int, max_documents: int) -> dict[str, Any]:
    """Where every document token's chunk goes, from segment_ids [B,T] (module docstring).

    Returns {"doc" [B,T]: document index (N for non-document tokens and documents past N),
    "slot" [B,T]: chunk slot (C for non-document tokens), "n_docs" [B], "fits" [B] (n_docs <= N),
    "count" [B,C]: real tokens per chunk slot, "chunk_doc" [B,C]: document of each slot (N if
    empty), "doc_chunks" [B,N]: chunks of each document, "doc_start" [B,N]: its first slot (a
    document's chunks are consecutive), "positive" [B,N] bool, "n_slots": C}.
    """
    seg = segment_ids.astype(jnp.int32)
    batch, seq = seg.shape
    n, c_slots = max_documents, num_chunk_slots(seq, chunk, max_documents)
    t = jnp.arange(seq, dtype=jnp.int32)
    is_doc = seg > 0
    prev = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), seg[:, :-1]], axis=1)
    start = is_doc & (seg != prev)
    n_docs = jnp.sum(start, axis=1, dtype=jnp.int32)
    doc = jnp.where(is_doc, jnp.minimum(jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1, n), n)
    run_start = jax.lax.cummax(jnp.where(start, t, 0), axis=1)
    in_doc_chunk = (t - run_start) // chunk
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, seq))
    length = jnp.zeros((batch, n + 1), jnp.int32).at[rows, doc].add(1)[:, :n]
    n_chunks = -(-length // chunk)
    base = jnp.cumsum(n_chunks, axis=1) - n_chunks
    slot = jnp.where(doc < n, jnp.take_along_axis(base, jnp.minimum(doc, n - 1), axis=1)
                     + in_doc_chunk, c_slots)
    slot = jnp.minimum(slot, c_slots)
    count = jnp.zeros((batch, c_slots + 1), jnp.int32).at[rows, slot].add(1)[:, :c_slots]
    chunk_doc = jnp.full((batch, c_slots + 1), n, jnp.int32).at[rows, slot].set(doc)[:, :c_slots]
    first_id = jnp.zeros((batch, n + 1), jnp.int32).at[rows, jnp.where(start, doc, n)].set(seg)
    positive = (first_id[:, :n] & ANSWER_BIT) != 0
    return {"doc": doc, "slot": slot, "n_docs": n_docs, "fits": n_docs <= n, "count": count,
            "chunk_doc": chunk_doc, "doc_chunks": n_chunks, "doc_start": base,
            "positive": positive, "n_slots": c_slots}


def pool_chunks(x_bt: jax.Array, layout: dict[str, Any]) -> jax.Array:
    """Mean of x [B,T,...] over the real tokens of each chunk slot -> [B,C,...] (float32 sums, x's
    dtype out; empty slots 0)."""
    batch, seq = x_bt.shape[:2]
    c_slots = layout["n_slots"]
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, seq))
    sums = jnp.zeros((batch, c_slots + 1) + x_bt.shape[2:], jnp.float32)
    sums = sums.at[rows, layout["slot"]].add(x_bt.astype(jnp.float32))[:, :c_slots]
    count = layout["count"].reshape(layout["count"].shape + (1,) * (x_bt.ndim - 2))
    return (sums / jnp.maximum(count, 1)).astype(x_bt.dtype)


def query_roles(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(query_id [B] (0 without a query), is_query [B,T], reads [B,T]: the query tokens the router
    reads: all but the last a of the query segment with id -(1 + a))."""
    seg = segment_ids.astype(jnp.int32)
    is_query = seg < 0
    query_id = jnp.min(jnp.where(is_query, seg, 0), axis=1)
    rank = jnp.cumsum(is_query, axis=1, dtype=jnp.int32) - 1  # index within the query segment
    n_query = jnp.sum(is_query, axis=1, dtype=jnp.int32)
    n_read = n_query - (-1 - query_id)  # query length minus the answer
    reads = is_query & (rank < n_read[:, None])
    return query_id, is_query, reads


def _l2_normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-30))


def unit_keys(route_k: jax.Array) -> jax.Array:
    """Pooled routing keys [..., K, Dh] as chunk_scores normalises them (float32, unit length per
    head), for keys scored many times: a memory bank's, once when it goes to the device."""
    return _l2_normalize(route_k)


def chunk_scores(q_route: jax.Array, k_route_chunks: jax.Array, reads: jax.Array,
                 cfg: Any, keys_normalized: bool = False) -> jax.Array:
    """Chunk scores [B,C] float32: reduce over the router-read query tokens (cfg.query_reduce) of
    reduce over heads (cfg.head_reduce; query head h uses key head h // G) of cos(q_route,
    k_route_chunk), from rotated routing queries [B,T,H,Dh], pooled routing keys [B,C,K,Dh] (one
    set per row) or [C,K,Dh] (shared by every row: a memory bank's tile) and reads [B,T]. A row
    without router-read tokens gets -inf ("max"), 0 ("mean") or its first token's score ("last");
    the document reduction masks it. keys_normalized: the keys are unit_keys(...) already (a
    memory bank's, MemoryBank.to_device), so they are not normalised again."""
    batch, seq, heads, dh = q_route.shape
    kv_heads = k_route_chunks.shape[-2]
    q = _l2_normalize(q_route).reshape(batch, seq, kv_heads, heads // kv_heads, dh)
    k = k_route_chunks if keys_normalized else _l2_normalize(k_route_chunks)
    if cfg.head_reduce == "mean":
        # The mean over heads of q_h . k_(h//G) is one dot over [kv head, Dh]: the G unit query
        # vectors of a key head summed (over H) against its unit key. One [B*T, K*Dh] x [K*Dh, C]
        # product instead of H products of depth Dh and a [B,T,H,C] buffer to average: 5-10x
        # faster over a memory bank, whose cost is this product (eval/BENCHMARKS.md "MSA").
        q_mean = (jnp.sum(q, axis=3) / heads).reshape(batch, seq, kv_heads * dh)
        k_flat = k.reshape(k.shape[:-2] + (kv_heads * dh,))
        s_btc = jnp.einsum("btd,cd->btc" if k.ndim == 3 else "btd,bcd->btc", q_mean, k_flat)
    else:
        pattern = "btkgd,ckd->btkgc" if k.ndim == 3 else "btkgd,bckd->btkgc"
        s_btc = jnp.max(jnp.einsum(pattern, q, k).reshape(batch, seq, heads, -1), axis=2)
    r = reads[:, :, None]
    if cfg.query_reduce == "max":
        return jnp.max(jnp.where(r, s_btc, -jnp.inf), axis=1)
    if cfg.query_reduce == "mean":
        return (jnp.sum(jnp.where(r, s_btc, 0.0), axis=1)
                / jnp.maximum(jnp.sum(reads, axis=1), 1)[:, None])
    # last router-read query token (padding-aware: the last real one, wherever it is)
    last = jnp.max(jnp.where(reads, jnp.arange(seq), -1), axis=1)
    return jnp.take_along_axis(s_btc, jnp.maximum(last, 0)[:, None, None], axis=1)[:, 0]


def init_document_scores(batch: int, n: int, chunk_reduce: str) -> tuple[jax.Array, jax.Array]:
    """The running (value, chunk count) [B,N+1] of accumulate_document_scores (slot N: dropped)."""
    fill = -jnp.inf if chunk_reduce == "max" else 0.0
    return (jnp.full((batch, n + 1), fill, jnp.float32), jnp.zeros((batch, n + 1), jnp.int32))


def accumulate_document_scores(acc: tuple[jax.Array, jax.Array], s_bc: jax.Array,
                               chunk_doc_bc: jax.Array, chunk_reduce: str
                               ) -> tuple[jax.Array, jax.Array]:
    """Folds chunk scores s [B,C] into their documents chunk_doc [B,C] (N = no document)."""
    value, count = acc
    rows = jnp.broadcast_to(jnp.arange(s_bc.shape[0])[:, None], chunk_doc_bc.shape)
    if chunk_reduce == "max":  # finish_document_scores needs no count: -inf marks no chunks
        return value.at[rows, chunk_doc_bc].max(s_bc), count
    value = value.at[rows, chunk_doc_bc].add(s_bc)
    return value, count.at[rows, chunk_doc_bc].add(1)


def finish_document_scores(acc: tuple[jax.Array, jax.Array], chunk_reduce: str) -> jax.Array:
    """Document scores [B,N] from the running (value, count): -inf for documents without chunks."""
    value, count = acc[0][:, :-1], acc[1][:, :-1]
    if chunk_reduce == "max":
        return value
    return jnp.where(count > 0, value / jnp.maximum(count, 1), -jnp.inf)


def fold_chunk_scores(s_bc: jax.Array, chunk_doc_bc: jax.Array, n: int,
                      chunk_reduce: str) -> jax.Array:
    """Document scores [B,n] from chunk scores s [B,C] of documents chunk_doc [B,C] (n = no
    document) in one pass; the memory bank folds its tiles with accumulate_document_scores."""
    acc = accumulate_document_scores(init_document_scores(s_bc.shape[0], n, chunk_reduce), s_bc,
                                     chunk_doc_bc, chunk_reduce)
    return finish_document_scores(acc, chunk_reduce)


def _chunk_documents(layout: dict[str, Any], n: int) -> jax.Array:
    """Each chunk slot's document [B,C], n for slots without tokens."""
    return jnp.where(layout["count"] > 0, layout["chunk_doc"], n)


def document_scores(q_route: jax.Array, k_route_chunks: jax.Array, reads: jax.Array,
                    layout: dict[str, Any], cfg: Any) -> jax.Array:
    """Document scores [B,N] float32 (-inf for empty document slots and rows without router-read
    query tokens) from rotated routing queries [B,T,H,Dh], pooled routing keys [B,C,K,Dh] and the
    router-read query tokens reads [B,T] (msa.py's module docstring for the three reductions)."""
    n = layout["positive"].shape[1]
    s_bc = chunk_scores(q_route, k_route_chunks, reads, cfg)
    doc = fold_chunk_scores(s_bc, _chunk_documents(layout, n), n, cfg.chunk_reduce)
    valid = jnp.arange(n)[None, :] < layout["n_docs"][:, None]
    return jnp.where(valid & jnp.any(reads, axis=1)[:, None], doc, -jnp.inf)


def batch_document_scores(q_route: jax.Array, k_route_chunks: jax.Array, reads: jax.Array,
                          layout: dict[str, Any], cfg: Any, max_tokens: int
                          ) -> tuple[jax.Array, jax.Array]:
    """In-batch negatives (MSAConfig.routing_negatives="batch"): every row's query scored against
    every row's documents by document_scores' rule -> (scores [B,B,N] float32, [i, j] = row i's
    query on row j's documents, -inf for empty slots and rows without router-read tokens;
    fits [B] bool).

    The query side keeps each row's first max_tokens router-read tokens (gathered in order), so
    the scores cost B*max_tokens*B*C dot products instead of B*T*B*C; where a row has no more
    than that (fits), its scores are exact, and the diagonal [i, i] equals document_scores."""
    batch, seq = reads.shape
    n, c_slots = layout["positive"].shape[1], k_route_chunks.shape[1]
    r = min(max_tokens, seq)
    order = jnp.argsort(jnp.logical_not(reads), axis=1, stable=True)[:, :r]  # read tokens first
    q = jnp.take_along_axis(q_route, order[:, :, None, None], axis=1)
    q_reads = jnp.take_along_axis(reads, order, axis=1)
    keys = k_route_chunks.reshape((batch * c_slots,) + k_route_chunks.shape[2:])
    s = chunk_scores(q, keys, q_reads, cfg)  # [B, B*C]: every row's chunks shared by every query
    chunk_doc = _chunk_documents(layout, n)
    flat_doc = jnp.where(chunk_doc < n, chunk_doc + n * jnp.arange(batch)[:, None], batch * n)
    flat_doc = jnp.broadcast_to(flat_doc.reshape(1, -1), s.shape)
    doc = fold_chunk_scores(s, flat_doc, batch * n, cfg.chunk_reduce).reshape(batch, batch, n)
    valid = jnp.arange(n)[None, None, :] < layout["n_docs"][None, :, None]
    doc = jnp.where(valid & jnp.any(reads, axis=1)[:, None, None], doc, -jnp.inf)
    return doc, jnp.sum(reads, axis=1) <= r


def top_k_recall(scores: jax.Array, positive: jax.Array, ks: Sequence[int]) -> list[jax.Array]:
    """recall@k for each k of ks from scores [B,M] (-inf = no document) and positives [B,M]: the
    mean over rows with a positive of the fraction of its positives among its top k (ties: lower
    index first, jax.lax.top_k's rule; a row with fewer than k documents counts all of them). It
    needs no [B,M,M] ranks, so it serves the M = B*N documents of in-batch scoring too."""
    _, top = jax.lax.top_k(scores, min(max(ks), scores.shape[1]))
    hit = jnp.take_along_axis(positive & jnp.isfinite(scores), top, axis=1)
    n_pos = jnp.sum(positive & jnp.isfinite(scores), axis=1)
    rows = n_pos > 0
    out = []
    for k in ks:
        frac = jnp.sum(hit[:, :k], axis=1) / jnp.maximum(n_pos, 1)
        out.append(jnp.sum(jnp.where(rows, frac, 0.0)) / jnp.maximum(jnp.sum(rows), 1))
    return out


def document_ranks(scores_bn: jax.Array) -> jax.Array:
    """Rank [B,N] int32 of every document slot by score, descending; ties: lower index first
    (explicit pairwise count: deterministic on every backend, no sort)."""
    s_i, s_j = scores_bn[:, :, None], scores_bn[:, None, :]
    idx = jnp.arange(scores_bn.shape[1])
    before = (s_j > s_i) | ((s_j == s_i) & (idx[None, None, :] < idx[None, :, None]))
    return jnp.sum(before, axis=-1, dtype=jnp.int32)


def select_documents(scores_bn: jax.Array, n_docs_b: jax.Array, top_k: int
                     ) -> tuple[jax.Array, jax.Array]:
    """(ranks [B,N], selected [B,N] bool): the top min(top_k, n_docs) real documents of each row
    (none in a row whose scores are all -inf, i.e. without a router-read query)."""
    ranks = document_ranks(scores_bn)
    real = jnp.arange(scores_bn.shape[1])[None, :] < n_docs_b[:, None]
    k = jnp.minimum(top_k, n_docs_b)[:, None]
    return ranks, real & (ranks < k) & jnp.isfinite(scores_bn)


INFONCE_FORMS = ("joint", "decoupled")


def _masked_lse(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """log sum_{mask} e^logits [B,1] (0 where the mask is empty), exact: the max is taken out
    (without gradient) instead of an epsilon added."""
    has = jnp.any(mask, axis=1, keepdims=True)
    top = jax.lax.stop_gradient(jnp.max(jnp.where(mask, logits, -jnp.inf), axis=1, keepdims=True))
    top = jnp.where(has, top, 0.0)
    # exp of -inf outside the mask, not where(mask, exp(.), 0): a masked logit far above a very
    # negative max overflows exp to inf, and its zero cotangent times inf is a NaN gradient (seen
    # at the clamped temperature 0.001 with every valid score negative).
    mass = jnp.sum(jnp.exp(jnp.where(mask, logits - top, -jnp.inf)), axis=1, keepdims=True)
    return jnp.log(jnp.where(has, mass, 1.0)) + top


def infonce(scores_bn: jax.Array, positive_bn: jax.Array, valid_bn: jax.Array,
            temperature: jax.Array, form: str = "joint") -> jax.Array:
    """Routing loss, l = score / temperature, mean over rows with a positive and a negative:
    "joint"      -log(sum_{positives} e^l / sum_{positives and negatives} e^l)
    "decoupled"  the mean over the row's positives p of -log(e^{l_p} / (e^{l_p} + sum_{negatives}
                 e^{l_n})): each positive against the negatives only, not against the other
                 positives.
    The two agree when a row has one positive. Exact log-sum-exps (no epsilon), zero gradient on
    masked slots; a row without negatives adds 0."""
    if form not in INFONCE_FORMS:
        raise ValueError(f"infonce: form={form!r}, valid: {INFONCE_FORMS}")
    valid = valid_bn & jnp.isfinite(scores_bn)
    logits = jnp.where(valid, scores_bn, 0.0) / temperature
    pos, neg = positive_bn & valid, valid & ~positive_bn
    has_neg = jnp.any(neg, axis=1)
    n_pos = jnp.sum(pos, axis=1)
    if form == "joint":
        per_row = (_masked_lse(logits, valid) - _masked_lse(logits, pos))[:, 0]
    else:
        per_pos = jnp.logaddexp(logits, _masked_lse(logits, neg)) - logits
        per_row = jnp.sum(jnp.where(pos, per_pos, 0.0), axis=1) / jnp.maximum(n_pos, 1)
    rows = (n_pos > 0) & has_neg
    return jnp.sum(jnp.where(rows, per_row, 0.0)) / jnp.maximum(jnp.sum(n_pos > 0), 1)


# The memory bank's forms ------------------------------------------------------------------------

def bank_axes() -> tuple[tuple[str, ...], int]:
    """(mesh axes, devices) a bank's chunks split over: every non-manual axis > 1 of the mesh in
    context (jax.sharding.get_abstract_mesh); ((), 1) without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False) or not mesh.axis_names:
        return (), 1
    sizes = mesh_axis_sizes(mesh)
    axes = tuple(a for a, n in sizes.items() if n > 1)
    return axes, math.prod(sizes[a] for a in axes)


def bank_chunk_padding(total: int, devices: int = 1) -> int:
    """Chunks a bank of `total` is padded to: every device's share a multiple of its scoring
    tile (min(BANK_TILE, share))."""
    share = -(-total // devices)
    if share > BANK_TILE:
        share = -(-share // BANK_TILE) * BANK_TILE
    return share * devices


def _scan_bank(q_route, reads, route_k, chunk_doc, n_docs: int, cfg: Any, keys_normalized: bool):
    """The running (value, count) [B,N+1] of a scan over tiles of min(BANK_TILE, Cp) chunks."""
    total = route_k.shape[0]
    tile = min(BANK_TILE, total)
    if total % tile:
        raise ValueError(f"bank_document_scores: {total} bank chunks (per device) is not a "
                         f"multiple of the scoring tile {tile}; pad the bank with "
                         "bank_chunk_padding (MemoryBank.to_device does)")
    keys = route_k.reshape((total // tile, tile) + route_k.shape[1:])
    docs = chunk_doc.reshape(total // tile, tile)

    def body(acc, xs):
        k_tile, d_tile = xs
        s_bc = chunk_scores(q_route, k_tile, reads, cfg, keys_normalized)
        d_bc = jnp.broadcast_to(d_tile[None], s_bc.shape)
        return accumulate_document_scores(acc, s_bc, d_bc, cfg.chunk_reduce), None

    acc, _ = jax.lax.scan(body, init_document_scores(q_route.shape[0], n_docs, cfg.chunk_reduce),
                          (keys, docs))
    return acc


def bank_document_scores(q_route: jax.Array, reads: jax.Array, route_k: jax.Array,
                         chunk_doc: jax.Array, n_docs: int, cfg: Any,
                         keys_normalized: bool = False) -> jax.Array:
    """Scores [B,N] of a bank's N documents (-inf in rows without router-read tokens): routing
    queries [B,T,H,Dh], reads [B,T], the bank's pooled routing keys route_k [Cp,K,Dh] with their
    documents chunk_doc [Cp] (N for padding). A scan over tiles of chunks, so memory stays
    [B,T,H,tile] whatever the bank's size. Under a mesh (bank_axes) whose device count divides
    Cp, each device scans its own share of the chunks (a shard_map; the bank arrays are best
    placed split over those axes already, as MemoryBank.to_device(mesh) does) and the partial
    document scores are combined (max: pmax; mean: psum of sums and counts); the result is the
    same as on one device. keys_normalized: route_k is unit_keys(...) already (MemoryBank.to_device
    stores it so: the bank's keys are normalised once, not at every query)."""
    axes, devices = bank_axes()
    if devices > 1 and route_k.shape[0] % devices == 0:
        mesh = jax.sharding.get_abstract_mesh()

        def local(q, r, k_loc, d_loc):
            value, count = _scan_bank(q, r, k_loc, d_loc, n_docs, cfg, keys_normalized)
            value = (jax.lax.pmax(value, axes) if cfg.chunk_reduce == "max"
                     else jax.lax.psum(value, axes))
            return value, jax.lax.psum(count, axes)

        split = P(axes)
        acc = shard_map_over(local, mesh, (P(), P(), split, split), (P(), P()), check=False)(
            q_route, reads, route_k, chunk_doc)
    else:
        acc = _scan_bank(q_route, reads, route_k, chunk_doc, n_docs, cfg, keys_normalized)
    scores = finish_document_scores(acc, cfg.chunk_reduce)
    return jnp.where(jnp.any(reads, axis=1)[:, None], scores, -jnp.inf)


def select_bank_documents(scores_bn: jax.Array, top_k: int) -> jax.Array:
    """The top min(top_k, N) documents [B,top_k] int32 of each row, best first (ties: lower index
    first), -1 in unused places (rows without router-read tokens, or N < top_k)."""
    n = scores_bn.shape[1]
    k = min(top_k, n)
    values, index = jax.lax.top_k(scores_bn, k)
    docs = jnp.where(jnp.isfinite(values), index, -1).astype(jnp.int32)
    return jnp.pad(docs, ((0, 0), (0, top_k - k)), constant_values=-1)


@jax.tree_util.register_static
class HostRows:
    """A memory bank's key or value rows [R, K, Dh] left in host memory (a memory-mapped file:
    MemoryBank.to_device(kv_on_host=True)) and read inside the compiled prefill by a host callback,
    so that only the gathered rows reach the device. A static pytree node (no leaves, compared by
    identity): a jitted function that receives one compiles for it. The file must stay as it is
    while the rows are in use (appends are fine: rows already there do not move)."""

    def __init__(self, rows: np.ndarray):
        if rows.ndim != 3:
            raise ValueError(f"HostRows: rows must be [R, K, Dh], got shape {rows.shape}")
        self.rows = rows

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.rows.shape)

    def take(self, index: jax.Array) -> jax.Array:
        """rows[index] as float32 [*index.shape, K, Dh] (index: int32 in [0, R))."""
        def read(i):
            return np.asarray(self.rows[np.asarray(i)], np.float32)

        shape = jax.ShapeDtypeStruct(tuple(index.shape) + self.shape[1:], jnp.float32)
        return jax.pure_callback(read, shape, index)


def _take_rows(rows: jax.Array | HostRows, index: jax.Array) -> jax.Array:
    return rows.take(index) if isinstance(rows, HostRows) else rows[index]


def gather_memory(bank_k: jax.Array, bank_v: jax.Array, kv_start: jax.Array,
                  kv_chunks: jax.Array, docs_bk: jax.Array, max_chunks: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(mem_k, mem_v [B,K,M,Dh], valid [B,M]) with M = k * max_chunks: the r-th selected
    document in increasing document order (the order of a packed row's chunks, so that sums run
    as in training) has its key/value chunks c < kv_chunks[doc] at memory slots r * max_chunks +
    c, from the bank's pooled keys and values [Ckv,K,Dh] (device arrays, or HostRows read by a
    host callback; document d's at kv_start[d] ...);
    docs_bk [B,k] in any order (-1 = none)."""
    batch, k = docs_bk.shape
    big = jnp.iinfo(jnp.int32).max
    docs_bk = jnp.sort(jnp.where(docs_bk >= 0, docs_bk, big), axis=1)
    docs_bk = jnp.where(docs_bk == big, -1, docs_bk)
    c = jnp.arange(max_chunks, dtype=jnp.int32)
    d = jnp.maximum(docs_bk, 0)
    valid = (docs_bk >= 0)[:, :, None] & (c[None, None, :] < kv_chunks[d][:, :, None])
    index = jnp.where(valid, kv_start[d][:, :, None] + c, 0).reshape(batch, k * max_chunks)
    mem_k = _take_rows(bank_k, index).swapaxes(1, 2)  # [B,M,K,Dh] -> head-major
    mem_v = _take_rows(bank_v, index).swapaxes(1, 2)
    valid = valid.reshape(batch, k * max_chunks)
    zero = jnp.zeros((), mem_k.dtype)
    return (jnp.where(valid[:, None, :, None], mem_k, zero),
            jnp.where(valid[:, None, :, None], mem_v, zero), valid)
