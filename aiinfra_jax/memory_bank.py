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

On disk (a folder):
  manifest.json           format, the model (its architecture config and a fingerprint of its
                          parameters), chunk and kv_chunk, routing layers, kv heads, head dim,
                          dtype, the committed counts (documents, routing chunks, key/value
                          chunks, tokens), the longest document and the configured limit, and
                          "appending" while an append is under way.
  doc_chunks.bin          int32 [N]: routing chunks of each document
  doc_length.bin          int32 [N]: tokens of each document (its key/value chunks follow)
  layer_<i>.<name>.bin    float32 per routing layer i: route_k [Cb, K, Dh], k and v [Ckv, K, Dh]
                          (Ckv = Cb when kv_chunk = chunk, the default; a bank written before
                          kv_chunk existed has neither field and reads as kv_chunk = chunk)
  docs.jsonl              one line per document: {"id": the caller's name for it, "tokens": n}
Why raw memory-mapped files (numpy.memmap) rather than tensorstore: a bank is a few append-only
arrays, read whole (routing keys) or gathered by row (keys and values of chosen documents) on one
host; raw files give zero-copy reads, appends by extending the file, and no dependency, where
tensorstore's chunked, compressed or remote storage pays off only for multi-host banks (not built).

Commit rule: the manifest is the only commit point. An append first marks the manifest
"appending", then cuts every file back to its committed size (dropping whatever an interrupted
append left), writes the new rows, flushes them, and finally replaces the manifest (written to a
temporary file and renamed) with the new counts. A reader sees the committed rows only; a bank
whose manifest says "appending" opens with its committed rows and a warning, and the next append
repairs it. A file shorter than its committed size is a damaged bank: opening it fails, naming the
file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax import sharding as shd
from aiinfra_jax.checksums import crc32, json_crc32
from aiinfra_jax.checkpoint import config_differences
from aiinfra_jax.config import runtime_keys, to_dict
from aiinfra_jax.generate import GenerateResult, decode_loop, inference_model
from aiinfra_jax.models.attention.msa import routing_layer_indices
from aiinfra_jax.models.attention.msa_routing import bank_chunk_padding
from aiinfra_jax.models.config import ModelConfig

log = logging.getLogger(__name__)

FORMAT = "aiinfra-msa-bank/1"
ARRAYS = ("route_k", "k", "v")  # per routing layer, float32 [Cb, K, Dh] / [Ckv, K, Dh] / same
_RECORDED = {"route_k": "pooled_route_k", "k": "pooled_k", "v": "pooled_v"}


class BankError(ValueError):
    """A bank that cannot be used as asked (another model, damaged files, bad documents)."""


# The model a bank belongs to ----------------------------------------------------------------------

def model_signature(model: nnx.Module) -> dict[str, Any]:
    """{"config": the model's architecture (ModelConfig without run-time fields), "params": a
    CRC32 over every parameter}: a bank answers only for the model that encoded it."""
    cfg = model.cfg
    skip = runtime_keys(ModelConfig)
    config = {k: v for k, v in to_dict(cfg).items() if k not in skip}
    for key in skip:  # nested run-time fields (msa.implementation, ...)
        head, _, tail = key.partition(".")
        if tail and isinstance(config.get(head), dict):
            config[head] = {k: v for k, v in config[head].items() if k != tail}
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    leaves = jax.tree_util.tree_leaves_with_path(params)
    sums = {jax.tree_util.keystr(path): crc32(np.asarray(leaf)) for path, leaf in leaves}
    return {"config": json.loads(json.dumps(config)), "params": json_crc32(sums)}


def _check_model(manifest: dict, model: nnx.Module, path: Path) -> None:
    sig = model_signature(model)
    saved = manifest["model"]
    diffs = config_differences({"model": saved["config"]}, {"model": sig["config"]}, ("model",))
    if diffs:
        raise BankError(f"memory bank {path} was encoded by a model with another configuration "
                        f"({'; '.join(diffs[:5])}); rebuild it with this model "
                        "(python -m aiinfra_jax.eval.memory build ...)")
    if saved["params"] != sig["params"]:
        raise BankError(f"memory bank {path} was encoded by the same architecture with other "
                        f"parameters (fingerprint {saved['params']}, this model "
                        f"{sig['params']}): another checkpoint or step; rebuild the bank with "
                        "this checkpoint")


# Encoding -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Encoded:
    """Documents encoded by `encode_documents`: per routing layer {name: float32 route_k
    [Cb,K,Dh], k, v [Ckv,K,Dh]}, routing chunks, key/value chunks and tokens per document."""

    layers: dict[int, dict[str, np.ndarray]]
    doc_chunks: np.ndarray  # [N] int32, routing chunks
    doc_kv_chunks: np.ndarray  # [N] int32, key/value chunks
    doc_length: np.ndarray  # [N] int32


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


@functools.partial(jax.jit, static_argnums=(0, 5))
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
    chunk, kv_chunk, max_docs = cfg.msa.chunk, cfg.msa.resolved_kv_chunk, cfg.msa.max_documents
    per_name = {"route_k": chunk, "k": kv_chunk, "v": kv_chunk}
    layers = routing_layer_indices(cfg)
    rows = _pack(lengths, row_len, max_docs)
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
                base = np.cumsum([0] + [-(-lengths[j] // per_name[name]) for j in row])
                for i in layers:
                    arr = pooled[i][name][b]
                    out[i][name].extend(arr[base[s]:base[s + 1]] for s in range(len(row)))
            done += len(row)
            tokens_done += sum(lengths[j] for j in row)
        bar.update(done, tokens_done)
    return Encoded(
        layers={i: {n: np.concatenate(v).astype(np.float32) for n, v in d.items()}
                for i, d in out.items()},
        doc_chunks=np.asarray([-(-n // chunk) for n in lengths], np.int32),
        doc_kv_chunks=np.asarray([-(-n // kv_chunk) for n in lengths], np.int32),
        doc_length=np.asarray(lengths, np.int32))


# Storage --------------------------------------------------------------------------------------------

def _write_manifest(path: Path, manifest: dict) -> None:
    tmp = path / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path / "manifest.json")


@dataclasses.dataclass(frozen=True)
class DeviceBank:
    """A bank on the device (MemoryBank.to_device): the arrays a routing prefill reads (a pytree
    for jit) and the longest document in key/value chunks (static: it sizes the memory slots)."""

    arrays: dict[str, Any]
    max_doc_chunks: int


class MemoryBank:
    """A bank on disk (module docstring); `open` / `create`, `append`, `array`, `to_device`."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = path, manifest

    # What the manifest says.
    @property
    def n_docs(self) -> int:
        return self.manifest["n_docs"]

    @property
    def n_chunks(self) -> int:
        return self.manifest["n_chunks"]

    @property
    def n_tokens(self) -> int:
        return self.manifest["n_tokens"]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.manifest["layers"])

    @property
    def kv_chunk(self) -> int:
        """Tokens per key/value chunk (banks written before kv_chunk existed: the chunk)."""
        return self.manifest.get("kv_chunk", self.manifest["chunk"])

    @property
    def n_kv_chunks(self) -> int:
        return self.manifest.get("n_kv_chunks", self.manifest["n_chunks"])

    @property
    def max_doc_chunks(self) -> int:
        """The longest document in key/value chunks (the memory slots one document takes)."""
        return -(-self.manifest["longest_doc"] // self.kv_chunk)

    def _files(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """{file name: (committed shape, dtype)}."""
        m = self.manifest
        n, row = m["n_docs"], (m["kv_heads"], m["head_dim"])
        rows = {"route_k": m["n_chunks"], "k": self.n_kv_chunks, "v": self.n_kv_chunks}
        files = {"doc_chunks.bin": ((n,), np.dtype(np.int32)),
                 "doc_length.bin": ((n,), np.dtype(np.int32))}
        for i in m["layers"]:
            for name in ARRAYS:
                files[f"layer_{i}.{name}.bin"] = ((rows[name],) + row, np.dtype(np.float32))
        return files

    @classmethod
    def create(cls, path: str | Path, model: nnx.Module, *, max_doc_length: int,
               overwrite: bool = False) -> "MemoryBank":
        """An empty bank for `model` at path (refused if a bank is there, unless overwrite)."""
        path = Path(path)
        if (path / "manifest.json").exists() and not overwrite:
            raise BankError(f"{path} already holds a memory bank; append to it, or pass "
                            "overwrite=True (--overwrite) to replace it")
        if path.exists() and not (path / "manifest.json").exists() and any(path.iterdir()):
            raise BankError(f"{path} exists and is not a memory bank (no manifest.json); give "
                            "an empty or new folder")
        cfg = model.cfg
        layers = routing_layer_indices(cfg)
        if not layers:
            raise BankError(f"the model has no routing MSA layer (mixers={cfg.mixers}, "
                            f"msa.routing_layers={cfg.msa.routing_layers}); a bank stores "
                            "routing layers' chunks")
        path.mkdir(parents=True, exist_ok=True)
        manifest = {"format": FORMAT, "model": model_signature(model), "layers": list(layers),
                    "chunk": cfg.msa.chunk, "kv_chunk": cfg.msa.resolved_kv_chunk,
                    "kv_heads": cfg.n_kv_heads, "head_dim": cfg.resolved_head_dim,
                    "dtype": "float32", "n_docs": 0, "n_chunks": 0, "n_kv_chunks": 0,
                    "n_tokens": 0, "longest_doc": 0,
                    "max_doc_length": int(max_doc_length), "appending": False}
        bank = cls(path, manifest)
        for name in bank._files():
            (path / name).write_bytes(b"")
        (path / "docs.jsonl").write_bytes(b"")
        _write_manifest(path, manifest)
        return bank

    @classmethod
    def open(cls, path: str | Path, model: nnx.Module | None = None) -> "MemoryBank":
        """The bank at path; with `model`, refused unless that model encoded it."""
        path = Path(path)
        mfile = path / "manifest.json"
        if not mfile.is_file():
            raise BankError(f"{path} is not a memory bank (no manifest.json); build one with "
                            "python -m aiinfra_jax.eval.memory build")
        try:
            manifest = json.loads(mfile.read_text())
        except json.JSONDecodeError as e:
            raise BankError(f"{mfile} is not valid JSON ({e}); the bank is damaged: rebuild "
                            "it") from e
        if manifest.get("format") != FORMAT:
            raise BankError(f"{path}: bank format {manifest.get('format')!r}, this code reads "
                            f"{FORMAT!r}; rebuild the bank")
        bank = cls(path, manifest)
        for name, (shape, dtype) in bank._files().items():
            f = path / name
            need = int(np.prod(shape)) * dtype.itemsize
            have = f.stat().st_size if f.is_file() else -1
            if have < need:
                raise BankError(f"memory bank {path}: {name} has {max(have, 0)} bytes, the "
                                f"manifest commits {need} ({'missing' if have < 0 else 'truncated'}"
                                " file); the bank is damaged: rebuild it")
        if manifest.get("appending"):
            log.warning("memory bank %s: an append was interrupted; reading its %d committed "
                        "documents (the next append discards the partial rows)", path,
                        manifest["n_docs"])
        if model is not None:
            _check_model(manifest, model, path)
        return bank

    def array(self, name: str) -> np.ndarray:
        """A committed array, memory-mapped read-only (no copy): "doc_chunks", "doc_length", or
        "layer_<i>.<route_k|k|v>"."""
        shape, dtype = self._files()[name + ".bin"]
        if 0 in shape:
            return np.zeros(shape, dtype)
        return np.memmap(self.path / (name + ".bin"), dtype=dtype, mode="r", shape=shape)

    def doc_ids(self) -> list[Any]:
        """The caller's id of every committed document, in bank order."""
        lines = (self.path / "docs.jsonl").read_text().splitlines()[:self.n_docs]
        return [json.loads(line)["id"] for line in lines]

    def append(self, encoded: Encoded, ids: Sequence[Any] | None = None,
               model: nnx.Module | None = None) -> None:
        """Adds encoded documents (module docstring, "Commit rule"); ids: one JSON-able name per
        document (None = their bank indices)."""
        if model is not None:
            _check_model(self.manifest, model, self.path)
        m = self.manifest
        n_new = len(encoded.doc_length)
        ids = list(range(m["n_docs"], m["n_docs"] + n_new)) if ids is None else list(ids)
        if len(ids) != n_new:
            raise BankError(f"append: {len(ids)} ids for {n_new} documents")
        if sorted(encoded.layers) != sorted(m["layers"]):
            raise BankError(f"append: encoded layers {sorted(encoded.layers)}, the bank stores "
                            f"{m['layers']}")
        longest = int(encoded.doc_length.max())
        if longest > m["max_doc_length"]:
            raise BankError(f"append: a document has {longest} tokens, more than the bank's "
                            f"max_doc_length={m['max_doc_length']}")
        committed = {name: int(np.prod(shape)) * dtype.itemsize
                     for name, (shape, dtype) in self._files().items()}
        _write_manifest(self.path, dict(m, appending=True))
        new = {"doc_chunks.bin": encoded.doc_chunks, "doc_length.bin": encoded.doc_length}
        for i in m["layers"]:
            for name in ARRAYS:
                new[f"layer_{i}.{name}.bin"] = encoded.layers[i][name]
        for name, size in committed.items():
            with open(self.path / name, "r+b") as f:
                f.truncate(size)
                f.seek(size)
                f.write(np.ascontiguousarray(new[name], self._files()[name][1]).tobytes())
                f.flush()
                os.fsync(f.fileno())
        jl = self.path / "docs.jsonl"
        kept = jl.read_text().splitlines()[:m["n_docs"]]
        lines = [json.dumps({"id": i, "tokens": int(n)}) for i, n in zip(ids, encoded.doc_length)]
        jl.write_text("".join(line + "\n" for line in kept + lines))
        self.manifest = dict(m, n_docs=m["n_docs"] + n_new,
                             n_chunks=m["n_chunks"] + int(encoded.doc_chunks.sum()),
                             n_kv_chunks=self.n_kv_chunks + int(encoded.doc_kv_chunks.sum()),
                             n_tokens=m["n_tokens"] + int(encoded.doc_length.sum()),
                             longest_doc=max(m["longest_doc"], longest), appending=False)
        _write_manifest(self.path, self.manifest)

    def to_device(self, mesh: jax.sharding.Mesh | None = None) -> DeviceBank:
        """The bank on the device (DeviceBank: arrays {"layers": {i: {route_k [Cp,K,Dh], k, v
        [Ckv',K,Dh]}}, "chunk_doc" [Cp], "kv_start", "kv_chunks" [N]} and max_doc_chunks). The
        routing chunks are padded to the scoring tile (msa_routing.bank_chunk_padding; the padding
        belongs to document N: never scored), the key/value chunks to a multiple of the devices
        (never gathered). With a mesh the chunk arrays are split over its axes > 1, so that each
        device scores its own share (msa_routing.bank_document_scores); query under that mesh
        (bank_prefill's mesh)."""
        if self.n_docs == 0:
            raise BankError(f"memory bank {self.path} is empty; append documents first")
        axes, devices = (), 1
        if mesh is not None:
            axes = tuple(a for a, n in mesh.shape.items() if n > 1)
            devices = int(np.prod([mesh.shape[a] for a in axes]))
        doc_chunks = np.asarray(self.array("doc_chunks"))
        total = self.n_chunks
        padded = bank_chunk_padding(total, devices)
        chunk_doc = np.full(padded, self.n_docs, np.int32)
        chunk_doc[:total] = np.repeat(np.arange(self.n_docs, dtype=np.int32), doc_chunks)
        kv_chunks = -(-np.asarray(self.array("doc_length")) // self.kv_chunk).astype(np.int32)
        kv_total = self.n_kv_chunks
        kv_padded = -(-kv_total // devices) * devices

        def put(a):
            if devices == 1:
                return jnp.asarray(a)
            spec = jax.sharding.PartitionSpec(axes, *([None] * (a.ndim - 1)))
            return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

        pad = {"route_k": padded - total, "k": kv_padded - kv_total, "v": kv_padded - kv_total}
        layers = {i: {name: put(np.pad(self.array(f"layer_{i}.{name}"),
                                       ((0, pad[name]), (0, 0), (0, 0))))
                      for name in ARRAYS} for i in self.layers}
        start = np.concatenate([[0], np.cumsum(kv_chunks)[:-1]]).astype(np.int32)
        return DeviceBank({"layers": layers, "chunk_doc": put(chunk_doc),
                           "kv_start": jnp.asarray(start), "kv_chunks": jnp.asarray(kv_chunks)},
                          self.max_doc_chunks)


def build_bank(model: nnx.Module, docs: Sequence[np.ndarray], out: str | Path, *,
               ids: Sequence[Any] | None = None, append: bool = False, overwrite: bool = False,
               max_doc_length: int = 1024, row_len: int | None = None, batch_rows: int = 8,
               batch_docs: int = 4096, progress: bool = False) -> MemoryBank:
    """Encodes docs and writes them to the bank at out (a new bank, or `append` to one), committed
    every batch_docs documents (an interruption keeps every committed batch)."""
    if not docs:
        raise BankError("build_bank: the collection is empty; give at least one document")
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
        batch, kv, slots, dh = inner["k"].shape
        grown = dict(inner)
        for key in ("k", "v"):
            grown[key] = jnp.concatenate([jnp.zeros((batch, kv, m, dh), inner[key].dtype),
                                          inner[key]], axis=2)
        grown["mem"] = jnp.zeros((batch, m), jnp.bool_)
        grown["bank"] = dict(shared, **arrays["layers"][i])
        return dict(layer_cache, mixer=grown) if "conv" in layer_cache else grown

    routes = set(arrays["layers"])
    return tuple(tuple(with_memory(c, r * size + p) if r * size + p in routes else c
                       for p, c in enumerate(block)) for r, block in enumerate(cache))


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8))
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
                       mesh: jax.sharding.Mesh | None = None) -> BankAnswer:
    """Greedy answers to token prompts over the bank (bank_prefill, then the compiled decode loop
    of aiinfra_jax.generate); mesh: as bank_prefill's."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("generate_from_bank: give at least one non-empty prompt")
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
                                   1.0, eos_id, int(pad_id), None)
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

