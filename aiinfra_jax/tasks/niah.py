"""Needle in a haystack: the eight RULER variants (arXiv 2404.06654), generated offline.

A needle reads "One of the special magic {numbers|uuids} for {key} is: {value}." with keys as
"adjective-noun" word pairs (or UUID-like strings) and values as 7-digit numbers (or UUID-like
strings). Depth placement: the first queried key's first needle goes at the requested depth; the
other needles (further values, further queried keys, distractor keys) at depths drawn uniformly
from the example's generator. Several answers (multivalue, multiquery) are listed, and several
queried keys asked, in the order their needles stand in the context. Where one key is asked (all
but multiquery), the answer prefix restates it as its needles do ("Answer: One of the special magic
numbers for {key} is: "), as RULER's answer prefix restates the query. Letters: L prompt tokens.

Variants (haystack, key, value, needles):
  niah_single_1    noise,  words, numbers   1 needle
  niah_single_2    essay,  words, numbers   1 needle
  niah_single_3    essay,  words, uuids     1 needle
  niah_multikey_1  essay,  words, numbers   1 real key among 4 keys
  niah_multikey_2  needle, words, numbers   1 real key; the haystack is all distractor needles
  niah_multikey_3  needle, uuids, uuids     the same with UUID keys and values
  niah_multivalue  essay,  words, numbers   4 values for the one key; all must be returned
  niah_multiquery  essay,  words, numbers   4 keys, all asked at once
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiinfra_jax.tasks import haystack as hs
from aiinfra_jax.tasks.common import (Example, check_depth, distinct, example_rng,
                                      make_example, number7, uuid_like, word_keys)


@dataclasses.dataclass(frozen=True)
class NIAHSpec:
    """One NIAH variant: haystack kind, key and value types and needle counts."""

    haystack: str = "essay"
    key_type: str = "words"  # "words" | "uuids"
    value_type: str = "numbers"  # "numbers" | "uuids"
    num_keys: int = 1  # needles with distinct keys (the queried ones + distractors)
    num_values: int = 1  # values for each queried key
    num_queries: int = 1  # keys asked at once (<= num_keys)

    def __post_init__(self):
        if self.haystack not in hs.HAYSTACKS:
            raise ValueError(f"NIAHSpec.haystack={self.haystack!r}: valid choices {hs.HAYSTACKS}")
        if self.key_type not in ("words", "uuids"):
            raise ValueError(f"NIAHSpec.key_type={self.key_type!r}: valid 'words', 'uuids'")
        if self.value_type not in ("numbers", "uuids"):
            raise ValueError(f"NIAHSpec.value_type={self.value_type!r}: valid 'numbers', 'uuids'")
        for name in ("num_keys", "num_values", "num_queries"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"NIAHSpec.{name}={getattr(self, name)!r}: must be an int >= 1")
        if self.num_queries > self.num_keys:
            raise ValueError(f"NIAHSpec.num_queries={self.num_queries} must be <= num_keys="
                             f"{self.num_keys}")


NIAH_VARIANTS: dict[str, NIAHSpec] = {
    "niah_single_1": NIAHSpec("noise", "words", "numbers"),
    "niah_single_2": NIAHSpec("essay", "words", "numbers"),
    "niah_single_3": NIAHSpec("essay", "words", "uuids"),
    "niah_multikey_1": NIAHSpec("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NIAHSpec("needle", "words", "numbers"),
    "niah_multikey_3": NIAHSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NIAHSpec("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NIAHSpec("essay", "words", "numbers", num_keys=4, num_queries=4),
}


def _lead_in(value_type: str, key: str) -> str:
    """What a needle says before its value; the answer prefix says it too."""
    return f"One of the special magic {value_type} for {key} is: "


def _needle(value_type: str, key: str, value: str) -> str:
    return f"{_lead_in(value_type, key)}{value}."


def niah_example(tokenizer: Any, task: str, length: int, depth: float, seed: int,
                 spec: NIAHSpec | None = None) -> Example:
    """One NIAH example of exactly ``length`` prompt tokens with its needle at ``depth``."""
    if spec is None:
        if task not in NIAH_VARIANTS:
            raise ValueError(f"unknown NIAH task {task!r}; variants: {sorted(NIAH_VARIANTS)}")
        spec = NIAH_VARIANTS[task]
    depth = check_depth(task, depth)
    rng = example_rng(task, seed)
    make_key = (lambda r: word_keys(r, 1)[0]) if spec.key_type == "words" else uuid_like
    make_value = number7 if spec.value_type == "numbers" else uuid_like
    # Keys are drawn before anything else, so the answer does not depend on the length.
    keys = distinct(rng, spec.num_keys, make_key)
    values = [distinct(rng, spec.num_values, make_value) for _ in keys]
    needles: list[hs.Needle] = []
    owners: list[tuple[int, int]] = []  # (key index, value index) of each needle
    for k, (key, vals) in enumerate(zip(keys, values)):
        for j, v in enumerate(vals):
            d = depth if (k == 0 and j == 0) else float(rng.uniform())
            needles.append(hs.Needle(_needle(spec.value_type, key, v), d))
            owners.append((k, j))
    # Several answers are listed in the order their needles stand in the context, and several
    # queried keys are asked in that order too (RULER scores them order-free, string-match-all).
    # Any other order is not predictable from the prompt, so as a training target it would teach
    # the model only to name some value, not to go on to the next one.
    in_context = [owners[i] for i in hs.placement_order(needles) if owners[i][0] < spec.num_queries]
    asked = list(dict.fromkeys(keys[k] for k, _ in in_context))

    def distractor(r):
        key = distinct(r, 1, make_key, avoid=keys)[0]
        return _needle(spec.value_type, key, make_value(r))

    kind = spec.value_type
    many = spec.num_values > 1 or spec.num_queries > 1
    prefix = f"Memorize the special magic {kind} hidden in the following text.\n"
    what = "are all the special magic" if many else "is the special magic"
    noun = kind if many else kind[:-1]
    # With one key asked, the answer prefix restates it in the needle's own words (RULER's prefix
    # restates the query too; passkey's does the same), so the prompt ends the way the needle goes
    # on to its value. Multiquery's four keys are not restated: its prompt would no longer fit
    # 512 tokens with its answer, and a prefix naming only the first key would read oddly.
    restated = _lead_in(kind, asked[0]) if len(asked) == 1 else ""
    suffix = f"\nWhat {what} {noun} for {', '.join(asked)}?\nAnswer: {restated}"
    sentences = hs.sentence_source(tokenizer, spec.haystack, rng, distractor)
    assembled = hs.assemble(tokenizer, task, length, prefix, needles, suffix, sentences)
    answers = [values[k][j] for k, j in in_context]
    return make_example(tokenizer, task, length, depth, seed, assembled, answers,
                        [n.text for n in needles])
