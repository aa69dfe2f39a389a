"""Start a model from another model's parameters: a Hugging Face Llama directory, or a run of this
framework of any architecture (architecture surgery).

    checkpoint.initialize_from=hf:DIR       a local HF Llama checkpoint (what save_pretrained
                                            writes; read as aiinfra_jax/import_hf.py reads it)
    checkpoint.initialize_from=params:RUN   the parameters of a run's checkpoint (a run directory,
                                            its checkpoints folder or one step folder)

(A plain path, without a prefix, still hands over the whole training state of a run of the same
architecture: aiinfra_jax/rundir.py.) Only parameters move: the new run starts at step 0 with a
fresh optimizer state, a fresh non-parameter state (e.g. a routing bias) and the data stream at
its first batch.

Every parameter of the new model is, by the export naming scheme (aiinfra_jax/export.py,
layers.<i>.<path>):
  adapted      derived from a dense attention layer of the source by the new mixer's
               `from_dense` (models/registry.py): NSA takes wq / wo as they are and the dense
               wk / wv for each of its K/V branches; Gated DeltaNet / KDA take the q, k, v and
               output projections with key/value heads repeated to their head count
  copied       a source tensor of the same name and shape (embeddings, norms, FFNs, head, the
               attention projections of dense, MSA and AttnRes layers...)
  initialised  nothing in the source has its name: the module's own initialisation (NSA's gates
               and compression MLPs, MSA's routers, AttnRes's queries, layers past the source's)
A source tensor with the same name and another shape is an error that names both shapes (a model
section that differs from the source's where it must not, e.g. another vocabulary); a source
tensor that nothing takes is listed as unused. The run prints a grouped summary and writes every
name to RUN_DIR/initialize.json.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax import hf
from aiinfra_jax.config import ConfigError
from aiinfra_jax.export import natural_order, tree_tensors, read_safetensors, tree_from_tensors
from aiinfra_jax.models.config import ModelConfig
from aiinfra_jax.models.registry import MIXERS

__all__ = ["PREFIXES", "Source", "initialize_params", "is_params_source", "read_source",
           "state_with_params", "transplant"]

PREFIXES = ("hf:", "params:")
REPORT_FILE = "initialize.json"


def is_params_source(spec: str) -> bool:
    """Whether checkpoint.initialize_from names a parameters-only source (hf: or params:)."""
    return spec.startswith(PREFIXES)


@dataclasses.dataclass
class Source:
    """Named tensors (export naming) of a source model, its model config, and where it is."""

    tensors: dict[str, np.ndarray]
    model: ModelConfig
    where: str


def read_source(spec: str, *, setting: str = "checkpoint.initialize_from") -> Source:
    """The parameters named by `hf:DIR` or `params:RUN` (module docstring)."""
    kind, _, path = spec.partition(":")
    if not path:
        raise ConfigError(f"{setting}={spec!r}: give a directory after '{kind}:'")
    where = f"{setting}={spec!r}"
    if kind == "hf":
        d = Path(path).expanduser()
        if not (d / "config.json").exists():
            raise ConfigError(f"{where}: {d} has no config.json; pass a directory that "
                              "save_pretrained wrote")
        try:
            hf_cfg = json.loads((d / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: {d}/config.json cannot be read ({e})") from e
        try:
            model = ModelConfig(**hf.model_fields_from_hf(hf_cfg, str(d)))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from e
        tensors, _ = hf.from_hf_tensors(read_safetensors(d), model, str(d))
        return Source(tensors, model, f"{d} (Hugging Face)")
    from aiinfra_jax.export import model_tensors  # pylint: disable=import-outside-toplevel
    from aiinfra_jax.load import load_model  # pylint: disable=import-outside-toplevel

    try:
        loaded = load_model(path, overrides=["mesh.num_devices=1"])
    except FileNotFoundError as e:
        raise ConfigError(f"{where}: {e}") from e
    tensors, state_names = model_tensors(loaded.model)
    for name in state_names:  # non-parameter state starts fresh (module docstring)
        tensors.pop(name)
    return Source(tensors, loaded.config.model, f"{path} step {loaded.step}")


def _shape(a) -> str:
    return f"{np.dtype(a.dtype).name}{list(a.shape)}"


def transplant(cfg: ModelConfig, fresh: Mapping[str, np.ndarray], source: Source
               ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(the new model's named tensors, report): `fresh` (the new model's initialised tensors by
    the export naming) with what `source` gives it (module docstring). The report holds
    "adapted" {name: [source name, how]}, "copied" {name: source name}, "initialised" [names],
    "unused" [source names] and "not_adapted" {name: why}."""
    src, src_cfg = source.tensors, source.model
    adapted: dict[str, tuple[np.ndarray, str, str]] = {}
    not_adapted: dict[str, str] = {}
    for i in range(min(cfg.n_layers, src_cfg.n_layers)):
        kind, src_kind = cfg.mixer_at(i), src_cfg.mixer_at(i)
        hook = getattr(MIXERS[kind], "from_dense", None)
        if src_kind != "dense" or kind == "dense" or hook is None:
            continue
        prefix = f"layers.{i}.mixer."
        dense = {k[len(prefix):]: v for k, v in src.items() if k.startswith(prefix)}
        for name, (array, src_name, how) in hook(cfg, dense).items():
            target = prefix + name
            if target not in fresh:
                raise ValueError(f"{MIXERS[kind].__name__}.from_dense returned {name!r}, which "
                                 "the layer does not have")
            if tuple(array.shape) != tuple(fresh[target].shape):
                not_adapted[target] = (f"dense {src_name} {list(array.shape)} does not fit "
                                       f"{list(fresh[target].shape)}")
                continue
            adapted[target] = (array, prefix + src_name, how)

    out, used = {}, set()
    report: dict[str, Any] = {"source": source.where, "adapted": {}, "copied": {},
                              "initialised": [], "unused": [], "not_adapted": not_adapted,
                              "differs": _silent_differences(cfg, src_cfg)}
    for name, init in fresh.items():
        dtype = np.dtype(init.dtype)
        if name in adapted:
            array, src_name, how = adapted[name]
            out[name] = np.asarray(array, dtype)
            report["adapted"][name] = [src_name, how]
            used.add(src_name)
        elif name in src:
            if tuple(src[name].shape) != tuple(init.shape):
                hint = (" (another vocabulary: data.tokenizer must be the source's tokenizer)"
                        if name in ("embed.table", "head.kernel") else "")
                raise ConfigError(
                    f"checkpoint.initialize_from: tensor {name!r} is {_shape(src[name])} in "
                    f"{source.where} but this model's is {_shape(init)}{hint}; make the model "
                    "section match the source where the names are shared")
            out[name] = np.asarray(src[name], dtype)
            report["copied"][name] = name
            used.add(name)
        else:
            out[name] = init
            report["initialised"].append(name)
    report["unused"] = sorted(set(src) - used, key=natural_order)
    if not used:
        raise ConfigError(f"checkpoint.initialize_from: no tensor of {source.where} fits this "
                          "model (no shared names); is it the model you meant?")
    return out, report


