#!/usr/bin/env python3
"""Standalone runner of a `--format stablehlo` export: greedy generation with jax alone.

    python run_stablehlo.py DIR --prompt 1,2,3 --prompt 7,8 --max-new-tokens 16 [--platform cpu]
        [--eos-id N | --stop-at-eos]
    -> [[...generated ids of prompt 1...], [...of prompt 2...]]   (JSON on stdout)

    import run_stablehlo
    model = run_stablehlo.load("DIR")                 # platform: the default jax backend
    tokens = run_stablehlo.generate(model, [[1, 2, 3], [7, 8]], max_new_tokens=16)

Needs only jax (with its numpy and ml_dtypes) and flatbuffers, which jax.export.deserialize
uses: `pip install jax flatbuffers` (jax[cuda12] / jax[tpu] for the accelerators). It imports
neither the framework that wrote the export nor flax; an export directory copies this file as
run_stablehlo.py (its source: aiinfra_jax/stablehlo_runner.py).

What it reads (the layout: aiinfra_jax/export_stablehlo.py, and DIR/stablehlo.json):
  - DIR/stablehlo.json, the manifest: the artifact of each platform (prefill per prompt-length
    bucket or one with a symbolic length; one decode step), batch, cache length, vocab, token ids;
  - the weights, DIR/model.safetensors or the shards model.safetensors.index.json names (read
    here: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
    data_offsets}} with an optional "__metadata__", then the raw bytes);
  - the serialized jax.export artifacts (jax.export.deserialize).

Generation matches the framework's greedy decoding (aiinfra_jax.generate.generate with
temperature 0) token for token: prefill, argmax, then one decode step per token at positions
prompt length, +1, ...; a row stops after its eos (when given). A batch of a fixed size
(the manifest's batch) is filled with dummy rows or split; prompts are right-padded to the
smallest prompt-length bucket that holds them. Failures are one line `error: ...` (exit 1),
as StableHLOError from the Python API: no export in DIR, a platform that was not exported, a
prompt that does not fit the cache, a damaged file, a jax that cannot read the artifacts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = ["StableHLOError", "StableHLOModel", "generate", "load", "main",
           "read_safetensors_file", "read_weights"]

FORMAT = "aiinfra_jax.stablehlo"
VERSION = 1
MANIFEST = "stablehlo.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
           "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class StableHLOError(ValueError):
    """A directory, platform or request this runner cannot serve; the message names the problem
    and the fix."""


# ----------------------------------------------------------------------------- weights

def read_safetensors_file(path: Path, *, error: type[Exception] = StableHLOError,
                          fix: str = "export again") -> dict[str, np.ndarray]:
    """The tensors of one .safetensors file as read-only views of a memory map (lazy: nothing is
    read until used). A file that cannot be read raises `error`, its message ending in `fix`.
    (aiinfra_jax.export reads through this too, with its own error and fix: one reader.)"""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or 8 + n > size:
                raise ValueError("the header length is out of range")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise error(f"{path} is not a readable safetensors file ({e}); {fix}") from e
    header.pop("__metadata__", None)
    body = (np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n
            else np.zeros(0, np.uint8))
    out = {}
    for name, info in header.items():
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise error(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}; readable: "
                        f"{sorted(_DTYPES)}")
        shape = tuple(info["shape"])
        start, stop = info["data_offsets"]
        if stop > body.size or stop - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise error(f"{path}: tensor {name!r} lies outside the file or has the wrong size; "
                        f"the file is truncated or damaged: {fix}")
        out[name] = body[start:stop].view(dtype).reshape(shape)
    return out


def read_weights(directory: str | Path, *, error: type[Exception] = StableHLOError,
                 fix: str = "export the model again with --format stablehlo"
                 ) -> dict[str, np.ndarray]:
    """The tensors of DIR/model.safetensors, or of the shards model.safetensors.index.json
    names, as read-only memory-mapped numpy arrays (errors as read_safetensors_file)."""
    d = Path(directory)
    if (d / INDEX_FILE).exists():
        try:
            weight_map = json.loads((d / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise error(f"{d / INDEX_FILE} is not a safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
    elif (d / SINGLE_FILE).exists():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise error(f"{d} holds neither {SINGLE_FILE} nor {INDEX_FILE}: the weights are "
                    f"missing; {fix}")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        if not (d / file).exists():
            raise error(f"{d / file} is missing (named by {INDEX_FILE})")
        for name, array in read_safetensors_file(d / file, error=error, fix=fix).items():
            if name in tensors:  # never one shard's copy silently replacing another's
                raise error(f"{d}: tensor {name!r} is in two files (the second: {file}); {fix}")
            if weight_map is not None and weight_map.get(name, file) != file:
                raise error(f"{d / file} holds {name!r}, which {INDEX_FILE} places in "
                            f"{weight_map[name]}; {fix}")
            tensors[name] = array
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise error(f"{d}: tensors {missing[:5]} named by {INDEX_FILE} are in no file")
    return tensors


# ----------------------------------------------------------------------------- loading

def _backend_platform() -> str:
    """The export platform name of jax's default backend (cpu, cuda, rocm, tpu)."""
    backend = jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if ("rocm" in version or backend == "rocm") else "cuda"
    return backend


