"""Scoring of a model's answer text against the expected strings.

- ``exact_match``: the answer (the output up to its first newline, stripped, without a trailing
  period, case-folded) equals the expected string; with several expected strings the output is
  split on commas and must hold exactly that set (order free).
- ``string_match_all`` (RULER): the share of expected strings found anywhere in the output
  (case-insensitive).
- ``string_match_part`` (RULER): 1 if any expected string is found.
"""

from __future__ import annotations

from collections.abc import Sequence


def answer_line(prediction: str) -> str:
    """The answer part of a model's output: up to the first newline, stripped."""
    return prediction.split("\n", 1)[0].strip()


def _norm(s: str) -> str:
    s = s.strip()
    if s.endswith("."):
        s = s[:-1]
    return s.strip().casefold()


def _check_refs(refs: Sequence[str]) -> list[str]:
    if isinstance(refs, str) or not refs:
        raise ValueError(f"expected strings must be a non-empty sequence of strings, got {refs!r}")
    return [str(r) for r in refs]


def exact_match(prediction: str, refs: Sequence[str]) -> float:
    refs = _check_refs(refs)
    line = answer_line(prediction)
    if len(refs) == 1:
        return float(_norm(line) == _norm(refs[0]))
    items = [_norm(x) for x in line.split(",")]
    return float(sorted(items) == sorted(_norm(r) for r in refs))


def string_match_all(prediction: str, refs: Sequence[str]) -> float:
    refs = _check_refs(refs)
    low = prediction.casefold()
    return sum(r.casefold() in low for r in refs) / len(refs)


def string_match_part(prediction: str, refs: Sequence[str]) -> float:
    refs = _check_refs(refs)
    low = prediction.casefold()
    return float(any(r.casefold() in low for r in refs))


def score(prediction: str, refs: Sequence[str], metric: str) -> dict[str, float]:
    """{"exact", "all", "score"}: both metrics, and the primary one (``metric``) as "score"."""
    if metric not in ("exact", "all"):
        raise ValueError(f"metric={metric!r}: valid choices 'exact', 'all'")
    out = {"exact": exact_match(prediction, refs), "all": string_match_all(prediction, refs)}
    out["score"] = out[metric]
    return out
