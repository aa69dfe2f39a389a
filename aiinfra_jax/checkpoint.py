"""Checkpointing: a thin wrapper over orbax's CheckpointManager with loud, explicit failure modes.

Every checkpoint is one step folder ``<directory>/<step>/`` holding four orbax items:

- ``state``:  the training state, an arbitrary pytree of ``jax.Array`` (params, optimizer state, step),
  written with ``StandardSave`` (OCDBT + zarr; sharded arrays written by their owners);
- ``data``:   ``{"data_state": <JSON dict or null>}``, e.g. the grain iterator state;
- ``config``: the resolved run config (a JSON-able dict), so a resume can check it is compatible;
- ``checksums``: a CRC32 of every array's bytes and of the two JSON items (see "Checksums").

Saves are asynchronous by default: ``save`` returns once the arrays are copied to host memory, the
write happens in a background thread, and ``wait()`` / ``close()`` block until it is committed. Orbax
writes into ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>`` only when complete, and it
deletes checkpoints beyond ``keep`` only after the newer one is committed, so an interrupted save
never costs the last good checkpoint.

Checksums. Neither OCDBT nor zarr protects the array bytes (a flipped byte in a data file is read back
as a different value, without any error), so this class does:

- what is hashed: at ``save``, before it returns, the bytes (C order) of every array shard this
  process holds (only replica 0 of a replicated shard), CRC32 each; a record per array of its shape,
  dtype and ``[(region, crc32)]``, a region being the shard's ``[start, stop)`` per dimension; and the
  CRC32 of the ``data`` and ``config`` JSON items (``sort_keys`` JSON). In a multi-process run the
  processes' records are gathered to process 0, which writes them. The regions are those of the
  sharding the state was saved with, so a restore into another sharding checks each region inside
  the restored shards (or the whole array, where this process holds all of it).
- where: the ``checksums`` JSON item of the same step folder, part of the same orbax save, so it is
  committed (renamed into place) with the arrays, never after them.
- when it is verified: by ``restore`` (every array read, plus the data and config items),
  ``restore_subtree`` (the arrays it read, plus the config), ``saved_config`` (the config), and
  ``verify(step)``, which reads a step back into host memory and checks everything. A mismatch is a
  ``CorruptCheckpointError`` naming the step, the array(s), and the other checkpoints of the
  directory after checking each of them (which still verify, which are damaged too).
- a step folder without a ``checksums`` item was written by an older version: it is restored with
  a logged warning (not verified), so existing runs keep resuming. One whose orbax metadata lists a
  ``checksums`` item that is missing is refused as corrupt.
- cost: a CRC32 (zlib, ~2 GB/s on one core) of the host copy of the state, inside ``save`` before
  it returns (the caller may donate the arrays afterwards), and one of the restored arrays in
  ``restore``: ~60 ms and ~50 ms per 100 MB of state on a CPU host (end to end, 0.3-0.6 s for a save
  and commit of 100 MB); no device memory, no compilation. A multi-process run adds two small
  all-gathers (the records at save, the verdict at restore) so that every process agrees.

Rotation never deletes the newest checkpoint that verified. "Verified" means: its arrays were read
back from its files and matched their checksums in this process -- by ``restore`` (a resume), by
``verify``, or by the rotation itself: when the next save would delete the newest verified step (or
none has verified yet and a step would be deleted), the newest committed step is first read back
into host memory and checked (newest first, down to the previous verified one); orbax's deletion
then keeps the newest ``keep`` steps and the newest verified one (a preservation policy).

Why this definition: trusting the newest committed step (what ``keep`` alone did) is how a damaged
checkpoint became "the last good one" while the good ones were rotated away; reading every
checkpoint back right after it is written doubles the I/O of every save, and a read straight after
a write mostly comes from the page cache. Reading a step back only when something older is about
to be deleted costs one read per ``keep - 1`` saves (every save with ``keep=1``), done in ``save``
before the new one starts (~0.4 s per 100 MB here), on files committed by an earlier save, and a
step that fails is logged as an error and never becomes the protected one. The protected step is
kept besides the newest ``keep``: with ``keep=1`` a training run holds two folders, and ``close()``
reads the newest back and, if it verifies, deletes the older one (a finished run holds ``keep``).
``verify_before_delete=False`` skips these read-backs (then only a step verified by
``restore``/``verify`` is protected).

Failure modes (never a silent start from scratch):

- a folder left by an interrupted save (``*.orbax-checkpoint-tmp*``) is ignored by ``latest_step`` and
  reported with a warning in the log;
- a directory that holds files but no checkpoint at all -> ``ValueError`` at construction;
- opened ``read_only`` (to read another run's checkpoints): a missing directory, or one without a
  committed checkpoint -> ``NoCheckpointError`` (a ``FileNotFoundError``) at construction; nothing
  there is created, saved or deleted;
- a committed step with missing, unreadable or damaged files (an array, or a JSON item, that does
  not match its checksum) -> ``CorruptCheckpointError`` (a ``RuntimeError``) naming the step folder,
  what is wrong, the other checkpoints that still verify, and the fix;
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
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from aiinfra_jax import checksums as cks
from aiinfra_jax.checkpoint_compat import (IncompatibleCheckpointError, check_compatible,
                                           config_differences, first_structure_mismatch,
                                           flatten_by_path, json_normalise, to_abstract)
from aiinfra_jax.errors import UserError

__all__ = [
    "Checkpointer",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "NoCheckpointError",
    "RestoreError",
    "check_compatible",
    "config_differences",
]

logger = logging.getLogger(__name__)

_ITEM_STATE = "state"
_ITEM_DATA = "data"
_ITEM_CONFIG = "config"
_ITEM_CHECKSUMS = "checksums"
_ITEMS = (_ITEM_STATE, _ITEM_DATA, _ITEM_CONFIG, _ITEM_CHECKSUMS)
_CHECKSUM_FORMAT = 1
_CHECKSUM_ALGORITHM = "crc32"
_STEP_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's per-step metadata (lists the step's items)
# Orbax names a step folder that is still being written (or whose save was interrupted)
# "<step>.orbax-checkpoint-tmp" (older releases append "-<timestamp>").
_TMP_MARKER = ".orbax-checkpoint-tmp"
_PARTIAL_RE = re.compile(r"^(?:.*_)?(\d+)" + re.escape(_TMP_MARKER))
_STEP_RE = re.compile(r"^(0|[1-9]\d*)$")


class CorruptCheckpointError(UserError, RuntimeError):
    """A committed checkpoint cannot be read (missing or damaged files)."""


class RestoreError(UserError, RuntimeError):
    """An intact checkpoint (read back and verified) that could not be restored into the arrays
    asked for: a mesh or sharding that does not fit, or memory. Nothing is wrong with its files."""


class NoCheckpointError(UserError, FileNotFoundError, ValueError):
    """A checkpoint directory is missing (opened read-only) or holds no committed checkpoint; a
    FileNotFoundError for the CLIs' handlers and a ValueError as ``restore`` always raised."""


