"""Training-throughput benchmark: tokens/s, MFU and the share of time spent outside the jitted step.

    python -m aiinfra_jax.eval.bench_train --config configs/tiny.py [--steps 60] [--set ...]
    make bench-train

Two measurements in one run, on the same config and device:
  1. the jitted train step alone: one batch already on the device, `--steps` calls, each waited for
     (block_until_ready); median step time -> tokens/s and MFU of the step itself;
  2. the real loop (`aiinfra_jax.train.train`: data loading, prefetch, host transfers, logging,
     periodic checkpoints) for `--steps` steps in a scratch run directory; the steady-state time per step
     is read from the loop's own interval timings, skipping the first interval (compilation).
Outside-the-step share = 1 - (step time / loop time per step). Target: <= 10% on the CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from aiinfra_jax import sharding as shd
from aiinfra_jax.config import apply_overrides, load_config
from aiinfra_jax.data import make_iterator
from aiinfra_jax.metrics import mfu, peak_flops_per_device
from aiinfra_jax.train import train
from aiinfra_jax.trainer import Trainer


def device_description() -> str:
    d = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    return f"{jax.device_count()} x {d.device_kind} ({jax.default_backend()}; host {cpu}, " \
           f"{__import__('os').cpu_count()} cores; jax {jax.__version__})"


def step_setup(cfg):
    """(trainer, initial state, jitted train step, jitted eval step, one training batch on the
    device): what the benchmarks that time or profile a step start from."""
    trainer = Trainer(cfg)
    state = trainer.init_state()
    jtrain, jeval = trainer.compiled_steps()
    batch = next(make_iterator(cfg.data, trainer.tokenizer, split="train", seed=cfg.run.seed))
    return trainer, state, jtrain, jeval, shd.shard_batch(batch, trainer.mesh)


def timed_train_steps(cfg, steps: int):
    """Runs the jitted train step `steps` times on one batch already on the device, after one
    warm-up (compiling) step; returns (trainer, state, jitted eval step, device batch, seconds per
    step). Shared by the benchmarks that time a training step."""
    trainer, state, jtrain, jeval, batch = step_setup(cfg)
    state, m = jtrain(state, batch)  # compile + warm-up
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = jtrain(state, batch)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
    return trainer, state, jeval, batch, times


def bench_step(cfg, steps: int) -> dict:
    trainer, _, _, _, times = timed_train_steps(cfg, steps)
    model = nnx.merge(trainer.graphdef, trainer.abstract_params, trainer.rest)
    fpt = float(model.flops_per_token(cfg.data.seq_len))
    tokens = cfg.data.batch_size * cfg.data.seq_len
    med = statistics.median(times)
    peak, source = peak_flops_per_device(jax.devices()[0], cfg.model.dtype)
    return {"step_s_median": med, "step_s_p10": float(np.percentile(times, 10)),
            "step_s_p90": float(np.percentile(times, 90)), "tokens_per_step": tokens,
            "tokens_per_sec": tokens / med, "flops_per_token_fwd": fpt,
            "mfu": mfu(fpt, tokens / med, trainer.mesh.size, peak), "peak_flops": peak,
            "peak_source": source}


def bench_loop(cfg, steps: int) -> dict:
    log_every = max(steps // 6, 1)
    with tempfile.TemporaryDirectory() as tmp:
        run_cfg = apply_overrides(cfg, [f"run.run_dir={tmp}/run", f"run.steps={steps}",
                                        f"run.log_every={log_every}", "run.progress=false",
                                        "eval.every=0", "eval.final_batches=1",
                                        f"checkpoint.every={max(steps // 2, 1)}"])
        s = train(run_cfg, quiet=True)
    steady = s["history"][1:]  # the first interval holds compilation
    per_step = [cfg.data.batch_size * cfg.data.seq_len / r["tokens_per_sec"] for r in steady]
    return {"loop_s_per_step_median": statistics.median(per_step),
            "host_wait_frac_median": statistics.median(r["host_wait_frac"] for r in steady),
            "intervals": len(steady), "log_every": log_every}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="runs/bench_train.json")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    device = device_description()
    print(f"device: {device}", flush=True)
    step = bench_step(cfg, args.steps)
    loop = bench_loop(cfg, args.steps)
    outside = 1.0 - step["step_s_median"] / loop["loop_s_per_step_median"]
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "device": device,
              "config": args.config, "overrides": args.overrides, "steps": args.steps,
              **step, **loop, "outside_step_frac": outside}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"| config | tokens/s (step) | step ms | loop ms/step | outside step | MFU | peak |\n"
          f"|---|---|---|---|---|---|---|\n"
          f"| {args.config} {' '.join(args.overrides)} | {step['tokens_per_sec']:.0f} | "
          f"{step['step_s_median'] * 1e3:.1f} | {loop['loop_s_per_step_median'] * 1e3:.1f} | "
          f"{outside:.1%} | {step['mfu']:.1%} | {step['peak_flops'] / 1e9:.0f} GFLOP/s "
          f"({step['peak_source']}) |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
