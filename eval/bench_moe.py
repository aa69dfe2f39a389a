"""MoE vs DeaMoE (issue 24): distinct bytes of routed expert weights a decode step touches at
batch 1-64, from routing traces; and (--quality) loss curves, bytes and FFN times of trained
dense / MoE / DeaMoE presets side by side.

    python -m aiinfra_jax.eval.bench_moe --moe runs/moe_tiny --deamoe runs/deamoe_tiny
    python -m aiinfra_jax.eval.bench_moe --moe configs/moe_tiny.py --deamoe configs/deamoe_tiny.py
    python -m aiinfra_jax.eval.bench_moe --quality [--out-dir runs/bench_moe]   (make bench-moe-quality)

--quality trains (or reads, when an earlier invocation finished them) five tiny runs on the
embedded corpus with validation every 50 steps (QUALITY_RUNS; about 8 min each on 2 cores): the
dense SwiGLU (configs/tiny.py), two matched MoE/DeaMoE pairs (moe_tiny vs deamoe_tiny at equal
parameters and active FLOPs; a fine-grained MoE of 16 experts top-4 vs a DeaMoE of the same 16
experts in 4 departments sharing their weights, which touches fewer weights per token), then
prints the loss table, writes bench_moe_quality.png and .json in --out-dir, prints the bytes per
decode step of both pairs from the trained models' routing, and times layer 0's FFN of every run
in this one invocation: a decode step (x [b,1,D]) at batch 1-64 and a training step's forward +
backward ([16,256,D]), median of --repeats.

Each model is a run or checkpoint (aiinfra_jax.load.load_model) or a preset (.py: freshly
initialised with --seed; its routing is an untrained model's, which the output says). Traces: S =
max(--batches) windows of --tokens tokens from documents of the embedded corpus (drawn with --seed),
run teacher-forced through the model with capture_intermediates=True; every layer's "expert_ids"
[S,T,K] is the routing a cached decode would make at those positions (the model is causal, the
FFN position-wise; cached decode and the full forward differ only by float rounding).

A decode step at batch b and position t is b windows' tokens at t; the windows are split into
S // b disjoint groups, every group and position is one step. Per layer and step the touched
bytes are: MoE, (distinct experts) x 3*D*F*itemsize; DeaMoE, (distinct departments) x
3*D*F*itemsize (the shared gate, up and down) + (distinct experts) x F*F*itemsize (the private
matrices). Summed over layers, averaged over steps. Router and shared-expert weights (loaded every
step whatever the routing) are reported apart, never mixed in. Also printed: the fraction of all
routed weights a step touches, and DeaMoE's mean distinct departments per token (<= its limit).

The bytes mode measures bytes, not time; nothing here runs on an accelerator.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.config import load_config
from aiinfra_jax.data.sources import EmbeddedCorpus
from aiinfra_jax.data.tokenizer import load_tokenizer
from aiinfra_jax.models import Transformer


def load(source: str, seed: int):
    """(model, config, trained?) from a run / checkpoint or a .py preset (fresh init)."""
    if source.endswith(".py"):
        cfg = load_config(source, [])
        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
        cfg = dataclasses.replace(cfg, model=cfg.model.with_vocab(vocab))
        return Transformer(cfg.model, rngs=nnx.Rngs(seed)), cfg, False
    from aiinfra_jax.load import load_model

    loaded = load_model(source)
    return loaded.model, loaded.config, True


def windows(cfg, n: int, length: int, seed: int) -> np.ndarray:
    """[n, length] token windows from random documents of the embedded corpus (long enough
    documents only), each at a random offset."""
    corpus, tok = EmbeddedCorpus.create(), load_tokenizer(cfg.data.tokenizer)
    rng = np.random.default_rng(seed)
    out = []
    for i in rng.permutation(len(corpus)):
        ids = np.asarray(tok.encode(corpus[int(i)]), np.int32)
        if len(ids) > length:
            start = rng.integers(0, len(ids) - length)
            out.append(ids[start:start + length])
            if len(out) == n:
                return np.stack(out)
    raise SystemExit(f"bench_moe: the corpus has fewer than {n} documents of > {length} tokens")


def traces(model, tokens: np.ndarray) -> list[np.ndarray]:
    """Per layer, the expert ids [S,T,K] of a teacher-forced forward."""
    tokens = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        _, _, aux = nnx.merge(graphdef, state)(tokens, positions=positions,
                                               capture_intermediates=True)
        return aux["intermediates"]

    inter = run(state)
    keys = sorted((k for k in inter if k.endswith("/expert_ids")),
                  key=lambda k: int(k.split("/")[0].split("_")[1]))
    if not keys:
        raise SystemExit("bench_moe: the model reports no expert_ids (no moe / deamoe FFN)")
    return [np.asarray(inter[k]) for k in keys]


def sizes(cfg) -> dict:
    """Bytes of one routed unit of the model's FFN and how experts map to departments."""
    m = cfg.model
    item = jnp.dtype(m.param_dtype).itemsize
    d = m.d_model
    if "deamoe" in m.ffns:
        c = m.deamoe
        f, pp = c.resolved_d_ff(m), c.resolved_private_dim(m)
        return dict(kind="deamoe", per_dept=3 * d * f * item, per_expert=pp * pp * item,
                    experts_per_dept=c.num_experts // c.num_departments,
                    total=c.num_departments * 3 * d * f * item + c.num_experts * pp * pp * item,
                    always=d * c.num_experts * 4, limit=c.limit)
    c = m.moe
    f = c.resolved_expert_d_ff(m)
    return dict(kind="moe", per_dept=0, per_expert=3 * d * f * item, experts_per_dept=1,
                total=c.num_experts * 3 * d * f * item,
                always=d * c.num_experts * 4 + 3 * d * c.resolved_shared_d_ff(m) * item,
                limit=None)


