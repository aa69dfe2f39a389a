"""Export a trained model to files other tools read, and load our own export back.

    python -m aiinfra_jax.export --checkpoint runs/tiny [--step N] --format safetensors --out DIR
        [--max-shard-size 5GB] [--force] [--set model.dense.implementation=xla] [--debug]
    python -m aiinfra_jax.export --checkpoint runs/tiny --format hf --out DIR
    python -m aiinfra_jax.export --checkpoint runs/nsa_tiny --format stablehlo --out DIR
        [--platforms cpu,cuda,tpu] [--max-len N] [--batch-size 8] [--prompt-lengths 16,64,...]
    python -m aiinfra_jax.export --checkpoint runs/tiny --format onnx --out DIR

Formats:
  safetensors  every model: its parameters (and non-parameter state, e.g. a routing bias) as
               named tensors in our own shapes, config.json (the run's resolved config, the file a
               run directory holds), export.json (what was exported: source, step, files, tensors,
               bytes, tokenizer) and the tokenizer. `load_safetensors(DIR)` builds the model back
               with identical logits.
  hf           models a Hugging Face Llama expresses (mixers all "dense", FFNs "swiglu", residual
               "standard", no short convolution): config.json, model.safetensors, tokenizer.json
               and tokenizer_config.json that `transformers.AutoModelForCausalLM` and
               `AutoTokenizer` load (the layout and the mapping: aiinfra_jax/hf.py). Any other
               model is refused, naming the parts Llama cannot express.
  stablehlo    every model with a decoding cache (NSA, Gated DeltaNet / KDA, dense; not MSA,
               whose decoding reads a memory bank):
               the safetensors files, config.json and tokenizer as above, plus jax.export
               artifacts of the prefill and the decode step per platform (cpu, cuda, tpu; the
               accelerators' with their Pallas kernels), stablehlo.json (signature, shapes, cache
               layout) and run_stablehlo.py, which generates with jax alone:
               python DIR/run_stablehlo.py DIR --prompt 1,2,3 --max-new-tokens 16
               (aiinfra_jax/export_stablehlo.py: what is symbolic, what is fixed, and why).
  onnx         dense models (the ones hf takes): model.onnx (+ model.onnx.data above 1 MB) of the
               forward tokens [batch, seq] -> logits [batch, seq, V] through jax2onnx, checked in
               onnxruntime against the JAX model before it is kept, plus config.json and the
               tokenizer (aiinfra_jax/export_onnx.py; needs the onnx extra).

Files. The tensors go to model.safetensors; above --max-shard-size (default 5GB) they are split,
as Hugging Face does, into model-00001-of-0000N.safetensors, ... with model.safetensors.index.json
({"metadata": {"total_size": bytes}, "weight_map": {name: file}}); a tensor is never split.

Naming scheme (format safetensors, `model_tensors`): one tensor per parameter per layer, in the
shape our module holds it (no transposes), named by its attribute path joined with ".":

    embed.table                        [V,D]
    layers.<i>.<path below the layer>  layers.0.mixer_norm.scale [D], layers.0.mixer.wq [D,H,Dh],
                                       layers.0.mixer.wo [H,Dh,D], layers.0.ffn.w_gate [D,F], ...
                                       (whatever the layer's mixer / FFN / residual scheme holds)
    final_norm.scale                   [D]
    head.kernel                        [D,V]  (absent with tie_embeddings)
    <other model-level modules>        e.g. residual_final.* (Attention Residuals)

Layer i is the model's layer i = r * P + p (block repeat r, position p in the block of P layers):
the leading "layers" axis of scan_layers=True parameters is unstacked, and a scan_layers=False
model gives the same names. Non-parameter state follows the same scheme (export.json lists those
names). Dtypes are the parameters' own (float32 or bfloat16).

Tokenizer. "byte" stays "byte" in config.json, and a tokenizer.json equal to it
(aiinfra_jax.hf.byte_tokenizer_json) is written beside for other tools; a tokenizer file (an HF
tokenizer.json or a tiktoken BPE file) is copied into DIR and config.json names it relative to
DIR (load_safetensors resolves it).

The output directory must not exist or must be empty; --force replaces an earlier export (a
directory holding export.json) and never deletes any other directory. Everything is written to a
temporary folder beside DIR and renamed into place at the end, so a failed export leaves nothing
half-written. Failures (no checkpoint, a damaged or incompatible one, a model Llama cannot express,
an existing directory) are one `error: ...` line (aiinfra_jax.errors; --debug adds the traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from aiinfra_jax import hf
from aiinfra_jax import sharding as shd
from aiinfra_jax.checkpoint import Checkpointer
from aiinfra_jax.config import ConfigError, from_dict, to_dict
from aiinfra_jax.data.tokenizer import load_tokenizer
from aiinfra_jax.errors import add_debug_flag, quiet_library_tracebacks, report_error
from aiinfra_jax.hf import ExportError
from aiinfra_jax.load import LoadedModel, _resolve, checkpoint_source, load_model
# The safetensors reader lives in the standalone runner (it may import nothing of ours).
from aiinfra_jax.stablehlo_runner import read_weights
from aiinfra_jax.models.config import ModelConfig
from aiinfra_jax.steps import abstract_model, init_variables, merge_model

__all__ = ["ExportError", "FORMATS", "export", "load_safetensors", "main", "model_tensors",
           "read_safetensors", "tensor_shapes", "tree_from_tensors", "write_safetensors"]

FORMATS = ("safetensors", "hf", "stablehlo", "onnx")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST = "export.json"
DEFAULT_MAX_SHARD = "5GB"

Say = Callable[[str], None]


# ----------------------------------------------------------------------------- the naming scheme

def path_keys(path: tuple) -> list[str]:
    out = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return out


def export_names(keys: list[str], cfg: ModelConfig) -> list[tuple[str, int | None]]:
    """The exported names of the leaf at `keys` of a params (or state) tree: [(name, r)], r the
    index into a leading "layers" axis (scan_layers) or None for a leaf stored as it is."""
    if keys[0] != "blocks":
        return [(".".join(keys), None)]
    size = cfg.block_size
    if cfg.scan_layers:  # blocks/layers/<p>/<path>, stacked over the R repeats
        if keys[1] != "layers":
            raise ExportError(f"unexpected parameter path {'/'.join(keys)}")
        p, rest = int(keys[2]), ".".join(keys[3:])
        return [(f"layers.{r * size + p}.{rest}", r) for r in range(cfg.n_repeats)]
    if keys[2] != "layers":  # blocks/<r>/layers/<p>/<path>
        raise ExportError(f"unexpected parameter path {'/'.join(keys)}")
    r, p, rest = int(keys[1]), int(keys[3]), ".".join(keys[4:])
    return [(f"layers.{r * size + p}.{rest}", None)]


def tree_tensors(tree: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        array = np.asarray(jax.device_get(leaf))
        for name, r in export_names(path_keys(path), cfg):
            out[name] = array if r is None else array[r]
    return out


def model_tensors(model) -> tuple[dict[str, np.ndarray], list[str]]:
    """(named host tensors of a model by the naming scheme, the names that are non-parameter
    state), in natural order (embed, layers.0..., final_norm, head)."""
    params, state = init_variables(model)
    tensors = tree_tensors(params, model.cfg)
    extra = tree_tensors(state, model.cfg)
    clash = sorted(set(tensors) & set(extra))
    if clash:
        raise ExportError(f"parameter and state names collide: {clash[:5]}")
    tensors.update(extra)
    ordered = {k: tensors[k] for k in sorted(tensors, key=natural_order)}
    return ordered, sorted(extra, key=natural_order)


def tensor_shapes(cfg: ModelConfig, seed: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
    """The names, shapes and dtypes an export of a model of `cfg` holds (nothing allocated)."""
    _, params, rest = abstract_model(cfg, seed)
    out = {}
    for tree in (nnx.to_pure_dict(params), nnx.to_pure_dict(rest)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            for name, r in export_names(path_keys(path), cfg):
                shape = leaf.shape if r is None else leaf.shape[1:]
                out[name] = jax.ShapeDtypeStruct(shape, leaf.dtype)
    return {k: out[k] for k in sorted(out, key=natural_order)}


def tree_from_tensors(abstract: Any, tensors: Mapping[str, np.ndarray], cfg: ModelConfig,
                       where: str, used: set[str]) -> Any:
    """The inverse of tree_tensors: arrays for the leaves of `abstract` (ShapeDtypeStructs),
    each checked for shape and dtype."""

    def build(path, leaf):
        parts = []
        for name, r in export_names(path_keys(path), cfg):
            if name not in tensors:
                raise ExportError(f"{where}: tensor {name!r} is missing; the files do not hold "
                                  "the model config.json describes")
            array = tensors[name]
            shape = tuple(leaf.shape) if r is None else tuple(leaf.shape[1:])
            if tuple(array.shape) != shape or np.dtype(array.dtype) != np.dtype(leaf.dtype):
                raise ExportError(f"{where}: tensor {name!r} is {np.dtype(array.dtype).name}"
                                  f"{list(array.shape)}, the model of config.json needs "
                                  f"{np.dtype(leaf.dtype).name}{list(shape)}")
            parts.append(array)
            used.add(name)
        return np.array(parts[0]) if len(parts) == 1 and r is None else np.stack(parts)

    return jax.tree_util.tree_map_with_path(build, abstract)


def natural_order(name: str) -> tuple:
    """Sort key: the model's order (embed, layers by number, then the rest), else by name."""
    parts = name.split(".")
    rank = {"embed": 0, "layers": 1}.get(parts[0], 2)
    return (rank,) + tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


