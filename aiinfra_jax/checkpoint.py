"""Checkpointing: a thin wrapper over orbax's CheckpointManager with loud, explicit failure modes.

Every checkpoint is one step folder ``<directory>/<step>/`` holding three orbax items:

- ``state``:  the training state, an arbitrary pytree of ``jax.Array`` (params, optimizer state, step),
  written with ``StandardSave`` (OCDBT + zarr, checksummed, sharded arrays written by their owners);
- ``data``:   ``{"data_state": <JSON dict or null>}``, e.g. the grain iterator state;
- ``config``: the resolved run config (a JSON-able dict), so a resume can check it is compatible.

Saves are asynchronous by default: ``save`` returns once the arrays are copied to host memory, the
write happens in a background thread, and ``wait()`` / ``close()`` block until it is committed. Orbax
writes into ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>`` only when complete, and it
deletes checkpoints beyond ``keep`` only after the newer one is committed, so an interrupted save
never costs the last good checkpoint.

Failure modes (never a silent start from scratch):

- a folder left by an interrupted save (``*.orbax-checkpoint-tmp*``) is ignored by ``latest_step`` and
  reported with a warning in the log;
- a directory that holds files but no checkpoint at all -> ``ValueError`` at construction;
- opened ``read_only`` (to read another run's checkpoints): a missing directory, or one without a
  committed checkpoint -> ``NoCheckpointError`` (a ``FileNotFoundError``) at construction; nothing
  there is created, saved or deleted;
- a committed step with missing or corrupt files -> ``CorruptCheckpointError`` (a ``RuntimeError``)
  naming the step folder and the fix;
- a saved config whose ``model`` section differs from the current one in what defines the trained
  function -> ``IncompatibleCheckpointError`` (a ``ValueError``) listing each differing key with its
  old and new value (run-time settings such as the kernel implementation or remat may differ; the
  differences are logged);
- a saved state whose tree structure, shapes or dtypes differ from ``abstract_state`` ->
  ``IncompatibleCheckpointError`` naming the first mismatching path.

Tree paths in messages are written ``params/layers/0/attn/wq`` (dict keys, sequence indices and
attribute names joined by ``/``).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Collection, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from aiinfra_jax.config import canonical_section, runtime_keys

__all__ = [
    "Checkpointer",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "NoCheckpointError",
    "check_compatible",
    "config_differences",
]

logger = logging.getLogger(__name__)

_ITEM_STATE = "state"
_ITEM_DATA = "data"
_ITEM_CONFIG = "config"
_ITEMS = (_ITEM_STATE, _ITEM_DATA, _ITEM_CONFIG)
# Orbax names a step folder that is still being written (or whose save was interrupted)
# "<step>.orbax-checkpoint-tmp" (older releases append "-<timestamp>").
_TMP_MARKER = ".orbax-checkpoint-tmp"
_PARTIAL_RE = re.compile(r"^(?:.*_)?(\d+)" + re.escape(_TMP_MARKER))
_STEP_RE = re.compile(r"^(0|[1-9]\d*)$")


class CorruptCheckpointError(RuntimeError):
    """A committed checkpoint cannot be read (missing or damaged files)."""


class IncompatibleCheckpointError(ValueError):
    """A readable checkpoint does not fit the current run (config or state structure differs)."""


class NoCheckpointError(FileNotFoundError, ValueError):
    """A checkpoint directory is missing (opened read-only) or holds no committed checkpoint; a
    FileNotFoundError for the CLIs' handlers and a ValueError as ``restore`` always raised."""


# --------------------------------------------------------------------------------------------------
# Config compatibility
# --------------------------------------------------------------------------------------------------

_MISSING = "<missing>"


def _json_normalise(value: Any) -> Any:
    """What ``value`` becomes after a JSON round trip (tuples -> lists, int keys -> str keys)."""
    return json.loads(json.dumps(value))


