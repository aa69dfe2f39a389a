"""Memory Sparse Attention ("msa" mixer, arXiv 2603.23516), part 1 of issue 21: the trainable core.

Shape letters: B batch, T tokens, D d_model, H query heads, K key/value heads (H = G * K), Dh
head_dim, N document slots per row (MSAConfig.max_documents), C chunk slots per row
(min(T, T // L + N): every document has ceil(length / L) chunks, at most T // L + N in all),
L = chunk for the routing keys and L = kv_chunk (MSAConfig.resolved_kv_chunk) for keys and values.

Batch representation (packed rows; it rides on the segment_ids and positions every mixer gets, so
the Transformer passes it through unchanged):
  segment_ids[b, t] == 0  padding.
                    >  0  a document token. A document is one contiguous run of one id (ids unique
                          within the row); documents are numbered 0, 1, ... in order of appearance
                          (the "document index", which also breaks score ties: lower wins). An id
                          with ANSWER_BIT (1 << 30) set marks a document holding the answer: a
                          positive of the routing loss and of router recall.
                    <  0  the query segment (at most one per row, one id for all its tokens):
                          id = -(1 + a) where a = how many of its LAST tokens the router must not
                          read (the answer, which must not steer the choice made for it); -1 = the
                          router reads every query token.
  positions: every document restarts at 0; the query starts at MSAConfig.query_offset (default
  top_k, as the paper). Building them is the batch builder's job; `pack_row` builds one row.
Other mixers only compare ids for equality and treat nonzero as real, so in a dense or NSA layer of
the same model these rows are ordinary packed segments. A row without a negative id (plain corpus)
has no query: an MSA layer then is causal attention within each segment, like "dense".

The layer: q, k, v projections (GQA) with RoPE at the given (document-wise) positions; bias-free
routing projections router_q [D,H,Dh] and router_k [D,K,Dh], rotated the same way (unless
router_rope=False). Per document,
K, V and the routing key are mean-pooled per chunk after RoPE (a last partial chunk averages only
its real tokens): the routing key per `chunk` tokens, K and V per `kv_chunk` tokens (by default the
same chunk, as the paper; kv_chunk < chunk keeps more of each chosen document for the query to
read, kv_chunk = 1 all of it, unpooled, while routing still compares one key per chunk: an option
added here because a tiny model routes on chunk averages but cannot copy out of them, see
eval/BENCHMARKS.md "MSA"). Routing score of a chunk: reduce over the router-read query tokens
(query_reduce) of reduce over heads (head_reduce; query head h uses key head h // G) of
cos(q_route, k_route_chunk); document score: reduce over its chunks (chunk_reduce); the top
min(top_k, documents in the row) documents are selected (ties: lower document index wins). Scores
are computed in float32.

Attention (one flash_attention call, kernels/flash_attention): keys are [C pooled chunks ; T
tokens], queries sit at q_offset = C (causal bound s <= t + C: every chunk slot and the tokens up to
itself), and pairs of segment ids do the rest: a token key carries its segment id, a chunk key the
row's query id when its document is selected in a routing layer, else an id no token has. So query
tokens see [pooled chunks of the selected documents ; their own causal context] and document tokens
see only their own document, causally. flash_attention rather than dense sdpa: the mask is exactly
expressible (causal + offset + segment pairs), no [B,H,T,C+T] logits buffer is built, and the same
call runs the Pallas kernels on GPU / TPU. The selection is integer-valued (not differentiable);
gradients reach the pooled chunk K/V (so the documents' k/v projections learn from the query's
loss), and the routing loss trains the router.

Routing layers: by default the top half of the model's layers (MSAConfig.routing_layers lists them
explicitly). A mixer does not know its layer index through the registry's interface, and with
scan_layers every repeat of a block shares one module structure, so the choice is a per-layer
non-parameter variable `routes` (RoutingFlag, int32 0/1; stacked [R] under scan) that masks the
selection: `MSAttention(cfg, rngs=..., layer_index=i)` sets it; the Transformer, which constructs
mixers without an index, calls the mixer's `after_build(model)` hook when it is built, and that sets
every MSA layer's flag (`assign_routing_layers`). Non-routing layers: documents self-attend, the
query sees only its own context.

Auxiliary outputs (models/auxiliary.py), per MSA layer: loss "routing" = routing_loss_weight *
routes * InfoNCE over document scores (routing_loss_form: "joint", the positives against all the
row's documents, or "decoupled", each positive against the negatives only; temperature a learned
scalar clamped to [0.001, 0.5], exact log-sum-exp; mean over rows with a positive; the negatives
are the row's other documents, or with routing_negatives="batch" every document of the batch, plus
metrics "batch_recall@1/5/10" among them and "batch_unfit"); metrics "recall@1", "recall@5",
"recall@10" (fraction of a row's positives among its top 1 / 5 / 10 documents, mean over rows with
a positive; reported by non-routing MSA layers too, whose router is then untrained).

Encoding (a memory bank, aiinfra_jax/memory_bank.py): every MSA layer also records its pooled
chunks ("pooled_k", "pooled_v", "pooled_route_k" [B,C,K,Dh], models/auxiliary.py `record`), which
a forward over rows of documents only returns with capture_intermediates=True.

Cache (prefill and decode): {"k": [B,K,Dh,M+S], "v": [B,K,M+S,Dh] (the dense cache's layout,
models/attention/dense.py), "lengths": [B] (the query's own
tokens in the cache), "mem": [B,M] bool (the memory slots in use), "docs": [B,top_k] int32 (the
bank documents in memory, best first, -1 = none)}: the first M slots hold pooled key/value chunks
of memory documents, the query's own tokens go at M + lengths. init_cache makes M = 0 (an MSA
model then decodes as causal attention over its own context); memory_bank.attach_bank gives a
routing layer's cache M = top_k * (the bank's longest document in key/value chunks) slots and a
"bank" entry (its pooled route_k [Cp,K,Dh] with chunk_doc [Cp], k / v [Ckv,K,Dh] with kv_start /
kv_chunks [N]: where each document's key/value chunks start, and how many). A cached call
whose cache holds a bank routes: its router-read query tokens (segment id < 0, without the last a
of an id -(1 + a)) score the bank in tiles with the training rule
(msa_routing.bank_document_scores), the top min(top_k, N) documents' pooled chunks are gathered
into the memory slots, and the returned cache drops the bank; later calls (decode) attend to
[memory ; own causal context] without touching the bank. So the prefill that routes must hold the
whole router-read prompt (one call, not chunks), and prefill plus decode equal the training
forward over [the bank's documents ; the query] (tests/models/test_msa_bank.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.kernels.flash_attention import AttentionMask, cached_attention, flash_attention

from ..auxiliary import record, report_loss, report_metric
from ..config import ModelConfig, check_implementation, runtime_field
from ..layers import apply_rope, out_proj_std, project
from ..registry import register_config, register_mixer
from .dense import cache_mask, cache_room, kv_buffers, refuse_rows, write_kv
from .msa_routing import (
    ANSWER_BIT, INFONCE_FORMS, bank_document_scores, batch_document_scores, document_layout,
    document_scores, gather_memory, infonce, pool_chunks, query_roles,
    select_bank_documents, select_documents, top_k_recall)


_HIDDEN = int(np.iinfo(np.int32).min)  # kv segment id of a chunk nobody sees (no token has it)
HEAD_REDUCE = ("mean", "max")
QUERY_REDUCE = ("max", "mean", "last")
CHUNK_REDUCE = ("max", "mean")
TEMPERATURE_RANGE = (0.001, 0.5)
ROUTING_NEGATIVES = ("row", "batch")


@register_config("msa")
@dataclasses.dataclass(frozen=True)
class MSAConfig:
    """Memory Sparse Attention settings, used by layers whose mixer is "msa".

    chunk: tokens per pooled chunk (L) of the routing keys, and of the keys and values unless
    kv_chunk says otherwise; kv_chunk: tokens per pooled key/value chunk that a query attends to
    (None = chunk, as the paper; 1 = the chosen documents' own keys and values, unpooled: routing
    on chunk averages, reading at full resolution, which is not MSA as published, see the module
    docstring); top_k: documents each routing layer selects (capped at the row's documents);
    routing_layers: layer indices (of the whole model) that route, None = the MSA layers in the
    top half (i >= n_layers // 2); head_reduce / query_reduce / chunk_reduce: the three
    reductions of the routing score (module docstring); query_offset: first position of the
    query segment (None = top_k; used by batch builders, see pack_row); temperature: initial
    InfoNCE temperature (a learned scalar, clamped to [0.001, 0.5] at use); router_rope: whether
    the routing projections are rotated like q and k (an ablation when False, see the field);
    router_stop_gradient: whether the routing loss stops at the router's projections (the field).
    """

    chunk: int = 64
    kv_chunk: int | None = None
    top_k: int = 16
    routing_layers: tuple[int, ...] | None = None
    head_reduce: str = "mean"
    query_reduce: str = "max"
    chunk_reduce: str = "max"
    query_offset: int | None = None
    temperature: float = 0.1
    # Rotate the routing projections at the document-wise positions (True, as the paper: the
    # routing key pooled after RoPE). False routes on unrotated projections, so a chunk's score
    # cannot depend on where in its document the chunk sits: with RoPE a document whose key is as
    # long as the needle's scores like it by position alone (eval/BENCHMARKS.md "MSA"). An
    # ablation added here; q, k and the reading attention keep RoPE either way.
    router_rope: bool = True
    # Training: the routing projections read a stop-gradient copy of the layer's input, so the
    # routing loss trains router_q, router_k and the temperature only, and the representations
    # the reading attention shares are shaped by the LM loss alone (a heavier routing loss was
    # seen to trade reading for ranking). An ablation: on the tiny preset the reading stays
    # near-exact but the ranking collapses, 90% -> 66% at 1M (eval/BENCHMARKS.md "MSA").
    # Forward values unchanged.
    router_stop_gradient: bool = runtime_field(False)
    routing_loss_weight: float = runtime_field(0.1)
    # InfoNCE over documents: "joint" (all positives against all documents) or "decoupled" (each
    # positive against the negatives only); the same with one positive (msa_routing.infonce).
    routing_loss_form: str = runtime_field("joint")
    # Negatives of the routing loss: "row" (the other documents of the query's row) or "batch"
    # (also every document of the batch's other rows: dense retrieval's in-batch negatives, so a
    # query learns to stand out among B*N documents, not N; msa_routing.batch_document_scores).
    # "batch" scores each row's first batch_query_tokens router-read query tokens against the
    # other rows; a row with more keeps only its own row's negatives (metric "batch_unfit").
    routing_negatives: str = runtime_field("row")
    batch_query_tokens: int = runtime_field(64)
    # Training only: documents of the batch's OTHER rows added to each query's memory, the
    # highest-scoring ones by the routing rule (0 = none). A bank's router brings the needle plus
    # the best-scoring of thousands of documents, competitors a row of a few documents rarely holds,
    # and a reader trained on rows alone confuses them (eval/BENCHMARKS.md "MSA"); these are the
    # hardest of the batch's B*N. Scored as routing_negatives="batch" (batch_query_tokens);
    # gradients reach their keys and values. Cached calls and banks ignore it.
    memory_negatives: int = runtime_field(0)
    # Document slots per row; a row with a query and more documents is refused (outputs NaN).
    max_documents: int = runtime_field(64)
    implementation: str | None = runtime_field(None)  # flash_attention backend (None = best)
    interpret: bool = runtime_field(False)  # Pallas kernels in interpret mode (CPU tests)

    def __post_init__(self):
        for name in ("chunk", "top_k", "max_documents", "batch_query_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"MSAConfig.{name}={v!r}: must be a positive int")
        m = self.memory_negatives
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"MSAConfig.memory_negatives={m!r}: must be an int >= 0")
        for name in ("router_rope", "router_stop_gradient"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MSAConfig.{name}={getattr(self, name)!r}: must be True or "
                                 "False")
        kv = self.kv_chunk
        if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0):
            raise ValueError(f"MSAConfig.kv_chunk={kv!r}: must be a positive int, or None (= "
                             "chunk)")
        if isinstance(self.routing_layers, list):
            object.__setattr__(self, "routing_layers", tuple(self.routing_layers))
        rl = self.routing_layers
        if rl is not None and (not isinstance(rl, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in rl)):
            raise ValueError(f"MSAConfig.routing_layers={rl!r}: must be a tuple of layer indices "
                             ">= 0, or None (= the MSA layers in the top half of the model)")
        for name, choices in (("head_reduce", HEAD_REDUCE), ("query_reduce", QUERY_REDUCE),
                              ("chunk_reduce", CHUNK_REDUCE), ("routing_loss_form", INFONCE_FORMS),
                              ("routing_negatives", ROUTING_NEGATIVES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"MSAConfig.{name}={getattr(self, name)!r}: valid choices: "
                                 f"{choices}")
        qo = self.query_offset
        if qo is not None and (not isinstance(qo, int) or isinstance(qo, bool) or qo < 0):
            raise ValueError(f"MSAConfig.query_offset={qo!r}: must be an int >= 0 or None "
                             "(= top_k)")
        lo, hi = TEMPERATURE_RANGE
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not lo <= t <= hi:
            raise ValueError(f"MSAConfig.temperature={t!r}: must be in [{lo}, {hi}] (the clamp "
                             "range of the learned InfoNCE temperature)")
        w = self.routing_loss_weight
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not w >= 0:
            raise ValueError(f"MSAConfig.routing_loss_weight={w!r}: must be a number >= 0")
        check_implementation("MSAConfig", self.implementation)

    @property
    def resolved_kv_chunk(self) -> int:
        return self.chunk if self.kv_chunk is None else self.kv_chunk

    @property
    def resolved_query_offset(self) -> int:
        return self.top_k if self.query_offset is None else self.query_offset

    def check_model(self, cfg: ModelConfig) -> None:
        """Checks against the model's layer pattern (called by ModelConfig's validation)."""
        if self.routing_layers is None:
            return
        for i in self.routing_layers:
            if i >= cfg.n_layers:
                raise ValueError(f"ModelConfig.msa: routing_layers has layer {i}, but n_layers="
                                 f"{cfg.n_layers}; list indices in [0, {cfg.n_layers})")
            if cfg.mixer_at(i) != "msa":
                raise ValueError(f"ModelConfig.msa: routing_layers has layer {i}, whose mixer is "
                                 f"{cfg.mixer_at(i)!r}, not 'msa' "
                                 f"(mixers={cfg.mixers})")


def routing_layer_indices(cfg: ModelConfig) -> tuple[int, ...]:
    """Indices of the layers that route: MSAConfig.routing_layers, or the MSA layers in the top
    half of the model."""
    if cfg.msa.routing_layers is not None:
        return tuple(sorted(set(cfg.msa.routing_layers)))
    return tuple(i for i in range(cfg.n_layers // 2, cfg.n_layers)
                 if cfg.mixer_at(i) == "msa")


def pack_row(doc_lengths: Sequence[int], query_length: int, *, answer_docs: Sequence[int] = (),
             answer_length: int = 0, query_offset: int = 16, row_length: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids [row_length], positions [row_length]) int32 numpy of one packed row: the
    documents in order (document j has id j + 1, with ANSWER_BIT when j is in answer_docs;
    positions from 0), then the query (id -(1 + answer_length): its last answer_length tokens are
    not read by the router; positions from query_offset), then right padding (0, 0)."""
    seg, pos = [], []
    for j, n in enumerate(doc_lengths):
        if n <= 0:
            raise ValueError(f"pack_row: document {j} has length {n}; documents are non-empty")
        seg += [(j + 1) | (ANSWER_BIT if j in answer_docs else 0)] * n
        pos += list(range(n))
    if not 0 <= answer_length <= query_length:
        raise ValueError(f"pack_row: answer_length={answer_length} must be in [0, query_length="
                         f"{query_length}]")
    seg += [-(1 + answer_length)] * query_length
    pos += list(range(query_offset, query_offset + query_length))
    row_length = len(seg) if row_length is None else row_length
    if len(seg) > row_length:
        raise ValueError(f"pack_row: {len(seg)} tokens do not fit in row_length={row_length}")
    pad = row_length - len(seg)
    return np.asarray(seg + [0] * pad, np.int32), np.asarray(pos + [0] * pad, np.int32)


# The module -------------------------------------------------------------------------------------

class RoutingFlag(nnx.Variable):
    """Non-parameter int32 0/1: whether this MSA layer routes (module docstring)."""


@register_mixer("msa")
class MSAttention(nnx.Module):
    """MSA token mixer (module docstring). Parameters: wq [D,H,Dh], wk, wv [D,K,Dh], wo [H,Dh,D],
    router_q [D,H,Dh], router_k [D,K,Dh], temperature [] (InfoNCE, clamped at use); state:
    routes (RoutingFlag)."""

    @classmethod
    def after_build(cls, model: nnx.Module) -> None:
        """The Transformer's hook (models/registry.py): sets the routing layers' flags."""
        assign_routing_layers(model)

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer_index: int | None = None):
        self.cfg = cfg
        d, h, k, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        std, pdt = cfg.init_std, cfg.param_dtype
        # name: (shape, logical axes, init std), drawn from one normal sample (one random program
        # to compile instead of six, as in nsa.py).
        specs = {
            "wq": ((d, h, dh), ("embed", "heads", "head_dim"), std),
            "wk": ((d, k, dh), ("embed", "kv_heads", "head_dim"), std),
            "wv": ((d, k, dh), ("embed", "kv_heads", "head_dim"), std),
            "wo": ((h, dh, d), ("heads", "head_dim", "embed"), out_proj_std(cfg)),
            "router_q": ((d, h, dh), ("embed", "heads", "head_dim"), std),
            "router_k": ((d, k, dh), ("embed", "kv_heads", "head_dim"), std),
        }
        sizes = [math.prod(shape) for shape, _, _ in specs.values()]
        flat = jax.random.normal(rngs.params(), (sum(sizes),), jnp.float32)
        offsets = np.cumsum([0] + sizes)
        for (name, (shape, axes, sd)), lo, hi in zip(specs.items(), offsets[:-1], offsets[1:]):
            value = (flat[lo:hi].reshape(shape) * sd).astype(pdt)
            setattr(self, name, nnx.Param(value, logical_axes=axes))
        self.temperature = nnx.Param(jnp.asarray(cfg.msa.temperature, pdt), logical_axes=())
        # Without an index (built by the Transformer) the flag is set by after_build.
        routes = 1 if layer_index is None else int(layer_index in routing_layer_indices(cfg))
        self.routes = RoutingFlag(jnp.asarray(routes, jnp.int32))

    def _project(self, x_btd: jax.Array, positions_bt: jax.Array) -> dict[str, jax.Array]:
        """q, q_route [B,T,H,Dh] and k, k_route, v [B,T,K,Dh] in the compute dtype; q and k
        rotated at positions, q_route and k_route too unless MSAConfig.router_rope is False;
        q_route and k_route from a stop-gradient input if MSAConfig.router_stop_gradient."""
        dt = jnp.dtype(self.cfg.dtype)
        x = x_btd.astype(dt)
        x_route = jax.lax.stop_gradient(x) if self.cfg.msa.router_stop_gradient else x
        out = {name: project(src, getattr(self, w)[...].astype(dt))
               for name, w, src in (("q", "wq", x), ("k", "wk", x), ("v", "wv", x),
                                    ("q_route", "router_q", x_route),
                                    ("k_route", "router_k", x_route))}
        rotated = ("q", "k") + (("q_route", "k_route") if self.cfg.msa.router_rope else ())
        for name in rotated:
            out[name] = apply_rope(out[name], positions_bt, self.cfg.rope_theta)
        return out

    def __call__(self, x_btd: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None,
                 cache: Any = None) -> tuple[jax.Array, None]:
        c = self.cfg.msa
        dt = jnp.dtype(self.cfg.dtype)
        p = self._project(x_btd, positions)
        kernel = dict(implementation=c.implementation, interpret=c.interpret)
        new_cache = None
        if cache is not None:
            y, new_cache = self._cached(p, segment_ids, cache)
        elif segment_ids is None:  # one document, no query: causal attention
            y = flash_attention(p["q"], p["k"], p["v"], mask=AttentionMask(causal=True), **kernel)
        else:
            y = self._routed(p, segment_ids.astype(jnp.int32), kernel)
        out = project(y.astype(dt), self.wo[...].astype(dt), contract=2)
        return out, new_cache

    def _routed(self, p: dict[str, jax.Array], seg: jax.Array, kernel: dict) -> jax.Array:
        c = self.cfg.msa
        batch = seg.shape[0]
        layout = document_layout(seg, c.chunk, c.max_documents)  # routing chunks
        kv_layout = (layout if c.resolved_kv_chunk == c.chunk
                     else document_layout(seg, c.resolved_kv_chunk, c.max_documents))
        query_id, _, reads = query_roles(seg)
        k_chunks, v_chunks = (pool_chunks(p[n], kv_layout) for n in ("k", "v"))
        kr_chunks = pool_chunks(p["k_route"], layout)
        for name, value in (("pooled_k", k_chunks), ("pooled_v", v_chunks),
                            ("pooled_route_k", kr_chunks)):
            record(self, name, value)  # a memory bank's encoding; dropped unless captured
        scores = document_scores(p["q_route"], kr_chunks, reads, layout, c)
        _, selected = select_documents(scores, layout["n_docs"], c.top_k)
        selected = selected & (self.routes[...] > 0)
        n = c.max_documents
        chunk_sel = jnp.take_along_axis(jnp.pad(selected, ((0, 0), (0, 1))),
                                        kv_layout["chunk_doc"], axis=1) & (kv_layout["count"] > 0)
        chunk_seg = jnp.where(chunk_sel, query_id[:, None], _HIDDEN)
        memory_k, memory_v, memory_seg = [k_chunks], [v_chunks], [chunk_seg]

        valid = jnp.arange(n)[None, :] < layout["n_docs"][:, None]
        positive = layout["positive"] & valid & jnp.isfinite(scores)
        for k, r in zip((1, 5, 10), top_k_recall(scores, positive, (1, 5, 10))):
            self._report(f"recall@{k}", r)
        loss_scores, loss_positive = scores, positive
        if c.routing_negatives == "batch" or c.memory_negatives:
            cross, cross_positive = self._batch_scores(p, reads, kr_chunks, layout, scores,
                                                       positive)
            if c.routing_negatives == "batch":
                loss_scores, loss_positive = cross, cross_positive
            if c.memory_negatives:
                extra_k, extra_v, extra_seg = self._memory_negatives(cross, kv_layout, k_chunks,
                                                                     v_chunks, query_id)
                memory_k.append(extra_k)
                memory_v.append(extra_v)
                memory_seg.append(extra_seg)
        k_all = jnp.concatenate(memory_k + [p["k"]], axis=1)
        v_all = jnp.concatenate(memory_v + [p["v"]], axis=1)
        kv_seg = jnp.concatenate(memory_seg + [seg], axis=1)
        offset = jnp.full((batch,), k_all.shape[1] - seg.shape[1], jnp.int32)
        y = flash_attention(p["q"], k_all, v_all, mask=AttentionMask(causal=True),
                            segment_ids=(seg, kv_seg), q_offset=offset, **kernel)
        temperature = jnp.clip(self.temperature[...].astype(jnp.float32), *TEMPERATURE_RANGE)
        loss = infonce(loss_scores, loss_positive, jnp.isfinite(loss_scores), temperature,
                       c.routing_loss_form)
        report_loss(self, "routing",
                    c.routing_loss_weight * self.routes[...].astype(jnp.float32) * loss)
        # A row with more documents than slots is refused only when it has a query to route:
        # plain packed text (no query) uses no chunk slot, so its outputs never depend on them.
        return refuse_rows(y, layout["fits"] | (query_id == 0))

    def _report(self, name: str, value: jax.Array) -> None:
        """A routing metric: NaN in a layer that does not route (it scores documents all the
        same, under the layer scan), so the average over layers is over the routing ones."""
        report_metric(self, name, jnp.where(self.routes[...] > 0, value, jnp.nan))

    def _batch_scores(self, p, reads, kr_chunks, layout, scores, positive
                      ) -> tuple[jax.Array, jax.Array]:
        """(scores, positives) [B, B*N] of in-batch negatives (MSAConfig.routing_negatives): row
        i's own documents at [i, i*N:(i+1)*N] (the exact scores), the other rows' documents as
        negatives where row i's router-read tokens fit batch_query_tokens (else -inf)."""
        batch, n = scores.shape
        cross, fits = batch_document_scores(p["q_route"], kr_chunks, reads, layout, self.cfg.msa,
                                            self.cfg.msa.batch_query_tokens)
        own = jnp.eye(batch, dtype=jnp.bool_)[:, :, None]
        cross = jnp.where(own, scores[:, None, :], jnp.where(fits[:, None, None], cross, -jnp.inf))
        cross = cross.reshape(batch, batch * n)
        pos = (own & positive[:, None, :]).reshape(batch, batch * n)
        for k, r in zip((1, 5, 10), top_k_recall(cross, pos, (1, 5, 10))):
            self._report(f"batch_recall@{k}", r)
        has_query = jnp.any(reads, axis=1)
        self._report("batch_unfit", jnp.sum(has_query & ~fits) / jnp.maximum(jnp.sum(has_query), 1))
        return cross, pos

    def _memory_negatives(self, cross, kv_layout, k_chunks, v_chunks, query_id
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """MSAConfig.memory_negatives: (k, v [B,M,K,Dh], kv segment ids [B,M]) of the
        highest-scoring documents of the other rows (cross [B,B*N] from _batch_scores), gathered
        as a bank's documents are (msa_routing.gather_memory), M = memory_negatives * C slots;
        hidden where a slot is unused or this layer does not route."""
        batch, n = cross.shape[0], cross.shape[1] // cross.shape[0]
        c_slots = kv_layout["n_slots"]
        own = jnp.repeat(jnp.eye(batch, dtype=jnp.bool_), n, axis=1)
        docs = select_bank_documents(jnp.where(own, -jnp.inf, cross),
                                     self.cfg.msa.memory_negatives)
        docs = jnp.where(self.routes[...] > 0, docs, -1)
        start = kv_layout["doc_start"] + c_slots * jnp.arange(batch)[:, None]  # flat slots
        flat = (batch * c_slots,) + k_chunks.shape[2:]
        k, v, used = gather_memory(k_chunks.reshape(flat), v_chunks.reshape(flat),
                                   start.reshape(-1), kv_layout["doc_chunks"].reshape(-1), docs,
                                   c_slots)
        return (k.swapaxes(1, 2), v.swapaxes(1, 2),
                jnp.where(used, query_id[:, None], _HIDDEN))

    def _cached(self, p: dict[str, jax.Array], segment_ids: jax.Array | None,
                cache: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
        """A cached call (module docstring, "Cache"): routes first when the cache holds a bank."""
        c = self.cfg.msa
        batch, seq = p["q"].shape[:2]
        mem, docs = cache["mem"], cache["docs"]
        m = mem.shape[1]
        slots = cache["v"].shape[2] - m
        lengths = cache["lengths"]
        added, fits, write_at = cache_room(lengths, segment_ids, seq, slots)
        k_all, v_all = write_kv(cache, p["k"], p["v"], m + write_at)
        bank = cache.get("bank")
        if bank is not None and m:
            reads = (jnp.zeros((batch, seq), jnp.bool_) if segment_ids is None
                     else query_roles(segment_ids)[2])
            scores = bank_document_scores(p["q_route"], reads, bank["route_k"],
                                          bank["chunk_doc"], bank["kv_start"].shape[0], c,
                                          keys_normalized=True)  # DeviceBank's route_k
            docs = jnp.where(self.routes[...] > 0, select_bank_documents(scores, c.top_k), -1)
            mem_k, mem_v, mem = gather_memory(bank["k"], bank["v"], bank["kv_start"],
                                              bank["kv_chunks"], docs, m // c.top_k)
            k_all = k_all.at[:, :, :, :m].set(mem_k.swapaxes(2, 3).astype(k_all.dtype))
            v_all = v_all.at[:, :, :m].set(mem_v.astype(v_all.dtype))
        visible = jnp.concatenate([jnp.broadcast_to(mem[:, None, :], (batch, seq, m)),
                                   cache_mask(lengths, seq, slots)], axis=2)
        y = refuse_rows(cached_attention(p["q"], k_all, v_all, visible, keys_transposed=True),
                        fits)
        return y, {"k": k_all, "v": v_all, "lengths": lengths + jnp.where(fits, added, 0),
                   "mem": mem, "docs": docs}

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> dict[str, jax.Array]:
        """A cache without memory slots (module docstring, "Cache"); memory_bank.attach_bank
        gives a routing layer its memory."""
        dtype = jnp.dtype(dtype or self.cfg.dtype)
        return {**kv_buffers(batch, self.cfg.n_kv_heads, self.cfg.resolved_head_dim, max_len,
                             dtype),
                "lengths": jnp.zeros((batch,), jnp.int32),
                "mem": jnp.zeros((batch, 0), jnp.bool_),
                "docs": jnp.full((batch, self.cfg.msa.top_k), -1, jnp.int32)}

    def flops_per_token(self, seq_len: int) -> float:
        """Projections (q, k, v, o and the two router projections), routing scores against every
        routing chunk 2*H*Dh*seq_len/L, and 4*H*Dh per attended key: the causal context (as dense)
        plus the selected documents' key/value chunks (at most top_k documents of a seq_len-token
        row)."""
        cfg, c = self.cfg, self.cfg.msa
        dh, h, k = cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads
        proj = 2.0 * cfg.d_model * dh * (3 * h + 3 * k)
        scoring = 2.0 * h * dh * seq_len / c.chunk
        kv_chunks = seq_len / c.resolved_kv_chunk
        attn = 4.0 * h * dh * ((seq_len + 1) / 2.0 + min(kv_chunks + c.top_k, seq_len))
        return proj + scoring + attn


def assign_routing_layers(model: nnx.Module) -> None:
    """Sets every MSA layer's `routes` flag of a built Transformer from routing_layer_indices
    (layer i = r * P + p). The Transformer builds mixers without their index; call this once after
    building (or loading) a model."""
    cfg = model.cfg
    routes = set(routing_layer_indices(cfg))
    size = cfg.block_size
    blocks = [model.blocks] if cfg.scan_layers else list(model.blocks)
    for r_block, block in enumerate(blocks):
        for p, layer in enumerate(block.layers):
            if not isinstance(layer.mixer, MSAttention):
                continue
            if cfg.scan_layers:
                flags = [int(r * size + p in routes) for r in range(cfg.n_repeats)]
            else:
                flags = int(r_block * size + p in routes)
            layer.mixer.routes[...] = jnp.asarray(flags, jnp.int32)
