"""MSA mixer (part 1): pooling, routing against float64 references, the attention mask against a
dense reference, document-wise positions, no cross-document attention, gradients, a Transformer."""

from __future__ import annotations

import dataclasses

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aiinfra_jax.models import ModelConfig, Transformer, get_mixer
from aiinfra_jax.models.attention.msa import MSAConfig, MSAttention, pack_row
from aiinfra_jax.models.attention.msa_routing import (
    ANSWER_BIT, batch_document_scores, document_layout, document_ranks, document_scores, infonce,
    pool_chunks, query_roles, select_documents, top_k_recall)

# Chunks of 4 tokens, 2 documents selected, up to 8 documents per row; layer 1 routes.
MSA = MSAConfig(chunk=4, top_k=2, max_documents=8, routing_layers=(1,), implementation="xla",
                routing_loss_weight=1.0)
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mixers=("msa",),
                  msa=MSA, max_seq_len=128)
T = 40


def _rows(rows):
    seg, pos = zip(*(pack_row(**r, query_offset=MSA.resolved_query_offset, row_length=T)
                     for r in rows))
    return jnp.asarray(np.stack(seg)), jnp.asarray(np.stack(pos))


# Row 0: four documents (lengths not multiples of 4), document 1 holds the answer; a 6-token query
# whose last 2 tokens (the answer) the router does not read. Row 1: three documents, the last one
# positive, a 5-token query; right padding.
ROWS = [dict(doc_lengths=[6, 9, 3, 5], query_length=6, answer_docs=[1], answer_length=2),
        dict(doc_lengths=[3, 8, 10], query_length=5, answer_docs=[2])]
SEG, POS = _rows(ROWS)


def _x(seed, b=2):
    return jax.random.normal(jax.random.key(seed), (b, T, CFG.d_model))


_LAYERS: dict = {}


@functools.partial(jax.jit, static_argnums=(3,))
def _route(q_route, k_route, seg, cfg):
    """One compiled program for layout, pooling, scores and selection (eager ops compile one by
    one, which costs more here than the arithmetic)."""
    layout = document_layout(seg, cfg.chunk, cfg.max_documents)
    kc = pool_chunks(k_route, layout)
    scores = document_scores(q_route, kc, query_roles(seg)[2], layout, cfg)
    return layout, kc, scores, select_documents(scores, layout["n_docs"], cfg.top_k)[1]


@nnx.jit
def _project(layer, x, pos):
    return layer._project(x, pos)


def _layer(layer_index=1, kv_chunk=None, router_rope=True):
    key = (layer_index, kv_chunk, router_rope)
    if key not in _LAYERS:
        cfg = dataclasses.replace(CFG, msa=dataclasses.replace(MSA, kv_chunk=kv_chunk,
                                                               router_rope=router_rope))
        _LAYERS[key] = MSAttention(cfg, rngs=nnx.Rngs(0), layer_index=layer_index)
    return nnx.clone(_LAYERS[key])


@nnx.jit
def _apply(layer, x, pos, seg):
    return layer(x, positions=pos, segment_ids=seg)[0]


def _docs_np(seg_row):
    """[(start, end, id)] of the documents of one numpy row, in order."""
    out, t = [], 0
    while t < len(seg_row):
        if seg_row[t] > 0:
            e = t
            while e < len(seg_row) and seg_row[e] == seg_row[t]:
                e += 1
            out.append((t, e, int(seg_row[t])))
            t = e
        else:
            t += 1
    return out


def _chunks_np(seg_row, chunk):
    """[(doc index, token indices)] of every chunk, in slot order."""
    out = []
    for d, (s, e, _) in enumerate(_docs_np(seg_row)):
        for c in range(s, e, chunk):
            out.append((d, list(range(c, min(c + chunk, e)))))
    return out


