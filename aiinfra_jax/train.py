"""The one training loop: a short stateful shell around the pure steps of aiinfra_jax.steps.

    summary = train(cfg)                  # or: python train.py --config configs/tiny.py --set ...

The pieces it drives: `Trainer` (aiinfra_jax.trainer: state, shardings, jitted steps, validation),
the run directory and the state to start from (aiinfra_jax.rundir), the checkpointer, the data
iterator, the metric writers, and in-loop hooks (aiinfra_jax.hooks: evaluations that run every N
steps, such as the long-context scores, which the loop calls without knowing what they are).

A non-finite step leaves params and optimizer state unchanged (selected inside the jitted step, so
the donated buffers always hold the last good state); the loop sees `bad_step` at the next log,
eval, hook or checkpoint point and stops, naming the step, without saving anything newer than the
last good checkpoint. SIGTERM / Ctrl-C save a checkpoint and return; the same command resumes.

Multi-process runs (one process per host, or several on one host; README, "Multi-process and
multi-host runs"): every process runs this same loop over its part of each batch (Trainer.shard)
and takes part in every step, evaluation, hook and checkpoint save and restore (orbax writes the
sharded arrays from their owners). Process 0 alone chooses the run directory (the others learn it
from it) and writes config.json, the logs, eval.json and summary.json, and prints. The processes
check at the start that they run the same config, and a checkpoint stores the data position of
every process's streams. SIGTERM to any process makes all of them stop and save at the same step
(JAX's preemption sync point); Ctrl-C ends a multi-process run without saving. A process that
fails ends itself at once (the CLI), so that JAX's distributed service stops the others.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from aiinfra_jax import sharding as shd
from aiinfra_jax.checkpoint import Checkpointer, config_differences
from aiinfra_jax.config import (Config, ConfigError, from_dict, load_config, save_config,
                                to_dict)
from aiinfra_jax.data import StreamsIterator, check_split, make_iterator
from aiinfra_jax.errors import (EXIT_INTERRUPTED, EXIT_STOPPED, EXIT_USAGE, DiskError,
                                UserError, add_debug_flag, describe, disk_error, disk_message,
                                quiet_library_tracebacks)
from aiinfra_jax.hooks import TrainHook, prepare_hooks
from aiinfra_jax.metrics import MetricsWriter, ProgressBar, mfu, peak_flops_per_device
# Re-exported: evaluations and tools restore runs and build models through this module.
from aiinfra_jax.rundir import RunLock, choose_run_dir, initialize_from
from aiinfra_jax.steps import lr_schedule
from aiinfra_jax.trainer import Trainer

__all__ = ["NonFiniteError", "main", "train"]


class NonFiniteError(UserError, RuntimeError):
    """The loss or the gradients stopped being finite; the message names the step and the last
    good checkpoint."""


# ----------------------------------------------------------------------------- the loop


def train(cfg: Config, *, hooks: Iterable[TrainHook] | None = None, stop_after: int | None = None,
          quiet: bool = False) -> dict[str, Any]:
    """Runs (or resumes) a training run; returns the summary (also written to run_dir/summary.json).

    hooks: in-loop hooks (aiinfra_jax.hooks); None = the installed packages' registered hooks that
    the config asks for (e.g. eval.longctx_every). stop_after: stop (with a checkpoint) once this
    many steps are done, as if interrupted; for tests of resumption and tools that train in slices.
    """
    trainer = Trainer(cfg)  # validates everything that needs the devices or the tokenizer
    cfg = trainer.cfg
    hooks = prepare_hooks(trainer, hooks)  # bad hook settings fail before anything is created
    procs = _Processes.of(cfg)
    stored = dataclasses.replace(cfg, mesh=cfg.mesh.without_launch())  # what the run dir keeps
    procs.check_same_config(to_dict(stored))
    run_dir, resume = procs.run_dir(cfg)
    # Opening the data reads every source, so bad data is refused before anything is created.
    train_it = make_iterator(cfg.data, trainer.tokenizer, split="train", seed=cfg.run.seed,
                             streams=trainer.data_streams)
    if cfg.data.val_fraction > 0:  # the evaluations' split, which would fail steps into the run
        check_split(cfg.data, "validation", trainer.data_streams)
    say = (lambda *a: None) if quiet or not procs.lead else (lambda *a: print(*a, flush=True))
    with RunLock(run_dir) if procs.lead else contextlib.nullcontext() as lock:
        note = lock.acquire() if procs.lead else None
        if note:
            say(note)
        return _train_in(trainer, hooks, procs, stored, run_dir, resume, train_it, say,
                         stop_after, quiet)


def _train_in(trainer: Trainer, hooks, procs: _Processes, stored: Config, run_dir: Path,
              resume: bool, train_it, say, stop_after: int | None, quiet: bool) -> dict[str, Any]:
    """train's loop, in a run directory this run holds the lock of."""
    cfg = trainer.cfg
    if procs.count > 1:
        say(f"{procs.count} processes, {jax.device_count()} devices; if one dies, the others are "
            "stopped (by JAX's distributed service); then start them all again with the same "
            "command, and the run resumes from its last checkpoint")

    ckpt = Checkpointer(run_dir / "checkpoints", config=to_dict(stored), keep=cfg.checkpoint.keep,
                        async_save=cfg.checkpoint.async_save)
    state, data_state, resumed = _starting_state(trainer, ckpt, run_dir, resume, stored, say)
    step = start_step = int(jax.device_get(state["step"]))
    if data_state is not None:
        _restore_data_position(train_it, data_state, run_dir, resumed)
    elif step:  # initialize_from with another data section: a fresh stream, whose data.stages
        train_it.start_at(step)  # still follow the steps (not the stream's own batch count)
    if procs.lead:  # only now: a resume that the checkpoint or the data refuses leaves it alone
        save_config(stored, run_dir / "config.json")
    if cfg.data.stages:
        say(_stages_line(cfg))
    if cfg.model.stages:
        say("model stages: " + "; ".join(
            f"from step {start + 1}: " + ", ".join(f"{k}={v!r}" for k, v in settings)
            for start, settings in cfg.model.stages))
    jtrain, jeval = trainer.compiled_steps(step)
    speed = _Speed.of(trainer, state, say)

    # Metric lines (and TensorBoard events) after the starting step were logged by an interrupted
    # attempt and are about to be logged again: dropped (all of them when it starts from scratch).
    writer = MetricsWriter(run_dir / "logs", resume_step=step) if procs.lead else _NoWriter()
    can_eval = cfg.data.val_fraction > 0
    if not can_eval:
        say("data.val_fraction=0: no validation split, so evaluation is skipped")
    bar = (ProgressBar(cfg.run.steps, desc=cfg.run.name)
           if cfg.run.progress and not quiet and procs.lead else None)
    last_data_state = data_state if resumed else train_it.get_state()  # before the prefetch
    prefetch = _Prefetcher(train_it)  # thread starts reading the iterator
    interval = _Interval()
    history: list[dict] = []
    stopped_by = None
    failed = False
    try:
        with _Stop(signals=procs.count == 1) as stop:
            while step < cfg.run.steps:
                if cfg.model.stages:  # the stage's steps (compiled once per stage, then cached)
                    jtrain, jeval = trainer.compiled_steps(step)
                batch, data_state_after = interval.next_batch(prefetch)
                state, metrics = jtrain(state, trainer.shard(batch))
                last_data_state = data_state_after
                interval.add(metrics)  # bounds the run-ahead; see _wait_for_step
                step += 1
                due = _Due.at(step, cfg, can_eval, hooks, stop.requested or procs.preempted(step),
                              stop_after)
                if due.anything:
                    _raise_if_not_finite(state, ckpt, run_dir)
                if due.log:
                    history.append(_log(step, interval, speed, writer, bar))
                # The checkpoint first: an evaluation or a hook that fails keeps the step, and a
                # stop (SIGTERM, stop_after) saves and ends without them.
                if due.checkpoint or due.stop:
                    ckpt.save(step, state, procs.data_state(last_data_state), force=bool(due.stop))
                if due.stop:
                    stopped_by = due.stop
                    break
                if due.eval:
                    with interval.not_training():
                        val = trainer.evaluate(state, jeval, cfg.eval.batches)
                    writer.write(step, {"val/loss": val["loss"], "val/perplexity": val["perplexity"]})
                if due.hooks:  # before the next step: the params buffers are donated to it
                    with interval.not_training():
                        model = trainer.model(state["params"], state.get("model_state"))
                        for hook in due.hooks:
                            writer.write(step, hook(step, model, trainer))
        if not stopped_by:  # (a stop saved its step above)
            ckpt.save(step, state, procs.data_state(last_data_state), force=True)
        final = None
        if not stopped_by and can_eval:
            final = trainer.evaluate(state, jeval, cfg.eval.final_batches)
        ckpt.wait()
    except BaseException as e:
        failed = True
        disk = disk_error(e)
        if disk is not None:  # a full disk: say where the run can go on from
            raise DiskError(f"{disk_message(disk)}; {_last_good(ckpt, run_dir, wait=False)}") from e
        if procs.count > 1 and _lost_a_process(e):
            last = ckpt.latest_step(reload=True)  # the save the loss interrupted may have committed
            raise shd.DistributedError(
                f"process {procs.index} of {procs.count} lost contact with another process near "
                f"step {step} ({str(e).strip().splitlines()[0][:300]}): a process died or its host "
                "cannot be reached; see the other processes' logs. Start every process again with "
                "the same command: the run resumes from its last checkpoint ("
                + (f"step {last}" if last is not None else "none yet: from the start") + ")") from e
        raise
    finally:
        prefetch.close()
        writer.close()
        if bar:
            bar.close()
        if not (failed and procs.count > 1):  # (the others are not here: orbax would wait for them)
            ckpt.close()

    if stopped_by:
        say(f"\nstopped at step {step} ({stopped_by}); checkpoint saved in "
            f"{run_dir / 'checkpoints'}; run the same command again to resume")
        return {"run_dir": str(run_dir), "step": step, "finished": False,
                "history": history, "start_step": start_step}
    summary = _summary(run_dir, step, start_step, speed, history, final)
    if procs.lead:
        _write_summary(run_dir, summary)
    say(_format_summary(summary))
    return summary