# ----------------------------------------------------------------------------- safetensors files

def parse_size(text: str) -> int:
    """Bytes of '5GB', '500MB', '1.5GiB', '2000000' (decimal units; KiB/MiB/GiB binary)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise ExportError(f"--max-shard-size={text!r}: expected a size such as 5GB, 500MB or "
                          "1.5GiB")
    unit = m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    size = int(float(m.group(1)) * scale)
    if size <= 0:
        raise ExportError(f"--max-shard-size={text!r} must be positive")
    return size


def human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def write_safetensors(directory: Path, tensors: Mapping[str, np.ndarray], *,
                      max_shard_bytes: int, metadata: dict[str, str], say: Say
                      ) -> list[str]:
    """Writes `tensors` (in their order) to model.safetensors, or to shards of at most
    `max_shard_bytes` (a larger tensor gets a shard of its own) with the index json; returns the
    file names."""
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

    shards: list[list[str]] = [[]]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += array.nbytes
    count = len(shards)
    files = [SINGLE_FILE] if count == 1 else [
        f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
    for file, names in zip(files, shards):
        part = {n: np.ascontiguousarray(tensors[n]) for n in names}
        save_file(part, str(directory / file), metadata=metadata)
        os.chmod(directory / file, 0o644)  # safetensors creates its files private (0600)
        say(f"  {file}: {len(names)} tensors, {human(sum(a.nbytes for a in part.values()))}")
    if count > 1:
        index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
                 "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
        (directory / INDEX_FILE).write_text(hf.dumps(index))
    return files


def read_safetensors(directory: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a directory's model.safetensors, or of the shards its
    model.safetensors.index.json names (read-only memory-mapped arrays)."""
    return read_weights(directory, error=ExportError,
                        fix="pass the directory an export (or save_pretrained) wrote")


