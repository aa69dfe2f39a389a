"""Haystacks and the assembly of a prompt with needles at requested depths, in tokens.

Token letters: L the requested prompt length (every token the model is fed, BOS included),
H the haystack budget (L minus the fixed prefix, suffix and needle tokens).

A prompt is assembled in token space: ``[BOS] + prefix + haystack with needles + suffix``, each
part encoded separately with the run's tokenizer and the token lists concatenated, so the prompt
has exactly L tokens for any tokenizer (zero slack). The haystack is a stream of whole sentences
cut at token level after exactly H tokens; each needle goes in at the sentence boundary nearest to
``depth * H`` haystack tokens, so it lies within one sentence of its requested depth.

Haystack kinds (RULER's three, built offline):
  "noise"   the repeated filler sentences of the passkey literature;
  "essay"   natural English from the framework's own embedded corpus (the pydoc topic texts that
            ship with Python: prose sentences only, code blocks dropped);
  "needle"  sentences that are themselves distractor needles (made by the task).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
HAYSTACKS = ("noise", "essay", "needle")


class ContextTooShort(ValueError):
    """The requested length cannot hold the task's fixed parts; ``needed`` is the minimum length."""

    def __init__(self, task: str, length: int, needed: int):
        self.task, self.length, self.needed = task, length, needed
        super().__init__(f"task {task!r}: length={length} tokens cannot hold the prompt's fixed "
                         f"parts (instructions, question and needles need {needed} tokens); use a "
                         f"length >= {needed}")


@dataclasses.dataclass(frozen=True)
class Needle:
    """A sentence to hide at a depth in [0, 1] of the haystack (0 = first, 1 = last)."""

    text: str
    depth: float


@dataclasses.dataclass(frozen=True)
class Assembled:
    """A prompt of exactly ``length`` tokens (BOS first) and where its parts landed."""

    tokens: np.ndarray  # [L] int32
    needle_offsets: tuple[int, ...]  # prompt token index where each needle (in input order) starts
    needle_lengths: tuple[int, ...]  # tokens of each needle
    haystack_span: tuple[int, int]  # [start, end) of the haystack region (needles included)
    haystack_tokens: int  # H: haystack tokens without the needles
    max_sentence_tokens: int  # the longest haystack sentence used (the depth tolerance)


def _split_sentences(text: str) -> list[str]:
    """Prose sentences of one pydoc topic: drops headings, underlines, indented (code) lines."""
    sentences = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.split("\n")
        if any(line.startswith((" ", "\t")) for line in lines):
            continue  # code, grammar or an indented example
        flat = " ".join(line.strip() for line in lines)
        if not flat or re.fullmatch(r"[*=\-~^\s]+", flat):
            continue
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat):
            words = s.split()
            letters = sum(c.isalpha() for c in s)
            prose = letters >= 0.7 * len(s.replace(" ", ""))
            if 4 <= len(words) <= 40 and s[-1] in ".!?" and prose:
                sentences.append(" ".join(words))
    return sentences


@functools.lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """The prose sentences of the embedded corpus's pydoc topics, in corpus order."""
    # Imported here, not at the top: aiinfra_jax.data (its synthetic source) imports this package.
    from aiinfra_jax.data.sources import EmbeddedCorpus  # pylint: disable=import-outside-toplevel

    corpus = EmbeddedCorpus.create()
    if not corpus.topics:
        raise ValueError("the 'essay' haystack needs the pydoc topic texts of the embedded corpus "
                         "(pydoc_data), which this Python installation lacks; use the 'noise' "
                         "haystack instead")
    out: list[str] = []
    first_topic = len(corpus.files)
    for i in range(len(corpus.topics)):
        out.extend(_split_sentences(corpus[first_topic + i]))
    return tuple(out)


_TOKEN_CACHE: dict[tuple[str, str, str], tuple[np.ndarray, ...]] = {}


def encode_sentences(tokenizer: Any, kind: str) -> tuple[np.ndarray, ...]:
    """Each sentence of a fixed haystack ("noise" or "essay") as int32 tokens, trailing space
    included; cached per tokenizer (by its type and repr, e.g. the tokenizer file's path)."""
    key = (type(tokenizer).__qualname__, repr(tokenizer), kind)
    if key not in _TOKEN_CACHE:
        if kind == "noise":
            texts: Sequence[str] = NOISE_SENTENCES
        elif kind == "essay":
            texts = essay_sentences()
        else:
            raise ValueError(f"haystack {kind!r} has no fixed sentences; valid: 'noise', 'essay'")
        _TOKEN_CACHE[key] = tuple(encode(tokenizer, t + " ") for t in texts)
    return _TOKEN_CACHE[key]