# Settings that change what the same tensors compute, with no tensor to show it.
_SILENT_KEYS = ("rope_theta", "norm_eps", "tie_embeddings")


def _silent_differences(cfg: ModelConfig, src_cfg: ModelConfig) -> dict[str, list]:
    """{model.KEY: [source value, this model's value]} for _SILENT_KEYS that differ (a longer
    RoPE base for context extension is a choice; a default left in place by mistake is not: the
    report names both)."""
    return {f"model.{k}": [getattr(src_cfg, k), getattr(cfg, k)] for k in _SILENT_KEYS
            if getattr(src_cfg, k) != getattr(cfg, k)}


def _grouped(names) -> list[str]:
    """Names with their layer numbers folded: layers.{0-3}.mixer.wk."""
    groups: dict[str, list[int]] = {}
    for name in names:
        m = re.match(r"layers\.(\d+)\.(.*)", name)
        key, idx = (f"layers.{{}}.{m.group(2)}", int(m.group(1))) if m else (name, -1)
        groups.setdefault(key, []).append(idx)
    out = []
    for key, idx in groups.items():
        if idx == [-1]:
            out.append(key)
            continue
        span = (f"{idx[0]}-{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1)) and len(idx) > 1
                else ",".join(map(str, idx)))
        out.append(key.format(span))
    return out


def summary(report: Mapping[str, Any]) -> str:
    """The report in a few lines (every name, layer numbers folded)."""
    how: dict[str, list[str]] = {}
    for name, (_, text) in report["adapted"].items():
        how.setdefault(text, []).append(name)
    lines = [f"initialised from the parameters of {report['source']}: "
             f"{len(report['copied'])} copied, {len(report['adapted'])} adapted, "
             f"{len(report['initialised'])} newly initialised, {len(report['unused'])} unused"]
    lines += [f"  adapted ({text}): {', '.join(_grouped(names))}" for text, names in how.items()]
    lines += [f"  copied: {', '.join(_grouped(report['copied']))}"] if report["copied"] else []
    for key, label in (("initialised", "newly initialised"), ("unused", "unused source tensors")):
        if report[key]:
            lines.append(f"  {label}: {', '.join(_grouped(report[key]))}")
    lines += [f"  not adapted: {name}: {why}" for name, why in report["not_adapted"].items()]
    for key, (theirs, ours) in report.get("differs", {}).items():
        lines.append(f"  NOTE {key}: the source was trained with {theirs!r}, this model runs "
                     f"{ours!r} (set {key}={theirs!r} to keep the source's behaviour)"
                     + ("; its head is the embedding, so this model's head.kernel starts random"
                        if key == "model.tie_embeddings" and theirs else ""))
    return "\n".join(lines)


def state_with_params(trainer, params: Any, state: dict | None = None) -> dict:
    """A training state at step 0 holding `params` (host arrays in the trainer's params tree),
    with a fresh optimizer state for them (and `state`'s other entries, e.g. model_state)."""
    shardings = trainer.state_shardings
    params = jax.tree.map(jax.device_put, params, shardings["params"])
    opt_state = jax.jit(trainer.optimizer.init, out_shardings=shardings["opt_state"])(params)
    new = dict(state or {})
    new.update(params=params, opt_state=opt_state,
               step=jax.device_put(jnp.int32(0), shardings["step"]),
               bad_step=jax.device_put(jnp.int32(0), shardings["bad_step"]))
    return new


def initialize_params(trainer, spec: str, say: Callable[[str], None]) -> tuple[dict, dict]:
    """(state at step 0, report) for checkpoint.initialize_from=hf:DIR | params:RUN."""
    cfg = trainer.cfg.model
    source = read_source(spec)
    state = trainer.init_state()
    fresh = tree_tensors(state["params"], cfg)
    tensors, report = transplant(cfg, fresh, source)
    params = tree_from_tensors(nnx.to_pure_dict(trainer.abstract_params), tensors, cfg,
                               source.where, set())
    say(summary(report))
    return state_with_params(trainer, params, state), report


def write_report(run_dir: Path, report: Mapping[str, Any]) -> None:
    (Path(run_dir) / REPORT_FILE).write_text(hf.dumps(dict(report)))
