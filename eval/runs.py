"""Training runs for the benchmarks that compare models by their loss curves (bench_surgery,
bench_moe --quality): train a preset once, or read the run a previous invocation finished."""

from __future__ import annotations

import json
from pathlib import Path

from aiinfra_jax.config import load_config
from aiinfra_jax.train import train

ROOT = Path(__file__).resolve().parents[1]


def train_or_read(name: str, preset: str, out: Path, overrides: list[str]) -> dict:
    """The run out/name of configs/<preset> with `overrides`: trained (quietly, from scratch) unless
    it finished before (its summary.json exists), then read. Returns its curves (train loss and
    validation loss by step) and final numbers."""
    run_dir = out / name
    if (run_dir / "summary.json").exists():
        print(f"{name}: reading the finished run in {run_dir}", flush=True)
    else:
        print(f"{name}: training ({preset} {' '.join(overrides)})", flush=True)
        cfg = load_config(str(ROOT / "configs" / preset),
                          [f"run.output_dir={out}", f"run.name={name}", "run.resume=never"]
                          + overrides)
        train(cfg, quiet=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [json.loads(x) for x in
             (run_dir / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"name": name, "run_dir": str(run_dir), "preset": preset, "overrides": overrides,
            "train": [(x["step"], x["loss"]) for x in lines if "loss" in x],
            "val": [(x["step"], x["val/loss"]) for x in lines if "val/loss" in x],
            "final_train_loss": summary["final_train_loss"],
            "final_val_loss": summary["validation"]["loss"],
            "final_val_accuracy": summary["validation"]["accuracy"]}


def value_at(curve: list, step: int) -> float | None:
    """The curve's value at `step` (None when it has none there)."""
    return next((v for s, v in curve if s == step), None)


def plot_curves(runs: dict, path: Path, *, title: str, xlabel: str = "training step") -> None:
    """One PNG of several runs' curves (train_or_read's dicts, by name): faint train loss, validation
    loss as dots, each labelled with its final validation loss."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    colors = ("gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    for (name, r), color in zip(runs.items(), colors):
        ax.plot(*zip(*r["train"]), color=color, alpha=0.3)
        ax.plot(*zip(*r["val"]), "o-", color=color,
                label=f"{name} (final validation {r['final_val_loss']:.3f})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats/byte); faint: train, dots: validation")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
