"""Long-context evaluation: RULER-style NIAH, passkey, MQAR and variable tracking on a checkpoint.

    python -m aiinfra_jax.eval.longctx --checkpoint RUN_DIR --tasks niah_single_1,niah_multikey_1 \
        --lengths 1k,2k,4k --depths 11 --samples 4 [--batch-size 8] [--out DIR] [--step N]
        [--branches-off cmp,slc]

--branches-off (NSA models only) fixes the named branches' gates at 0 in every layer, to measure
what each branch carries; the default output folder then ends in ``_without_<branches>``.

Writes into --out (default RUN_DIR/longctx/step_<N>):
  samples.jsonl        one record per (task, length, depth, sample): answers, prediction, scores
  results.json         accuracy by task and length, by depth, the NIAH average, timing
  results.md           the same as markdown tables
  heatmap_<task>.png   depth (y) x context length (x), red (0) to green (1)

Every example is generated offline (``aiinfra_jax.tasks``) at exactly its length in tokens of
the run's tokenizer; generation is batched greedy decoding through the model's own prefill and
cached decode (``aiinfra_jax.generate.prefill`` / ``decode_step``), so every registered mixer works
without special cases. A length that, with the answer budget, exceeds ``model.max_seq_len`` is
refused before any model work.

The answering side is pluggable (``Answerer``, in ``aiinfra_jax.eval.answerers``, re-exported
here): ``ModelAnswerer`` runs a model; any object with its call can stand in (the tests check the
scoring path with stubs that score 100% and ~0%). Inside training, the in-loop hook
(``aiinfra_jax.eval.longctx_hook``) calls ``longctx_scores(model, tokenizer, cfg)``, which returns a
flat dict of scores to log.

Letters: B batch of prompts, T prompt tokens, N new tokens (the answer budget).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from aiinfra_jax.config import ConfigError, load_run_config
from aiinfra_jax.errors import add_debug_flag, report_error
from aiinfra_jax.data import load_tokenizer
from aiinfra_jax.eval.answerers import Answerer, ModelAnswerer
from aiinfra_jax.load import load_model
from aiinfra_jax.metrics import ProgressBar
from aiinfra_jax.models.attention.nsa import check_branches, require_nsa, with_branches_off
from aiinfra_jax.tasks import (NIAH_TASKS, Example, check_task_options, expand_tasks,
                               make_task_example, parse_task_options, score)


# ----------------------------------------------------------------------------- configuration


def parse_length(text: str | int) -> int:
    """"4k" -> 4096, "1536" -> 1536, "0.5k" -> 512, "1m" -> 1048576."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        return int(text)
    t = str(text).strip().lower()
    unit = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if unit > 1 else t) * unit
    except ValueError as e:
        raise ValueError(f"length {text!r}: expected tokens like 1024, 1k or 1m") from e
    if value != int(value) or value < 1:
        raise ValueError(f"length {text!r}: must be a positive whole number of tokens")
    return int(value)


