"""The pure parts of training: model state helpers, the optimizer, and the jitted-step builders.

No I/O and no state here (nanodo's split): `make_train_step` and `make_eval_step` return pure
functions that aiinfra_jax.train jits, donates and drives. Params are plain nested dicts
(`nnx.to_pure_dict`) so jit shardings, optax and orbax all see one simple tree.

State: {"params": nested dict of arrays, "opt_state": optax state, "step": int32,
        "bad_step": int32 (0, or 1 + the first step whose loss or gradients were not finite)}.
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
    """(graphdef, abstract param State, rest) of the model without allocating anything."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError("the model holds non-parameter state (e.g. stored RNG streams); the trainer "
                         "keeps only nnx.Param state, so keep RNGs out of modules after init")
    return graphdef, params, rest


def merge_model(graphdef, abstract_params, rest, params):
    """An nnx model from a plain params dict (inside jit: no copies)."""
    state = jax.tree.map(lambda x: x, abstract_params)  # fresh State of the same structure
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state, rest)


def weight_decay_mask(abstract_params):
    """True for matrices; False for norm scales, biases and scalars (by their logical axes)."""

    def decays(var):
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


def loss_and_stats(model, batch, n_buckets: int = 1):
    """Sum of token NLLs, sum of loss weights, auxiliary losses, and per-position-bucket sums.

    Position buckets split [0, T) of the row into n_buckets equal ranges of the token's position
    within its document (batch["positions"]), to show whether the model uses long context.
    """
    logits, _, aux = model(batch["inputs"], positions=batch["positions"],
                           segment_ids=batch["segment_ids"])
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
    aux_loss = sum((v for k, v in aux.items() if k.startswith("loss/")), jnp.float32(0.0))
    return nll_sum, aux_loss, stats, aux


def make_train_step(graphdef, abstract_params, rest, optimizer, grad_accum: int):
    """train_step(state, batch) -> (state, metrics); pure, to be jitted with the state donated."""

    def micro_loss(params, mb):
        model = merge_model(graphdef, abstract_params, rest, params)
        nll_sum, aux_loss, stats, aux = loss_and_stats(model, mb)
        # Weighted by tokens: the objective is total NLL / total weight over the whole batch; the
        # caller divides by the weight summed over micro-batches.
        return nll_sum + aux_loss * stats["weight_sum"], (stats, aux)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def train_step(state, batch):
        params = state["params"]
        if grad_accum == 1:
            (_, (stats, aux)), grads = grad_fn(params, batch)
        else:
            micro = jax.tree.map(
                lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

            def body(carry, mb):
                g_acc, s_acc = carry
                (_, (s, a)), g = grad_fn(params, mb)
                return (jax.tree.map(jnp.add, g_acc, g),
                        jax.tree.map(jnp.add, s_acc, s)), a

            zeros_g = jax.tree.map(jnp.zeros_like, params)
            _, (stats0, _) = jax.eval_shape(lambda: micro_loss(params, jax.tree.map(lambda x: x[0], micro)))
            zeros_s = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats0)
            (grads, stats), aux = jax.lax.scan(body, (zeros_g, zeros_s), micro)
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
        metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": stats["weight_sum"],
                   "accuracy": stats["correct"] / denom}
        metrics.update({k: v for k, v in aux.items() if jnp.ndim(v) == 0})
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, abstract_params, rest, n_buckets: int):
    """eval_step(params, batch) -> stats (sums, to be added over batches); pure."""

    def eval_step(params, batch):
        model = merge_model(graphdef, abstract_params, rest, params)
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
