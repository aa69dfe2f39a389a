"""GPU kernel check: every Pallas GPU kernel's parity with its float32 reference (run natively),
and timings against cuDNN and the XLA path, forward and forward+backward, in one invocation.

    python -m aiinfra_jax.eval.bench_gpu [--lengths 4k,64k,16k,8k,32k] [--budget-s 270] [--out F]
    python eval/bench_gpu.py [...]           the same from a checkout that is not pip-installed
                                             (the GPU machine: its python3, no network, no grain)
    make bench-gpu ARGS="..."
    python -m aiinfra_jax.eval.bench_gpu --interpret --tiny     on a CPU: the same code paths with
                                             Pallas in interpret mode at tiny shapes (timings
                                             meaningless; tests/eval/test_bench_gpu.py runs this)
    python -m aiinfra_jax.eval.bench_gpu --lower-only           on a CPU: every timing row of the
                                             real configuration built and lowered for cuda (the
                                             native kernels through Triton lowering), each Triton
                                             module through the MLIR verifier (the GPU's Triton
                                             compiler's first check), nothing run

It imports JAX, NumPy and this library's kernels only (never grain, datasets or the trainer), so
it runs where nothing else of the project is installed.

Parity. Every kernel folder with a pallas_gpu.py (kernels/<op>/) has cases in eval/gpu_parity.py;
one that has none is reported as a failing row. Each case draws fresh random inputs (the seed is
printed; --seed repeats it), runs the kernel with implementation="pallas_gpu" (natively;
--interpret for interpret mode) and its float32 reference (kernels/<op>/reference.py), forward
and gradients through jax.vjp with random cotangents, at moderate shapes (--tiny: the unit
tests' shapes). The metric
and tolerances are the kernel tests' (tests/kernels): the relative error of each whole tensor,
||actual - expected|| / ||expected||, against kernels._testing.TOLERANCES (float32 2e-5, bfloat16
1.5e-2) and, for gated_delta, its test's 1e-4 / 5e-3; leapquant (decode only: no gradients)
decodes format "none" through the kernel against the float32 recurrence at 2e-5, and INT8 with
checks scaled by the quantization error (eval/gpu_parity._parity_leapquant says why a fixed
tolerance cannot hold there). A row shows the worst
tensor, its relative error and max abs error, the tolerance and pass / FAIL, and every tensor's
relative error (and any extra check). bfloat16 flash and sparse rows also run the op's XLA path on
the same inputs, and a tensor within 2x of that baseline's error passes too (gpu_parity says
why). Cases run --parity-workers at a time (threads, default 4): compiling the kernel, the
reference and their VJPs is most of a case's time (220 s for the 15 cases one after another on
the first H200 run, 2026-12-04).

Timings. B = 1, Hq = --heads query heads over --kv-heads KV heads of --head-dim, --dtype (bfloat16),
at each of --lengths, in the order given (the default visits 4K and 64K, then 16K, 8K and 32K, so
a short budget still spans the range; the table is sorted by length):
  flash       dense causal flash_attention        pallas_gpu | xla | cudnn
  window      sliding window of --window keys      pallas_gpu | xla | cudnn (local_window_size)
  compressed  compressed-causal mask (l=32, d=16)  pallas_gpu | xla
  sparse      sparse_attention over select_blocks' selections of real compressed scores of the
              random q / k (eval/bench_kernels.nsa_selection; FLOPs from the keys attended)
                                                   pallas_gpu | xla
  select      select_blocks, forward only          pallas_gpu | xla
  gdn, kda    gated_delta_rule (H = HV = --heads, K = V = --head-dim; the Pallas kernels are
              the state pass and its backward, the rest is XLA)          pallas_gpu | xla
  depth       depth_attention (Attention Residuals) over --depth-sources sources of width
              --depth-dim for every token, 2 queries                     pallas_gpu | xla
cudnn = jax.nn.dot_product_attention(..., implementation="cudnn") in the same dtype; with
--interpret on a CPU, jax.nn.dot_product_attention's XLA path stands in for it (marked cudnn*).
Per row: AOT-compiled (compilation is never timed), one warm-up call, then the median of --repeats
samples, each the mean of enough back-to-back calls to last >= 20 ms; achieved TFLOP/s and GB/s
from the op's FLOP and byte counts (the kernels' *_flops / *_bytes helpers), the share of the bf16
matmul peak measured at the start of the same run, and two speed-ups: vs cuDNN (cuDNN's dense
causal attention, or its sliding window for `window`, at the same T and mode, divided by this
row's time: > 1 is faster than cuDNN) and vs XLA (the same op's XLA path). Every ratio comes from
this one invocation.

Budget. The whole run stops starting work after --budget-s seconds (default 270: under 5
minutes). Before each row the time it needs is predicted (compile time seen so far, the same row
at another length scaled by its FLOP growth) and a row that would not fit is skipped with the
reason printed and listed in the table; so is one whose compiled temporaries and outputs would not
fit the device's free memory. A row that raises is listed with its error and the run goes on.
The markdown is rewritten after every row, so a run killed from outside leaves what it measured.
Exit status 1 if any parity row fails.

Output: --out (default $OUT/bench_gpu.md when $OUT is set, else eval/bench_gpu.md), and the
same numbers as JSON beside it (.json).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: python eval/bench_gpu.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # eval/, for _checkout
    import _checkout
    _checkout.use_this_checkout()   # the root instead of eval/ on sys.path (see there)

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import platform
import statistics
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from aiinfra_jax.eval.bench_kernels import (CMP_LEN, CMP_STRIDE, attended_keys, nsa_selection,
                                            parse_lengths)
from aiinfra_jax.eval.gpu_parity import BASELINE_FACTOR, errors, parity_cases
from aiinfra_jax.kernels._testing import TRITON_CALL, verified_triton_modules
from aiinfra_jax.kernels.block_selection import select_blocks
from aiinfra_jax.kernels.depth_attention import depth_attention
from aiinfra_jax.kernels.depth_attention.cost import cost_estimate as depth_cost
from aiinfra_jax.kernels.flash_attention import (AttentionMask, flash_attention,
                                                 flash_attention_bytes, flash_attention_flops)
from aiinfra_jax.kernels.gated_delta import gated_delta_rule
from aiinfra_jax.kernels.gated_delta.cost import gated_delta_bytes, gated_delta_flops
from aiinfra_jax.kernels.sparse_attention import (sparse_attention, sparse_attention_bytes,
                                                  sparse_attention_flops)

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"
_INVOKED = ("python -m aiinfra_jax.eval.bench_gpu" if __package__ else "python eval/bench_gpu.py")
TIMED_OPS = ("flash", "window", "compressed", "sparse", "select", "gdn", "kda", "depth")
# How each op's time grows with T (for predicting a row from the same row at another length).
GROWTH = {"flash": 2, "window": 1, "compressed": 2, "sparse": 1, "select": 2, "gdn": 1, "kda": 1,
          "depth": 1}
DEPTH_QUERIES = 2
MIN_SAMPLE_S = 0.02   # one timing sample lasts at least this long (back-to-back calls)


# ----------------------------------------------------------------------------------------------
# Run state: the budget, the rows, the output file (rewritten after every row).

@dataclasses.dataclass
class Run:
    args: argparse.Namespace
    on_gpu: bool                          # the default backend is a GPU (cuDNN is real)
    pallas: dict                          # implementation="pallas_gpu", interpret=...
    deadline: float
    started: float
    out: Path
    meta: dict
    parity: list = dataclasses.field(default_factory=list)
    timing: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    compile_s: dict = dataclasses.field(default_factory=dict)   # (op, impl, mode) -> seconds
    call_s: dict = dataclasses.field(default_factory=dict)      # (op, impl, mode) -> {T: s}
    peak_flops: float | None = None
    peak_bytes: float | None = None
    status: str = "running"

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def skip(self, what: str, reason: str) -> None:
        self.skipped.append({"what": what, "reason": reason})
        print(f"  SKIP {what}: {reason}", flush=True)
        self.write()

    def write(self) -> None:
        write_outputs(self)


_FAST_COMPILE: list = []   # [options or None], probed once


def _compile_options(run_or_args) -> dict | None:
    """Interpret mode at tiny shapes on a CPU: XLA's backend optimisations are most of the compile
    time of these tiny programs and buy nothing (as the kernel tests do). None elsewhere, or
    where this XLA does not know the option."""
    args = getattr(run_or_args, "args", run_or_args)
    if not (args.tiny and jax.default_backend() == "cpu"):
        return None
    if not _FAST_COMPILE:
        opts = {"xla_backend_optimization_level": 0}
        try:
            jax.jit(lambda x: x + 1, compiler_options=opts)(1.0)
        except Exception:
            opts = None
        _FAST_COMPILE.append(opts)
    return _FAST_COMPILE[0]


def _compile(run: Run, fn, *args):
    """AOT compile (never timed). Returns (compiled, seconds, bytes it allocates or None)."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    opts = _compile_options(run)
    compiled = lowered.compile(opts) if opts else lowered.compile()
    seconds = time.perf_counter() - t0
    need = None
    try:
        mem = compiled.memory_analysis()
        need = int(mem.temp_size_in_bytes) + int(mem.output_size_in_bytes)
    except Exception:  # not every backend reports it
        pass
    return compiled, seconds, need


