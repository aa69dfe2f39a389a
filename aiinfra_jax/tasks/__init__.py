"""Long-context task generators (seeded, offline) and their scoring.

    example = make_task_example(tokenizer, "niah_single_1", length=1024, depth=0.5, seed=0)

Every task builds a prompt of exactly ``length`` tokens of the given tokenizer ([BOS] + instructions
+ haystack with needles + question + answer prefix; zero slack, see ``haystack``), its needle at
``depth`` (0 = start of the haystack, 1 = end) within one haystack sentence, and the expected
answers (``Example``). The same (task, seed) gives the same keys and values at every length and
depth, and the same example for the same (task, length, depth, seed).

Where the generators live: here, in ``aiinfra_jax.tasks``, beside ``data`` and below ``eval``,
because both use them: ``aiinfra_jax.data.synthetic`` turns them into training documents and
``aiinfra_jax.eval.longctx`` scores models on them. They import numpy and, for the natural-text
haystack only, ``aiinfra_jax.data.sources`` (inside ``haystack.essay_sentences``, so that importing
``aiinfra_jax.data``, whose ``synthetic`` module imports this package, never meets a half-initialised
module); never the trainer, the models or ``eval``.

Tasks: the eight RULER NIAH variants (``NIAH_TASKS``), "passkey", "mqar", "variable_tracking", and
"copy" (a random string to repeat: the induction warm-up for training, see ``copy``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from aiinfra_jax.tasks.common import Example
from aiinfra_jax.tasks.copy import copy_example
from aiinfra_jax.tasks.haystack import ContextTooShort
from aiinfra_jax.tasks.mqar import mqar_example
from aiinfra_jax.tasks.niah import NIAH_VARIANTS, NIAHSpec, niah_example
from aiinfra_jax.tasks.passkey import passkey_example
from aiinfra_jax.tasks.scoring import (answer_line, exact_match, score, string_match_all,
                                       string_match_part)
from aiinfra_jax.tasks.variable_tracking import variable_tracking_example

NIAH_TASKS: tuple[str, ...] = tuple(NIAH_VARIANTS)
TaskFn = Callable[..., Example]
TASKS: dict[str, TaskFn] = {
    **{name: niah_example for name in NIAH_TASKS},
    "passkey": passkey_example,
    "mqar": mqar_example,
    "variable_tracking": variable_tracking_example,
    "copy": copy_example,
}
# Names that stand for several tasks (in --tasks and in "synthetic:<name>").
TASK_GROUPS: dict[str, tuple[str, ...]] = {"niah": NIAH_TASKS, "all": tuple(TASKS)}


def expand_tasks(names: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Task names with groups ("niah", "all") expanded, in order, without repeats."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out: list[str] = []
    for n in names:
        if n in TASK_GROUPS:
            members = TASK_GROUPS[n]
        elif n in TASKS:
            members = (n,)
        else:
            raise ValueError(f"unknown task {n!r}; tasks: {sorted(TASKS)}; groups: "
                             f"{sorted(TASK_GROUPS)}")
        out.extend(m for m in members if m not in out)
    if not out:
        raise ValueError("no tasks given; pick from " + ", ".join(sorted(TASKS)))
    return tuple(out)


def parse_number(value: str) -> int | float:
    """A task option's value: an int where it reads as one ("1_000" too), else a float."""
    try:
        return int(value.replace("_", ""))
    except ValueError:
        return float(value)


def task_option_names(task: str) -> tuple[str, ...]:
    """The keyword options of ``task``'s generator (e.g. copy: num_chars, repeats)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {sorted(TASKS)}")
    params = inspect.signature(TASKS[task]).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def check_task_options(task: str, names: Iterable[str], where: str) -> None:
    """Refuses option names that ``task``'s generator does not take, naming them and the valid
    ones (where: what the options came from, for the message)."""
    allowed = task_option_names(task)
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: task {task!r} has no option {', '.join(unknown)}; its "
                         f"options: {', '.join(allowed) or '(none)'}")


def parse_task_options(task: str, text: str) -> dict[str, int | float]:
    """"key=value,..." -> the options of ``task``'s generator, each name checked against it."""
    out: dict[str, int | float] = {}
    for item in (text.split(",") if text else []):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq:
            raise ValueError(f"task {task!r}: bad option {item!r}; give key=value")
        check_task_options(task, [key], f"option {item!r}")
        try:
            out[key] = parse_number(value)
        except ValueError as e:
            raise ValueError(f"task {task!r}: option {key}={value!r} is not a number") from e
    return out


def make_task_example(tokenizer: Any, task: str, length: int, depth: float, seed: int,
                      **options: Any) -> Example:
    """One example of ``task`` (see the module docstring); options go to the task's generator."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {sorted(TASKS)}")
    return TASKS[task](tokenizer, task, length, depth, seed, **options)


__all__ = [
    "ContextTooShort", "Example", "copy_example", "NIAHSpec", "NIAH_TASKS", "NIAH_VARIANTS", "TASKS", "TASK_GROUPS",
    "answer_line", "exact_match", "expand_tasks", "make_task_example", "mqar_example",
    "check_task_options", "parse_number", "parse_task_options", "task_option_names",
    "niah_example", "passkey_example", "score", "string_match_all", "string_match_part",
    "variable_tracking_example",
]