def _flatten_dict(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        if not value:
            return {prefix: {}}
        flat: dict[str, Any] = {}
        for key, sub in value.items():
            flat.update(_flatten_dict(sub, f"{prefix}.{key}"))
        return flat
    return {prefix: value}


def _canonical(config: dict, section: str) -> Any:
    """``config[section]`` as this version writes it (``canonical_section``), so a checkpoint from
    before a setting was added or renamed compares equal where nothing really changed."""
    value = config.get(section, _MISSING)
    return canonical_section(section, value) if isinstance(value, dict) else value


def config_differences(saved_config: dict, config: dict, sections: Sequence[str], *,
                       skip: Collection[str] = (), only: Collection[str] | None = None
                       ) -> list[str]:
    """One line per dotted key of ``sections`` whose value differs between ``saved_config`` and
    ``config`` (compared after a JSON round trip, so a tuple equals the list it was saved as);
    keys in ``skip`` are left out, and with ``only`` just those keys are compared."""
    if isinstance(sections, str):
        raise TypeError(f"sections must be a sequence of section names, got the string {sections!r}")
    saved = _json_normalise(saved_config)
    current = _json_normalise(config)
    if not isinstance(saved, dict) or not isinstance(current, dict):
        raise TypeError(
            f"configs must be dicts, got {type(saved_config).__name__} and {type(config).__name__}"
        )
    diffs: list[str] = []
    for section in sections:
        old = _flatten_dict(_canonical(saved, section), section)
        new = _flatten_dict(_canonical(current, section), section)
        for key in sorted(set(old) | set(new)):
            if key in skip or (only is not None and key not in only):
                continue
            old_value, new_value = old.get(key, _MISSING), new.get(key, _MISSING)
            if old_value != new_value:
                diffs.append(f"  {key}: checkpoint {old_value!r}, current {new_value!r}")
    return diffs


def check_compatible(
    saved_config: dict,
    config: dict,
    sections: Sequence[str] = ("model",),
    *,
    source: str = "the checkpoint",
) -> None:
    """Raises ``IncompatibleCheckpointError`` if ``saved_config`` and ``config`` differ in ``sections``
    in anything but run-time settings (``runtime_keys``: kernel implementation, remat, compute
    dtype, ...), whose differences are logged instead.

    The error lists every differing dotted key (``config_differences``) with its saved
    ("checkpoint") and current value; ``source`` names where ``saved_config`` came from.
    """
    runtime = runtime_keys()
    allowed = config_differences(saved_config, config, sections, only=runtime)
    if allowed:
        logger.warning("%s: run-time settings differ from the saved ones (allowed):\n%s", source,
                       "\n".join(allowed))
    diffs = config_differences(saved_config, config, sections, skip=runtime)
    if diffs:
        raise IncompatibleCheckpointError(
            f"{source} was written with a different {'/'.join(sections)} config than the current run; "
            f"{len(diffs)} key(s) differ:\n" + "\n".join(diffs) + "\n"
            "Fix: run with the checkpoint's settings (they are saved in its 'config' item), or start "
            "the new configuration in a fresh checkpoint directory."
        )


# --------------------------------------------------------------------------------------------------
# Tree helpers
# --------------------------------------------------------------------------------------------------


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path_str(path: tuple) -> str:
    return "/".join(_key_name(k) for k in path) or "<root>"


def _flatten_by_path(tree: Any) -> dict[str, Any]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_path_str(path): leaf for path, leaf in leaves}


def _to_abstract(abstract_state: Any) -> Any:
    """Checks ``abstract_state`` leaves and turns concrete ``jax.Array`` leaves into ShapeDtypeStructs."""

    def convert(path: tuple, leaf: Any) -> jax.ShapeDtypeStruct:
        if isinstance(leaf, jax.Array):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            if getattr(leaf, "sharding", None) is None:
                raise ValueError(
                    f"abstract_state leaf {_path_str(path)!r} has no sharding; build it as "
                    "jax.ShapeDtypeStruct(shape, dtype, sharding=...) (or pass the initialised state) "
                    "so the checkpoint is restored onto the intended devices"
                )
            return leaf
        raise TypeError(
            f"abstract_state leaf {_path_str(path)!r} is a {type(leaf).__name__}; expected "
            "jax.ShapeDtypeStruct (with .sharding) or jax.Array"
        )

    return jax.tree_util.tree_map_with_path(convert, abstract_state)


def _first_structure_mismatch(saved: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """Describes the first path where the saved metadata and the wanted abstract state differ."""
    problems: list[str] = []
    for path, want in wanted.items():
        if path not in saved:
            problems.append(f"{path!r} is in the current state but not in the checkpoint")
            continue
        have = saved[path]
        have_shape = tuple(getattr(have, "shape", ()) or ())
        if have_shape != tuple(want.shape):
            problems.append(f"{path!r} has shape {have_shape} in the checkpoint, {tuple(want.shape)} now")
            continue
        have_dtype = getattr(have, "dtype", None)
        if have_dtype is not None and np.dtype(have_dtype) != np.dtype(want.dtype):
            problems.append(
                f"{path!r} has dtype {np.dtype(have_dtype).name} in the checkpoint, "
                f"{np.dtype(want.dtype).name} now"
            )
    for path in saved:
        if path not in wanted:
            problems.append(f"{path!r} is in the checkpoint but not in the current state")
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more mismatching path(s))" if len(problems) > 1 else ""
    return problems[0] + more


