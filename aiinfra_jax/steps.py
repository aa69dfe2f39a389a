"""The pure parts of training: model state helpers, the optimizer, and the jitted-step builders.

No I/O and no state here (nanodo's split): `make_train_step` and `make_eval_step` return pure
functions that aiinfra_jax.train jits, donates and drives. Params are plain nested dicts
(`nnx.to_pure_dict`) so jit shardings, optax and orbax all see one simple tree.

State: {"params": nested dict of arrays, "opt_state": optax state, "step": int32,
        "bad_step": int32 (0, or 1 + the first step whose loss or gradients were not finite),
        and, only for models that keep non-parameter state (an nnx.Variable that is not an
        nnx.Param, e.g. a routing bias updated outside the gradient), "model_state": its nested
        dict, returned updated by every step and checkpointed with the rest}.
The training objective is the mean token NLL plus the sum of the auxiliary losses the model
reports (models/auxiliary.py); each auxiliary loss and metric is logged as aux_loss/<name> and
aux/<name>. Components that draw randomness get nnx.Rngs from fold_in(key(seed), step).
A non-finite step leaves params and optimizer state unchanged (selected inside the step, so donated
buffers always hold the last good state).

Shapes: B = global batch rows, T = sequence length, V = vocabulary, A = gradient-accumulation steps.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from aiinfra_jax import sharding as shd
from aiinfra_jax.models import Transformer
from aiinfra_jax.models.config import ModelConfig


# ----------------------------------------------------------------------------- model and optimizer


def abstract_model(cfg: ModelConfig, seed: int = 0):
    """(graphdef, abstract param State, abstract non-param State) of the model without allocating
    anything. The non-param state is what a module keeps besides its parameters (see the module
    docstring); RNG streams stored in a module are refused (randomness comes in per call)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(nnx.state(model, nnx.RngState)):
        raise ValueError("the model stores RNG streams (nnx.Rngs kept as module attributes after "
                         "init); draw randomness from the rngs argument of __call__ instead")
    return graphdef, params, rest


def init_variables(model) -> tuple[dict, dict]:
    """(params, model_state) of a built model as plain nested dicts (model_state is {} for models
    without non-parameter state)."""
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def merge_model(graphdef, abstract_params, rest, params, model_state=None):
    """An nnx model from a plain params dict (inside jit: no copies); model_state (a plain dict
    like init_variables gives) replaces the non-param state's values when given."""
    state = jax.tree.map(lambda x: x, abstract_params)  # fresh State of the same structure
    nnx.replace_by_pure_dict(state, params)
    rest = jax.tree.map(lambda x: x, rest)
    if model_state:
        nnx.replace_by_pure_dict(rest, model_state)
    return nnx.merge(graphdef, state, rest)


