"""Gated DeltaNet / KDA quality against attention (issue 22): dense, NSA, GDN, the GDN+NSA hybrid
and KDA, each a tiny preset trained the same 300 steps x 16 x 256 tokens of the embedded corpus, and
dense and NSA with a short convolution as controls.

    python -m aiinfra_jax.eval.bench_recurrent [--out-dir runs/bench_recurrent] [--long 1024]
        [--matched]
    make bench-recurrent

--matched trains MATCHED_RUNS instead (into runs/bench_recurrent_matched by default): the five
models at one parameter count (the hybrid preset's), dense and NSA with the short convolution.

Trains (or reads, when an earlier invocation finished them) the seven runs with validation every 50
steps (QUALITY_RUNS; 7-27 min each on 2 cores), then prints, and writes to --out-dir as
bench_recurrent.json and bench_recurrent.png:
  * the validation loss curves and each run's final validation (32 batches of 256 tokens);
  * loss by position beyond the training length: --long-batches batches (x the preset's 16 rows)
    of the validation split cut into rows of --long tokens (the models were trained on 256), the
    loss in four position buckets. Attention
    with RoPE meets positions it never saw; a recurrent state has no positions, so the later
    buckets show which models hold up past their training length.
The parameter counts are the models' own. The long-context task scores (MQAR, NIAH through
eval.longctx) need models trained on those tasks (configs/longctx_tiny.py's mix), not these
corpus-only runs: untrained on the format, every model scores ~0 there.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

QUALITY_RUNS = (  # name, preset, overrides
    ("dense", "tiny.py", []),
    ("nsa", "nsa_tiny.py", []),
    ("gdn", "gdn_tiny.py", []),
    ("hybrid", "hybrid_tiny.py", []),
    ("kda", "kda_tiny.py", []),
    # Controls: the attention presets with a width-4 causal convolution (models/short_conv.py),
    # since the gated-delta mixers carry one on q, k and v.
    ("dense_conv", "tiny.py", ["model.short_conv=4"]),
    ("nsa_conv", "nsa_tiny.py", ["model.short_conv=4"]),
)

# --matched: every model at the hybrid preset's 3.83M parameters (each within 0.1%, by the FFN
# width alone), dense and NSA with the width-4 short convolution the gated-delta mixers carry.
MATCHED_PARAMS = 3_832_548
MATCHED_RUNS = (
    ("dense_conv", "tiny.py", ["model.short_conv=4", "model.d_ff=925"]),
    ("nsa_conv", "nsa_tiny.py", ["model.short_conv=4", "model.d_ff=566"]),
    ("gdn", "gdn_tiny.py", ["model.d_ff=749"]),
    ("hybrid", "hybrid_tiny.py", []),
    ("kda", "kda_tiny.py", ["model.d_ff=708"]),
)


def main(argv=None) -> int:
    from aiinfra_jax.eval.perplexity import evaluate_checkpoint
    from aiinfra_jax.eval.runs import plot_curves, train_or_read, value_at

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="runs/bench_recurrent")
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: the presets' 300)")
    ap.add_argument("--long", type=int, default=1024, help="row length of the beyond-training-"
                    "length evaluation (0: skip it)")
    ap.add_argument("--long-batches", type=int, default=8)
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ap.add_argument("--matched", action="store_true", help="the parameter-matched set "
                    "(MATCHED_RUNS) instead of the presets as they are")
    args = ap.parse_args(argv)
    if args.matched and args.out_dir == ap.get_default("out_dir"):
        args.out_dir += "_matched"
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    extra = ["eval.every=50"] + ([f"run.steps={args.steps}"] if args.steps else [])
    chosen = [r for r in (MATCHED_RUNS if args.matched else QUALITY_RUNS)
              if not args.only or r[0] in args.only.split(",")]
    runs = {name: train_or_read(name, preset, out, extra + over) for name, preset, over in chosen}
    for r in runs.values():
        summary = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        r["params"] = summary["params"]
        r["by_position"] = summary["validation"]["by_position"]
        if args.long:
            long = evaluate_checkpoint(r["run_dir"], overrides=[f"data.seq_len={args.long}"],
                                       batches=args.long_batches)
            r["long"] = {"loss": long["loss"], "by_position": long["by_position"]}
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(["python -m aiinfra_jax.eval.bench_recurrent"] + sys.argv[1:]),
              "runs": runs}
    (out / "bench_recurrent.json").write_text(json.dumps(result, indent=1))
    plot_curves(runs, out / "bench_recurrent.png",
                title="Dense vs NSA vs GDN vs GDN+NSA hybrid vs KDA, "
                + ("3.83M parameters each" if args.matched else "tiny presets"),
                xlabel="training step (16 x 256 tokens)")
    steps = sorted({s for r in runs.values() for s, _ in r["val"]})
    print("\n| model | params | " + " | ".join(f"val @{s}" for s in steps)
          + " | final validation (32 batches) |")
    print("|---|---|" + "---|" * (len(steps) + 1))
    for name, r in runs.items():
        cells = [f"{value_at(r['val'], s):.3f}" if value_at(r["val"], s) is not None else "-"
                 for s in steps]
        print(f"| {name} | {r['params'] / 1e6:.2f}M | " + " | ".join(cells)
              + f" | {r['final_val_loss']:.4f} |")
    if args.long:
        buckets = next(iter(runs.values()))["long"]["by_position"]
        print(f"\nrows of {args.long} tokens (trained on 256): validation loss by position")
        print("| model | " + " | ".join(f"{b['positions'][0]}-{b['positions'][1]}"
                                        for b in buckets) + " | all |")
        print("|---|" + "---|" * (len(buckets) + 1))
        for name, r in runs.items():
            print(f"| {name} | " + " | ".join(f"{b['loss']:.3f}" for b in r["long"]["by_position"])
                  + f" | {r['long']['loss']:.3f} |")
    print(f"\nfigure: {out / 'bench_recurrent.png'}; numbers: {out / 'bench_recurrent.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
