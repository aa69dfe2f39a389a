"""Attention Residuals benchmark: training-step and forward overhead against the standard residual,
and validation loss at equal steps and tokens for standard / Full / Block AttnRes.

    python -m aiinfra_jax.eval.bench_attnres [--config configs/tiny.py] [--set k=v ...]
        [--steps 20] [--rounds 1] [--deep-layers 16] [--deep-set k=v ...] [--train-steps 600]
        [--eval-batches 32] [--skip-overhead] [--skip-quality] [--memory]
        [--out-dir runs/bench_attnres]

Reduced size (a few CPU minutes):
    python -m aiinfra_jax.eval.bench_attnres --set model.d_model=128 --set data.seq_len=128 \\
        --set data.batch_size=8 --steps 10 --deep-layers 12 --train-steps 150 --eval-batches 8

1. Overhead: for the config and a deeper copy (n_layers = --deep-layers), each residual scheme's
   jitted train step and forward (eval step) on one batch already on the device: median time over
   --steps calls after a warm-up, the ratio to "standard" measured in the same run, and beside it
   the theoretical extra work of depth attention (FLOPs and bytes read per token, forward). With
   --rounds R > 1 the schemes are compiled first and timed in R interleaved rounds, so that a
   machine whose speed drifts during the run slows every scheme alike.
2. Quality: aiinfra_jax.train.train for --train-steps steps per scheme on the config's corpus (same
   data, seed, batch and steps, so equal tokens); final validation loss (eval.final_batches =
   --eval-batches) and the training-loss curves -> a PNG and a JSON in --out-dir.
3. With --memory: the compiled temporaries of each scheme's gradient (no optimizer) at the config's
   batch shape, with remat "none" and "full" (under both, AttnRes keeps one depth buffer and
   rebuilds each layer's from the final one: models/rebuilding.py); nothing runs.
The paper (at scale) reports < 4% training and < 2% inference overhead; small models may not gain
in loss (reproductions at small depth disagree): the benchmark reports what it sees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import jax
from flax import nnx

from aiinfra_jax.config import load_config
from aiinfra_jax.eval.bench_train import device_description, step_setup
from aiinfra_jax.train import train

RESIDUALS = ("standard", "attnres_full", "attnres_block")


def depth_attention_cost(cfg) -> dict:
    """Forward FLOPs and bytes per token of depth attention (sublayer inputs + final aggregation),
    counting only the used slots (what the Pallas kernels read)."""
    m = cfg.model
    J, D = 2 * m.n_layers, m.d_model
    item = 2 if m.dtype == "bfloat16" else 4
    if m.residual == "attnres_full":
        reads = sum(j + 1 for j in range(J)) + (J + 1)          # sublayer j reads j + 1 sources
    elif m.residual == "attnres_block":
        per_block = J // m.attnres.n_blocks
        reads = sum(1 + j // per_block + (j % per_block > 0) for j in range(J))
        reads += m.attnres.n_blocks + 1
    else:
        return {"depth_flops_per_token": 0.0, "depth_bytes_per_token": 0.0}
    # per source read: RMSNorm (3D), score (2D), exp-weighted accumulation (2D)
    return {"depth_flops_per_token": float(reads * 7 * D),
            "depth_bytes_per_token": float(reads * D * item)}


class _Scheme:
    """One residual scheme's compiled train and eval steps on one batch already on the device,
    warmed up, and the times of the calls made so far."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.trainer, self.state, self.jtrain, self.jeval, self.batch = step_setup(cfg)
        self.train_times: list[float] = []
        self.forward_times: list[float] = []
        self._train()                                                # compile + warm-up
        self._forward()

    def _train(self) -> float:
        t0 = time.perf_counter()
        self.state, m = self.jtrain(self.state, self.batch)
        jax.block_until_ready((self.state, m))
        return time.perf_counter() - t0

    def _forward(self) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(self.jeval(self.state["params"], self.batch,
                                         self.state.get("model_state")))
        return time.perf_counter() - t0

    def visit(self, steps: int, rewarm: bool) -> None:
        """steps timed train calls, then steps timed forward calls; with rewarm one untimed train
        call first (after another scheme ran, the first call pays for its pages again)."""
        if rewarm:
            self._train()
        self.train_times += [self._train() for _ in range(steps)]
        self.forward_times += [self._forward() for _ in range(steps)]

    def result(self) -> dict:
        model = nnx.merge(self.trainer.graphdef, self.trainer.abstract_params, self.trainer.rest)
        return {"train_step_s": statistics.median(self.train_times),
                "forward_s": statistics.median(self.forward_times),
                "train_calls": len(self.train_times),
                "model_flops_per_token": float(model.flops_per_token(self.cfg.data.seq_len)),
                "params": int(model.num_params()), **depth_attention_cost(self.cfg)}