# --------------------------------------------------------------------------------------------------
# Checkpointer
# --------------------------------------------------------------------------------------------------


class _Damaged(Exception):
    """Internal: what is wrong with a step (turned into a CorruptCheckpointError by the caller)."""


class _KeepNewestAndVerified:
    """Orbax preservation policy: the newest ``keep`` steps, and the newest step that verified
    (``protected()``, read when orbax decides what to delete, i.e. when a save starts)."""

    def __init__(self, keep: int, protected: Any):
        self.keep = keep
        self.protected = protected

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any = None) -> list[bool]:
        del context
        newest = set(sorted(c.step for c in checkpoints)[-self.keep:])
        protected = self.protected()
        return [c.step in newest or c.step == protected for c in checkpoints]


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
      verify_before_delete: before a save lets rotation delete the newest verified checkpoint,
        read the newest committed one back and check its checksums (module docstring, "Rotation");
        False: no read-backs (only steps verified by ``restore``/``verify`` are protected).
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
        verify_before_delete: bool = True,
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
            self._config = json_normalise(config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"config must be JSON-serialisable to be stored in checkpoints: {e}") from e

        self.directory = Path(directory).expanduser().resolve()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {self.directory} exists and is not a directory")
        self.keep = keep
        self.async_save = async_save
        self.save_every = save_every
        self.read_only = read_only
        self.verify_before_delete = verify_before_delete
        self._verified: int | None = None  # the newest step whose files matched their checksums
        self._bad: set[int] = set()  # steps that failed verification (never protected)
        self._saved = False  # this Checkpointer started a save
        self._unverifiable_logged: set[int] = set()
        if read_only and not self.directory.is_dir():
            raise NoCheckpointError(f"no checkpoint directory {self.directory}")

        self._partial = self._scan_directory()
        options = ocp.CheckpointManagerOptions(
            # keep: the newest `keep` steps and the newest verified one (read-only: none deleted)
            preservation_policy=None if read_only else _KeepNewestAndVerified(
                keep, lambda: self._verified),
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
                _ITEM_CHECKSUMS: ocp.JsonCheckpointHandler(),
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

    def latest_step(self, *, reload: bool = False) -> int | None:
        """The newest committed step, or None when there is none (partial folders are ignored).
        reload: list the folder again instead of trusting the manager's record, which a save
        interrupted after its commit (another process dying in the save's final barrier) leaves
        without the committed step. Reading the folder is local to this process."""
        if reload:
            self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All committed steps, ascending."""
        return sorted(self._manager.all_steps())

    @property
    def verified_step(self) -> int | None:
        """The newest step whose files matched their checksums in this process (restored, read
        back by ``verify`` or by rotation), or None; rotation never deletes it."""
        return self._verified

    # ---------------------------------------------------------------- save

    def save(self, step: int, state: Any, data_state: dict | None, *, force: bool = False) -> bool:
        """Saves ``state`` (pytree of arrays), ``data_state`` (JSON dict or None) and the config.

        Returns True if a save was started; False when ``step`` is not on the ``save_every`` cadence
        (and ``force`` is False) or when ``step`` is already saved. Saving a step older than the
        newest one in the directory is a ``ValueError`` (a later resume would skip it). With ``async_save`` the write
        continues in the background; arrays are copied to host before this returns, so the caller
        may donate or overwrite them. The arrays' checksums are computed before it returns and
        written with the step; when rotation would delete the newest verified step, the newest
        committed one is read back and checked first (module docstring).
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
            data_item = json_normalise({"data_state": data_state})
        except (TypeError, ValueError) as e:
            raise ValueError(f"data_state must be JSON-serialisable: {e}") from e
        for path, leaf in flatten_by_path(state).items():
            if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
                raise TypeError(
                    f"state leaf {path!r} is a {type(leaf).__name__}; the checkpointed state must be a "
                    "pytree of arrays"
                )
        # The checksums come from this process's host copy of the arrays, taken now (the caller may
        # donate them once save returns), and are committed with the step in the same orbax save.
        checksums = {
            "format": _CHECKSUM_FORMAT,
            "algorithm": _CHECKSUM_ALGORITHM,
            "arrays": cks.state_checksums(flatten_by_path(state)),
            "items": {_ITEM_DATA: cks.json_crc32(data_item),
                      _ITEM_CONFIG: cks.json_crc32(self._config)},
        }
        self._protect_before_rotation()
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    _ITEM_STATE: ocp.args.StandardSave(state),
                    _ITEM_DATA: ocp.args.JsonSave(data_item),
                    _ITEM_CONFIG: ocp.args.JsonSave(self._config),
                    _ITEM_CHECKSUMS: ocp.args.JsonSave(checksums),
                }
            ),
            force=True,
        )
        self._saved = self._saved or bool(saved)
        if saved:
            logger.info("checkpoint for step %d %s in %s", step, "started" if self.async_save else "saved", self.directory)
        return bool(saved)

    def wait(self) -> None:
        """Blocks until any in-flight asynchronous save is committed (re-raises its error)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources. When rotation kept an older
        verified step beyond ``keep`` (``keep=1``), the newest step is read back first and, if it
        verifies, the older one is deleted."""
        try:
            if self._saved and not self.read_only and self.verify_before_delete:
                self._manager.wait_until_finished()
                self._trim_after_verifying_newest()
        finally:
            self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- restore

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _corrupt(self, step: int, what: str, err: BaseException | None = None, *,
                 damaged: bool = False) -> CorruptCheckpointError:
        """The error for an unreadable (or, ``damaged``, checksum-failing) step: what is wrong, the
        other checkpoints here after checking each of them, and the fix."""
        detail = ""
        if err is not None:  # tensorstore appends a long JSON spec; keep the readable head
            text = str(err).split(" [tensorstore_spec", 1)[0].strip()
            detail = f": {type(err).__name__}: {text[:400]}{'...' if len(text) > 400 else ''}"
        statuses = self._other_statuses(step)
        if damaged:
            head = (f"checkpoint step {step} at {self._step_dir(step)} is damaged ({what}){detail}; "
                    "its files no longer hold what was saved, so it is refused rather than "
                    "restored with changed values")
        else:
            head = f"checkpoint step {step} at {self._step_dir(step)} is unreadable ({what}){detail}"
        parts = []
        for other, (status, why) in sorted(statuses.items(), reverse=True):
            if status == "good":
                parts.append(f"step {other} verifies (its checksums were checked just now)")
            elif status == "unverifiable":
                parts.append(f"step {other} is readable but has no checksums (written by an older "
                             "version)")
            else:
                parts.append(f"step {other} is {'damaged' if status == 'bad' else 'unreadable'} "
                             f"too ({why})")
        report = (f"Other checkpoints in {self.directory}: " + "; ".join(parts) + "."
                  if parts else f"No other checkpoint is in {self.directory}.")
        good = sorted(o for o, (status, _) in statuses.items() if status in ("good", "unverifiable"))
        newest_good = good[-1] if good else None
        # A resume takes the newest step: every damaged step newer than the newest good one goes.
        broken = sorted({step} | {o for o, (status, _) in statuses.items()
                                  if status in ("bad", "unreadable")
                                  and (newest_good is None or o > newest_good)})
        folders = ", ".join(str(self._step_dir(o)) for o in broken)
        if newest_good is not None:
            fix = (f"move {folders} out of {self.directory} (a resume then starts from step "
                   f"{newest_good}, the newest good checkpoint) or restore another step "
                   f"({', '.join(map(str, good))})")
        else:
            fix = (f"move {folders} out of {self.directory}; no other checkpoint here is good, so "
                   "training starts again (or point at another run's checkpoints)")
        return CorruptCheckpointError(f"{head}\n{report}\nFix: {fix}.")

    def _restore_failure(self, step: int, what: str, err: BaseException) -> UserError:
        """The error for a restore of ``step`` that raised ``err``: a CorruptCheckpointError when
        the step's files fail when read back on the host, else a RestoreError (the files are
        fine; the arrays asked for, e.g. their sharding, or the memory are not), which never
        advises moving the checkpoint away."""
        status, why = self._verify_on_host(step)
        if status in ("bad", "unreadable"):
            return self._corrupt(step, what, err)
        text = str(err).split(" [tensorstore_spec", 1)[0].strip()
        checked = ("read back and its checksums verified just now" if status == "good" else
                   "read back just now; it has no checksums")
        return RestoreError(
            f"checkpoint step {step} at {self._step_dir(step)} is intact ({checked}), but "
            f"restoring it into this run's arrays failed: {type(err).__name__}: {text[:400]}"
            f"{'...' if len(text) > 400 else ''}. Its files are fine: keep them. Usual causes: a "
            "mesh whose axis does not divide an array's dimension (change mesh.* or the model "
            "sizes), or too little device/host memory")

    def _other_statuses(self, step: int) -> dict[int, tuple[str, str]]:
        """{other committed step: (status, what is wrong)} after reading each back and checking it
        (``_verify_on_host``; this runs only when a step is refused)."""
        statuses = {}
        for other in sorted((s for s in self._manager.all_steps() if s != step), reverse=True):
            statuses[other] = self._verify_on_host(other)
            if statuses[other][0] == "good":
                self._mark_verified(other)
            elif statuses[other][0] in ("bad", "unreadable"):
                self._bad.add(other)
        return statuses

    def _mark_verified(self, step: int) -> None:
        if self._verified is None or step > self._verified:
            self._verified = step
        self._bad.discard(step)

    def _read_checksums(self, step: int, *, warn: bool = True) -> dict | None:
        """The step's checksums item; None for a step written before checksums were stored (logged
        once when ``warn``). Raises _Damaged when the item is missing or malformed."""
        if not (self._step_dir(step) / _ITEM_CHECKSUMS).exists():
            try:
                items = json.loads((self._step_dir(step) / _STEP_METADATA_FILE).read_text())
                listed = _ITEM_CHECKSUMS in (items.get("item_handlers") or {})
            except (OSError, ValueError, AttributeError):
                listed = False
            if listed:
                raise _Damaged(f"its '{_ITEM_CHECKSUMS}' item is missing")
            if warn and step not in self._unverifiable_logged:
                self._unverifiable_logged.add(step)
                logger.warning(
                    "checkpoint step %d at %s was written before checkpoints stored checksums (an "
                    "older version): it is restored without verifying its arrays; the checkpoints "
                    "this version saves are verified", step, self._step_dir(step))
            return None
        try:
            item = self._manager.restore(
                step, args=ocp.args.Composite(**{_ITEM_CHECKSUMS: ocp.args.JsonRestore()})
            )[_ITEM_CHECKSUMS]
        except Exception as e:
            raise _Damaged(f"cannot read its '{_ITEM_CHECKSUMS}' item: {type(e).__name__}: "
                           f"{str(e)[:200]}") from e
        if (not isinstance(item, dict) or item.get("format") != _CHECKSUM_FORMAT
                or item.get("algorithm") != _CHECKSUM_ALGORITHM
                or not isinstance(item.get("arrays"), dict)
                or not isinstance(item.get("items"), dict)):
            raise _Damaged(f"its '{_ITEM_CHECKSUMS}' item is not what this version writes "
                           f"(format {_CHECKSUM_FORMAT}, {_CHECKSUM_ALGORITHM})")
        return item

    def _read_host_state(self, step: int) -> Any:
        """The step's whole state read into host memory (numpy arrays, none on a device)."""
        metadata = self._manager.item_metadata(step)[_ITEM_STATE]
        tree = getattr(metadata, "tree", metadata)
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
            return reader.restore(self._step_dir(step) / _ITEM_STATE,
                                  args=ocp.args.PyTreeRestore(restore_args=restore_args))

    def _verify_on_host(self, step: int) -> tuple[str, str]:
        """Reads ``step`` back into host memory and checks it: ("good" | "bad" | "unreadable" |
        "unverifiable" (no checksums), what is wrong). Never raises for a damaged step."""
        try:
            checksums = self._read_checksums(step, warn=False)
        except _Damaged as e:
            return "bad", str(e)
        if checksums is None:
            return "unverifiable", "written before checksums were stored"
        try:
            host = self._read_host_state(step)
            items = self._manager.restore(step, args=ocp.args.Composite(
                **{_ITEM_DATA: ocp.args.JsonRestore(), _ITEM_CONFIG: ocp.args.JsonRestore()}))
        except Exception as e:  # orbax/tensorstore raise many types; all mean "cannot read"
            text = str(e).split(" [tensorstore_spec", 1)[0].strip()
            return "unreadable", f"{type(e).__name__}: {text[:200]}"
        bad, _ = cks.check_arrays(flatten_by_path(host), checksums["arrays"])
        missing = sorted(set(checksums["arrays"]) - set(flatten_by_path(host)))
        bad += [f"array {path!r} is missing" for path in missing]
        for name in (_ITEM_DATA, _ITEM_CONFIG):
            if cks.json_crc32(items[name]) != checksums["items"].get(name):
                bad.append(f"its '{name}' item does not match its checksum")
        if bad:
            return "bad", bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
        return "good", ""

    def _verify_restored(self, step: int, tree: Any, checksums: dict,
                         data_item: dict | None = None) -> bool:
        """Checks arrays restored from ``step`` (and its data item) against its checksums; raises
        CorruptCheckpointError on a mismatch; True when every array was checked."""
        bad, unchecked = cks.check_arrays(flatten_by_path(tree), checksums["arrays"])
        bad, never = cks.gathered_problems(bad, unchecked)
        if (data_item is not None
                and cks.json_crc32(data_item) != checksums["items"].get(_ITEM_DATA)):
            bad.append(f"its '{_ITEM_DATA}' item (the data-pipeline state) does not match its "
                       "checksum")
        if bad:
            self._bad.add(step)
            more = ""
            if len(bad) > 1:
                more = f"; {len(bad) - 1} more damaged: " + "; ".join(bad[1:4]) + (
                    " ..." if len(bad) > 4 else "")
            raise self._corrupt(step, bad[0] + more, damaged=True)
        if never:
            logger.warning("checkpoint step %d: %d array region(s) could not be checked against "
                           "their checksums in this process layout: %s", step, len(never),
                           ", ".join(never[:5]) + (" ..." if len(never) > 5 else ""))
        return not never

    def verify(self, step: int | None = None) -> bool:
        """Reads ``step`` (default: the latest) back into host memory and checks every array and
        JSON item against the checksums saved with it. True: it verified (and counts as verified
        for rotation); False: it was written before checksums were stored (nothing to check; a
        warning is logged). Raises ``CorruptCheckpointError`` naming what is damaged and the other
        checkpoints that still verify."""
        step = self._committed_step(step)
        status, detail = self._verify_on_host(step)
        if status == "good":
            self._mark_verified(step)
            return True
        if status == "unverifiable":
            self._read_checksums(step)  # logs the warning
            return False
        self._bad.add(step)
        raise self._corrupt(step, detail, damaged=status == "bad")

    # ---------------------------------------------------------------- rotation

    def _protect_before_rotation(self) -> None:
        """Called before a save: if rotation would delete the newest verified step (or a step while
        none verified yet), read back the newest committed steps, newest first, until one verifies
        (down to the verified one); the policy then keeps it."""
        if self.read_only or not self.verify_before_delete:
            return
        self._manager.wait_until_finished()  # (orbax's save waits for it anyway)
        committed = self.all_steps()
        n_drop = len(committed) - (self.keep - 1)  # the new step takes one of the `keep` places
        if n_drop <= 0 or self._verified in committed[n_drop:]:
            return
        floor = self._verified if self._verified in committed else -1
        for step in reversed(committed):
            if step <= floor:
                break
            if step in self._bad:
                continue
            status, detail = self._verify_on_host(step)
            if status == "good":
                self._mark_verified(step)
                logger.info("checkpoint step %d read back and verified before rotation", step)
                return
            if status != "unverifiable":
                self._bad.add(step)
                logger.error(
                    "checkpoint step %d at %s fails verification (%s: %s); it is not counted as "
                    "a good checkpoint, and the newest one that verified is kept", step,
                    self._step_dir(step), status, detail)

    def _trim_after_verifying_newest(self) -> None:
        """At close: steps beyond ``keep`` that rotation kept only because they were the newest
        verified are deleted once the newest step verifies."""
        committed = self.all_steps()
        extra = committed[:-self.keep]
        if not extra:
            return
        newest = committed[-1]
        if self._verified != newest:
            if newest in self._bad:
                return
            status, detail = self._verify_on_host(newest)
            if status != "good":
                if status != "unverifiable":
                    self._bad.add(newest)
                    logger.error("checkpoint step %d at %s fails verification (%s: %s); step %s, "
                                 "the newest that verified, is kept", newest,
                                 self._step_dir(newest), status, detail, self._verified)
                return
            self._mark_verified(newest)
        for step in extra:
            self._manager.delete(step)
        logger.info("deleted checkpoint step(s) %s of %s: step %d verified", extra,
                    self.directory, newest)

    # ---------------------------------------------------------------- restore (public)

    def restore(self, abstract_state: Any, step: int | None = None, *,
                compare: Sequence[str] = ("model",)) -> tuple[Any, dict | None, dict]:
        """Restores ``(state, data_state, saved_config)`` from ``step`` (default: the latest).

        ``compare``: the config sections that must equal the saved ones (default ``model``); a
        caller that accepts other settings passes ``()`` and reads ``saved_config`` itself (the
        state's tree structure, shapes and dtypes are checked either way).

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with ``.sharding`` (or of
        ``jax.Array``, whose shapes, dtypes and shardings are used); arrays are restored directly
        into those shardings. Every array read (and the data and config items) is checked against
        the checksums saved with it. Raises ``NoCheckpointError`` (a ValueError) when there is
        nothing to restore, ``ValueError`` for a step that was not saved,
        ``IncompatibleCheckpointError`` for a config or tree mismatch and
        ``CorruptCheckpointError`` for unreadable or damaged files.
        """
        step, saved_config, checksums = self._checked_step(step, compare)
        wanted = to_abstract(abstract_state)
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
            raise self._restore_failure(step, "cannot read its 'state' or 'data' item", e) from e
        data_item = restored[_ITEM_DATA]
        if not isinstance(data_item, dict) or "data_state" not in data_item:
            raise self._corrupt(step, "its 'data' item has no 'data_state' entry")
        if checksums is not None:
            if self._verify_restored(step, restored[_ITEM_STATE], checksums, data_item):
                self._mark_verified(step)
        logger.info("restored checkpoint step %d from %s%s", step, self.directory,
                    " (checksums verified)" if checksums is not None else "")
        return restored[_ITEM_STATE], data_item["data_state"], saved_config

    def restore_subtree(self, abstract_subtree: Any, step: int | None = None, *,
                        compare: Sequence[str] = ("model",)) -> tuple[Any, dict]:
        """Restores only part of the saved state, ``(subtree, saved_config)``: ``abstract_subtree``
        names the top-level entries wanted (e.g. ``{"params": ...}`` for inference: the optimizer
        state is never read). Same checks and errors as ``restore`` for what it reads (the arrays
        read are checked against their checksums)."""
        step, saved_config, checksums = self._checked_step(step, compare)
        wanted = to_abstract(abstract_subtree)
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
            raise self._restore_failure(step, "cannot read its 'state' item", e) from e
        if checksums is not None:
            self._verify_restored(step, subtree, checksums)
        logger.info("restored %s of checkpoint step %d from %s", sorted(wanted), step,
                    self.directory)
        return subtree, saved_config

    def _committed_step(self, step: int | None) -> int:
        """``step``, or the latest when None, after pending saves are committed; NoCheckpointError
        when there is none, ValueError naming the available steps for one that was not saved."""
        self.wait()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise self._no_checkpoint()
            return steps[-1]
        if step not in steps:
            raise ValueError(f"no committed checkpoint for step {step} in {self.directory}; "
                             f"available steps: {steps or 'none'}")
        return step

    def saved_config(self, step: int | None = None) -> tuple[int, dict]:
        """(step, the config saved with it) of ``step`` (default: the latest), nothing compared."""
        step, config, _ = self._checked_step(step, ())
        return step, config

    def _checked_step(self, step: int | None, compare: Sequence[str]
                      ) -> tuple[int, dict, dict | None]:
        """(the step to restore, its saved config, its checksums or None), after the config check
        (the config is checked against its checksum first)."""
        step = self._committed_step(step)
        # The config first (small, and it decides whether the rest is worth reading).
        try:
            saved_config = self._manager.restore(
                step, args=ocp.args.Composite(**{_ITEM_CONFIG: ocp.args.JsonRestore()})
            )[_ITEM_CONFIG]
        except Exception as e:  # orbax/tensorstore raise many types; all mean "cannot read"
            raise self._corrupt(step, "cannot read its 'config' item", e) from e
        if not isinstance(saved_config, dict):
            raise self._corrupt(step, f"its 'config' item is a {type(saved_config).__name__}, not a dict")
        try:
            checksums = self._read_checksums(step)
        except _Damaged as e:
            raise self._corrupt(step, str(e)) from None
        if checksums is not None and (cks.json_crc32(saved_config)
                                      != checksums["items"].get(_ITEM_CONFIG)):
            self._bad.add(step)
            raise self._corrupt(step, "its 'config' item does not match its checksum", damaged=True)
        check_compatible(saved_config, self._config, compare,
                         source=f"checkpoint step {step} at {self._step_dir(step)}")
        return step, saved_config, checksums

    def _check_structure(self, step: int, wanted: Any, *, partial: bool) -> None:
        """The saved state's tree structure, shapes and dtypes (orbax's metadata) against
        ``wanted``; with ``partial``, saved entries ``wanted`` does not ask for are ignored."""
        try:
            metadata = self._manager.item_metadata(step)[_ITEM_STATE]
        except Exception as e:
            raise self._corrupt(step, "cannot read the metadata of its 'state' item", e) from e
        if metadata is None:
            raise self._corrupt(step, "the metadata of its 'state' item (state/_METADATA) is missing")
        saved_leaves = flatten_by_path(getattr(metadata, "tree", metadata))
        wanted_leaves = flatten_by_path(wanted)
        if partial:
            tops = {path.split("/", 1)[0] for path in wanted_leaves}
            saved_leaves = {p: v for p, v in saved_leaves.items() if p.split("/", 1)[0] in tops}
        mismatch = first_structure_mismatch(saved_leaves, wanted_leaves)
        if mismatch is not None:
            raise IncompatibleCheckpointError(
                f"checkpoint step {step} at {self._step_dir(step)} does not match the state to restore "
                f"into: {mismatch}.\nFix: build the model/optimizer with the settings the checkpoint "
                "was written with, or start in a fresh checkpoint directory."
            )