def _free_device_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
        return int(stats["bytes_limit"]) - int(stats["bytes_in_use"])
    except Exception:  # the CPU reports nothing
        return None


def _time(fn, args, repeats: int, row_max_s: float, min_sample_s: float):
    """(seconds per call, note): a warm-up call, then the median of `repeats` samples, each the
    mean of back-to-back calls lasting >= min_sample_s (async dispatch: block on the last)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    if first >= row_max_s / 2 or repeats <= 0:
        return first, "1 call (long)" if repeats > 0 else "1 call"
    inner = max(1, min(1000, math.ceil(min_sample_s / max(first, 1e-7))))
    samples = max(1, min(repeats, int((row_max_s - first) / (first * inner))))
    times, enqueue = [], []
    for _ in range(samples):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
        enqueue.append((t1 - t0) / inner)
    note = f"median of {samples} x {inner} calls"
    if inner > 1 and statistics.median(enqueue) > 0.8 * statistics.median(times):
        note += "; host dispatch ~ the call time: an upper bound"  # the device waited on Python
    return statistics.median(times), note


def pallas_gpu_kernels() -> list[str]:
    """The kernel folders that hold a Pallas GPU kernel (kernels/<op>/pallas_gpu.py)."""
    return sorted(p.parent.name for p in KERNELS_DIR.glob("*/pallas_gpu.py"))


def run_parity(run: Run) -> None:
    cases = [c for c in parity_cases(run.args.tiny) if c.kernel in run.args.kernels]
    covered = {c.kernel for c in parity_cases(run.args.tiny)}
    for kernel in pallas_gpu_kernels():
        if kernel not in covered:
            run.parity.append({"kernel": kernel, "case": "-", "dtype": "-", "shape": "-",
                               "pass": False, "worst": "-", "rel_err": None, "max_abs": None,
                               "tol": None, "details": "kernels/%s/pallas_gpu.py has no parity "
                               "case in eval/gpu_parity.py" % kernel})
            print(f"  FAIL {kernel}: has a pallas_gpu.py but no parity case in gpu_parity.py",
                  flush=True)
    mode = "interpret mode" if run.pallas["interpret"] else "native"
    workers = max(1, run.args.parity_workers)
    print(f"parity ({mode}; seed {run.meta['seed']}; {workers} case(s) at a time):", flush=True)
    # Cases run in threads: each compiles its kernel, its reference and their VJPs, which is most
    # of a case's time (10-36 s each on the first H200 run, 220 s for 15 cases one at a time) and
    # releases the GIL; the device runs whatever is ready. Rows are recorded in case order.
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = []
        for i, case in enumerate(cases):
            if run.left() < 5:
                run.skip(f"parity {case.kernel} / {case.name} ({case.dtype})",
                         f"the budget is spent ({run.left():.0f} s left)")
                continue
            futures.append(pool.submit(_parity_row, run, case, i))
        for future in futures:
            row = future.result()
            run.parity.append(row)
            rel = "-" if row["rel_err"] is None else f"{row['rel_err']:.2e}"
            print(f"  {'pass' if row['pass'] else 'FAIL'} {row['kernel']:<17} {row['case']:<22} "
                  f"{row['dtype']:<9} worst {row['worst']:<14} rel {rel} tol "
                  f"{_fmt_tol(row['tol'])} ({row['seconds']:.1f} s)", flush=True)
            run.write()


def _parity_row(run: Run, case, i: int) -> dict:
    """One parity case's row (its own random inputs, from the run's seed and the case's index)."""
    rng = np.random.default_rng([run.meta["seed"], i])
    t0 = time.perf_counter()
    row = {"kernel": case.kernel, "case": case.name, "dtype": case.dtype, "shape": case.shape,
           "tol": case.tol}
    try:
        pairs, checks = case.run(rng, run.pallas, _compile_options(run))
        # (name, rel err, max abs err, note, the XLA baseline's rel err or None: gpu_parity)
        errs = [(p[0],) + errors(p[1], p[2]) + (errors(p[3], p[2])[0] if len(p) > 3 else None,)
                for p in pairs]
        worst = max(errs, key=lambda x: x[1])
        ok = all(rel <= case.tol or (base is not None and rel <= BASELINE_FACTOR * base)
                 for _, rel, _, _, base in errs) and all(c for _, c in checks)
        details = ", ".join(f"{n} {rel:.1e}" + (f" (XLA {base:.1e})" if base is not None else "")
                            + (f" ({note})" if note else "") for n, rel, _, note, base in errs)
        details += "".join(f"; {'' if c else 'FAILED: '}{w}" for w, c in checks)
        row.update({"pass": ok, "worst": worst[0], "rel_err": worst[1],
                    "max_abs": worst[2], "details": details})
    except Exception as exc:  # a kernel that fails to lower or run is a failing row
        traceback.print_exc(limit=3)
        row.update({"pass": False, "worst": "-", "rel_err": None, "max_abs": None,
                    "details": f"error: {_first_line(exc)}"})
    row["seconds"] = time.perf_counter() - t0
    return row


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


