"""Run directories: where a run goes, where it starts from, and how a finished one is read back.

- ``choose_run_dir``: the directory of a new or resumed run, by ``run.resume`` (a finished run,
  one with summary.json, is never reused).
- ``initialize_from``: the state another run's checkpoint hands a new run
  (``checkpoint.initialize_from``; the source is named as ``aiinfra_jax.load.checkpoint_source``
  reads it).
- ``restore_run``: a (trainer, state) pair from a run directory's checkpoint, for evaluations that
  need the trainer (a model alone: ``aiinfra_jax.load.load_model``).
"""

from __future__ import annotations

from pathlib import Path

import jax

from aiinfra_jax.checkpoint import Checkpointer, NoCheckpointError, config_differences
from aiinfra_jax.config import Config, ConfigError, load_run_config, to_dict
from aiinfra_jax.load import checkpoint_source
from aiinfra_jax.trainer import Trainer


def _is_finished(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists()


def choose_run_dir(cfg: Config) -> tuple[Path, bool]:
    """(run directory, whether to resume in it), by run.resume; never reuses a finished run."""
    if cfg.run.run_dir:
        d = Path(cfg.run.run_dir)
        has_ckpt = any((d / "checkpoints").glob("*")) if (d / "checkpoints").exists() else False
        if cfg.run.resume == "require" and not has_ckpt:
            raise ConfigError(f"run.resume='require' but {d} holds no checkpoint")
        if cfg.run.resume == "never" and d.exists() and any(d.iterdir()):
            raise ConfigError(f"run.run_dir={str(d)!r} already holds a run and run.resume='never': "
                              f"choose another run.run_dir (nothing is overwritten)")
        return d, has_ckpt
    base = Path(cfg.run.output_dir)
    name = cfg.run.name
    existing = sorted(
        (p for p in base.glob(f"{name}*") if p.is_dir() and
         (p.name == name or (p.name.startswith(name + "-") and p.name[len(name) + 1:].isdigit()))),
        key=lambda p: 1 if p.name == name else int(p.name[len(name) + 1:]))
    if cfg.run.resume in ("auto", "require") and existing:
        newest = existing[-1]
        if (newest / "checkpoints").exists() and not _is_finished(newest):
            return newest, True
    if cfg.run.resume == "require":
        raise ConfigError(f"run.resume='require' but no unfinished run named {name!r} with a "
                          f"checkpoint is in {base}")
    if not existing:
        return base / name, False
    last = existing[-1]
    k = 1 if last.name == name else int(last.name[len(name) + 1:])
    return base / f"{name}-{k + 1}", False


def initialize_from(trainer: Trainer, say) -> tuple[dict, dict | None]:
    """(state, data_state) of the checkpoint named by checkpoint.initialize_from (see
    CheckpointConfig). Config differences are allowed where the state keeps its tree, shapes and
    dtypes (checked by the restore) and printed; the data stream goes on only when the data
    section is unchanged, else it starts at its first batch."""
    cfg = trainer.cfg
    spec = cfg.checkpoint.initialize_from
    folder, step = checkpoint_source(spec, "checkpoint.initialize_from")
    try:
        source = Checkpointer(folder, config=to_dict(cfg), async_save=False, read_only=True)
    except NoCheckpointError as e:
        raise ConfigError(f"checkpoint.initialize_from={spec!r}: {e}; pass a run directory that "
                          "has saved one") from e
    try:
        state, data_state, saved = source.restore(trainer.abstract_state(), step, compare=())
    finally:
        source.close()
    start = int(jax.device_get(state["step"]))
    if start >= cfg.run.steps:
        raise ConfigError(f"checkpoint.initialize_from={spec!r} is at step {start} and run.steps="
                          f"{cfg.run.steps}: nothing left to train; raise run.steps")
    current = to_dict(cfg)
    diffs = config_differences(saved, current, ("model", "optim"))
    say(f"initialized from {folder} step {start}; model/optim differences from it: "
        + ("none" if not diffs else "\n" + "\n".join(diffs)))
    data_diffs = config_differences(saved, current, ("data",))
    if data_diffs:
        say("the data section differs from the checkpoint's, so the data stream starts at its "
            "first batch:\n" + "\n".join(data_diffs))
        data_state = None
    return state, data_state


def restore_run(run_dir: str | Path, *, step: int | None = None, overrides=()):
    """(trainer, state) of a run directory's checkpoint for an evaluation that needs the trainer
    (its data pipeline and eval step, e.g. eval.perplexity); state holds "params", "step" and the
    model's "model_state" if it keeps any; the optimizer state is not read. Overrides may change
    data/mesh/eval and the model's run-time settings (aiinfra_jax.load.load_model, for a model
    alone). A changed model section is rejected by the checkpoint's compatibility check."""
    run_dir = Path(run_dir)
    trainer = Trainer(load_run_config(run_dir, overrides))
    with Checkpointer(run_dir / "checkpoints", config=to_dict(trainer.cfg), async_save=False,
                      read_only=True) as ckpt:  # NoCheckpointError (a FileNotFoundError) if none
        abstract = trainer.abstract_state()
        wanted = {k: v for k, v in abstract.items() if k in ("params", "step", "model_state")}
        state, _ = ckpt.restore_subtree(wanted, step=step)
    return trainer, state
