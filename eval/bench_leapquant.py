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
window's records at their mean fill, at their stored dtype (--extra's "LeapQuant INT8, bf16
records" keeps k~ and u in bf16). This measures accuracy and bytes, not time (the decode time per
step of each variant, after its compile, is printed for information only: one run, no repeats).

Cost mode (issue 23's decode step time against float32):

    python -m aiinfra_jax.eval.bench_leapquant --cost [--batches 1,8] [--cost-heads 8]
        [--cost-dim 128] [--cost-steps 64] [--repeats 7] [--out cost.json]

Per batch size, every format (model.gated_delta.state_quant's names and specs: none = float32
through the one-token gated_delta_rule, the model's decode path; int8 = LeapQuant; int8_per_step
and bf16_per_step = the naive baselines; on request, --cost-formats ...,int8+bf16rec: LeapQuant
INT8 with model.gated_delta.state_records=bfloat16, its window records in bf16) decodes the same
synthetic stream (above) of --cost-steps tokens in one compiled lax.scan with its state donated;
the median wall time of --repeats calls (after one that compiles) divided by the steps, and the
state's in-memory bytes per row (window records included). All formats in one invocation: run it
on a quiet machine.
Cost mode needs neither grain nor datasets (only quality mode imports the data pipeline), so on
the GPU machine it runs from the bare checkout with that machine's python3:
`python3 eval/bench_leapquant.py --cost --batches 1,8,64,256` (implementation=None: the Pallas
GPU read kernel on cuda).

Prefix mode (issue 23's memory with prefix caching):
    python -m aiinfra_jax.eval.bench_leapquant --prefix [--prefix-configs configs/gdn_tiny.py,...]
        [--prefix-settings none,bf16_per_step,int8[,int8+bf16rec]] [--prefix-tokens 3840]
        [--prefix-every 1024] [--prefix-decode 256] [--set KEY=VALUE]
Per config and state format (none, bf16_per_step, int8 by default; int8+bf16rec = int8 with its
window records in bf16, model.gated_delta.state_records=bfloat16), a freshly initialised model
(bytes do not depend on training) prefills one shared random prompt with a prefix-cache snapshot
every --prefix-every tokens (models/prefix_cache.py); the snapshots' bytes (gated-delta layers apart
from attention layers) and one request's live cache bytes, with their ratios to float32.
Quality mode (issue 23's perplexity on a trained run, `--quality --checkpoint RUN ...`): see
eval/leapquant_quality.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: python3 eval/bench_leapquant.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # eval/, for _checkout
    import _checkout
    _checkout.use_this_checkout()   # the root instead of eval/ on sys.path (see there)

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
from aiinfra_jax.models.attention.gated_delta import GatedDeltaConfig
from aiinfra_jax.models.prefix_cache import prefill_with_snapshots, snapshot_nbytes
from aiinfra_jax.models.registry import get_mixer
from aiinfra_jax.steps import abstract_model, init_variables, merge_model

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
    ("LeapQuant INT8, bf16 records", LeapQuantSpec(record_dtype="bfloat16")),
)
FP32 = LeapQuantSpec(fmt="none", window=1)  # for the bytes column only


def synthetic(seed: int, T: int, heads: int, K: int, batch: int = 1) -> tuple[jax.Array, ...]:
    """(q, k [B,T,H,K], v [B,T,H,K], g [B,T,H], beta [B,T,H]) as the module docstring says."""
    ks = jax.random.split(jax.random.key(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (batch, T, heads, K)))
    k = unit(jax.random.normal(ks[1], (batch, T, heads, K)))
    v = jax.random.normal(ks[2], (batch, T, heads, K))
    rate = jnp.exp(jax.random.uniform(ks[3], (heads,), minval=np.log(1e-4),
                                      maxval=np.log(3e-2)))
    g = -rate * jnp.exp(0.3 * jax.random.normal(ks[4], (batch, T, heads)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[5], (batch, T, heads)))
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


# -- Settings of the cost and prefix modes: model.gated_delta fields by name

BF16_RECORDS = "+bf16rec"  # "<state_quant>+bf16rec": that format with its window records in bf16


def gated_delta_fields(setting: str) -> dict:
    """A cost/prefix mode setting -> model.gated_delta fields: "none" (float32 states), a
    state_quant value, or "<state_quant>+bf16rec" (the same with state_records="bfloat16")."""
    quant = setting.removesuffix(BF16_RECORDS)
    return {"state_quant": None if quant == "none" else quant,
            "state_records": "bfloat16" if quant != setting else "float32"}


def setting_overrides(setting: str) -> list[str]:
    """gated_delta_fields as --set overrides (config.load_config's form)."""
    fields = gated_delta_fields(setting)
    return [f"model.gated_delta.{key}={value}" for key, value in fields.items()]


def _check_settings(flag: str, settings, valid) -> None:
    bad = [s for s in settings if s not in valid]
    if bad:
        raise SystemExit(f"bench_leapquant: {flag} {bad}: valid are {valid}")


# -- Cost mode: decode step time and state bytes, float32 recurrence against the stored formats

COST_FORMATS = ("none", "int8", "int8_per_step", "bf16_per_step")  # the default rows
COST_CHOICES = COST_FORMATS + ("int8" + BF16_RECORDS,)


def decode_cost(batch: int, heads: int, K: int, steps: int, repeats: int,
                formats=COST_FORMATS, seed: int = 0) -> list[dict]:
    """Median wall time per decode step of `steps` tokens decoded one at a time (one compiled
    lax.scan, the state donated), per state format (model.gated_delta.state_quant's names and
    specs, GatedDeltaConfig.state_spec), all in this process on the same synthetic stream (K = V).
    "none" steps the float32 state with the one-token gated_delta_rule (the model's decode path);
    the others run leapquant_decode without an `active` mask, as generate's decode step calls
    it."""
    q, k, v, g, beta = synthetic(seed, steps, heads, K, batch)
    scale = K ** -0.5

    def fp32_run(S, q, k, v, g, beta):
        def step(S, xs):
            o, S = gated_delta_rule(*(x[:, None] for x in xs), initial_state=S,
                                    output_final_state=True, scale=scale)
            return S, o[:, 0]
        S, o = jax.lax.scan(step, S, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)))
        return S, jnp.moveaxis(o, 0, 1)

    rows = []
    for fmt in formats:
        spec = GatedDeltaConfig(**gated_delta_fields(fmt)).state_spec()
        if spec is None:
            state = jnp.zeros((batch, heads, K, K), jnp.float32)
            fn = jax.jit(fp32_run, donate_argnums=0)
        else:
            state = init_state(spec, batch, heads, K, K, decay_dim=1)
            fn = jax.jit(lambda s, *a, spec=spec: leapquant_decode(
                *a, s, spec=spec, scale=scale)[::-1], donate_argnums=0)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        state, o = fn(state, q, k, v, g, beta)  # compiles
        jax.block_until_ready(o)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            state, o = fn(state, q, k, v, g, beta)
            jax.block_until_ready((state, o))
            times.append(time.perf_counter() - start)
        rows.append({"format": fmt, "batch": batch, "heads": heads, "K": K, "V": K,
                     "us_per_step": float(np.median(times)) / steps * 1e6,
                     "us_min": float(np.min(times)) / steps * 1e6,
                     "state_bytes_per_row": nbytes // batch})
    return rows


def cost_main(a) -> int:
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); {a.cost_heads} "
          f"value heads, K=V={a.cost_dim}, {a.cost_steps} steps per compiled call, median of "
          f"{a.repeats}; GDN decays")
    formats = tuple(filter(None, a.cost_formats.split(",")))
    _check_settings("--cost-formats", formats, COST_CHOICES)
    print("\n| batch | state | us/step (median) | us/step (min) | vs float32 | state bytes/row |")
    print("|---|---|---:|---:|---:|---:|")
    out = []
    for batch in (int(b) for b in a.batches.split(",")):
        rows = decode_cost(batch, a.cost_heads, a.cost_dim, a.cost_steps, a.repeats, formats,
                           a.seed)
        base = next((r["us_per_step"] for r in rows if r["format"] == "none"), None)
        for r in rows:
            ratio = "-" if base is None else f"{r['us_per_step'] / base:.2f}x"
            print(f"| {batch} | {r['format']} | {r['us_per_step']:.0f} | {r['us_min']:.0f} | "
                  f"{ratio} | {r['state_bytes_per_row']:,} |", flush=True)
        out.extend(rows)
    if a.out:
        Path(a.out).write_text(json.dumps({"argv": sys.argv[1:], "rows": out}, indent=1))
    return 0