def time_schemes(cfgs: list, steps: int, rounds: int = 1) -> list[dict]:
    """Median train-step and forward time per config. rounds 1: one scheme after the other
    (compile, steps calls, freed). rounds R > 1: every scheme compiled first, then R rounds that
    visit the schemes in turn, steps calls each after one untimed call: the machine's drift over
    the run then hits every scheme alike (on the 2-core VM the ratio of two separate runs of the
    same code moves by +-0.07-0.15), at the memory cost of every scheme resident at once."""
    if rounds <= 1:
        out = []
        for cfg in cfgs:
            scheme = _Scheme(cfg)
            scheme.visit(steps, rewarm=False)
            out.append(scheme.result())
            del scheme
        return out
    schemes = [_Scheme(cfg) for cfg in cfgs]
    for r in range(rounds):
        for scheme in schemes:
            scheme.visit(steps, rewarm=True)
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{s.cfg.model.residual} {s.train_times[-1] * 1e3:.0f} ms" for s in schemes),
            flush=True)
    return [s.result() for s in schemes]


def overhead(config: str, overrides: list[str], steps: int, label: str,
             residuals=RESIDUALS, rounds: int = 1) -> list[dict]:
    cfgs = [load_config(config, overrides + [f"model.residual={r}"]) for r in residuals]
    print(f"[overhead/{label}] {', '.join(residuals)}"
          + (f" in {rounds} interleaved rounds" if rounds > 1 else "") + " ...", flush=True)
    rows = []
    for cfg, timed in zip(cfgs, time_schemes(cfgs, steps, rounds)):
        rows.append({"setting": label, "residual": cfg.model.residual,
                     "n_layers": cfg.model.n_layers, "d_model": cfg.model.d_model,
                     "rounds": rounds, **timed})
        print(f"  {cfg.model.residual}: train step {timed['train_step_s'] * 1e3:.1f} ms, "
              f"forward {timed['forward_s'] * 1e3:.1f} ms", flush=True)
    base = rows[0]
    for r in rows:
        r["train_ratio"] = r["train_step_s"] / base["train_step_s"]
        r["forward_ratio"] = r["forward_s"] / base["forward_s"]
        r["depth_flops_frac"] = r["depth_flops_per_token"] / r["model_flops_per_token"]
    return rows


def memory(config: str, overrides: list[str], label: str, residuals=RESIDUALS) -> list[dict]:
    """Compiled temporaries (memory_analysis) of the gradient of the model's summed logits on one
    batch of the config's shape, per scheme, without and with remat="full"; nothing runs."""
    import jax.numpy as jnp

    from aiinfra_jax.models import Transformer
    rows = []
    for residual in residuals:
        for remat in ("none", "full"):
            cfg = load_config(config, overrides + [f"model.residual={residual}",
                                                   f"model.remat={remat}"])
            m = cfg.model.with_vocab(384) if cfg.model.vocab_size <= 0 else cfg.model
            model = nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))  # noqa: B023
            graphdef, state = nnx.split(model)
            shape = (cfg.data.batch_size, cfg.data.seq_len)
            tokens = jax.ShapeDtypeStruct(shape, jnp.int32)

            def loss(state, tokens):
                positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
                return jnp.sum(nnx.merge(graphdef, state)(  # noqa: B023
                    tokens, positions=positions)[0])

            compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
            mib = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
            rows.append({"setting": label, "residual": residual, "remat": remat,
                         "n_layers": m.n_layers, "grad_temp_mib": mib})
            print(f"[memory/{label}] {residual} remat={remat}: {mib:.0f} MiB", flush=True)
    return rows


