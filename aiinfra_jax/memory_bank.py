"""A document memory bank for MSA models (issue 21): encode documents once, store them on disk,
answer queries by routing over them.

    bank = build_bank(model, docs, "banks/wiki")                 # encode + write (or append)
    bank = MemoryBank.open("banks/wiki", model=model)            # checks it belongs to the model
    result = generate_from_bank(model, bank.to_device(), prompts, max_new_tokens=16)

Encoding: each document is encoded independently (documents are packed into rows, but an MSA row
without a query is causal attention within each document, and every document's positions restart
at 0), and every routing layer's pooled chunks (keys, values, routing keys; msa.py "Encoding") are
kept. Query: the bank's arrays go to the device, a routing layer's cache gets memory slots and the
bank (msa.py "Cache"), one prefill call over the prompt routes in every routing layer with the
training scoring rule (tiled over the bank's chunks), and decoding continues without the bank.

On disk: aiinfra_jax/bank_storage.py (the files, the commit rule, the bank on the device; its
names are re-exported here).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax import sharding as shd
from aiinfra_jax.bank_storage import (ARRAYS, FORMAT, BankError, DeviceBank, Encoded, MemoryBank,
                                      model_signature)
from aiinfra_jax.generate import GenerateResult, check_vocab, decode_loop, inference_model
from aiinfra_jax.kernels.compilation import jit
from aiinfra_jax.models.attention.msa import routing_layer_indices

__all__ = ["ARRAYS", "FORMAT", "BankAnswer", "BankError", "DeviceBank", "Encoded", "MemoryBank",
           "attach_bank", "bank_prefill", "build_bank", "cache_documents", "encode_documents",
           "generate_from_bank", "model_signature", "read_documents"]

_RECORDED = {"route_k": "pooled_route_k", "k": "pooled_k", "v": "pooled_v"}


# Encoding -------------------------------------------------------------------------------------------

def _pack(lengths: Sequence[int], row_len: int, max_docs: int) -> list[list[int]]:
    """Greedy packing of documents (in order) into rows of row_len tokens and max_docs documents."""
    rows, row, used = [], [], 0
    for j, n in enumerate(lengths):
        if row and (used + n > row_len or len(row) == max_docs):
            rows.append(row)
            row, used = [], 0
        row.append(j)
        used += n
    if row:
        rows.append(row)
    return rows


@functools.partial(jit, static_argnums=(0, 5))
def _encode_rows(graphdef, state, tokens, positions, segment_ids, layers: tuple[int, ...]):
    model = nnx.merge(graphdef, state)
    _, _, aux = model.features(tokens, positions=positions, segment_ids=segment_ids,
                               capture_intermediates=True)
    inter = aux["intermediates"]
    return {i: {name: inter[f"layer_{i}/mixer/{rec}"] for name, rec in _RECORDED.items()}
            for i in layers}


class _Progress:
    """A one-line progress bar on stderr (no dependency): done / total, percent, rate."""

    def __init__(self, total: int, what: str, enabled: bool):
        self.total, self.what, self.enabled = total, what, enabled
        self.start = time.perf_counter()

    def update(self, done: int, tokens: int) -> None:
        if not self.enabled:
            return
        rate = tokens / max(time.perf_counter() - self.start, 1e-9)
        end = "\n" if done >= self.total else ""
        print(f"\r{self.what}: {done}/{self.total} documents ({100 * done / self.total:.0f}%), "
              f"{rate:,.0f} tokens/s", end=end, file=sys.stderr, flush=True)


def encode_documents(model: nnx.Module, docs: Sequence[np.ndarray], *, row_len: int = 1024,
                     batch_rows: int = 8, max_doc_length: int | None = None,
                     progress: bool = False) -> Encoded:
    """Encodes token documents (each a 1-D int array, BOS included if the model was trained so)
    independently: rows of up to row_len tokens and msa.max_documents documents, batch_rows rows
    per jitted call. A document longer than max_doc_length (None = row_len) or empty is refused."""
    cfg = model.cfg
    if not any(m == "msa" for m in cfg.mixers):
        raise BankError(f"encode_documents: the model has no MSA layer (mixers={cfg.mixers})")
    limit = row_len if max_doc_length is None else max_doc_length
    if limit > row_len:
        raise BankError(f"encode_documents: max_doc_length={limit} exceeds row_len={row_len}; a "
                        "document is encoded within one row: raise row_len")
    if not docs:
        raise BankError("encode_documents: the collection is empty; give at least one document")
    docs = [np.asarray(d, np.int32).reshape(-1) for d in docs]
    lengths = [d.size for d in docs]
    for j, n in enumerate(lengths):
        if n == 0 or n > limit:
            raise BankError(f"encode_documents: document {j} has {n} tokens; documents must have "
                            f"1 to max_doc_length={limit} tokens (split long documents, or raise "
                            "max_doc_length and row_len)")
        if docs[j].min() < 0 or docs[j].max() >= cfg.vocab_size:
            raise BankError(f"encode_documents: document {j} has token ids outside [0, "
                            f"{cfg.vocab_size})")
    # Chunks of every document: routing keys per msa.chunk, keys and values per kv_chunk.
    n_route = -(-np.asarray(lengths, np.int32) // cfg.msa.chunk)
    n_kv = -(-np.asarray(lengths, np.int32) // cfg.msa.resolved_kv_chunk)
    n_chunks = {"route_k": n_route, "k": n_kv, "v": n_kv}
    layers = routing_layer_indices(cfg)
    rows = _pack(lengths, row_len, cfg.msa.max_documents)
    graphdef, state = nnx.split(model)
    out: dict[int, dict[str, list]] = {i: {n: [] for n in ARRAYS} for i in layers}
    bar = _Progress(len(docs), "encoding", progress)
    done = tokens_done = 0
    for first in range(0, len(rows), batch_rows):
        group = rows[first:first + batch_rows]
        tok = np.zeros((batch_rows, row_len), np.int32)
        pos = np.zeros_like(tok)
        seg = np.zeros_like(tok)
        for b, row in enumerate(group):
            at = 0
            for slot, j in enumerate(row):
                n = lengths[j]
                tok[b, at:at + n], pos[b, at:at + n], seg[b, at:at + n] = docs[j], np.arange(n), \
                    slot + 1
                at += n
        pooled = jax.device_get(_encode_rows(graphdef, state, tok, pos, seg, layers))
        for b, row in enumerate(group):
            for name in ARRAYS:
                base = np.concatenate([[0], np.cumsum(n_chunks[name][row])])
                for i in layers:
                    arr = pooled[i][name][b]
                    out[i][name].extend(arr[base[s]:base[s + 1]] for s in range(len(row)))
            done += len(row)
            tokens_done += sum(lengths[j] for j in row)
        bar.update(done, tokens_done)
    return Encoded(
        layers={i: {n: np.concatenate(v).astype(np.float32) for n, v in d.items()}
                for i, d in out.items()},
        doc_chunks=n_route, doc_kv_chunks=n_kv,
        doc_length=np.asarray(lengths, np.int32))


def build_bank(model: nnx.Module, docs: Sequence[np.ndarray], out: str | Path, *,
               ids: Sequence[Any] | None = None, append: bool = False, overwrite: bool = False,
               max_doc_length: int = 1024, row_len: int | None = None, batch_rows: int = 8,
               batch_docs: int = 4096, progress: bool = False) -> MemoryBank:
    """Encodes docs and writes them to the bank at out (a new bank, or `append` to one), committed
    every batch_docs documents (an interruption keeps every committed batch)."""
    if not docs:
        raise BankError("build_bank: the collection is empty; give at least one document")
    if ids is not None and len(ids) != len(docs):  # before any batch is committed
        raise BankError(f"build_bank: {len(ids)} ids for {len(docs)} documents")
    bank = (MemoryBank.open(out, model=model) if append
            else MemoryBank.create(out, model, max_doc_length=max_doc_length,
                                   overwrite=overwrite))
    limit = bank.manifest["max_doc_length"]
    row_len = row_len or max(limit, 256)
    ids = list(range(bank.n_docs, bank.n_docs + len(docs))) if ids is None else list(ids)
    for first in range(0, len(docs), batch_docs):
        part = docs[first:first + batch_docs]
        enc = encode_documents(model, part, row_len=row_len, batch_rows=batch_rows,
                               max_doc_length=limit, progress=progress)
        bank.append(enc, ids[first:first + batch_docs])
    return bank


# Query ----------------------------------------------------------------------------------------------

def attach_bank(model: nnx.Module, cache: tuple, arrays: dict[str, Any],
                max_doc_chunks: int) -> tuple:
    """The model's cache (Transformer.init_cache) with memory slots (top_k * max_doc_chunks) and
    the bank (DeviceBank.arrays) in every routing layer's MSA cache (msa.py "Cache");
    other layers unchanged."""
    cfg = model.cfg
    m = cfg.msa.top_k * max_doc_chunks
    size = cfg.block_size
    shared = {key: arrays[key] for key in ("chunk_doc", "kv_start", "kv_chunks")}

    def with_memory(layer_cache, i):
        inner = layer_cache["mixer"] if "conv" in layer_cache else layer_cache
        batch, kv, slots, dh = inner["v"].shape  # k is [B,K,Dh,S] (msa.py "Cache")
        grown = dict(inner)
        grown["k"] = jnp.concatenate([jnp.zeros((batch, kv, dh, m), inner["k"].dtype),
                                      inner["k"]], axis=3)
        grown["v"] = jnp.concatenate([jnp.zeros((batch, kv, m, dh), inner["v"].dtype),
                                      inner["v"]], axis=2)
        grown["mem"] = jnp.zeros((batch, m), jnp.bool_)
        grown["bank"] = dict(shared, **arrays["layers"][i])
        return dict(layer_cache, mixer=grown) if "conv" in layer_cache else grown

    routes = set(arrays["layers"])
    return tuple(tuple(with_memory(c, r * size + p) if r * size + p in routes else c
                       for p, c in enumerate(block)) for r, block in enumerate(cache))


@functools.partial(jit, static_argnums=(0, 6, 7, 8))
def _bank_prefill(graphdef, state, arrays, tokens_bt, lengths_b, unread_b, max_len: int,
                  max_doc_chunks: int, every_position: bool):
    model = inference_model(graphdef, state)
    batch, seq = tokens_bt.shape
    offset = model.cfg.msa.resolved_query_offset
    cache = attach_bank(model, model.init_cache(batch, max_len), arrays, max_doc_chunks)
    t = jnp.arange(seq, dtype=jnp.int32)[None, :]
    segment_ids = jnp.where(t < lengths_b[:, None], -1 - unread_b[:, None], 0).astype(jnp.int32)
    positions = jnp.broadcast_to(offset + t, (batch, seq))
    x, cache, _ = model.features(tokens_bt, positions=positions, segment_ids=segment_ids,
                                 cache=cache)
    if every_position:
        return model.logits(x), cache
    last = jnp.take_along_axis(x, (lengths_b - 1)[:, None, None], axis=1)
    return model.logits(last)[:, 0], cache


def bank_prefill(model: nnx.Module, device_bank: DeviceBank, tokens: np.ndarray,
                 lengths: np.ndarray, max_len: int, mesh: jax.sharding.Mesh | None = None, *,
                 unread: np.ndarray | None = None, every_position: bool = False
                 ) -> tuple[jax.Array, tuple]:
    """Right-padded query prompts tokens [B,T] (true lengths [B]) routed over the bank and
    prefilled in one call: (logits [B,V] at each prompt's last token, or [B,T,V] at every
    position with every_position, and the cache with room for max_len query tokens;
    cache_documents reads what each routing layer chose). Positions from
    msa.resolved_query_offset; the prompt is one query segment whose last unread[b] tokens (default
    0) the router does not read (msa.py's convention: teacher-forced answers after the prompt
    score as in training). mesh: trace under it, so the bank's chunks are scored split over its
    devices (MemoryBank.to_device(mesh))."""
    graphdef, state = nnx.split(model)
    lengths = jnp.asarray(lengths, jnp.int32)
    unread = jnp.zeros_like(lengths) if unread is None else jnp.asarray(unread, jnp.int32)
    args = (graphdef, state, device_bank.arrays, jnp.asarray(tokens, jnp.int32), lengths, unread,
            int(max_len), device_bank.max_doc_chunks, bool(every_position))
    if mesh is None:
        return _bank_prefill(*args)
    with shd.activation_rules(mesh):
        return _bank_prefill(*args)


def cache_documents(model: nnx.Module, cache: tuple) -> dict[int, np.ndarray]:
    """{routing layer: [B,top_k] bank documents in memory, best first (-1 = none)} of a
    prefilled cache."""
    size = model.cfg.block_size
    out = {}
    for i in routing_layer_indices(model.cfg):
        c = cache[i // size][i % size]
        out[i] = np.asarray((c["mixer"] if "conv" in c else c)["docs"])
    return out


@dataclasses.dataclass(frozen=True)
class BankAnswer:
    result: GenerateResult
    documents: dict[int, np.ndarray]  # routing layer -> [B,top_k] bank documents, best first


def generate_from_bank(model: nnx.Module, device_bank: DeviceBank,
                       prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                       eos_id: int | None = None, pad_id: int = 0,
                       mesh: jax.sharding.Mesh | None = None,
                       vocab: int | None = None) -> BankAnswer:
    """Greedy answers to token prompts over the bank (bank_prefill, then the compiled decode loop
    of aiinfra_jax.generate); mesh: as bank_prefill's; vocab: as generate's (ids < vocab only,
    e.g. the tokenizer's vocab_size when the model's vocabulary is padded past it)."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("generate_from_bank: give at least one non-empty prompt")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate_from_bank: max_new_tokens={max_new_tokens!r} must be a "
                         "positive int")
    check_vocab(vocab, model.cfg.vocab_size, "generate_from_bank")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    tokens = np.full((len(prompts), int(lengths.max())), pad_id, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    cfg = model.cfg
    max_len = tokens.shape[1] + max_new_tokens
    if cfg.msa.resolved_query_offset + max_len > cfg.max_seq_len:
        raise ValueError(f"generate_from_bank: query offset {cfg.msa.resolved_query_offset} + "
                         f"prompt {tokens.shape[1]} + max_new_tokens {max_new_tokens} exceeds "
                         f"max_seq_len={cfg.max_seq_len}")
    logits, cache = bank_prefill(model, device_bank, tokens, lengths, max_len, mesh=mesh)
    documents = cache_documents(model, cache)
    graphdef, state = nnx.split(model)
    lengths_j = jnp.asarray(lengths)
    out, n_out, done = decode_loop(graphdef, state, cache, logits,
                                   lengths_j + cfg.msa.resolved_query_offset, max_new_tokens, 0.0,
                                   1.0, eos_id, int(pad_id), None,
                                   vocab=None if vocab is None else int(vocab))
    return BankAnswer(GenerateResult(tokens=out, lengths=n_out, finished=done,
                                     prompt_lengths=lengths_j), documents)


def read_documents(path: str | Path, tokenizer, *, field: str = "text",
                   bos: bool = True) -> tuple[list[np.ndarray], list[Any]]:
    """Documents of a local collection as token arrays with ids: a .jsonl file (one object per
    line, its `field` the text, "id" its id if present, else the line number), a text file (one
    document per paragraph: blank-line separated) or a folder of .txt files (one per file, id =
    file name). bos: prepend the tokenizer's BOS (as the synthetic MSA rows do)."""
    path = Path(path)
    items: list[tuple[Any, str]] = []
    if path.is_dir():
        items = [(f.name, f.read_text()) for f in sorted(path.glob("*.txt"))]
    elif path.suffix == ".jsonl":
        for n, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BankError(f"{path}:{n + 1}: not a JSON object ({e})") from e
            if field not in obj:
                raise BankError(f"{path}:{n + 1}: no field {field!r} (fields: {sorted(obj)}); "
                                "name the text field with --field")
            items.append((obj.get("id", n), obj[field]))
    elif path.is_file():
        paras = [p.strip() for p in path.read_text().split("\n\n")]
        items = [(n, p) for n, p in enumerate(paras) if p]
    else:
        raise BankError(f"documents {path}: no such file or folder")
    if not items:
        raise BankError(f"documents {path}: the collection is empty")
    pre = [tokenizer.bos_id] if bos else []
    docs = [np.asarray(pre + list(tokenizer.encode(text)), np.int32) for _, text in items]
    return docs, [i for i, _ in items]

