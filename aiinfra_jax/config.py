"""Run configuration: frozen dataclasses for every setting, presets, `--set` overrides, validation.

One dataclass per concern (model, data, optim, mesh, checkpoint, eval, run), composed into `Config`.
The model and data sections live beside the code they configure (`aiinfra_jax.models.config`,
`aiinfra_jax.data.config`); this module composes them and owns the machinery:

* `load_config(preset, overrides)`: a preset is a Python file defining `CONFIG` (a `Config`) or
  `config() -> Config`, or a YAML file holding a nested mapping of the fields it changes from the
  defaults. Overrides are `section.field=value` strings (`--set model.d_model=256`).
* Unknown keys, wrong types and inconsistent combinations raise `ConfigError` (a ValueError) naming the
  key, the value and the valid choices, before anything is compiled.
* `to_dict` / `from_dict` round-trip a config through JSON (written beside the run's outputs and into
  every checkpoint).
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import importlib.util
import json
import logging
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.errors import UserError
from aiinfra_jax.models.config import Components, ModelConfig, is_runtime
from aiinfra_jax.models.registry import component_configs

log = logging.getLogger(__name__)


class ConfigError(UserError, ValueError):
    """A configuration that cannot run; the message names the key and the fix."""


def _check(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r}: {why}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up and a decay schedule; global-norm clipping; weight-decay mask."""

    lr: float = 1e-3
    schedule: str = "cosine"  # "cosine" | "linear" | "constant" (after warm-up)
    warmup_steps: int = 50
    decay_steps: int = 0  # 0 = decay over run.steps
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only: never to norms, biases or scalars
    grad_clip: float = 1.0  # global-norm clipping; 0 = off
    grad_accum: int = 1  # micro-batches per optimizer step (the global batch is split evenly)
    # The objective: lm_weight * mean token NLL + aux_weight * the model's auxiliary losses (each
    # already weighted by its component's own setting, e.g. model.msa.routing_loss_weight).
    # loss_stages: ((start_step, lm_weight, aux_weight), ...), increasing start steps > 0: from
    # the step after start_step (state step >= start_step, as data.stages) those weights replace
    # the previous ones. MSA's paper schedule, a warm-up on the routing loss then the LM:
    # lm_weight=0.1, aux_weight=1.0, loss_stages=((400, 1.0, 0.1),) with routing_loss_weight=1.
    lm_weight: float = 1.0
    aux_weight: float = 1.0
    loss_stages: tuple[tuple[int, float, float], ...] = ()

    def __post_init__(self):
        # inf / nan pass the comparisons below (or fail them with a misleading reason); refuse them
        # first, for every float setting (inf as lr trains NaN from the first step).
        for f in dataclasses.fields(self):
            if f.type not in ("float", float):
                continue
            value = getattr(self, f.name)
            try:
                finite = not isinstance(value, bool) and math.isfinite(value)
            except TypeError:
                finite = False
            _check(finite, f"optim.{f.name}", value,
                   f"must be a finite number; set optim.{f.name} to a finite value (default "
                   f"{f.default!r})")
        _check(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        _check(self.eps > 0, "optim.eps", self.eps, "must be > 0 (Adam divides by sqrt(v) + eps)")
        _check(self.schedule in ("cosine", "linear", "constant"), "optim.schedule", self.schedule,
               "valid choices: 'cosine', 'linear', 'constant'")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _check(self.decay_steps >= 0, "optim.decay_steps", self.decay_steps, "must be >= 0")
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio,
               "must be in [0, 1]")
        _check(0 <= self.b1 < 1 and 0 <= self.b2 < 1, "optim.b1/b2", (self.b1, self.b2),
               "must be in [0, 1)")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        _check(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "must be >= 0 (0 = off)")
        _check(self.grad_accum >= 1, "optim.grad_accum", self.grad_accum, "must be >= 1")
        if isinstance(self.loss_stages, list):
            object.__setattr__(self, "loss_stages", tuple(tuple(st) for st in self.loss_stages))
        previous = 0
        for i, (lm, aux) in enumerate([(self.lm_weight, self.aux_weight)]
                                      + [st[1:] for st in self.loss_stages
                                         if isinstance(st, tuple) and len(st) == 3]):
            _check(all(isinstance(w, (int, float)) and not isinstance(w, bool)
                       and math.isfinite(w) and w >= 0 for w in (lm, aux)) and lm + aux > 0,
                   "optim.lm_weight/aux_weight" if i == 0 else f"optim.loss_stages[{i - 1}]",
                   (lm, aux), "weights must be finite numbers >= 0, not both 0")
        for i, st in enumerate(self.loss_stages):
            ok = (isinstance(st, tuple) and len(st) == 3 and isinstance(st[0], int)
                  and not isinstance(st[0], bool) and st[0] > previous)
            _check(ok, f"optim.loss_stages[{i}]", st,
                   "must be (start_step, lm_weight, aux_weight) with start steps > 0 and "
                   f"increasing (the previous starts at {previous}), e.g. (400, 1.0, 0.1)")
            previous = st[0]

    def loss_schedule(self) -> tuple[tuple[int, float, float], ...]:
        """((0, lm_weight, aux_weight),) + loss_stages: every stage of the objective's weights."""
        return ((0, float(self.lm_weight), float(self.aux_weight)),) + tuple(
            (int(s), float(lm), float(aux)) for s, lm, aux in self.loss_stages)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: one named axis per field marked `mesh_axis`, in mesh order (outermost first;
    the innermost axes get the fastest links, so tensor, which talks every layer, is last). Each is
    a size, or -1 on one axis for 'all remaining devices'. Adding an axis is adding a field here
    (and its rules in aiinfra_jax.sharding); nothing else lists them.

    data: pure data parallelism. fsdp: data parallelism with parameters and optimizer state sharded
    over it (ZeRO-3). expert: expert parallelism inside MoE layers, data parallelism elsewhere.
    context: the sequence dimension split (context parallelism). tensor: Megatron-style tensor
    parallelism over heads and the FFN's hidden dimension.

    Multi-process runs (several hosts, or several processes on one host; README, "Multi-process
    and multi-host runs"): `distributed` says whether to start JAX's distributed runtime
    (`jax.distributed.initialize`, in `aiinfra_jax.sharding.maybe_initialize_distributed`).
    "auto" starts it when this process is told where the coordinator is (`coordinator_address`
    or JAX_COORDINATOR_ADDRESS) or runs in a multi-process SLURM, Open MPI or TPU-pod job (which
    JAX detects by itself); "on" always starts it; "off" never. `coordinator_address` ("host:port"
    of process 0), `num_processes` and `process_id` are launch settings, not part of the run:
    unset, they come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, then from
    the cluster; a run directory's config.json and checkpoints store them unset
    (`without_launch`). `init_timeout_s`: how long processes wait for each other, at start and at
    the run's meeting points (run directory, config check, data state); `heartbeat_timeout_s`:
    after how long without a heartbeat a process counts as dead, and the others stop.
    """

    data: int = dataclasses.field(default=-1, metadata={"mesh_axis": True})
    fsdp: int = dataclasses.field(default=1, metadata={"mesh_axis": True})
    expert: int = dataclasses.field(default=1, metadata={"mesh_axis": True})
    context: int = dataclasses.field(default=1, metadata={"mesh_axis": True})
    tensor: int = dataclasses.field(default=1, metadata={"mesh_axis": True})
    num_devices: int = 0  # 0 = every visible device; n = the first n (tests, debugging)
    distributed: str = "auto"  # "auto" | "on" | "off": see the class docstring
    coordinator_address: str = ""  # "host:port" of process 0; "" = JAX_COORDINATOR_ADDRESS / cluster
    num_processes: int = 0  # 0 = JAX_NUM_PROCESSES / the cluster's count
    process_id: int = -1  # -1 = JAX_PROCESS_ID / the cluster's rank
    init_timeout_s: int = 300
    heartbeat_timeout_s: int = 100

    @classmethod
    def axis_names(cls) -> tuple[str, ...]:
        """The mesh axes, in mesh order (the fields marked `mesh_axis`)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("mesh_axis"))

    def axis_sizes(self) -> dict[str, int]:
        """{axis: configured size} in mesh order; -1 = the rest of the devices."""
        return {name: getattr(self, name) for name in self.axis_names()}

    def __post_init__(self):
        sizes = self.axis_sizes()
        for name, v in sizes.items():
            _check(v == -1 or v >= 1, f"mesh.{name}", v, "must be a positive size or -1 (the rest)")
        _check(sum(v == -1 for v in sizes.values()) <= 1, "mesh", sizes,
               "at most one axis may be -1")
        _check(self.num_devices >= 0, "mesh.num_devices", self.num_devices, "must be >= 0")
        _check(self.distributed in ("auto", "on", "off"), "mesh.distributed", self.distributed,
               "valid choices: 'auto', 'on', 'off'")
        _check(not self.coordinator_address or self.coordinator_address.rpartition(":")[2]
               .isdigit(), "mesh.coordinator_address", self.coordinator_address,
               "must be 'host:port' (process 0's address and a free port), or '' (unset)")
        _check(self.num_processes >= 0, "mesh.num_processes", self.num_processes,
               "must be >= 1, or 0 (unset)")
        _check(self.process_id >= -1 and (self.num_processes == 0
                                          or self.process_id < self.num_processes),
               "mesh.process_id", self.process_id,
               "must be in 0..num_processes-1, or -1 (unset)")
        for key in ("init_timeout_s", "heartbeat_timeout_s"):
            _check(getattr(self, key) >= 1, f"mesh.{key}", getattr(self, key), "must be >= 1")

    def without_launch(self) -> MeshConfig:
        """This mesh without the launch settings (coordinator, process count and id): what a run
        directory stores, so that a resume or an evaluation is launched by its own settings."""
        return dataclasses.replace(self, coordinator_address="", num_processes=0, process_id=-1)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200  # steps between saves; 0 = only at the end (and on SIGTERM/Ctrl-C)
    keep: int = 3  # newest checkpoints kept
    async_save: bool = True
    # Start a new run from another run's checkpoint (levanter's initialize_from): a run directory
    # (its newest checkpoint), its checkpoints folder, or one step folder (runs/NAME/checkpoints/400).
    # The whole training state is taken (params, optimizer state, step; the data stream too when the
    # data section is unchanged), so the run goes on from that step under this config: the model
    # section may differ where the state keeps its shapes (e.g. nsa.window_heads), and every
    # difference is printed. Read only; the source run is never written. A run that already has
    # checkpoints of its own resumes from them instead.
    # Parameters only, from another architecture or another framework (aiinfra_jax/surgery.py):
    # "hf:DIR" (a local Hugging Face Llama checkpoint) or "params:RUN" (a run of any model): the
    # tensors that fit are copied or adapted (dense attention -> NSA / gated-delta projections),
    # the rest initialised, every one listed in RUN_DIR/initialize.json; step 0, fresh optimizer.
    initialize_from: str = ""

    def __post_init__(self):
        _check(self.every >= 0, "checkpoint.every", self.every, "must be >= 0")
        _check(self.keep >= 1, "checkpoint.keep", self.keep, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 100  # steps between validation passes inside the loop; 0 = only at the end
    batches: int = 8  # validation batches per in-loop pass
    final_batches: int = 32  # validation batches for the end-of-run perplexity; 0 = whole split
    position_buckets: int = 4  # token-position buckets for the per-position perplexity
    # Long-context tasks (aiinfra_jax.eval.longctx) inside the loop: every longctx_every steps
    # (0 = never), greedy answers on a small grid, logged as longctx/<task>@<length>.
    longctx_every: int = 0
    longctx_tasks: tuple[str, ...] = ("niah",)  # task names or groups ("niah", "all")
    longctx_lengths: tuple[int, ...] = ()  # prompt lengths in tokens; () = data.seq_len
    longctx_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    longctx_samples: int = 1

    def __post_init__(self):
        for key in ("every", "batches", "final_batches"):
            v = getattr(self, key)
            _check(v >= 0, f"eval.{key}", v, "must be >= 0")
        _check(self.batches >= 1, "eval.batches", self.batches, "must be >= 1")
        _check(self.position_buckets >= 1, "eval.position_buckets", self.position_buckets,
               "must be >= 1")
        _check(self.longctx_every >= 0, "eval.longctx_every", self.longctx_every,
               "must be >= 0 (0 = never)")
        _check(self.longctx_samples >= 1, "eval.longctx_samples", self.longctx_samples,
               "must be >= 1")
        _check(all(0 <= d <= 1 for d in self.longctx_depths), "eval.longctx_depths",
               self.longctx_depths, "depths are fractions in [0, 1]")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "tiny"
    output_dir: str = "runs"  # runs go to output_dir/name (or name-2, name-3, ... see `resume`)
    steps: int = 600
    seed: int = 0
    log_every: int = 10
    # "auto": resume the newest unfinished run of this name; a finished one is left alone and a new
    #         run directory (name-2, ...) is started. "never": always a new run directory.
    #         "require": resume, and fail if there is no checkpoint.
    resume: str = "auto"
    run_dir: str = ""  # explicit run directory (overrides output_dir/name and the -2 suffixes)
    progress: bool = True

    def __post_init__(self):
        _check(bool(self.name) and self.name not in (".", "..")
               and not any(c in self.name for c in "/\\*?[]"), "run.name", self.name,
               "must be a file name: not empty, '.' or '..', without '/', '\\', '*', '?', '[' or ']'")
        _check(self.steps >= 1, "run.steps", self.steps, "must be >= 1")
        _check(self.log_every >= 1, "run.log_every", self.log_every, "must be >= 1")
        _check(self.resume in ("auto", "never", "require"), "run.resume", self.resume,
               "valid choices: 'auto', 'never', 'require'")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()

    def __post_init__(self):
        b, acc = self.data.batch_size, self.optim.grad_accum
        _check(b % acc == 0, "optim.grad_accum", acc,
               f"must divide data.batch_size={b} (each micro-batch gets batch_size/grad_accum rows)")
        seq, max_seq = self.data.seq_len, self.model.max_seq_len
        _check(seq >= 2, "data.seq_len", seq,
               "must be >= 2: a row of T tokens gives T - 1 (input, next-token target) pairs; set "
               "data.seq_len=2 or more")
        _check(seq <= max_seq, "data.seq_len", seq,
               f"exceeds model.max_seq_len={max_seq}, the longest sequence the model (its caches, "
               f"generation at the training length) handles; set model.max_seq_len={seq} or more "
               f"(a run-time setting: a checkpoint may be resumed with a larger one), or lower "
               f"data.seq_len to {max_seq}")
        self._check_msa_sources()

    def _check_msa_sources(self) -> None:
        """An MSA model's ``synthetic:msa_*`` rows must start their query where the model expects
        it and hold no more documents than its slots (else those rows train on NaN outputs)."""
        if "msa" not in self.model.mixers:
            return
        from aiinfra_jax.data.synthetic_msa import parse_msa_spec  # data code: import on need

        msa = self.model.msa
        for spec in self.data.sources:
            if not spec.startswith("synthetic:msa_"):
                continue
            _, options = parse_msa_spec(spec)
            _check(options.query_offset == msa.resolved_query_offset, "data.sources", spec,
                   f"its query_offset={options.query_offset} differs from the model's "
                   f"model.msa.resolved_query_offset={msa.resolved_query_offset} (query_offset, or "
                   f"top_k when unset), where the model's memory-bank queries start; add "
                   f"query_offset={msa.resolved_query_offset} to the source's options")
            _check(options.docs <= msa.max_documents, "data.sources", spec,
                   f"its docs={options.docs} exceeds model.msa.max_documents="
                   f"{msa.max_documents}: the MSA layers would refuse those rows (NaN outputs); "
                   f"lower docs or raise model.msa.max_documents")


# ----------------------------------------------------------------------------- (de)serialisation


def to_dict(cfg) -> dict:
    """A JSON-able nested dict (tuples become lists; component configs appear under their keys,
    model.nsa.*, like fields)."""
    return json.loads(json.dumps(_asdict(cfg)))


def _asdict(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if isinstance(v, Components):
                out.update({key: _asdict(c) for key, c in v.items()})
            else:
                out[f.name] = _asdict(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_asdict(v) for v in value]
    return value


def from_dict(d: dict, cls=Config):
    """Inverse of `to_dict`, with the same key and type checks as overrides."""
    return _build(cls, d, prefix="")


def _field_types(cls) -> dict[str, Any]:
    """Settable keys of a config class and their types; a `components` field stands for the
    registered component configs (ModelConfig: model.nsa, model.attnres, ...)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if hints[f.name] is Components:
            out.update(component_configs())
        else:
            out[f.name] = hints[f.name]
    return out


def runtime_keys(cls=Config, prefix: str = "") -> frozenset[str]:
    """Dotted keys of the fields that say how a model runs, not what it computes (declared with
    models.config.runtime_field): a checkpoint may be restored or evaluated with other values."""
    keys = set()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, tp in _field_types(cls).items():
        if name in fields and is_runtime(fields[name]):
            keys.add(prefix + name)
        elif dataclasses.is_dataclass(tp):
            keys |= runtime_keys(tp, f"{prefix}{name}.")
    return frozenset(keys)


# Keys that older config.json files hold, and what they became: (section class, old key) ->
# function(value) -> {new key: value}. Read with a logged note, never silently dropped.
_RENAMED = {
    # model.attention_impl (None | "xla" | "cudnn" | "flash") became the dense mixer's own config.
    (ModelConfig, "attention_impl"): lambda v: {"dense": (
        {"kernel": "flash_attention"} if v == "flash" else {"implementation": v})},
}


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}.{hint} Valid keys here: {', '.join(valid)}")


def _build(cls, values: dict, prefix: str, base=None):
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of fields, got "
                          f"{type(values).__name__}")
    types_ = _field_types(cls)
    kwargs = {}
    values = _rename_old_keys(cls, values, prefix)
    for key, value in values.items():
        if key not in types_:
            raise _unknown_key(prefix + key, sorted(types_))
        kwargs[key] = _coerce(types_[key], value, prefix + key,
                              getattr(base, key) if base is not None else None)
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e


def canonical_section(section: str, value: dict) -> dict:
    """A saved config section (a dict from an older run's config.json) as this version writes it:
    renamed keys under their new names, settings added since then at their defaults. Nothing is
    validated (a checkpoint's config is compared, not run), so it never fails."""
    cls = _field_types(Config)[section]

    def merge(tp, default, saved):
        if not isinstance(saved, dict) or not isinstance(default, dict):
            return saved
        saved = _rename_old_keys(tp, saved, "", quiet=True) if dataclasses.is_dataclass(tp) \
            else saved
        types_ = _field_types(tp) if dataclasses.is_dataclass(tp) else {}
        out = dict(default)
        for k, v in saved.items():
            out[k] = merge(types_.get(k), default.get(k), v)
        return out

    return merge(cls, to_dict(cls()), value)


def _rename_old_keys(cls, values: dict, prefix: str, quiet: bool = False) -> dict:
    """values with keys that older runs wrote read as this version's: renamed ones (_RENAMED) under
    their new names, retired ones (a section's RETIRED_FIELDS) dropped; each logged unless quiet."""
    retired = getattr(cls, "RETIRED_FIELDS", {})
    for key in sorted(retired.keys() & values.keys()):
        if not quiet:
            log.warning("config: %s%s=%r is ignored: %s", prefix, key, values[key], retired[key])
    values = {k: v for k, v in values.items() if k not in retired}
    renamed = {k: v for k, v in values.items() if (cls, k) not in _RENAMED}
    for key in values.keys() - renamed.keys():
        new = _RENAMED[(cls, key)](values[key])
        if not quiet:
                log.warning("config: %s%s=%r is read as %s (its name in older runs)", prefix, key,
                        values[key], ", ".join(f"{prefix}{k}={v!r}" for k, v in new.items()))
        for k, v in new.items():
            if isinstance(v, dict) and isinstance(renamed.get(k), dict):
                v = {**v, **renamed[k]}
            renamed[k] = v
    return renamed


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp, value, key: str, current=None):
    """Checks (and, for strings from the command line, parses) `value` against annotation `tp`."""
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", base=current)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key, current)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}={value!r}: expected {_type_name(tp)}")
    if origin is tuple:
        args = typing.get_args(tp)
        nested = any(typing.get_origin(a) is tuple for a in args)
        if isinstance(value, str) and nested:
            # Nested sequences from the command line are YAML flow lists: [[500, [1, 0]], ...].
            try:
                value = yaml.safe_load(value.replace("(", "[").replace(")", "]"))
            except yaml.YAMLError as e:
                raise ConfigError(f"{key}={value!r}: expected a nested list, e.g. [[500, [1, 0]]] "
                                  f"({e})") from e
        elif isinstance(value, str):
            # Comma-separated; an entry that itself holds commas goes in double quotes:
            # data.sources=embedded,"synthetic:copy:repeats=5,num_chars=64".
            body = value.strip()
            if body[:1] + body[-1:] in ("()", "[]"):
                body = body[1:-1]
            try:
                rows = list(csv.reader([body], skipinitialspace=True, strict=True))
            except csv.Error as e:
                raise ConfigError(f"{key}={value!r}: cannot split into a list ({e}); separate "
                                  'entries with commas and quote one with commas inside: a,"b,c"') from e
            value = [v.strip() for v in (rows[0] if rows else []) if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list ({_type_name(tp)}), e.g. a,b,c")
        if args and args[-1] is not Ellipsis:  # fixed length: tuple[int, str]
            if len(value) != len(args):
                raise ConfigError(f"{key}={value!r}: expected {len(args)} entries ({_type_name(tp)})")
            return tuple(_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        elem = args[0] if args else str
        return tuple(_coerce(elem, v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0",
                                                         "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}={value!r}: expected a bool (true/false)")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected an int")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}={value!r}: expected an int")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected a float")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):  # YAML 1.1 reads unquoted on/off/yes/no/true/false as bools
            raise ConfigError(f"{key}={value!r}: expected a string; YAML read an unquoted on/off, "
                              "yes/no or true/false as a bool: quote it in the file, e.g. 'off'")
        raise ConfigError(f"{key}={value!r}: expected a string")
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


# ----------------------------------------------------------------------------- presets, overrides


def _nest(overrides: list[str]) -> dict:
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. model.d_model=256")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = nested
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is set twice, once as a value")
        node[parts[-1]] = value.strip()
    return nested


def load_preset(path: str | Path) -> Config:
    """A preset: a .py file with `CONFIG` or `config()`, or a .yaml/.yml/.json file of changed fields."""
    path = Path(path)
    if not path.exists():
        # `--config configs/tiny` is accepted for configs/tiny.py or configs/tiny.yaml.
        for suffix in (".py", ".yaml", ".yml", ".json"):
            if path.with_suffix(suffix).exists():
                path = path.with_suffix(suffix)
                break
        else:
            presets = sorted(p.name for p in Path("configs").glob("*.*")) if Path("configs").is_dir() else []
            raise ConfigError(f"config preset {str(path)!r} does not exist"
                              + (f"; presets in configs/: {', '.join(presets)}" if presets else ""))
    if path.suffix == ".py":
        spec = importlib.util.spec_from_file_location(f"aiinfra_preset_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            cfg = module.config() if hasattr(module, "config") else getattr(module, "CONFIG", None)
        except SyntaxError as e:
            raise ConfigError(f"config preset {str(path)!r}, line {e.lineno}: Python syntax error "
                              f"({e.msg}); fix the file") from e
        except (ValueError, TypeError) as e:  # a value the config classes refuse (ConfigError too)
            raise ConfigError(f"config preset {str(path)!r}: {e}; fix the preset") from e
        if cfg is None:
            raise ConfigError(f"preset {path}: define CONFIG = Config(...) or def config() -> Config")
        if not isinstance(cfg, Config):
            raise ConfigError(f"preset {path}: CONFIG must be an aiinfra_jax.config.Config, got "
                              f"{type(cfg).__name__}")
        return cfg
    if path.suffix in (".yaml", ".yml", ".json"):
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:  # JSON is YAML: a broken .json lands here too
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"config preset {str(path)!r}{where}: not valid YAML/JSON "
                              f"({getattr(e, 'problem', None) or e}); fix the file") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config preset {str(path)!r}: expected a mapping of sections "
                              f"(model:, data:, ...), got a {type(data).__name__}")
        return _build(Config, data, prefix="", base=Config())
    raise ConfigError(f"config preset {str(path)!r}: expected a .py, .yaml, .yml or .json file")


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    if not overrides:
        return cfg
    return _build(Config, _nest(list(overrides)), prefix="", base=cfg)


def load_config(preset: str | Path | None = None, overrides=()) -> Config:
    cfg = load_preset(preset) if preset else Config()
    return apply_overrides(cfg, overrides)


def load_run_config(run_dir: str | Path, overrides=()) -> Config:
    """The config a run directory was trained with (the config.json train.py writes there), with
    ``overrides`` applied; FileNotFoundError naming the directory when it has none."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json); pass the "
                                "directory that train.py printed (runs/NAME)")
    return apply_overrides(from_dict(json.loads(path.read_text())), list(overrides))


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")
