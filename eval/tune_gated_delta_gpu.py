"""Tile choices of the gated-delta Triton state pass (kernels/gated_delta/pallas_gpu.py), timed
against the XLA state pass in one invocation, each checked against it first.

    python3 eval/tune_gated_delta_gpu.py [--T 16384] [--heads 16] [--dim 128]
        [--variants 16x4,32x4,32x8,64x8] [--repeats 5] [--out F.json]
    python -m aiinfra_jax.eval.tune_gated_delta_gpu --interpret --tiny     (a CPU: logic only)

Why: on the first H200 run (eval/BENCHMARKS.md "GPU kernel check") the state pass and its
backward ran at ~1 TFLOP/s at every length, 4-7x slower than the XLA scan at the same float32
precision, so implementation=None no longer picks them on cuda. Each program owns a [K, block_v]
slice of the state for the whole sequential loop and loads [C, K] operands per chunk; with
num_warps=4 and K = 128 that is ~200 registers of tiles per thread, so spills are the first
suspect. A variant "BVxW" runs the sequential kernels with block_v = BV value columns per program
and num_warps = W.

What runs: GDN inputs (B = 1, --heads value heads over as many key heads, K = V = --dim, T =
--T, chunk 64, L2-normalised q and k, log-decays of moderate magnitude), prepared once by
xla.prepare; then the state pass alone (pallas_gpu.state_pass vs xla.state_pass) forward, and its
backward (pallas_gpu.state_pass_bwd vs the VJP of xla.state_pass) on random cotangents. Each
variant's outputs must be within the gated-delta kernels' float32 tolerance (1e-4 relative, the
whole tensor) of XLA's before it is timed; a variant that fails or does not compile is a row
with its error. Times: AOT-compiled, a warm-up call, the median of --repeats samples of >= 20 ms
of back-to-back calls (eval/gpu_timing.time_call). It imports JAX, NumPy and kernels/ only (no
grain): it runs from a bare checkout with the GPU machine's python3.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file (python3 eval/tune_...py)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # eval/, for _checkout
    import _checkout
    _checkout.use_this_checkout()   # the root instead of eval/ on sys.path (see there)

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from aiinfra_jax.eval.gpu_timing import time_call
from aiinfra_jax.kernels import _testing
from aiinfra_jax.kernels.gated_delta import pallas_gpu, xla

TOLERANCE = 1e-4          # tests/kernels/test_gated_delta.py's float32 tolerance
MIN_SAMPLE_S = 0.02


def prepared_inputs(rng: np.random.Generator, *, T: int, heads: int, dim: int, chunk: int):
    """The state pass's operands (w, u1, qg, m, kdt, decay, S0) for random GDN inputs."""
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)       # noqa: E731
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)      # noqa: E731
    q, k = unit(normal(1, T, heads, dim)), unit(normal(1, T, heads, dim))
    v = normal(1, T, heads, dim)
    g = -np.exp(rng.uniform(np.log(1e-3), np.log(0.3), (1, T, heads))).astype(np.float32)
    beta = 1 / (1 + np.exp(-normal(1, T, heads)))
    p = jax.jit(lambda *a: xla.prepare(*a, None, scale=dim ** -0.5, chunk_size=chunk))(
        *(jnp.asarray(x) for x in (q, k, v, g, beta)))
    S0 = jnp.asarray(normal(1, heads, dim, dim))
    return (p.w, p.u1, p.qg, p.m, p.kdt, p.decay, S0)


def _variants(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        bv, _, w = item.partition("x")
        if not (bv.isdigit() and w.isdigit()):
            raise SystemExit(f"tune_gated_delta_gpu: --variants item {item!r} must be BVxW, "
                             "e.g. 32x8 (block_v 32, num_warps 8)")
        out.append((int(bv), int(w)))
    return out


def run(a) -> list[dict]:
    rng = np.random.default_rng(a.seed)
    args = prepared_inputs(rng, T=a.T, heads=a.heads, dim=a.dim, chunk=a.chunk)
    o_shape = args[1].shape
    cot = (jnp.asarray(rng.standard_normal(o_shape).astype(np.float32)),
           jnp.asarray(rng.standard_normal(args[6].shape).astype(np.float32)))
    fwd_ref = jax.jit(xla.state_pass)
    bwd_ref = jax.jit(lambda args, cot: jax.vjp(xla.state_pass, *args)[1](cot))
    want_f, want_b = fwd_ref(*args), bwd_ref(args, cot)
    min_s = 0.0 if a.interpret else MIN_SAMPLE_S
    rows = [{"variant": "xla", "fwd_s": time_call(fwd_ref, args, a.repeats, 8.0, min_s)[0],
             "bwd_s": time_call(bwd_ref, (args, cot), a.repeats, 8.0, min_s)[0]}]
    for bv, w in _variants(a.variants):
        row = {"variant": f"{bv}x{w}", "block_v": bv, "num_warps": w}
        kw = dict(interpret=a.interpret, block_v=bv, num_warps=w)
        fwd = jax.jit(lambda *x, kw=kw: pallas_gpu.state_pass(*x, **kw))
        bwd = jax.jit(lambda x, c, kw=kw: pallas_gpu.state_pass_bwd(x, c, **kw))
        try:
            got_f, got_b = fwd(*args), bwd(args, cot)
            row["fwd_err"] = max(_testing.rel_err(g, e) for g, e in zip(got_f, want_f))
            row["bwd_err"] = max(_testing.rel_err(g, e) for g, e in zip(got_b, want_b))
            if max(row["fwd_err"], row["bwd_err"]) > TOLERANCE:
                row["error"] = f"differs from XLA beyond {TOLERANCE:g}"
            else:
                row["fwd_s"] = time_call(fwd, args, a.repeats, 8.0, min_s)[0]
                row["bwd_s"] = time_call(bwd, (args, cot), a.repeats, 8.0, min_s)[0]
        except Exception as exc:      # a variant that does not compile is a row, not the end
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
    return rows


def table(rows: list[dict], a) -> str:
    base = rows[0]
    lines = [f"gated-delta state pass, B=1, {a.heads} heads, K=V={a.dim}, T={a.T}, chunk "
             f"{a.chunk}; {jax.devices()[0].device_kind}, jax {jax.__version__}"
             + ("; interpret mode (times meaningless)" if a.interpret else ""), "",
             "| variant | fwd ms | bwd ms | fwd vs XLA | bwd vs XLA | rel err fwd / bwd |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | | | | | {r['error']} |")
            continue
        err = (f"{r['fwd_err']:.1e} / {r['bwd_err']:.1e}" if "fwd_err" in r else "(reference)")
        lines.append(f"| {r['variant']} | {r['fwd_s'] * 1e3:.3g} | {r['bwd_s'] * 1e3:.3g} | "
                     f"{base['fwd_s'] / r['fwd_s']:.2f}x | {base['bwd_s'] / r['bwd_s']:.2f}x | "
                     f"{err} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--variants", default="16x4,32x4,16x8,32x8,64x8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU)")
    ap.add_argument("--tiny", action="store_true", help="T 128, 2 heads of 16 (with --interpret)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    if a.tiny:
        a.T, a.heads, a.dim, a.chunk, a.repeats = 128, 2, 16, 32, 1
    if jax.default_backend() != "gpu" and not a.interpret:
        print("tune_gated_delta_gpu: no GPU here; pass --interpret (--tiny) to check the logic",
              file=sys.stderr)
        return 2
    rows = run(a)
    print(table(rows, a), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
