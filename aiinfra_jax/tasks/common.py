"""What every task shares: the Example record, seeding, keys and values.

Token letters: L prompt tokens (BOS included), A answer tokens (without EOS).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np

from aiinfra_jax.tasks.haystack import Assembled, encode

# Word-pair keys ("adjective-noun"), as in RULER's needles.
ADJECTIVES = (
    "able", "ancient", "angry", "bold", "brave", "bright", "broad", "calm", "careful", "cheap",
    "clean", "clever", "cold", "cool", "curious", "damp", "dark", "deep", "dry", "eager", "early",
    "easy", "empty", "fair", "famous", "fancy", "fast", "fierce", "flat", "fresh", "gentle", "giant",
    "glad", "golden", "grand", "green", "happy", "heavy", "hollow", "honest", "huge", "humble",
    "icy", "jolly", "kind", "large", "lazy", "light", "little", "lively", "loud", "lucky", "mellow",
    "mighty", "modern", "narrow", "neat", "noisy", "odd", "orange", "pale", "patient", "plain",
    "polite", "proud", "purple", "quick", "quiet", "rapid", "rare", "rich", "rough", "round", "royal",
    "rusty", "sandy", "sharp", "shiny", "silent", "silly", "simple", "slow", "smart", "smooth",
    "soft", "solid", "spicy", "steady", "strong", "sunny", "sweet", "swift", "tall", "tender",
    "thick", "tidy", "tiny", "vast", "warm", "wild", "wise", "young",
)
NOUNS = (
    "anchor", "apple", "arrow", "badge", "basket", "beacon", "bell", "blanket", "bottle", "bridge",
    "bucket", "cabin", "camel", "candle", "canyon", "carpet", "castle", "cherry", "chimney",
    "circle", "cloud", "comet", "copper", "cottage", "crayon", "desert", "dolphin", "donkey",
    "dragon", "drum", "eagle", "engine", "falcon", "feather", "fiddle", "forest", "fountain", "garden",
    "glacier", "guitar", "hammer", "harbor", "helmet", "island", "jacket", "jungle", "kettle",
    "ladder", "lantern", "lemon", "library", "lizard", "magnet", "marble", "meadow", "mirror",
    "monkey", "mountain", "needle", "oasis", "ocean", "orchard", "otter", "paddle", "palace",
    "parrot", "pebble", "pencil", "pepper", "piano", "pillow", "planet", "pocket", "puzzle",
    "rabbit", "ribbon", "river", "rocket", "saddle", "salmon", "shadow", "shelter", "silver",
    "spider", "spoon", "statue", "tablecloth", "teapot", "thunder", "tiger", "tower", "trumpet",
    "tunnel", "turtle", "umbrella", "valley", "violin", "wagon", "walrus", "window", "wizard",
)


def example_rng(task: str, seed: int, *salt: int) -> np.random.Generator:
    """The generator of one example: a stable function of (task, seed, salt), nothing else."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an int >= 0")
    return np.random.default_rng([zlib.crc32(task.encode()), int(seed), *map(int, salt)])


def word_keys(rng: np.random.Generator, n: int) -> list[str]:
    """n distinct "adjective-noun" keys."""
    flat = rng.choice(len(ADJECTIVES) * len(NOUNS), size=n, replace=False)
    return [f"{ADJECTIVES[i // len(NOUNS)]}-{NOUNS[i % len(NOUNS)]}" for i in flat]


def uuid_like(rng: np.random.Generator) -> str:
    """A UUID-shaped hex string (8-4-4-4-12) from the example's generator."""
    digits = "".join("0123456789abcdef"[d] for d in rng.integers(0, 16, size=32))
    return "-".join((digits[:8], digits[8:12], digits[12:16], digits[16:20], digits[20:]))


def number7(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def distinct(rng: np.random.Generator, n: int, make, avoid=()) -> list[str]:
    """n distinct values from ``make(rng)``, none of them in ``avoid``."""
    out: list[str] = []
    seen = set(avoid)
    while len(out) < n:
        v = make(rng)
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Example:
    """One (context, question, answer) example of a task at a length and a depth.

    ``prompt_tokens`` is everything the model is fed ([BOS] + instructions + haystack with needles +
    question + answer prefix), exactly ``length`` tokens. The model should continue with
    ``target_text`` (``answers`` joined by ", ") and then EOS. ``metric`` is the primary score:
    "exact" (exact match of the answer) for one answer, "all" (string-match-all) for several.
    ``needle_offsets[0]`` is where the needle placed at ``depth`` starts in the prompt.
    """

    task: str
    length: int
    depth: float
    seed: int
    prompt_tokens: np.ndarray  # [L] int32
    answers: tuple[str, ...]
    target_tokens: np.ndarray  # [A] int32, without EOS
    metric: str
    needles: tuple[str, ...]
    needle_offsets: tuple[int, ...]
    haystack_span: tuple[int, int]
    haystack_tokens: int
    max_sentence_tokens: int
    extra_weighted: tuple[tuple[int, int], ...] = ()  # [start, end) prompt spans worth training on

    @property
    def target_text(self) -> str:
        return ", ".join(self.answers)


def make_example(tokenizer: Any, task: str, length: int, depth: float, seed: int,
                 assembled: Assembled, answers: list[str], needles: list[str],
                 extra_weighted: tuple[tuple[int, int], ...] = ()) -> Example:
    if not answers:
        raise ValueError(f"task {task!r}: an example needs at least one answer")
    target = encode(tokenizer, ", ".join(answers))
    return Example(task=task, length=int(length), depth=float(depth), seed=int(seed),
                   prompt_tokens=assembled.tokens, answers=tuple(answers), target_tokens=target,
                   metric="exact" if len(answers) == 1 else "all", needles=tuple(needles),
                   needle_offsets=assembled.needle_offsets,
                   haystack_span=assembled.haystack_span,
                   haystack_tokens=assembled.haystack_tokens,
                   max_sentence_tokens=assembled.max_sentence_tokens,
                   extra_weighted=extra_weighted)


def check_depth(task: str, depth: float) -> float:
    if isinstance(depth, bool) or not isinstance(depth, (int, float, np.floating)) \
            or not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"task {task!r}: depth={depth!r} must be a fraction in [0, 1] "
                         "(0 = the needle first, 1 = last)")
    return float(depth)