# ----------------------------------------------------------------------------------------------
# Timings.

@dataclasses.dataclass
class Bench:
    op: str
    impl: str                   # pallas_gpu | xla | cudnn
    fn: Callable                # fn(*inputs) -> one array
    inputs: tuple
    n_diff: int                 # gradients w.r.t. inputs[:n_diff] (0: forward only)
    flops: tuple                # (forward, backward alone)
    nbytes: tuple
    extra: dict = dataclasses.field(default_factory=dict)


def _sdpa(cudnn: bool, window: int | None = None):
    """cuDNN's fused attention (jax.nn.dot_product_attention, implementation="cudnn"), or its XLA
    path standing in for it off the GPU."""
    lw = None if window is None else (window - 1, 0)
    impl = "cudnn" if cudnn else "xla"
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        local_window_size=lw,
                                                        implementation=impl)


def benches_for_length(run: Run, T: int) -> list[Bench]:
    a = run.args
    B, H, Hkv, D = 1, a.heads, a.kv_heads, a.head_dim
    dt = jnp.dtype(a.dtype)
    abstract = a.lower_only                      # shapes only: rows are lowered, never run
    key = jax.random.PRNGKey(run.meta["seed"] + T)
    kq, kk, kv, kg, kb, ks, kd = jax.random.split(key, 7)

    def normal(key, shape, dtype=dt):
        if abstract:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.random.normal(key, shape, dtype)

    q = normal(kq, (B, T, H, D))
    k = normal(kk, (B, T, Hkv, D))
    v = normal(kv, (B, T, Hkv, D))
    pallas = run.pallas
    impls = [("pallas_gpu", pallas), ("xla", {"implementation": "xla"})]
    ops = a.ops
    out = []

    def flash_like(op, mask, kk_, vv_, cudnn_window):
        S = kk_.shape[1]
        fl = (flash_attention_flops(B, T, S, H, D, D, mask),
              flash_attention_flops(B, T, S, H, D, D, mask, backward=True))
        by = (flash_attention_bytes(B, T, S, H, Hkv, D, D, dtype=dt),
              flash_attention_bytes(B, T, S, H, Hkv, D, D, dtype=dt, backward=True))
        for impl, kw in impls:
            out.append(Bench(op, impl, lambda q, k, v, kw=kw: flash_attention(q, k, v, mask=mask,
                                                                              **kw),
                             (q, kk_, vv_), 3, fl, by))
        if cudnn_window is not False:
            out.append(Bench(op, "cudnn", _sdpa(run.on_gpu, cudnn_window), (q, kk_, vv_), 3, fl,
                             by, {"stand_in": not run.on_gpu}))

    if "flash" in ops:
        flash_like("flash", AttentionMask(), k, v, None)
    if "window" in ops:
        flash_like("window", AttentionMask(window=a.window), k, v, a.window)
    if any(o in ops for o in ("compressed", "sparse", "select")):
        t0 = time.perf_counter()
        select = lambda q, k, v: nsa_selection(q, k, v, block=a.block, n=a.n,  # noqa: E731
                                               implementation="xla")
        if abstract:
            idx, kc, vc, lse = jax.eval_shape(select, q, k, v)
        else:
            idx, kc, vc, lse = jax.block_until_ready(select(q, k, v))
            print(f"  T={T}: NSA inputs (compressed keys, lse, select_blocks) in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        mc = AttentionMask(causal=False, compressed=(CMP_LEN, CMP_STRIDE))
        if "compressed" in ops:
            flash_like("compressed", mc, kc, vc, False)
        if "sparse" in ops:
            nominal = a.n * a.block
            if abstract:  # no selection was made: the nominal count
                keys, dups = np.full((B, T, Hkv), nominal), 0
            else:
                keys, dups = attended_keys(idx, a.block)
                print(f"  T={T}: sparse selection: nominal {nominal} keys/query, actual mean "
                      f"{keys.mean():.1f} (min {int(keys.min())}); duplicate blocks {dups}",
                      flush=True)
            attended = int(keys.sum()) * (H // Hkv)
            fl = (2 * attended * 2 * D, 2 * attended * 5 * D)
            by = (sparse_attention_bytes(B, T, H, D, D, a.n, a.block, Hkv=Hkv,
                                         itemsize=dt.itemsize),
                  sparse_attention_bytes(B, T, H, D, D, a.n, a.block, backward=True, Hkv=Hkv,
                                         itemsize=dt.itemsize))
            extra = {"keys_nominal": nominal, "keys_actual": float(keys.mean()),
                     "duplicate_blocks": dups,
                     "flops_nominal": sparse_attention_flops(B, T, H, D, D, a.n, a.block)}
            for impl, kw in impls:
                out.append(Bench("sparse", impl,
                                 lambda q, k, v, idx, kw=kw: sparse_attention(
                                     q, k, v, idx, block_size=a.block, **kw),
                                 (q, k, v, idx), 3, fl, by, extra))
        if "select" in ops:
            n_init = min(1, a.n)
            fl = (flash_attention_flops(B, T, kc.shape[1], H, D, 0, mc), 0)
            by = ((q.size + kc.size) * dt.itemsize + lse.size * 4 + B * T * Hkv * a.n * 4, 0)
            for impl, kw in impls:
                out.append(Bench("select", impl,
                                 lambda q, kc, lse, kw=kw: select_blocks(
                                     q, kc, lse, seq_len=T, cmp_block_len=CMP_LEN,
                                     cmp_stride=CMP_STRIDE, block_size=a.block, n_selected=a.n,
                                     n_init=n_init, n_local=min(2, a.n - n_init), **kw),
                                 (q, kc, lse), 0, fl, by))
    for op in ("gdn", "kda"):
        if op not in ops:
            continue
        kda = op == "kda"
        g = normal(kg, (B, T, H, D) if kda else (B, T, H), jnp.float32)
        beta = normal(kb, (B, T, H), jnp.float32)
        kn = k if Hkv == H else normal(ks, (B, T, H, D))
        vn = v if Hkv == H else normal(kd, (B, T, H, D))
        if not abstract:
            g, beta = jax.nn.log_sigmoid(g) / 16, jax.nn.sigmoid(beta)
            kn = (kn / jnp.linalg.norm(kn.astype(jnp.float32), axis=-1, keepdims=True)
                  ).astype(dt)
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
        fl = tuple(gated_delta_flops(B, T, H, H, D, D, per_channel=kda, backward=bw)
                   for bw in (False, True))
        by = tuple(gated_delta_bytes(B, T, H, H, D, D, itemsize=dt.itemsize, per_channel=kda,
                                     backward=bw) for bw in (False, True))
        for impl, kw in impls:
            out.append(Bench(op, impl, lambda q, k, v, g, beta, kw=kw: gated_delta_rule(
                unit(q), k, v, g, beta, **kw), (q, kn, vn, g, beta), 3, fl, by))
    if "depth" in ops:
        S, Dd = a.depth_sources, a.depth_dim
        queries = normal(kg, (DEPTH_QUERIES, Dd), jnp.float32)
        sources = normal(kd, (S, B, T, Dd))
        costs = [depth_cost(DEPTH_QUERIES, S, B * T, Dd, dt.itemsize, bw) for bw in (False, True)]
        fl = (costs[0].flops, costs[1].flops)
        by = (costs[0].bytes_accessed, costs[1].bytes_accessed)
        for impl, kw in impls:
            out.append(Bench("depth", impl, lambda qs, src, kw=kw: depth_attention(qs, src, **kw),
                             (queries, sources), 2, fl, by))
    order = {o: i for i, o in enumerate(ops)}
    return sorted(out, key=lambda b: order[b.op])   # stable: pallas, xla, cudnn within an op


def _fwd_bwd(fn, n_diff: int):
    """A training step's attention work: the loss value and the gradients of inputs[:n_diff]
    (value_and_grad: a forward kernel whose residuals the backward does not use, like the
    gated-delta state pass, would otherwise be dead code)."""
    def loss(*args):
        *xs, ct = args
        return jnp.sum(fn(*xs).astype(jnp.float32) * ct)
    return jax.value_and_grad(loss, argnums=tuple(range(n_diff)))


def _predict(run: Run, key, T: int) -> tuple[float, float]:
    """(compile seconds, seconds per call) expected for row `key` at length T."""
    compiles = list(run.compile_s.values())
    comp = run.compile_s.get(key, max(compiles) if compiles else 5.0)
    seen = run.call_s.get(key, {})
    if not seen:
        return comp, 0.0
    below = [t for t in seen if t <= T]
    ref = max(below) if below else min(seen)
    return comp, seen[ref] * (T / ref) ** GROWTH.get(key[0], 2)


def time_bench(run: Run, b: Bench, T: int, mode: str) -> None:
    a = run.args
    label = "cudnn*" if b.extra.get("stand_in") else b.impl
    what = f"{b.op} {label} T={T} {mode}"
    key = (b.op, b.impl, mode)
    comp_est, call_est = _predict(run, key, T)
    loop_est = min(a.row_max_s, max(call_est, MIN_SAMPLE_S) * (a.repeats + 1)) if call_est else 0
    need = comp_est + call_est + loop_est
    if need > run.left():
        run.skip(what, f"would need ~{need:.0f} s (compile ~{comp_est:.0f} s, calls "
                       f"~{call_est + loop_est:.1f} s); {max(run.left(), 0):.0f} s of the budget "
                       f"left")
        return
    if a.lower_only and b.impl == "cudnn" and not run.on_gpu:
        run.skip(what, "jax.nn.dot_product_attention(implementation='cudnn') traces only where "
                       "cuDNN is (a GPU)")
        return
    if (b.impl == "cudnn" and not run.on_gpu
            and b.inputs[0].shape[0] * a.heads * T * T * 4 > 2**30):
        run.skip(what, "the XLA stand-in for cuDNN would materialise > 1 GiB of scores")
        return
    row = {"op": b.op, "impl": label, "T": T, "mode": mode, **b.extra}
    try:
        if mode == "fwd":
            fn, args = b.fn, b.inputs
        else:
            shape = jax.eval_shape(b.fn, *b.inputs)
            ct = (jax.ShapeDtypeStruct(shape.shape, jnp.float32) if a.lower_only else
                  jax.random.normal(jax.random.PRNGKey(T + 1), shape.shape, jnp.float32))
            fn, args = _fwd_bwd(b.fn, b.n_diff), (*b.inputs, ct)
        if a.lower_only:
            t0 = time.perf_counter()
            with _abstract_gpu(run), verified_triton_modules() as verified:
                text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            row.update({"lowered_s": time.perf_counter() - t0,
                        "triton_calls": text.count(f"custom_call @{TRITON_CALL}"),
                        "triton_verified": len(verified)})
            run.compile_s[key] = row["lowered_s"]
            if b.impl == "pallas_gpu" and not row["triton_calls"]:
                row["error"] = "pallas_gpu row lowered without a Triton kernel call"
            elif row["triton_verified"] != row["triton_calls"]:
                row["error"] = (f"{row['triton_calls']} Triton call(s), "
                                f"{row['triton_verified']} module(s) verified")
            print(f"  {what:<36} lowered for cuda in {row['lowered_s']:.1f} s: "
                  f"{row['triton_calls']} Triton kernel call(s), modules verified", flush=True)
            run.timing.append(row)
            run.write()
            return
        compiled, comp_s, alloc = _compile(run, fn, *args)
        run.compile_s[key] = comp_s
        free = _free_device_bytes()
        if alloc is not None and free is not None and alloc > 0.9 * free:
            run.skip(what, f"needs {alloc / 2**30:.1f} GiB of temporaries and outputs, "
                           f"{free / 2**30:.1f} GiB free")
            return
        repeats = a.repeats if run.left() > 2 * a.row_max_s else 1
        sec, note = _time(compiled, args, repeats, a.row_max_s,
                          MIN_SAMPLE_S if run.on_gpu and not a.tiny else 0.0)
        run.call_s.setdefault(key, {})[T] = sec
        flops = b.flops[0] + (b.flops[1] if mode != "fwd" else 0)
        nbytes = b.nbytes[0] + (b.nbytes[1] if mode != "fwd" else 0)
        row.update({"seconds": sec, "timing": note, "compile_s": comp_s, "flops": flops,
                    "bytes": nbytes, "flop_per_s": flops / sec, "bytes_per_s": nbytes / sec})
        print(f"  {what:<36} {sec * 1e3:10.3f} ms  {flops / sec / 1e12:8.3f} TFLOP/s  "
              f"{nbytes / sec / 1e9:9.1f} GB/s  (compile {comp_s:.1f} s; {note})", flush=True)
    except Exception as exc:
        traceback.print_exc(limit=3)
        row.update({"error": _first_line(exc)})
        print(f"  ERROR {what}: {row['error']}", flush=True)
    run.timing.append(row)
    add_ratios(run.timing)
    run.write()


def _abstract_gpu(run: Run):
    """Where lowering for cuda happens without a GPU: JAX >= 0.11 lowers a Triton kernel for the
    GPU it will run on (its compute capability), read from the context mesh's abstract device
    when there is no GPU, so lower under a one-device abstract mesh of an H200 (JAX 0.10 does not
    ask). On a GPU: nothing."""
    if run.on_gpu:
        return contextlib.nullcontext()
    try:
        device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                             platform="gpu")
        mesh = jax.sharding.AbstractMesh((1,), ("bench_gpu",), (jax.sharding.AxisType.Auto,),
                                         abstract_device=device)
        return jax.sharding.use_abstract_mesh(mesh)
    except (AttributeError, TypeError):  # a JAX without abstract devices needs none
        return contextlib.nullcontext()


def add_ratios(rows: list[dict]) -> None:
    """vs cuDNN: cuDNN's time for the same T and mode (its sliding window for `window`, dense
    causal attention for every other op) over this row's; vs XLA: the same op's XLA path."""
    t = {(r["op"], r["impl"].rstrip("*"), r["T"], r["mode"]): r["seconds"]
         for r in rows if "seconds" in r}
    for r in rows:
        if "seconds" not in r:
            continue
        base = "window" if r["op"] == "window" else "flash"
        cud = t.get((base, "cudnn", r["T"], r["mode"]))
        xla = t.get((r["op"], "xla", r["T"], r["mode"]))
        r["vs_cudnn"] = cud / r["seconds"] if cud else None
        r["vs_cudnn_of"] = f"{base} cudnn" if cud else None
        r["vs_xla"] = xla / r["seconds"] if xla and r["impl"] != "xla" else None


def run_timing(run: Run) -> None:
    a = run.args
    print(f"timings (B=1, Hq={a.heads}, Hkv={a.kv_heads}, D={a.head_dim}, {a.dtype}; "
          f"lengths {a.lengths}; budget {run.left():.0f} s left):", flush=True)
    for T in parse_lengths(a.lengths):
        if run.left() < 3:
            run.skip(f"every row at T={T}", f"the budget is spent ({run.left():.0f} s left)")
            continue
        try:
            benches = benches_for_length(run, T)
        except Exception as exc:  # e.g. out of memory making the inputs
            traceback.print_exc(limit=3)
            run.skip(f"every row at T={T}", f"making the inputs failed: {_first_line(exc)}")
            continue
        for b in benches:
            for mode in a.modes:
                if mode != "fwd" and not b.n_diff:
                    continue
                time_bench(run, b, T, mode)
        del benches


def measure_peak(run: Run) -> None:
    """The machine's bf16 matmul rate and elementwise copy bandwidth, measured now."""
    n = 256 if run.args.tiny else 8192
    elems = 2**20 if run.args.tiny else 2**29
    try:
        x = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
        mm, _, _ = _compile(run, lambda x: x @ x, x)
        sec, _ = _time(mm, (x,), 5, 5.0, MIN_SAMPLE_S)
        run.peak_flops = 2 * n ** 3 / sec
        y = jax.random.normal(jax.random.PRNGKey(1), (elems,), jnp.bfloat16)
        cp, _, _ = _compile(run, lambda y: y * 2, y)
        sec, _ = _time(cp, (y,), 5, 5.0, MIN_SAMPLE_S)
        run.peak_bytes = 2 * y.size * 2 / sec
        print(f"measured peak: bf16 matmul {n}^3 {run.peak_flops / 1e12:.1f} TFLOP/s; "
              f"elementwise read+write {run.peak_bytes / 1e9:.0f} GB/s", flush=True)
    except Exception as exc:
        print(f"peak measurement failed: {_first_line(exc)}", flush=True)


# ----------------------------------------------------------------------------------------------
# Output.

def _g(x, digits=3) -> str:
    return "" if x is None else f"{x:.{digits}g}"


def write_outputs(run: Run) -> None:
    a, m = run.args, run.meta
    lines = ["# GPU kernel check: Pallas parity and timings", "",
             f"- status: {run.status}; {time.perf_counter() - run.started:.0f} s of the "
             f"{a.budget_s:.0f} s budget used",
             f"- device: {m['device']}; jax {m['jax']}, jaxlib {m['jaxlib']}, Python "
             f"{m['python']}{'; cuDNN ' + str(m['cudnn']) if m.get('cudnn') else ''}",
             f"- Pallas: {_pallas_mode(run)}"
             f"; date {m['date']}; seed {m['seed']}",
             f"- command: `{m['command']}`"]
    if run.peak_flops:
        lines.append(f"- measured in this run: bf16 matmul {run.peak_flops / 1e12:.1f} TFLOP/s, "
                     f"elementwise read+write {run.peak_bytes / 1e9:.0f} GB/s")
    if run.parity or "parity" in a.sections:
        n_pass = sum(r["pass"] for r in run.parity)
        lines += ["", f"## Parity: {n_pass} of {len(run.parity)} rows pass", "",
                  "Pallas GPU kernel (implementation=\"pallas_gpu\") against its float32 "
                  "reference, forward and gradients; relative error = ||actual - expected|| / "
                  "||expected|| per tensor, tolerances of tests/kernels.", "",
                  "| kernel | case | dtype | shape | worst tensor | rel err | max abs err | "
                  "tolerance | pass | every tensor (rel err); checks |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in run.parity:
            lines.append(f"| {r['kernel']} | {r['case']} | {r['dtype']} | {r['shape']} | "
                         f"{r['worst']} | {_fmt_e(r['rel_err'])} | {_fmt_e(r['max_abs'])} | "
                         f"{_fmt_tol(r['tol'])} | {'pass' if r['pass'] else '**FAIL**'} | "
                         f"{r['details']} |")
    if run.timing or "timing" in a.sections:
        stand_in = any(r.get("stand_in") for r in run.timing)
        lines += ["", f"## Timings: B=1, Hq={a.heads}, Hkv={a.kv_heads}, D={a.head_dim}, "
                  f"{a.dtype}; window {a.window}; NSA l={CMP_LEN}, d={CMP_STRIDE}, "
                  f"block {a.block}, n={a.n}; depth {a.depth_sources} sources x {a.depth_dim}", "",
                  "| op | impl | T | mode | ms | TFLOP/s | % of bf16 peak | GB/s | vs cuDNN | "
                  "vs XLA | timing |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        order = {o: i for i, o in enumerate(TIMED_OPS)}
        impl_order = {"pallas_gpu": 0, "cudnn": 1, "cudnn*": 1, "xla": 2}
        for r in sorted(run.timing, key=lambda r: (order.get(r["op"], 99), r["T"],
                                                   r["mode"], impl_order.get(r["impl"], 9))):
            if "error" in r:
                lines.append(f"| {r['op']} | {r['impl']} | {r['T']} | {r['mode']} | error | | | "
                             f"| | | {r['error'].replace('|', '/')} |")
                continue
            if "lowered_s" in r:
                lines.append(f"| {r['op']} | {r['impl']} | {r['T']} | {r['mode']} | lowered | | "
                             f"| | | | lowered for cuda in {r['lowered_s']:.1f} s: "
                             f"{r['triton_calls']} Triton kernel call(s), every module "
                             f"verified |")
                continue
            pct = (f"{100 * r['flop_per_s'] / run.peak_flops:.1f}" if run.peak_flops else "")
            cud = f"{r['vs_cudnn']:.2f}x" if r.get("vs_cudnn") else ""
            if cud and r["op"] not in ("flash", "window"):
                cud += " (dense)"
            xla = f"{r['vs_xla']:.2f}x" if r.get("vs_xla") else ""
            note = r["timing"]
            if "keys_actual" in r:
                note += f"; keys/query {r['keys_actual']:.0f} of nominal {r['keys_nominal']}"
            lines.append(f"| {r['op']} | {r['impl']} | {r['T']} | {r['mode']} | "
                         f"{_g(r['seconds'] * 1e3)} | {_g(r['flop_per_s'] / 1e12)} | {pct} | "
                         f"{_g(r['bytes_per_s'] / 1e9)} | {cud} | {xla} | {note} |")
        lines += ["", "vs cuDNN: cuDNN's time at the same T and mode (its sliding window for "
                  "`window`, its dense causal attention for the other ops: \"(dense)\") over "
                  "this row's; > 1 is faster. vs XLA: the same op's XLA path over this row's. "
                  "Sparse FLOPs count the keys select_blocks' selections really attend. gdn / kda: "
                  "the Pallas kernels are the sequential state pass and its backward; the "
                  "state-independent preparation and its gradient are XLA."]
        if stand_in:
            lines.append("cudnn*: no GPU, so jax.nn.dot_product_attention's XLA path stands in "
                         "for cuDNN (plumbing only).")
    if run.skipped:
        lines += ["", "## Skipped", ""] + [f"- {s['what']}: {s['reason']}" for s in run.skipped]
    run.out.parent.mkdir(parents=True, exist_ok=True)
    run.out.write_text("\n".join(lines) + "\n")
    data = {"meta": m, "status": run.status, "peak_flops": run.peak_flops,
            "peak_bytes": run.peak_bytes, "parity": run.parity, "timing": run.timing,
            "skipped": run.skipped}
    run.out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))


def _pallas_mode(run: Run) -> str:
    if run.args.lower_only:
        return "native kernels lowered for cuda only (--lower-only: nothing ran)"
    return "interpret mode (timings meaningless)" if run.pallas["interpret"] else "native"


def _fmt_tol(x) -> str:
    """A tolerance as written in the tests (1.5e-2 printed with one digit read "1e-02")."""
    return "-" if x is None else f"{x:.2g}"


def _fmt_e(x, digits=2) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.{digits}e}"