def test_registered_layout_and_pack_row():
    assert get_mixer("msa") is MSAttention
    seg = np.asarray(SEG[0])
    assert [e - s for s, e, _ in _docs_np(seg)] == [6, 9, 3, 5]
    assert seg[6] == 2 | ANSWER_BIT and (seg[23:29] == -3).all() and (seg[29:] == 0).all()
    pos = np.asarray(POS[0])
    assert list(pos[6:15]) == list(range(9)) and list(pos[23:29]) == list(range(2, 8))
    cache = _layer().init_cache(1, 8)
    assert cache["k"].shape == (1, 2, 8, 8) and cache["mem"].shape == (1, 0)


def test_pooling_with_partial_chunks_matches_numpy():
    x = jax.random.normal(jax.random.key(1), (2, T, 2, 8))
    layout, pooled, _, _ = _route(jax.random.normal(jax.random.key(0), (2, T, 4, 8)), x, SEG, MSA)
    pooled = np.asarray(pooled)
    x_np = np.asarray(x, np.float64)
    for b in range(2):
        chunks = _chunks_np(np.asarray(SEG[b]), MSA.chunk)
        n = len(chunks)
        assert int(layout["n_docs"][b]) == len(_docs_np(np.asarray(SEG[b])))
        np.testing.assert_array_equal(np.asarray(layout["count"][b, :n]),
                                      [len(rows) for _, rows in chunks])
        assert (np.asarray(layout["count"][b, n:]) == 0).all()
        np.testing.assert_array_equal(np.asarray(layout["chunk_doc"][b, :n]),
                                      [d for d, _ in chunks])
        ref = np.stack([x_np[b, rows].mean(0) for _, rows in chunks])
        np.testing.assert_allclose(pooled[b, :n], ref, rtol=1e-5, atol=1e-6)
    assert np.asarray(layout["positive"]).tolist()[0][:4] == [False, True, False, False]
    assert np.asarray(layout["positive"]).tolist()[1][:3] == [False, False, True]


