"""The long-context evaluation as an in-loop training hook (aiinfra_jax.hooks).

Every eval.longctx_every steps it scores the model on a small grid (eval.longctx_tasks, _lengths,
_depths, _samples; greedy answers) and logs "longctx/<task>@<length>" and the NIAH averages
(``longctx.longctx_scores``). The grid is built, and every example generated, in ``check``, before
the run directory exists, so a length that cannot hold a task fails first.

pyproject.toml registers ``make_hook`` under the entry point group "aiinfra_jax.train_hooks" with
the name "longctx": the training loop finds it there without importing aiinfra_jax.eval.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiinfra_jax.config import Config, ConfigError
from aiinfra_jax.eval.longctx import (LongCtxConfig, answer_budgets, build_examples,
                                      check_lengths, longctx_scores, small_grid)


class LongCtxHook:
    name = "longctx"

    def __init__(self, every: int):
        self.every = every
        self.grid: LongCtxConfig | None = None

    def check(self, trainer: Any) -> None:
        """Builds the grid from the run's eval.longctx_* settings; ConfigError if it cannot run."""
        cfg = trainer.cfg
        e = cfg.eval
        lengths = e.longctx_lengths or (cfg.data.seq_len,)
        too_long = [n for n in lengths if n > cfg.model.max_seq_len]
        if too_long:
            raise ConfigError(f"eval.longctx_lengths={tuple(lengths)}: {too_long} exceed "
                              f"model.max_seq_len={cfg.model.max_seq_len}")
        try:
            grid = small_grid(lengths=tuple(lengths), tasks=tuple(e.longctx_tasks),
                              depths=tuple(e.longctx_depths), samples=e.longctx_samples)
            examples = build_examples(trainer.tokenizer, grid)  # a too short length fails here
            # each length plus its answer must fit the model (else the first call fails, steps
            # into the run)
            check_lengths(answer_budgets(examples, grid), cfg.model.max_seq_len)
        except ValueError as err:
            raise ConfigError(f"eval.longctx_*: {err}") from err
        self.grid = grid

    def __call__(self, step: int, model: Any, trainer: Any) -> Mapping[str, float]:
        if self.grid is None:
            raise RuntimeError("LongCtxHook: call check(trainer) before the first evaluation")
        return longctx_scores(model, trainer.tokenizer, self.grid)


def make_hook(cfg: Config) -> LongCtxHook | None:
    """The hook when the config asks for it (eval.longctx_every > 0), else None."""
    return LongCtxHook(cfg.eval.longctx_every) if cfg.eval.longctx_every else None