# ----------------------------------------------------------------------------- export

def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"--out {out} already exists and is not empty; pass --force to "
                              "replace an earlier export, or choose another directory")
        if not (out / MANIFEST).exists():
            raise ExportError(f"--out {out} holds files that are not an export (no {MANIFEST}); "
                              "--force only replaces an earlier export: choose another directory")


def _tokenizer_token(data: dict, token_id: int | None) -> str | None:
    """The text of token `token_id` in a parsed tokenizer.json (added tokens, then the vocab)."""
    if token_id is None:
        return None
    for t in data.get("added_tokens") or []:
        if t.get("id") == token_id:
            return t.get("content")
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        for text, i in vocab.items():
            if i == token_id:
                return text
    return None


def _write_tokenizer(tmp: Path, spec: str, fmt: str, max_len: int, say: Say
                     ) -> tuple[str, dict[str, Any]]:
    """Writes the tokenizer files into tmp; returns (data.tokenizer for our config.json,
    tokenizer info for export.json)."""
    tok = load_tokenizer(spec)
    info = {"spec": spec, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
            "eos_id": tok.eos_id, "pad_id": tok.pad_id}
    if spec == "byte":
        (tmp / "tokenizer.json").write_text(hf.dumps(hf.byte_tokenizer_json()))
        names = hf.BYTE_SPECIALS
        if fmt == "hf":
            (tmp / "tokenizer_config.json").write_text(hf.dumps(hf.tokenizer_config(
                names[tok.bos_id], names[tok.eos_id], names[tok.pad_id], max_len)))
        info.update(kind="byte", files=["tokenizer.json"])
        return "byte", info
    source = Path(spec)
    if spec.endswith(".json"):
        name = "tokenizer.json"
        shutil.copyfile(source, tmp / name)
        if fmt == "hf":
            data = json.loads(source.read_text())
            text = {k: _tokenizer_token(data, getattr(tok, f"{k}_id"))
                    for k in ("bos", "eos", "pad")}
            (tmp / "tokenizer_config.json").write_text(hf.dumps(hf.tokenizer_config(
                text["bos"], text["eos"], text["pad"], max_len)))
        info.update(kind="tokenizer.json", files=[name])
        return name, info
    name = source.name  # a tiktoken BPE file: copied; HF has no tokenizer.json for it
    shutil.copyfile(source, tmp / name)
    if fmt == "hf":
        say(f"note: the tokenizer {spec} is a tiktoken BPE file, which is copied as {name} but not "
            "converted to a tokenizer.json: transformers' AutoTokenizer will not load it")
    info.update(kind="tiktoken", files=[name])
    return name, info