def quality(config: str, overrides: list[str], train_steps: int, eval_batches: int,
            residuals=RESIDUALS) -> list[dict]:
    rows = []
    for residual in residuals:
        print(f"[quality] {residual}: {train_steps} steps ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(config, overrides + [
                f"model.residual={residual}", f"run.run_dir={tmp}/run", f"run.steps={train_steps}",
                f"run.log_every={max(train_steps // 30, 1)}", "run.progress=false",
                "eval.every=0", f"eval.final_batches={eval_batches}", "checkpoint.every=0"])
            t0 = time.perf_counter()
            s = train(cfg, quiet=True)
            wall = time.perf_counter() - t0
        rows.append({"residual": residual, "steps": train_steps,
                     "tokens": train_steps * cfg.data.batch_size * cfg.data.seq_len,
                     "val_loss": float(s["validation"]["loss"]), "wall_s": wall,
                     "curve": [(r["step"], float(r["loss"])) for r in s["history"]]})
        print(f"  val loss {rows[-1]['val_loss']:.4f} ({wall:.0f} s)", flush=True)
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        steps, losses = zip(*r["curve"])
        a.plot(steps, losses, label=r["residual"])
    a.set_xlabel("step")
    a.set_ylabel("training loss (nats/token)")
    a.legend()
    a.set_title("training loss")
    names = [r["residual"] for r in rows]
    vals = [r["val_loss"] for r in rows]
    b.bar(names, vals, color=[f"C{i}" for i in range(len(vals))])
    lo = min(vals)
    b.set_ylim(lo - 0.1, max(vals) + 0.05)
    for i, v in enumerate(vals):
        b.text(i, v + 0.005, f"{v:.4f}", ha="center")
    b.set_title("validation loss at equal steps")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="config override for every run, e.g. --set model.d_model=128")
    ap.add_argument("--steps", type=int, default=20, help="timed calls per scheme (per round)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: compile every scheme, then time them in this many interleaved "
                    "rounds (ratios robust to the machine's drift; every scheme resident)")
    ap.add_argument("--deep-layers", type=int, default=16, help="n_layers of the deeper setting "
                    "(0 = skip)")
    ap.add_argument("--deep-set", dest="deep_overrides", action="append", default=[],
                    help="extra overrides for the deeper setting only")
    ap.add_argument("--train-steps", type=int, default=600)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--memory", action="store_true",
                    help="also tabulate compiled gradient temporaries (remat none / full)")
    ap.add_argument("--residuals", default=",".join(RESIDUALS),
                    help="comma-separated schemes; overhead ratios need 'standard' first")
    ap.add_argument("--out-dir", default="runs/bench_attnres")
    args = ap.parse_args(argv)
    residuals = tuple(r for r in args.residuals.split(",") if r)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = device_description()
    print(f"device: {device}", flush=True)
    common = ["mesh.num_devices=1"] + args.overrides if jax.default_backend() == "cpu" \
        else list(args.overrides)
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device,
              "command": " ".join(["python -m aiinfra_jax.eval.bench_attnres"] + sys.argv[1:]),
              "config": args.config, "overrides": common}
    if not args.skip_overhead:
        rows = overhead(args.config, common, args.steps, "base", residuals, args.rounds)
        if args.deep_layers:
            rows += overhead(args.config, common + [f"model.n_layers={args.deep_layers}"]
                             + args.deep_overrides, args.steps, f"deep L={args.deep_layers}",
                             residuals, args.rounds)
        result["overhead"] = rows
        print("\n| setting | residual | L | D | train step ms | ratio | forward ms | ratio | "
              "depth-attn FLOPs / model FLOPs | depth-attn bytes/token |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['setting']} | {r['residual']} | {r['n_layers']} | {r['d_model']} | "
                  f"{r['train_step_s'] * 1e3:.1f} | {r['train_ratio']:.3f} | "
                  f"{r['forward_s'] * 1e3:.1f} | {r['forward_ratio']:.3f} | "
                  f"{r['depth_flops_frac']:.2%} | {r['depth_bytes_per_token'] / 1e3:.1f} KB |")
    if args.memory:
        rows = memory(args.config, common, "base", residuals)
        if args.deep_layers:
            rows += memory(args.config, common + [f"model.n_layers={args.deep_layers}"]
                           + args.deep_overrides, f"deep L={args.deep_layers}", residuals)
        result["memory"] = rows
        print("\n| setting | residual | remat | gradient temporaries MiB |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['setting']} | {r['residual']} | {r['remat']} | "
                  f"{r['grad_temp_mib']:.0f} |")
    if not args.skip_quality:
        rows = quality(args.config, common, args.train_steps, args.eval_batches, residuals)
        result["quality"] = rows
        png = out / "bench_attnres_loss.png"
        plot(rows, png, f"{args.config} {' '.join(common)} | {device}")
        print("\n| residual | steps | tokens | val loss | wall s |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['residual']} | {r['steps']} | {r['tokens']} | {r['val_loss']:.4f} | "
                  f"{r['wall_s']:.0f} |")
        print(f"wrote {png}")
    path = out / "bench_attnres.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