# ----------------------------------------------------------------------------- the loop's helpers


def _starting_state(trainer: Trainer, ckpt: Checkpointer, run_dir: Path, resume: bool,
                    stored: Config, say) -> tuple[dict, dict | None, bool]:
    """(state, data-iterator state or None, resumed): the run's own newest checkpoint, else the
    checkpoint named by checkpoint.initialize_from, else a fresh state. A resume names the
    settings that differ from the checkpoint's (those the checkpoint allows to change)."""
    cfg = trainer.cfg
    if ckpt.latest_step() is not None:
        if not resume:
            raise RuntimeError(f"{run_dir} already holds checkpoints but was chosen for a new run")
        state, data_state, saved = ckpt.restore(trainer.abstract_state())
        at = int(jax.device_get(state["step"]))
        if at > cfg.run.steps:
            raise ConfigError(f"{run_dir} resumes at step {at}, past run.steps={cfg.run.steps}: "
                              f"nothing to train (nothing was changed); set run.steps >= {at}")
        current = to_dict(stored)
        changed = config_differences(saved, current, sorted(set(saved) | set(current)))
        say(f"resumed {run_dir} from step {int(state['step'])}"
            + (" (its own checkpoint; checkpoint.initialize_from is not read again)"
               if cfg.checkpoint.initialize_from else "")
            + ("; settings changed since that checkpoint:\n" + "\n".join(changed)
               if changed else "") + _lr_change(saved, cfg, at))
        return state, data_state, True
    if cfg.run.resume == "require":
        raise ConfigError(f"run.resume='require' but {run_dir / 'checkpoints'} holds no committed "
                          "checkpoint (none was saved, or only an interrupted save): nothing to "
                          "resume. Set run.resume=auto to start this run from step 0")
    state, data_state = (initialize_from(trainer, say, run_dir) if cfg.checkpoint.initialize_from
                         else (trainer.init_state(), None))
    say(f"new run in {run_dir}")
    return state, data_state, False


