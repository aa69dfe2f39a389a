"""Associative recall at the token level: which mixers learn it, at which learning rate and head
size.

    python -m aiinfra_jax.eval.bench_recall [--mixers dense,gdn,kda] [--lrs 1e-3,3e-3]
        [--heads 1,2] [--pairs 8] [--steps 600] [--out-dir runs/bench_recall]
        [--quant-rounds R [--quant-settings none,int8_per_step,int8,...]]
    make bench-recall ARGS="..."

Multi-query associative recall as Zoology (Arora et al., arXiv 2312.04927) poses it, the probe the
linear-attention literature uses to check that a recurrent layer can store and retrieve: a sequence
of N key-value pairs "k1 v1 ... kN vN" (distinct keys from tokens 1-63, values from 64-127), then
the N keys again in a random order, each followed by its value. Loss and accuracy count only those
recalled values, so chance is 1/64 per value (and a model that has only learned that values follow
keys, not which, sits near ln 64 = 4.16 nats). Every (mixer, lr, heads) cell trains a fresh
--layers-layer model of --d-model (this library's Transformer, "mixers" all the same, --heads
query heads of d_model / heads, as many KV heads; --short-conv before each mixer) with the
trainer's optimizer (AdamW, warm-up then cosine to 0.1x, weight decay on matrices only; its b2,
weight decay and clipping by flag) on fresh batches, and reports the accuracy on a held-out batch
every steps / 10 steps, the first step at which it reached 90%, and the final accuracy.

Why it is here (issue 22): the recurrent mixers learned no retrieval in the byte-level long-context
recipe (eval/BENCHMARKS.md). This separates "cannot" from "not with these settings": the same
models on the cleanest recall task, swept over the two settings that decide it here.

Quantized recurrent states (issue 23), `--quant-rounds R`: after a gdn or kda cell trains, its
held-out recall is decoded through the model's generation cache (generate.decode_step, one token
at a time, as bench_leapquant --quality does) once per --quant-settings value of
model.gated_delta.state_quant (default: float32, bf16 and INT8 rounded every step, LeapQuant
INT8 / INT6 / INT4), on --quant-batch fresh sequences of the pairs followed by R query passes
over the keys (each pass a fresh order; T = 2 * pairs * (1 + R)), teacher-forced. R = 1 is the
training task; a larger R keeps the same associations live over a long decode, where a state's
rounding errors have time to add up. Reported per format: accuracy over all passes, in the first
pass and in the last quarter of the passes, and max |logit - float32 decode logit|; the training
forward (no cache) on the same sequences is the check that the float32 decode is exact.

No timings are asserted or compared (each cell is a separate training run); the wall time per cell
is printed for planning.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from aiinfra_jax import steps
from aiinfra_jax.config import OptimConfig
from aiinfra_jax.eval.leapquant_quality import decode_scores, forward_scores
from aiinfra_jax.models import ModelConfig, Transformer
from aiinfra_jax.models.attention.gated_delta import GatedDeltaConfig

VOCAB = 128
KEYS = np.arange(1, 64)        # key tokens
VALUE_LO = 64                  # values are 64..127
TARGET = 0.9                   # "learned": held-out accuracy at or above this
RECURRENT = ("gdn", "kda")     # mixers with a recurrent decode state (--quant-rounds)
QUANT_SETTINGS = ("none", "bf16_per_step", "int8_per_step", "int8", "int6", "int4")


def recall_batch(rng: np.random.Generator, batch: int, pairs: int, rounds: int = 1):
    """(inputs [B,T-1], targets [B,T-1], weights [B,T-1]) with T = 2 * pairs * (1 + rounds): the
    pairs, then `rounds` passes over the keys (each in a fresh random order), each key followed
    by its value; weight 1 on the value that follows each queried key, 0 elsewhere."""
    if not 1 <= pairs <= KEYS.size:
        raise ValueError(f"--pairs={pairs} must be in [1, {KEYS.size}] (distinct keys 1-63)")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1 (query passes over the keys)")
    keys = np.stack([rng.choice(KEYS, pairs, replace=False) for _ in range(batch)])
    vals = rng.integers(VALUE_LO, VOCAB, (batch, pairs))
    parts = [np.stack([keys, vals], -1).reshape(batch, -1)]
    for _ in range(rounds):
        order = np.argsort(rng.random((batch, pairs)), axis=1)
        parts.append(np.stack([np.take_along_axis(keys, order, 1),
                               np.take_along_axis(vals, order, 1)], -1).reshape(batch, -1))
    tokens = np.concatenate(parts, 1)
    weights = np.zeros(tokens.shape, np.float32)
    weights[:, 2 * pairs + 1::2] = 1.0                       # the recalled values
    return (jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32),
            jnp.asarray(weights[:, 1:]))


def _loss(model, x, y, w):
    pos = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape)
    logits = model(x, positions=pos)[0]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    acc = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.sum(w), jnp.sum(acc * w) / jnp.sum(w)


def _model_config(mixer: str, heads: int, args, max_seq_len: int,
                  state_quant: str | None = None) -> ModelConfig:
    gated = GatedDeltaConfig(state_quant=state_quant)
    return ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=heads,
                       n_kv_heads=heads, mixers=(mixer,), vocab_size=VOCAB,
                       max_seq_len=max_seq_len, short_conv=args.short_conv, gated_delta=gated)


def quantized_recall(mixer: str, heads: int, trained: nnx.State, args) -> dict:
    """The trained cell's held-out recall decoded one token at a time through its state cache,
    for every --quant-settings value of model.gated_delta.state_quant ("none" = float32, run
    first: the reference), on sequences of --quant-rounds query passes; and the training forward
    (no cache, float32) on the same sequences. See the module docstring."""
    x, y, w = (np.asarray(a) for a in recall_batch(
        np.random.default_rng([args.seed, 3]), args.quant_batch, args.pairs, args.quant_rounds))
    w = w > 0
    per_round = 2 * args.pairs
    rnd = (np.arange(x.shape[1]) + 1) // per_round - 1          # query round of each target
    last = rnd >= args.quant_rounds - max(args.quant_rounds // 4, 1)

    def summary(setting, hit, diff, state_bytes):
        return {"setting": setting, "accuracy": float(hit[w].mean()),
                "first_round": float(hit[w & (rnd == 0)].mean()),
                "last_quarter": float(hit[w & last].mean()),
                "max_abs_logit_diff": float(diff.max()),
                "state_bytes_per_row_per_layer": state_bytes}

    rows, ref, fp32_model = [], None, None
    for s in args.quant_settings:
        model = Transformer(_model_config(mixer, heads, args, x.shape[1] + 1,
                                          None if s == "none" else s), rngs=nnx.Rngs(0))
        nnx.update(model, trained)
        r = decode_scores(model, x, y, 0, ref, label=f"{mixer} {s}")
        if ref is None:
            ref, fp32_model = r.pop("logits"), model
        gd = [b for b in r["state_bytes"] if b]
        rows.append(summary(s, r["hit"], r["diff"], gd[0] // x.shape[0] if gd else 0))
    f = forward_scores(fp32_model, x, y, 0, ref)
    rows.append(summary("training forward", f["hit"], f["diff"], 0))
    return {"rounds": args.quant_rounds, "tokens": int(x.shape[1]) + 1,
            "sequences": int(x.shape[0]), "rows": rows}


def run_cell(mixer: str, lr: float, heads: int, args) -> dict:
    """Trains one fresh model; returns its curve and summary (and, with --quant-rounds, the
    quantized-state recall of a recurrent mixer)."""
    cfg = _model_config(mixer, heads, args, 4 * args.pairs)
    model = Transformer(cfg, rngs=nnx.Rngs(args.seed))
    # plain dicts, as the trainer keeps them (steps.weight_decay_mask gives one of that shape)
    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(param_state)
    optim = OptimConfig(lr=lr, warmup_steps=min(100, args.steps // 10), b2=args.b2,
                        weight_decay=args.weight_decay, grad_clip=args.grad_clip)
    tx = steps.make_optimizer(optim, args.steps, steps.weight_decay_mask(param_state))
    opt_state = tx.init(params)

    def loss_of(params, x, y, w):
        state = nnx.State(param_state)
        nnx.replace_by_pure_dict(state, params)
        return _loss(nnx.merge(graphdef, state, rest), x, y, w)

    @jax.jit
    def train_step(params, opt_state, x, y, w):
        grads = jax.grad(lambda p: loss_of(p, x, y, w)[0])(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    evaluate = jax.jit(loss_of)
    rng = np.random.default_rng([args.seed, 1])
    held_out = recall_batch(np.random.default_rng([args.seed, 2]), args.eval_batch, args.pairs)
    curve, first, t0 = [], None, time.perf_counter()
    every = max(args.steps // 10, 1)
    for step in range(1, args.steps + 1):
        params, opt_state = train_step(params, opt_state,
                                       *recall_batch(rng, args.batch, args.pairs))
        if step % every == 0 or step == args.steps:
            loss, acc = (float(v) for v in evaluate(params, *held_out))
            curve.append({"step": step, "loss": loss, "accuracy": acc})
            if first is None and acc >= TARGET:
                first = step
    row = {"mixer": mixer, "lr": lr, "heads": heads, "head_dim": args.d_model // heads,
           "params": int(sum(np.prod(p.shape) for p in jax.tree.leaves(params))),
           "final_accuracy": curve[-1]["accuracy"], "final_loss": curve[-1]["loss"],
           "first_step_at_target": first, "curve": curve,
           "seconds": time.perf_counter() - t0}
    if args.quant_rounds and mixer in RECURRENT:
        trained = nnx.State(param_state)
        nnx.replace_by_pure_dict(trained, params)
        row["quantized"] = quantized_recall(mixer, heads, trained, args)
    return row


def markdown(rows: list[dict], args) -> str:
    head = (f"MQAR, {args.pairs} pairs (T = {4 * args.pairs}), d_model {args.d_model}, "
            f"{args.layers} layers, short conv {args.short_conv}, {args.steps} steps of "
            f"{args.batch}, seed {args.seed}; AdamW b2 {args.b2:g}, weight decay "
            f"{args.weight_decay:g}, clipping {args.grad_clip:g}; held-out accuracy on "
            f"{args.eval_batch} sequences (chance 1/64)\n\n"
            "| mixer | lr | heads x dim | params | final acc | final loss | first step >= 90% "
            "| s |\n|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['mixer']} | {r['lr']:g} | {r['heads']} x {r['head_dim']} | {r['params']:,} | "
        f"{r['final_accuracy']:.1%} | {r['final_loss']:.3f} | "
        f"{r['first_step_at_target'] or 'never'} | {r['seconds']:.0f} |\n" for r in rows)


def quant_markdown(rows: list[dict]) -> str:
    """The table of the cells' quantized-state recall (rows without it are left out)."""
    cells = [r for r in rows if "quantized" in r]
    if not cells:
        return ""
    q = cells[0]["quantized"]
    head = (f"\nRecall decoded one token at a time through the state cache, per "
            f"model.gated_delta.state_quant, on {q['sequences']} held-out sequences of "
            f"{q['tokens']} tokens (the pairs, then {q['rounds']} query passes over the keys; "
            "the cells trained on one): accuracy over every pass, the first pass, the last "
            "quarter of the passes; max |logit - float32 decode logit|\n\n"
            "| mixer | lr | heads x dim | state | acc | first pass | last quarter | "
            "max abs dlogit | state B/row/layer |\n|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['mixer']} | {r['lr']:g} | {r['heads']} x {r['head_dim']} | {s['setting']} | "
        f"{s['accuracy']:.1%} | {s['first_round']:.1%} | {s['last_quarter']:.1%} | "
        f"{s['max_abs_logit_diff']:.2e} | {s['state_bytes_per_row_per_layer'] or '-'} |\n"
        for r in cells for s in r["quantized"]["rows"])


