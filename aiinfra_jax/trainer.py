"""The trainer's state and steps: what a run trains, sharded over the mesh, without the loop.

`Trainer(cfg)` resolves the config against the tokenizer and the devices (it raises `ConfigError`
for what only they can refuse), builds the model abstractly from the registry (it never knows
which mixer it trains), and gives: a fresh or abstract training state in its shardings, the jitted
train and eval steps (aiinfra_jax.steps), the nnx model of a params tree, and a validation pass.
The loop that drives it is aiinfra_jax.train; run directories and restores are aiinfra_jax.rundir.

State (a plain pytree, so jit shardings, optax and orbax see one simple tree):
    {"params": nested dict of arrays, "opt_state": optax state, "step": int32,
     "bad_step": int32 (0, or 1 + the first step whose loss or gradients were not finite),
     "model_state": the model's non-parameter state, only for models that keep any}

The steps are traced under the mesh and the logical-axis rules (sharding.with_activation_rules), so
the models' activation constraints and the kernels' shard_map wrappers see the mesh.

Multi-process runs: each process reads only its part of every batch. Its devices hold some rows
(and, with a context axis across processes, some positions) of the global batch; the rows are
whole data streams (DataConfig.streams), `data_streams` names them, and `shard` places the
process's part. What a batch holds does not depend on the number of processes.

Shapes: B = global batch rows, T = sequence length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax import sharding as shd
from aiinfra_jax.kernels.compilation import compiler_options
from aiinfra_jax.config import Config, ConfigError
from aiinfra_jax.data import BATCH_KEYS, load_tokenizer, make_iterator
from aiinfra_jax.models import Transformer
from aiinfra_jax.steps import (abstract_model, init_variables, make_eval_step, make_optimizer,
                               make_train_step, merge_model, summarize_eval, weight_decay_mask)


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
        if jax.process_count() > 1 and cfg.mesh.num_devices not in (0, jax.device_count()):
            raise ConfigError(f"mesh.num_devices={cfg.mesh.num_devices}: a multi-process run uses "
                              f"every device of every process ({jax.device_count()}); set "
                              "mesh.num_devices=0")
        self.mesh = shd.make_mesh(cfg.mesh)
        dp = shd.data_parallel_size(self.mesh)
        micro = cfg.data.batch_size // cfg.optim.grad_accum
        if micro % dp:
            raise ConfigError(f"data.batch_size={cfg.data.batch_size} / optim.grad_accum="
                              f"{cfg.optim.grad_accum} = {micro} rows per micro-batch, which the "
                              f"{dp} data-parallel devices (mesh {'*'.join(shd.BATCH_AXES)}) do "
                              "not divide")
        # The model of state step 0 (model.stages applied; later stages: compiled_steps).
        self.graphdef, self.abstract_params, self.rest = abstract_model(cfg.model.at_step(0),
                                                                        cfg.run.seed)
        self._stages: dict[int, tuple] = {}  # stage start -> (graphdef, jtrain, jeval)
        self.param_shardings = shd.param_shardings(self.abstract_params, self.mesh)
        self.optimizer = make_optimizer(cfg.optim, cfg.run.steps,
                                        weight_decay_mask(self.abstract_params))
        self.batch_sharding = shd.batch_sharding(self.mesh)
        self.batch_shape = (cfg.data.batch_size, cfg.data.seq_len)
        rows, self._positions = _process_part(self.batch_sharding, self.batch_shape)
        self.data_streams = _streams_of(rows, cfg.data)
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        params_abs = nnx.to_pure_dict(self.abstract_params)
        opt_abs = jax.eval_shape(self.optimizer.init, params_abs)
        self.state_shardings = {
            "params": self.param_shardings,
            "opt_state": _match_param_shardings(opt_abs, params_abs, self.param_shardings,
                                                self.replicated),
            "step": self.replicated, "bad_step": self.replicated,
        }
        if jax.tree.leaves(self.rest):  # non-parameter state, sharded like parameters
            self.state_shardings["model_state"] = shd.param_shardings(self.rest, self.mesh)

    # -- state

    def _init_state_fn(self):
        cfg, seed, optimizer = self.cfg.model, self.cfg.run.seed, self.optimizer

        def init():
            params, model_state = init_variables(Transformer(cfg, rngs=nnx.Rngs(seed)))
            state = {"params": params, "opt_state": optimizer.init(params),
                     "step": jnp.int32(0), "bad_step": jnp.int32(0)}
            if model_state:
                state["model_state"] = model_state
            return state

        return init

    def init_state(self):
        """A fresh state, initialised directly into its shardings."""
        return jax.jit(self._init_state_fn(), out_shardings=self.state_shardings)()

    def abstract_state(self):
        """ShapeDtypeStructs (with shardings) of the state, to restore a checkpoint into."""
        shapes = jax.eval_shape(self._init_state_fn())
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    # -- models and steps

    def model(self, params, model_state=None) -> nnx.Module:
        """The nnx model holding ``params`` (a state's "params" tree; no copies) and, for models
        that keep any, the state's "model_state"."""
        return merge_model(self.graphdef, self.abstract_params, self.rest, params, model_state)

    def flops_per_token(self) -> float:
        """Forward FLOPs per token at data.seq_len, as the model reports them."""
        abstract = nnx.merge(self.graphdef, self.abstract_params, self.rest)
        return float(abstract.flops_per_token(self.cfg.data.seq_len))

    def compiled_steps(self, step: int = 0):
        """(train_step(state, batch), eval_step(params, batch, model_state=None)) of the
        model.stages stage in force at state step `step`, jitted in the state's shardings and
        traced under the mesh's activation rules; built once per stage. The trainer's model()
        then follows that stage."""
        start = self.cfg.model.stage_start(step)
        if start not in self._stages:
            graphdef = self.graphdef
            if start:
                graphdef, params, rest = abstract_model(self.cfg.model.at_step(step),
                                                        self.cfg.run.seed)
                if (jax.tree.structure(params) != jax.tree.structure(self.abstract_params)
                        or jax.tree.structure(rest) != jax.tree.structure(self.rest)):
                    raise ConfigError(f"model.stages: the stage from step {start + 1} changes "
                                      "the model's parameters; a stage may change run-time "
                                      "settings only")
            self._stages[start] = (graphdef,) + self._compile(graphdef)
        self.graphdef = self._stages[start][0]
        return self._stages[start][1:]

    def _compile(self, graphdef):
        train_step = make_train_step(graphdef, self.abstract_params, self.rest,
                                     self.optimizer, self.cfg.optim.grad_accum,
                                     seed=self.cfg.run.seed,
                                     loss_schedule=self.cfg.optim.loss_schedule())
        eval_step = make_eval_step(graphdef, self.abstract_params, self.rest,
                                   self.cfg.eval.position_buckets)
        batch_sh = {k: self.batch_sharding for k in BATCH_KEYS}
        options = compiler_options(self.mesh.devices.flat[0].platform)
        jtrain = jax.jit(shd.with_activation_rules(train_step, self.mesh),
                         in_shardings=(self.state_shardings, batch_sh),
                         out_shardings=(self.state_shardings, self.replicated),
                         donate_argnums=(0,), compiler_options=options)
        jeval = jax.jit(shd.with_activation_rules(eval_step, self.mesh),
                        in_shardings=(self.state_shardings["params"], batch_sh,
                                      self.state_shardings.get("model_state")),
                        out_shardings=self.replicated, compiler_options=options)
        return jtrain, jeval

    def shard(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows of a batch (those of its `data_streams`, as
        make_iterator(..., streams=trainer.data_streams) reads them; with one process, the whole
        batch) as global arrays sharded over the mesh."""
        if jax.process_count() == 1:
            return shd.shard_batch(batch, self.mesh)
        out = {}
        for k, v in batch.items():
            v = np.asarray(v)[:, self._positions]
            out[k] = jax.make_array_from_process_local_data(self.batch_sharding, v,
                                                            self.batch_shape + v.shape[2:])
        return out

    def evaluate(self, state, eval_step, max_batches: int, split: str = "validation"
                 ) -> dict[str, Any]:
        """Loss/perplexity of a state's params (and model state) over the first max_batches
        batches of a split (0 = the whole split). Each process reads its own streams; with
        several streams the pass ends when all of them have (rows of padding, which weigh
        nothing, stand in for the streams that ended first), so the numbers do not depend on
        the number of processes."""
        if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 0:
            raise ValueError(f"evaluate: max_batches={max_batches!r} must be an int >= 0 (0 = the "
                             "whole split)")
        total = None
        many = jax.process_count() > 1
        with make_iterator(self.cfg.data, self.tokenizer, split=split, seed=self.cfg.run.seed,
                           repeat=False, streams=self.data_streams) as it:
            i = 0
            while not max_batches or i < max_batches:
                batch, any_data = _next_or_padding(it)
                if many:  # a pass ends when it has ended for every process's streams
                    any_data = any(shd.exchange(f"{split} batch", any_data,
                                                self.cfg.mesh.init_timeout_s))
                if not any_data:
                    break
                stats = eval_step(state["params"], self.shard(batch), state.get("model_state"))
                total = stats if total is None else jax.tree.map(jnp.add, total, stats)
                i += 1
        if total is None:
            raise ValueError(f"the {split} split produced no batches; check data.sources and "
                             f"data.val_fraction")
        out = summarize_eval(jax.device_get(total), self.cfg.data.seq_len)
        out["batches"] = i  # fewer than max_batches when the split ended first
        return out


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


def _next_or_padding(it) -> tuple[dict[str, np.ndarray] | None, bool]:
    """(the next batch, True), or once the iterator has ended (None, False); a StreamsIterator's
    padding rows after the end, for a process that must take part until every process ends."""
    if hasattr(it, "next_padded"):
        return it.next_padded()
    try:
        return next(it), True
    except StopIteration:
        return None, False


def _process_part(sharding: jax.sharding.NamedSharding, shape: tuple[int, int]
                  ) -> tuple[range, slice]:
    """(rows, positions) of a [B, T] batch that this process's devices hold. Refused with a
    ConfigError when they are not one block (a device order that interleaves processes)."""
    parts = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        parts.add(tuple((sl.start or 0, shape[d] if sl.stop is None else sl.stop)
                        for d, sl in enumerate(index)))
    bounds = [(min(p[d][0] for p in parts), max(p[d][1] for p in parts)) for d in range(2)]
    distinct = [{p[d] for p in parts} for d in range(2)]
    covered = [sum(b - a for a, b in distinct[d]) for d in range(2)]
    if any(covered[d] != bounds[d][1] - bounds[d][0] for d in range(2)) or \
            len(parts) != len(distinct[0]) * len(distinct[1]):
        raise ConfigError(f"mesh: process {jax.process_index()}'s devices hold parts "
                          f"{sorted(parts)} of each [batch, seq] = {shape} batch, which are not "
                          "one block; order the mesh so that each process holds whole, adjacent "
                          "rows (e.g. put the process-spanning axis first: mesh.data)")
    (r0, r1), (c0, c1) = bounds
    return range(r0, r1), slice(c0, c1)


def _streams_of(rows: range, data) -> tuple[int, ...]:
    """The data streams whose rows ``rows`` are (all of them in a single-process run)."""
    per = data.batch_size // data.streams
    if rows.start % per or rows.stop % per:
        n = jax.process_count()
        raise ConfigError(
            f"data.streams={data.streams}: process {jax.process_index()} of {n} holds rows "
            f"{rows.start}..{rows.stop - 1} of each batch, which are not whole streams of {per} "
            f"rows, so it would read other processes' data. Set data.streams to a multiple of "
            f"{n} (it must divide data.batch_size={data.batch_size}); the batches then depend on "
            f"data.streams, never on the number of processes")
    return tuple(range(rows.start // per, rows.stop // per))