def _lr_change(saved: dict, cfg: Config, step: int) -> str:
    """A line naming the learning-rate jump at the resumed step when the schedule's settings
    (optim.*, run.steps: a decay over run.steps stretches with it) changed, else ""."""
    try:
        before = lr_schedule(from_dict(saved).optim, int(saved["run"]["steps"]))(step)
    except (ValueError, TypeError, KeyError):  # a config the current code cannot rebuild
        return ""
    now = lr_schedule(cfg.optim, cfg.run.steps)(step)
    if math.isclose(float(before), float(now), rel_tol=1e-6):
        return ""
    return (f"\nthe learning rate at step {step} is {float(now):.3g} under these settings, "
            f"{float(before):.3g} under the checkpoint's")


def _restore_data_position(train_it, data_state: dict, run_dir: Path, resumed: bool) -> None:
    """The data stream goes on where the checkpoint left it; a data section (or run.seed) other
    than the one it was saved with cannot, which is a ConfigError naming the fix."""
    try:
        train_it.set_state(data_state)
    except ValueError as e:
        where = (f"resume {run_dir} with the data settings and run.seed of its config.json, or "
                 if resumed else "")
        raise ConfigError(
            f"{e}. Fix: {where}start a new run with checkpoint.initialize_from=<that run>, whose "
            "data stream starts at its first batch when the data section or run.seed differs"
        ) from e


