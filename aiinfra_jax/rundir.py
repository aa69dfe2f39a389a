"""Run directories: where a run goes, where it starts from, and how a finished one is read back.

- ``choose_run_dir``: the directory of a new or resumed run, by ``run.resume`` (a finished run,
  one with summary.json, is never reused).
- ``initialize_from``: the state another run's checkpoint hands a new run
  (``checkpoint.initialize_from``; the source is named as ``aiinfra_jax.load.checkpoint_source``
  reads it), or the parameters of an HF checkpoint or of a model of another architecture
  (``hf:DIR``, ``params:RUN``: aiinfra_jax/surgery.py).
- ``restore_run``: a (trainer, state) pair from a run directory's checkpoint, for evaluations that
  need the trainer (a model alone: ``aiinfra_jax.load.load_model``).
- ``RunLock``: the exclusive lock a training run holds on its directory (``RUN_DIR/run.lock``).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

import jax

from aiinfra_jax.checkpoint import Checkpointer, NoCheckpointError, config_differences
from aiinfra_jax.config import Config, ConfigError, load_run_config, to_dict
from aiinfra_jax.errors import RunLockedError
from aiinfra_jax.load import checkpoint_source
from aiinfra_jax.surgery import initialize_params, is_params_source, write_report
from aiinfra_jax.trainer import Trainer


def _is_finished(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists()


def _finished_step(run_dir: Path) -> int | None:
    """The step a finished run ended at (summary.json), None if unreadable."""
    try:
        step = json.loads((run_dir / "summary.json").read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def choose_run_dir(cfg: Config) -> tuple[Path, bool]:
    """(run directory, whether to resume in it), by run.resume; never reuses a finished run (an
    explicit run.run_dir only to train it past the step it finished at)."""
    if cfg.run.run_dir:
        d = Path(cfg.run.run_dir)
        if _is_finished(d):
            done = _finished_step(d)
            if done is None or cfg.run.steps <= done:
                raise ConfigError(
                    f"run.run_dir={str(d)!r} holds a finished run (summary.json"
                    + (f", step {done}" if done is not None else "") + ") and run.steps="
                    f"{cfg.run.steps} adds no step to it: nothing is overwritten. Choose another "
                    "run.run_dir, start from it with checkpoint.initialize_from="
                    f"{str(d)!r}, or raise run.steps to train it further")
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
                          f"checkpoint is in {base}" + (
                              f": the newest of that name, {existing[-1].name}, is finished or "
                              "has no checkpoint (only the newest is resumed; to resume another, "
                              "name it with run.run_dir)" if existing else ""))
    if not existing:
        return base / name, False
    last = existing[-1]
    k = 1 if last.name == name else int(last.name[len(name) + 1:])
    return base / f"{name}-{k + 1}", False


def initialize_from(trainer: Trainer, say, run_dir: Path | None = None
                    ) -> tuple[dict, dict | None]:
    """(state, data_state) of the checkpoint named by checkpoint.initialize_from (see
    CheckpointConfig). Config differences are allowed where the state keeps its tree, shapes and
    dtypes (checked by the restore) and printed; the data stream goes on only when the data
    section and run.seed are unchanged, else it starts at its first batch. A parameters-only source (hf:DIR,
    params:RUN) goes through aiinfra_jax/surgery.py instead: step 0, a fresh optimizer and data
    stream, and the report of every tensor in run_dir/initialize.json."""
    cfg = trainer.cfg
    spec = cfg.checkpoint.initialize_from
    if is_params_source(spec):
        state, report = initialize_params(trainer, spec, say)
        if run_dir is not None and jax.process_index() == 0:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            write_report(run_dir, report)
        return state, None
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
    data_diffs = (config_differences(saved, current, ("data",))  # (what the stream depends on)
                  + config_differences(saved, current, ("run",), only=("run.seed",)))
    if data_diffs:
        say("the data section or run.seed differs from the checkpoint's, so the data stream starts "
            "at its "
            f"first batch (its data.stages counted from step {start}):\n" + "\n".join(data_diffs))
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


class RunLock:
    """An exclusive lock on a run directory, held by the training run that writes in it.

    ``RUN_DIR/run.lock`` is locked with ``flock`` (released by the kernel when the process ends,
    however it ends, so a crash or ``kill -9`` leaves no stale lock) and holds the holder's pid,
    host, start time and command, which the refusal of a second run names. The file stays (an
    unlocked, empty run.lock is free): deleting it would let two runs lock two different files.
    On a file system without flock (ENOLCK / EOPNOTSUPP, some network mounts) the file's content
    is the lock: a holder on this host whose pid is gone is stale and taken over (said in the
    log); a holder on another host cannot be checked from here and is refused, naming the file
    to delete once that run is known to be dead.
    """

    NAME = "run.lock"

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / self.NAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Takes the lock (creating the directory); returns a note about a stale lock taken over,
        or None. Raises RunLockedError naming the live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read_holder(fd)
                os.close(fd)
                raise RunLockedError(self._refusal(holder)) from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            flocked = False
        previous = _read_holder(fd)
        note = None
        if previous:
            same_host = previous.get("host") == socket.gethostname()
            if not flocked and not (same_host and not _pid_alive(previous.get("pid"))):
                os.close(fd)
                raise RunLockedError(self._refusal(previous) + (
                    "" if same_host else f". This file system has no flock; if that run is "
                    f"dead, delete {self.path}"))
            note = (f"took over the lock of a run that ended without releasing it (pid "
                    f"{previous.get('pid')} on {previous.get('host')}, started "
                    f"{previous.get('started')}): it crashed or was killed")
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds"),
                  "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return note

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # empty = free (a crash leaves the content: see acquire)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _refusal(self, holder: dict) -> str:
        who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started "
               f"{holder.get('started')}: {holder.get('command')!r}" if holder
               else "a process that has not written its name yet")
        return (f"run directory {self.path.parent} is in use by another run ({who}). Wait for it "
                "to end or stop it, or give this run another run.run_dir / run.name; two runs in "
                "one directory would delete each other's checkpoints")


def _read_holder(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {"pid": None, "host": None, "started": None, "command": "(unreadable run.lock)"}


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
