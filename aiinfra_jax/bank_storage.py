"""A memory bank on disk (aiinfra_jax/memory_bank.py encodes documents into it and answers queries
over it): the files, the commit rule, the check that a bank belongs to a model, and the bank's
arrays on the device.

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

import collections
import dataclasses
import functools
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.checksums import crc32, json_crc32
from aiinfra_jax.checkpoint import config_differences
from aiinfra_jax.config import runtime_keys, to_dict
from aiinfra_jax.models.attention.msa import routing_layer_indices
from aiinfra_jax.models.attention.msa_routing import HostRows, bank_chunk_padding, unit_keys
from aiinfra_jax.models.config import ModelConfig

log = logging.getLogger(__name__)


@functools.partial(jax.jit, static_argnums=1)
def _unit_keys(route_k: jax.Array, rows: int) -> jax.Array:
    """MemoryBank.to_device's routing keys: zero-padded to `rows`, normalised once."""
    return unit_keys(jnp.pad(route_k, ((0, rows - route_k.shape[0]), (0, 0), (0, 0))))


FORMAT = "aiinfra-msa-bank/1"
ARRAYS = ("route_k", "k", "v")  # per routing layer, float32 [Cb, K, Dh] / [Ckv, K, Dh] / same


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


@dataclasses.dataclass
class Encoded:
    """Documents encoded by `encode_documents`: per routing layer {name: float32 route_k
    [Cb,K,Dh], k, v [Ckv,K,Dh]}, routing chunks, key/value chunks and tokens per document."""

    layers: dict[int, dict[str, np.ndarray]]
    doc_chunks: np.ndarray  # [N] int32, routing chunks
    doc_kv_chunks: np.ndarray  # [N] int32, key/value chunks
    doc_length: np.ndarray  # [N] int32



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
        return [json.loads(line)["id"] for line in self._doc_lines()]

    def _doc_lines(self) -> list[str]:
        """The committed documents' lines of docs.jsonl (refused when it holds fewer)."""
        lines = (self.path / "docs.jsonl").read_text().splitlines()[:self.n_docs]
        if len(lines) < self.n_docs:
            raise BankError(f"memory bank {self.path}: docs.jsonl names {len(lines)} documents, "
                            f"the manifest commits {self.n_docs}; the bank is damaged (its ids "
                            "would name the wrong documents): rebuild it")
        return lines

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
        lines = []  # (checked before anything is written: a bad id leaves the bank as it was)
        for i, n in zip(ids, encoded.doc_length):
            try:
                lines.append(json.dumps({"id": i, "tokens": int(n)}))
            except TypeError as e:
                raise BankError(f"append: id {i!r} ({type(i).__name__}) is not JSON-able; pass "
                                "str or int ids") from e
        keys = [json.dumps(json.loads(line)["id"]) for line in lines]  # as they will read back
        kept = self._doc_lines()  # (read once: the check here, the rewrite below)
        seen = {json.dumps(json.loads(line)["id"]) for line in kept}
        again = sorted({k for k in keys if k in seen}
                       | {k for k, c in collections.Counter(keys).items() if c > 1})
        if again:
            raise BankError(f"append: ids {again[:5]} are already in the bank or given twice; "
                            "a document appended twice would be routed to twice (to go on after "
                            "an interrupted build, append only the documents not yet in it)")
        if sorted(encoded.layers) != sorted(m["layers"]):
            raise BankError(f"append: encoded layers {sorted(encoded.layers)}, the bank stores "
                            f"{m['layers']}")
        rows = {"route_k": int(encoded.doc_chunks.sum()), "k": int(encoded.doc_kv_chunks.sum())}
        rows["v"] = rows["k"]
        for i in m["layers"]:
            for name in ARRAYS:
                want = (rows[name], m["kv_heads"], m["head_dim"])
                got = tuple(np.shape(encoded.layers[i][name]))
                if got != want:
                    raise BankError(
                        f"append: layer {i} {name} is {list(got)}, the bank stores [rows, "
                        f"{m['kv_heads']}, {m['head_dim']}] and these documents' chunks make "
                        f"{rows[name]} rows: encode them with the bank's model "
                        "(MemoryBank.open(path, model) checks it)")
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
        tmp = jl.with_suffix(".jsonl.tmp")  # replaced whole: a crash keeps the old file
        tmp.write_text("".join(line + "\n" for line in kept + lines))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, jl)
        self.manifest = dict(m, n_docs=m["n_docs"] + n_new,
                             n_chunks=m["n_chunks"] + int(encoded.doc_chunks.sum()),
                             n_kv_chunks=self.n_kv_chunks + int(encoded.doc_kv_chunks.sum()),
                             n_tokens=m["n_tokens"] + int(encoded.doc_length.sum()),
                             longest_doc=max(m["longest_doc"], longest), appending=False)
        _write_manifest(self.path, self.manifest)

    def to_device(self, mesh: jax.sharding.Mesh | None = None, *,
                  kv_on_host: bool = False) -> DeviceBank:
        """The bank on the device (DeviceBank: arrays {"layers": {i: {route_k [Cp,K,Dh] (unit
        length per head: msa_routing.unit_keys, as routing scores them), k, v [Ckv',K,Dh]}},
        "chunk_doc" [Cp], "kv_start", "kv_chunks" [N]} and max_doc_chunks). The
        routing chunks are padded to the scoring tile (msa_routing.bank_chunk_padding; the padding
        belongs to document N: never scored), the key/value chunks to a multiple of the devices
        (never gathered). With a mesh the chunk arrays are split over its axes > 1, so that each
        device scores its own share (msa_routing.bank_document_scores); query under that mesh
        (bank_prefill's mesh). kv_on_host: k and v stay in their memory-mapped files
        (msa_routing.HostRows: a query reads only its chosen documents' rows, through a host
        callback), so the device holds the routing keys alone, about a fifth of the bank with
        the preset's chunks; the files must not be rewritten while the DeviceBank is used."""
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

        def load(i, name):
            rows = self.array(f"layer_{i}.{name}")  # memory-mapped: one copy to the device
            if name == "route_k":  # normalised once here, not by every query's scoring
                if devices > 1:  # the split needs the padded length; else padded on the device
                    rows = np.pad(rows, ((0, padded - total), (0, 0), (0, 0)))
                return _unit_keys(put(rows), padded)
            if kv_on_host:
                return HostRows(rows)
            if kv_padded > kv_total:
                rows = np.pad(rows, ((0, kv_padded - kv_total), (0, 0), (0, 0)))
            return put(rows)

        layers = {i: {name: load(i, name) for name in ARRAYS} for i in self.layers}
        start = np.concatenate([[0], np.cumsum(kv_chunks)[:-1]]).astype(np.int32)
        return DeviceBank({"layers": layers, "chunk_doc": put(chunk_doc),
                           "kv_start": jnp.asarray(start), "kv_chunks": jnp.asarray(kv_chunks)},
                          self.max_doc_chunks)