# -- Prefix mode: what prefix-cache snapshots hold per state format

PREFIX_SETTINGS = ("none", "bf16_per_step", "int8")  # the default rows (gated_delta_fields)
PREFIX_CHOICES = PREFIX_SETTINGS + ("int8" + BF16_RECORDS,)


def _cache_bytes(cache, model_cfg) -> tuple[int, int]:
    """(bytes of the gated-delta layers' caches, bytes of the other layers') of a decode cache or
    snapshot (a tuple of scanned blocks of per-layer caches, in layer order)."""
    layers = [layer for block in cache for layer in block]
    recurrent = other = 0
    for i, layer in enumerate(layers):
        n = snapshot_nbytes(layer)  # a snapshot's left-out records count 0
        if model_cfg.mixer_at(i) in ("gdn", "kda"):
            recurrent += n
        else:
            other += n
    return recurrent, other


def prefix_memory(config: str, *, tokens: int, every: int, decode: int, settings=PREFIX_SETTINGS,
                  overrides=(), seed: int = 0) -> list[dict]:
    """Per setting: a freshly initialised model of `config` (bytes do not depend on training;
    one initialisation serves every setting) prefills one shared prompt of `tokens` random tokens with a snapshot every `every` tokens
    (models/prefix_cache.prefill_with_snapshots, cache room tokens + decode); the bytes of the
    snapshots (gated-delta layers apart from attention layers) and of one request's live cache."""
    rows, variables = [], None
    for setting in settings:
        cfg = load_config(config, [*overrides, *setting_overrides(setting)])
        model_cfg = cfg.model.with_vocab(load_tokenizer(cfg.data.tokenizer).vocab_size)
        if variables is None:
            model = Transformer(model_cfg, rngs=nnx.Rngs(seed))
            variables = init_variables(model)
        else:  # the state settings are run-time fields: the same parameters, no second init
            model = merge_model(*abstract_model(model_cfg, seed), *variables)
        prompt = np.random.default_rng(seed).integers(1, model_cfg.vocab_size, (1, tokens))
        _, cache, snaps = prefill_with_snapshots(model, prompt, every=every,
                                                 max_len=tokens + decode)
        parts = [_cache_bytes(snap, model_cfg) for snap in snaps.values()]
        recurrent, attention = sum(r for r, _ in parts), sum(o for _, o in parts)
        live = _cache_bytes(cache, model_cfg)
        rows.append({"config": config, "setting": setting, "snapshots": len(snaps),
                     "snapshot_bytes": recurrent + attention,
                     "snapshot_recurrent_bytes": recurrent, "snapshot_attention_bytes": attention,
                     "live_bytes": sum(live),
                     "live_recurrent_bytes": live[0], "live_attention_bytes": live[1]})
    return rows