def encode(tokenizer: Any, text: str) -> np.ndarray:
    fast = getattr(tokenizer, "encode_array", None)
    if fast is not None:
        return np.asarray(fast(text), np.int32)
    return np.asarray(tokenizer.encode(text), np.int32)


SentenceSource = Callable[[int], np.ndarray]  # i -> tokens of the i-th haystack sentence


def sentence_source(tokenizer: Any, kind: str, rng: np.random.Generator,
                    make_distractor: Callable[[np.random.Generator], str] | None = None
                    ) -> SentenceSource:
    """The i-th sentence of a haystack: "noise" cycles the filler from the start, "essay" reads the
    corpus on from a random sentence, "needle" draws distractor needles from ``make_distractor``."""
    if kind == "noise":
        sents = encode_sentences(tokenizer, "noise")
        return lambda i: sents[i % len(sents)]
    if kind == "essay":
        sents = encode_sentences(tokenizer, "essay")
        start = int(rng.integers(len(sents)))
        return lambda i: sents[(start + i) % len(sents)]
    if kind == "needle":
        if make_distractor is None:
            raise ValueError("the 'needle' haystack needs a make_distractor function")
        return lambda i: encode(tokenizer, make_distractor(rng) + " ")
    raise ValueError(f"haystack={kind!r}: valid choices are {HAYSTACKS}")


def placement_order(needles: Sequence[Needle]) -> list[int]:
    """Indices of ``needles`` in the order ``assemble`` places them in the context: by depth,
    equal depths in input order."""
    return sorted(range(len(needles)), key=lambda k: (needles[k].depth, k))


def assemble(tokenizer: Any, task: str, length: int, prefix: str, needles: Sequence[Needle],
             suffix: str, sentences: SentenceSource) -> Assembled:
    """``[BOS] + prefix + haystack (H tokens) with needles + suffix``, exactly ``length`` tokens.

    Needles go in by depth (``placement_order``), equal depths in their input order (a chain of
    assignments stays in order when its depths are sorted). Raises ContextTooShort when the fixed
    parts exceed ``length``.
    """
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"task {task!r}: length={length!r} must be a positive int (tokens)")
    for n in needles:
        if not 0.0 <= n.depth <= 1.0:
            raise ValueError(f"task {task!r}: needle depth {n.depth!r} must be in [0, 1]")
    head = np.concatenate([np.array([tokenizer.bos_id], np.int32), encode(tokenizer, prefix)])
    tail = encode(tokenizer, suffix)
    needle_toks = [encode(tokenizer, n.text + " ") for n in needles]
    fixed = head.size + tail.size + sum(t.size for t in needle_toks)
    budget = int(length) - fixed
    if budget < 0:
        raise ContextTooShort(task, int(length), fixed)
    # Whole sentences until the budget is reached; the last one is cut at token level.
    parts, bounds, total, longest, i = [], [0], 0, 0, 0
    while total < budget:
        s = sentences(i)
        i += 1
        if s.size == 0:
            continue
        longest = max(longest, s.size)
        s = s[:budget - total]
        parts.append(s)
        total += s.size
        bounds.append(total)
    hay = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    bounds_arr = np.asarray(bounds)
    points = [int(bounds_arr[np.argmin(np.abs(bounds_arr - n.depth * budget))]) for n in needles]
    order = placement_order(needles)  # points grow with depth, so they are sorted too
    pieces, offsets, cursor, at = [head], [0] * len(needles), 0, head.size
    for k in order:
        pieces.append(hay[cursor:points[k]])
        at += points[k] - cursor
        cursor = points[k]
        offsets[k] = at
        pieces.append(needle_toks[k])
        at += needle_toks[k].size
    pieces.append(hay[cursor:])
    at += hay.size - cursor
    hay_end = at
    pieces.append(tail)
    tokens = np.concatenate(pieces).astype(np.int32)
    assert tokens.size == length, (tokens.size, length)
    return Assembled(tokens=tokens, needle_offsets=tuple(offsets),
                     needle_lengths=tuple(t.size for t in needle_toks),
                     haystack_span=(int(head.size), int(hay_end)), haystack_tokens=budget,
                     max_sentence_tokens=longest)