# ----------------------------------------------------------------------------------------------

def _default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "bench_gpu.md"
    return Path(__file__).resolve().parent / "bench_gpu.md"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default=None,
                    help="comma list, visited in this order (default 4k,64k,16k,8k,32k; --tiny: "
                         "128)")
    ap.add_argument("--ops", default=",".join(TIMED_OPS))
    ap.add_argument("--kernels", default=None,
                    help="parity for these kernel folders only (default: every one)")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--sections", default="parity,timing")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--block", type=int, default=None)
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--depth-sources", type=int, default=None)
    ap.add_argument("--depth-dim", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="no new work after this many seconds from the start")
    ap.add_argument("--row-max-s", type=float, default=None,
                    help="timing loop of one row at most (compilation excluded)")
    ap.add_argument("--interpret", action="store_true",
                    help="Pallas kernels in interpret mode (any backend; timings meaningless)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes: the unit tests' parity shapes and T=128 timings")
    ap.add_argument("--lower-only", action="store_true",
                    help="no GPU needed: build every timing row and lower it for cuda (the native "
                         "Pallas kernels through Triton lowering), no parity, nothing run")
    ap.add_argument("--parity-workers", type=int, default=4,
                    help="parity cases run (compile) at a time, in threads (default 4)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=None,
                    help="markdown file (default $OUT/bench_gpu.md, else eval/bench_gpu.md)")
    args = ap.parse_args(argv)
    full = dict(lengths="4k,64k,16k,8k,32k", heads=16, kv_heads=1, head_dim=128, block=64, n=16,
                window=512, depth_sources=16, depth_dim=1024, repeats=5, row_max_s=8.0)
    tiny = dict(lengths="128", heads=2, kv_heads=1, head_dim=16, block=16, n=4, window=32,
                depth_sources=4, depth_dim=32, repeats=1, row_max_s=2.0)
    for name, value in (tiny if args.tiny else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(args.ops) - set(TIMED_OPS))
    if unknown:
        ap.error(f"--ops: unknown {unknown}; choose from {','.join(TIMED_OPS)}")
    args.kernels = (pallas_gpu_kernels() if args.kernels is None
                    else [k.strip() for k in args.kernels.split(",")])
    args.modes = [m.strip() for m in args.modes.split(",")]
    if set(args.modes) - {"fwd", "fwd+bwd"}:
        ap.error("--modes: fwd and/or fwd+bwd")
    args.sections = [s.strip() for s in args.sections.split(",")]
    if args.lower_only:
        if args.interpret:
            ap.error("--lower-only lowers the native kernels; drop --interpret")
        args.sections = [s for s in args.sections if s == "timing"]
    return args


