"""Generation throughput: prefill and decode tokens/s of `aiinfra_jax.generate.generate`.

    python -m aiinfra_jax.eval.bench_generate [--presets tiny,nsa_tiny,attnres] [--contexts 1024,4096]
        [--batches 1,8] [--new-tokens 64] [--prefill-chunk 512] [--repeats 3] [--set k=v ...]

For each preset (a configs/ file name, or "attnres" = configs/tiny.py with Block Attention
Residuals), context length and batch size: a randomly initialised model (speed does not depend on
the weights; no eos, so every row decodes --new-tokens tokens) generates from random prompts.
The two compiled programs of `generate` are timed apart, each the best of --repeats calls after a
compiling one: the prefill (prompts fed in chunks of --prefill-chunk tokens, 0 = one chunk) and
the decode loop (`lax.while_loop`, N - 1 model steps after the token sampled from the prefill's
logits), whose time over N - 1 is the decode time per step.

Beside it, the step's own compute: one decode step of the same per-block model compiled alone and
called back to back on its donated cache ("step alone", best of --repeats means over 20 calls),
and the loop's time per token as a multiple of it ("loop / step": what the loop, sampling and
bookkeeping add; < 1 where the loop's program schedules better than the lone step). XLA's
cost-analysis bytes are not shown: they count every in-place cache write as a full read and
write of the buffer, so they overstate a decode step several times over.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.config import apply_overrides, load_config
from aiinfra_jax.generate import decode_loop, _decode_step, prefill
from aiinfra_jax.models import Transformer

PRESETS = {"tiny": ("configs/tiny.py", []), "nsa_tiny": ("configs/nsa_tiny.py", []),
           "attnres": ("configs/tiny.py", ["model.residual=attnres_block"])}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_alone(model, prompts: np.ndarray, new_tokens: int, repeats: int) -> float:
    """Seconds of one compiled decode step (the per-block model generate's loop runs), called back
    to back on its own donated cache: best over `repeats` of the mean of 20 calls."""
    batch, ctx = prompts.shape
    lengths = jnp.full((batch,), ctx, jnp.int32)
    _, cache = prefill(model, prompts, lengths, ctx + 1 + 20 * repeats)
    unscanned = getattr(model, "unscanned", None)  # (older code: no such method)
    graphdef, state = nnx.split(model if unscanned is None else unscanned())
    tokens = jnp.ones((batch,), jnp.int32)
    _, cache = _decode_step(graphdef, state, cache, tokens, lengths)  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(20):
            logits, cache = _decode_step(graphdef, state, cache, tokens, lengths)
        logits.block_until_ready()
        best = min(best, (time.perf_counter() - start) / 20)
    return best


def measure(preset: str, ctx: int, batch: int, new_tokens: int, repeats: int,
            overrides: list[str], prefill_chunk: int | None = None) -> dict:
    path, extra = PRESETS.get(preset, (f"configs/{preset}.py", []))
    cfg = apply_overrides(load_config(path), extra + overrides
                          + [f"model.max_seq_len={ctx + max(new_tokens, 1 + 20 * repeats)}"])
    model = Transformer(cfg.model.with_vocab(cfg.model.vocab_size or 256), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 200, (batch, ctx)).astype(np.int32)
    lengths = jnp.full((batch,), ctx, jnp.int32)
    graphdef, state = nnx.split(model)

    def run_prefill():
        logits, cache = prefill(model, prompts, lengths, ctx + new_tokens, chunk_size=prefill_chunk)
        return jax.block_until_ready((logits, cache))

    def run_decode(logits, cache):
        out = decode_loop(graphdef, state, cache, logits, lengths, new_tokens, 0.0, 1.0, None, 0,
                           None)
        jax.block_until_ready(out)

    logits, cache = run_prefill()  # compile
    run_decode(logits, cache)
    one = min(_timed(run_prefill) for _ in range(repeats))
    step = min(_timed(lambda: run_decode(logits, cache)) for _ in range(repeats)) / (new_tokens - 1)
    alone = step_alone(model, prompts, new_tokens, repeats)
    return {"preset": preset, "context": ctx, "batch": batch, "prefill_tok_s": batch * ctx / one,
            "step_ms": step * 1e3, "decode_tok_s": batch / step, "alone_ms": alone * 1e3,
            "loop_over_step": step / alone}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,nsa_tiny,attnres")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode time is a difference of two runs)")
    print(f"# generate throughput, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}; command: python -m "
          f"aiinfra_jax.eval.bench_generate {' '.join(argv if argv is not None else sys.argv[1:])}")
    print("| preset | context | batch | prefill tok/s | decode ms/step | decode tok/s | "
          "step alone ms | loop / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for preset in args.presets.split(","):
        for ctx in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                r = measure(preset, ctx, batch, args.new_tokens, args.repeats, args.overrides,
                            args.prefill_chunk or None)
                print(f"| {r['preset']} | {r['context']} | {r['batch']} | "
                      f"{r['prefill_tok_s']:,.0f} | {r['step_ms']:.2f} | "
                      f"{r['decode_tok_s']:,.0f} | {r['alone_ms']:.2f} | "
                      f"{r['loop_over_step']:.2f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
