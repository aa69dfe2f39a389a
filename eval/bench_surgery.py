"""Architecture surgery, measured: NSA finetuned from a trained dense model against NSA from scratch.

    python -m aiinfra_jax.eval.bench_surgery [--out-dir runs/bench_surgery] [--dense-steps 300]
        [--nsa-steps 150] [--eval-every 25]

Three runs on the embedded corpus, one after the other (a finished run in --out-dir is read, not
trained again):
  dense           configs/tiny.py for --dense-steps (the dense model `make train CONFIG=...` trains)
  nsa_from_dense  configs/nsa_tiny.py, checkpoint.initialize_from=params:<dense>: the dense
                  projections adapted into NSA's three branches, gates and compression MLPs fresh
                  (aiinfra_jax/surgery.py), --nsa-steps steps under the preset's own schedule
  nsa_scratch     configs/nsa_tiny.py from its own initialisation, the same steps and schedule
Writes bench_surgery.json (the curves and final numbers) and bench_surgery.png (train loss and
validation loss by step of the two NSA runs, with the dense model's final validation loss), and
prints a markdown table for eval/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from aiinfra_jax.eval.runs import train_or_read as _run, value_at as _at


def plot(runs: dict, path: Path) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, color in (("nsa_from_dense", "tab:blue"), ("nsa_scratch", "tab:orange")):
        r = runs[key]
        ax.plot(*zip(*r["train"]), color=color, alpha=0.5, label=f"{key} train")
        ax.plot(*zip(*r["val"]), "o-", color=color, label=f"{key} validation")
    ax.axhline(runs["dense"]["final_val_loss"], color="gray", ls="--",
               label=f"dense source, validation ({runs['dense']['final_val_loss']:.3f})")
    ax.set_xlabel("NSA training step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.set_title("NSA from a dense checkpoint (params:) vs from scratch, tiny preset")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="runs/bench_surgery")
    ap.add_argument("--dense-steps", type=int, default=300)
    ap.add_argument("--nsa-steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    nsa = [f"run.steps={args.nsa_steps}", f"eval.every={args.eval_every}", "run.log_every=10"]
    runs = {"dense": _run("dense", "tiny.py", out, [f"run.steps={args.dense_steps}"])}
    runs["nsa_from_dense"] = _run("nsa_from_dense", "nsa_tiny.py", out, nsa + [
        f"checkpoint.initialize_from=params:{runs['dense']['run_dir']}"])
    runs["nsa_scratch"] = _run("nsa_scratch", "nsa_tiny.py", out, nsa)
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(["python -m aiinfra_jax.eval.bench_surgery"] + sys.argv[1:]),
              "runs": runs}
    (out / "bench_surgery.json").write_text(json.dumps(result, indent=1))
    plot(runs, out / "bench_surgery.png")
    a, b = runs["nsa_from_dense"], runs["nsa_scratch"]
    steps = [s for s, _ in a["val"]]
    print("\n| NSA step | " + " | ".join(str(s) for s in steps) + " | final (full val) |")
    print("|---|" + "---|" * (len(steps) + 1))
    for r in (a, b):
        cells = [f"{_at(r['val'], s):.3f}" if _at(r["val"], s) is not None else "-"
                 for s in steps]
        print(f"| {r['name']} validation loss | " + " | ".join(cells)
              + f" | {r['final_val_loss']:.3f} |")
    print(f"\ndense source after {args.dense_steps} steps: validation loss "
          f"{runs['dense']['final_val_loss']:.3f}; figure: {out / 'bench_surgery.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
