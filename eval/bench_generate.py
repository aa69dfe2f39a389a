"""Generation throughput: prefill and decode tokens/s of `aiinfra_jax.generate.generate`.

    python -m aiinfra_jax.eval.bench_generate [--presets tiny,nsa_tiny,attnres] [--contexts 1024,4096]
        [--batches 1,8] [--new-tokens 64] [--prefill-chunk 512] [--repeats 3] [--set k=v ...]

For each preset (a configs/ file name, or "attnres" = configs/tiny.py with Block Attention
Residuals), context length and batch size: a randomly initialised model (speed does not depend on
the weights; no eos, so every row decodes --new-tokens tokens) generates from random prompts.
Decode time per step = (time of generate with N new tokens - time with 1) / (N - 1), each the
best of --repeats calls after a compiling one, so prefill and dispatch cancel; prefill tokens/s
from the 1-token call (prompts fed in chunks of --prefill-chunk tokens, 0 = one chunk). Beside it, the step's own cost: the bytes one compiled decode step
accesses (XLA's cost analysis of `decode_step`) over this machine's measured copy bandwidth, and
the measured step time as a multiple of that bound ("x bytes" in the table).
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
from aiinfra_jax.generate import _decode_step, generate, prefill
from aiinfra_jax.models import Transformer

PRESETS = {"tiny": ("configs/tiny.py", []), "nsa_tiny": ("configs/nsa_tiny.py", []),
           "attnres": ("configs/tiny.py", ["model.residual=attnres_block"])}


def copy_bandwidth(mbytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a jitted x + 1 over a float32 buffer of `mbytes` MB (one read, one write)."""
    x = jnp.zeros((mbytes * 2**20 // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    f(x).block_until_ready()
    best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(repeats))
    return 2 * x.nbytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_bytes(model, prompts: np.ndarray, new_tokens: int) -> float:
    """Bytes accessed by one compiled decode step (XLA cost analysis) after a prefill."""
    batch, ctx = prompts.shape
    lengths = jnp.full((batch,), ctx, jnp.int32)
    _, cache = prefill(model, prompts, lengths, ctx + new_tokens)
    # the per-block model that generate's decode loop runs (its parameter slices are taken once
    # per call, outside the loop, so they are not part of a step)
    graphdef, state = nnx.split(model.unscanned())
    compiled = _decode_step.lower(graphdef, state, cache, jnp.zeros((batch,), jnp.int32),
                                  lengths).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("bytes accessed", float("nan")))


def measure(preset: str, ctx: int, batch: int, new_tokens: int, repeats: int,
            overrides: list[str], bandwidth: float, prefill_chunk: int | None = None) -> dict:
    path, extra = PRESETS.get(preset, (f"configs/{preset}.py", []))
    cfg = apply_overrides(load_config(path), extra + overrides
                          + [f"model.max_seq_len={ctx + new_tokens}"])
    model = Transformer(cfg.model.with_vocab(cfg.model.vocab_size or 256), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 200, (batch, ctx)).astype(np.int32)
    lengths = np.full((batch,), ctx, np.int32)

    def best(n: int) -> float:
        run = lambda: generate(model, (prompts, lengths), max_new_tokens=n,
                               prefill_chunk=prefill_chunk).tokens.block_until_ready()
        run()  # compile
        return min(_timed(run) for _ in range(repeats))

    one, many = best(1), best(new_tokens)
    step = (many - one) / (new_tokens - 1)
    nbytes = step_bytes(model, prompts, new_tokens)
    return {"preset": preset, "context": ctx, "batch": batch, "prefill_tok_s": batch * ctx / one,
            "step_ms": step * 1e3, "decode_tok_s": batch / step, "step_mb": nbytes / 1e6,
            "x_bytes": step / (nbytes / bandwidth)}


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
    bandwidth = copy_bandwidth()
    print(f"# generate throughput, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; command: python -m aiinfra_jax.eval.bench_generate "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}")
    print("| preset | context | batch | prefill tok/s | decode ms/step | decode tok/s | "
          "step MB | x bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for preset in args.presets.split(","):
        for ctx in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                r = measure(preset, ctx, batch, args.new_tokens, args.repeats, args.overrides,
                            bandwidth, args.prefill_chunk or None)
                print(f"| {r['preset']} | {r['context']} | {r['batch']} | "
                      f"{r['prefill_tok_s']:,.0f} | {r['step_ms']:.2f} | "
                      f"{r['decode_tok_s']:,.0f} | {r['step_mb']:.1f} | {r['x_bytes']:.1f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