def make_run(argv: list[str], started: float | None = None) -> Run | None:
    """The run's settings and state from the command line; None (with the reason printed) when
    this machine cannot run what was asked."""
    started = time.perf_counter() if started is None else started
    args = parse_args(argv)
    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    if not on_gpu and not (args.interpret or args.lower_only):
        print(f"bench_gpu: no GPU here (JAX backend {backend!r}). The Pallas GPU kernels run "
              "natively only on a GPU; pass --interpret (with --tiny) to run this script's code "
              "paths in Pallas interpret mode, or --lower-only to lower every timing row for "
              "cuda.", file=sys.stderr)
        return None
    seed = args.seed if args.seed is not None else int(np.random.default_rng().integers(2**31))
    d = jax.devices()[0]
    meta = {"device": f"{d.device_kind} ({backend}, {jax.device_count()} device(s))",
            "jax": jax.__version__, "jaxlib": _jaxlib_version(),
            "python": platform.python_version(),
            "cudnn": _cudnn_version() if on_gpu else None, "seed": seed,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([_INVOKED] + argv)}
    return Run(args=args, on_gpu=on_gpu,
               pallas={"implementation": "pallas_gpu", "interpret": bool(args.interpret)},
               deadline=started + args.budget_s, started=started,
               out=Path(args.out) if args.out else _default_out(), meta=meta)