def _check_dense_early(folder: Path, step: int | None, fmt: str) -> None:
    """Refuses a model that format hf / onnx cannot express from its saved config, before
    reading any array."""
    with Checkpointer(folder, config={}, async_save=False, read_only=True) as reader:
        step, saved = reader.saved_config(step)
    try:
        model_cfg = from_dict(saved).model
    except ConfigError as e:
        raise ConfigError(f"checkpoint {folder}/{step}: {e}") from e
    what = f"the model of checkpoint {folder}/{step}"
    if fmt == "onnx":
        from aiinfra_jax.export_onnx import check_dense  # pylint: disable=import-outside-toplevel
        check_dense(model_cfg, what)
    else:
        hf.check_expressible(model_cfg, what)


def export(source: str | Path, out: str | Path, *, fmt: str = "safetensors",
           step: int | None = None, overrides: Sequence[str] = (), force: bool = False,
           max_shard_bytes: int | str = DEFAULT_MAX_SHARD, say: Say = print,
           stablehlo: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Exports the checkpoint `source` (a run directory, its checkpoints folder or one step
    folder) to the directory `out` in format `fmt` (see the module docstring); returns what
    export.json records. stablehlo: keyword arguments of export_stablehlo.write_stablehlo
    (platforms, max_len, batch_size, prompt_lengths)."""
    if fmt not in FORMATS:
        raise ExportError(f"--format={fmt!r}: valid formats: {', '.join(FORMATS)}")
    if jax.process_count() > 1:
        raise ExportError("export runs in one process; start it without the distributed runtime")
    if isinstance(max_shard_bytes, str):
        max_shard_bytes = parse_size(max_shard_bytes)
    out = Path(out).expanduser()
    _prepare_out(out, force)
    folder, source_step = checkpoint_source(source, "--checkpoint")
    step = step if step is not None else source_step
    if fmt in ("hf", "onnx"):
        _check_dense_early(folder, step, fmt)
    loaded = load_model(source, step=step, overrides=overrides)
    cfg = loaded.config
    tensors, state_names = model_tensors(loaded.model)
    say(f"loaded {folder} step {loaded.step}: {len(tensors)} tensors, "
        f"{human(sum(a.nbytes for a in tensors.values()))} ({cfg.model.param_dtype})")
    if fmt == "hf":
        if state_names:
            raise ExportError(f"the model keeps non-parameter state {state_names[:3]}, which a "
                              "Llama model cannot hold; export with --format safetensors")
        tensors = hf.to_hf_tensors(tensors, cfg.model)
        metadata = {"format": "pt"}  # what transformers expects in a safetensors header
    else:
        metadata = {"format": "aiinfra_jax", "naming": "layers.<i>.<path>"}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        say(f"writing {fmt} to {out}")
        extra: dict[str, Any] = {}
        if fmt == "onnx":
            from aiinfra_jax.export_onnx import write_onnx  # pylint: disable=C0415
            extra["onnx"] = write_onnx(loaded, tmp, say=say,
                                       what=f"the model of checkpoint {folder}/{loaded.step}")
            files = extra["onnx"]["files"]
        else:
            files = write_safetensors(tmp, tensors, max_shard_bytes=max_shard_bytes,
                                      metadata=metadata, say=say)
        tok_spec, tok_info = _write_tokenizer(tmp, cfg.data.tokenizer, fmt,
                                              cfg.model.max_seq_len, say)
        if fmt == "hf":
            config = hf.hf_config(cfg.model, bos_id=tok_info["bos_id"],
                                  eos_id=tok_info["eos_id"], pad_id=tok_info["pad_id"])
        else:
            config = to_dict(dataclasses.replace(
                cfg, mesh=cfg.mesh.without_launch(),
                data=dataclasses.replace(cfg.data, tokenizer=tok_spec)))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if fmt == "stablehlo":  # reads the safetensors files and config written above
            from aiinfra_jax.export_stablehlo import write_stablehlo  # pylint: disable=C0415
            extra = write_stablehlo(loaded, tmp, say=say, **(stablehlo or {}))
        total = int(sum(a.nbytes for a in tensors.values()))
        manifest = {
            "format": fmt,
            "naming": ("aiinfra_jax/hf.py (Llama)" if fmt == "hf"
                       else "aiinfra_jax/export.py: layers.<i>.<path>"),
            "source": str(folder), "step": loaded.step,
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "files": files, "tensors": len(tensors), "bytes": total,
            "state_tensors": state_names, "tokenizer": tok_info, **extra,
        }
        (tmp / MANIFEST).write_text(hf.dumps(manifest))
        if out.exists():
            shutil.rmtree(out)  # empty, or an earlier export (checked by _prepare_out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"wrote {out}: {len(files)} safetensors file(s), {len(tensors)} tensors, {human(total)}")
    return manifest


# ----------------------------------------------------------------------------- load our export

def load_safetensors(directory: str | Path, *, overrides: Sequence[str] = ()) -> LoadedModel:
    """The model of a `--format safetensors` export (see the module docstring), like
    aiinfra_jax.load.load_model: run-time settings may be overridden, a change of architecture
    is refused naming the key. Every tensor is checked for name, shape and dtype."""
    d = Path(directory).expanduser()
    manifest = {}
    if (d / MANIFEST).exists():
        manifest = json.loads((d / MANIFEST).read_text())
        if manifest.get("format") == "hf":
            raise ExportError(f"{d} is a Hugging Face export; load it with transformers, or into "
                              "this framework with python -m aiinfra_jax.import_hf")
    if not (d / "config.json").exists():
        raise ExportError(f"{d} has no config.json; pass a directory written by "
                          "python -m aiinfra_jax.export --format safetensors")
    saved = json.loads((d / "config.json").read_text())
    if "model" not in saved or "data" not in saved:
        raise ExportError(f"{d}/config.json is not this framework's config (no model/data "
                          "sections); a Hugging Face directory is read by aiinfra_jax.import_hf")
    tok = saved["data"].get("tokenizer", "byte")
    if tok != "byte" and not Path(tok).is_absolute():
        saved["data"]["tokenizer"] = str(d / tok)
    cfg = _resolve(saved, overrides, str(d))
    mesh = shd.make_mesh(cfg.mesh)
    graphdef, abstract_params, rest = abstract_model(cfg.model, cfg.run.seed)
    tensors = read_safetensors(d)
    used: set[str] = set()
    params = tree_from_tensors(nnx.to_pure_dict(abstract_params), tensors, cfg.model, str(d),
                                used)
    params = jax.tree.map(jax.device_put, params, shd.param_shardings(abstract_params, mesh))
    model_state = None
    if jax.tree.leaves(rest):
        model_state = tree_from_tensors(nnx.to_pure_dict(rest), tensors, cfg.model, str(d), used)
        model_state = jax.tree.map(jax.device_put, model_state,
                                   shd.param_shardings(rest, mesh))
    extra = sorted(set(tensors) - used, key=natural_order)
    if extra:
        raise ExportError(f"{d}: tensors {extra[:5]} are not part of the model config.json "
                          "describes")
    model = merge_model(graphdef, abstract_params, rest, params, model_state)
    return LoadedModel(model=model, tokenizer=load_tokenizer(cfg.data.tokenizer), config=cfg,
                       step=int(manifest.get("step", 0)), mesh=mesh)


# ----------------------------------------------------------------------------- command line

def _stablehlo_args(args) -> dict[str, Any]:
    try:
        lengths = tuple(int(x) for x in args.prompt_lengths.split(",") if x.strip())
    except ValueError as e:
        raise ExportError(f"--prompt-lengths={args.prompt_lengths!r}: give comma-separated "
                          "token counts, e.g. 16,64,256") from e
    return {"platforms": tuple(p for p in args.platforms.split(",") if p),
            "max_len": args.max_len, "batch_size": args.batch_size,
            "prompt_lengths": lengths or None}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True,
                    help="a run directory, its checkpoints folder, or one step folder")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    ap.add_argument("--format", dest="fmt", default="safetensors", choices=FORMATS)
    ap.add_argument("--out", required=True, help="the directory to write (must not hold files)")
    ap.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD,
                    help="split the tensors into files of at most this size (default 5GB)")
    ap.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="run-time settings of the model, e.g. --set model.dtype=float32")
    ap.add_argument("--platforms", default="cpu,cuda,tpu",
                    help="stablehlo: the platforms to lower for (default cpu,cuda,tpu)")
    ap.add_argument("--max-len", type=int, default=None,
                    help="stablehlo: cache length in tokens (default: model.max_seq_len)")
    ap.add_argument("--batch-size", type=int, default=8,
                    help="stablehlo: the batch of models whose batch cannot be symbolic")
    ap.add_argument("--prompt-lengths", default="",
                    help="stablehlo: prefill buckets, e.g. 16,64,256 (default: powers of two)")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    if args.fmt != "stablehlo":  # their settings would be ignored: said instead
        given = [flag for flag in ("--platforms", "--max-len", "--batch-size", "--prompt-lengths")
                 if getattr(args, flag[2:].replace("-", "_")) != ap.get_default(
                     flag[2:].replace("-", "_"))]
        if given:
            ap.error(f"{', '.join(given)} apply to --format stablehlo only (--format is "
                     f"{args.fmt})")
    if not args.debug:
        quiet_library_tracebacks()
    try:
        export(args.checkpoint, args.out, fmt=args.fmt, step=args.step,
               overrides=args.overrides, force=args.force,
               max_shard_bytes=args.max_shard_size, say=lambda s: print(s, flush=True),
               stablehlo=_stablehlo_args(args) if args.fmt == "stablehlo" else None)
    except BaseException as e:  # noqa: BLE001 -- a bug is re-raised with its traceback
        status = report_error(e, debug=args.debug, expected=(FileNotFoundError, ValueError))
        if status is None:
            raise
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