@dataclasses.dataclass(frozen=True)
class _Processes:
    """This process's place in the run's processes (one, or several: multi-process runs), and the
    points where they meet (aiinfra_jax.sharding.exchange; each waits at most mesh.init_timeout_s
    for the others, then raises a DistributedError naming the one that did not come)."""

    index: int
    count: int
    timeout_s: float

    @classmethod
    def of(cls, cfg: Config) -> _Processes:
        return cls(jax.process_index(), jax.process_count(), float(cfg.mesh.init_timeout_s))

    @property
    def lead(self) -> bool:
        """Process 0: the one that writes the run directory and prints."""
        return self.index == 0

    def check_same_config(self, config: dict) -> None:
        """Every process must run the config of process 0 (launch settings aside)."""
        if self.count == 1:
            return
        configs = shd.exchange("config check", config, self.timeout_s)
        for i, other in enumerate(configs[1:], start=1):
            diffs = [line.replace(": checkpoint ", ": process 0 ", 1)
                     .replace(", current ", f", process {i} ", 1)
                     for line in config_differences(configs[0], other, list(configs[0]))]
            if diffs:
                raise ConfigError(
                    f"process {i} runs another config than process 0:\n" + "\n".join(diffs)
                    + "\nStart every process with the same preset and --set values; only the "
                    "mesh's launch settings (coordinator, process count and id) may differ")

    def run_dir(self, cfg: Config) -> tuple[Path, bool]:
        """choose_run_dir's answer, on process 0 (the others would race it creating the
        directory), handed to every process."""
        path, resume = shd.from_process_0("run directory", lambda: _jsonable_choice(cfg),
                                          self.timeout_s)
        return Path(path), bool(resume)

    def data_state(self, local: dict | None) -> dict | None:
        """The data position of every process's streams, for a checkpoint; with one process,
        ``local`` itself."""
        if self.count == 1 or local is None:
            return local
        states = shd.exchange("data state", local, self.timeout_s)
        if all("states" in st for st in states):  # StreamsIterator states: each its own streams
            return StreamsIterator.merge_states(states)
        return states[0]  # one stream that every process reads whole (a batch they all hold)

    def preempted(self, step: int) -> str | None:
        """Multi-process runs: whether every process stops at ``step``, because some process got
        SIGTERM (JAX's preemption sync point: all agree on the step; called after every step)."""
        if self.count == 1:
            return None
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

        try:
            reached = multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # JAX's preemption service is off (jax_enable_preemption_service)
            return None
        return "SIGTERM to one of the processes (preemption sync point)" if reached else None


def _lost_a_process(e: BaseException) -> bool:
    """Whether ``e`` is the runtime's error for a collective or connection whose other end went
    away (a gloo / NCCL collective, the distributed service), rather than an error of this one."""
    return (isinstance(e, getattr(jax.errors, "JaxRuntimeError", RuntimeError))
            and re.search(r"gloo|nccl|connection|peer|unavailable|heartbeat|coordination",
                          str(e), re.IGNORECASE) is not None)


