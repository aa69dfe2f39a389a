"""Weight loading per decode step, MoE vs DeaMoE: distinct bytes of routed expert weights a
decode step touches at batch 1-64, from routing traces (issue 24).

    python -m aiinfra_jax.eval.bench_moe --moe runs/moe_tiny --deamoe runs/deamoe_tiny
    python -m aiinfra_jax.eval.bench_moe --moe configs/moe_tiny.py --deamoe configs/deamoe_tiny.py

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

This measures bytes, not time; nothing here runs on an accelerator.
"""

from __future__ import annotations

import argparse
import dataclasses
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
        f = c.resolved_d_ff(m)
        return dict(kind="deamoe", per_dept=3 * d * f * item, per_expert=f * f * item,
                    experts_per_dept=c.num_experts // c.num_departments,
                    total=c.num_departments * 3 * d * f * item + c.num_experts * f * f * item,
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moe", required=True, help="run / checkpoint / .py preset of a MoE model")
    p.add_argument("--deamoe", required=True, help="the same for the DeaMoE model")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--tokens", type=int, default=64, help="decode positions per window")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); bytes, not time")
    rows = {}
    for name, source in (("moe", args.moe), ("deamoe", args.deamoe)):
        model, cfg, trained = load(source, args.seed)
        s = sizes(cfg)
        if s["kind"] != name:
            raise SystemExit(f"bench_moe: --{name} {source} is a {s['kind']} model")
        layers = traces(model, windows(cfg, max(batches), args.tokens, args.seed))
        rows[name] = {b: touched(layers, s, b) for b in batches}
        extra = (f", distinct departments per token {departments_per_token(layers, s):.3f} "
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


if __name__ == "__main__":
    main()
