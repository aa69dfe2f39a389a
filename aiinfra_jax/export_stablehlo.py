"""`--format stablehlo`: the prefill and the decode step of a trained model as serialized
`jax.export` artifacts, per platform, run later by a standalone loader that needs only jax.

    from aiinfra_jax.export_stablehlo import write_stablehlo
    info = write_stablehlo(loaded, directory)   # the directory already holds model.safetensors

    python DIR/run_stablehlo.py DIR --prompt 1,2,3 --prompt 7,8 --max-new-tokens 16

This is the format for models no serving engine runs (NSA, MSA, Gated DeltaNet / KDA): the
artifacts compute exactly what aiinfra_jax/generate.py computes (they trace its own prefill and
decode step), and aiinfra_jax/stablehlo_runner.py, copied into the directory as run_stablehlo.py,
runs them in a process that imports only jax (+ numpy, ml_dtypes and flatbuffers, jax's own
dependencies for this), never this package.

Files (beside the safetensors weights the export writes first, names as aiinfra_jax/export.py):

    stablehlo.json                   the manifest: format version, jax version, the functions'
                                     signature, the artifact of each platform and shape, the cache
                                     layout (one entry per cache buffer), vocab size, cache length,
                                     bos / eos / pad ids, and what is symbolic or fixed and why
    stablehlo/decode.<p>.bin         one decode step for platform p (cpu, cuda, tpu)
    stablehlo/prefill.<p>.bin        the prefill, when the prompt length could stay symbolic, else
    stablehlo/prefill.<p>.t<T>.bin   one per prompt-length bucket T (prompts are right-padded up
                                     to the smallest bucket that holds them)
    run_stablehlo.py                 the standalone runner (aiinfra_jax/stablehlo_runner.py)

The functions (weights: a dict {tensor name: array} with exactly the tensors of the safetensors
files, so the runner passes what it read; the model is rebuilt from them inside the function):

    prefill(weights, tokens [b,t] int32 right-padded, lengths [b] int32)
        -> (logits [b,V] float32 at each row's last prompt token, cache)
    decode(weights, cache, tokens [b] int32, positions [b] int32) -> (logits [b,V] float32, cache)

Positions of a decode step are the rows' cache lengths (the prompt length, then +1 per step).

Platforms. One artifact per platform and function, each lowered from this machine for that
platform alone (`jax.export.export(..., platforms=[p])`): kernels pick their implementation from
the lowering platform (kernels/_dispatch.py), so with implementation None the cuda artifact holds
the Pallas/Triton kernels (`__gpu$xla.gpu.triton` custom calls) and the tpu artifact the Mosaic
ones (`tpu_custom_call`); lowering for several platforms at once fails with a Pallas branch. jax
guarantees no compatibility for Triton custom calls across versions (the check is disabled for
them): run the cuda artifact with the jax / jaxlib version the manifest names.

Symbolic and fixed dimensions (measured on jax 0.10.2; the manifest records what each export got):
  - cache length S: fixed, the model's max_seq_len or `max_len`: the caches are preallocated
    buffers and the mixers derive static sizes from S (NSA's compressed-token count, its window
    slice min(S, w + T - 1)).
  - batch b: symbolic when the decode step / prefill trace with a symbolic batch, else fixed at
    `batch_size` and the runner pads a batch with dummy rows and splits larger ones. Every
    attention kernel's entry checks the shapes with Python min() (flash_attention's validation,
    sparse_attention's XLA path), and with implementation None the Pallas branches are traced
    for every platform and need static grids, so only a dense-attention decode step stays
    symbolic today; NSA and Gated DeltaNet get the fixed batch.
  - prompt length t: symbolic when the prefill traces so, else one artifact per bucket
    (`prompt_lengths`, default powers of two from 16 up to S, and S). The mixers compare the
    prompt length with static sizes (NSA: min(S, w + t - 1); dense: t > 1), so every model
    gets buckets today. Padding a prompt up to its bucket changes nothing: the padding is
    masked (segment id 0) and never enters the cache.

Limits: greedy / sampling happens in the runner, not in the artifacts; MSA is refused (its
decoding reads a memory bank that a routing prefill gathers, aiinfra_jax/memory_bank.py; an
artifact without the bank would silently answer from the prompt alone); one device per artifact
(no mesh).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax import generate as gen
from aiinfra_jax.export import path_keys, export_names, natural_order, human, read_safetensors
from aiinfra_jax.hf import ExportError
from aiinfra_jax.load import LoadedModel
from aiinfra_jax.steps import abstract_model, merge_model

__all__ = ["FORMAT", "MANIFEST", "PLATFORMS", "RUNNER", "VERSION", "default_prompt_lengths",
           "write_stablehlo"]

FORMAT = "aiinfra_jax.stablehlo"
VERSION = 1
MANIFEST = "stablehlo.json"
RUNNER = "run_stablehlo.py"
FOLDER = "stablehlo"
PLATFORMS = ("cpu", "cuda", "tpu")
DEFAULT_BATCH = 8
# Custom calls of the Pallas GPU (Triton) kernels, which jax.export refuses by default (no
# compatibility guarantee); Mosaic TPU's tpu_custom_call is on jax's stable list.
_UNSTABLE_TARGETS = ("__gpu$xla.gpu.triton",)

Say = Callable[[str], None]

# Axes of the cache buffers, by (mixer, buffer name); "*" = any mixer. See AXES_GLOSSARY.
_AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("*", "lengths"): ("batch",),
    ("dense", "k"): ("batch", "kv_heads", "head_dim", "slot"),
    ("dense", "v"): ("batch", "kv_heads", "slot", "head_dim"),
    ("nsa", "k_win"): ("batch", "kv_heads", "head_dim", "window"),
    ("nsa", "v_win"): ("batch", "kv_heads", "window", "head_dim"),
    **{("nsa", n): ("batch", "kv_heads", "slot", "head_dim") for n in ("k", "v", "k_slc", "v_slc")},
    ("nsa", "k_src"): ("batch", "cmp_tail", "kv_heads", "head_dim"),
    ("nsa", "v_src"): ("batch", "cmp_tail", "kv_heads", "head_dim"),
    ("nsa", "k_cmp"): ("batch", "kv_heads", "head_dim", "compressed"),
    ("nsa", "v_cmp"): ("batch", "kv_heads", "compressed", "head_dim"),
    **{(m, "state"): ("batch", "value_heads", "key_dim", "value_dim") for m in ("gdn", "kda")},
    **{(m, "conv"): ("batch", "conv_tail", "channels") for m in ("gdn", "kda")},
    ("short_conv", "conv"): ("batch", "conv_tail", "embed"),
}
AXES_GLOSSARY = {
    "batch": "the row (one prompt)",
    "slot": "the token position: a row's token at position p is in slot p; decode writes its "
            "token at slot positions[b], and slots >= lengths[b] are unused",
    "lengths": "tokens written per row (the next decode position)",
    "kv_heads": "key/value head", "head_dim": "channel of a head",
    "window": "NSA: the window branch's ring of W = min(window, max_len) slots: the token at "
              "position p is in slot p mod W",
    "cmp_tail": "NSA: the last cmp_block_len - 1 un-rotated compression inputs of the row",
    "compressed": "NSA: compressed token i (raw tokens [i*cmp_stride, i*cmp_stride + "
                  "cmp_block_len))",
    "value_heads": "Gated DeltaNet / KDA value head", "key_dim": "recurrent state row",
    "value_dim": "recurrent state column",
    "conv_tail": "the last width - 1 inputs of a short convolution", "channels": "channel",
    "embed": "d_model channel",
}


# ----------------------------------------------------------------------------- the traced model

def _unscanned_parts(cfg):
    """(graphdef, abstract params, abstract rest, per-block cfg) of the model with per-block
    parameters: what generate.py runs after `unscanned()`, and whose leaves map one-to-one onto
    the exported tensor names (no stacking, which works on tracers)."""
    cfg_u = dataclasses.replace(cfg, scan_layers=False)
    graphdef, params, rest = abstract_model(cfg_u)
    return graphdef, params, rest, cfg_u


def _tree(abstract: Any, weights: Mapping[str, Any], cfg, used: set[str]) -> Any:
    """The leaves of a per-block abstract tree taken from `weights` by the naming scheme
    (aiinfra_jax/export.py), checked for shape and dtype; works on tracers."""

    def take(path, leaf):
        (name, r), = export_names(path_keys(path), cfg)
        if name not in weights:
            raise ExportError(f"tensor {name!r} is missing from the weights; the files do not hold "
                              "the model the config describes")
        x = weights[name]
        if tuple(x.shape) != tuple(leaf.shape) or np.dtype(x.dtype) != np.dtype(leaf.dtype):
            raise ExportError(f"tensor {name!r} is {np.dtype(x.dtype).name}{list(x.shape)}, the "
                              f"model needs {np.dtype(leaf.dtype).name}{list(leaf.shape)}")
        used.add(name)
        return x

    return jax.tree_util.tree_map_with_path(take, abstract)


def _model_builder(cfg) -> Callable[[Mapping[str, Any]], nnx.Module]:
    """weights {name: array} -> the unscanned model (inside a traced function)."""
    graphdef, abstract_params, rest, cfg_u = _unscanned_parts(cfg)
    has_state = bool(jax.tree.leaves(rest))

    def build(weights):
        used: set[str] = set()
        params = _tree(nnx.to_pure_dict(abstract_params), weights, cfg_u, used)
        state = _tree(nnx.to_pure_dict(rest), weights, cfg_u, used) if has_state else None
        extra = sorted(set(weights) - used, key=natural_order)
        if extra:
            raise ExportError(f"tensors {extra[:5]} are not part of the model the config "
                              "describes")
        return merge_model(graphdef, abstract_params, rest, params, state)

    return build


def _functions(cfg, max_len: int):
    build = _model_builder(cfg)

    def prefill(weights, tokens, lengths):
        # generate.py's own prefill (one chunk of the whole padded prompt), cache of max_len.
        graphdef, state = nnx.split(build(weights))
        return gen.run_prefill(graphdef, state, tokens, lengths, max_len, tokens.shape[1])

    def decode(weights, cache, tokens, positions):
        return gen.run_step(build(weights), cache, tokens, positions)

    return build, jax.jit(prefill), jax.jit(decode)


# ----------------------------------------------------------------------------- helpers

def default_prompt_lengths(max_len: int, smallest: int = 16) -> list[int]:
    """Prompt-length buckets: powers of two from `smallest` below max_len, and max_len."""
    out, t = [], smallest
    while t < max_len:
        out.append(t)
        t *= 2
    return out + [max_len]


def _dims(shape) -> list:
    return [d if isinstance(d, int) else str(d) for d in shape]


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _export(fn, args, platform: str):
    return jax.export.export(fn, platforms=[platform], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(t) for t in _UNSTABLE_TARGETS])(*args)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _cache_layout(cache_spec: Any, cfg, batch) -> list[dict[str, Any]]:
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache_spec)[0]:
        keys = path_keys(path)
        r, p, rest = int(keys[0]), int(keys[1]), keys[2:]
        mixer = cfg.mixer_at(p)
        owner = "short_conv" if rest == ["conv"] and cfg.short_conv else mixer
        axes = _AXES.get(("*", rest[-1])) or _AXES.get((owner, rest[-1]))
        entry = {"name": ".".join(["cache"] + keys), "layer": r * cfg.block_size + p,
                 "mixer": mixer, "shape": [batch] + list(leaf.shape[1:]),
                 "dtype": np.dtype(leaf.dtype).name}
        entry["axes"] = list(axes) if axes and len(axes) == leaf.ndim else \
            ["batch"] + [f"axis{i}" for i in range(1, leaf.ndim)]
        out.append(entry)
    return out


def _tokens_info(loaded: LoadedModel) -> dict[str, int | None]:
    tok = loaded.tokenizer
    return {k: (None if getattr(tok, k, None) is None else int(getattr(tok, k)))
            for k in ("bos_id", "eos_id", "pad_id")}


# ----------------------------------------------------------------------------- the export

def write_stablehlo(loaded: LoadedModel, tmp: Path, *, platforms: Sequence[str] = PLATFORMS,
                    max_len: int | None = None, batch_size: int = DEFAULT_BATCH,
                    prompt_lengths: Sequence[int] | None = None, say: Say = print
                    ) -> dict[str, Any]:
    """Writes the stablehlo artifacts of `loaded` (see the module docstring) into the directory
    `tmp`, which already holds the weights (model.safetensors or its shards: the tensors of
    aiinfra_jax.export.model_tensors(loaded.model)); writes stablehlo.json and run_stablehlo.py.

    max_len: the cache length (default: the model's max_seq_len); batch_size: the batch of the
    artifacts whose batch cannot stay symbolic; prompt_lengths: the prefill buckets when the
    prompt length cannot stay symbolic (default: default_prompt_lengths(max_len)). Returns
    {"stablehlo": {...}} for export.json."""
    tmp = Path(tmp)
    cfg = loaded.config.model
    if "msa" in cfg.mixers:
        raise ExportError(f"the model cannot be exported as stablehlo: its MSA layers "
                          f"(mixers={cfg.mixers}) decode from a memory bank, which the artifacts "
                          "do not carry; export --format safetensors and query with "
                          "python -m aiinfra_jax.eval.memory")
    platforms = list(dict.fromkeys(platforms))
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad or not platforms:
        raise ExportError(f"stablehlo platforms {platforms}: choose among {', '.join(PLATFORMS)}")
    max_len = cfg.max_seq_len if max_len is None else int(max_len)
    if not 1 <= max_len <= cfg.max_seq_len:
        raise ExportError(f"stablehlo max_len={max_len}: must be in [1, model.max_seq_len="
                          f"{cfg.max_seq_len}]")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ExportError(f"stablehlo batch_size={batch_size!r}: must be a positive int")
    buckets = sorted(set(default_prompt_lengths(max_len) if prompt_lengths is None
                         else (int(t) for t in prompt_lengths)))
    if not buckets or buckets[0] < 1 or buckets[-1] > max_len:
        raise ExportError(f"stablehlo prompt_lengths={list(prompt_lengths or [])}: each must be "
                          f"in [1, max_len={max_len}]")

    tensors = read_safetensors(tmp)  # memory-mapped: only the headers are read here
    weights = {n: _spec(a.shape, a.dtype) for n, a in tensors.items()}
    build, prefill, decode = _functions(cfg, max_len)
    try:
        cache1 = jax.eval_shape(lambda w: build(w).init_cache(1, max_len), weights)
    except NotImplementedError as e:
        raise ExportError(f"the model cannot be exported as stablehlo: it has no decoding cache "
                          f"({e})") from e

    def cache_spec(batch):
        return jax.tree.map(lambda a: _spec((batch,) + a.shape[1:], a.dtype), cache1)

    (tmp / FOLDER).mkdir(exist_ok=True)
    i32 = jnp.int32
    b, t = jax.export.symbolic_shape("b, t")
    traced: dict[tuple, str | None] = {}  # trace outcome per (function, batch, length) kind
    notes: dict[str, str] = {}  # why a dimension could not stay symbolic
    entries: dict[str, Any] = {}
    total = 0

    def attempt(name: str, fn, args, platform: str, key: tuple):
        """The artifact of fn(*args) for `platform`, or None (noted) when shapes with symbolic
        dimensions do not trace or lower. Tracing does not depend on the platform (every kernel
        branch is traced), so its outcome is kept for the next platforms."""
        if key not in traced:
            try:
                fn.trace(*args)
                traced[key] = None
            except ExportError:
                raise
            except Exception as e:  # noqa: BLE001 -- any failure: the fixed shape is tried next
                traced[key] = _first_line(e)
        why = traced[key]
        if why is None:
            try:
                return _export(fn, args, platform)
            except ExportError:
                raise
            except Exception as e:  # noqa: BLE001
                why = f"on {platform}: {_first_line(e)}"
        notes.setdefault(f"{name} with symbolic {' and '.join(key[1:])}", why)
        return None

    def save(exported, name: str) -> dict[str, Any]:
        nonlocal total
        data = exported.serialize()
        rel = f"{FOLDER}/{name}"
        (tmp / rel).write_bytes(data)
        total += len(data)
        return {"file": rel, "bytes": len(data)}

    def pre_args(batch, length):
        return weights, _spec((batch, length), i32), _spec((batch,), i32)

    for platform in platforms:
        # Decode: a symbolic batch if it traces and lowers, else batch_size.
        batch: int | Any = b
        exp = attempt("decode", decode, (weights, cache_spec(b), _spec((b,), i32),
                                         _spec((b,), i32)), platform, ("decode", "batch"))
        if exp is None:
            batch = batch_size
            exp = _export(decode, (weights, cache_spec(batch), _spec((batch,), i32),
                                   _spec((batch,), i32)), platform)
        decode_entry = {**save(exp, f"decode.{platform}.bin"), "batch": _dims([batch])[0]}

        # Prefill: the decode step's batch (symbolic or fixed; a symbolic prefill batch would not
        # help a fixed decode batch), then a symbolic prompt length, else the buckets.
        pre = []
        exp = attempt("prefill", prefill, pre_args(batch, t), platform,
                      ("prefill", "batch", "prompt length") if batch is b
                      else ("prefill", "prompt length"))
        if exp is not None:
            pre.append({**save(exp, f"prefill.{platform}.bin"), "batch": _dims([batch])[0],
                        "prompt_len": "t"})
        for length in buckets if exp is None else ():
            exp = None
            if batch is b:
                exp = attempt("prefill", prefill, pre_args(b, length), platform,
                              ("prefill", "batch"))
                if exp is None:  # the decode step takes any batch: use a fixed one here
                    batch = batch_size
            if exp is None:
                exp = _export(prefill, pre_args(batch, length), platform)
            pre.append({**save(exp, f"prefill.{platform}.t{length}.bin"),
                        "batch": _dims([batch])[0], "prompt_len": length})
        last = exp
        # The runner feeds the decode step what the prefill returns: a fixed batch anywhere
        # fixes it for the platform.
        fixed = [e["batch"] for e in pre + [decode_entry] if isinstance(e["batch"], int)]
        entries[platform] = {"batch": fixed[0] if fixed else "b", "prefill": pre,
                             "decode": decode_entry}
        lengths_text = "symbolic" if pre[0]["prompt_len"] == "t" else \
            "buckets " + ",".join(str(e["prompt_len"]) for e in pre)
        say(f"  stablehlo {platform}: decode + {len(pre)} prefill artifact(s), batch "
            f"{entries[platform]['batch']}, prompt length {lengths_text}, "
            f"{human(sum(e['bytes'] for e in pre) + decode_entry['bytes'])}")

    vocab = int(cfg.vocab_size)
    cache_b = cache_spec(1)
    manifest = {
        "format": FORMAT, "version": VERSION,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "calling_convention_version": int(last.calling_convention_version),
        "runner": RUNNER,
        "vocab_size": vocab, "max_len": max_len, "tokens": _tokens_info(loaded),
        "mixers": list(cfg.mixers), "n_layers": int(cfg.n_layers),
        "weights": {n: {"dtype": np.dtype(a.dtype).name, "shape": list(a.shape)}
                    for n, a in weights.items()},
        "signature": {
            "prefill": {
                "inputs": [{"name": "weights", "kind": "dict {tensor name: array}, exactly the "
                            "tensors of 'weights'"},
                           {"name": "tokens", "shape": ["b", "t"], "dtype": "int32",
                            "note": "right-padded prompts"},
                           {"name": "lengths", "shape": ["b"], "dtype": "int32",
                            "note": "true prompt lengths, >= 1"}],
                "outputs": [{"name": "logits", "shape": ["b", vocab], "dtype": "float32",
                             "note": "at each row's last prompt token"},
                            {"name": "cache", "kind": "see 'cache'"}]},
            "decode": {
                "inputs": [{"name": "weights", "kind": "as prefill"},
                           {"name": "cache", "kind": "see 'cache'"},
                           {"name": "tokens", "shape": ["b"], "dtype": "int32"},
                           {"name": "positions", "shape": ["b"], "dtype": "int32",
                            "note": "the rows' cache lengths: the prompt length, then +1 per "
                                    "step"}],
                "outputs": [{"name": "logits", "shape": ["b", vocab], "dtype": "float32"},
                            {"name": "cache", "kind": "see 'cache'"}]},
        },
        "cache": {"structure": "cache[r][p] (layer r * block_size + p), a dict of buffers per "
                               "layer; the pytree the artifacts take and return",
                  "block_size": int(cfg.block_size), "buffers": _cache_layout(cache_b, cfg, "b"),
                  "axes": AXES_GLOSSARY},
        "symbolic": {
            "cache length": f"fixed at max_len={max_len} (preallocated buffers; the mixers "
                            "derive static sizes from it)",
            "batch": {p: e["batch"] for p, e in entries.items()},
            "prompt length": {p: ("symbolic" if e["prefill"][0]["prompt_len"] == "t"
                                  else [x["prompt_len"] for x in e["prefill"]])
                              for p, e in entries.items()},
            "why not symbolic": notes,
        },
        "platforms": entries,
        "notes": ("cuda artifacts hold Triton custom calls (__gpu$xla.gpu.triton), which jax "
                  "does not keep compatible across versions: run them with jax "
                  f"{jax.__version__}. Batches of a fixed size are padded by the runner with "
                  "dummy rows; prompts are right-padded to the smallest prompt-length bucket."),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    runner = Path(__file__).with_name("stablehlo_runner.py")
    shutil.copyfile(runner, tmp / RUNNER)
    os.chmod(tmp / RUNNER, 0o755)
    files = sorted([e["file"] for p in entries.values() for e in p["prefill"] + [p["decode"]]])
    say(f"  {MANIFEST}, {RUNNER}: {len(files)} artifacts, {human(total)}")
    return {"stablehlo": {"manifest": MANIFEST, "runner": RUNNER, "platforms": platforms,
                          "max_len": max_len, "batch": manifest["symbolic"]["batch"],
                          "prompt_lengths": manifest["symbolic"]["prompt length"],
                          "files": files, "bytes": total, "jax_version": jax.__version__}}
