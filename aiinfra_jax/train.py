"""The one training loop: the stateful shell around the pure steps of aiinfra_jax.steps.

Pure parts (no I/O, jitted; in aiinfra_jax.steps): `make_optimizer`, `loss_and_stats`,
`make_train_step`, `make_eval_step`. The stateful shell (`Trainer`) owns the mesh, the data iterators, the checkpointer, the metric writers
and the signal handling, and never knows which mixer it trains: the model is built from the registry by
its config and reports its own FLOPs per token.

State (a plain pytree, so jit shardings, optax and orbax see one simple tree):
    {"params": nested dict of arrays, "opt_state": optax state, "step": int32,
     "bad_step": int32 (0, or 1 + the first step whose loss or gradients were not finite)}
A non-finite step leaves params and optimizer state unchanged (selected inside the jitted step, so the
donated buffers always hold the last good state); the host sees `bad_step` at the next log point and
stops, naming the step, without saving anything newer than the last good checkpoint.

Shapes: B = global batch rows, T = sequence length, V = vocabulary, A = gradient-accumulation steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax import sharding as shd
from aiinfra_jax.checkpoint import Checkpointer, NoCheckpointError, config_differences
from aiinfra_jax.config import (Config, ConfigError, load_config, load_run_config, save_config,
                                to_dict)
from aiinfra_jax.data import BATCH_KEYS, load_tokenizer, make_iterator
from aiinfra_jax.metrics import MetricsWriter, ProgressBar, mfu, peak_flops_per_device
from aiinfra_jax.models import Transformer
from aiinfra_jax.steps import (abstract_model, lr_schedule, make_eval_step,  # noqa: F401
                               make_optimizer, make_train_step, merge_model, summarize_eval,
                               weight_decay_mask)

log = logging.getLogger("aiinfra_jax.train")

# ----------------------------------------------------------------------------- run directories


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


# ----------------------------------------------------------------------------- the stateful shell


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


class Trainer:
    def __init__(self, cfg: Config):
        shd.maybe_initialize_distributed(cfg.mesh)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        try:  # vocab_size=0 means the tokenizer's size, rounded up to a multiple of 128
            model_cfg = cfg.model.with_vocab(self.tokenizer.vocab_size)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        cfg = dataclasses.replace(cfg, model=model_cfg)
        self.cfg = cfg
        self.mesh = shd.make_mesh(cfg.mesh)
        dp = shd.data_parallel_size(self.mesh)
        micro = cfg.data.batch_size // cfg.optim.grad_accum
        if micro % dp:
            raise ConfigError(f"data.batch_size={cfg.data.batch_size} / optim.grad_accum="
                              f"{cfg.optim.grad_accum} = {micro} rows per micro-batch, which the "
                              f"{dp} data-parallel devices (mesh data*fsdp) do not divide")
        self.graphdef, self.abstract_params, self.rest = abstract_model(cfg.model, cfg.run.seed)
        self.param_shardings = shd.param_shardings(self.abstract_params, self.mesh)
        self.optimizer = make_optimizer(cfg.optim, cfg.run.steps,
                                        weight_decay_mask(self.abstract_params))
        self.batch_sharding = shd.batch_sharding(self.mesh)
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        params_abs = nnx.to_pure_dict(self.abstract_params)
        opt_abs = jax.eval_shape(self.optimizer.init, params_abs)
        self.state_shardings = {
            "params": self.param_shardings,
            "opt_state": _match_param_shardings(opt_abs, params_abs, self.param_shardings,
                                                self.replicated),
            "step": self.replicated, "bad_step": self.replicated,
        }

    # -- state

    def _init_state_fn(self):
        cfg, seed, optimizer = self.cfg.model, self.cfg.run.seed, self.optimizer

        def init():
            model = Transformer(cfg, rngs=nnx.Rngs(seed))
            params = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])
            return {"params": params, "opt_state": optimizer.init(params),
                    "step": jnp.int32(0), "bad_step": jnp.int32(0)}

        return init

    def init_state(self):
        """A fresh state, initialised directly into its shardings."""
        return jax.jit(self._init_state_fn(), out_shardings=self.state_shardings)()

    def abstract_state(self):
        """ShapeDtypeStructs (with shardings) of the state, to restore a checkpoint into."""
        shapes = jax.eval_shape(self._init_state_fn())
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    # -- steps

    def compiled_steps(self):
        train_step = make_train_step(self.graphdef, self.abstract_params, self.rest,
                                     self.optimizer, self.cfg.optim.grad_accum)
        eval_step = make_eval_step(self.graphdef, self.abstract_params, self.rest,
                                   self.cfg.eval.position_buckets)
        batch_sh = {k: self.batch_sharding for k in BATCH_KEYS}
        jtrain = jax.jit(train_step, in_shardings=(self.state_shardings, batch_sh),
                         out_shardings=(self.state_shardings, self.replicated),
                         donate_argnums=(0,))
        jeval = jax.jit(eval_step, in_shardings=(self.state_shardings["params"], batch_sh),
                        out_shardings=self.replicated)
        return jtrain, jeval

    def longctx_grid(self):
        """The in-loop long-context grid (eval.longctx_*), checked before training starts.

        The evaluation code lives in aiinfra_jax.eval (which imports the core); it is imported here
        lazily, only when the run asks for it, so the core never depends on it otherwise."""
        from aiinfra_jax.eval.longctx import build_examples, small_grid

        e = self.cfg.eval
        lengths = e.longctx_lengths or (self.cfg.data.seq_len,)
        too_long = [n for n in lengths if n > self.cfg.model.max_seq_len]
        if too_long:
            raise ConfigError(f"eval.longctx_lengths={tuple(lengths)}: {too_long} exceed "
                              f"model.max_seq_len={self.cfg.model.max_seq_len}")
        try:
            grid = small_grid(lengths=tuple(lengths), tasks=tuple(e.longctx_tasks),
                              depths=tuple(e.longctx_depths), samples=e.longctx_samples)
            build_examples(self.tokenizer, grid)  # a length too short for a task fails here
        except ValueError as err:
            raise ConfigError(f"eval.longctx_*: {err}") from err
        return grid

    def longctx_scores(self, params, grid) -> dict[str, float]:
        from aiinfra_jax.eval.longctx import longctx_scores

        model = merge_model(self.graphdef, self.abstract_params, self.rest, params)
        return longctx_scores(model, self.tokenizer, grid)

    def evaluate(self, params, eval_step, max_batches: int, split: str = "validation"
                 ) -> dict[str, Any]:
        """Loss/perplexity over the first max_batches batches of a split (0 = the whole split)."""
        total = None
        with make_iterator(self.cfg.data, self.tokenizer, split=split, seed=self.cfg.run.seed,
                           repeat=False) as it:
            for i, batch in enumerate(it):
                if max_batches and i >= max_batches:
                    break
                stats = eval_step(params, shd.shard_batch(_local_rows(batch), self.mesh))
                total = stats if total is None else jax.tree.map(jnp.add, total, stats)
        if total is None:
            raise ValueError(f"the {split} split produced no batches; check data.sources and "
                             f"data.val_fraction")
        return summarize_eval(jax.device_get(total), self.cfg.data.seq_len)


def _match_param_shardings(opt_abs, params_abs, params_sh, default):
    """Optimizer-state leaves shaped like a parameter get that parameter's sharding."""
    flat_p = {tuple(str(k) for k in path): sh
              for (path, _), sh in zip(jax.tree_util.tree_flatten_with_path(params_abs)[0],
                                       jax.tree.leaves(params_sh))}

    shapes = {tuple(str(k) for k in path): leaf.shape
              for path, leaf in jax.tree_util.tree_flatten_with_path(params_abs)[0]}

    def pick(path, leaf):
        keys = tuple(str(k) for k in path)
        for n in range(len(keys)):  # longest matching path suffix first
            sh = flat_p.get(keys[n:])
            if sh is not None and shapes[keys[n:]] == leaf.shape:
                return sh
        return default

    return jax.tree_util.tree_map_with_path(pick, opt_abs)


