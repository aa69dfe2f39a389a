"""LeapQuant state error over long decodes: per-step INT8 vs per-window INT8 vs + compensators vs
+ smoothing (issue 23), the outlier/median magnitude ratio through the stages, and the bytes per
state element of every option.

    python -m aiinfra_jax.eval.bench_leapquant                         # 4K and 16K steps
    python -m aiinfra_jax.eval.bench_leapquant --steps 4096,16384,65536 --extra

Streams (batch 1, every value head its own state [K,V]):
  synthetic K=V=128 and K=V=64, 2 heads: L2-normalised q and k, unit-normal v, GDN log-decays
    g = -rate * exp(0.3 N(0,1)) with a per-head rate drawn log-uniformly in [1e-4, 3e-2] (long
    memories: half-lives of ~20 to ~7000 steps, where rounding errors live longest), betas
    sigmoid(N(0,1));
  model: layer 0 of an untrained configs/gdn_tiny.py model (K=V=64, 4 heads) fed the embedded
    corpus (byte tokens of consecutive documents, embedded and RMS-normalised), its q, k, v, g,
    beta taken from the mixer (GatedDeltaNet.recurrence_inputs). Untrained: its decays are the
    initialisation's (fast), which the output says.
Every variant decodes the same stream one token at a time through kernels/leapquant (xla.py's
record form, the quantized state fed back into every read); the float32 reference is the chunked
gated delta rule (kernels/gated_delta) over the same stream. Error = ||S - S_fp32||_F / ||S_fp32||_F
over all heads, at each checkpoint. Outlier/median = max|x| / median|x| of the float32 state
("state"), of the state less its rank-4 power-iteration fit ("- comps"), and of that divided by
the smoothing factors ("smoothed"), median over heads. Bytes per element:
kernels/leapquant/quantize.bytes_per_element, persistent storage (records not counted) and with the
window's records at their mean fill. This measures accuracy and bytes, not time (the decode time
per step of each variant, after its compile, is printed for information only: one run, no repeats).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.config import load_config
from aiinfra_jax.data.sources import EmbeddedCorpus
from aiinfra_jax.data.tokenizer import load_tokenizer
from aiinfra_jax.kernels.gated_delta import gated_delta_rule
from aiinfra_jax.kernels.leapquant import (LeapQuantSpec, bytes_per_element, init_state,
                                           leapquant_decode, materialize, stage_outlier_ratios)
from aiinfra_jax.models import Transformer
from aiinfra_jax.models.registry import get_mixer

SEGMENT = 1024  # tokens per compiled decode call; checkpoints must be multiples of it

VARIANTS = (
    ("INT8 per-step", LeapQuantSpec(window=1, rank=0, smoothing=False)),
    ("INT8 per-window", LeapQuantSpec(rank=0, smoothing=False)),
    ("+ compensators", LeapQuantSpec(smoothing=False)),
    ("+ smoothing", LeapQuantSpec()),
)
EXTRA = (
    ("comps fit to error", LeapQuantSpec(comp_target="error")),
    ("INT6 LeapQuant", LeapQuantSpec(fmt="int6")),
    ("INT4 LeapQuant", LeapQuantSpec(fmt="int4")),
    ("BF16 per-step", LeapQuantSpec(fmt="bf16", window=1)),
)
FP32 = LeapQuantSpec(fmt="none", window=1)  # for the bytes column only


def synthetic(seed: int, T: int, heads: int, K: int) -> tuple[jax.Array, ...]:
    """(q, k [1,T,H,K], v [1,T,H,K], g [1,T,H], beta [1,T,H]) as the module docstring says."""
    ks = jax.random.split(jax.random.key(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (1, T, heads, K)))
    k = unit(jax.random.normal(ks[1], (1, T, heads, K)))
    v = jax.random.normal(ks[2], (1, T, heads, K))
    rate = jnp.exp(jax.random.uniform(ks[3], (heads,), minval=np.log(1e-4),
                                      maxval=np.log(3e-2)))
    g = -rate * jnp.exp(0.3 * jax.random.normal(ks[4], (1, T, heads)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[5], (1, T, heads)))
    return q, k, v, g, beta


def model_stream(T: int, seed: int) -> tuple[jax.Array, ...]:
    """Layer 0's recurrence inputs of an untrained configs/gdn_tiny.py fed T corpus tokens."""
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "gdn_tiny.py"), [])
    tok = load_tokenizer(cfg.data.tokenizer)
    model_cfg = cfg.model.with_vocab(tok.vocab_size)
    corpus = EmbeddedCorpus.create()
    ids: list[int] = []
    i = 0
    while len(ids) < T:
        ids.extend(tok.encode(corpus[i % len(corpus)]))
        i += 1
    tokens = jnp.asarray(np.asarray(ids[:T], np.int32))[None]
    model = Transformer(model_cfg, rngs=nnx.Rngs(seed))
    mixer = get_mixer("gdn")(model_cfg, rngs=nnx.Rngs(seed + 1))
    x = model.embed(tokens).astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    q, k, v, g, beta = jax.jit(mixer.recurrence_inputs)(x)
    return tuple(a.astype(jnp.float32) for a in (q, k, v, g, beta))