def _jsonable_choice(cfg: Config) -> tuple[str, bool]:
    run_dir, resume = choose_run_dir(cfg)
    return str(run_dir), resume


class _NoWriter:
    """The metrics writer of the processes other than 0 (process 0 logs the run)."""

    def write(self, step: int, metrics) -> None:
        pass

    def close(self) -> None:
        pass


def _stages_line(cfg: Config) -> str:
    return "data stages: " + "; ".join(
        f"from step {start + 1}: " + ", ".join(f"{src} {w:.2f}" for src, w in
                                           zip(cfg.data.sources, weights) if w > 0)
        for start, weights in cfg.data.stage_weights)


@dataclasses.dataclass(frozen=True)
class _Speed:
    """What turns a log interval into throughput and MFU: the model's size and cost, the peak."""

    n_params: int
    flops_per_token: float
    tokens_per_step: int
    n_devices: int
    peak: float
    lr: Callable[[int], Any]

    @classmethod
    def of(cls, trainer: Trainer, state, say) -> _Speed:
        cfg = trainer.cfg
        peak, peak_source = peak_flops_per_device(jax.devices()[0], cfg.model.dtype)
        speed = cls(n_params=int(sum(x.size for x in jax.tree.leaves(state["params"]))),
                    flops_per_token=trainer.flops_per_token(),
                    tokens_per_step=cfg.data.batch_size * cfg.data.seq_len,
                    n_devices=trainer.mesh.size, peak=peak,
                    lr=lr_schedule(cfg.optim, cfg.run.steps))
        say(f"model: {speed.n_params / 1e6:.2f}M params, {speed.flops_per_token / 1e6:.2f} "
            f"MFLOP/token forward; mesh {dict(trainer.mesh.shape)} on "
            f"{jax.devices()[0].device_kind}; peak {peak / 1e9:.1f} GFLOP/s per device "
            f"({peak_source})")
        return speed


class _Interval:
    """The steps since the last log point: their metrics (still on the device, at most two steps
    unfinished), and the wall time and the time spent waiting for batches since it began."""

    def __init__(self):
        self.pending: list[dict] = []
        self.host_wait = self.excluded = 0.0
        self.start = time.perf_counter()

    def next_batch(self, prefetch: _Prefetcher):
        t0 = time.perf_counter()
        item = prefetch.next()
        self.host_wait += time.perf_counter() - t0
        return item

    def add(self, metrics: dict) -> None:
        if self.pending:  # (emptied only at a log point, which waited for every step)
            _wait_for_step(self.pending[-1])
        self.pending.append(metrics)

    @contextlib.contextmanager
    def not_training(self):
        """Around work that is not training (validation, hooks): its time is left out of the
        interval's throughput, and the steps before it keep theirs (they are finished first, so
        it holds none of their compute)."""
        if self.pending:
            _wait_for_step(self.pending[-1])
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t0

    def seconds(self) -> float:
        """Training wall time of the interval so far."""
        return time.perf_counter() - self.start - self.excluded

    def restart(self) -> None:
        self.pending, self.host_wait, self.excluded = [], 0.0, 0.0
        self.start = time.perf_counter()


@dataclasses.dataclass(frozen=True)
class _Due:
    """What the end of a step calls for."""

    log: bool
    eval: bool
    checkpoint: bool
    hooks: tuple
    stop: str | None  # why the run stops here, or None

    @classmethod
    def at(cls, step: int, cfg: Config, can_eval: bool, hooks, stop_requested: str | None,
           stop_after: int | None) -> _Due:
        total = cfg.run.steps
        stop = stop_requested or (f"stop_after={stop_after}"
                                  if stop_after is not None and step >= stop_after else None)
        return cls(
            # (a stop logs the steps since the last log point: they would be lost otherwise)
            log=step % cfg.run.log_every == 0 or step == total or stop is not None,
            eval=bool(can_eval and cfg.eval.every and step % cfg.eval.every == 0 and step < total),
            checkpoint=bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0),
            hooks=tuple(h for h in hooks if step % h.every == 0),
            stop=stop)

    @property
    def anything(self) -> bool:
        return self.log or self.eval or self.checkpoint or bool(self.hooks) or bool(self.stop)


