"""Synthetic long-context task sources for training: ``synthetic:<task>[:key=value,...]``.

    DataConfig(sources=("embedded", "synthetic:niah", "synthetic:mqar"), weights=(0.4, 0.4, 0.2))

``<task>`` is a task of ``aiinfra_jax.tasks`` (niah_single_1 ... niah_multiquery, passkey,
mqar, variable_tracking) or a group ("niah": the eight NIAH variants in turn, "all": every task in
turn). ``synthetic:msa_<task>`` (``msa_niah``) is another kind: whole pre-packed multi-document
rows for the MSA mixer, with their own options (``aiinfra_jax.data.synthetic_msa``).
Document i is the task's example with seed 2**40 + seed * 2**32 + i (never an evaluation seed),
at a length drawn uniformly from [min_length, max_length] and a depth drawn uniformly from
[min_depth, max_depth] (default [0, 1]), pre-tokenised as ``[BOS] + prompt + answer + [EOS]``,
with loss weight ``answer_weight`` on the answer and EOS (and on the recalled values of MQAR's
inline queries) and ``context_weight`` elsewhere. Every document fits one row (at most seq_len + 1
tokens), so question and answer are never cut apart.

Options (comma-separated key=value after a second colon):
  n               documents in the source (default 1_000_000); the first ceil(n * val_fraction)
                  indices are the validation split, the rest train
  seed            base seed (default 0)
  min_length      shortest prompt in tokens (default: the task's minimum, at least 64)
  max_length      longest prompt in tokens (default: data.seq_len minus the answer)
  min_depth       shallowest needle depth, 0 = start of the haystack (default 0.0)
  max_depth       deepest needle depth, 1 = just before the question (default 1.0); with
                  ``data.stages``, a depth range that widens from 1 is a curriculum over the
                  distance between a needle and its question
  context_weight  loss weight of prompt tokens (default 0.0)
  answer_weight   loss weight of the answer tokens and EOS (default 1.0)
Any other key=value goes to the task's generator as a keyword option (an int where the value is
one, else a float), e.g. ``synthetic:mqar:num_queries=16`` (every key recalled inline, a denser
recall signal) or ``synthetic:variable_tracking:num_hops=2``; an option the generator does not take
is an error at construction.

The generators live in ``aiinfra_jax.tasks``, which this module and ``aiinfra_jax.eval`` both
import (the core never imports ``eval``).
Letters: L prompt tokens, A answer tokens, T = data.seq_len.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.data.sources import GeneratedSource, register_source
from aiinfra_jax.data.synthetic_msa import MSASource
from aiinfra_jax.data.tokenizer import load_tokenizer
from aiinfra_jax.tasks import (ContextTooShort, check_task_options, expand_tasks, make_task_example,
                               parse_number)

# Seeds probed at construction for a task's longest need (prompt + answer); see _check_fit.
PROBE_SEEDS = 32

# Training documents use example seeds >= 2**40; the evaluation grid uses seed * 1_000_003 + sample,
# so no evaluation example (for any seed < 10**6) is ever a training document.
TRAIN_SEED_BASE = 2**40
_INT_OPTIONS = ("n", "seed", "min_length", "max_length")
_FLOAT_OPTIONS = ("context_weight", "answer_weight", "min_depth", "max_depth")


@dataclasses.dataclass(frozen=True)
class SyntheticOptions:
    n: int = 1_000_000
    seed: int = 0
    min_length: int = 0  # 0 = the task's minimum (at least 64)
    max_length: int = 0  # 0 = seq_len minus the answer
    context_weight: float = 0.0
    answer_weight: float = 1.0
    min_depth: float = 0.0
    max_depth: float = 1.0
    task_options: tuple[tuple[str, int | float], ...] = ()  # keyword options of the generator

    def __post_init__(self):
        for name in ("n", "seed", "min_length", "max_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (1 if name == "n" else 0):
                raise ValueError(f"synthetic source option {name}={v!r} must be an int >= "
                                 f"{1 if name == 'n' else 0}")
        for name in _FLOAT_OPTIONS:
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"synthetic source option {name}={v!r} must be a finite number >= 0")
        if not 0.0 <= self.min_depth <= self.max_depth <= 1.0:
            raise ValueError(f"synthetic source options min_depth={self.min_depth!r}, max_depth="
                             f"{self.max_depth!r} must satisfy 0 <= min_depth <= max_depth <= 1")
        if self.answer_weight == 0 and self.context_weight == 0:
            raise ValueError("synthetic source: answer_weight and context_weight are both 0, so "
                             "nothing would be trained on")


def parse_spec(spec: str) -> tuple[str, SyntheticOptions]:
    """"synthetic:<task>[:k=v,...]" -> (task or group name, options)."""
    parts = spec.split(":", 2)
    if len(parts) < 2 or not parts[1]:
        raise ValueError(f"data source {spec!r}: expected 'synthetic:<task>[:key=value,...]', e.g. "
                         "'synthetic:niah' or 'synthetic:mqar:min_length=128'")
    kwargs: dict[str, Any] = {}
    task_options: dict[str, int | float] = {}
    if len(parts) == 3 and parts[2]:
        for item in parts[2].split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key.isidentifier():
                raise ValueError(f"data source {spec!r}: bad option {item!r}; options are key=value "
                                 f"({', '.join(_INT_OPTIONS + _FLOAT_OPTIONS)}, or a keyword "
                                 "option of the task's generator)")
            try:
                if key in _INT_OPTIONS:
                    kwargs[key] = int(value.replace("_", ""))
                elif key in _FLOAT_OPTIONS:
                    kwargs[key] = float(value)
                else:
                    task_options[key] = parse_number(value)
            except ValueError as e:
                raise ValueError(f"data source {spec!r}: option {key}={value!r} is not a number") from e
    return parts[1], SyntheticOptions(**kwargs, task_options=tuple(sorted(task_options.items())))


class SyntheticSource(GeneratedSource):
    """A DocumentSource of pre-tokenised task examples (see the module docstring)."""

    def __init__(self, spec: str, cfg: DataConfig):
        self.name = spec
        group, self.options = parse_spec(spec)
        self.tasks = expand_tasks([group])
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.seq_len = cfg.seq_len
        opts = self.options
        for t in self.tasks:  # a key neither of the source nor of the generator: a typo
            check_task_options(t, dict(opts.task_options), f"data source {spec!r}")
        shortest = {t: self._shortest_prompts(t) for t in self.tasks}
        # The floor of the prompt lengths drawn: the first probe's shortest prompt + 8, at least 64.
        self.min_length = {t: max(opts.min_length, 64, shortest[t][0] + 8) for t in self.tasks}
        for t in self.tasks:
            top = opts.max_length or cfg.seq_len
            if self.min_length[t] > top or self.min_length[t] >= cfg.seq_len:
                raise ValueError(
                    f"data source {spec!r}: task {t!r} needs prompts of at least "
                    f"{self.min_length[t]} tokens, which does not fit max_length={top} / "
                    f"data.seq_len={cfg.seq_len} with its answer; raise data.seq_len")
            self._check_fit(t, shortest[t])
        if opts.max_length > cfg.seq_len:
            raise ValueError(f"data source {spec!r}: max_length={opts.max_length} exceeds "
                             f"data.seq_len={cfg.seq_len}; documents must fit one row")

    def _make(self, task: str, length: int, depth: float, seed: int):
        return make_task_example(self.tokenizer, task, length, depth, seed,
                                 **dict(self.options.task_options))

    def _shortest_prompts(self, task: str) -> list[int]:
        """The shortest prompt (tokens) of the task's examples for the first PROBE_SEEDS evaluation
        seeds: the fixed parts (needles, question, keys) set it and vary with the example."""
        shortest = []
        for seed in range(PROBE_SEEDS):
            try:
                self._make(task, 1, 0.5, seed)
                shortest.append(1)
            except ContextTooShort as e:
                shortest.append(e.needed)
        return shortest

    def _check_fit(self, task: str, shortest: list[int]) -> None:
        """Refuse, at construction, a task whose longer examples would not fit one row with their
        answer: without this the error would come from the example that first fails, mid-run.
        shortest: _shortest_prompts(task); the answer is measured on the same probe seeds."""
        worst = 0
        for seed, needed in enumerate(shortest):
            length = max(needed, self.min_length[task])
            worst = max(worst, length + self._make(task, length, 0.5, seed).target_tokens.size + 1)
        if worst > self.seq_len + 1:
            raise ValueError(
                f"data source {self.name!r}: task {task!r} has examples needing {worst} tokens "
                f"(shortest prompt, answer and EOS) in a row of data.seq_len + 1 = "
                f"{self.seq_len + 1}; raise data.seq_len or drop the task from the source")

    def example(self, index: int):
        """The task example behind document ``index`` (fits seq_len + 1 with answer and EOS)."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}: document {index} out of range [0, {len(self)})")
        task = self.tasks[index % len(self.tasks)]
        rng = np.random.default_rng([self.options.seed, index, 7])
        lo = self.min_length[task]
        hi = max(lo, self.options.max_length or self.seq_len)
        length = int(rng.integers(lo, hi + 1))
        depth = float(rng.uniform(self.options.min_depth, self.options.max_depth))
        seed = TRAIN_SEED_BASE + self.options.seed * 2**32 + index
        try:
            ex = self._make(task, length, depth, seed)
        except ContextTooShort as e:  # this example's keys are longer than usual
            length = e.needed
            ex = self._make(task, length, depth, seed)
        overflow = length + ex.target_tokens.size + 1 - (self.seq_len + 1)
        if overflow > 0:  # the answer does not depend on the length, so one retry suffices
            if length - overflow < min(lo, length):
                raise ValueError(f"{self.name}: task {task!r} with its {ex.target_tokens.size}-"
                                 f"token answer does not fit data.seq_len={self.seq_len}; raise "
                                 "data.seq_len")
            ex = self._make(task, length - overflow, depth, seed)
        return ex

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        ex = self.example(index)
        opts = self.options
        tokens = np.concatenate([ex.prompt_tokens, ex.target_tokens,
                                 np.array([self.tokenizer.eos_id], np.int32)]).astype(np.int32)
        weights = np.full(tokens.size, opts.context_weight, np.float32)
        weights[ex.prompt_tokens.size:] = opts.answer_weight
        for start, end in ex.extra_weighted:
            weights[start:end] = opts.answer_weight
        return {"tokens": tokens, "loss_weights": weights}


@register_source("synthetic")
def _synthetic(spec: str, cfg: DataConfig) -> SyntheticSource | MSASource:
    if spec.startswith("synthetic:msa_"):  # whole rows for the MSA mixer (synthetic_msa)
        return MSASource(spec, cfg)
    return SyntheticSource(spec, cfg)
