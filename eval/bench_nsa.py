"""NSA against dense attention: layer speed and memory at long context, and training quality.

    python -m aiinfra_jax.eval.bench_nsa layer [--lengths 4096,8192,16384,32768,65536] [--repeats 3]
    python -m aiinfra_jax.eval.bench_nsa quality [--steps 600] [--eval-every 100] [--match-params]
    python -m aiinfra_jax.eval.bench_nsa flops [--widths 512/8/2,2048/16/1] [--lengths ...]

layer: one NSA layer and one dense attention layer (models/attention/dense.py) of the same width,
forward, forward+backward (gradients of every parameter and of the input) and one decode step
against a cache holding T - 1 tokens, at each context length T. Medians over --repeats after a
warm-up call, each waited for. Beside each measured NSA/dense speed-up: the theoretical FLOP ratio
(flops_per_token of both modules) and, for decode, the byte ratio (cache bytes a step must read:
dense all T keys and values; NSA the compressed tokens, n selected blocks and the window). Peak
memory is the compiled program's memory_analysis (arguments + outputs + temporaries). The dense
layer runs through the chunked flash_attention kernel (model.dense.kernel="flash_attention", the
faster dense path on the CPU at every length measured); --dense-kernel auto uses
jax.nn.dot_product_attention instead where its [B,H,T,T] float32 logits fit in --dense-max-gb.
Each row names the dense attention it used. With decode, the same invocation also measures the
copy bandwidth (a jitted copy of COPY_BYTES) and prints each decode step against the time its
cache bytes take at that rate (issue 26, item 5: NSA at 16K within 1.2x of it).

--torch-nsa: also times the PyTorch NSA module a researcher would pick instead on a CPU,
lucidrains' native-sparse-attention-pytorch (`SparseAttention`, causal, the same width, heads,
l, d, l', n and window; its default compression MLP and gating; the optional `bench` extra), forward
and forward+backward on the same shapes in this invocation, and prints ours / theirs.

flops: the theoretical whole-layer forward FLOP ratio dense / NSA (flops_per_token of both
modules, nothing compiled or run) for several layer widths (d_model/heads/kv_heads) and lengths:
the ceiling on any measured forward speed-up of the layer.

quality: trains the dense and the NSA model of --config (default configs/nsa_tiny.py) on the same
data for the same steps through aiinfra_jax.train.train and reports the validation loss curves
(JSON, markdown and a PNG). --match-params widens the dense model's FFN so that both have about the
same parameter count (NSA adds per-branch K/V projections, gates and the compression MLP).

Shape letters: B batch, T context length, D d_model, H query heads, K KV heads, Dh head_dim.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.models.attention.dense import DenseAttention
from aiinfra_jax.models.attention.nsa import NSAttention, n_compressed
from aiinfra_jax.models import DenseConfig, ModelConfig, NSAConfig


def device_description() -> str:
    d = jax.devices()[0]
    if d.platform == "cpu":
        import os
        return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return f"{d.platform} ({getattr(d, 'device_kind', '?')})"


LONG_CALL_S = 20.0  # a compiled call longer than this is timed once (the warm-up call itself)


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median over `repeats` calls after a warm-up call (programs are compiled beforehand, so the
    warm-up times a real run: when it exceeds LONG_CALL_S, it is the one measurement)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())  # warm-up
    if time.perf_counter() - t0 > LONG_CALL_S:
        return time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _compile(jitted, *args):
    """(compiled program, peak bytes = arguments + outputs + temporaries, or None if the backend
    does not report them). One compilation serves both the timing and the memory figure."""
    compiled = jitted.lower(*args).compile()
    try:
        ma = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        ma = None
    if ma is None:
        return compiled, None
    total = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
             - getattr(ma, "alias_size_in_bytes", 0))
    return compiled, int(total)


COPY_BYTES = 64 * 2 ** 20


def copy_bandwidth(repeats: int = 9) -> float:
    """Bytes per second of a jitted float32 copy (x + 1, which XLA cannot elide) of COPY_BYTES
    into its own donated buffer (as a decode step updates its donated cache: a fresh output
    buffer would time the page faults of its first touch): each byte read once and written once,
    counted once. A decode step only reads its cache, so its bytes at this rate are a
    conservative floor on its time."""
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    holder = [jnp.zeros((COPY_BYTES // 4,), jnp.float32)]

    def step():
        holder[0] = f(holder[0])
        return holder[0]

    return COPY_BYTES / _median_time(step, repeats)


# Theoretical costs ------------------------------------------------------------------------------
def decode_flops(layer, context: int) -> float:
    """FLOPs of one decode step (one token) against `context` cached tokens."""
    cfg = layer.cfg
    hd = cfg.n_heads * cfg.resolved_head_dim
    if isinstance(layer, NSAttention):
        c = cfg.nsa
        one = layer.attended_keys(1)
        base = layer.flops_per_token(1) - 4.0 * hd * sum(one.values()) - 2.0 * hd * one["cmp"]
        n_cmp = max(0, (context - c.cmp_block_len) // c.cmp_stride + 1)
        keys = n_cmp + min(context, c.n_selected * c.sel_block_size) + min(context, c.window)
        return base + 4.0 * hd * keys + 2.0 * hd * n_cmp
    return layer.flops_per_token(1) - 4.0 * hd + 4.0 * hd * context


def decode_bytes(layer, context: int, itemsize: int) -> float:
    """Cache bytes one decode step must read (keys and values of every attended token)."""
    cfg = layer.cfg
    per_token = 2 * cfg.n_kv_heads * cfg.resolved_head_dim * itemsize
    if isinstance(layer, NSAttention):
        c = cfg.nsa
        n_cmp = n_compressed(context, c.cmp_block_len, c.cmp_stride)
        # compressed tokens (read by the compressed branch and the block scoring), the selected
        # blocks, the window, and the last l raw tokens to compress a finished block
        keys = (1.5 * n_cmp + min(context, c.n_selected * c.sel_block_size)
                + min(context, c.window) + c.cmp_block_len / c.cmp_stride * c.cmp_block_len)
        return keys * per_token
    return context * per_token


# Layer benchmark --------------------------------------------------------------------------------
def _layer_programs(layer, batch: int, seq: int, dtype, key):
    graphdef, state = nnx.split(layer)
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (batch, seq, layer.cfg.d_model), dtype)
    w = jax.random.normal(kw, (batch, seq, layer.cfg.d_model), dtype)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))

    def forward(state, x):
        return nnx.merge(graphdef, state)(x, positions=pos)[0]

    def loss(state, x):
        return jnp.sum(forward(state, x).astype(jnp.float32) * w)

    fwd = jax.jit(forward)
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))

    def decode(state, cache, tok_x, tok_pos):
        return nnx.merge(graphdef, state)(tok_x, positions=tok_pos, cache=cache)

    step = jax.jit(decode, donate_argnums=(1,))
    return state, x, fwd, fwd_bwd, step


def bench_layer_once(kind: str, cfg: ModelConfig, batch: int, seq: int, repeats: int,
                     do_forward: bool, do_backward: bool, do_decode: bool,
                     key) -> dict[str, Any]:
    layer_cls = NSAttention if kind == "nsa" else DenseAttention
    layer = layer_cls(cfg, rngs=nnx.Rngs(0))
    dtype = jnp.dtype(cfg.dtype)
    state, x, fwd, fwd_bwd, step = _layer_programs(layer, batch, seq, dtype, key)
    row: dict[str, Any] = {"kind": kind, "seq_len": seq}
    if do_forward:
        prog, row["forward_peak_bytes"] = _compile(fwd, state, x)
        row["forward_s"] = _median_time(lambda: prog(state, x), repeats)
    if do_backward:
        prog, row["fwd_bwd_peak_bytes"] = _compile(fwd_bwd, state, x)
        row["fwd_bwd_s"] = _median_time(lambda: prog(state, x), repeats)
    row["flops_fwd"] = batch * seq * layer.flops_per_token(seq)
    row["flops_decode"] = batch * decode_flops(layer, seq - 1)
    row["bytes_decode"] = batch * decode_bytes(layer, seq - 1, dtype.itemsize)
    if not do_decode:
        return row
    # decode: one token at position T - 1 against a cache of T slots holding T - 1 tokens
    cache = layer.init_cache(batch, seq, dtype)
    lengths = jnp.full((batch,), seq - 1, jnp.int32)
    cache = {k: (jax.random.normal(jax.random.fold_in(key, i), v.shape, v.dtype)
                 if k != "lengths" else lengths) for i, (k, v) in enumerate(cache.items())}
    tok_x = x[:, -1:]
    tok_pos = jnp.full((batch, 1), seq - 1, jnp.int32)
    prog, row["decode_peak_bytes"] = _compile(step, state, cache, tok_x, tok_pos)
    holder = {"cache": cache}

    def one_step():
        y, new_cache = prog(state, holder["cache"], tok_x, tok_pos)
        # the same position every call (a fresh array: the old one was donated)
        holder["cache"] = {**new_cache, "lengths": jnp.full((batch,), seq - 1, jnp.int32)}
        return y

    row["decode_s"] = _median_time(one_step, max(repeats, 5))
    return row


def bench_torch_nsa(cfg: ModelConfig, batch: int, seq: int, repeats: int, do_forward: bool,
                    do_backward: bool) -> dict[str, Any]:
    """lucidrains' native_sparse_attention_pytorch.SparseAttention at this layer's shapes."""
    try:
        import torch
        from native_sparse_attention_pytorch import SparseAttention
    except ImportError as e:
        raise SystemExit(f"--torch-nsa needs torch and native-sparse-attention-pytorch ({e}): "
                         "run `make install-bench` (pip install -e '.[bench]')") from e
    n = cfg.nsa
    torch.manual_seed(0)
    layer = SparseAttention(dim=cfg.d_model, dim_head=cfg.resolved_head_dim, heads=cfg.n_heads,
                            kv_heads=cfg.n_kv_heads, sliding_window_size=n.window,
                            compress_block_size=n.cmp_block_len,
                            compress_block_sliding_stride=n.cmp_stride,
                            selection_block_size=n.sel_block_size,
                            num_selected_blocks=n.n_selected, causal=True)
    x = torch.randn(batch, seq, cfg.d_model)
    w = torch.randn(batch, seq, cfg.d_model)
    row: dict[str, Any] = {"kind": "torch_nsa", "seq_len": seq,
                           "module": "native_sparse_attention_pytorch.SparseAttention"}
    if do_forward:
        def fwd():
            with torch.no_grad():
                layer(x)
        row["forward_s"] = _median_time(fwd, repeats)
    if do_backward:
        xg = x.clone().requires_grad_(True)

        def fwd_bwd():
            layer.zero_grad(set_to_none=True)
            xg.grad = None
            (layer(xg) * w).sum().backward()
        row["fwd_bwd_s"] = _median_time(fwd_bwd, repeats)
    return row


def _nsa_config(spec: str, implementation=None) -> NSAConfig:
    names = ("cmp_block_len", "cmp_stride", "sel_block_size", "n_selected", "window")
    return NSAConfig(**dict(zip(names, (int(v) for v in spec.split(",")))),
                     implementation=implementation)


def run_flops(args) -> dict[str, Any]:
    lengths = [int(v) for v in args.lengths.split(",")]
    nsa = _nsa_config(args.nsa)
    rows = []
    for width in args.widths.split(","):
        d, h, k = (int(v) for v in width.split("/"))
        cfg = ModelConfig(vocab_size=256, d_model=d, n_heads=h, n_kv_heads=k, n_layers=1,
                          mixers=("nsa",), nsa=nsa, max_seq_len=max(lengths))
        dense = nnx.eval_shape(lambda: DenseAttention(cfg, rngs=nnx.Rngs(0)))  # noqa: B023
        sparse = nnx.eval_shape(lambda: NSAttention(cfg, rngs=nnx.Rngs(0)))  # noqa: B023
        rows.append({"d_model": d, "heads": h, "kv_heads": k, "head_dim": cfg.resolved_head_dim,
                     "ratios": {str(t): dense.flops_per_token(t) / sparse.flops_per_token(t)
                                for t in lengths}})
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "nsa": dataclasses.asdict(nsa), "rows": rows}


def flops_markdown(result: dict[str, Any]) -> str:
    lengths = list(result["rows"][0]["ratios"])
    lines = ["| d_model / heads / kv heads (head dim) | "
             + " | ".join(f"{int(t) // 1024}K" for t in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for r in result["rows"]:
        lines.append(f"| {r['d_model']} / {r['heads']} / {r['kv_heads']} ({r['head_dim']}) | "
                     + " | ".join(f"{r['ratios'][t]:.2f}x" for t in lengths) + " |")
    return "\n".join(lines) + "\n"


def run_layer(args) -> dict[str, Any]:
    lengths = [int(v) for v in args.lengths.split(",")]
    ops = set(args.ops.split(","))
    if not ops <= {"forward", "backward", "decode"}:
        raise SystemExit(f"--ops={args.ops!r}: choose from forward, backward, decode")
    nsa = _nsa_config(args.nsa, args.implementation)
    key = jax.random.key(0)
    rows = []
    copy_bytes_s = copy_bandwidth() if "decode" in ops else None
    for seq in lengths:
        cfg = ModelConfig(vocab_size=256, d_model=args.d_model, n_heads=args.heads,
                          n_kv_heads=args.kv_heads, n_layers=1, mixers=("nsa",), nsa=nsa,
                          dtype=args.dtype, max_seq_len=max(seq, 8))
        logits_bytes = args.batch * args.heads * seq * seq * 4
        dense_ok = (args.dense_kernel == "auto"
                    and logits_bytes <= args.dense_max_gb * 2 ** 30)
        for kind in ("dense", "nsa"):
            layer_cfg = cfg
            if kind == "dense" and not dense_ok:
                layer_cfg = dataclasses.replace(cfg, dense=DenseConfig(kernel="flash_attention"))
            row = bench_layer_once(kind, layer_cfg, args.batch, seq, args.repeats,
                                   "forward" in ops, "backward" in ops, "decode" in ops, key)
            if kind == "dense":
                row["dense_attention"] = ("jax.nn.dot_product_attention" if dense_ok
                                          else "flash_attention")
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.torch_nsa and ops & {"forward", "backward"}:
            row = bench_torch_nsa(cfg, args.batch, seq, args.repeats, "forward" in ops,
                                  "backward" in ops)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": device_description(), "command": " ".join(sys.argv),
            "config": {"batch": args.batch, "d_model": args.d_model, "heads": args.heads,
                       "kv_heads": args.kv_heads, "dtype": args.dtype,
                       "nsa": dataclasses.asdict(nsa)},
            "copy_bytes_per_s": copy_bytes_s, "rows": rows}


def _ratio(a, b) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.1f}x"


def _gib(v) -> str:
    return "-" if v is None else f"{v / 2 ** 30:.2f}"


def layer_markdown(result: dict[str, Any]) -> str:
    by = {(r["kind"], r["seq_len"]): r for r in result["rows"]}
    lengths = sorted({r["seq_len"] for r in result["rows"]})
    torch_rows = any(r["kind"] == "torch_nsa" for r in result["rows"])
    lines = [f"NSA vs dense attention layer on {result['device']}, {result['date']}",
             f"config: {json.dumps(result['config'])}", "",
             "| T | op | dense s | NSA s | speed-up | FLOP ratio | speed-up / FLOP ratio | "
             "byte ratio | dense peak GiB | NSA peak GiB |"
             + (" torch NSA s | torch / ours |" if torch_rows else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if torch_rows else "")]
    for t in lengths:
        d, n, tn = by[("dense", t)], by[("nsa", t)], by.get(("torch_nsa", t), {})
        fr = d["flops_fwd"] / n["flops_fwd"]
        for op, key, peak, flop, byte in (
                ("forward", "forward_s", "forward_peak_bytes", f"{fr:.1f}x", "-"),
                ("fwd+bwd", "fwd_bwd_s", "fwd_bwd_peak_bytes", f"{fr:.1f}x", "-"),
                ("decode", "decode_s", "decode_peak_bytes",
                 _ratio(d["flops_decode"], n["flops_decode"]),
                 _ratio(d["bytes_decode"], n["bytes_decode"]))):
            ds, ns = d.get(key), n.get(key)
            if ds is None and ns is None:
                continue
            ceiling = (d["flops_decode"] / n["flops_decode"] if op == "decode"
                       else fr)
            of_ceiling = "-" if ds is None or ns is None else f"{ds / ns / ceiling:.2f}"
            line = (f"| {t} | {op} | {'skipped' if ds is None else f'{ds:.4f}'} | "
                    f"{'-' if ns is None else f'{ns:.4f}'} | {_ratio(ds, ns)} | {flop} | "
                    f"{of_ceiling} | {byte} | {_gib(d.get(peak))} | {_gib(n.get(peak))} |")
            if torch_rows:
                ts = tn.get(key)
                line += f" {'-' if ts is None else f'{ts:.4f}'} | {_ratio(ts, ns)} |"
            lines.append(line)
    bw = result.get("copy_bytes_per_s")
    decoded = [t for t in lengths if by[("nsa", t)].get("decode_s") is not None]
    if bw and decoded:
        lines += ["", f"decode step / its cache bytes at the measured copy bandwidth "
                      f"({bw / 1e9:.1f} GB/s, a jitted copy of {COPY_BYTES // 2 ** 20} MiB):", ""]
        for t in decoded:
            parts = []
            for kind in ("dense", "nsa"):
                r = by[(kind, t)]
                floor = r["bytes_decode"] / bw
                parts.append(f"{kind} {r['decode_s'] * 1e3:.2f} ms / {floor * 1e3:.2f} ms = "
                             f"{r['decode_s'] / floor:.2f}x")
            lines.append(f"- T={t}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


# Quality run ------------------------------------------------------------------------------------
def _params(cfg) -> int:
    from aiinfra_jax.models import Transformer
    from aiinfra_jax.trainer import Trainer
    model_cfg = Trainer(cfg).cfg.model  # vocab filled in from the tokenizer
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    return int(sum(np.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param))))


def run_quality(args) -> dict[str, Any]:
    from aiinfra_jax.config import load_config
    from aiinfra_jax.train import train

    out = Path(args.out)
    common = list(args.set) + [f"run.steps={args.steps}", f"eval.every={args.eval_every}",
                               "checkpoint.every=0", "run.resume=never", "run.progress=false",
                               f"run.output_dir={out / 'runs'}"]
    cfgs = {kind: load_config(args.config, common + [f"model.mixers={kind}",
                                                    f"run.name=quality-{kind}"])
            for kind in ("dense", "nsa")}
    if args.match_params:
        # widen the dense FFN (SwiGLU: 3 * D * F parameters per layer) to NSA's parameter count
        m = cfgs["dense"].model
        extra = _params(cfgs["nsa"]) - _params(cfgs["dense"])
        d_ff = m.resolved_d_ff + max(0, round(extra / (3 * m.d_model * m.n_layers)))
        cfgs["dense"] = load_config(args.config, common + ["model.mixers=dense",
                                                          "run.name=quality-dense",
                                                          f"model.d_ff={d_ff}"])
    curves, summaries = {}, {}
    for kind, cfg in cfgs.items():
        t0 = time.perf_counter()
        s = train(cfg, quiet=True)
        metrics = [json.loads(line) for line in
                   (Path(s["logs"]) / "metrics.jsonl").read_text().splitlines()]
        curves[kind] = [(m["step"], m["val/loss"]) for m in metrics if "val/loss" in m]
        final = (s["validation"] or {}).get("loss")
        if final is not None and (not curves[kind] or curves[kind][-1][0] != s["step"]):
            curves[kind].append((s["step"], final))  # end-of-run pass (eval.final_batches)
        summaries[kind] = {"params": s["params"], "flops_per_token": s["flops_per_token"],
                           "final_val_loss": (s["validation"] or {}).get("loss"),
                           "final_train_loss": s["final_train_loss"],
                           "wall_s": time.perf_counter() - t0,
                           "d_ff": cfg.model.resolved_d_ff}
        print(kind, json.dumps(summaries[kind]), flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": device_description(), "command": " ".join(sys.argv),
              "config": args.config, "overrides": common, "curves": curves,
              "summaries": summaries}
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for kind, pts in curves.items():
            if pts:
                millions = summaries[kind]["params"] / 1e6
                ax.plot(*zip(*pts), marker="o", label=f"{kind} ({millions:.2f}M params)")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title("dense vs NSA, same data and steps")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "quality.png", dpi=120)
        result["plot"] = str(out / "quality.png")
    except ImportError:
        print("matplotlib is not installed: no PNG (the numbers are in the JSON)", flush=True)
    return result


def quality_markdown(result: dict[str, Any]) -> str:
    steps = sorted({s for pts in result["curves"].values() for s, _ in pts})
    kinds = list(result["curves"])
    lines = [f"dense vs NSA validation loss on {result['device']}, {result['date']}",
             f"config: {result['config']} {' '.join(result['overrides'][:-1])}", "",
             "| step | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    for step in steps:
        vals = [dict(result["curves"][k]).get(step) for k in kinds]
        lines.append(f"| {step} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in vals)
                     + " |")
    lines.append("")
    for k in kinds:
        s = result["summaries"][k]
        fv = s["final_val_loss"]
        lines.append(f"- {k}: {s['params'] / 1e6:.3f}M params (d_ff {s['d_ff']}), "
                     f"{s['flops_per_token'] / 1e6:.2f} MFLOP/token, final val loss "
                     f"{'-' if fv is None else f'{fv:.4f}'}, {s['wall_s']:.0f} s")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    lay = sub.add_parser("layer", help="layer forward / backward / decode timings")
    lay.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    lay.add_argument("--repeats", type=int, default=3)
    lay.add_argument("--batch", type=int, default=1)
    lay.add_argument("--d-model", type=int, default=512)
    lay.add_argument("--heads", type=int, default=8)
    lay.add_argument("--kv-heads", type=int, default=2)
    lay.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    lay.add_argument("--nsa", default="32,16,64,16,512", help="l,d,l',n,w")
    lay.add_argument("--implementation", default=None,
                     choices=(None, "xla", "pallas_gpu", "pallas_tpu"))
    lay.add_argument("--ops", default="forward,backward,decode",
                     help="comma list of forward, backward (forward+backward), decode")
    lay.add_argument("--dense-kernel", default="flash", choices=("flash", "auto"),
                     help="flash: the dense layer through flash_attention at every length; auto: "
                          "jax.nn.dot_product_attention where its logits fit in --dense-max-gb")
    lay.add_argument("--dense-max-gb", type=float, default=4.0)
    lay.add_argument("--torch-nsa", action="store_true",
                     help="also time lucidrains' native-sparse-attention-pytorch at these shapes")
    lay.add_argument("--out", default="runs/bench_nsa_layer")
    q = sub.add_parser("quality", help="dense vs NSA training at matched tokens")
    q.add_argument("--config", default="configs/nsa_tiny.py")
    q.add_argument("--steps", type=int, default=600)
    q.add_argument("--eval-every", type=int, default=100)
    q.add_argument("--match-params", action="store_true")
    q.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. data.seq_len=64")
    q.add_argument("--out", default="runs/bench_nsa_quality")
    fl = sub.add_parser("flops", help="theoretical dense / NSA FLOP ratio (nothing runs)")
    fl.add_argument("--widths", default="512/8/2,1024/16/2,2048/16/1,4096/64/16",
                    help="comma list of d_model/heads/kv_heads")
    fl.add_argument("--lengths", default="8192,16384,32768,65536")
    fl.add_argument("--nsa", default="32,16,64,16,512", help="l,d,l',n,w")
    fl.add_argument("--out", default="runs/bench_nsa_flops")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"device: {device_description()}", flush=True)
    if args.mode == "layer":
        result = run_layer(args)
        md = layer_markdown(result)
    elif args.mode == "flops":
        result = run_flops(args)
        md = flops_markdown(result)
    else:
        result = run_quality(args)
        md = quality_markdown(result)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "result.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
