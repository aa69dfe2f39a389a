"""Multi-query associative recall (Zoology, arXiv 2312.04927) as text: key-value pairs, then queries
at power-law gaps, the last query answered by the model.

Letters: L prompt tokens, N pairs, Q queries. A block of N pairs "abcd:1234" (4-letter keys, 4-digit
values) is hidden at the requested depth in the noise haystack. After it, Q - 1 of the keys reappear
with their values ("abcd:1234", teacher-forced recall: the spans of those values are marked for
training) at gaps drawn from a power law (density proportional to g^(a - 1) on (0, 1 - depth],
a = ``power_a``: short gaps are the most common, as in Zoology). The prompt ends with a key not
queried before followed by ":", and the answer is its value.
"""

from __future__ import annotations

import string
from typing import Any

import numpy as np

from aiinfra_jax.tasks import haystack as hs
from aiinfra_jax.tasks.common import Example, check_depth, distinct, example_rng, make_example

PREFIX = "Each key below is followed by its value. When a key appears again, recall its value.\n"


def _key(rng: np.random.Generator) -> str:
    return "".join(string.ascii_lowercase[i] for i in rng.integers(0, 26, size=4))


def _value(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1000, 10000)))


def mqar_example(tokenizer: Any, task: str, length: int, depth: float, seed: int, *,
                 num_pairs: int = 16, num_queries: int = 4, power_a: float = 0.3) -> Example:
    """One MQAR example of exactly ``length`` prompt tokens with the pair block at ``depth``."""
    if not isinstance(num_pairs, int) or num_pairs < 1:
        raise ValueError(f"mqar: num_pairs={num_pairs!r} must be an int >= 1")
    if not isinstance(num_queries, int) or not 1 <= num_queries <= num_pairs:
        raise ValueError(f"mqar: num_queries={num_queries!r} must be an int in [1, num_pairs="
                         f"{num_pairs}]")
    if not power_a > 0:
        raise ValueError(f"mqar: power_a={power_a!r} must be > 0")
    depth = check_depth(task, depth)
    rng = example_rng(task, seed)
    keys = distinct(rng, num_pairs, _key)
    values = [_value(rng) for _ in keys]
    asked = rng.choice(num_pairs, size=num_queries, replace=False)
    target, inline = int(asked[-1]), [int(i) for i in asked[:-1]]
    block = " ".join(f"{k}:{v}" for k, v in zip(keys, values))
    gaps = (1.0 - depth) * rng.uniform(size=len(inline)) ** (1.0 / power_a)
    needles = [hs.Needle(block, depth)]
    needles += [hs.Needle(f"{keys[i]}:{values[i]}", float(min(depth + g, 1.0)))
                for i, g in zip(inline, gaps)]
    suffix = f"\n{keys[target]}:"
    sentences = hs.sentence_source(tokenizer, "noise", rng)
    assembled = hs.assemble(tokenizer, task, length, PREFIX, needles, suffix, sentences)
    spans = []
    for n, i in enumerate(inline, start=1):
        start = assembled.needle_offsets[n] + hs.encode(tokenizer, f"{keys[i]}:").size
        spans.append((start, start + hs.encode(tokenizer, values[i]).size))
    return make_example(tokenizer, task, length, depth, seed, assembled, [values[target]],
                        [n.text for n in needles], extra_weighted=tuple(spans))