# --------------------------------------------------------------------------------------------------
# Checkpointer
# --------------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores ``(state, data_state, config)`` in ``directory``; see the module docstring.

    Args:
      directory: the run's checkpoint folder (created if missing). It must be empty, absent, or hold
        checkpoints written by this class; anything else is an error.
      config: the resolved run config (JSON-able dict); written into every checkpoint and compared
        (``model`` section) with the saved one on restore.
      keep: how many most recent committed checkpoints to keep (>= 1).
      async_save: write in a background thread (call ``wait()``/``close()`` before exiting).
      save_every: ``save()`` writes only when ``step % save_every == 0`` (or ``force=True``);
        0 means every call to ``save()`` writes (the caller decides the cadence).
      read_only: only restore (another run's checkpoints, or a finished run's): the directory must
        exist and hold a committed checkpoint (else ``NoCheckpointError``), and nothing in it is
        created, saved or deleted (``save`` raises).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        config: dict,
        keep: int = 3,
        async_save: bool = True,
        save_every: int = 0,
        read_only: bool = False,
    ) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (checkpoints to keep), got {keep!r}")
        if not isinstance(save_every, int) or isinstance(save_every, bool) or save_every < 0:
            raise ValueError(
                f"save_every must be an int >= 0 (0 = save on every call), got {save_every!r}"
            )
        if not isinstance(config, dict):
            raise TypeError(f"config must be a JSON-able dict, got {type(config).__name__}")
        try:
            self._config = _json_normalise(config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"config must be JSON-serialisable to be stored in checkpoints: {e}") from e

        self.directory = Path(directory).expanduser().resolve()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {self.directory} exists and is not a directory")
        self.keep = keep
        self.async_save = async_save
        self.save_every = save_every
        self.read_only = read_only
        if read_only and not self.directory.is_dir():
            raise NoCheckpointError(f"no checkpoint directory {self.directory}")

        self._partial = self._scan_directory()
        options = ocp.CheckpointManagerOptions(
            # (read-only: the values orbax would otherwise replace, with a warning each)
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else 1,  # cadence is decided in save()
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=False,  # an interrupted save is reported, and replaced on re-save
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                _ITEM_STATE: ocp.StandardCheckpointHandler(),
                _ITEM_DATA: ocp.JsonCheckpointHandler(),
                _ITEM_CONFIG: ocp.JsonCheckpointHandler(),
            },
        )
        if read_only and self._manager.latest_step() is None:
            self._manager.close()
            raise self._no_checkpoint()

    # ---------------------------------------------------------------- directory inspection

    def _scan_directory(self) -> list[Path]:
        """Logs partial folders; raises if the directory holds files but no checkpoint at all."""
        if not self.directory.exists():
            return []
        entries = sorted(self.directory.iterdir())
        partial = [p for p in entries if _PARTIAL_RE.match(p.name)]
        steps = [p for p in entries if p.is_dir() and _STEP_RE.match(p.name)]
        for p in partial:
            logger.warning(
                "ignoring %s: a checkpoint folder left by an interrupted save (never committed); "
                "it is replaced if that step is saved again, and can be deleted",
                p,
            )
        others = [p for p in entries if p not in partial and p not in steps]
        if not steps and others and not self.read_only:  # read-only: NoCheckpointError instead
            names = ", ".join(p.name for p in others[:5]) + (" ..." if len(others) > 5 else "")
            raise ValueError(
                f"checkpoint directory {self.directory} holds files but no checkpoint ({names}); "
                "refusing to start from scratch there. Fix: point the checkpoint directory at an "
                "empty or new folder, or move those files away."
            )
        if steps and others:
            logger.warning(
                "checkpoint directory %s holds entries that are not checkpoints: %s",
                self.directory,
                ", ".join(p.name for p in others),
            )
        return partial

    def _no_checkpoint(self) -> NoCheckpointError:
        names = ", ".join(p.name for p in self._partial)
        return NoCheckpointError(f"no committed checkpoint in {self.directory}"
                                 + (f" (only interrupted saves: {names})" if self._partial else "")
                                 + "; check the path, or train to save one")

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none (partial folders are ignored)."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All committed steps, ascending."""
        return sorted(self._manager.all_steps())

    # ---------------------------------------------------------------- save

    def save(self, step: int, state: Any, data_state: dict | None, *, force: bool = False) -> bool:
        """Saves ``state`` (pytree of arrays), ``data_state`` (JSON dict or None) and the config.

        Returns True if a save was started; False when ``step`` is not on the ``save_every`` cadence
        (and ``force`` is False) or when ``step`` is already saved. Saving a step older than the
        newest one in the directory is a ``ValueError`` (a later resume would skip it). With ``async_save`` the write
        continues in the background; arrays are copied to host before this returns, so the caller
        may donate or overwrite them.
        """
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        step = int(step)
        if self.read_only:
            raise RuntimeError(f"{self.directory} was opened read-only; nothing is saved there")
        if not force and self.save_every > 0 and step % self.save_every != 0:
            return False
        existing = self._manager.all_steps()
        if step in existing:
            logger.info("checkpoint for step %d already exists in %s; not saving it again", step, self.directory)
            return False
        if existing and step < max(existing):
            raise ValueError(
                f"cannot save step {step} into {self.directory}: it already holds the newer step "
                f"{max(existing)}, which a resume would pick instead (and keep={self.keep} could delete "
                "this one first). Fix: move the newer checkpoints away, or save into a new directory."
            )
        if data_state is not None and not isinstance(data_state, dict):
            raise TypeError(f"data_state must be a JSON-able dict or None, got {type(data_state).__name__}")
        try:
            data_item = _json_normalise({"data_state": data_state})
        except (TypeError, ValueError) as e:
            raise ValueError(f"data_state must be JSON-serialisable: {e}") from e
        for path, leaf in _flatten_by_path(state).items():
            if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
                raise TypeError(
                    f"state leaf {path!r} is a {type(leaf).__name__}; the checkpointed state must be a "
                    "pytree of arrays"
                )
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    _ITEM_STATE: ocp.args.StandardSave(state),
                    _ITEM_DATA: ocp.args.JsonSave(data_item),
                    _ITEM_CONFIG: ocp.args.JsonSave(self._config),
                }
            ),
            force=True,
        )
        if saved:
            logger.info("checkpoint for step %d %s in %s", step, "started" if self.async_save else "saved", self.directory)
        return bool(saved)

    def wait(self) -> None:
        """Blocks until any in-flight asynchronous save is committed (re-raises its error)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- restore

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _corrupt(self, step: int, what: str, err: BaseException | None = None) -> CorruptCheckpointError:
        others = [s for s in self.all_steps() if s != step]
        pick = f" or restore another step ({', '.join(map(str, others))})" if others else ""
        detail = ""
        if err is not None:  # tensorstore appends a long JSON spec; keep the readable head
            text = str(err).split(" [tensorstore_spec", 1)[0].strip()
            detail = f": {type(err).__name__}: {text[:400]}{'...' if len(text) > 400 else ''}"
        return CorruptCheckpointError(
            f"checkpoint step {step} at {self._step_dir(step)} is unreadable ({what}){detail}\n"
            f"Fix: move that folder out of {self.directory} (the previous checkpoint is then used){pick}."
        )

    def restore(self, abstract_state: Any, step: int | None = None, *,
                compare: Sequence[str] = ("model",)) -> tuple[Any, dict | None, dict]:
        """Restores ``(state, data_state, saved_config)`` from ``step`` (default: the latest).

        ``compare``: the config sections that must equal the saved ones (default ``model``); a
        caller that accepts other settings passes ``()`` and reads ``saved_config`` itself (the
        state's tree structure, shapes and dtypes are checked either way).

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with ``.sharding`` (or of
        ``jax.Array``, whose shapes, dtypes and shardings are used); arrays are restored directly
        into those shardings. Raises ``NoCheckpointError`` (a ValueError) when there is nothing to
        restore, ``ValueError`` for a step that was not saved,
        ``IncompatibleCheckpointError`` for a config or tree mismatch and
        ``CorruptCheckpointError`` for unreadable files.
        """
        step, saved_config = self._checked_step(step, compare)
        wanted = _to_abstract(abstract_state)
        self._check_structure(step, wanted, partial=False)

        # The arrays and the data-pipeline state.
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        _ITEM_STATE: ocp.args.StandardRestore(wanted),
                        _ITEM_DATA: ocp.args.JsonRestore(),
                    }
                ),
            )
        except Exception as e:
            raise self._corrupt(step, "cannot read its 'state' or 'data' item", e) from e
        data_item = restored[_ITEM_DATA]
        if not isinstance(data_item, dict) or "data_state" not in data_item:
            raise self._corrupt(step, "its 'data' item has no 'data_state' entry")
        logger.info("restored checkpoint step %d from %s", step, self.directory)
        return restored[_ITEM_STATE], data_item["data_state"], saved_config

    def restore_subtree(self, abstract_subtree: Any, step: int | None = None, *,
                        compare: Sequence[str] = ("model",)) -> tuple[Any, dict]:
        """Restores only part of the saved state, ``(subtree, saved_config)``: ``abstract_subtree``
        names the top-level entries wanted (e.g. ``{"params": ...}`` for inference: the optimizer
        state is never read). Same checks and errors as ``restore`` for what it reads."""
        step, saved_config = self._checked_step(step, compare)
        wanted = _to_abstract(abstract_subtree)
        self._check_structure(step, wanted, partial=True)
        restore_args = jax.tree.map(
            lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape,
                                           dtype=s.dtype), wanted)
        try:
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
                subtree = reader.restore(
                    self._step_dir(step) / _ITEM_STATE,
                    args=ocp.args.PyTreeRestore(wanted, restore_args=restore_args,
                                                partial_restore=True))
        except Exception as e:
            raise self._corrupt(step, "cannot read its 'state' item", e) from e
        logger.info("restored %s of checkpoint step %d from %s", sorted(wanted), step,
                    self.directory)
        return subtree, saved_config

    def saved_config(self, step: int | None = None) -> tuple[int, dict]:
        """(step, the config saved with it) of ``step`` (default: the latest), nothing compared."""
        return self._checked_step(step, ())

    def _checked_step(self, step: int | None, compare: Sequence[str]) -> tuple[int, dict]:
        """(the step to restore, its saved config), after the config check."""
        self.wait()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise self._no_checkpoint()
            step = steps[-1]
        elif step not in steps:
            raise ValueError(
                f"no committed checkpoint for step {step} in {self.directory}; available steps: "
                f"{steps or 'none'}"
            )
        # The config first (small, and it decides whether the rest is worth reading).
        try:
            saved_config = self._manager.restore(
                step, args=ocp.args.Composite(**{_ITEM_CONFIG: ocp.args.JsonRestore()})
            )[_ITEM_CONFIG]
        except Exception as e:  # orbax/tensorstore raise many types; all mean "cannot read"
            raise self._corrupt(step, "cannot read its 'config' item", e) from e
        if not isinstance(saved_config, dict):
            raise self._corrupt(step, f"its 'config' item is a {type(saved_config).__name__}, not a dict")
        check_compatible(saved_config, self._config, compare,
                         source=f"checkpoint step {step} at {self._step_dir(step)}")
        return step, saved_config

    def _check_structure(self, step: int, wanted: Any, *, partial: bool) -> None:
        """The saved state's tree structure, shapes and dtypes (orbax's metadata) against
        ``wanted``; with ``partial``, saved entries ``wanted`` does not ask for are ignored."""
        try:
            metadata = self._manager.item_metadata(step)[_ITEM_STATE]
        except Exception as e:
            raise self._corrupt(step, "cannot read the metadata of its 'state' item", e) from e
        if metadata is None:
            raise self._corrupt(step, "the metadata of its 'state' item (state/_METADATA) is missing")
        saved_leaves = _flatten_by_path(getattr(metadata, "tree", metadata))
        wanted_leaves = _flatten_by_path(wanted)
        if partial:
            tops = {path.split("/", 1)[0] for path in wanted_leaves}
            saved_leaves = {p: v for p, v in saved_leaves.items() if p.split("/", 1)[0] in tops}
        mismatch = _first_structure_mismatch(saved_leaves, wanted_leaves)
        if mismatch is not None:
            raise IncompatibleCheckpointError(
                f"checkpoint step {step} at {self._step_dir(step)} does not match the state to restore "
                f"into: {mismatch}.\nFix: build the model/optimizer with the settings the checkpoint "
                "was written with, or start in a fresh checkpoint directory."
            )