def prefix_main(a) -> int:
    configs = [c for c in a.prefix_configs.split(",") if c]
    settings = tuple(filter(None, a.prefix_settings.split(",")))
    _check_settings("--prefix-settings", settings, PREFIX_CHOICES)
    print(f"prefix-cache snapshots: one shared prompt of {a.prefix_tokens} tokens, a snapshot every "
          f"{a.prefix_every}, cache room for {a.prefix_decode} decoded tokens; fresh models "
          "(bytes do not depend on training)")
    print("\n| config | state | snapshots | snapshot bytes (gated-delta layers / attention layers)"
          " | vs float32 | live cache per request (gated-delta / attention) | vs float32 |")
    print("|---|---|---:|---|---:|---|---:|")
    out = []
    for config in configs:
        rows = prefix_memory(config, tokens=a.prefix_tokens, every=a.prefix_every,
                             decode=a.prefix_decode, settings=settings, overrides=a.set,
                             seed=a.seed)
        base = rows[0] if rows[0]["setting"] == "none" else None
        for r in rows:
            snap_ratio = live_ratio = "-"
            if base is not None:
                snap_ratio = f"{r['snapshot_bytes'] / base['snapshot_bytes']:.2f}x"
                live_ratio = f"{r['live_bytes'] / base['live_bytes']:.2f}x"
            print(f"| {config} | {r['setting']} | {r['snapshots']} | {r['snapshot_bytes']:,} "
                  f"({r['snapshot_recurrent_bytes']:,} / {r['snapshot_attention_bytes']:,}) | "
                  f"{snap_ratio} | {r['live_bytes']:,} ({r['live_recurrent_bytes']:,} / "
                  f"{r['live_attention_bytes']:,}) | {live_ratio} |", flush=True)
        out.extend(rows)
    if a.out:
        Path(a.out).write_text(json.dumps({"argv": sys.argv[1:], "rows": out}, indent=1))
    return 0


