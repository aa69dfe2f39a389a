"""A trained model for inference, without the trainer: `load_model(source)`.

    from aiinfra_jax.load import load_model
    loaded = load_model("runs/nsa_tiny")                       # newest checkpoint of a run
    loaded = load_model("runs/nsa_tiny/checkpoints/400",       # one step, run-time settings changed
                        overrides=["model.nsa.implementation=xla", "model.remat=none"])
    logits, _, _ = loaded.model(tokens, positions=positions)

`source` is a run directory, its checkpoints folder, or one step folder. The configuration comes
from the checkpoint itself (every checkpoint stores the run's resolved config), so a checkpoint
folder copied without its run directory loads too. Only the parameters (and the model's
non-parameter state, if it keeps any) are read: the optimizer state is never touched, so loading
costs the model's size, not three times it.

Overrides may change any run-time setting of the model (`runtime_keys()`: kernel implementation,
remat, compute dtype, cache size, ...) and the non-model sections (mesh, data, eval); a change to
what defines the trained function (sizes, architecture) is refused naming the key, since the
parameters would not fit it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import jax
from flax import nnx

from aiinfra_jax import sharding as shd
from aiinfra_jax.checkpoint import Checkpointer, config_differences
from aiinfra_jax.config import Config, ConfigError, apply_overrides, from_dict, runtime_keys, \
    to_dict
from aiinfra_jax.data.tokenizer import Tokenizer, load_tokenizer
from aiinfra_jax.models import Transformer
from aiinfra_jax.steps import abstract_model, merge_model


@dataclasses.dataclass
class LoadedModel:
    """What `load_model` returns: the model with its parameters, its tokenizer, the resolved
    config (overrides applied), the checkpoint step, and the mesh the parameters live on."""

    model: Transformer
    tokenizer: Tokenizer
    config: Config
    step: int
    mesh: jax.sharding.Mesh


def checkpoint_source(spec: str | Path, what: str = "source") -> tuple[Path, int | None]:
    """(checkpoints folder, step or None = newest) named by a run directory, its checkpoints
    folder, or one step folder (runs/NAME/checkpoints/400); `what` names the setting in errors."""
    path = Path(spec).expanduser()
    step = None
    if (path / "checkpoints").is_dir():  # a run directory, whatever its name (runs/123 too)
        path = path / "checkpoints"
    elif path.name.isdigit() and path.is_dir():
        path, step = path.parent, int(path.name)
    if not path.is_dir():
        raise ConfigError(f"{what}={str(spec)!r}: no such directory; pass a run directory "
                          "(runs/NAME), its checkpoints folder, or one step folder "
                          "(runs/NAME/checkpoints/400)")
    return path, step


def load_model(source: str | Path, *, step: int | None = None,
               overrides: Sequence[str] = ()) -> LoadedModel:
    """Loads a model for inference from a run or checkpoint (see the module docstring).

    Raises ConfigError for a bad source or override, NoCheckpointError when the source holds no
    committed checkpoint, and the Checkpointer's errors for corrupt or mismatching files."""
    folder, source_step = checkpoint_source(source)
    if step is not None and source_step is not None and step != source_step:
        raise ConfigError(f"step {step} was asked for, but {source} is the folder of step "
                          f"{source_step}: name the run directory with the step, or the step "
                          "folder alone")
    step = step if step is not None else source_step
    with Checkpointer(folder, config={}, async_save=False, read_only=True) as reader:
        step, saved = reader.saved_config(step)
        cfg = _resolve(saved, overrides, f"{folder}/{step}")
        mesh = shd.make_mesh(cfg.mesh)
        graphdef, abstract_params, rest = abstract_model(cfg.model, cfg.run.seed)
        wanted = {"params": _with_shardings(abstract_params, mesh)}
        if jax.tree.leaves(rest):
            wanted["model_state"] = _with_shardings(rest, mesh)
        restored, _ = reader.restore_subtree(wanted, step, compare=())
    model = merge_model(graphdef, abstract_params, rest, restored["params"],
                        restored.get("model_state"))
    return LoadedModel(model=model, tokenizer=load_tokenizer(cfg.data.tokenizer), config=cfg,
                       step=step, mesh=mesh)


def _resolve(saved: dict, overrides: Sequence[str], where: str) -> Config:
    try:
        saved_cfg = from_dict(saved)
        cfg = apply_overrides(saved_cfg, list(overrides))
    except ConfigError as e:
        raise ConfigError(f"checkpoint {where}: {e}") from e
    fixed = config_differences(to_dict(saved_cfg), to_dict(cfg), ("model",), skip=runtime_keys())
    if fixed:
        raise ConfigError(f"overrides change what the checkpoint {where} was trained as; only "
                          "run-time settings of the model may change (e.g. model.nsa."
                          "implementation, model.remat, model.dtype):\n" + "\n".join(fixed))
    return cfg


def _with_shardings(abstract_state: Any, mesh) -> dict:
    """Plain-dict ShapeDtypeStructs carrying the shardings the logical-axis rules give."""
    shardings = shd.param_shardings(abstract_state, mesh)
    shapes = nnx.to_pure_dict(abstract_state)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