def _raise_if_not_finite(state, ckpt: Checkpointer, run_dir: Path) -> None:
    bad = int(jax.device_get(state["bad_step"]))
    if bad:
        raise NonFiniteError(
            f"step {bad}: the loss or the gradients are not finite (NaN/Inf). Training stopped; "
            + _last_good(ckpt, run_dir)
            + ". Try a lower optim.lr or a stricter optim.grad_clip.")


def _last_good(ckpt: Checkpointer, run_dir: Path, wait: bool = True) -> str:
    """Where the run can go on from: its newest committed checkpoint (every save comes from a
    finite state: the check above runs before each one)."""
    if wait:
        ckpt.wait()  # an asynchronous save still being written counts once it is committed
    step = ckpt.latest_step()
    if step is None:
        return ("no checkpoint was saved before it (the run started from scratch), so the same "
                "command starts again from step 0")
    return f"the last good checkpoint, step {step}, is kept in {run_dir / 'checkpoints'}"


def _log(step: int, interval: _Interval, speed: _Speed, writer: MetricsWriter,
         bar: ProgressBar | None) -> dict:
    """Writes the log record of the interval that ends at ``step`` (the means of its steps'
    metrics, throughput, MFU), shows it on the progress bar, starts a new interval; returns it."""
    values = jax.device_get(interval.pending)
    seconds = interval.seconds()
    tokens_per_sec = len(values) * speed.tokens_per_step / seconds
    rec = {k: float(np.mean([v[k] for v in values])) for k in values[0]}
    rec.update({
        "step": step, "perplexity": math.exp(min(rec["loss"], 80.0)),
        "lr": float(speed.lr(step - 1)),
        "tokens_per_sec": tokens_per_sec,
        "mfu": mfu(speed.flops_per_token, tokens_per_sec, speed.n_devices, speed.peak),
        "host_wait_frac": interval.host_wait / seconds,
    })
    writer.write(step, rec)
    if bar:
        bar.update(step, loss=rec["loss"], tokens_per_sec=tokens_per_sec, mfu=rec["mfu"])
    interval.restart()
    return rec


def _summary(run_dir: Path, step: int, start_step: int, speed: _Speed, history: list[dict],
             final: dict | None) -> dict:
    """The summary of a finished run (what train returns)."""
    return {
        "run_dir": str(run_dir), "step": step, "finished": True, "start_step": start_step,
        "params": speed.n_params, "flops_per_token": speed.flops_per_token,
        "final_train_loss": history[-1]["loss"] if history else None,
        "validation": final,
        "checkpoints": str(run_dir / "checkpoints"), "logs": str(run_dir / "logs"),
        "eval_results": str(run_dir / "eval.json"), "history": history,
    }


def _write_summary(run_dir: Path, summary: dict) -> None:
    """The end of a finished run: eval.json and summary.json in run_dir (by process 0)."""
    (run_dir / "eval.json").write_text(json.dumps(summary["validation"], indent=2) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(
        {k: v for k, v in summary.items() if k != "history"}, indent=2) + "\n")