@jax.jit
def _reference_segment(S, q, k, v, g, beta):
    return gated_delta_rule(q, k, v, g, beta, initial_state=S, output_final_state=True,
                            implementation="xla")[1]


def _segments(stream, checkpoints):
    n = checkpoints[-1] // SEGMENT
    for j in range(n):
        yield (j + 1) * SEGMENT, tuple(a[:, j * SEGMENT:(j + 1) * SEGMENT] for a in stream)


def reference_states(stream, checkpoints) -> dict[int, jax.Array]:
    B, _, HV, V = stream[2].shape
    S = jnp.zeros((B, HV, stream[0].shape[3], V), jnp.float32)
    out = {}
    for t, seg in _segments(stream, checkpoints):
        S = _reference_segment(S, *seg)
        if t in checkpoints:
            out[t] = S
    return out


def variant_errors(spec, stream, checkpoints, refs) -> tuple[dict[int, float], float]:
    """Relative state error at each checkpoint, and the wall time of the decode after the first
    (compiling) segment, in microseconds per step."""
    B, _, HV, V = stream[2].shape
    K = stream[0].shape[3]
    run = jax.jit(lambda s, *a: leapquant_decode(*a, s, spec=spec)[1], donate_argnums=0)
    state = init_state(spec, B, HV, K, V, decay_dim=1)
    errs, start = {}, None
    for t, seg in _segments(stream, checkpoints):
        state = run(state, *seg)
        if start is None:
            jax.block_until_ready(state)
            start = time.perf_counter()
        if t in checkpoints:
            S, ref = materialize(state), refs[t]
            errs[t] = float(jnp.linalg.norm(S - ref) / jnp.linalg.norm(ref))
    jax.block_until_ready(state)
    steps = checkpoints[-1] - SEGMENT
    return errs, (time.perf_counter() - start) / max(steps, 1) * 1e6


def outliers(S: jax.Array) -> dict[str, float]:
    r = jax.jit(stage_outlier_ratios, static_argnums=0)(LeapQuantSpec(), S)
    return {k: float(jnp.median(v)) for k, v in r.items()}


def run_stream(name: str, stream, checkpoints, variants) -> None:
    K, V = stream[0].shape[3], stream[2].shape[3]
    heads = stream[2].shape[2]
    print(f"\n### {name}: K={K} V={V}, {heads} heads, {checkpoints[-1]} decode steps\n")
    refs = reference_states(stream, checkpoints)
    cols = " | ".join(f"err @{t // 1024}K" for t in checkpoints)
    print(f"| variant | {cols} | B/elem | B/elem +records | us/step |")
    print("|---" * (len(checkpoints) + 4) + "|")
    print("| fp32 | " + " | ".join("0" for _ in checkpoints)
          + f" | {bytes_per_element(FP32, K, V):.4g} | - | - |")
    for label, spec in variants:
        errs, wall = variant_errors(spec, stream, checkpoints, refs)
        b0 = bytes_per_element(spec, K, V)
        b1 = bytes_per_element(spec, K, V, records="mean")
        row = " | ".join(f"{errs[t]:.2e}" for t in checkpoints)
        print(f"| {label} | {row} | {b0:.4g} | {b1:.4g} | {wall:.0f} |", flush=True)
    print("\nOutlier/median magnitude of the float32 state through the stages (median over "
          "heads):\n")
    print("| step | state | - comps (r=4) | smoothed |")
    print("|---|---|---|---|")
    for t in checkpoints:
        o = outliers(refs[t])
        print(f"| {t} | {o['state']:.1f} | {o['after_compensators']:.1f} | "
              f"{o['after_smoothing']:.1f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="4096,16384",
                   help=f"comma-separated checkpoints, multiples of {SEGMENT}")
    p.add_argument("--model-steps", type=int, default=None,
                   help="decode steps of the model stream (default: the last checkpoint)")
    p.add_argument("--extra", action="store_true",
                   help="also INT6/INT4 LeapQuant, BF16 per-step, compensators fit to the error")
    p.add_argument("--skip", default="", help="comma-separated streams to skip: "
                   "synthetic128, synthetic64, model")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    checkpoints = sorted(int(s) for s in a.steps.split(","))
    if any(t <= 0 or t % SEGMENT for t in checkpoints):
        raise SystemExit(f"bench_leapquant: --steps must be positive multiples of {SEGMENT}, got "
                         f"{a.steps}")
    skip = set(filter(None, a.skip.split(",")))
    variants = VARIANTS + (EXTRA if a.extra else ())
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); accuracy and "
          f"bytes, not time")
    total = time.perf_counter()
    for K in (128, 64):
        if f"synthetic{K}" not in skip:
            stream = synthetic(a.seed, checkpoints[-1], 2, K)
            run_stream("synthetic (GDN decays, rates 1e-4..3e-2)", stream, checkpoints,
                       variants)
    if "model" not in skip:
        T = a.model_steps or checkpoints[-1]
        model_checkpoints = [t for t in checkpoints if t <= T] or [T]
        stream = model_stream(model_checkpoints[-1], a.seed)
        run_stream("untrained configs/gdn_tiny.py layer 0 on the embedded corpus "
                   "(UNTRAINED: initialisation decays)", stream, model_checkpoints, variants)
    print(f"\ntotal wall time {time.perf_counter() - total:.0f} s")


if __name__ == "__main__":
    main()