def _local_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's rows of a global batch (every process reads the same global batch)."""
    n, i = jax.process_count(), jax.process_index()
    if n == 1:
        return batch
    return {k: v[i * (len(v) // n):(i + 1) * (len(v) // n)] for k, v in batch.items()}


# ----------------------------------------------------------------------------- the loop


class _Stop:
    """SIGTERM / Ctrl-C: ask the loop to save and exit cleanly (a second Ctrl-C aborts)."""

    def __init__(self):
        self.requested = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
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


class NonFiniteError(RuntimeError):
    pass


def train(cfg: Config, *, stop_after: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Runs (or resumes) a training run; returns the summary (also written to run_dir/summary.json).

    stop_after: stop (with a checkpoint) once this many steps are done, as if interrupted; for tests
    of resumption and for tools that train in slices.
    """
    trainer = Trainer(cfg)  # validates everything that needs the devices or the tokenizer
    cfg = trainer.cfg
    longctx_grid = trainer.longctx_grid() if cfg.eval.longctx_every else None
    run_dir, resume = choose_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    save_config(cfg, run_dir / "config.json")

    ckpt = Checkpointer(run_dir / "checkpoints", config=to_dict(cfg), keep=cfg.checkpoint.keep,
                        async_save=cfg.checkpoint.async_save)
    train_it = make_iterator(cfg.data, trainer.tokenizer, split="train", seed=cfg.run.seed)
    latest = ckpt.latest_step()
    if latest is not None:
        if not resume:
            raise RuntimeError(f"{run_dir} already holds checkpoints but was chosen for a new run")
        state, data_state, _ = ckpt.restore(trainer.abstract_state())
        say(f"resumed {run_dir} from step {int(state['step'])}"
            + (" (its own checkpoint; checkpoint.initialize_from is not read again)"
               if cfg.checkpoint.initialize_from else ""))
    else:
        state, data_state = (initialize_from(trainer, say) if cfg.checkpoint.initialize_from
                             else (trainer.init_state(), None))
        say(f"new run in {run_dir}")
    if data_state is not None:
        train_it.set_state(data_state)
    if cfg.data.stages:
        say("data stages: " + "; ".join(
            f"from step {start + 1}: " + ", ".join(f"{src} {w:.2f}" for src, w in
                                               zip(cfg.data.sources, weights) if w > 0)
            for start, weights in cfg.data.stage_weights))
    jtrain, jeval = trainer.compiled_steps()

    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    seq_len, batch_size = cfg.data.seq_len, cfg.data.batch_size
    model_for_flops = nnx.merge(trainer.graphdef, trainer.abstract_params, trainer.rest)
    flops_per_token = float(model_for_flops.flops_per_token(seq_len))
    peak, peak_source = peak_flops_per_device(jax.devices()[0], cfg.model.dtype)
    n_dev = trainer.mesh.size
    say(f"model: {n_params / 1e6:.2f}M params, {flops_per_token / 1e6:.2f} MFLOP/token forward; "
        f"mesh {dict(trainer.mesh.shape)} on {jax.devices()[0].device_kind}; peak "
        f"{peak / 1e9:.1f} GFLOP/s per device ({peak_source})")

    step = int(jax.device_get(state["step"]))
    # On resume, metric lines logged after the checkpoint (by the interrupted run) are dropped.
    writer = MetricsWriter(run_dir / "logs", resume_step=step if latest is not None else None)
    can_eval = cfg.data.val_fraction > 0
    if not can_eval:
        say("data.val_fraction=0: no validation split, so evaluation is skipped")
    start_step = step
    total = cfg.run.steps
    bar = ProgressBar(total, desc=cfg.run.name) if (cfg.run.progress and not quiet) else None
    prefetch = _Prefetcher(train_it)
    pending: list[dict] = []
    last_data_state = data_state if latest is not None else train_it.get_state()
    t_interval = time.perf_counter()
    host_wait = 0.0
    history: list[dict] = []
    stopped_by = None
    last_eval = None

    def save(step_: int, force: bool = False):
        ckpt.save(step_, state, last_data_state, force=force)

    try:
        with _Stop() as stop:
            while step < total:
                t0 = time.perf_counter()
                batch, data_state_after = prefetch.next()
                host_wait += time.perf_counter() - t0
                state, metrics = jtrain(state, shd.shard_batch(_local_rows(batch), trainer.mesh))
                last_data_state = data_state_after
                if pending:  # (emptied only at a log point, which waited for every step)
                    _wait_for_step(pending[-1])  # bounds the run-ahead; see _wait_for_step
                pending.append(metrics)
                step += 1
                at_log = step % cfg.run.log_every == 0 or step == total
                at_eval = (can_eval and cfg.eval.every and step % cfg.eval.every == 0
                           and step < total)
                at_ckpt = cfg.checkpoint.every and step % cfg.checkpoint.every == 0
                at_longctx = longctx_grid is not None and step % cfg.eval.longctx_every == 0
                interrupt = stop.requested or (stop_after is not None and step >= stop_after)
                if at_log or at_eval or at_ckpt or at_longctx or interrupt:
                    bad = int(jax.device_get(state["bad_step"]))
                    if bad:
                        raise NonFiniteError(
                            f"step {bad}: the loss or the gradients are not finite (NaN/Inf). "
                            f"Training stopped; the last good checkpoint (step "
                            f"{ckpt.latest_step()}) is kept in {run_dir / 'checkpoints'}. Try a "
                            f"lower optim.lr or a stricter optim.grad_clip.")
                if at_log and pending:
                    values = jax.device_get(pending)
                    dt = time.perf_counter() - t_interval
                    tokens = len(values) * batch_size * seq_len
                    rec = {k: float(np.mean([v[k] for v in values])) for k in values[0]}
                    rec.update({
                        "step": step, "perplexity": math.exp(min(rec["loss"], 80.0)),
                        "lr": float(lr_schedule(cfg.optim, total)(step - 1)),
                        "tokens_per_sec": tokens / dt,
                        "mfu": mfu(flops_per_token, tokens / dt, n_dev, peak),
                        "host_wait_frac": host_wait / dt,
                    })
                    writer.write(step, rec)
                    history.append(rec)
                    if bar:
                        bar.update(step, loss=rec["loss"], tokens_per_sec=rec["tokens_per_sec"],
                                   mfu=rec["mfu"])
                    pending, t_interval, host_wait = [], time.perf_counter(), 0.0
                if at_eval:
                    last_eval = trainer.evaluate(state["params"], jeval, cfg.eval.batches)
                    writer.write(step, {"val/loss": last_eval["loss"],
                                        "val/perplexity": last_eval["perplexity"]})
                    t_interval = time.perf_counter()
                if at_longctx:  # before the next step: the params buffers are donated to it
                    writer.write(step, trainer.longctx_scores(state["params"], longctx_grid))
                    t_interval = time.perf_counter()
                if at_ckpt and not interrupt:
                    save(step)
                if interrupt:
                    stopped_by = stop.requested or f"stop_after={stop_after}"
                    break
        if stopped_by:
            save(step, force=True)
            ckpt.wait()
            say(f"\nstopped at step {step} ({stopped_by}); checkpoint saved in "
                f"{run_dir / 'checkpoints'}; run the same command again to resume")
            return {"run_dir": str(run_dir), "step": step, "finished": False,
                    "history": history, "start_step": start_step}
        save(step, force=True)
        final = (trainer.evaluate(state["params"], jeval, cfg.eval.final_batches)
                 if can_eval else None)
        ckpt.wait()
    finally:
        prefetch.close()
        writer.close()
        if bar:
            bar.close()
        ckpt.close()

    summary = {
        "run_dir": str(run_dir), "step": step, "finished": True, "start_step": start_step,
        "params": int(n_params), "flops_per_token": flops_per_token,
        "final_train_loss": history[-1]["loss"] if history else None,
        "validation": final,
        "checkpoints": str(run_dir / "checkpoints"), "logs": str(run_dir / "logs"),
        "eval_results": str(run_dir / "eval.json"), "history": history,
    }
    (run_dir / "eval.json").write_text(json.dumps(final, indent=2) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(
        {k: v for k, v in summary.items() if k != "history"}, indent=2) + "\n")
    say(_format_summary(summary))
    return summary


def checkpoint_source(spec: str) -> tuple[Path, int | None]:
    """(checkpoints folder, step or None = newest) named by checkpoint.initialize_from: a run
    directory, its checkpoints folder, or one step folder."""
    path = Path(spec).expanduser()
    step = None
    if path.name.isdigit() and path.is_dir():
        path, step = path.parent, int(path.name)
    elif (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not path.is_dir():
        raise ConfigError(f"checkpoint.initialize_from={spec!r}: no such directory; pass a run "
                          "directory (runs/NAME), its checkpoints folder, or one step folder "
                          "(runs/NAME/checkpoints/400)")
    return path, step


def initialize_from(trainer: "Trainer", say) -> tuple[dict, dict | None]:
    """(state, data_state) of the checkpoint named by checkpoint.initialize_from (see
    CheckpointConfig). Config differences are allowed where the state keeps its tree, shapes and
    dtypes (checked by the restore) and printed; the data stream goes on only when the data
    section is unchanged, else it starts at its first batch."""
    cfg = trainer.cfg
    spec = cfg.checkpoint.initialize_from
    folder, step = checkpoint_source(spec)
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
    """(trainer, state) of a run directory's checkpoint; overrides may change data/mesh/eval only
    (a changed model section is rejected by the checkpoint's compatibility check)."""
    run_dir = Path(run_dir)
    trainer = Trainer(load_run_config(run_dir, overrides))
    ckpt = Checkpointer(run_dir / "checkpoints", config=to_dict(trainer.cfg), async_save=False,
                        read_only=True)  # NoCheckpointError (a FileNotFoundError) if none
    try:
        state, _, _ = ckpt.restore(trainer.abstract_state(), step=step)
    finally:
        ckpt.close()
    return trainer, state


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


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train an aiinfra-jax model.")
    parser.add_argument("--config", default=None, help="preset: configs/<name>.py or .yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a field, e.g. --set model.d_model=256")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    try:
        train(cfg)
    except (ConfigError, NonFiniteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