def model_state_of(model) -> dict:
    """The model's non-parameter state as a plain dict (after a forward pass that updated it)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))


def weight_decay_mask(abstract_params):
    """True for matrices; False for norm scales, biases and scalars: by their logical axes (a
    "norm" axis, or fewer than two axes besides "layers"), or by a parameter's own
    ``weight_decay=False`` metadata (biases and log-rates with two axes, e.g. NSA's gate bias
    [heads, branch], KDA's dt_bias [heads, K]; as fla's and the public models' _no_weight_decay)."""

    def decays(var):
        if var.get_metadata().get("weight_decay") is False:
            return False
        axes = shd.variable_logical_axes(var)
        if axes is None:
            return var.ndim >= 2
        if "norm" in axes:
            return False
        return sum(a != "layers" for a in axes) >= 2

    return shd.map_variables(decays, abstract_params)


def lr_schedule(cfg, total_steps: int) -> optax.Schedule:
    decay = cfg.decay_steps or max(total_steps - cfg.warmup_steps, 1)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(cfg.lr, end, decay)
    else:
        after = optax.constant_schedule(cfg.lr)
    if cfg.warmup_steps == 0:
        return after
    warm = optax.linear_schedule(cfg.lr / max(cfg.warmup_steps, 1), cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(cfg, total_steps: int, decay_mask) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)


# ----------------------------------------------------------------------------- pure steps


def loss_and_stats(model, batch, n_buckets: int = 1, rngs: nnx.Rngs | None = None):
    """Sum of token NLLs, the summed auxiliary losses, per-position-bucket sums, and the model's
    aux (models/auxiliary.py: losses, metrics).

    Position buckets split [0, T) of the row into n_buckets equal ranges of the token's position
    within its document (batch["positions"]), to show whether the model uses long context.
    """
    logits, _, aux = model(batch["inputs"], positions=batch["positions"],
                           segment_ids=batch["segment_ids"], rngs=rngs)
    logits = logits.astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    w = batch["loss_weights"].astype(jnp.float32)
    nll_sum = jnp.sum(nll * w)
    w_sum = jnp.sum(w)
    T = batch["inputs"].shape[1]
    bucket = jnp.clip(batch["positions"] * n_buckets // T, 0, n_buckets - 1)
    onehot = jax.nn.one_hot(bucket, n_buckets, dtype=jnp.float32) * w[..., None]
    stats = {
        "nll_sum": nll_sum,
        "weight_sum": w_sum,
        "bucket_nll": jnp.einsum("btk,bt->k", onehot, nll),
        "bucket_weight": onehot.sum((0, 1)),
        "correct": jnp.sum((jnp.argmax(logits, -1) == batch["targets"]) * w),
    }
    aux_loss = sum(aux["losses"].values(), jnp.float32(0.0))
    return nll_sum, aux_loss, stats, aux


def aux_metrics(aux) -> dict[str, jax.Array]:
    """The model's auxiliary losses and metrics as flat log keys (aux_loss/<name>, aux/<name>)."""
    out = {f"aux_loss/{k}": v for k, v in aux["losses"].items()}
    if aux["losses"]:
        out["aux_loss"] = sum(aux["losses"].values())
    out.update({f"aux/{k}": v for k, v in aux["metrics"].items()})
    return out


def loss_weights(schedule: tuple[tuple[int, float, float], ...], step: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """(lm_weight, aux_weight) at state step `step` of OptimConfig.loss_schedule()."""
    starts = jnp.asarray([s for s, _, _ in schedule], jnp.int32)
    table = jnp.asarray([[lm, aux] for _, lm, aux in schedule], jnp.float32)
    row = table[jnp.sum(step >= starts) - 1]
    return row[0], row[1]


def make_train_step(graphdef, abstract_params, rest, optimizer, grad_accum: int, seed: int = 0,
                    loss_schedule: tuple[tuple[int, float, float], ...] = ((0, 1.0, 1.0),)):
    """train_step(state, batch) -> (state, metrics); pure, to be jitted with the state donated.
    seed: the base of the per-step randomness handed to the model (nnx.Rngs). loss_schedule:
    OptimConfig.loss_schedule(), the weights of the NLL and the auxiliary losses by step (the
    logged "loss" stays the plain NLL)."""
    has_model_state = bool(jax.tree.leaves(rest))

    def micro_loss(params, mb, model_state, key, weights):
        model = merge_model(graphdef, abstract_params, rest, params, model_state)
        nll_sum, aux_loss, stats, aux = loss_and_stats(model, mb, rngs=nnx.Rngs(key))
        new_model_state = model_state_of(model) if has_model_state else {}
        # Weighted by tokens: the objective is total NLL / total weight over the whole batch; the
        # caller divides by the weight summed over micro-batches.
        lm_w, aux_w = weights
        return lm_w * nll_sum + aux_w * aux_loss * stats["weight_sum"], (
            stats, aux_metrics(aux), new_model_state)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def train_step(state, batch):
        params = state["params"]
        model_state = state.get("model_state", {})
        key = jax.random.fold_in(jax.random.key(seed), state["step"])
        weights = loss_weights(loss_schedule, state["step"])
        if grad_accum == 1:
            (_, (stats, aux, new_model_state)), grads = grad_fn(params, batch, model_state, key,
                                                                weights)
        else:
            micro = jax.tree.map(
                lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

            def body(carry, xs):
                g_acc, s_acc, ms = carry
                mb, i = xs
                (_, (s, a, ms)), g = grad_fn(params, mb, ms, jax.random.fold_in(key, i), weights)
                return (jax.tree.map(jnp.add, g_acc, g),
                        jax.tree.map(jnp.add, s_acc, s), ms), a

            zeros_g = jax.tree.map(jnp.zeros_like, params)
            _, (stats0, _, _) = jax.eval_shape(lambda: micro_loss(
                params, jax.tree.map(lambda x: x[0], micro), model_state, key, weights))
            zeros_s = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats0)
            (grads, stats, new_model_state), aux = jax.lax.scan(
                body, (zeros_g, zeros_s, model_state), (micro, jnp.arange(grad_accum)))
            aux = jax.tree.map(lambda x: x.mean(0), aux)
        denom = jnp.maximum(stats["weight_sum"], 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        loss = stats["nll_sum"] / denom
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                                 for g in jax.tree.leaves(grads)))
        updates, new_opt = optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (state["bad_step"] == 0)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        new_state = {
            "params": keep(new_params, params),
            "opt_state": keep(new_opt, state["opt_state"]),
            "step": state["step"] + ok.astype(jnp.int32),
            "bad_step": jnp.where((state["bad_step"] == 0) & ~ok, state["step"] + 1,
                                  state["bad_step"]),
        }
        if "model_state" in state:
            new_state["model_state"] = keep(new_model_state, model_state)
        metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": stats["weight_sum"],
                   "accuracy": stats["correct"] / denom}
        metrics.update(aux)
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, abstract_params, rest, n_buckets: int):
    """eval_step(params, batch, model_state=None) -> stats (sums, to be added over batches);
    pure. The model state (if the model keeps any) is read, never updated, by an evaluation."""

    def eval_step(params, batch, model_state=None):
        model = merge_model(graphdef, abstract_params, rest, params, model_state)
        _, _, stats, _ = loss_and_stats(model, batch, n_buckets)
        return stats

    return eval_step


def summarize_eval(stats: dict[str, np.ndarray], seq_len: int) -> dict[str, Any]:
    """Loss, perplexity and per-position-bucket loss from summed eval stats."""
    w = float(stats["weight_sum"])
    if w == 0:
        raise ValueError("evaluation saw no target tokens: the validation data is empty")
    loss = float(stats["nll_sum"]) / w
    n = len(stats["bucket_weight"])
    buckets = []
    for i in range(n):
        bw = float(stats["bucket_weight"][i])
        lo, hi = i * seq_len // n, (i + 1) * seq_len // n
        buckets.append({"positions": [lo, hi - 1], "tokens": int(bw),
                        "loss": float(stats["bucket_nll"][i]) / bw if bw else None})
    return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)),
            "accuracy": float(stats["correct"]) / w, "tokens": int(w), "by_position": buckets}