def format_length(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}m"
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def parse_depths(text: str) -> tuple[float, ...]:
    """"11" -> 11 depths evenly spaced over 0-100%; "0,50,100" -> those percentages."""
    t = text.strip()
    if "," not in t and t.isdigit():
        n = int(t)
        if n < 1:
            raise ValueError(f"--depths {text!r}: the number of depths must be >= 1")
        return (0.5,) if n == 1 else tuple(round(float(x), 6) for x in np.linspace(0, 1, n))
    try:
        pct = [float(x) for x in t.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--depths {text!r}: give a count (11) or percentages (0,25,50)") from e
    return tuple(p / 100 for p in pct)


@dataclasses.dataclass(frozen=True)
class LongCtxConfig:
    """The evaluation grid and how it runs.

    tasks: task names or groups ("niah", "all"); lengths: prompt tokens; depths: fractions in
    [0, 1]; samples: examples per (task, length, depth), sample s uses seed ``seed * 1_000_003 + s``
    (the same keys and values at every length and depth); batch_size: prompts per generate call;
    answer_margin: decode budget beyond the longest expected answer and its EOS; prefill_chunk:
    prompt chunk of the prefill (None = one chunk); teacher_forced: also score the expected answer
    under teacher forcing where the answerer can (``answer_nll``: mean negative log-likelihood per
    answer token, EOS included; ``answer_token_acc``: share of answer tokens that are the greedy
    choice given the true prefix). Exact match stays at 0 until a whole answer is right; these two
    move as soon as the model starts to copy, so they show a run's progress on the way.
    task_options: {task: {option: value}} for the tasks' generators (e.g. {"copy": {"num_chars":
    8}}, {"mqar": {"num_pairs": 4}}), the options ``synthetic:<task>:...`` takes in training.
    """

    tasks: tuple[str, ...] = NIAH_TASKS
    lengths: tuple[int, ...] = (1024,)
    depths: tuple[float, ...] = tuple(round(float(x), 6) for x in np.linspace(0, 1, 11))
    samples: int = 1
    seed: int = 0
    batch_size: int = 8
    answer_margin: int = 4
    prefill_chunk: int | None = None
    teacher_forced: bool = True
    task_options: Any = ()   # a dict, stored as sorted ((task, ((key, value), ...)), ...)

    def __post_init__(self):
        try:
            object.__setattr__(self, "tasks", expand_tasks(self.tasks))
        except ValueError as e:
            raise ValueError(f"LongCtxConfig.tasks={self.tasks!r}: {e}") from e
        if isinstance(self.lengths, (int, str)):
            object.__setattr__(self, "lengths", (self.lengths,))
        try:
            lengths = tuple(parse_length(x) for x in self.lengths)
        except ValueError as e:
            raise ValueError(f"LongCtxConfig.lengths={self.lengths!r}: {e}") from e
        if not lengths:
            raise ValueError("LongCtxConfig.lengths=(): give at least one length, e.g. (1024,)")
        object.__setattr__(self, "lengths", tuple(sorted(set(lengths))))
        depths = tuple(float(d) for d in self.depths)
        if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
            raise ValueError(f"LongCtxConfig.depths={self.depths!r}: give fractions in [0, 1]")
        object.__setattr__(self, "depths", tuple(sorted(set(depths))))
        for name, low in (("samples", 1), ("seed", 0), ("batch_size", 1), ("answer_margin", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"LongCtxConfig.{name}={v!r}: must be an int >= {low}")
        options = dict(self.task_options)
        for task, opts in options.items():
            if task not in self.tasks:
                raise ValueError(f"LongCtxConfig.task_options: options for {task!r}, which is not "
                                 f"among the tasks {list(self.tasks)}")
            check_task_options(task, dict(opts), "LongCtxConfig.task_options")
        object.__setattr__(self, "task_options", tuple(sorted(
            (task, tuple(sorted(dict(opts).items()))) for task, opts in options.items())))
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int)
                                               or self.prefill_chunk < 1):
            raise ValueError(f"LongCtxConfig.prefill_chunk={self.prefill_chunk!r}: a positive "
                             "int or None")


def small_grid(lengths: Sequence[int] = (256,), tasks: Sequence[str] = NIAH_TASKS,
               depths: Sequence[float] = (0.0, 0.5, 1.0), samples: int = 1,
               batch_size: int = 8) -> LongCtxConfig:
    """A grid small enough to run inside training (the default: 8 tasks x 3 depths x 1 sample)."""
    return LongCtxConfig(tasks=tuple(tasks), lengths=tuple(lengths), depths=tuple(depths),
                         samples=samples, batch_size=batch_size, answer_margin=2)


def build_examples(tokenizer: Any, cfg: LongCtxConfig) -> list[Example]:
    """Every example of the grid, ordered by (task, length, depth, sample)."""
    options = {task: dict(opts) for task, opts in cfg.task_options}
    return [make_task_example(tokenizer, task, length, depth, cfg.seed * 1_000_003 + s,
                              **options.get(task, {}))
            for task in cfg.tasks for length in cfg.lengths for depth in cfg.depths
            for s in range(cfg.samples)]


def answer_budgets(examples: Sequence[Example], cfg: LongCtxConfig) -> dict[int, int]:
    """Decode budget N per length: the longest answer at that length + EOS + the margin (one N per
    length, so every task of a length shares the compiled programs)."""
    out: dict[int, int] = {}
    for ex in examples:
        out[ex.length] = max(out.get(ex.length, 0), ex.target_tokens.size + 1 + cfg.answer_margin)
    return out


