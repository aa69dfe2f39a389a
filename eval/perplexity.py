"""Perplexity of a checkpoint on any data source, overall and by token-position bucket.

    python -m aiinfra_jax.eval.perplexity --checkpoint runs/tiny [--step N] [--batches 0]
        [--split validation] [--set data.sources=path/to/texts] [--set data.seq_len=512]
        [--out results.json]

The per-position buckets split each row's positions (the token's position within its document) into
equal ranges: a model that uses long context has lower loss in the later buckets. The training loop
computes the same numbers at the end of every run (aiinfra_jax.steps.make_eval_step).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from aiinfra_jax.errors import add_debug_flag, report_error
from aiinfra_jax.rundir import restore_run


def evaluate_checkpoint(run_dir, *, step=None, overrides=(), batches: int = 0,
                        split: str = "validation") -> dict:
    trainer, state = restore_run(run_dir, step=step, overrides=overrides)
    _, jeval = trainer.compiled_steps()
    result = trainer.evaluate(state, jeval, batches, split=split)
    result.update({"run_dir": str(run_dir), "step": int(state["step"]), "split": split,
                   "sources": list(trainer.cfg.data.sources), "seq_len": trainer.cfg.data.seq_len})
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a run directory printed by train.py")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    ap.add_argument("--batches", type=int, default=0, help="batches to evaluate (0 = whole split)")
    ap.add_argument("--split", default="validation", choices=("train", "validation"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="data/mesh overrides, e.g. --set data.sources=my_texts/")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    try:
        res = evaluate_checkpoint(args.checkpoint, step=args.step, overrides=args.overrides,
                                  batches=args.batches, split=args.split)
    except BaseException as e:  # noqa: BLE001 -- a bug is re-raised with its traceback
        status = report_error(e, debug=args.debug, expected=(FileNotFoundError, ValueError))
        if status is None:
            raise
        return status
    print(f"{res['split']} loss {res['loss']:.4f}  perplexity {res['perplexity']:.3f}  "
          f"({res['tokens']} tokens in {res['batches']} batches, step {res['step']})")
    if args.batches and res["batches"] < args.batches:
        print(f"note: the {res['split']} split ended after {res['batches']} of the "
              f"{args.batches} batches asked for")
    for b in res["by_position"]:
        loss = f"{b['loss']:.4f}" if b["loss"] is not None else "n/a"
        print(f"  positions {b['positions'][0]:>6}-{b['positions'][1]:<6} loss {loss}  "
              f"({b['tokens']} tokens)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
