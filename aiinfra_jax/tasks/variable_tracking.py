"""Variable tracking (RULER): chains of assignments ``VAR X = 12345``, ``VAR Y = VAR X``, ...
hidden in noise; the answer is every name bound to the queried value.

Letters: L prompt tokens, C chains, K hops per chain. The first assignment of the queried chain goes
at the requested depth; its K hops at sorted uniform depths after it; the C - 1 distractor chains
(other values) at sorted uniform depths anywhere. Names are 5 random capital letters.
"""

from __future__ import annotations

import string
from typing import Any

import numpy as np

from aiinfra_jax.tasks import haystack as hs
from aiinfra_jax.tasks.common import Example, check_depth, distinct, example_rng, make_example

PREFIX = "Memorize and track the chains of variable assignments hidden in the following text.\n"


def _name(rng: np.random.Generator) -> str:
    return "".join(string.ascii_uppercase[i] for i in rng.integers(0, 26, size=5))


def _value(rng: np.random.Generator) -> str:
    return str(int(rng.integers(10_000, 100_000)))


def variable_tracking_example(tokenizer: Any, task: str, length: int, depth: float, seed: int, *,
                              num_chains: int = 1, num_hops: int = 4) -> Example:
    """One variable-tracking example of exactly ``length`` prompt tokens."""
    for name, v in (("num_chains", num_chains), ("num_hops", num_hops)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"variable_tracking: {name}={v!r} must be an int >= 1")
    depth = check_depth(task, depth)
    rng = example_rng(task, seed)
    names = distinct(rng, num_chains * (num_hops + 1), _name)
    values = distinct(rng, num_chains, _value)
    chains = [names[c * (num_hops + 1):(c + 1) * (num_hops + 1)] for c in range(num_chains)]
    needles: list[hs.Needle] = []
    for c, (chain, value) in enumerate(zip(chains, values)):
        start = depth if c == 0 else float(rng.uniform())
        hops = np.sort(rng.uniform(start, 1.0, size=num_hops))
        needles.append(hs.Needle(f"VAR {chain[0]} = {value}.", start))
        needles += [hs.Needle(f"VAR {chain[i + 1]} = VAR {chain[i]}.", float(d))
                    for i, d in enumerate(hops)]
    suffix = (f"\nQuestion: Find all variables that are assigned the value {values[0]} in the text "
              "above.\nAnswer: ")
    sentences = hs.sentence_source(tokenizer, "noise", rng)
    assembled = hs.assemble(tokenizer, task, length, PREFIX, needles, suffix, sentences)
    return make_example(tokenizer, task, length, depth, seed, assembled, list(chains[0]),
                        [n.text for n in needles])