def check_lengths(budgets: dict[int, int], max_seq_len: int | None) -> None:
    """Raises before any work if a length plus its answer budget exceeds max_seq_len."""
    if max_seq_len is None:
        return
    bad = {n: n + b for n, b in budgets.items() if n + b > max_seq_len}
    if bad:
        worst = ", ".join(f"{format_length(n)} + {budgets[n]} answer tokens = {t}"
                          for n, t in sorted(bad.items()))
        raise ValueError(f"context lengths too long for this model: {worst} exceed "
                         f"model.max_seq_len={max_seq_len} (the longest prompt + answer its cache "
                         f"holds); use lengths <= {max_seq_len - max(budgets.values())}")


# ----------------------------------------------------------------------------- answerers
# Answerer and ModelAnswerer live in aiinfra_jax.eval.answerers;
# imported above and re-exported here, where the runner and its callers have always found them.
__all__ = ["Answerer", "LongCtxConfig", "ModelAnswerer",
           "longctx_scores", "main", "run_longctx", "small_grid"]


# ----------------------------------------------------------------------------- the runner


def _prediction_text(tokenizer: Any, tokens: list[int]) -> str:
    eos = tokenizer.eos_id
    if eos in tokens:
        tokens = tokens[:tokens.index(eos)]
    return tokenizer.decode(tokens)


def run_longctx(answerer: Answerer, tokenizer: Any, cfg: LongCtxConfig, *,
                out_dir: str | Path | None = None, max_seq_len: int | None = None,
                progress: bool = True, meta: dict[str, Any] | None = None,
                examples: list[Example] | None = None) -> dict[str, Any]:
    """Runs the grid through ``answerer``; returns the results dict (also written to out_dir).

    max_seq_len: refuse lengths that do not fit (None = the answerer's ``max_seq_len``, if any).
    """
    if max_seq_len is None:
        max_seq_len = getattr(answerer, "max_seq_len", None)
    if max_seq_len is not None and max(cfg.lengths) >= max_seq_len:
        check_lengths({n: 1 for n in cfg.lengths}, max_seq_len)
    if examples is None:
        examples = build_examples(tokenizer, cfg)
    budgets = answer_budgets(examples, cfg)
    check_lengths(budgets, max_seq_len)

    # Batches mix tasks and depths of one length (one decode budget per length, so they share the
    # compiled programs); only the last batch of each length is padded.
    groups: dict[int, list[int]] = defaultdict(list)
    for i, ex in enumerate(examples):
        groups[ex.length].append(i)
    batches = [idx[k:k + cfg.batch_size] for idx in groups.values()
               for k in range(0, len(idx), cfg.batch_size)]
    calls = []
    for idx in batches:
        batch = [examples[i] for i in idx]
        padded = batch + [batch[-1]] * (cfg.batch_size - len(batch))  # fixed shapes
        calls.append((batch, padded, budgets[batch[0].length]))
    out_path = Path(out_dir) if out_dir is not None else None
    jsonl = None
    if out_path is not None:
        out_path.mkdir(parents=True, exist_ok=True)
        jsonl = (out_path / "samples.jsonl").open("w")
    bar = None
    if progress:
        bar = ProgressBar(len(calls), desc="longctx", interval_s=10.0)
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        plan = getattr(answerer, "plan", None)  # inside the wall time: it is part of the run
        if plan is not None:
            plan([(padded, max_new) for _, padded, max_new in calls])
        for n_done, (batch, padded, max_new) in enumerate(calls, start=1):
            generated = answerer(padded, max_new)
            if len(generated) != len(padded):
                raise ValueError(f"answerer returned {len(generated)} rows for {len(padded)} "
                                 "prompts")
            forced = None
            if cfg.teacher_forced and hasattr(answerer, "teacher_forced"):
                forced = answerer.teacher_forced(padded)
            for j, (ex, toks) in enumerate(zip(batch, generated)):
                toks = [int(t) for t in toks]
                pred = _prediction_text(tokenizer, toks)
                rec = {"task": ex.task, "length": ex.length, "depth": ex.depth,
                       "sample": (ex.seed - cfg.seed * 1_000_003), "seed": ex.seed,
                       "answers": list(ex.answers), "prediction": pred, "metric": ex.metric,
                       **score(pred, ex.answers, ex.metric), "generated_tokens": len(toks)}
                if forced is not None:
                    rec["answer_nll"], rec["answer_token_acc"] = forced[j]
                records.append(rec)
                if jsonl is not None:
                    jsonl.write(json.dumps(rec) + "\n")
            if bar is not None:
                done = sum(r["score"] for r in records) / len(records)
                bar.update(n_done, accuracy=done)
    finally:
        if jsonl is not None:
            jsonl.close()
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - start
    result = summarize(records, cfg)
    timing = {"wall_s": wall, "examples": len(records)}
    t = getattr(answerer, "timing", None)
    if t:
        timing.update(t)
        timing["prefill_tokens_per_s"] = (t["prefill_tokens"] / t["prefill_s"]
                                          if t["prefill_s"] > 0 else None)
        timing["decode_tokens_per_s"] = (t["decode_tokens"] / t["decode_s"]
                                         if t["decode_s"] > 0 else None)
    result["timing"] = timing
    result["meta"] = dict(meta or {})
    if out_path is not None:
        write_outputs(result, out_path)
    return result


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else math.nan


