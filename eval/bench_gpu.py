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

Timings (the rows and their timer: eval/gpu_timing.py). B = 1, Hq = --heads query heads over
--kv-heads KV heads of --head-dim, --dtype (bfloat16), at each of --lengths, in the order given
(the default visits 4K and 64K, then 16K, 8K and 32K, so a short budget still spans the range; the
table is sorted by length):
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
import dataclasses
import json
import math
import platform
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import jax
import numpy as np

from aiinfra_jax.eval.bench_kernels import CMP_LEN, CMP_STRIDE
from aiinfra_jax.eval.gpu_parity import BASELINE_FACTOR, errors, parity_cases
from aiinfra_jax.eval.gpu_timing import (TIMED_OPS, compile_options, first_line, measure_peak,
                                         run_timing)

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"
_INVOKED = ("python -m aiinfra_jax.eval.bench_gpu" if __package__ else "python eval/bench_gpu.py")


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
        pairs, checks = case.run(rng, run.pallas, compile_options(run))
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
                    "details": f"error: {first_line(exc)}"})
    row["seconds"] = time.perf_counter() - t0
    return row



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