def _format_summary(s: dict) -> str:
    v = s["validation"]
    if v is None:
        v = {"loss": float("nan"), "perplexity": float("nan"), "tokens": 0,
             "accuracy": float("nan"), "by_position": []}
    lines = [
        "",
        f"done: {s['step']} steps, {s['params'] / 1e6:.2f}M params",
        f"  final train loss   {s['final_train_loss']:.4f}" if s["final_train_loss"] is not None
        else "  final train loss   n/a",
        f"  validation loss    {v['loss']:.4f}  (perplexity {v['perplexity']:.2f}, "
        f"{v['tokens']} tokens, next-token accuracy {v['accuracy']:.3f})",
        "  validation loss by position: " + ", ".join(
            f"{b['positions'][0]}-{b['positions'][1]}: "
            + (f"{b['loss']:.3f}" if b["loss"] is not None else "n/a") for b in v["by_position"]),
        f"  checkpoint:  {s['checkpoints']}",
        f"  logs:        {s['logs']}  (metrics.jsonl, TensorBoard events)",
        f"  evaluation:  {s['eval_results']}",
        f"  config:      {Path(s['run_dir']) / 'config.json'}",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- host machinery


class _Prefetcher:
    """Reads batches in a thread; each batch comes with the iterator state after it was read, so a
    checkpoint stores exactly the position of the last batch the step consumed."""

    def __init__(self, iterator, depth: int = 4):
        self._it = iterator
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            while not self._stop.is_set():
                batch = next(self._it)
                item = (batch, self._it.get_state())
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surfaced in the main thread
            self._q.put(e)

    def next(self):
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self._stop.set()


def _wait_for_step(metrics: dict) -> None:
    """Blocks until the step that produced ``metrics`` has computed. The loop calls it on the
    previous step's metrics right after dispatching the next one, so at most two steps are
    dispatched but not finished: the device never idles (the next step is queued while the host
    waits), and a SIGTERM is acted on within about two steps' time. Without it, async dispatch lets
    the host run up to run.log_every steps ahead, and the stop checkpoint waits for all of them,
    which can outlast a preemption's grace period (longctx preset: 38.9 s from SIGTERM to exit
    without the wait, 5.0 s with it; eval/BENCHMARKS.md, training loop)."""
    jax.block_until_ready(metrics)


class _Stop:
    """SIGTERM / Ctrl-C: ask the loop to save and exit cleanly (a second Ctrl-C aborts).
    ``signals=False`` (multi-process runs) leaves both alone: SIGTERM goes to JAX's preemption
    notifier (see _Processes.preempted), Ctrl-C interrupts."""

    def __init__(self, signals: bool = True):
        self.requested = None
        self._signals = signals
        self._old = {}

    def __enter__(self):
        if self._signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """The training CLI. Exit status (aiinfra_jax.errors): 0 finished, 75 stopped by SIGTERM /
    Ctrl-C after saving (run the same command to resume), 1 a failure the one-line message
    explains, 2 a config that cannot be used, 130 interrupted without saving."""
    parser = argparse.ArgumentParser(description="Train an aiinfra-jax model.")
    parser.add_argument("--config", default=None, help="preset: configs/<name>.py or .yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a field, e.g. --set model.d_model=256")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not args.debug:
        quiet_library_tracebacks()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        if args.debug:
            traceback.print_exc()
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.print_config:
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    try:
        summary = train(cfg)  # with the registered in-loop hooks the config asks for
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint
        print("interrupted", file=sys.stderr)
        _end_now_if_multiprocess(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except BaseException as e:
        report = describe(e)
        if report is None:  # a bug: its traceback
            if _multiprocess():
                traceback.print_exc()
                _end_now_if_multiprocess(1)
            raise
        if args.debug:
            traceback.print_exc()
        print(f"error: {report[0]}", file=sys.stderr)
        _end_now_if_multiprocess(report[1], explain=not isinstance(e, shd.DistributedError))
        return report[1]
    return 0 if summary["finished"] else EXIT_STOPPED


def _multiprocess() -> bool:
    return jax.distributed.is_initialized() and jax.process_count() > 1


def _end_now_if_multiprocess(status: int, explain: bool = True) -> None:
    """A failed process of a multi-process run ends at once: the others are then stopped by JAX's
    distributed service (they may be waiting for it in a step). A normal exit would first wait
    for them at the runtime's shutdown barrier, up to mesh.init_timeout_s."""
    if not _multiprocess():
        return
    if explain:
        print(f"process {jax.process_index()} of {jax.process_count()} failed (above) and ends "
              "now; JAX's distributed service stops the other processes. Fix the cause, then "
              "start every process again with the same command: the run resumes from its last "
              "checkpoint", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # Process 0 hosts the coordination service, whose end aborts the others at once: wait a few
    # seconds at a last meeting, so that processes failing together (e.g. on a config check that
    # every process makes) each print their own error first. A process stuck elsewhere does not
    # come, and the wait ends.
    try:
        shd.exchange("exit", status, timeout_s=_FAREWELL_S)
        if jax.process_index() == 0:
            time.sleep(2.0)  # the others end first, with their own status, not the service's abort
    except Exception:  # noqa: BLE001 -- best effort: the process ends either way
        pass
    os._exit(status)


_FAREWELL_S = 10.0


if __name__ == "__main__":
    sys.exit(main())
