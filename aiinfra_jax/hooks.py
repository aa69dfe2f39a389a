"""In-loop hooks: work the training loop runs every N steps without knowing what it is.

A hook is any object with

    name: str                                   what errors call it
    every: int                                  the loop calls it after every every-th step (>= 1)
    check(trainer) -> None                      run before the run directory or any checkpoint
                                                exists: refuse bad settings (ConfigError) there
    __call__(step, model, trainer) -> {str: float}   metrics, written to the run's logs at step

The loop calls a due hook after the step's log line and validation pass and before the next step,
with the nnx model of the current parameters; the next step takes those buffers over (they are
donated), so a hook must not keep the model. In a multi-process run every process calls every hook
at the same step (a hook may run computations over the whole mesh); the metrics of process 0 are
the ones logged.

Where hooks come from: ``train(cfg, hooks=[...])`` takes them as given. By default (``hooks=None``,
and so on the command line) the loop asks the installed packages: every entry point of the group
``aiinfra_jax.train_hooks`` is a factory ``factory(cfg) -> hook | None`` (None when the config does
not ask for that hook). aiinfra-jax registers the long-context evaluation there (pyproject.toml),
so the core runs it without ever importing ``aiinfra_jax.eval``, which imports the core.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from aiinfra_jax.config import Config, ConfigError

if TYPE_CHECKING:
    from flax import nnx

    from aiinfra_jax.trainer import Trainer

ENTRY_POINT_GROUP = "aiinfra_jax.train_hooks"

# Settings of the core config that only a hook carries out: (dotted setting, the hook's name). A run
# that sets one without that hook among its hooks is refused, never trained without it.
HOOK_SETTINGS = (("eval.longctx_every", "longctx"),)


class TrainHook(Protocol):
    name: str
    every: int

    def check(self, trainer: Trainer) -> None: ...

    def __call__(self, step: int, model: nnx.Module, trainer: Trainer) -> Mapping[str, float]: ...


def registered_hooks(cfg: Config) -> list[TrainHook]:
    """The hooks the installed packages register (see the module docstring) that ``cfg`` asks for."""
    hooks = []
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            factory = ep.load()
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"training hook {ep.name!r} ({ep.value}, entry point group "
                              f"{ENTRY_POINT_GROUP!r}) does not load: {e}") from e
        hook = factory(cfg)
        if hook is not None:
            hooks.append(hook)
    return hooks


def prepare_hooks(trainer: Trainer, hooks: Iterable[TrainHook] | None) -> list[TrainHook]:
    """The run's hooks (``None``: the registered ones), each checked against the run's settings."""
    cfg = trainer.cfg
    hooks = registered_hooks(cfg) if hooks is None else list(hooks)
    names = [h.name for h in hooks]
    if len(set(names)) != len(names):
        raise ConfigError(f"training hooks {names}: two share a name")
    for setting, name in HOOK_SETTINGS:
        value = _setting(cfg, setting)
        if value and name not in names:
            raise ConfigError(
                f"{setting}={value!r} needs the {name!r} training hook, which this run does not "
                f"have (its hooks: {names}). It is registered under the entry point group "
                f"{ENTRY_POINT_GROUP!r} of the installed aiinfra-jax: reinstall it (pip install "
                f"-e .), or pass it in train(cfg, hooks=[...])")
    for hook in hooks:
        if isinstance(hook.every, bool) or not isinstance(hook.every, int) or hook.every < 1:
            raise ConfigError(f"training hook {hook.name!r}: every={hook.every!r} must be an int >= 1")
        hook.check(trainer)
    return hooks


def _setting(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
