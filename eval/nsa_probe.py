"""Where NSA's far route fails: does selection pick the needle's block, and do the gates use it?

    python -m aiinfra_jax.eval.nsa_probe --checkpoint runs/longctx_tiny --lengths 512 --depths 5 \
        [--tasks niah_single_1,niah_single_2,niah_single_3,passkey] [--samples 4] [--out probe.json]

For each example of the long-context grid (the same examples as ``aiinfra_jax.eval.longctx``), the
prompt and its expected answer are fed in one teacher-forced pass. At every position that predicts
an answer token, and in every NSA layer, it reads (the model's intermediates, through
``models.attention.nsa.branch_records``):
  hit     the share of KV heads whose selected blocks hold the prompt token to copy (the answer's
          first occurrence in the prompt, shifted by the answer token's index);
  chance  the share a selection would reach by picking its free blocks uniformly at random (forced
          blocks, the first n_init and the n_local last, count as hits when they hold the token);
  gates   the mean cmp / slc / win gates over the query heads.
Printed by depth and layer with the distance from the needle to the question and the answer NLL.
A far-route failure reads as: hit near chance (the compression scores do not find the needle) or
hit high with a low slc gate or a high NLL (the block is there, the selection branch does not copy
from it). Only tasks with one answer that appears verbatim in the prompt are probed.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from aiinfra_jax.config import load_run_config
from aiinfra_jax.errors import add_debug_flag, report_error
from aiinfra_jax.load import load_model
from aiinfra_jax.eval.longctx import LongCtxConfig, build_examples, parse_depths
from aiinfra_jax.kernels.block_selection.reference import forced_blocks
from aiinfra_jax.models.attention.nsa import branch_records, require_nsa

SINGLE_ANSWER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "passkey")


def copy_source(prompt: np.ndarray, target: np.ndarray) -> int:
    """Start of the target's first verbatim occurrence in the prompt (ValueError if none)."""
    p, t = prompt.tolist(), target.tolist()
    for i in range(len(p) - len(t) + 1):
        if p[i:i + len(t)] == t:
            return i
    raise ValueError("the expected answer does not appear verbatim in the prompt; probe tasks "
                     f"with one verbatim answer ({', '.join(SINGLE_ANSWER_TASKS)})")


