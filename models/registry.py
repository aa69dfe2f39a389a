"""Name -> class registries for token mixers, FFNs and residual schemes.

Adding a new mixer is one new file plus a decorator; the trainer and the Transformer never change:

    @register_mixer("nsa")
    class NSAttention(nnx.Module): ...

Shape letters: B batch, T new tokens in this call, S cache slots (max_len), D d_model,
H query heads, K (Hkv) key/value heads, Dh head_dim.

Interfaces (duck-typed; every registered class must follow them):

Mixer -- `cls(cfg: ModelConfig, *, rngs: nnx.Rngs)`
  `__call__(x [B,T,D], *, positions [B,T] int32, segment_ids [B,T] int32 | None, cache=None)
      -> (y [B,T,D], new_cache)`
      Without a cache (training): causal attention restricted to equal segment ids (0 = padding is
      its own segment); new_cache is None.
      With a cache (prefill / decode): the T new tokens are written at each row's current length;
      each query attends to the cached slots < its row's length plus its own causal prefix among
      the new tokens. segment_ids, when given, marks which new tokens are real (nonzero) and which
      are right padding (0); a row's length grows by its number of real tokens (all T when None),
      so the next call overwrites the padding. A row whose real tokens do not fit in the cache's
      max_len slots is refused, never written past the end: nothing of it is stored, its length
      stays and its outputs are NaN (models/attention/dense.py: cache_room, refuse_rows).
  `init_cache(batch, max_len, dtype) -> pytree` (dense: {"k","v": [B,K,S,Dh], "lengths": [B] int32})
  `after_build(model)`: optional classmethod, called once by the Transformer after it is built, for
      what a mixer cannot set without its layer index (a mixer is built without one, and with
      scan_layers the repeats of a block share one structure): MSA sets its routing layers here.
  `flops_per_token(seq_len) -> float`: forward FLOPs per token at this context length (projection
      matmuls + attention score/value terms), so sparse mixers are counted honestly.
  `from_dense(cfg, dense) -> {name: (array, dense name, how)}`: optional classmethod, for
      architecture surgery (aiinfra_jax/surgery.py): what a dense attention layer's parameters
      (dense: {"wq", "wk", "wv", "wo"} host arrays) give this mixer's parameters; the rest keep their
      initialisation. NSA and the gated-delta mixers define it; a mixer whose parameters share the
      dense names and shapes (MSA's wq/wk/wv/wo) needs none.

FFN -- `cls(cfg, *, rngs)`; `__call__(x [B,T,D], *, segment_ids [B,T] int32 | None = None,
      rngs: nnx.Rngs | None = None) -> y [B,T,D]`; `flops_per_token() -> float`.
      segment_ids marks padding (0) so that it never votes in a router; rngs is given only in
      training (router noise / jitter are drawn from it; None = deterministic).

Residual scheme -- a per-layer module `cls(cfg, *, rngs)` with
  `init_carry(cfg, x_embed) -> carry`   classmethod, called once per model with the embeddings
  `sublayer_input(carry, k) -> h`       k = 0 for the mixer, 1 for the FFN (the layer norms h)
  `update(carry, out, k) -> carry`      fold the sublayer output into the carry
  `finalize(cfg, carry) -> x [B,T,D]`   classmethod, model level, before the final norm
  `make_final(cfg, *, rngs) -> module`  optional classmethod: a model-level module (for example
      Attention Residuals' final aggregation query) that replaces `finalize`; the Transformer
      stores it as `residual_final` and calls it with the carry.
  The carry is any pytree; it flows through the layer scan.
  Optional, for a carry that is a large write-once buffer (Attention Residuals): classmethods
  `rebuilds(cfg) -> bool`, `snapshot(cfg, carry) -> small pytree` and
  `rebuild_carry(cfg, final_carry, snapshot) -> carry`; training then runs the layer scans of
  models/rebuilding.py, which keep one buffer instead of one per layer (`update` and
  `sublayer_input` must not report auxiliary outputs there).

Auxiliary outputs (every kind): a component reports losses, metrics and diagnostic arrays from its
`__call__` with models/auxiliary.py (`report_loss`, `report_metric`, `record`: Flax's `sow`); the
Transformer collects them per layer through the layer scan and remat. Non-parameter state a module
keeps (an `nnx.Variable` that is not an `nnx.Param`, e.g. a routing bias updated outside the
gradient) is carried, returned by the training step, and checkpointed.

Component configs: a component with settings registers a frozen dataclass under a key with
`@register_config("nsa")`, in its own file; `ModelConfig` then has it as `cfg.nsa` (defaults filled
in), `--set model.nsa.window=256` reaches it, and it round-trips through config.json. Fields marked
`runtime_field(...)` (models/config.py) say how the model runs, not what it computes (kernel
implementation, remat, ...): a checkpoint may be restored or evaluated with other values.
"""

from __future__ import annotations

from typing import Callable, TypeVar

MIXERS: dict[str, type] = {}
FFNS: dict[str, type] = {}
RESIDUALS: dict[str, type] = {}

CONFIGS: dict[str, type] = {}  # component config key -> frozen dataclass (model.<key>.*)

_KINDS = {"mixer": MIXERS, "ffn": FFNS, "residual": RESIDUALS, "config": CONFIGS}

C = TypeVar("C", bound=type)


def _register(kind: str, name: str) -> Callable[[C], C]:
    table = _KINDS[kind]
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_{kind}: name must be a non-empty string, got {name!r}")

    def decorator(cls: C) -> C:
        if name in table and table[name] is not cls:
            owner = f"{table[name].__module__}.{table[name].__qualname__}"
            raise ValueError(f"register_{kind}: {name!r} is already registered to {owner}; "
                             "pick another name")
        table[name] = cls
        return cls

    return decorator


def register_mixer(name: str) -> Callable[[C], C]:
    """Class decorator: makes a token mixer available as `ModelConfig(mixers=(name, ...))`."""
    return _register("mixer", name)


def register_ffn(name: str) -> Callable[[C], C]:
    """Class decorator: makes an FFN available as `ModelConfig(ffns=(name, ...))`."""
    return _register("ffn", name)


def register_residual(name: str) -> Callable[[C], C]:
    """Class decorator: makes a residual scheme available as `ModelConfig(residual=name)`."""
    return _register("residual", name)


def register_config(key: str) -> Callable[[C], C]:
    """Class decorator for a component's frozen config dataclass: it becomes `ModelConfig.<key>`
    (`--set model.<key>.<field>=...`), defaults filled in when a config does not set it."""
    return _register("config", key)


def load_builtins() -> None:
    """Imports the modules that register the built-in mixers, FFNs and residual schemes."""
    from . import layers, residual  # noqa: F401  (registration side effects)
    from . import attention  # noqa: F401


def _get(kind: str, name: str) -> type:
    load_builtins()
    table = _KINDS[kind]
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; registered {kind}s: {sorted(table)}")
    return table[name]


def get_mixer(name: str) -> type:
    return _get("mixer", name)


def get_ffn(name: str) -> type:
    return _get("ffn", name)


def get_residual(name: str) -> type:
    return _get("residual", name)


def component_configs() -> dict[str, type]:
    """Registered component config classes by key (model.<key>), built-ins loaded."""
    load_builtins()
    return dict(CONFIGS)


def registered(kind: str) -> list[str]:
    """Sorted registered names of one kind: 'mixer', 'ffn', 'residual' or 'config'."""
    load_builtins()
    return sorted(_KINDS[kind])
