"""The quality mode of eval/bench_leapquant.py: a trained run's loss decoded through its
(quantized) gated-delta state cache, one setting of model.gated_delta.state_quant at a time.

Quality mode (issue 23's perplexity measurement on a trained run):

    python -m aiinfra_jax.eval.bench_leapquant --quality --checkpoint RUN [--docs 8]
        [--length 1024] [--prefill 0] [--settings none,bf16_per_step,int8_per_step,int8,int6,int4]
        [--out results.json]

Every setting s loads RUN with `model.gated_delta.state_quant=s` ("none" = float32 states, always
run first: the reference; "s+bf16rec" = s with its window records in bfloat16,
`model.gated_delta.state_records=bfloat16`: bench_leapquant.gated_delta_fields), in one process. Rows: the first --docs documents of the run's own
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

Its own module so that bench_leapquant.py's state-error and cost modes import no data code: only
this mode reads a run's validation split.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.data import sources as sources_lib
from aiinfra_jax.eval.bench_leapquant import setting_overrides
from aiinfra_jax.generate import decode_step, prefill
from aiinfra_jax.kernels.leapquant import LeapQuantSpec, bytes_per_element
from aiinfra_jax.load import load_model

FP32 = LeapQuantSpec(fmt="none", window=1)  # float32 states, for the bytes column only
# model.gated_delta.state_quant settings compared by default ("none" first: the reference)
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
    base = load_model(checkpoint, step=step, overrides=setting_overrides("none"))
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
                                                     overrides=setting_overrides(s))
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
    settings = ([s.strip() for s in a.settings.split(",") if s.strip()] if a.settings
                else list(QUALITY_SETTINGS))
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
