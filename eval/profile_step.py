"""Where a training (or evaluation) step spends its time: the top compiled ops, with the JAX code
each one came from.

    python -m aiinfra_jax.eval.profile_step --config configs/tiny.py [--set k=v ...]
        [--step train|eval|decode] [--calls 2] [--top 25] [--out runs/profile_step]
        [--context 1024] [--batch 8]

Compiles the jitted step of `aiinfra_jax.trainer.Trainer` for one batch (--step train / eval), or
one cached decode step of `aiinfra_jax.generate` (--step decode: a randomly initialised model,
--batch random prompts of --context tokens prefilled, then the donated single-token step that
generate's loop runs), runs it once (warm-up), then traces --calls calls with jax.profiler (a
Perfetto trace lands in --out; open it in ui.perfetto.dev for the timeline). The printed table sums
each compiled op (XLA fusion, dot, copy, ...) over the traced calls and divides by --calls; the
op_name column is the JAX source path that XLA recorded in the op's metadata ("while/body/..." is
the layer scan; "transpose(jvp())" the backward pass), so a slow fusion leads back to the line that
made it. "buffer copies" counts whole-array copy ops, which often point at a carry that XLA could
not update in place.

Works on every backend; on the CPU each op is one thunk event, on GPUs the device-side kernel
events carry the same names.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import sys
from pathlib import Path

import jax

from aiinfra_jax.config import load_config
from aiinfra_jax.eval.bench_train import step_setup

_OP_NAME = re.compile(r'\s*(?:ROOT )?%([\w.\-]+) = .*?op_name="([^"]+)"')
# Host-side wrappers, and control-flow ops whose events enclose the ops they run (counted there).
_SKIP = ("Thunk", "$", "Slinky", "PjRt", "TfrtCpu", "Pjit", "CommonPjRt", "while", "conditional",
         "call")


def op_names(hlo_text: str) -> dict[str, str]:
    """Compiled-op name -> the JAX op_name in its metadata (first occurrence)."""
    names: dict[str, str] = {}
    for line in hlo_text.splitlines():
        m = _OP_NAME.match(line)
        if m:
            names.setdefault(m.group(1), m.group(2))
    return names


def op_times(trace_dir: str) -> dict[str, float]:
    """Summed durations (seconds) of the complete events in the newest Perfetto trace."""
    paths = sorted(glob.glob(f"{trace_dir}/plugins/profile/*/perfetto_trace.json.gz"))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}/plugins/profile")
    data = json.load(gzip.open(paths[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    total: dict[str, float] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(_SKIP):
            total[e["name"]] += e.get("dur", 0) * 1e-6
    return dict(total)


def _decode_setup(cfg, context: int, batch: int):
    """The compiled decode step and its first arguments, and a function giving the next ones."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from aiinfra_jax.config import apply_overrides
    from aiinfra_jax.generate import _decode_step, prefill
    from aiinfra_jax.models import Transformer

    slots = context + 64
    cfg = apply_overrides(cfg, [f"model.max_seq_len={max(slots, cfg.model.max_seq_len)}"])
    model = Transformer(cfg.model.with_vocab(cfg.model.vocab_size or 256), rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(1, 200, (batch, context)).astype(np.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    _, cache = prefill(model, prompts, lengths, slots)
    graphdef, state = nnx.split(model.unscanned())
    tokens = jnp.ones((batch,), jnp.int32)
    fn = _decode_step.lower(graphdef, state, cache, tokens, lengths).compile()
    # The same cache slot is rewritten every call: a step's cost does not depend on the length.
    return fn, (state, cache, tokens, lengths), lambda args, result: (args[0], result[1],
                                                                      *args[2:])


def profile(cfg, step: str, calls: int, out: Path, context: int = 1024, batch: int = 8) -> dict:
    if step == "decode":
        compiled, args, advance = _decode_setup(cfg, context, batch)
    else:
        compiled, args, advance = _step_setup(cfg, step)
    hlo = compiled.as_text()

    def call(args):
        return advance(args, jax.block_until_ready(compiled(*args)))

    args = call(args)                                         # warm-up
    out.mkdir(parents=True, exist_ok=True)
    jax.profiler.start_trace(str(out), create_perfetto_trace=True)
    for _ in range(calls):
        args = call(args)
    jax.profiler.stop_trace()
    names = op_names(hlo)
    times = op_times(str(out))
    rows = [{"op": op, "seconds_per_call": t / calls, "op_name": names.get(op, "")}
            for op, t in sorted(times.items(), key=lambda kv: -kv[1])]
    copies = sum(1 for line in hlo.splitlines() if re.search(r"= \S+ copy\(", line))
    return {"step": step, "calls": calls, "rows": rows, "copy_ops": copies,
            "total_op_seconds_per_call": sum(r["seconds_per_call"] for r in rows)}


def _step_setup(cfg, step: str):
    _, state, jtrain, jeval, batch = step_setup(cfg)
    if step == "train":
        fn, args = jtrain, (state, batch)
    else:
        fn, args = jeval, (state["params"], batch, state.get("model_state"))
    compiled = fn.lower(*args).compile()
    if step == "train":  # the train step donates its state: carry the new one
        return compiled, args, lambda args, result: (result[0], batch)
    return compiled, args, lambda args, result: args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--step", choices=("train", "eval", "decode"), default="train")
    ap.add_argument("--context", type=int, default=1024, help="--step decode: prompt tokens")
    ap.add_argument("--batch", type=int, default=8, help="--step decode: rows")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="runs/profile_step")
    args = ap.parse_args(argv)
    if args.calls < 1:
        raise SystemExit(f"--calls={args.calls}: must be >= 1")
    cfg = load_config(args.config, args.overrides)
    res = profile(cfg, args.step, args.calls, Path(args.out), args.context, args.batch)
    (Path(args.out) / "ops.json").write_text(json.dumps(res, indent=2) + "\n")
    total = res["total_op_seconds_per_call"]
    print(f"{args.step} step of {args.config} {' '.join(args.overrides)}: {total * 1e3:.1f} ms of "
          f"compiled ops per call; {res['copy_ops']} copy ops in the program\n")
    print("| ms / call | share | op | JAX op_name |\n|---|---|---|---|")
    for r in res["rows"][:args.top]:
        print(f"| {r['seconds_per_call'] * 1e3:.1f} | {r['seconds_per_call'] / total:.1%} | "
              f"{r['op']} | {r['op_name'][-100:]} |")
    print(f"\nwrote {args.out}/ops.json and a Perfetto trace under {args.out}/plugins/profile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