def _csv(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixers", type=_csv(str), default=("dense", "gdn", "kda"))
    ap.add_argument("--lrs", type=_csv(float), default=(1e-3, 3e-3))
    ap.add_argument("--heads", type=_csv(int), default=(1, 2))
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--short-conv", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--eval-batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weight-decay", type=float, default=OptimConfig.weight_decay)
    ap.add_argument("--b2", type=float, default=OptimConfig.b2)
    ap.add_argument("--grad-clip", type=float, default=OptimConfig.grad_clip)
    ap.add_argument("--quant-rounds", type=int, default=0,
                    help="after training a gdn/kda cell, decode held-out sequences of this many "
                    "query passes through each --quant-settings state format (0 = off)")
    ap.add_argument("--quant-settings", type=_csv(str), default=QUANT_SETTINGS,
                    help="model.gated_delta.state_quant values; none = float32 (the reference)")
    ap.add_argument("--quant-batch", type=int, default=64, help="held-out sequences decoded")
    ap.add_argument("--out-dir", default="runs/bench_recall")
    args = ap.parse_args(argv)
    if args.quant_rounds < 0 or args.quant_batch < 1:
        ap.error("--quant-rounds must be >= 0 and --quant-batch >= 1")
    if args.quant_rounds:
        settings = ["none"] + [s for s in args.quant_settings if s != "none"]
        for s in settings[1:]:
            try:
                GatedDeltaConfig(state_quant=s)
            except ValueError as e:
                ap.error(f"--quant-settings: {e}")
        args.quant_settings = tuple(dict.fromkeys(settings))
    for h in args.heads:
        if h < 1 or args.d_model % h:
            ap.error(f"--heads {h}: every head count must divide --d-model {args.d_model}")
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    recall_batch(np.random.default_rng(0), 1, args.pairs)  # validates --pairs before any work
    rows = []
    for mixer in args.mixers:
        for heads in args.heads:
            for lr in args.lrs:
                r = run_cell(mixer, lr, heads, args)
                rows.append(r)
                print(f"{mixer:>6} lr {lr:g} heads {heads}: final {r['final_accuracy']:.1%}, "
                      f">= 90% at step {r['first_step_at_target'] or 'never'} "
                      f"({r['seconds']:.0f} s)", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, args) + quant_markdown(rows)
    (out / "results.md").write_text(table)
    (out / "results.json").write_text(json.dumps(
        {"args": vars(args), "command": " ".join(sys.argv), "rows": rows}, indent=1))
    print(table + f"\noutputs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
