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

Cost mode (issue 23's decode step time against float32):

    python -m aiinfra_jax.eval.bench_leapquant --cost [--batches 1,8] [--cost-heads 8]
        [--cost-dim 128] [--cost-steps 64] [--repeats 7] [--out cost.json]

Per batch size, every format (model.gated_delta.state_quant's names and specs: none = float32
through the one-token gated_delta_rule, the model's decode path; int8 = LeapQuant; int8_per_step
and bf16_per_step = the naive baselines) decodes the same synthetic stream (above) of
--cost-steps tokens in one compiled lax.scan with its state donated; the median wall time of
--repeats calls (after one that compiles) divided by the steps, and the state's in-memory bytes per
row (window records included). All formats in one invocation: run it on a quiet machine.
Cost mode needs neither grain nor datasets (only quality mode imports the data pipeline), so on
the GPU machine it runs from the bare checkout with that machine's python3:
`python3 eval/bench_leapquant.py --cost --batches 1,8,64,256` (implementation=None: the Pallas
GPU read kernel on cuda).

Quality mode (issue 23's perplexity measurement on a trained run):

    python -m aiinfra_jax.eval.bench_leapquant --quality --checkpoint RUN [--docs 8]
        [--length 1024] [--prefill 0] [--settings none,bf16_per_step,int8_per_step,int8,int6,int4]
        [--out results.json]

Every setting s loads RUN with `model.gated_delta.state_quant=s` ("none" = float32 states, always
run first: the reference), in one process. Rows: the first --docs documents of the run's own
validation split (data.sources, split by data.val_fraction, tokenized BOS + text + EOS as the
training pipeline does) that hold at least length + 1 tokens, each TRUNCATED to its first
length + 1 tokens (shorter documents are skipped; the ids and how many were skipped are in the
JSON). Inputs are tokens 0..length-1, targets 1..length. The first --prefill inputs go through
`generate.prefill` (the same tokens for every setting); every later input is fed ONE AT A TIME
through `generate.decode_step` with the cache at position = its index (the running length), so
LeapQuant's windows close and re-quantize as in serving, and its logits score the next token:
length - prefill scored targets per row (weighted by the pipeline's loss weights). Reported per
setting: mean loss (nats/token over all scored tokens), perplexity, the loss difference to "none"
with its standard error over documents (std of the per-document differences / sqrt(docs)), the
standard error of the mean loss itself over documents (the sampling noise of the document set),
max |logit - fp32 logit| over every scored step and row, the median wall time of a decode step
(one batch of docs rows, blocked on its logits; the first two steps, which compile, left out),
and the in-memory bytes per row of one gated-delta layer's state cache ("state" / "qstate" arrays:
INT6/INT4 in int8 containers, the window's record buffers included) and of the whole cache. The
training forward (no cache, float32 states) on the same inputs is reported too, against the fp32
decode: the two should agree to float rounding. Loss by position quarter goes to the JSON (the
presets train on data.seq_len-token pieces, so positions past it are extrapolation). A NaN logit
(e.g. a row refused because its cache is full) is an error, never averaged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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
from aiinfra_jax.data import sources as sources_lib
from aiinfra_jax.data.sources import EmbeddedCorpus
from aiinfra_jax.data.tokenizer import load_tokenizer
from aiinfra_jax.generate import decode_step, prefill
from aiinfra_jax.kernels.gated_delta import gated_delta_rule
from aiinfra_jax.kernels.leapquant import (LeapQuantSpec, bytes_per_element, init_state,
                                           leapquant_decode, materialize, stage_outlier_ratios)
from aiinfra_jax.load import load_model
from aiinfra_jax.models import Transformer
from aiinfra_jax.models.attention.gated_delta import GatedDeltaConfig
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


# -- Cost mode: decode step time and state bytes, float32 recurrence against the stored formats

COST_FORMATS = ("none", "int8", "int8_per_step", "bf16_per_step")


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
        spec = GatedDeltaConfig(state_quant=None if fmt == "none" else fmt).state_spec()
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
    bad = [f for f in formats if f not in COST_FORMATS]
    if bad:
        raise SystemExit(f"bench_leapquant: --cost-formats {bad}: valid are {COST_FORMATS}")
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


# -- Quality mode: next-token loss of a trained run decoded through its (quantized) state cache

QUALITY_SETTINGS = ("none", "bf16_per_step", "int8_per_step", "int8", "int6", "int4")
QUALITY_BUCKETS = 4  # position quarters of the scored range, in the JSON
_TIMING_SKIP = 2  # decode steps left out of the median time (the first compiles)


def validation_rows(cfg, tokenizer, docs: int, length: int) -> dict:
    """The first `docs` documents of cfg's validation split with >= length + 1 tokens, each cut to
    its first length + 1: {"tokens" [docs, length+1] int32, "weights" [docs, length+1] float32,
    "ids", "skipped_short", "truncated_from"} (see the module docstring)."""
    from aiinfra_jax.data.pipeline import Tokenize   # here: grain only where quality mode runs
    tokenize = Tokenize(tokenizer)
    rows, weights, ids, lengths, skipped = [], [], [], [], 0
    for source in sources_lib.open_sources(cfg.data):
        for j in sources_lib.split_indices(source, "validation", cfg.data.val_fraction):
            el = tokenize.map({"doc": source[int(j)], "id": source.doc_id(int(j))})
            if el["tokens"].size < length + 1:
                skipped += 1
                continue
            rows.append(el["tokens"][:length + 1])
            weights.append(el["weights"][:length + 1])
            ids.append(f"{source.name}:{el['id']}")
            lengths.append(int(el["tokens"].size))
            if len(rows) == docs:
                return {"tokens": np.stack(rows).astype(np.int32),
                        "weights": np.stack(weights).astype(np.float32), "ids": ids,
                        "skipped_short": skipped, "truncated_from": lengths}
    raise ValueError(f"bench_leapquant --quality: the validation split of data.sources="
                     f"{list(cfg.data.sources)} (val_fraction={cfg.data.val_fraction}) has only "
                     f"{len(rows)} documents of >= {length + 1} tokens ({skipped} shorter); lower "
                     f"--length or --docs")


@jax.jit
def _score(logits, targets, ref):
    """Per row: the target's negative log-likelihood, max |logits - ref|, whether any logit is
    not finite (a refused row gives NaN logits), and whether the argmax is the target."""
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    diff = jnp.max(jnp.abs(logits - ref.astype(jnp.float32)), axis=-1)
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1)
    return nll, diff, bad, jnp.argmax(logits, axis=-1) == targets


def _cache_layers(cache) -> list:
    return [layer for block in cache for layer in block]


def _state_nbytes(tree) -> int:
    """Bytes of the arrays under the keys "state" / "qstate" anywhere in one layer's cache."""
    if isinstance(tree, dict):
        return sum(int(sum(a.nbytes for a in jax.tree.leaves(v))) if k in ("state", "qstate")
                   else _state_nbytes(v) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return sum(_state_nbytes(v) for v in tree)
    return 0


def decode_scores(model, inputs: np.ndarray, targets: np.ndarray, prefill_len: int,
                  ref: list | None = None, label: str = "", mesh=None) -> dict:
    """Feeds inputs [B,L] through the cache (prefill_len tokens by prefill, the rest one at a time
    by decode_step) and scores every decode step's logits against targets [B,L]. ref: the fp32
    run's per-step logits (None: this is the fp32 run; its logits are returned as "logits").
    Returns {"nll" [B,S], "diff" [B,S] (0 without ref), "hit" [B,S] (argmax == target), "ms"
    per step, "state_bytes" and "cache_bytes" per layer, "logits" (ref run only)}; raises on a
    non-finite logit."""
    B, L = inputs.shape
    if prefill_len:
        _, cache = prefill(model, jnp.asarray(inputs[:, :prefill_len]),
                           jnp.full((B,), prefill_len, jnp.int32), L)
    else:
        cache = model.init_cache(B, L)
        if mesh is not None:  # where decode_step's outputs live: else step 2 compiles again
            cache = jax.device_put(cache, jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec()))
    layers = _cache_layers(cache)
    state_bytes = [_state_nbytes(c) for c in layers]
    cache_bytes = [int(sum(a.nbytes for a in jax.tree.leaves(c))) for c in layers]
    steps = range(prefill_len, L)
    feed = [(jnp.asarray(inputs[:, t]), jnp.full((B,), t, jnp.int32),
             jnp.asarray(targets[:, t])) for t in steps]
    jax.block_until_ready(feed)
    nll, diff, bad, hit, kept, ms = [], [], [], [], [], []
    for i, (tok, pos, tgt) in enumerate(feed):
        start = time.perf_counter()
        logits, cache = decode_step(model, cache, tok, pos)
        logits.block_until_ready()
        ms.append((time.perf_counter() - start) * 1e3)
        n, d, b, h = _score(logits, tgt, logits if ref is None else ref[i])
        nll.append(n)
        diff.append(d)
        bad.append(b)
        hit.append(h)
        if ref is None:
            kept.append(logits)
    bad = np.asarray(jnp.stack(bad, axis=1))
    if bad.any():
        b, s = np.argwhere(bad)[0]
        raise FloatingPointError(
            f"bench_leapquant --quality [{label}]: non-finite logits at {int(bad.sum())} "
            f"(row, step)s, first row {b} at position {prefill_len + s} (a NaN row is refused: "
            "its cache is full, or the model diverged); not averaging it")
    out = {"nll": np.asarray(jnp.stack(nll, axis=1), np.float64),
           "diff": np.asarray(jnp.stack(diff, axis=1), np.float64),
           "hit": np.asarray(jnp.stack(hit, axis=1)), "ms": ms,
           "state_bytes": state_bytes, "cache_bytes": cache_bytes}
    if ref is None:
        out["logits"] = kept
    return out


def forward_scores(model, inputs: np.ndarray, targets: np.ndarray, prefill_len: int,
                   ref: list) -> dict:
    """The training forward (no cache) on the same inputs: nll, max |logit - ref| and argmax ==
    target of the positions the decode scored."""
    graphdef, state = nnx.split(model)
    B, L = inputs.shape

    @jax.jit
    def fwd(state, tokens):
        m = nnx.merge(graphdef, state)
        pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
        return m(tokens, positions=pos, segment_ids=jnp.ones((B, L), jnp.int32))[0]

    logits = fwd(state, jnp.asarray(inputs))[:, prefill_len:]
    n, d, _, h = jax.vmap(_score, in_axes=(1, 1, 0), out_axes=1)(
        logits, jnp.asarray(targets[:, prefill_len:]), jnp.stack(ref))
    if not np.all(np.isfinite(np.asarray(n))):
        raise FloatingPointError("bench_leapquant --quality: the training forward gave "
                                 "non-finite losses")
    return {"nll": np.asarray(n, np.float64), "diff": np.asarray(d, np.float64),
            "hit": np.asarray(h)}


def _loss_stats(nll: np.ndarray, w: np.ndarray, ref_doc: np.ndarray | None) -> dict:
    """Mean loss over all scored tokens, per document, and the paired difference to ref_doc."""
    doc = (nll * w).sum(1) / w.sum(1)
    loss = float((nll * w).sum() / w.sum())
    n = doc.size
    out = {"loss": loss, "perplexity": float(np.exp(loss)), "doc_loss": doc.tolist(),
           "loss_se_docs": float(doc.std(ddof=1) / np.sqrt(n)) if n > 1 else None}
    if ref_doc is not None:
        d = doc - ref_doc
        out["doc_delta"] = d.tolist()
        out["delta_se_docs"] = float(d.std(ddof=1) / np.sqrt(n)) if n > 1 else None
    return out


def _quarters(steps: int) -> list[tuple[int, int]]:
    """[a, b) ranges splitting `steps` scored steps into QUALITY_BUCKETS near-equal parts."""
    edges = np.linspace(0, steps, QUALITY_BUCKETS + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _buckets(nll: np.ndarray, w: np.ndarray, first: int) -> list[dict]:
    return [{"positions": [first + a, first + b - 1],
             "loss": float((nll[:, a:b] * w[:, a:b]).sum() / w[:, a:b].sum())}
            for a, b in _quarters(nll.shape[1])]


def _setting_override(setting: str) -> str:
    return "model.gated_delta.state_quant=" + ("None" if setting == "none" else setting)


def quality(checkpoint, *, docs: int = 8, length: int = 1024, prefill_len: int = 0,
            settings=QUALITY_SETTINGS, step: int | None = None, forward: bool = True) -> dict:
    """The quality measurement of the module docstring; returns the JSON-able result."""
    settings = list(dict.fromkeys(settings))
    if "none" in settings:
        settings.remove("none")
    settings = ["none"] + settings  # the fp32 reference runs first
    if docs < 1 or length < 2 or not 0 <= prefill_len < length:
        raise ValueError(f"bench_leapquant --quality: need --docs >= 1, --length >= 2 and "
                         f"0 <= --prefill < --length; got {docs}, {length}, {prefill_len}")
    base = load_model(checkpoint, step=step, overrides=[_setting_override("none")])
    cfg = base.config
    if length > cfg.model.max_seq_len:
        raise ValueError(f"bench_leapquant --quality: --length {length} exceeds the model's "
                         f"max_seq_len {cfg.model.max_seq_len}")
    data = validation_rows(cfg, base.tokenizer, docs, length)
    inputs, targets = data["tokens"][:, :-1], data["tokens"][:, 1:]
    w = data["weights"][:, 1:][:, prefill_len:].astype(np.float64)
    K, V = cfg.model.gated_delta.dims(cfg.model)[2:]
    result = {
        "checkpoint": str(checkpoint), "step": base.step, "mixers": list(cfg.model.mixers),
        "train_seq_len": cfg.data.seq_len, "max_seq_len": cfg.model.max_seq_len,
        "docs": docs, "length": length, "prefill": prefill_len,
        "scored_tokens_per_doc": length - prefill_len, "doc_ids": data["ids"],
        "doc_tokens_before_truncation": data["truncated_from"],
        "skipped_short_docs": data["skipped_short"],
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg": list(os.getloadavg()), "host": platform.node(), "rows": [],
    }
    ref, ref_doc = None, None
    for s in settings:
        loaded = base if s == "none" else load_model(checkpoint, step=base.step,
                                                     overrides=[_setting_override(s)])
        spec = loaded.config.model.gated_delta.state_spec()
        r = decode_scores(loaded.model, inputs, targets, prefill_len, ref, label=s,
                          mesh=loaded.mesh)
        if ref is None:
            ref = r.pop("logits")
        stats = _loss_stats(r["nll"], w, ref_doc)
        if ref_doc is None:
            ref_doc = np.asarray(stats["doc_loss"])
            stats["doc_delta"], stats["delta_se_docs"] = [0.0] * docs, 0.0
        gd = [b for b in r["state_bytes"] if b]
        ms = r["ms"][_TIMING_SKIP:] or r["ms"]
        row = {"setting": s, **stats, "delta": stats["loss"] - result["rows"][0]["loss"]
               if result["rows"] else 0.0,
               "max_abs_logit_diff": float(r["diff"].max()),
               "mean_abs_logit_diff_max_per_step": float(r["diff"].mean()),
               "by_position": _buckets(r["nll"], w, prefill_len),
               "max_abs_logit_diff_by_position": [float(r["diff"][:, a:b].max())
                                                  for a, b in _quarters(r["diff"].shape[1])],
               "step_ms_median": float(np.median(ms)), "step_ms_p90": float(np.percentile(ms, 90)),
               "state_bytes_per_row_per_layer": (gd[0] // docs) if gd else 0,
               "state_bytes_per_layer": r["state_bytes"], "cache_bytes_per_layer":
                   r["cache_bytes"], "cache_bytes_per_row": sum(r["cache_bytes"]) // docs,
               "bytes_per_element_packed": bytes_per_element(
                   spec if spec is not None else FP32, K, V,
                   decay_dim=K if "kda" in cfg.model.mixers else 1)}
        result["rows"].append(row)
        print(f"  {s}: loss {row['loss']:.5f}  delta {row['delta']:+.2e}  max|dlogit| "
              f"{row['max_abs_logit_diff']:.2e}  {row['step_ms_median']:.1f} ms/step",
              file=sys.stderr, flush=True)
    if forward:
        f = forward_scores(base.model, inputs, targets, prefill_len, ref)
        stats = _loss_stats(f["nll"], w, ref_doc)
        result["forward"] = {**stats, "delta": stats["loss"] - result["rows"][0]["loss"],
                             "max_abs_logit_diff": float(f["diff"].max()),
                             "by_position": _buckets(f["nll"], w, prefill_len)}
    return result


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def quality_table(res: dict) -> str:
    """The markdown tables of a quality() result."""
    lines = [
        f"checkpoint `{res['checkpoint']}` step {res['step']} (mixers {','.join(res['mixers'])}), "
        f"{res['docs']} validation docs x {res['length']} tokens (truncated; "
        f"{res['skipped_short_docs']} shorter docs skipped), prefill {res['prefill']}, "
        f"{res['scored_tokens_per_doc']} decode-scored tokens per doc; {res['device']}, "
        f"{res['date']}, loadavg {' '.join(f'{x:.2f}' for x in res['loadavg'])}",
        "",
        "| setting | loss (nats/tok) | ppl | Δloss vs fp32 ± SE(docs) | SE(loss, docs) | "
        "max abs Δlogit | ms/step (median) | state B/row/layer | cache B/row | B/elem packed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['setting']} | {r['loss']:.5f} | {r['perplexity']:.4f} | "
            f"{r['delta']:+.2e} ± {_fmt(r['delta_se_docs'], '.1e')} | "
            f"{_fmt(r['loss_se_docs'], '.4f')} | "
            f"{r['max_abs_logit_diff']:.2e} | {r['step_ms_median']:.2f} | "
            f"{r['state_bytes_per_row_per_layer']} | {r['cache_bytes_per_row']} | "
            f"{r['bytes_per_element_packed']:.3f} |")
    f = res.get("forward")
    if f is not None:
        lines.append(
            f"| training forward (no cache) | {f['loss']:.5f} | {f['perplexity']:.4f} | "
            f"{f['delta']:+.2e} ± {_fmt(f['delta_se_docs'], '.1e')} | "
            f"{_fmt(f['loss_se_docs'], '.4f')} | "
            f"{f['max_abs_logit_diff']:.2e} | - | - | - | - |")
    rows = res["rows"] + ([dict(f, setting="training forward")] if f else [])
    heads = [f"{b['positions'][0]}-{b['positions'][1]}" for b in res["rows"][0]["by_position"]]
    lines += ["", f"Loss by position (training pieces were {res['train_seq_len']} tokens):", "",
              "| setting | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r['setting']} | "
                     + " | ".join(f"{b['loss']:.4f}" for b in r["by_position"]) + " |")
    return "\n".join(lines)


def quality_main(a) -> int:
    if not a.checkpoint:
        raise SystemExit("bench_leapquant --quality needs --checkpoint RUN")
    settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    res = quality(a.checkpoint, docs=a.docs, length=a.length, prefill_len=a.prefill,
                  settings=settings, step=a.step, forward=not a.no_forward)
    res["command"] = " ".join([Path(sys.executable).name, "-m", "aiinfra_jax.eval.bench_leapquant"]
                              + list(a.argv))
    table = quality_table(res)
    print(table)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
        out.with_suffix(".md").write_text(table + "\n")
        print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return 0


def main(argv=None) -> int | None:
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
    q = p.add_argument_group("quality mode (see the module docstring)")
    q.add_argument("--quality", action="store_true",
                   help="loss of a trained run decoded through its (quantized) state cache")
    q.add_argument("--checkpoint", default=None, help="a run directory (or checkpoints folder)")
    q.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    q.add_argument("--docs", type=int, default=8, help="validation documents (rows of a batch)")
    q.add_argument("--length", type=int, default=1024, help="input tokens per document")
    q.add_argument("--prefill", type=int, default=0, help="inputs fed by prefill, not scored")
    q.add_argument("--settings", default=",".join(QUALITY_SETTINGS),
                   help="model.gated_delta.state_quant values; none = float32 (the reference)")
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
                   help="comma-separated state formats (none = float32)")
    c.add_argument("--repeats", type=int, default=7, help="timed calls per format (median)")
    a = p.parse_args(argv)
    if a.cost:
        return cost_main(a)
    if a.quality:
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