# -- Quality mode: next-token loss of a trained run decoded through its (quantized) state cache

def main(argv=None) -> int | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="4096,16384",
                   help=f"comma-separated checkpoints, multiples of {SEGMENT}")
    p.add_argument("--model-steps", type=int, default=None,
                   help="decode steps of the model stream (default: the last checkpoint)")
    p.add_argument("--extra", action="store_true",
                   help="also INT6/INT4 LeapQuant, BF16 per-step, compensators fit to the error, "
                        "INT8 LeapQuant with bf16 window records")
    p.add_argument("--skip", default="", help="comma-separated streams to skip: "
                   "synthetic128, synthetic64, model")
    p.add_argument("--seed", type=int, default=0)
    q = p.add_argument_group("quality mode (see the module docstring)")
    q.add_argument("--quality", action="store_true",
                   help="loss of a trained run decoded through its (quantized) state cache")
    q.add_argument("--checkpoint", default=None, help="a run directory (or checkpoints folder)")
    q.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    q.add_argument("--docs", type=int, default=8, help="validation documents (rows of a batch)")
    q.add_argument("--length", type=int, default=1024, help="input tokens per document")
    q.add_argument("--prefill", type=int, default=0, help="inputs fed by prefill, not scored")
    q.add_argument("--settings", default=None,
                   help="model.gated_delta.state_quant values; none = float32 (the reference), "
                   "+bf16rec: window records in bfloat16 (e.g. int8+bf16rec); "
                   "default none,bf16_per_step,int8_per_step,int8,int6,int4")
    q.add_argument("--no-forward", action="store_true",
                   help="skip the training-forward comparison")
    q.add_argument("--out", default=None, help="write the JSON here (and the table as .md)")
    c = p.add_argument_group("cost mode: decode step time per state format")
    c.add_argument("--cost", action="store_true",
                   help="time decode steps of the float32 state and the stored formats")
    c.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    c.add_argument("--cost-heads", type=int, default=8, help="value heads (one state each)")
    c.add_argument("--cost-dim", type=int, default=128, help="K = V, the state's sides")
    c.add_argument("--cost-steps", type=int, default=64, help="decode steps per compiled call")
    c.add_argument("--cost-formats", default=",".join(COST_FORMATS),
                   help="comma-separated state formats (none = float32) of "
                        f"{', '.join(COST_CHOICES)} (+bf16rec: window records in bfloat16)")
    c.add_argument("--repeats", type=int, default=7, help="timed calls per format (median)")
    x = p.add_argument_group("prefix mode: bytes of prefix-cache snapshots per state format")
    x.add_argument("--prefix", action="store_true",
                   help="snapshot bytes per model.gated_delta state setting (--prefix-settings)")
    x.add_argument("--prefix-settings", default=",".join(PREFIX_SETTINGS),
                   help=f"comma-separated settings of {', '.join(PREFIX_CHOICES)} (none = float32;"
                        " +bf16rec: window records in bfloat16)")
    x.add_argument("--prefix-configs",
                   default="configs/gdn_tiny.py,configs/kda_tiny.py,configs/hybrid_tiny.py")
    x.add_argument("--prefix-tokens", type=int, default=3840,
                   help="shared prompt tokens (with --prefix-decode: the presets' 4096 positions)")
    x.add_argument("--prefix-every", type=int, default=1024, help="tokens between snapshots")
    x.add_argument("--prefix-decode", type=int, default=256,
                   help="cache room for decoded tokens after the prompt")
    x.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides for every prefix config")
    a = p.parse_args(argv)
    if a.cost:
        return cost_main(a)
    if a.prefix:
        return prefix_main(a)
    if a.quality:
        from aiinfra_jax.eval.leapquant_quality import quality_main  # the only mode reading data
        a.argv = list(sys.argv[1:] if argv is None else argv)
        return quality_main(a)
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
    sys.exit(main())