def hit_shares(idx_tkn: np.ndarray, queries: np.ndarray, sources: np.ndarray,
               block_size: int) -> np.ndarray:
    """[len(queries)]: for query row queries[j], the share of KV heads whose selected blocks
    idx_tkn [T,K,n] (-1 = none) hold row sources[j]."""
    sel = idx_tkn[queries]                                         # [Q,K,n]
    return (sel == (sources // block_size)[:, None, None]).any(-1).mean(-1)


def chance_shares(queries: np.ndarray, sources: np.ndarray, *, block_size: int, n_selected: int,
                  n_init: int, n_local: int) -> np.ndarray:
    """[len(queries)]: the hit share of a selection that takes its forced blocks (the first n_init,
    the query's own and the n_local - 1 before it) and then free blocks uniformly at random."""
    out = np.empty(len(queries))
    for j, (q, s) in enumerate(zip(queries, sources)):
        own = q // block_size  # blocks 0..own are candidates (one document from row 0)
        forced = forced_blocks(own, 0, n_init=n_init, n_local=n_local)
        free_slots = max(0, min(n_selected, own + 1) - len(forced))
        out[j] = 1.0 if s // block_size in forced else free_slots / max(1, own + 1 - len(forced))
    return out


def probe(model: Any, examples: Sequence[Any], nsa_cfg: Any) -> list[dict[str, Any]]:
    """One record per example: task, length, depth, distance, answer_nll and per NSA layer
    hit / chance / gates (cmp, slc, win)."""
    out = []
    for ex in examples:
        prompt, target = np.asarray(ex.prompt_tokens), np.asarray(ex.target_tokens)
        src = copy_source(prompt, target)
        tokens = np.concatenate([prompt, target]).astype(np.int32)
        queries = np.arange(prompt.size - 1, tokens.size - 1)       # rows predicting the answer
        sources = src + np.arange(target.size)
        logits, _, aux = model(jnp.asarray(tokens)[None],
                               positions=jnp.arange(tokens.size, dtype=jnp.int32)[None],
                               capture_intermediates=True)
        records = [jax.tree.map(np.asarray, r) for r in branch_records(aux)]
        if not records:
            raise ValueError("the model has no NSA layer to probe (model.mixers has no 'nsa')")
        logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
        nll = float(-np.mean(logp[queries, tokens[queries + 1]]))
        chance = chance_shares(queries, sources, block_size=nsa_cfg.sel_block_size,
                               n_selected=nsa_cfg.n_selected, n_init=nsa_cfg.n_init,
                               n_local=nsa_cfg.n_local)
        layers = [{"hit": float(hit_shares(r["idx"][0], queries, sources,
                                           nsa_cfg.sel_block_size).mean()),
                   "chance": float(chance.mean()),
                   "gates": [float(g) for g in r["gates"][0][queries].mean((0, 1))]}
                  for r in records]
        out.append({"task": ex.task, "length": int(ex.length), "depth": float(ex.depth),
                    "distance": int(prompt.size - src), "answer_nll": nll, "layers": layers})
    return out


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means by (length, depth): distance, answer NLL and per layer hit / chance / gates."""
    groups: dict[tuple[int, float], list] = collections.defaultdict(list)
    for r in records:
        groups[(r["length"], r["depth"])].append(r)
    rows = []
    for (length, depth), rs in sorted(groups.items()):
        layers = []
        for i in range(len(rs[0]["layers"])):
            ls = [r["layers"][i] for r in rs]
            layers.append({"hit": float(np.mean([x["hit"] for x in ls])),
                           "chance": float(np.mean([x["chance"] for x in ls])),
                           "gates": np.mean([x["gates"] for x in ls], 0).round(4).tolist()})
        rows.append({"length": length, "depth": depth, "examples": len(rs),
                     "distance": float(np.mean([r["distance"] for r in rs])),
                     "answer_nll": float(np.mean([r["answer_nll"] for r in rs])),
                     "layers": layers})
    return {"rows": rows}


def format_summary(summary: dict[str, Any]) -> str:
    lines = ["| length | depth | distance | answer NLL | layer | hit / chance | gates cmp / slc / win |",
             "|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        for i, layer in enumerate(row["layers"]):
            head = (f"| {row['length']} | {row['depth']:.2f} | {row['distance']:.0f} | "
                    f"{row['answer_nll']:.2f} |" if i == 0 else "| | | | |")
            g = layer["gates"]
            lines.append(f"{head} {i} | {layer['hit']:.2f} / {layer['chance']:.2f} | "
                         f"{g[0]:.2f} / {g[1]:.2f} / {g[2]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a run directory printed by train.py")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    ap.add_argument("--tasks", default=",".join(SINGLE_ANSWER_TASKS))
    ap.add_argument("--lengths", default="512")
    ap.add_argument("--depths", default="5", help="a count (5) or percentages (0,25,50)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the records and the summary (JSON) here")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    try:
        tasks = tuple(args.tasks.split(","))
        unsupported = sorted(set(tasks) - set(SINGLE_ANSWER_TASKS))
        if unsupported:
            raise ValueError(f"--tasks: {unsupported} have several answers or none verbatim; "
                             f"choose from {', '.join(SINGLE_ANSWER_TASKS)}")
        cfg = LongCtxConfig(tasks=tasks, lengths=tuple(args.lengths.split(",")),
                            depths=parse_depths(args.depths), samples=args.samples)
        require_nsa(load_run_config(args.checkpoint).model.mixers, "eval.nsa_probe")
        loaded = load_model(args.checkpoint, step=args.step)
        examples = build_examples(loaded.tokenizer, cfg)
        records = probe(loaded.model, examples, loaded.config.model.nsa)
    except BaseException as e:  # noqa: BLE001 -- a bug is re-raised with its traceback
        status = report_error(e, debug=args.debug, expected=(FileNotFoundError, ValueError))
        if status is None:
            raise
        return status
    summary = summarize(records)
    print(format_summary(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"records": records, **summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