def _task_length_table(records: Sequence[dict[str, Any]], key: str, cfg: LongCtxConfig
                       ) -> dict[str, dict[str, float]]:
    """{task: {str(length): mean of record[key], ..., "mean": mean over the lengths}}."""
    vals: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in records:
        vals[(r["task"], r["length"])].append(r[key])
    table = {t: {str(n): _mean(vals[(t, n)]) for n in cfg.lengths} for t in cfg.tasks}
    for row in table.values():
        row["mean"] = _mean([row[str(n)] for n in cfg.lengths])
    return table


def summarize(records: Sequence[dict[str, Any]], cfg: LongCtxConfig) -> dict[str, Any]:
    """Accuracy (mean primary score) by task x length, by task x depth x length, NIAH average."""
    by_tdl: dict[tuple[str, float, int], list[float]] = defaultdict(list)
    for r in records:
        by_tdl[(r["task"], r["depth"], r["length"])].append(r["score"])
    acc = _task_length_table(records, "score", cfg)
    by_depth = {t: {f"{d:g}": {str(n): _mean(by_tdl[(t, d, n)]) for n in cfg.lengths}
                    for d in cfg.depths} for t in cfg.tasks}
    niah = [t for t in cfg.tasks if t in NIAH_TASKS]
    niah_avg = niah_by_depth = None
    if niah:
        niah_avg = {str(n): _mean([acc[t][str(n)] for t in niah]) for n in cfg.lengths}
        niah_avg["mean"] = _mean([niah_avg[str(n)] for n in cfg.lengths])
        niah_by_depth = {f"{d:g}": {str(n): _mean([by_depth[t][f"{d:g}"][str(n)] for t in niah])
                                    for n in cfg.lengths} for d in cfg.depths}
    forced = {key: _task_length_table(records, key, cfg)
              for key in ("answer_nll", "answer_token_acc")
              if records and all(key in r for r in records)}
    return {"tasks": list(cfg.tasks), "lengths": list(cfg.lengths), "depths": list(cfg.depths),
            "samples": cfg.samples, "seed": cfg.seed, "accuracy": acc, "niah_average": niah_avg,
            "niah_tasks": niah, "by_depth": by_depth, "niah_average_by_depth": niah_by_depth,
            **forced}


def markdown_table(result: dict[str, Any]) -> str:
    lengths = result["lengths"]
    head = "| task | " + " | ".join(format_length(n) for n in lengths) + " | mean |"
    rule = "|" + "---|" * (len(lengths) + 2)
    rows = [head, rule]

    def cells(d):
        return " | ".join(f"{100 * d[str(n)]:.1f}" for n in lengths) + f" | {100 * d['mean']:.1f}"

    for t in result["tasks"]:
        rows.append(f"| {t} | {cells(result['accuracy'][t])} |")
    if result.get("niah_average"):
        rows.append(f"| **NIAH average ({len(result['niah_tasks'])} variants)** | "
                    f"{cells(result['niah_average'])} |")
    lines = ["Accuracy (%) by task and context length (tokens):", ""] + rows
    if "answer_nll" in result:
        lines += ["", "Teacher-forced answer tokens (the expected answer fed in): mean NLL (nats) "
                  "/ greedy token accuracy (%):", "", head, rule]
        for t in result["tasks"]:
            nll, tacc = result["answer_nll"][t], result["answer_token_acc"][t]
            lines.append(f"| {t} | " + " | ".join(
                f"{nll[k]:.2f} / {100 * tacc[k]:.0f}" for k in [str(n) for n in lengths] + ["mean"])
                + " |")
    tm = result.get("timing") or {}
    if tm:
        lines += ["", f"Wall time {tm['wall_s']:.1f} s for {tm['examples']} examples."]
        if tm.get("prefill_tokens_per_s"):
            lines.append(f"Prefill: {tm['prefill_tokens']} tokens in {tm['prefill_s']:.2f} s = "
                         f"{tm['prefill_tokens_per_s']:.0f} tokens/s; decode: "
                         f"{tm['decode_tokens']} tokens in {tm['decode_s']:.2f} s = "
                         f"{(tm.get('decode_tokens_per_s') or 0):.0f} tokens/s"
                         + (f"; teacher-forced answer scores {tm['answer_scores_s']:.2f} s"
                            if tm.get("answer_scores_s") else "")
                         + (f" (the first batch of each of {tm['warmup_calls']} compiled "
                            f"shapes, {tm['warmup_s']:.1f} s with its compilation, excluded)."
                            if tm.get("warmup_s") else "."))
        elif tm.get("warmup_calls"):
            lines.append(f"No rates: every batch was the first of its compiled shape "
                         f"({tm['warmup_calls']} shapes, {tm['warmup_s']:.1f} s with compilation). "
                         "More examples per length give timed batches; --no-warmup times them all, "
                         "compilation included.")
    return "\n".join(lines) + "\n"