def _device(platform: str):
    name = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    try:
        return jax.devices(name)[0]
    except RuntimeError as e:
        raise StableHLOError(f"--platform {platform}: this jax has no {platform} device "
                             f"({str(e).splitlines()[0] if str(e) else e}); install jax for it "
                             f"or pick the platform of this machine ({_backend_platform()})") \
            from e


def _read_manifest(d: Path) -> dict[str, Any]:
    if not d.is_dir():
        raise StableHLOError(f"{d}: no such directory; pass the directory an export with "
                             "--format stablehlo wrote")
    path = d / MANIFEST
    if not path.exists():
        raise StableHLOError(f"{d} holds no {MANIFEST}: it is not a stablehlo export; export "
                             "it with python -m aiinfra_jax.export --format stablehlo")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StableHLOError(f"{path} is not readable JSON ({e}); export again") from e
    if manifest.get("format") != FORMAT:
        raise StableHLOError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise StableHLOError(f"{path}: version {manifest.get('version')!r}; this runner reads "
                             f"version {VERSION}: use the run_stablehlo.py of that export")
    return manifest


def _deserialize(path: Path, written_by: str):
    if not path.exists():
        raise StableHLOError(f"{path} is missing (named by {MANIFEST}); export again")
    try:
        return jax.export.deserialize(bytearray(path.read_bytes()))
    except ImportError as e:
        raise StableHLOError(f"reading {path.name} needs the flatbuffers package: pip install "
                             "flatbuffers") from e
    except Exception as e:  # noqa: BLE001 -- a damaged file or an incompatible jax
        raise StableHLOError(f"{path}: jax {jax.__version__} cannot read this artifact "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                             f"the export was written by jax {written_by}: use that version, or "
                             "export again with this one") from e