def _scores_np(q, kc, seg_row, cfg, doc_row=None):
    """Float64 reference of document scores for one row (q [T,H,Dh], kc [C,K,Dh] pooled): the
    query of seg_row against the documents of doc_row (default: the same row)."""
    doc_row = seg_row if doc_row is None else doc_row
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kc = kc / np.linalg.norm(kc, axis=-1, keepdims=True)
    g = q.shape[1] // kc.shape[1]
    q_idx = np.flatnonzero(seg_row < 0)
    answer = -1 - int(seg_row[q_idx[0]])
    reads = q_idx[:len(q_idx) - answer]
    head = np.mean if cfg.head_reduce == "mean" else np.max
    chunks = _chunks_np(doc_row, cfg.chunk)
    per_chunk = []
    for c, _ in enumerate(chunks):
        s = [head([q[t, h] @ kc[c, h // g] for h in range(q.shape[1])]) for t in reads]
        per_chunk.append({"max": max(s), "mean": np.mean(s), "last": s[-1]}[cfg.query_reduce])
    docs = []
    for d in range(len(_docs_np(doc_row))):
        s = [v for (dd, _), v in zip(chunks, per_chunk) if dd == d]
        docs.append(max(s) if cfg.chunk_reduce == "max" else np.mean(s))
    return np.asarray(docs)


def _topk_np(scores, k):
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return set(order[:min(k, len(scores))])


def _random_routing(head, query, chunk, seed):
    """(cfg, routing queries [2,T,4,8], _route's outputs) for random routing projections."""
    cfg = MSAConfig(chunk=4, top_k=2, max_documents=8, head_reduce=head, query_reduce=query,
                    chunk_reduce=chunk)
    kq, kk = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(kq, (2, T, 4, 8))
    k = jax.random.normal(kk, (2, T, 2, 8))
    return cfg, q, _route(q, k, SEG, cfg)


# Every option of each reduction at least once.
@pytest.mark.parametrize("head,query,chunk", [("mean", "max", "max"), ("max", "mean", "mean"),
                                              ("mean", "last", "mean"), ("max", "last", "max")])
def test_routing_scores_and_topk_match_float64_reference(head, query, chunk):
    cfg, q, (_, kc, scores, selected) = _random_routing(head, query, chunk, seed=2)
    scores = np.asarray(scores)
    for b in range(2):
        seg_row = np.asarray(SEG[b])
        n_chunks = len(_chunks_np(seg_row, cfg.chunk))
        ref = _scores_np(np.asarray(q[b], np.float64), np.asarray(kc[b, :n_chunks], np.float64),
                         seg_row, cfg)
        n = len(ref)
        np.testing.assert_allclose(scores[b, :n], ref, rtol=1e-5, atol=1e-6)
        assert np.isneginf(scores[b, n:]).all()
        assert set(np.flatnonzero(np.asarray(selected[b]))) == _topk_np(ref, cfg.top_k)


@pytest.mark.parametrize("head,query,chunk", [("mean", "max", "max"), ("max", "last", "mean")])
def test_batch_scores_match_float64_reference(head, query, chunk):
    """In-batch negatives: row i's query against row j's documents, exact where the row's
    router-read tokens fit batch_query_tokens (row 0 reads 4 tokens, row 1 reads 5)."""
    cfg, q, (layout, kc, scores, _) = _random_routing(head, query, chunk, seed=3)
    reads = query_roles(SEG)[2]
    cross, fits = jax.jit(batch_document_scores, static_argnums=(4, 5))(q, kc, reads, layout,
                                                                       cfg, 5)
    cross = np.asarray(cross)
    assert np.asarray(fits).tolist() == [True, True]
    for i in range(2):
        np.testing.assert_allclose(cross[i, i], np.asarray(scores[i]), rtol=1e-6, atol=1e-6)
        for j in range(2):
            doc_row = np.asarray(SEG[j])
            n_chunks = len(_chunks_np(doc_row, cfg.chunk))
            ref = _scores_np(np.asarray(q[i], np.float64), np.asarray(kc[j, :n_chunks],
                             np.float64), np.asarray(SEG[i]), cfg, doc_row=doc_row)
            np.testing.assert_allclose(cross[i, j, :len(ref)], ref, rtol=1e-5, atol=1e-6)
            assert np.isneginf(cross[i, j, len(ref):]).all()
    _, fits = batch_document_scores(q, kc, reads, layout, cfg, 4)
    assert np.asarray(fits).tolist() == [True, False]


def test_batch_negatives_loss_recall_and_gradients():
    """routing_negatives="batch": the joint InfoNCE over the batch's documents equals a float64
    reference built from the layer's own scores, recall is reported among them, and the routing
    loss trains the router keys of the other row's documents too."""
    cfg = dataclasses.replace(CFG, msa=dataclasses.replace(MSA, routing_negatives="batch"))
    layer = MSAttention(cfg, rngs=nnx.Rngs(0), layer_index=1)
    x = _x(8)
    loss, grads = nnx.jit(nnx.value_and_grad(_routing_loss))(layer, x)
    p = _project(layer, x, POS)
    layout, kc, scores, _ = _route(p["q_route"], p["k_route"], SEG, MSA)
    cross, _ = batch_document_scores(p["q_route"], kc, query_roles(SEG)[2], layout, MSA, 64)
    tau = float(layer.temperature[...])
    refs = []
    for i in range(2):
        own = np.asarray(scores[i], np.float64)
        logits = [own[np.isfinite(own)]]
        logits += [np.asarray(cross[i, j], np.float64) for j in range(2) if j != i]
        logits = np.concatenate(logits)
        logits = logits[np.isfinite(logits)] / tau
        pos = np.asarray(layout["positive"][i])[:np.isfinite(own).sum()]
        lse = np.log(np.exp(logits).sum())
        refs.append(lse - np.log(np.exp(logits[:len(pos)][pos]).sum()))
    np.testing.assert_allclose(float(loss), np.mean(refs), rtol=1e-5)
    row_layer = _layer()
    row_loss = float(nnx.jit(_routing_loss)(row_layer, x))
    assert float(loss) > row_loss  # more negatives, larger joint loss
    assert 0.0 <= float(getattr(layer, "batch_recall@1")[...]) <= 1.0
    assert float(getattr(layer, "batch_unfit")[...]) == 0.0
    short = dataclasses.replace(cfg, msa=dataclasses.replace(cfg.msa, batch_query_tokens=4))
    short_layer = MSAttention(short, rngs=nnx.Rngs(0), layer_index=1)
    nnx.jit(_routing_loss)(short_layer, x)  # row 1 reads 5 tokens: its negatives stay in-row
    assert float(getattr(short_layer, "batch_unfit")[...]) == 0.5
    # Row 0's query scores row 1's documents, so row 1's document tokens get router_k gradient
    # from the loss even where row 1's own routing would not reach them.
    g = np.asarray(grads.router_k[...])
    assert np.isfinite(g).all() and np.abs(g).max() > 0


def test_top_k_recall_matches_a_ranked_reference():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 4, (6, 12)).astype(np.float32)  # many ties
    s[:, 10:] = -np.inf
    s[5, 3:] = -np.inf  # a row with 3 documents: recall@5 counts all of them
    pos = rng.random((6, 12)) < 0.3
    pos[:, 10:] = False
    pos[5, 3:], pos[5, 2] = False, True
    ranks = np.asarray(document_ranks(jnp.asarray(s)))  # ties: lower index first
    n_docs = np.isfinite(s).sum(1)
    for k, got in zip((1, 3, 5), top_k_recall(jnp.asarray(s), jnp.asarray(pos), (1, 3, 5))):
        rows = [(pos[b] & (ranks[b] < min(k, n_docs[b]))).sum() / pos[b].sum()
                for b in range(6) if pos[b].any()]
        np.testing.assert_allclose(float(got), np.mean(rows), rtol=1e-6)


def test_topk_ties_lower_index_wins_and_k_is_capped():
    s = jnp.asarray([[0.5, 0.9, 0.5, 0.9, 0.5, -jnp.inf], [0.2, 0.2, 0.2, 0.2, 0.0, 0.0]])
    n_docs = jnp.asarray([5, 2])
    ranks = np.asarray(document_ranks(s))
    assert ranks[0].tolist() == [2, 0, 3, 1, 4, 5]
    _, sel = select_documents(s, n_docs, 3)
    assert np.flatnonzero(np.asarray(sel[0])).tolist() == [0, 1, 3]  # 0.9, 0.9, first 0.5 wins
    assert np.flatnonzero(np.asarray(sel[1])).tolist() == [0, 1]  # k capped at the 2 documents
    _, sel = select_documents(s, n_docs, 6)
    assert np.asarray(sel).sum(1).tolist() == [5, 2]  # never a slot past the real documents


def test_infonce_is_exact_at_small_temperature():
    s = jnp.asarray([[0.30, 0.20, -0.10, 0.25, 0.0], [0.1, -0.4, 0.3, 0.0, 0.0]])
    pos = jnp.asarray([[False, True, False, True, False], [False, False, False, False, False]])
    valid = jnp.asarray([[True, True, True, True, False], [True, True, True, False, False]])
    tau = 0.001
    l = np.asarray(s[0], np.float64) / tau
    neg = l[[0, 2]]

    def lse(x):
        return x.max() + np.log(np.exp(x - x.max()).sum())

    def nll(lp):
        return lse(np.append(neg, lp)) - lp
    # Row 1 has no positive: not counted. Row 0 has two positives (slots 1 and 3).
    refs = {"decoupled": (nll(l[1]) + nll(l[3])) / 2, "joint": lse(l[:4]) - lse(l[[1, 3]])}
    for form, ref in refs.items():
        got = float(jax.jit(infonce, static_argnums=4)(s, pos, valid, jnp.float32(tau), form))
        np.testing.assert_allclose(got, ref, rtol=1e-5)
        g = jax.jit(jax.grad(lambda x: infonce(x, pos, valid, jnp.float32(0.1), form)))(s)
        assert np.isfinite(np.asarray(g)).all() and float(jnp.abs(g[0, 4])) == 0.0
    # At the clamped temperature with every valid score negative, the masked slots (logit 0 far
    # above the max) must not overflow into a NaN gradient.
    low = jnp.asarray([[-0.5, -0.3, -0.2, -0.9, 0.0]])
    for form in ("joint", "decoupled"):
        g = jax.grad(lambda x: infonce(x, pos[:1], valid[:1], jnp.float32(0.001), form))(low)
        assert np.isfinite(np.asarray(g)).all(), form
    one = pos.at[0, 3].set(False)  # one positive: the two forms agree
    np.testing.assert_allclose(float(infonce(s, one, valid, jnp.float32(0.1), "joint")),
                               float(infonce(s, one, valid, jnp.float32(0.1), "decoupled")),
                               rtol=1e-6)


def _dense_reference(layer, x, pos, seg):
    """Float64 numpy: the layer's output from its own projections with an explicit mask over
    [pooled key/value chunks of the selected documents ; tokens] (selection from the float64
    scores of the routing chunks)."""
    p = {k: np.asarray(v, np.float64) for k, v in _project(layer, x, pos).items()}
    wo = np.asarray(layer.wo[...], np.float64)
    routes = int(layer.routes[...])
    kv_chunk = layer.cfg.msa.resolved_kv_chunk
    outs = []
    for b in range(x.shape[0]):
        seg_row = np.asarray(seg[b])
        route_chunks = _chunks_np(seg_row, MSA.chunk)
        k_route = np.stack([p["k_route"][b, rows].mean(0) for _, rows in route_chunks])
        chunks = _chunks_np(seg_row, kv_chunk)
        pooled = {n: np.stack([p[n][b, rows].mean(0) for _, rows in chunks]) for n in ("k", "v")}
        scores = _scores_np(p["q_route"][b], k_route, seg_row, MSA)
        chosen = _topk_np(scores, MSA.top_k) if routes else set()
        keys = np.concatenate([pooled["k"], p["k"][b]])
        vals = np.concatenate([pooled["v"], p["v"][b]])
        n_c = len(chunks)
        vis = np.zeros((T, n_c + T), bool)
        for t in range(T):
            vis[t, n_c:n_c + t + 1] = seg_row[:t + 1] == seg_row[t]
            if seg_row[t] < 0:
                vis[t, :n_c] = [d in chosen for d, _ in chunks]
        g = p["q"].shape[2] // keys.shape[1]
        y = np.zeros(p["q"].shape[1:])
        for h in range(p["q"].shape[2]):
            logits = p["q"][b, :, h] @ keys[:, h // g].T / np.sqrt(p["q"].shape[-1])
            logits = np.where(vis, logits, -np.inf)
            w = np.exp(logits - logits.max(1, keepdims=True))
            y[:, h] = (w / w.sum(1, keepdims=True)) @ vals[:, h // g]
        outs.append(np.einsum("thk,hkd->td", y, wo))
    return np.stack(outs)


@pytest.mark.parametrize("layer_index,kv_chunk", [
    (1, None), (0, None),  # routing, non-routing
    (1, 1), (1, 3)])  # key/value chunks of 1 (unpooled) and 3 tokens, routing chunks of 4
def test_layer_matches_dense_mask_reference(layer_index, kv_chunk):
    layer = _layer(layer_index, kv_chunk)
    assert int(layer.routes[...]) == (layer_index == 1)
    x = _x(3)
    got = np.asarray(_apply(layer, x, POS, SEG))
    ref = _dense_reference(layer, x, POS, SEG)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_document_wise_positions():
    """Documents are rotated at their own positions (from 0), so the same documents in another order
    give the same outputs, the query's included (it reads them through position-rotated pooled
    chunks); with row positions instead, the query's outputs change with the order."""
    layer = _layer()
    lengths, order = [7, 9, 5], [2, 0, 1]
    seg, pos = _rows([dict(doc_lengths=lengths, query_length=4),
                      dict(doc_lengths=[lengths[i] for i in order], query_length=4)])
    xa = _x(4, b=1)[0]
    starts = np.cumsum([0] + lengths)
    pieces = [xa[starts[i]:starts[i + 1]] for i in order] + [xa[starts[-1]:]]
    x = jnp.stack([xa, jnp.concatenate(pieces, axis=0)])
    y = np.asarray(_apply(layer, x, pos, seg))
    q = slice(starts[-1], starts[-1] + 4)
    np.testing.assert_allclose(y[1, q], y[0, q], rtol=1e-5, atol=1e-6)
    b_starts = np.cumsum([0] + [lengths[i] for i in order])
    for j, i in enumerate(order):
        np.testing.assert_allclose(y[1, b_starts[j]:b_starts[j + 1]],
                                   y[0, starts[i]:starts[i + 1]], rtol=1e-5, atol=1e-6)
    row_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    r = np.asarray(_apply(layer, x, row_pos, seg))
    assert np.abs(r[1, q] - r[0, q]).max() > 1e-5  # float noise of the equalities: ~1e-9


def test_router_without_rope_routes_on_unrotated_projections():
    """router_rope=False: q_route and k_route are the projections as at position 0 (no rotation),
    so routing scores do not depend on positions; q and k are rotated as with the default."""
    x = _x(5)
    rot, plain = _project(_layer(), x, POS), _project(_layer(router_rope=False), x, POS)
    at_zero = _project(_layer(), x, jnp.zeros_like(POS))
    for name in ("q_route", "k_route"):
        np.testing.assert_allclose(plain[name], at_zero[name], rtol=1e-6, atol=1e-6)
        assert np.abs(np.asarray(rot[name] - plain[name])).max() > 1e-3
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(plain[name], rot[name])
    shifted = _project(_layer(router_rope=False), x, POS + 7)
    scores = [_route(pr["q_route"], pr["k_route"], SEG, MSA)[2] for pr in (plain, shifted)]
    np.testing.assert_allclose(scores[0], scores[1], rtol=1e-6, atol=1e-6)


def test_no_cross_document_attention():
    layer = _layer()
    x = _x(6)
    y = np.asarray(_apply(layer, x, POS, SEG))
    x2 = x.at[0, 6:15].add(jax.random.normal(jax.random.key(7), (9, CFG.d_model)))  # doc 1, row 0
    y2 = np.asarray(_apply(layer, x2, POS, SEG))
    others = np.r_[0:6, 15:23]  # the other documents of row 0
    np.testing.assert_allclose(y2[0, others], y[0, others], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y2[1], y[1], rtol=1e-5, atol=1e-6)  # the other row
    # The query reads documents only through the selected chunks (a non-routing layer: never).
    plain = _layer(0)
    z = np.asarray(_apply(plain, x, POS, SEG))
    z2 = np.asarray(_apply(plain, x2, POS, SEG))
    np.testing.assert_allclose(z2[0, 23:29], z[0, 23:29], rtol=1e-5, atol=1e-6)


def test_too_many_documents_refuses_query_rows_only():
    """max_documents bounds the chunk slots of a row with a query (such a row is refused: NaN
    outputs, never silently wrong routing); plain packed text with more pieces than that (corpus
    rows mixed into MSA training) uses no slot and runs as with room for every piece."""
    many = [3] * 10  # 10 documents > max_documents = 8
    seg, pos = _rows([dict(doc_lengths=many, query_length=4)])
    plain_seg = jnp.where(seg < 0, 11, seg)  # the query tokens become an 11th plain piece
    roomy = MSAttention(dataclasses.replace(CFG, msa=dataclasses.replace(MSA, max_documents=16)),
                        rngs=nnx.Rngs(0), layer_index=1)
    x = _x(8, b=1)
    refused = np.asarray(_apply(_layer(), x, pos, seg))
    assert np.isnan(refused).all()
    got = np.asarray(_apply(_layer(), x, pos, plain_seg))
    # Equal to float32 rounding: the slot count changes the key tiling, so the order of the sums.
    np.testing.assert_allclose(got, np.asarray(_apply(roomy, x, pos, plain_seg)), rtol=1e-5,
                               atol=1e-7)
    assert np.isfinite(got).all()


def _routing_loss(layer, x):
    layer(x, positions=POS, segment_ids=SEG)
    return layer.routing[...]


def _query_loss(layer, x):
    """Stands in for the LM loss: reads only the query's outputs."""
    y = layer(x, positions=POS, segment_ids=SEG)[0]
    return jnp.sum(jnp.where((SEG < 0)[..., None], y, 0.0) ** 2)


@nnx.jit
def _grads(layer, x):
    return nnx.grad(_routing_loss)(layer, x), nnx.grad(_query_loss, argnums=(0, 1))(layer, x)


def test_gradients_reach_router_and_pooled_document_kv():
    layer = _layer()
    x = _x(8)
    grads, (gw, gx) = _grads(layer, x)
    for name in ("router_q", "router_k", "temperature"):
        g = np.asarray(getattr(grads, name)[...])
        assert np.isfinite(g).all() and np.abs(g).max() > 0, name
    for name in ("wq", "wk", "wv", "wo"):  # the routing loss trains only the router
        assert np.abs(np.asarray(getattr(grads, name)[...])).max() == 0, name

    # The query's loss reaches the selected documents' tokens (through the pooled chunk K/V) and
    # nothing else among the documents; the k/v projections get its gradient.
    p = _project(layer, x, POS)
    layout, _, _, selected = _route(p["q_route"], p["k_route"], SEG, MSA)
    selected = np.asarray(selected)
    assert selected.sum(1).tolist() == [2, 2]
    gx = np.abs(np.asarray(gx)).sum(-1)
    doc = np.asarray(layout["doc"])
    for b in range(2):
        for d in range(int(layout["n_docs"][b])):
            reached = gx[b, doc[b] == d].max() > 0
            assert reached == bool(selected[b, d]), (b, d)
    assert np.abs(np.asarray(gw.wk[...])).max() > 0 and np.abs(np.asarray(gw.wv[...])).max() > 0


def test_router_stop_gradient_keeps_the_routing_loss_in_the_router():
    """router_stop_gradient: same forward and the same router gradients, but the routing loss no
    longer reaches the layer's input (it does without the option); the query's loss still does."""
    layer = _layer()
    cfg = dataclasses.replace(layer.cfg, msa=dataclasses.replace(layer.cfg.msa,
                                                                 router_stop_gradient=True))
    detached = MSAttention(cfg, rngs=nnx.Rngs(0), layer_index=1)
    x = _x(8)
    np.testing.assert_array_equal(np.asarray(_apply(detached, x, POS, SEG)),
                                  np.asarray(_apply(layer, x, POS, SEG)))
    (g, gx), (gd, gxd) = (_routing_grads(m, x) for m in (layer, detached))
    assert np.abs(np.asarray(gx)).max() > 0 and np.abs(np.asarray(gxd)).max() == 0
    for name in ("router_q", "router_k", "temperature"):
        np.testing.assert_allclose(np.asarray(getattr(gd, name)[...]),
                                   np.asarray(getattr(g, name)[...]), rtol=1e-6, atol=1e-8)
    _, (_, gq) = _grads(detached, x)
    assert np.abs(np.asarray(gq)).max() > 0


@nnx.jit
def _routing_grads(layer, x):
    return nnx.grad(_routing_loss, argnums=(0, 1))(layer, x)


@pytest.mark.parametrize("kv_chunk", [None, 1])
def test_memory_negatives_read_the_other_rows_best_document(kv_chunk):
    """memory_negatives=1: row 0's query reads its own selected documents plus the other row's
    (one document there, so it is the best); equal to one packed row holding that document too,
    with top_k covering all three. The other row's document gets the query's gradient; a
    non-routing layer ignores the option."""
    msa = dataclasses.replace(MSA, top_k=3, kv_chunk=kv_chunk)
    cfg = dataclasses.replace(CFG, msa=dataclasses.replace(msa, memory_negatives=1))
    seg, pos = _rows([dict(doc_lengths=[6, 9], query_length=5),
                      dict(doc_lengths=[7], query_length=4)])
    ref_seg, ref_pos = _rows([dict(doc_lengths=[6, 9, 7], query_length=5)])
    x = _x(9)
    ref_x = jnp.concatenate([x[0, :15], x[1, :7], x[0, 15:20], x[0, 20:T - 7]])[None]
    plain = dataclasses.replace(CFG, msa=msa)
    for index in (1, 0):
        layer = MSAttention(cfg, rngs=nnx.Rngs(0), layer_index=index)
        got = np.asarray(_apply(layer, x, pos, seg))
        ref_layer = MSAttention(plain, rngs=nnx.Rngs(0), layer_index=index)
        if index:
            ref = np.asarray(_apply(ref_layer, ref_x, ref_pos, ref_seg))[0, 22:27]
        else:  # a non-routing layer: as without the option
            ref = np.asarray(_apply(ref_layer, x, pos, seg))[0, 15:20]
        np.testing.assert_allclose(got[0, 15:20], ref, rtol=1e-5, atol=1e-6)

    def row0_query(layer, x):
        y = layer(x, positions=pos, segment_ids=seg)[0]
        return jnp.sum(y[0, 15:20] ** 2)

    layer = MSAttention(cfg, rngs=nnx.Rngs(0), layer_index=1)
    gx = np.abs(np.asarray(nnx.grad(row0_query, argnums=1)(layer, x))).sum(-1)
    assert gx[1, :7].min() > 0 and gx[1, 7:].max() == 0  # every token of the read document


def test_transformer_forward_backward_with_dense_and_msa():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                      mixers=("dense", "msa"), msa=MSAConfig(chunk=4, top_k=2, max_documents=8,
                                                             implementation="xla"),
                      max_seq_len=128)
    model = Transformer(cfg, rngs=nnx.Rngs(0))  # its after_build hook sets the routing layers
    flags = np.asarray(model.blocks.layers[1].mixer.routes[...])
    assert flags.tolist() == [0, 1]  # MSA layers 1 and 3; the top half (layers 2, 3) routes
    tokens = jax.random.randint(jax.random.key(9), (2, T), 0, 64) * (SEG != 0)

    @nnx.jit
    def step(model):
        def loss_fn(model):
            logits, _, aux = model(tokens, positions=POS, segment_ids=SEG)
            logp = jax.nn.log_softmax(logits[:, :-1])
            nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
            lm = jnp.sum(jnp.where(SEG[:, 1:] != 0, nll, 0.0)) / jnp.sum(SEG[:, 1:] != 0)
            return lm + sum(aux["losses"].values()), aux
        return nnx.grad(loss_fn, has_aux=True)(model)

    grads, aux = step(model)
    assert "mixer/routing" in aux["losses"] and float(aux["losses"]["mixer/routing"]) > 0
    assert {"mixer/recall@1", "mixer/recall@5/layer_3", "mixer/recall@10"} <= set(aux["metrics"])
    m = {k: float(v) for k, v in aux["metrics"].items()}  # layer 1 does not route: NaN, not 0
    assert np.isnan(m["mixer/recall@1/layer_1"])
    assert m["mixer/recall@1"] == m["mixer/recall@1/layer_3"]
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    rq = np.asarray(grads.blocks.layers[1].mixer.router_q[...])
    assert np.abs(rq[1]).max() > 0 and np.abs(rq[0]).max() == 0  # only layer 3 routes


@pytest.mark.parametrize("kwargs,field", [
    (dict(chunk=0), "chunk"), (dict(kv_chunk=0), "kv_chunk"),
    (dict(head_reduce="sum"), "head_reduce"),
    (dict(query_reduce="first"), "query_reduce"), (dict(temperature=0.9), "temperature"),
    (dict(routing_loss_form="coupled"), "routing_loss_form"),
    (dict(memory_negatives=-1), "memory_negatives"), (dict(router_rope=1), "router_rope"),
    (dict(router_stop_gradient=1), "router_stop_gradient"),
    (dict(routing_layers=(-1,)), "routing_layers"), (dict(implementation="cuda"),
                                                     "implementation")])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MSAConfig(**kwargs)


def test_model_check_of_routing_layers():
    with pytest.raises(ValueError, match="not 'msa'"):
        ModelConfig(n_layers=4, mixers=("dense", "msa"), msa=MSAConfig(routing_layers=(2,)))
    with pytest.raises(ValueError, match="n_layers"):
        ModelConfig(n_layers=4, mixers=("msa",), msa=MSAConfig(routing_layers=(4,)))
