"""Kernel microbenchmark: each op x implementation x sequence length, forward and forward+backward.

    python -m aiinfra_jax.eval.bench_kernels [--lengths 4k,8k,16k,32k] [--impls auto]
        [--ops sparse,window,compressed,select] [--heads 16 --kv-heads 1 --head-dim 128]
        [--block 64 --n 16] [--dtype float32] [--repeats 3] [--out-dir runs/bench_kernels]
    make bench-kernels ARGS="--lengths 4k,8k"

Ops, at NSA's default shapes (one GQA group of 16 query heads over 1 KV head, block 64, n = 16):
  sparse      sparse_attention over the n blocks per query that this library's own select_blocks
              picks (kernels/block_selection) from real compressed scores of the random q / k: the
              keys are compressed (windows of l=32 every d=16 raw keys, summed / sqrt(l): a
              parameter-free stand-in for NSA's learned compression), the compressed branch's lse
              comes from flash_attention, and select_blocks ranks the blocks (the first block and
              the query's own two forced, no duplicate blocks). Early queries have fewer than n
              blocks to pick from and their own block is partly in the future, so fewer keys are
              attended than the nominal n * block: both are printed, and sparse rows count FLOPs,
              FLOP/s and the FLOP ratio from the keys actually attended.
  window      flash_attention with a sliding window of 512 keys (NSA's window branch)
  compressed  flash_attention over the T/16 compressed keys above with the compressed-causal mask
  select      select_blocks (scores from q, the compressed keys and lse; top-n), forward only
  gdn, kda    gated_delta_rule, chunkwise (H = HV = --heads value and query/key heads, K = V =
              --head-dim, L2-normalised q/k, log-decays logsigmoid(N(0,1))/16, beta sigmoid(N);
              fwd+bwd differentiates q, k, v, g and beta, as a training step does);
              gdn_rec / kda_rec: the same through the step-by-step float32 recurrence
              (kernels/gated_delta/reference.py), the baseline of the chunked form's speed-up
              (`recurrent_speedup` on the chunked rows). Their speed-up over dense causal
              attention is read against dense_* with --kv-heads = --heads (no GQA), the shape
              whose arithmetic matches.
  dense_*     the baseline: dense causal attention, as jax.nn.dot_product_attention (dense_sdpa, only
              while its [B,H,T,T] float32 score matrix fits in --dense-materialise-gb), as this
              library's chunked flash_attention with a causal mask (dense_flash), and, when torch
              is importable (the optional `bench` extra), as torch's
              scaled_dot_product_attention on the same inputs (dense_torch; --no-torch skips it);
              the fastest at each T and mode is the baseline of the speed-ups, and each row names
              it. Every ratio comes from this one invocation (both sides under the same load):
              when --ops names other ops but no dense one, the dense baseline is added (say
              --no-dense-baseline to skip it; the rows then carry no ratio).

A program whose compiled temporaries exceed --max-temp-gb (default 60% of the host's memory) is
not run, and results.md lists it: the recurrence's backward keeps one [H, K, V] state per step
(16 heads of 128 at 16K: ~38 GiB).

Reported per row: median time over --repeats timed calls after a warm-up call (calls longer than
--long-call-s are timed once after compilation, and the row says so), achieved FLOP/s and bytes/s
against the op's own FLOP and byte counts (kernels' *_flops / *_bytes helpers), the fraction of the
machine's matmul peak measured at the start of the run (matmul_peak), the speed-up over the
dense baseline at the same T, and the FLOP ratio (the limit a compute-bound kernel can reach). Writes
results.json, results.md and time_vs_length.png to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from aiinfra_jax.kernels.block_selection import select_blocks
from aiinfra_jax.kernels.gated_delta import gated_delta_rule, gated_delta_rule_reference
from aiinfra_jax.kernels.gated_delta.cost import gated_delta_bytes, gated_delta_flops
from aiinfra_jax.kernels.flash_attention import (AttentionMask, flash_attention,
                                                 flash_attention_bytes, flash_attention_flops)
from aiinfra_jax.kernels.sparse_attention import (sparse_attention, sparse_attention_bytes,
                                                  sparse_attention_flops)

WINDOW = 512
CMP_LEN, CMP_STRIDE = 32, 16


def parse_lengths(text: str) -> list[int]:
    out = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        out.append(int(float(tok[:-1]) * 1024) if tok.endswith("k") else int(tok))
    return out


def compress_keys(x: jax.Array, cmp_len: int = CMP_LEN, cmp_stride: int = CMP_STRIDE
                  ) -> jax.Array:
    """[B, S, H, D] -> [B, Sc, H, D], Sc = (S - l) // d + 1: compressed token i is the sum of raw
    rows [i*d, i*d + l) over sqrt(l) (unit variance for unit-variance rows; a parameter-free
    stand-in for NSA's learned compression MLP). Window sums from one float32 cumulative sum."""
    S = x.shape[1]
    sc = max((S - cmp_len) // cmp_stride + 1, 1)
    cs = jnp.cumsum(jnp.pad(x.astype(jnp.float32), ((0, 0), (1, 0), (0, 0), (0, 0))), axis=1)
    starts = jnp.arange(sc) * cmp_stride
    ends = jnp.minimum(starts + cmp_len, S)
    return ((cs[:, ends] - cs[:, starts]) * cmp_len ** -0.5).astype(x.dtype)


def nsa_selection(q, k, v, *, block: int, n: int, cmp_len: int = CMP_LEN,
                  cmp_stride: int = CMP_STRIDE, implementation: str | None = "xla",
                  interpret: bool = False):
    """NSA's selection for random q, k, v, made by this library's kernels: compressed keys and
    values (compress_keys), the compressed branch's lse (flash_attention with the
    compressed-causal mask) and select_blocks' top-n blocks (the first block and the query's own
    two forced; ascending, no duplicates, -1 where a query has fewer than n candidate blocks).
    Returns (block_indices [B, T, Hkv, n] int32, k_cmp, v_cmp, lse [B, T, Hq] float32)."""
    T = k.shape[1]
    n_init = min(1, n)
    n_local = min(2, n - n_init)
    mask = AttentionMask(causal=False, compressed=(cmp_len, cmp_stride))

    @jax.jit
    def go(q, k, v):
        kc, vc = compress_keys(k, cmp_len, cmp_stride), compress_keys(v, cmp_len, cmp_stride)
        _, lse = flash_attention(q, kc, vc, mask=mask, return_lse=True,
                                 implementation=implementation, interpret=interpret)
        idx = select_blocks(q, kc, lse, seq_len=T, cmp_block_len=cmp_len, cmp_stride=cmp_stride,
                            block_size=block, n_selected=n, n_init=n_init, n_local=n_local,
                            implementation=implementation, interpret=interpret)
        return idx, kc, vc, lse

    return go(q, k, v)


def attended_keys(block_indices, block: int) -> tuple[np.ndarray, int]:
    """(keys [B, T, Hkv] each query attends with each KV head, duplicate block entries): the
    causally visible keys (positions <= t) of the distinct blocks listed, as sparse_attention
    counts them (a repeated block once, -1 nothing)."""
    idx = np.sort(np.asarray(block_indices), axis=-1)
    dup = np.zeros(idx.shape, bool)
    dup[..., 1:] = (idx[..., 1:] == idx[..., :-1]) & (idx[..., 1:] >= 0)
    t = np.arange(idx.shape[1])[None, :, None, None]
    keys = np.where((idx >= 0) & ~dup, np.clip(t - idx * block + 1, 0, block), 0)
    return keys.sum(-1), int(dup.sum())


def _time(fn, args, repeats: int, long_call_s: float) -> tuple[float, int, str]:
    """(median seconds, timed calls, note). fn is AOT-compiled, so compilation is never timed;
    a synchronous host callable (torch) returning None is timed the same way."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    if first > long_call_s:
        return first, 1, "1 call (long)"
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), repeats, f"median of {repeats}"


def _host_memory_gib() -> float:
    """Physical memory of this host in GiB (64 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 64.0


def matmul_peak(dtype, repeats: int = 5) -> float:
    """The machine's measured matmul FLOP/s in `dtype` through XLA: the best of square products
    of 1024 and 2048 (the reference for the "% peak" column; 4096 measured no higher here)."""
    best = 0.0
    for n in (1024, 2048):
        a = jax.random.normal(jax.random.PRNGKey(n), (n, n), dtype)
        f = jax.jit(lambda a: a @ a).lower(a).compile()
        jax.block_until_ready(f(a))
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(a))
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def torch_sdpa():
    """torch.nn.functional.scaled_dot_product_attention when torch is importable (the optional
    `bench` extra), else None: the dense baseline a researcher on a CPU would reach for."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _torch_dense_rows(torch, q, k, v, ct, run_host):
    """Causal torch SDPA forward and forward+backward on the same inputs ([B,H,T,D] copies)."""
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}[str(q.dtype)]

    def to_torch(x):
        x = torch.from_numpy(np.array(x, np.float32))  # a writable copy
        return x.to(tdt).permute(0, 2, 1, 3).contiguous()

    tq, tk, tv, tct = (to_torch(x) for x in (q, k, v, ct))
    gqa = q.shape[2] != k.shape[2]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fwd():
        with torch.no_grad():
            sdpa(tq, tk, tv, is_causal=True, enable_gqa=gqa)

    leaves = [x.detach().clone().requires_grad_(True) for x in (tq, tk, tv)]

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        o = sdpa(*leaves, is_causal=True, enable_gqa=gqa)
        o.backward(tct.to(o.dtype))

    run_host("fwd", fwd)
    run_host("fwd+bwd", fwd_bwd)


def _compile(f, *args):
    compiled = jax.jit(f).lower(*args).compile()
    try:
        mem = compiled.memory_analysis()
        temp = int(getattr(mem, "temp_size_in_bytes", 0))
    except Exception:  # not every backend reports it
        temp = -1
    return compiled, temp


def _fwd_bwd(attn, n_diff: int = 3):
    """Gradients for the first n_diff arguments (q, k, v; gated delta: also g and beta, which a
    training step differentiates too); the others before the cotangent are inputs without
    gradients."""
    def loss(q, k, v, *rest):
        return jnp.sum(attn(q, k, v, *rest[:-1]).astype(jnp.float32) * rest[-1])
    return jax.grad(loss, argnums=tuple(range(n_diff)))


def bench_length(T: int, args, impl: str | None) -> list[dict]:
    B, H, Hkv, D = 1, args.heads, args.kv_heads, args.head_dim
    dt = jnp.dtype(args.dtype)
    key = jax.random.PRNGKey(T)
    kq, kk, kv, kc, kcc = jax.random.split(key, 5)
    q = jax.random.normal(kq, (B, T, H, D), dt)
    k = jax.random.normal(kk, (B, T, Hkv, D), dt)
    v = jax.random.normal(kv, (B, T, Hkv, D), dt)
    ct = jax.random.normal(kc, (B, T, H, D), jnp.float32)
    rows = []
    skipped = args.skipped

    def run(op: str, attn, flops_f, flops_b, bytes_f, bytes_b, baseline_note="", kv=(k, v),
            actual=None, extra=None, n_diff=3):
        """Times fwd and fwd+bwd. actual: (forward, backward) FLOPs of the work really done when
        it is below the nominal count (sparse: the keys actually attended); FLOP/s and the FLOP
        ratio then use it. extra: fields copied into both rows."""
        for mode in ("fwd", "fwd+bwd"):
            call_args = (q, *kv) if mode == "fwd" else (q, *kv, ct)
            fn, temp = _compile(attn if mode == "fwd" else _fwd_bwd(attn, n_diff), *call_args)
            if temp > args.max_temp_gb * 2**30:
                why = (f"{op} {mode} at T={T}: not run, its compiled program needs "
                       f"{temp / 2**30:.1f} GiB of temporaries (--max-temp-gb "
                       f"{args.max_temp_gb:g})")
                print(f"  {why}", flush=True)
                skipped.append(why)
                continue
            sec, calls, note = _time(fn, call_args, args.repeats, args.long_call_s)
            flops = flops_f if mode == "fwd" else flops_f + flops_b
            nbytes = bytes_f if mode == "fwd" else bytes_f + bytes_b
            row = {"op": op, "impl": impl or "auto", "T": T, "mode": mode, "seconds": sec,
                   "timing": note, "flops": flops, "bytes": nbytes, "bytes_per_s": nbytes / sec,
                   "temp_bytes": temp, "baseline": baseline_note, **(extra or {})}
            if actual is not None:
                row["flops_actual"] = actual[0] if mode == "fwd" else actual[0] + actual[1]
            row["flop_per_s"] = row.get("flops_actual", flops) / sec
            rows.append(row)
            print(f"  T={T:>6} {op:<11} {mode:<8} {sec * 1e3:10.1f} ms  "
                  f"{row['flop_per_s'] / 1e9:8.1f} GFLOP/s  temp {temp / 2**20:8.1f} MiB  "
                  f"({note})", flush=True)

    def run_host(op, mode, fn, flops, nbytes, baseline_note):
        sec, calls, note = _time(fn, (), args.repeats, args.long_call_s)
        rows.append({"op": op, "impl": "torch", "T": T, "mode": mode, "seconds": sec,
                     "timing": note, "flops": flops, "bytes": nbytes, "bytes_per_s": nbytes / sec,
                     "temp_bytes": -1, "baseline": baseline_note, "flop_per_s": flops / sec})
        print(f"  T={T:>6} {op:<11} {mode:<8} {sec * 1e3:10.1f} ms  {flops / sec / 1e9:8.1f} "
              f"GFLOP/s  ({note})", flush=True)

    # dense causal baseline
    causal = AttentionMask(causal=True)
    dense_ff = flash_attention_flops(B, T, T, H, D, D, causal)
    dense_fb = flash_attention_flops(B, T, T, H, D, D, causal, backward=True)
    dense_bf = flash_attention_bytes(B, T, T, H, Hkv, D, D, dtype=dt)
    dense_bb = flash_attention_bytes(B, T, T, H, Hkv, D, D, dtype=dt, backward=True)
    if "dense" in args.ops:
        # Both dense candidates where the score matrix fits; only the chunked one beyond that.
        # The faster of the two (per mode) is the baseline for the ratios.
        if B * H * T * T * 4 / 2**30 <= args.dense_materialise_gb:
            run("dense_sdpa", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                dense_ff, dense_fb, dense_bf, dense_bb, "jax.nn.dot_product_attention")
        run("dense_flash",
            lambda q, k, v: flash_attention(q, k, v, mask=causal, implementation=impl),
            dense_ff, dense_fb, dense_bf, dense_bb, "flash_attention(causal)")
        torch = None if args.no_torch else torch_sdpa()
        if torch is not None:
            _torch_dense_rows(torch, q, k, v, ct, lambda mode, fn: run_host(
                "dense_torch", mode, fn, dense_ff if mode == "fwd" else dense_ff + dense_fb,
                dense_bf if mode == "fwd" else dense_bf + dense_bb, "torch SDPA"))

    # NSA's compressed keys, the compressed branch's lse and select_blocks' selections, made once
    # per T from the random q / k / v (the XLA path: the selection is an input here, not timed).
    mc = AttentionMask(causal=False, compressed=(CMP_LEN, CMP_STRIDE))
    if any(op in args.ops for op in ("sparse", "compressed", "select")):
        idx, kcmp, vcmp, lse = nsa_selection(q, k, v, block=args.block, n=args.n,
                                             implementation="xla")
        Sc = kcmp.shape[1]

    if "sparse" in args.ops:
        keys, dups = attended_keys(idx, args.block)
        nominal = args.n * args.block
        mean_keys = float(keys.mean())
        print(f"  T={T:>6} sparse selection: select_blocks on compressed scores (l={CMP_LEN}, "
              f"d={CMP_STRIDE}) of random q/k, n={args.n} blocks of {args.block}: nominal "
              f"{nominal} keys/query, actual mean {mean_keys:.1f} (min {int(keys.min())}, max "
              f"{int(keys.max())}) = {100 * mean_keys / nominal:.1f}% of nominal; duplicate "
              f"blocks {dups}", flush=True)
        attended = int(keys.sum()) * (H // Hkv)           # (query, head, key) triples, all heads
        attn = lambda q, k, v: sparse_attention(q, k, v, idx, block_size=args.block,
                                                implementation=impl)
        run("sparse", attn,
            sparse_attention_flops(B, T, H, D, D, args.n, args.block),
            sparse_attention_flops(B, T, H, D, D, args.n, args.block, backward=True),
            sparse_attention_bytes(B, T, H, D, D, args.n, args.block, Hkv=Hkv,
                                   itemsize=dt.itemsize),
            sparse_attention_bytes(B, T, H, D, D, args.n, args.block, backward=True, Hkv=Hkv,
                                   itemsize=dt.itemsize),
            actual=(2 * attended * (D + D), 2 * attended * (3 * D + 2 * D)),
            extra={"keys_nominal": nominal, "keys_actual": mean_keys,
                   "keys_actual_min": int(keys.min()), "duplicate_blocks": dups})

    if "window" in args.ops:
        m = AttentionMask(causal=True, window=WINDOW)
        attn = lambda q, k, v: flash_attention(q, k, v, mask=m, implementation=impl)
        run("window", attn, flash_attention_flops(B, T, T, H, D, D, m),
            flash_attention_flops(B, T, T, H, D, D, m, backward=True),
            flash_attention_bytes(B, T, T, H, Hkv, D, D, dtype=dt),
            flash_attention_bytes(B, T, T, H, Hkv, D, D, dtype=dt, backward=True))

    if "compressed" in args.ops:
        attn = lambda q, k, v: flash_attention(q, k, v, mask=mc, implementation=impl)
        run("compressed", attn, flash_attention_flops(B, T, Sc, H, D, D, mc),
            flash_attention_flops(B, T, Sc, H, D, D, mc, backward=True),
            flash_attention_bytes(B, T, Sc, H, Hkv, D, D, dtype=dt),
            flash_attention_bytes(B, T, Sc, H, Hkv, D, D, dtype=dt, backward=True),
            kv=(kcmp, vcmp))

    if "select" in args.ops:
        sel = lambda q, kc, lse: select_blocks(q, kc, lse, seq_len=T, cmp_block_len=CMP_LEN,
                                               cmp_stride=CMP_STRIDE, block_size=args.block,
                                               n_selected=args.n, n_init=min(1, args.n),
                                               n_local=min(2, args.n - min(1, args.n)),
                                               implementation=impl)
        fn, temp = _compile(sel, q, kcmp, lse)
        sec, calls, note = _time(fn, (q, kcmp, lse), args.repeats, args.long_call_s)
        flops = flash_attention_flops(B, T, Sc, H, D, 0, mc)  # q.k_cmp recompute
        nbytes = (q.size + kcmp.size) * dt.itemsize + lse.size * 4 + B * T * Hkv * args.n * 4
        rows.append({"op": "select", "impl": impl or "auto", "T": T, "mode": "fwd",
                     "seconds": sec, "timing": note, "flops": flops, "bytes": nbytes,
                     "flop_per_s": flops / sec, "bytes_per_s": nbytes / sec, "temp_bytes": temp,
                     "baseline": ""})
        print(f"  T={T:>6} {'select':<11} {'fwd':<8} {sec * 1e3:10.1f} ms  ({note})", flush=True)

    for op in ("gdn", "kda", "gdn_rec", "kda_rec"):
        if op in args.ops:
            _bench_gated_delta(op, T, args, impl, run_gd=run, rng_key=kcc)

    # ratios against the fastest dense baseline of the same T and mode
    dense = {}
    for r in rows:
        if r["op"].startswith("dense") and (r["mode"] not in dense
                                            or r["seconds"] < dense[r["mode"]]["seconds"]):
            dense[r["mode"]] = r
    rec = {(r["op"].removesuffix("_rec"), r["mode"]): r for r in rows if r["op"].endswith("_rec")}
    for r in rows:
        base = rec.get((r["op"], r["mode"]))
        if base:
            r["recurrent_speedup"] = base["seconds"] / r["seconds"]
    for r in rows:
        t = next((x for x in rows if x["op"] == "dense_torch" and x["mode"] == r["mode"]), None)
        if t and r["op"] == "dense_flash":
            r["vs_torch"] = r["seconds"] / t["seconds"]
    for r in rows:
        d = dense.get(r["mode"])
        if d and not r["op"].startswith("dense"):
            r["baseline"] = d["baseline"]
            r["speedup_vs_dense"] = d["seconds"] / r["seconds"]
            work = r.get("flops_actual", r["flops"])
            r["flop_ratio_vs_dense"] = d["flops"] / work if work else None
    return rows


def _bench_gated_delta(op: str, T: int, args, impl: str | None, *, run_gd, rng_key) -> None:
    """One gated-delta row pair (fwd, fwd+bwd) through bench_length's `run`: q/k/v vary, g and
    beta are inputs drawn here, passed as arguments (closed over, they became constants whose
    cumulative sums XLA folded at compile time: 30 s per KDA program at 2K)."""
    B, H, D = 1, args.heads, args.head_dim
    kda = op.startswith("kda")
    kg, kb, kq, kk, kv = jax.random.split(rng_key, 5)
    g_shape = (B, T, H, D) if kda else (B, T, H)
    g = jax.nn.log_sigmoid(jax.random.normal(kg, g_shape, jnp.float32)) / 16
    beta = jax.nn.sigmoid(jax.random.normal(kb, (B, T, H), jnp.float32))
    dt = jnp.dtype(args.dtype)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    kd = unit(jax.random.normal(kk, (B, T, H, D), jnp.float32)).astype(dt)
    vd = jax.random.normal(kv, (B, T, H, D), dt)
    if op.endswith("_rec"):
        attn = lambda q, k, v, g, beta: gated_delta_rule_reference(unit(q), k, v, g, beta)[0]
    else:
        attn = lambda q, k, v, g, beta: gated_delta_rule(unit(q), k, v, g, beta,
                                                         implementation=impl)
    if op.endswith("_rec"):  # per token and head: read k^T S, write the update, read q^T S
        flops = [6.0 * B * T * H * D * D * (2 if bw else 1) for bw in (False, True)]
    else:
        flops = [gated_delta_flops(B, T, H, H, D, D, per_channel=kda, backward=bw)
                 for bw in (False, True)]
    nbytes = [gated_delta_bytes(B, T, H, H, D, D, itemsize=dt.itemsize, per_channel=kda,
                                backward=bw) for bw in (False, True)]
    run_gd(op, attn, *flops, *nbytes, kv=(kd, vd, g, beta), n_diff=5)


def write_outputs(rows: list[dict], meta: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"Device: {meta['device']}; dtype {meta['dtype']}; B=1, Hq={meta['heads']}, "
             f"Hkv={meta['kv_heads']}, D={meta['head_dim']}, block {meta['block']}, "
             f"n={meta['n']}; measured matmul peak "
             f"{meta['matmul_peak_flop_per_s'] / 1e9:.1f} GFLOP/s; {meta['date']}", "",
             "| op | T | mode | time (ms) | GFLOP/s | % peak | GB/s | temp MiB | "
             "speed-up vs dense | FLOP ratio | flash / torch | vs recurrence | "
             "keys/query actual (nominal) | timing |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        su = f"{r['speedup_vs_dense']:.2f}x" if r.get("speedup_vs_dense") else ""
        fr = f"{r['flop_ratio_vs_dense']:.1f}x" if r.get("flop_ratio_vs_dense") else ""
        op = r["op"] + (f" (vs {r['baseline']})" if r.get("speedup_vs_dense") else "")
        rec = f"{r['recurrent_speedup']:.1f}x" if r.get("recurrent_speedup") else ""
        keys = (f"{r['keys_actual']:.0f} ({r['keys_nominal']})" if "keys_actual" in r else "")
        vt = f"{r['vs_torch']:.2f}x" if r.get("vs_torch") else ""
        temp = f"{r['temp_bytes'] / 2**20:.0f}" if r["temp_bytes"] >= 0 else ""
        lines.append(f"| {op} | {r['T']} | {r['mode']} | {r['seconds'] * 1e3:.1f} | "
                     f"{r['flop_per_s'] / 1e9:.1f} | {100 * r['peak_fraction']:.0f}% | "
                     f"{r['bytes_per_s'] / 1e9:.2f} | {temp} | {su} | {fr} | {vt} | {rec} | "
                     f"{keys} | {r['timing']} |")
    lines += ["", "Ratios: each row against the fastest dense baseline of the same T and mode "
              "(torch SDPA included when torch is importable), measured in this invocation; "
              "flash / torch: dense_flash's time over torch SDPA's (below 1: flash is "
              "faster). Sparse rows count FLOPs (GFLOP/s, FLOP ratio) from the keys actually "
              "attended under select_blocks' selections, not the nominal n * block."]
    lines += [f"Not run: {why}." for why in meta.get("skipped", [])]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for op in sorted({r["op"] for r in rows}):
            for mode, style in (("fwd", "-o"), ("fwd+bwd", "--s")):
                pts = sorted((r["T"], r["seconds"]) for r in rows
                             if r["op"] == op and r["mode"] == mode)
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{op} {mode}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("seconds")
        ax.set_title(f"kernels on {meta['device']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "time_vs_length.png", dpi=120)
        plt.close(fig)
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4k,8k,16k,32k")
    ap.add_argument("--ops", default="dense,sparse,window,compressed,select")
    # (dense = both dense baselines)
    ap.add_argument("--impls", default="auto",
                    help="comma list of auto,xla,pallas_gpu,pallas_tpu")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-call-s", type=float, default=10.0)
    ap.add_argument("--dense-materialise-gb", type=float, default=1.0)
    ap.add_argument("--max-temp-gb", type=float, default=0.6 * _host_memory_gib(),
                    help="skip (and list) a program whose compiled temporaries exceed this "
                    "(default: 60%% of the host's memory), e.g. the recurrence's backward, "
                    "which keeps one state per step")
    ap.add_argument("--no-dense-baseline", action="store_true",
                    help="do not add the dense baseline when --ops names none (no ratios then)")
    ap.add_argument("--no-torch", action="store_true",
                    help="skip torch's scaled_dot_product_attention even when torch is importable")
    ap.add_argument("--out-dir", default="runs/bench_kernels")
    args = ap.parse_args(argv)
    args.skipped = []
    args.ops = [o.strip() for o in args.ops.split(",")]
    rated = [o for o in args.ops if o != "dense"]
    if rated and "dense" not in args.ops:
        if args.no_dense_baseline:
            print("no dense baseline (--no-dense-baseline): rows carry no speed-up ratio",
                  flush=True)
        else:
            print("adding the dense baseline, so that every ratio comes from this invocation "
                  "(--no-dense-baseline skips it)", flush=True)
            args.ops.insert(0, "dense")
    d = jax.devices()[0]
    device = f"{d.device_kind} ({jax.default_backend()}, {jax.device_count()} device(s), jax {jax.__version__})"
    print(f"device: {device}", flush=True)
    peak = matmul_peak(jnp.dtype(args.dtype))
    print(f"measured {args.dtype} matmul peak: {peak / 1e9:.1f} GFLOP/s", flush=True)
    rows = []
    for impl_name in args.impls.split(","):
        impl = None if impl_name == "auto" else impl_name
        for T in parse_lengths(args.lengths):
            rows += bench_length(T, args, impl)
    for r in rows:
        r["peak_fraction"] = r["flop_per_s"] / peak
    meta = {"device": device, "matmul_peak_flop_per_s": peak,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "dtype": args.dtype, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "block": args.block, "n": args.n,
            "skipped": args.skipped,
            "command": "python -m aiinfra_jax.eval.bench_kernels " + " ".join(argv or sys.argv[1:])}
    out = Path(args.out_dir)
    write_outputs(rows, meta, out)
    print((out / "results.md").read_text())
    print(f"wrote {out}/results.json, results.md, time_vs_length.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