class StableHLOModel:
    """A loaded stablehlo export: its weights on the device, its jitted prefill and decode."""

    def __init__(self, directory: Path, manifest: dict[str, Any], platform: str):
        self.directory, self.manifest, self.platform = directory, manifest, platform
        self.vocab_size = int(manifest["vocab_size"])
        self.max_len = int(manifest["max_len"])
        tokens = manifest.get("tokens") or {}
        self.bos_id, self.eos_id = tokens.get("bos_id"), tokens.get("eos_id")
        self.pad_id = int(tokens.get("pad_id") or 0)
        entry = manifest["platforms"][platform]
        batch = entry["batch"]
        self.batch = batch if isinstance(batch, int) else None  # None: any batch
        self.device = _device(platform)

        weights = read_weights(directory)
        wanted = manifest["weights"]
        missing, extra = sorted(set(wanted) - set(weights)), sorted(set(weights) - set(wanted))
        if missing or extra:
            raise StableHLOError(f"{directory}: the weights do not match {MANIFEST} (missing "
                                 f"{missing[:5]}, unexpected {extra[:5]}); export again")
        for name, spec in wanted.items():
            a = weights[name]
            if list(a.shape) != spec["shape"] or np.dtype(a.dtype).name != spec["dtype"]:
                raise StableHLOError(f"{directory}: tensor {name!r} is {np.dtype(a.dtype).name}"
                                     f"{list(a.shape)}, {MANIFEST} says {spec['dtype']}"
                                     f"{spec['shape']}; export again")
        self.weights = {n: jax.device_put(np.asarray(a), self.device) for n, a in weights.items()}

        def first(out):  # greedy pick on the device; the logits come back too
            logits, cache = out
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, cache

        written_by = str(manifest.get("jax_version", "?"))
        self._prefill: list[tuple[int | None, Any]] = []  # (bucket or None = any length, fn)
        for item in entry["prefill"]:
            exp = _deserialize(directory / item["file"], written_by)
            length = item["prompt_len"] if isinstance(item["prompt_len"], int) else None
            self._prefill.append((length, jax.jit(lambda w, t, n, e=exp: first(e.call(w, t, n)))))
        self._prefill.sort(key=lambda item: float("inf") if item[0] is None else item[0])
        exp = _deserialize(directory / entry["decode"]["file"], written_by)
        self._decode = jax.jit(lambda w, c, t, p, e=exp: first(e.call(w, c, t, p)),
                               donate_argnums=(1,))

    # -------------------------------------------------------------------------- the functions

    def _bucket(self, length: int):
        for bucket, fn in self._prefill:
            if bucket is None or bucket >= length:
                return bucket or length, fn
        raise StableHLOError(f"prompts of {length} tokens are longer than the longest prefill "
                             f"bucket ({self._prefill[-1][0]}); shorten them or export with "
                             "longer prompt lengths")

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray):
        """Right-padded tokens [b,T] int32, lengths [b] -> (next tokens [b], logits [b,V],
        cache); b must be the export's batch when it is fixed. T is padded up to a bucket."""
        tokens = np.asarray(tokens, np.int32)
        bucket, fn = self._bucket(tokens.shape[1])
        if bucket > tokens.shape[1]:
            tokens = np.pad(tokens, ((0, 0), (0, bucket - tokens.shape[1])),
                            constant_values=self.pad_id)
        with jax.default_device(self.device):
            return fn(self.weights, tokens, np.asarray(lengths, np.int32))

    def decode(self, cache: Any, tokens: np.ndarray, positions: np.ndarray):
        """One step: tokens [b] at positions [b] -> (next tokens [b], logits [b,V], cache). The
        cache passed in is donated: use only the returned one."""
        with jax.default_device(self.device):
            return self._decode(self.weights, cache, np.asarray(tokens, np.int32),
                                np.asarray(positions, np.int32))

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 eos_id: int | None = None) -> list[list[int]]:
        """Greedy continuation of each prompt (a list of token ids): up to max_new_tokens ids per
        prompt, eos_id included when a row emits it."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise StableHLOError(f"max_new_tokens={max_new_tokens!r}: must be a positive int")
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise StableHLOError("every prompt needs at least one token (and at least one "
                                 "prompt)")
        for p in prompts:
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise StableHLOError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                     f"[0, {self.vocab_size})")
        if eos_id is not None and not 0 <= eos_id < self.vocab_size:
            raise StableHLOError(f"eos_id={eos_id} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_len:
            raise StableHLOError(f"a prompt of {longest} tokens + max_new_tokens "
                                 f"{max_new_tokens} = {longest + max_new_tokens} exceeds the "
                                 f"cache of {self.max_len} tokens the export was made with; "
                                 "shorten the prompt or max_new_tokens, or export with a longer "
                                 "max_len")
        self._bucket(longest)
        size = self.batch or len(prompts)
        out: list[list[int]] = []
        for start in range(0, len(prompts), size):
            out += self._generate_batch(prompts[start:start + size], size, max_new_tokens,
                                        eos_id)
        return out

    def _generate_batch(self, prompts, size, max_new, eos_id):
        rows = len(prompts)
        prompts = prompts + [[self.pad_id]] * (size - rows)  # dummy rows fill a fixed batch
        lengths = np.array([len(p) for p in prompts], np.int32)
        tokens = np.full((size, int(lengths.max())), self.pad_id, np.int32)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = p
        tok, _, cache = self.prefill(tokens, lengths)
        tok = np.asarray(tok)
        out = [[int(t)] for t in tok[:rows]]
        done = np.array([eos_id is not None and t == eos_id for t in tok[:rows]])
        positions = lengths.copy()
        for _ in range(1, max_new):
            if done.all():
                break
            tok, _, cache = self.decode(cache, tok, positions)
            tok = np.asarray(tok)
            positions = positions + 1
            for b in range(rows):
                if not done[b]:
                    out[b].append(int(tok[b]))
                    done[b] = eos_id is not None and tok[b] == eos_id
        return out


def load(directory: str | Path, platform: str | None = None) -> StableHLOModel:
    """The export in `directory` for `platform` (cpu, cuda, tpu; None = jax's default
    backend), its weights on that platform's first device."""
    d = Path(directory).expanduser()
    manifest = _read_manifest(d)
    exported = sorted(manifest.get("platforms") or {})
    platform = platform or _backend_platform()
    if platform not in exported:
        raise StableHLOError(f"platform {platform!r} was not exported (this export has "
                             f"{', '.join(exported) or 'none'}); pass --platform with one of "
                             "them, or export again for it")
    return StableHLOModel(d, manifest, platform)


def generate(model: StableHLOModel | str | Path, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, eos_id: int | None = None,
             platform: str | None = None) -> list[list[int]]:
    """Greedy generation (see StableHLOModel.generate) with a loaded model or a directory."""
    if not isinstance(model, StableHLOModel):
        model = load(model, platform)
    return model.generate(prompts, max_new_tokens=max_new_tokens, eos_id=eos_id)


# ----------------------------------------------------------------------------- command line

def _prompt(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token "
                                         "ids") from e
    if not ids:
        raise argparse.ArgumentTypeError("an empty prompt")
    return ids


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", help="the directory a --format stablehlo export wrote")
    ap.add_argument("--prompt", type=_prompt, action="append", required=True,
                    help="token ids, comma-separated (repeat for a batch)")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--platform", default=None,
                    help="cpu, cuda or tpu (default: jax's default backend)")
    stop = ap.add_mutually_exclusive_group()
    stop.add_argument("--eos-id", type=int, default=None, help="stop a row after this id")
    stop.add_argument("--stop-at-eos", action="store_true",
                      help="stop a row after the export's eos id (stablehlo.json)")
    args = ap.parse_args(argv)
    try:
        model = load(args.directory, args.platform)
        eos = model.eos_id if args.stop_at_eos else args.eos_id
        out = model.generate(args.prompt, max_new_tokens=args.max_new_tokens, eos_id=eos)
    except StableHLOError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