def touched(layers: list[np.ndarray], s: dict, batch: int) -> tuple[float, float]:
    """(mean bytes per decode step summed over layers, mean fraction of the routed weights)."""
    steps = []
    for ids in layers:  # [S,T,K]
        n_seq, t, k = ids.shape
        groups = ids[: n_seq // batch * batch].reshape(n_seq // batch, batch, t, k)
        per_step = np.zeros((n_seq // batch, t))
        for gi in range(groups.shape[0]):
            for ti in range(t):
                e = np.unique(groups[gi, :, ti])
                per_step[gi, ti] = (len(e) * s["per_expert"]
                                    + len(np.unique(e // s["experts_per_dept"])) * s["per_dept"])
        steps.append(per_step)
    total = np.sum(steps, axis=0)  # over layers
    return float(total.mean()), float(total.mean() / (s["total"] * len(layers)))


def departments_per_token(layers: list[np.ndarray], s: dict) -> float:
    ids = np.stack(layers)  # [L,S,T,K]
    d = np.sort(ids // s["experts_per_dept"], axis=-1)
    return float((1 + np.sum(d[..., 1:] != d[..., :-1], axis=-1)).mean())


def bytes_table(moe: str, deamoe: str, batches: list[int], tokens: int, seed: int) -> dict:
    """Prints and returns {batch: (MoE bytes, fraction, DeaMoE bytes, fraction)} per decode step
    for a MoE and a DeaMoE model (runs, checkpoints or .py presets)."""
    rows, info = {}, {}
    for name, source in (("moe", moe), ("deamoe", deamoe)):
        model, cfg, trained = load(source, seed)
        s = sizes(cfg)
        if s["kind"] != name:
            raise SystemExit(f"bench_moe: --{name} {source} is a {s['kind']} model")
        layers = traces(model, windows(cfg, max(batches), tokens, seed))
        rows[name] = {b: touched(layers, s, b) for b in batches}
        if name == "deamoe":
            info["departments_per_token"] = departments_per_token(layers, s)
        extra = (f", distinct departments per token {info['departments_per_token']:.3f} "
                 f"(limit {s['limit']})" if name == "deamoe" else "")
        mib = lambda v: f"{v * len(layers) / 2**20:.2f} MiB"  # noqa: E731
        print(f"{name}: {Path(source).name} ({'trained' if trained else 'UNTRAINED, fresh init'})"
              f", {len(layers)} layers, routed expert weights {mib(s['total'])}, always loaded "
              f"(router, shared experts) {mib(s['always'])}"
              + extra)
    print(f"{'batch':>5} | {'MoE MiB/step':>12} {'frac':>6} | {'DeaMoE MiB/step':>15} "
          f"{'frac':>6} | {'DeaMoE/MoE':>10}")
    for b in batches:
        (m, mf), (dm, df) = rows["moe"][b], rows["deamoe"][b]
        print(f"{b:>5} | {m / 2**20:>12.3f} {mf:>6.3f} | {dm / 2**20:>15.3f} {df:>6.3f} | "
              f"{dm / m:>10.3f}")
    return {"rows": {b: (*rows["moe"][b], *rows["deamoe"][b]) for b in batches}, **info}


# ----------------------------------------------------------------------------- --quality

FINE = ["model.moe.num_experts=16", "model.moe.top_k=4", "model.moe.expert_d_ff=176"]
QUALITY_RUNS = (  # name, preset, overrides
    ("dense", "tiny.py", []),
    ("moe", "moe_tiny.py", []),
    ("deamoe", "deamoe_tiny.py", []),
    ("moe_fine", "moe_tiny.py", FINE),
    ("deamoe_shared", "deamoe_tiny.py", ["model.deamoe.num_experts=16",
                                         "model.deamoe.num_departments=4",
                                         "model.deamoe.department_d_ff=176",
                                         "model.deamoe.private_dim=64"]),
)
PAIRS = (("moe", "deamoe"), ("moe_fine", "deamoe_shared"))


def ffn_weights(cfg) -> tuple[int, int]:
    """(FFN weights per layer, weights a token uses at most), router excluded."""
    m = cfg.model
    d = m.d_model
    if "deamoe" in m.ffns:
        c = m.deamoe
        f, pp = c.resolved_d_ff(m), c.resolved_private_dim(m)
        return (c.num_departments * 3 * d * f + c.num_experts * pp * pp,
                c.slots * 3 * d * f + c.top_k * pp * pp)
    if "moe" in m.ffns:
        c = m.moe
        f, fs = c.resolved_expert_d_ff(m), c.resolved_shared_d_ff(m)
        return c.num_experts * 3 * d * f + 3 * d * fs, c.top_k * 3 * d * f + 3 * d * fs
    return 3 * d * m.resolved_d_ff, 3 * d * m.resolved_d_ff


def first_ffn(model, cfg):
    """Layer 0's FFN module, with its trained weights (unstacked when the layers are scanned)."""
    from flax import nnx as _nnx

    if cfg.model.scan_layers:
        graphdef, state = _nnx.split(model.blocks.layers[0].ffn)
        return _nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    return model.blocks[0].layers[0].ffn


def _median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def time_ffn(ffn, d: int, batches: list[int], train_shape: tuple[int, int], repeats: int,
             seed: int = 0) -> dict:
    """Milliseconds: {"decode": {b: forward of x [b,1,D]}, "train": forward + backward (input and
    every parameter) of x [*train_shape, D]}; compiled first, median of `repeats`."""
    graphdef, params, rest = nnx.split(ffn, nnx.Param, ...)
    key = jax.random.key(seed)

    @jax.jit
    def forward(params, rest, x):
        return nnx.merge(graphdef, params, rest)(x)

    def loss(params, rest, x):  # a training call (rngs given), as the trainer makes it
        return jnp.sum(nnx.merge(graphdef, params, rest)(x, rngs=nnx.Rngs(0)) ** 2)

    train = jax.jit(jax.grad(loss, (0, 2)))
    out = {"decode": {}}
    for b in batches:
        x = jax.random.normal(key, (b, 1, d), jnp.float32)
        out["decode"][b] = _median_ms(forward, params, rest, x, repeats=repeats)
    x = jax.random.normal(key, (*train_shape, d), jnp.float32)
    out["train"] = _median_ms(train, params, rest, x, repeats=max(3, repeats // 4))
    return out


def quality(args) -> None:
    from aiinfra_jax.eval.runs import plot_curves, train_or_read, value_at
    from aiinfra_jax.load import load_model

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    extra = ["eval.every=50"] + ([f"run.steps={args.steps}"] if args.steps else [])
    runs = {name: train_or_read(name, preset, out, extra + over)
            for name, preset, over in QUALITY_RUNS}
    batches = [int(b) for b in args.batches.split(",")]
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(["python -m aiinfra_jax.eval.bench_moe"] + sys.argv[1:]),
              "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
              "runs": runs, "bytes": {}, "times": {}}
    steps = sorted({s for r in runs.values() for s, _ in r["val"]})
    print("\n| model | FFN weights / layer | used per token | " + " | ".join(
        f"val @{s}" for s in steps) + " | final validation (32 batches) | vs moe |")
    print("|---|---|---|" + "---|" * (len(steps) + 2))
    for name, r in runs.items():
        loaded = load_model(r["run_dir"])
        r["ffn_weights"], r["ffn_used"] = ffn_weights(loaded.config)
        cells = [f"{value_at(r['val'], s):.3f}" if value_at(r["val"], s) is not None else "-"
                 for s in steps]
        rel = r["final_val_loss"] / runs["moe"]["final_val_loss"] - 1
        print(f"| {name} | {r['ffn_weights'] / 1e6:.3f}M | {r['ffn_used'] / 1e3:.0f}K | "
              + " | ".join(cells) + f" | {r['final_val_loss']:.4f} | {100 * rel:+.2f}% |")
        r["times"] = time_ffn(first_ffn(loaded.model, loaded.config),
                              loaded.config.model.d_model, batches, (16, 256), args.repeats)
    plot_curves(runs, out / "bench_moe_quality.png",
                title="Dense vs MoE vs DeaMoE, tiny presets, embedded corpus")
    for a, b in PAIRS:
        print(f"\nbytes per decode step: {a} vs {b}")
        result["bytes"][f"{a}/{b}"] = bytes_table(runs[a]["run_dir"], runs[b]["run_dir"], batches,
                                                  args.tokens, args.seed)
    print("\nlayer 0's FFN, ms (median of %d; decode: forward of [b,1,D]; train: forward + "
          "backward of [16,256,D])" % args.repeats)
    print("| model | " + " | ".join(f"decode b={b}" for b in batches) + " | train step |")
    print("|---|" + "---|" * (len(batches) + 1))
    for name, r in runs.items():
        t = r["times"]
        print(f"| {name} | " + " | ".join(f"{t['decode'][b]:.3f}" for b in batches)
              + f" | {t['train']:.1f} |")
    (out / "bench_moe_quality.json").write_text(json.dumps(result, indent=1))
    print(f"\nfigure: {out / 'bench_moe_quality.png'}; numbers: {out / 'bench_moe_quality.json'}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moe", help="run / checkpoint / .py preset of a MoE model")
    p.add_argument("--deamoe", help="the same for the DeaMoE model")
    p.add_argument("--quality", action="store_true", help="train / read the QUALITY_RUNS and "
                   "compare them (module docstring)")
    p.add_argument("--out-dir", default="runs/bench_moe", help="--quality: where the runs live")
    p.add_argument("--steps", type=int, default=0, help="--quality: training steps (0: presets')")
    p.add_argument("--repeats", type=int, default=20, help="--quality: timing repeats")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--tokens", type=int, default=64, help="decode positions per window")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    if args.quality:
        return quality(args)
    if not (args.moe and args.deamoe):
        p.error("give --moe and --deamoe (bytes per decode step), or --quality")
    bytes_table(args.moe, args.deamoe, [int(b) for b in args.batches.split(",")], args.tokens,
                args.seed)
    return None


if __name__ == "__main__":
    main()