def write_heatmap(result: dict[str, Any], task: str, path: str | Path) -> None:
    """Depth (y, 0% at the top) x context length (x) accuracy, red (0) to green (1). task
    "niah_average" draws the mean over the NIAH variants (result["niah_average_by_depth"])."""
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    lengths, depths = result["lengths"], result["depths"]
    cells = (result["niah_average_by_depth"] if task == "niah_average"
             else result["by_depth"][task])
    grid = np.array([[cells[f"{d:g}"][str(n)] for n in lengths] for d in depths], float)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.4 * len(depths)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [format_length(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{task}: mean {100 * np.nanmean(grid):.1f}%")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not math.isnan(grid[i, j]):
                ax.text(j, i, f"{100 * grid[i, j]:.0f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def prepare_out(out: Path, overwrite: bool) -> None:
    """Refuses an output folder that holds files, unless `overwrite` and it is an earlier
    evaluation's (results.json or samples.jsonl), which is then removed whole: a grid never
    mixes with another's heatmaps or samples."""
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"{out} already holds files (an earlier evaluation's results?); pass "
                          "another --out, or --overwrite to replace them")
    if not ((out / "results.json").exists() or (out / "samples.jsonl").exists()):
        raise ConfigError(f"--overwrite: {out} holds files but no results.json or samples.jsonl, "
                          "so it is not a longctx output folder; nothing is deleted")
    shutil.rmtree(out)


def write_outputs(result: dict[str, Any], out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(markdown_table(result))
    for task in result["tasks"]:
        write_heatmap(result, task, out / f"heatmap_{task}.png")
    if result.get("niah_average_by_depth"):
        write_heatmap(result, "niah_average", out / "heatmap_niah_average.png")


# ----------------------------------------------------------------------------- in-loop hook


def longctx_scores(model: Any, tokenizer: Any, cfg: LongCtxConfig | None = None
                   ) -> dict[str, float]:
    """Scores of ``model`` on a small grid, as a flat dict to log with the training metrics:
    "longctx/<task>@<length>", "longctx/niah_avg@<length>" and "longctx/niah_avg" (0-1).

    ``model`` is the nnx model (``Trainer.model(params)`` builds it from a state); ``cfg``
    defaults to ``small_grid()``. No files, no progress bar.
    """
    cfg = small_grid() if cfg is None else cfg
    answerer = ModelAnswerer(model, tokenizer, prefill_chunk=cfg.prefill_chunk,
                             score_answers=cfg.teacher_forced)
    res = run_longctx(answerer, tokenizer, cfg, progress=False)
    out: dict[str, float] = {}
    for t in cfg.tasks:
        for n in cfg.lengths:
            out[f"longctx/{t}@{format_length(n)}"] = res["accuracy"][t][str(n)]
            if "answer_nll" in res:
                out[f"longctx/{t}@{format_length(n)}/answer_nll"] = res["answer_nll"][t][str(n)]
    if res["niah_average"]:
        for n in cfg.lengths:
            out[f"longctx/niah_avg@{format_length(n)}"] = res["niah_average"][str(n)]
        out["longctx/niah_avg"] = res["niah_average"]["mean"]
    return out


# ----------------------------------------------------------------------------- CLI


def _parse_task_options(items: Sequence[str]) -> dict[str, dict[str, int | float]]:
    """--task-options TASK:key=value,... (repeatable) -> {task: {key: value}}."""
    out: dict[str, dict[str, int | float]] = {}
    for item in items:
        task, colon, text = item.partition(":")
        if not colon or not text:
            raise ValueError(f"--task-options {item!r}: expected TASK:key=value,..., e.g. "
                             "copy:num_chars=8")
        out.setdefault(task, {}).update(parse_task_options(task, text))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a run directory printed by train.py")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    ap.add_argument("--tasks", default="niah", help="comma-separated tasks or groups (niah, all)")
    ap.add_argument("--lengths", default="1k", help="context lengths in tokens, e.g. 1k,2k,4k")
    ap.add_argument("--depths", default="11",
                    help="a count (evenly spaced 0-100%%), or comma-separated percents; one "
                         "percent alone needs a trailing comma: 50, (50 is fifty depths)")
    ap.add_argument("--samples", type=int, default=1, help="examples per (task, length, depth)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=None)
    ap.add_argument("--no-warmup", action="store_true",
                    help="rates over every batch, compilation included (default: the first batch "
                         "of each compiled shape is timed apart)")
    ap.add_argument("--no-teacher-forced", action="store_true",
                    help="skip the teacher-forced answer NLL / token accuracy (one forward pass "
                         "per batch)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", default=None, help="output folder (default RUN_DIR/longctx/step_N)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier evaluation's results in --out (else refused)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="overrides of the run's config: mesh, data, and the model's run-time "
                         "settings (e.g. model.nsa.implementation=xla)")
    ap.add_argument("--task-options", action="append", default=[], metavar="TASK:KEY=VALUE,...",
                    help="options of a task's generator, as synthetic:<task>:... takes them in "
                         "training (repeatable), e.g. copy:num_chars=8 or mqar:num_pairs=4")
    ap.add_argument("--branches-off", default="", metavar="cmp,slc,win",
                    help="NSA only: evaluate with these branches' gates fixed at 0")
    add_debug_flag(ap)
    args = ap.parse_args(argv)

    try:
        cfg = LongCtxConfig(tasks=tuple(args.tasks.split(",")),
                            lengths=tuple(args.lengths.split(",")),
                            depths=parse_depths(args.depths),
                            samples=args.samples, seed=args.seed, batch_size=args.batch_size,
                            prefill_chunk=args.prefill_chunk,
                            teacher_forced=not args.no_teacher_forced,
                            task_options=_parse_task_options(args.task_options))
        run_dir = Path(args.checkpoint)
        run_cfg = load_run_config(run_dir, args.overrides)
        branches_off = tuple(b for b in args.branches_off.split(",") if b)
        if branches_off:
            require_nsa(run_cfg.model.mixers, "--branches-off")
            check_branches(branches_off)
        tokenizer = load_tokenizer(run_cfg.data.tokenizer)
        # Everything that can be refused is refused before the checkpoint is loaded.
        examples = build_examples(tokenizer, cfg)
        check_lengths(answer_budgets(examples, cfg), run_cfg.model.max_seq_len)
        loaded = load_model(run_dir, step=args.step, overrides=args.overrides)
        model = loaded.model
        if branches_off:
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            model = nnx.merge(graphdef, with_branches_off(params, branches_off), rest)
        step = loaded.step
        suffix = f"_without_{'_'.join(branches_off)}" if branches_off else ""
        out = Path(args.out) if args.out else run_dir / "longctx" / f"step_{step}{suffix}"
        prepare_out(out, args.overwrite)
        answerer = ModelAnswerer(model, loaded.tokenizer, prefill_chunk=cfg.prefill_chunk,
                                 warmup=not args.no_warmup, score_answers=cfg.teacher_forced)
        meta = {"run_dir": str(run_dir), "step": step,
                "mixers": list(loaded.config.model.mixers), "branches_off": list(branches_off),
                "tokenizer": run_cfg.data.tokenizer, "command": " ".join(sys.argv)}
        result = run_longctx(answerer, loaded.tokenizer, cfg, out_dir=out,
                             progress=not args.no_progress, meta=meta, examples=examples)
    except BaseException as e:  # noqa: BLE001 -- a bug is re-raised with its traceback
        status = report_error(e, debug=args.debug, expected=(FileNotFoundError, ValueError))
        if status is None:
            raise
        return status
    print(markdown_table(result))
    print(f"outputs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
