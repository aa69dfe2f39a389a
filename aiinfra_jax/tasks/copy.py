"""String copy: a random string hidden in filler, to be repeated exactly. A training warm-up.

Why it is here: the retrieval tasks give a small model few answer tokens per document, and the
circuit they need (an induction head: find the earlier occurrence of the current context, copy what
followed it; Olsson et al., arXiv 2209.11895) forms only after a long plateau on such sparse
signal. A long random string in the answer makes nearly every answer token an induction target, the
densest signal for that circuit; mixed into training (``synthetic:copy``) it bootstraps the copy
step that passkey, MQAR and the NIAH values then reuse. It is also a task of its own for the runner
(exact match).

Letters: L prompt tokens, C = ``num_chars`` characters of the string (lowercase letters and digits,
so that one character rarely identifies its position and the copy must follow the string), R =
``repeats`` (default 1).

``repeats=R > 1`` (a training option, ``synthetic:copy:repeats=4``) hides the string R times: the
needle at ``depth`` and R - 1 more at uniform random depths. Every occurrence after the first in
the prompt is marked in ``extra_weighted``, so a training document carries R copies to learn from
instead of one, all at different distances (the answer still repeats it once more). Copies that
land on the same sentence boundary sit back to back, at a fixed offset: they are learned first, and
in the long-context preset this easy rung is what got retrieval going (eval/BENCHMARKS.md, issue
5: forcing the copies apart made stage 0 learn nothing).
"""

from __future__ import annotations

import string
from typing import Any

from aiinfra_jax.tasks import haystack as hs
from aiinfra_jax.tasks.common import Example, check_depth, example_rng, make_example

PREFIX = "A secret string is hidden in the following text. Repeat it exactly.\n"
SUFFIX = "\nWhat is the secret string? The secret string is: "
ALPHABET = string.ascii_lowercase + string.digits


def copy_example(tokenizer: Any, task: str, length: int, depth: float, seed: int, *,
                 num_chars: int = 32, repeats: int = 1) -> Example:
    """One copy example of exactly ``length`` prompt tokens with its string at ``depth``."""
    if not isinstance(num_chars, int) or num_chars < 1:
        raise ValueError(f"copy: num_chars={num_chars!r} must be an int >= 1")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"copy: repeats={repeats!r} must be an int >= 1")
    depth = check_depth(task, depth)
    rng = example_rng(task, seed)
    secret = "".join(ALPHABET[i] for i in rng.integers(0, len(ALPHABET), size=num_chars))
    text = f"The secret string is: {secret}."
    needles = [hs.Needle(text, depth)] + [hs.Needle(text, float(d))
                                          for d in rng.uniform(size=repeats - 1)]
    sentences = hs.sentence_source(tokenizer, "noise", rng)
    assembled = hs.assemble(tokenizer, task, length, PREFIX, needles, SUFFIX, sentences)
    lead = hs.encode(tokenizer, "The secret string is: ").size
    width = hs.encode(tokenizer, secret).size
    starts = sorted(off + lead for off in assembled.needle_offsets)
    spans = tuple((s, s + width) for s in starts[1:])  # every occurrence after the first
    return make_example(tokenizer, task, length, depth, seed, assembled, [secret],
                        [n.text for n in needles], extra_weighted=spans)