def main(argv=None) -> int:
    started = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    run = make_run(argv, started)
    if run is None:
        return 2
    args = run.args
    print(f"device: {run.meta['device']}; jax {run.meta['jax']}; writing {run.out}", flush=True)
    if args.lower_only:
        print("--lower-only: every timing row is lowered for cuda, nothing runs (no parity, no "
              "timings)", flush=True)
    else:
        measure_peak(run)
    if "parity" in args.sections:
        run_parity(run)
    if "timing" in args.sections:
        run_timing(run)
    run.status = "complete" + (f", {len(run.skipped)} item(s) skipped" if run.skipped else "")
    run.write()
    print(run.out.read_text())
    failed = [r for r in run.parity if not r["pass"]]
    errors = [r for r in run.timing if "error" in r]
    print(f"wrote {run.out} and {run.out.with_suffix('.json')}; parity: "
          f"{len(run.parity) - len(failed)} of {len(run.parity)} pass; timing rows: "
          f"{len(run.timing) - len(errors)} measured, {len(errors)} errors, "
          f"{len(run.skipped)} skipped; {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if failed or (args.lower_only and errors) else 0


def _jaxlib_version() -> str:
    try:
        import jaxlib
        return getattr(jaxlib, "__version__", None) or jaxlib.version.__version__
    except Exception:
        return "?"


def _cudnn_version():
    try:
        from jax._src.lib import cuda_versions
        return cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
