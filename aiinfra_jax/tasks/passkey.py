"""Passkey retrieval (Mohtashami & Jaggi, arXiv 2305.16300): a 5-digit number hidden in filler.

Letters: L prompt tokens. The filler is the "noise" haystack; the passkey sentence goes at depth.
"""

from __future__ import annotations

from typing import Any

from aiinfra_jax.tasks import haystack as hs
from aiinfra_jax.tasks.common import Example, check_depth, example_rng, make_example

PREFIX = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and "
          "memorize it. I will quiz you about the pass key.\n")
SUFFIX = "\nWhat is the pass key? The pass key is "


def passkey_example(tokenizer: Any, task: str, length: int, depth: float, seed: int) -> Example:
    """One passkey example of exactly ``length`` prompt tokens."""
    depth = check_depth(task, depth)
    rng = example_rng(task, seed)
    key = str(int(rng.integers(10_000, 100_000)))
    needle = hs.Needle(f"The pass key is {key}. Remember it. {key} is the pass key.", depth)
    sentences = hs.sentence_source(tokenizer, "noise", rng)
    assembled = hs.assemble(tokenizer, task, length, PREFIX, [needle], SUFFIX, sentences)
    return make_example(tokenizer, task, length, depth, seed, assembled, [key], [needle.text])
