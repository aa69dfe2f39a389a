"""ModelConfig: the frozen description of a Transformer (sizes, layer pattern, dtypes, remat).

Layer pattern: the block of P = lcm(len(mixers), len(ffns)) layers (layer i uses
mixers[i % len(mixers)] and ffns[i % len(ffns)]) is repeated n_layers / P times.

Component settings (NSA, Attention Residuals, dense attention, and whatever registers later) are not
fields of this class: each component registers its own frozen dataclass beside its code with
`@register_config("nsa")` (models/registry.py), and ModelConfig holds one instance per registered
key in `components`, reachable as `cfg.nsa`, built with `ModelConfig(nsa=NSAConfig(...))` or
`dataclasses.replace(cfg, nsa=...)`, and written to config.json as `model.nsa.*` like a field.

What defines the trained function (sizes, architecture, parameter dtype) is kept apart from how it
runs: fields declared with `runtime_field` (compute dtype, remat, kernel implementations, cache
sizes, loss weights) may differ between a checkpoint and the run that restores or evaluates it;
`runtime_keys()` in aiinfra_jax/config.py lists them, and the checkpoint check skips them (printing
the difference).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

DTYPES = ("float32", "bfloat16")
# The one kernel-backend vocabulary of every component's `implementation` field: None = the best
# available for the platform the model is lowered for; "xla" runs everywhere; "pallas_gpu" and
# "pallas_tpu" are the Pallas kernels; "cudnn" only where a component says it accepts it (dense
# attention through jax.nn.dot_product_attention).
IMPLEMENTATIONS = (None, "xla", "pallas_gpu", "pallas_tpu", "cudnn")
# jax.checkpoint_policies members that are policies themselves (not factories needing arguments).
REMAT_POLICIES = ("everything_saveable", "nothing_saveable", "dots_saveable", "checkpoint_dots",
                  "dots_with_no_batch_dims_saveable", "checkpoint_dots_with_no_batch_dims")


def runtime_field(default: Any, **kwargs) -> Any:
    """A config field that says how the model runs, not what it computes (see the module doc)."""
    return dataclasses.field(default=default, metadata={"runtime": True}, **kwargs)


def is_runtime(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("runtime"))


def check_implementation(owner: str, value: Any, allowed=IMPLEMENTATIONS[:4]) -> None:
    """ValueError unless `value` is one of `allowed` (a subset of IMPLEMENTATIONS)."""
    if value not in allowed:
        raise ValueError(f"{owner}.implementation={value!r}: valid choices: {allowed} (None = best "
                         "available for the platform the model is lowered for)")


def padded_vocab_size(tokenizer_size: int, multiple: int = 128) -> int:
    """The tokenizer's vocabulary size rounded up to a multiple of `multiple`."""
    if tokenizer_size <= 0:
        raise ValueError(f"tokenizer_size must be positive, got {tokenizer_size}")
    return -(-tokenizer_size // multiple) * multiple


def remat_choices() -> tuple[str, ...]:
    import jax
    available = tuple(p for p in REMAT_POLICIES if hasattr(jax.checkpoint_policies, p))
    return ("none", "full") + available


class Components(Mapping):
    """Component key -> its config dataclass instance; immutable and hashable (a ModelConfig is a
    static argument of jitted initialisers)."""

    def __init__(self, items: Mapping[str, Any] | None = None):
        self._items = dict(sorted(dict(items or {}).items()))

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return "Components(" + ", ".join(f"{k}={v!r}" for k, v in self._items.items()) + ")"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 0  # 0 = the tokenizer's size rounded up to 128 (filled in by the trainer)
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # None = d_model // n_heads
    d_ff: int | None = None  # None = 8/3 * d_model rounded up to a multiple of 64 (SwiGLU)
    mixers: tuple[str, ...] = ("dense",)
    ffns: tuple[str, ...] = ("swiglu",)
    residual: str = "standard"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    dtype: str = runtime_field("float32")  # compute dtype
    param_dtype: str = "float32"
    # "none" | "full" | a jax.checkpoint_policies name, e.g. "dots_saveable"
    remat: str = runtime_field("none")
    scan_layers: bool = True  # stacked [R, ...] parameters run by a scan (changes the param tree)
    # Layer-scan steps unrolled per loop iteration (jax.lax.scan's unroll; 0 = all: straight-line
    # code, the parameters still stacked). On the CPU a fully unrolled scan does not copy each
    # layer's activations into stacked residual buffers: the tiny preset's training step 1.24-1.28x
    # faster (eval/BENCHMARKS.md, "Training loop", 2026-12-07), for a compile that grows with depth.
    # Also the AttnRes rebuilding scans (models/rebuilding.py). Under remat (any policy) and in a
    # run over several processes the layers stay looped (models/transformer.py says why: unrolled,
    # remat "full" saved almost no memory).
    scan_unroll: int = runtime_field(1)
    init_std: float = 0.02
    max_seq_len: int = runtime_field(4096)  # used only for checks and cache sizes
    # Width W of a causal depthwise convolution (with a residual) on every mixer's input; 0 = off.
    # Gives attention the previous tokens directly, so induction / recall circuits form in one
    # layer (models/short_conv.py). fla's linear-attention layers and Canon layers use W = 4.
    short_conv: int = 0
    # Run-time settings that change during training, as data.stages and optim.loss_stages do:
    # ((start_step, {dotted run-time key: value, ...}), ...), start steps > 0 and increasing. From
    # the step after start_step (state step >= start_step) the stage's settings apply on top of
    # the earlier stages' and this config's own, e.g. ((700, {"msa.memory_negatives": 1}),): the
    # hardest in-batch documents join MSA's memory only after a copy stage. Only run-time fields
    # (runtime_field) can change: they leave the parameters as they are. The trainer compiles one
    # step per stage; loading a run for evaluation uses the settings above, not the stages'.
    stages: tuple[tuple[int, Any], ...] = runtime_field(())
    # Registered component configs by key (see the module docstring); filled with every registered
    # component's defaults. Pass them by key: ModelConfig(nsa=NSAConfig(window=256)).
    components: Components = dataclasses.field(default_factory=Components)

    def __post_init__(self):
        # Lists from YAML / CLI overrides become tuples so the config stays hashable.
        for name in ("mixers", "ffns"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if isinstance(value, list):
                value = tuple(value)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "components", self._resolve_components(self.components))
        self._validate()

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: component configs by key (cfg.nsa).
        components = self.__dict__.get("components")
        if components is not None and name in components:
            return components[name]
        raise AttributeError(f"ModelConfig has no field or component config {name!r}")

    @staticmethod
    def _resolve_components(given: Mapping[str, Any]) -> Components:
        from . import registry

        table = registry.component_configs()
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        out = {}
        for key, value in dict(given).items():
            if key not in table:
                raise ValueError(f"ModelConfig: unknown field or component config {key!r}; fields: "
                                 f"{sorted(fields - {'components'})}; component configs: "
                                 f"{sorted(table)}")
            if isinstance(value, Mapping):
                value = table[key](**value)
            if not isinstance(value, table[key]):
                raise ValueError(f"ModelConfig.{key}: expected a {table[key].__name__}, got "
                                 f"{type(value).__name__}")
            out[key] = value
        for key, cls in table.items():
            if key in fields:
                raise ValueError(f"component config key {key!r} ({cls.__name__}) clashes with the "
                                 "ModelConfig field of that name; register it under another key")
            out.setdefault(key, cls())
        return Components(out)

    def _fail(self, name: str, why: str) -> None:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: {why}")

    def _validate(self) -> None:
        from . import registry

        if not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            self._fail("vocab_size", "must be a non-negative int (0 = fill in from the tokenizer "
                       "with ModelConfig.with_vocab(tokenizer_size))")
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                self._fail(name, "must be a positive int")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                self._fail("n_heads", f"must divide d_model={self.d_model} when head_dim is None "
                           "(or set head_dim explicitly)")
        elif not isinstance(self.head_dim, int) or self.head_dim <= 0:
            self._fail("head_dim", "must be a positive int or None (= d_model // n_heads)")
        if self.resolved_head_dim % 2:
            self._fail("head_dim", f"resolved head_dim {self.resolved_head_dim} must be even "
                       "for RoPE")
        if self.n_heads % self.n_kv_heads:
            self._fail("n_kv_heads", f"must divide n_heads={self.n_heads} "
                       "(grouped-query attention)")
        for component in self.components.values():  # checks that need the model's sizes
            check = getattr(component, "check_model", None)
            if check is not None:
                check(self)
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or self.d_ff <= 0):
            self._fail("d_ff", "must be a positive int or None (= 8/3 d_model rounded up to 64)")
        for name, kind in (("mixers", "mixer"), ("ffns", "ffn")):
            names = getattr(self, name)
            if not names or not all(isinstance(n, str) for n in names):
                self._fail(name, f"must be a non-empty tuple of names; registered: "
                           f"{registry.registered(kind)}")
            unknown = [n for n in names if n not in registry.registered(kind)]
            if unknown:
                self._fail(name, f"unknown {kind} name(s) {unknown}; registered: "
                           f"{registry.registered(kind)}")
        if self.residual not in registry.registered("residual"):
            self._fail("residual", f"unknown residual scheme; registered: "
                       f"{registry.registered('residual')}")
        if self.n_layers % self.block_size:
            self._fail("n_layers", f"must be a multiple of lcm(len(mixers), len(ffns)) = "
                       f"{self.block_size} (mixers={self.mixers}, ffns={self.ffns})")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value <= 0):
                self._fail(name, "must be a positive finite number")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                self._fail(name, f"must be one of {DTYPES}")
        if self.remat not in remat_choices():
            self._fail("remat", f"must be one of {remat_choices()}")
        if not isinstance(self.short_conv, int) or isinstance(self.short_conv, bool) \
                or self.short_conv < 0:
            self._fail("short_conv", "must be an int >= 0 (the kernel width; 0 = no convolution, "
                       "4 is the usual choice)")
        if not isinstance(self.scan_unroll, int) or isinstance(self.scan_unroll, bool) \
                or self.scan_unroll < 0:
            self._fail("scan_unroll", "must be an int >= 0 (layer-scan steps per loop iteration; "
                       "1 = a plain loop, 0 = all layers unrolled)")
        for name in ("tie_embeddings", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "must be True or False")
        self._check_stages()

    def _check_stages(self) -> None:
        """Normalises stages to ((start, ((key, value), ...)), ...) (hashable) and checks that
        each names run-time settings whose values the settings' own checks accept."""
        stages = self.stages
        if not isinstance(stages, (list, tuple)):
            self._fail("stages", "must be a tuple of (start_step, {run-time key: value}) pairs")
        allowed = self.runtime_settings()
        out, previous = [], 0
        for i, stage in enumerate(stages):
            ok = isinstance(stage, (list, tuple)) and len(stage) == 2
            start, settings = stage if ok else (None, None)
            if isinstance(settings, (list, tuple)) and all(
                    isinstance(kv, (list, tuple)) and len(kv) == 2 for kv in settings):
                settings = dict(settings)  # the pairs config.json holds
            if not (ok and isinstance(start, int) and not isinstance(start, bool)
                    and start > previous and isinstance(settings, Mapping) and settings):
                raise ValueError(f"ModelConfig.stages[{i}]={stage!r}: must be (start_step, "
                                 "{run-time key: value, ...}) with start steps > 0 and increasing "
                                 f"(the previous starts at {previous}), e.g. (700, "
                                 "{'msa.memory_negatives': 1})")
            bad = sorted(k for k in settings if k not in allowed)
            if bad:
                raise ValueError(f"ModelConfig.stages[{i}]: {bad} are not run-time settings of "
                                 "this model (a stage cannot change what the parameters are); "
                                 f"run-time settings: {sorted(allowed)}")
            out.append((start, tuple(sorted(settings.items()))))
            previous = start
        object.__setattr__(self, "stages", tuple(out))
        for i in range(len(out)):
            try:
                self.at_step(out[i][0])
            except ValueError as e:
                raise ValueError(f"ModelConfig.stages[{i}]: {e}") from e

    def runtime_settings(self) -> frozenset[str]:
        """Dotted keys of this config's run-time fields ("remat", "msa.memory_negatives", ...),
        the ones model.stages may change; stages itself is not one of them."""
        keys = {f.name for f in dataclasses.fields(self) if is_runtime(f)} - {"stages"}
        for name, component in self.components.items():
            keys |= {f"{name}.{f.name}" for f in dataclasses.fields(component) if is_runtime(f)}
        return frozenset(keys)

    def stage_start(self, step: int) -> int:
        """The start step of the stage in force at state step `step` (0: none yet)."""
        return max([s for s, _ in self.stages if step >= s], default=0)

    def at_step(self, step: int) -> "ModelConfig":
        """This config with the settings of every stage started by state step `step` applied, in
        order, and no stages: the model the trainer runs at that step."""
        top: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {}
        for start, settings in self.stages:
            if step >= start:
                for key, value in settings:
                    head, _, tail = key.partition(".")
                    if tail:
                        nested.setdefault(head, {})[tail] = value
                    else:
                        top[key] = value
        parts = {head: dataclasses.replace(self.components[head], **values)
                 for head, values in nested.items()}
        return dataclasses.replace(self, stages=(), **top, **parts)

    # Derived sizes ---------------------------------------------------------------------------
    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        return -(-(8 * self.d_model) // (3 * 64)) * 64

    def mixer_at(self, i: int) -> str:
        """The token mixer of layer i (the pattern `mixers` cycled over the layers)."""
        return self.mixers[i % len(self.mixers)]

    @property
    def block_size(self) -> int:
        """P: layers in one repeated block, lcm(len(mixers), len(ffns))."""
        return math.lcm(len(self.mixers), len(self.ffns))

    @property
    def n_repeats(self) -> int:
        """How many times the block of P layers is repeated (the scan length)."""
        return self.n_layers // self.block_size

    def with_vocab(self, tokenizer_size: int, multiple: int = 128) -> "ModelConfig":
        """This config with vocab_size = tokenizer_size rounded up to `multiple` (if it was 0)."""
        if self.vocab_size:
            if self.vocab_size < tokenizer_size:
                raise ValueError(f"ModelConfig.vocab_size={self.vocab_size} is smaller than the "
                                 f"tokenizer's {tokenizer_size} tokens; raise it or set it to 0")
            return self
        return dataclasses.replace(self, vocab_size=padded_vocab_size(tokenizer_size, multiple))


def _init_with_components(init):
    """ModelConfig(..., nsa=NSAConfig(...)): keyword arguments that are not fields are component
    configs (checked in __post_init__); dataclasses.replace(cfg, nsa=...) goes through here too."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}

    def __init__(self, *args, components: Mapping[str, Any] | None = None, **kwargs):
        merged = dict(components or {})
        for key in [k for k in kwargs if k not in names]:
            merged[key] = kwargs.pop(key)
        init(self, *args, components=Components(merged), **kwargs)

    __init__.__doc__ = init.__doc__
    return __init__


ModelConfig.__init__ = _init_with_components(ModelConfig.__init__)
