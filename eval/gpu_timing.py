"""The timing rows of eval/bench_gpu.py: each op at each length, forward and forward+backward,
for the Pallas GPU kernel, the XLA path and cuDNN, with the compile and timing helpers both the
parity cases and the timings use.

``benches_for_length(run, T)`` builds one length's rows (inputs, FLOP and byte counts);
``time_bench`` compiles (never timed), checks the budget against a prediction from the rows
already timed, and times a row (or, with --lower-only, lowers it for cuda and verifies its Triton
modules); ``add_ratios`` fills the vs-cuDNN and vs-XLA columns. ``run`` is bench_gpu.Run (its
args, budget, rows and output).

Its own module so that bench_gpu.py keeps to running and reporting. Like bench_gpu.py it imports
JAX, NumPy and the kernels only (never grain, datasets or the trainer): the GPU machine has nothing
else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
import traceback
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from aiinfra_jax.eval.bench_kernels import (CMP_LEN, CMP_STRIDE, attended_keys, nsa_selection,
                                            parse_lengths)
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

if TYPE_CHECKING:
    from aiinfra_jax.eval.bench_gpu import Run

TIMED_OPS = ("flash", "window", "compressed", "sparse", "select", "gdn", "kda", "depth")
# How each op's time grows with T (for predicting a row from the same row at another length).
GROWTH = {"flash": 2, "window": 1, "compressed": 2, "sparse": 1, "select": 2, "gdn": 1, "kda": 1,
          "depth": 1}
DEPTH_QUERIES = 2
MIN_SAMPLE_S = 0.02   # one timing sample lasts at least this long (back-to-back calls)


_FAST_COMPILE: list = []   # [options or None], probed once


def compile_options(run_or_args) -> dict | None:
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


def compile_aot(run: Run, fn, *args):
    """AOT compile (never timed). Returns (compiled, seconds, bytes it allocates or None)."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    opts = compile_options(run)
    compiled = lowered.compile(opts) if opts else lowered.compile()
    seconds = time.perf_counter() - t0
    need = None
    try:
        mem = compiled.memory_analysis()
        need = int(mem.temp_size_in_bytes) + int(mem.output_size_in_bytes)
    except Exception:  # not every backend reports it
        pass
    return compiled, seconds, need


def free_device_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
        return int(stats["bytes_limit"]) - int(stats["bytes_in_use"])
    except Exception:  # the CPU reports nothing
        return None


def time_call(fn, args, repeats: int, row_max_s: float, min_sample_s: float):
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



def first_line(exc: BaseException) -> str:
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
        compiled, comp_s, alloc = compile_aot(run, fn, *args)
        run.compile_s[key] = comp_s
        free = free_device_bytes()
        if alloc is not None and free is not None and alloc > 0.9 * free:
            run.skip(what, f"needs {alloc / 2**30:.1f} GiB of temporaries and outputs, "
                           f"{free / 2**30:.1f} GiB free")
            return
        repeats = a.repeats if run.left() > 2 * a.row_max_s else 1
        sec, note = time_call(compiled, args, repeats, a.row_max_s,
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
        row.update({"error": first_line(exc)})
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
            run.skip(f"every row at T={T}", f"making the inputs failed: {first_line(exc)}")
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
        mm, _, _ = compile_aot(run, lambda x: x @ x, x)
        sec, _ = time_call(mm, (x,), 5, 5.0, MIN_SAMPLE_S)
        run.peak_flops = 2 * n ** 3 / sec
        y = jax.random.normal(jax.random.PRNGKey(1), (elems,), jnp.bfloat16)
        cp, _, _ = compile_aot(run, lambda y: y * 2, y)
        sec, _ = time_call(cp, (y,), 5, 5.0, MIN_SAMPLE_S)
        run.peak_bytes = 2 * y.size * 2 / sec
        print(f"measured peak: bf16 matmul {n}^3 {run.peak_flops / 1e12:.1f} TFLOP/s; "
              f"elementwise read+write {run.peak_bytes / 1e9:.0f} GB/s", flush=True)
    except Exception as exc:
        print(f"peak measurement failed: {first_line(exc)}", flush=True)
