"""Synthetic multi-document rows for the MSA mixer: ``synthetic:msa_niah[:key=value,...]``.

    DataConfig(sources=("embedded", "synthetic:msa_niah"), weights=(0.5, 0.5))

Each item is one whole row of data.seq_len tokens (T), already packed in the convention of
``aiinfra_jax.models.attention.msa`` (its module docstring; ``pack_row`` builds the same ids and
positions): ``docs`` short documents, then one query, then right padding. The pipeline carries
such rows through unchanged (``whole_rows``; see ``aiinfra_jax.data.pipeline``), and rows of the
other sources of a mixture stay ordinary packed segments (ids > 0, no query), which an MSA layer
reads as plain causal text.

A row (letters: N documents, D_j tokens of document j, Q query tokens, A answer tokens):
  documents  [BOS] + filler of D_j - 1 tokens + [EOS] (inputs the first D_j, targets the last D_j),
             D_j drawn uniformly from [min_doc_length, max_doc_length], so lengths are arbitrary,
             not multiples of any chunk. Filler: the sentences of a task haystack ("essay": prose of
             the embedded corpus's pydoc topics; "noise": the repeated filler sentences).
             ``positives`` documents hold the needle fact "{key} is {value}." (key an
             adjective-noun pair, value a 7-digit number, as the NIAH tasks), at a uniform depth;
             ``distractors`` other documents each hold a fact of another key with another value.
             Segment id j + 1, with ANSWER_BIT on the positives; positions 0 .. D_j - 1.
  query      [BOS] + "{key} is " + value + [EOS] (the prompt restates the needle's lead-in, as the
             NIAH answer prefix does); inputs are the prompt and the A answer tokens, so its id is
             -(1 + A): the router never reads the answer. Positions query_offset .. + Q - 1.
  padding    segment 0, position 0, weight 0, token pad_id.

Loss weights (weight t applies to targets[t]): ``answer_weight`` (default 1) on the A answer tokens
and EOS; ``doc_weight`` (default 0) on every document target; ``query_weight`` (default 0) on the
query prompt's targets. Why documents default to 0: an LM loss on them is legitimate (an MSA
document attends only within itself, so nothing of the query leaks into it), but steps.py averages
the NLL over all weighted tokens of the batch, and ~N * D document tokens per row would outweigh the
A + 1 answer tokens some tenfold, drowning the retrieval signal this source exists for; the LM
signal comes from the corpus rows it is mixed with. Set doc_weight > 0 when training on these rows
alone, or to keep the document encoders' language modelling sharp. The routing loss (the model's
InfoNCE over documents, positives = ANSWER_BIT) needs no weights: the ids carry it.

Options (comma-separated key=value after ``synthetic:msa_niah:``):
  n               rows in the source (default 1_000_000); the first ceil(n * val_fraction)
                  indices are the validation split, the rest train (as every synthetic source)
  seed            base seed (default 0); row i uses example seed 2**40 + seed * 2**32 + i, never
                  an evaluation seed, and is the same row whatever else is read
  docs            documents per row (default 8); keep it <= the model's msa.max_documents (a row
                  with more documents is refused by the MSA layer: NaN outputs)
  positives       documents holding the needle (default 1, at most docs)
  distractors     documents (among the others) holding a fact of another key; -1 = all of them
                  (default -1: the router must match the key, not spot any fact)
  near_keys       how many of the distractors' keys share a word with the needle's key (its
                  adjective or its noun; default 0 = keys drawn at random): the near misses a
                  large memory bank is full of ("bold-river" among "bold-stone", "calm-river")
  same_length     how many of the other distractors' keys have the needle key's length (its
                  prompt "{key} is " encodes to as many tokens; default 0). Facts open these short
                  documents, so such a distractor's value sits at exactly the needle value's
                  positions: a reader that finds the answer by position alone cannot tell them
                  apart, one that matches the key can (eval/BENCHMARKS.md "MSA": the router's
                  second choice in a large bank is often such a document)
  min_doc_length  shortest document, tokens (default 0 = max(half of max_doc_length, the longest
                  fact + 1))
  max_doc_length  longest document, tokens (default 0 = the most that always fits:
                  (seq_len - longest query) // docs)
  query_offset    first position of the query (default 16 = MSAConfig's default top_k, which is
                  its default query_offset; set it to the model's msa.resolved_query_offset)
  haystack        "essay" (default) or "noise"
  answer_weight, doc_weight, query_weight   loss weights (above)
A row that cannot fit (docs * max_doc_length + the longest query > seq_len, or a fact longer than
a document) is refused at construction with a ValueError naming the option to change.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.data.sources import GeneratedSource
from aiinfra_jax.data.tokenizer import load_tokenizer
from aiinfra_jax.tasks import haystack as hs
from aiinfra_jax.tasks.common import ADJECTIVES, NOUNS, distinct, example_rng, number7, word_keys

# The MSA convention's marker of a positive document (aiinfra_jax.models.attention.msa.ANSWER_BIT;
# restated here so that data code loads no JAX; tests/data/test_msa_source.py checks they agree).
ANSWER_BIT = 1 << 30
TRAIN_SEED_BASE = 2**40  # as aiinfra_jax.data.synthetic: never an evaluation seed
MSA_TASKS = ("msa_niah",)
_INT = ("n", "seed", "docs", "positives", "distractors", "near_keys", "same_length",
        "min_doc_length", "max_doc_length", "query_offset")
_FLOAT = ("answer_weight", "doc_weight", "query_weight")
_STR = ("haystack",)


@dataclasses.dataclass(frozen=True)
class MSAOptions:
    """The options of ``synthetic:msa_niah`` (module docstring)."""

    n: int = 1_000_000
    seed: int = 0
    docs: int = 8
    positives: int = 1
    distractors: int = -1
    near_keys: int = 0
    same_length: int = 0
    min_doc_length: int = 0
    max_doc_length: int = 0
    query_offset: int = 16
    haystack: str = "essay"
    answer_weight: float = 1.0
    doc_weight: float = 0.0
    query_weight: float = 0.0

    def __post_init__(self):
        floors = {"n": 1, "docs": 1, "positives": 1, "distractors": -1}
        for name in _INT:
            v, lo = getattr(self, name), floors.get(name, 0)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"synthetic:msa option {name}={v!r} must be an int >= {lo}")
        if self.positives > self.docs:
            raise ValueError(f"synthetic:msa option positives={self.positives} exceeds docs="
                             f"{self.docs}; lower positives or raise docs")
        if self.distractors > self.docs - self.positives:
            raise ValueError(f"synthetic:msa option distractors={self.distractors} exceeds the "
                             f"{self.docs - self.positives} documents that are not positives; "
                             "lower it (-1 = all of them)")
        if self.near_keys > self.n_distractors:
            raise ValueError(f"synthetic:msa option near_keys={self.near_keys} exceeds the "
                             f"{self.n_distractors} distractors; lower it or raise distractors")
        if self.near_keys + self.same_length > self.n_distractors:
            raise ValueError(f"synthetic:msa options near_keys={self.near_keys} + same_length="
                             f"{self.same_length} exceed the {self.n_distractors} distractors; "
                             "lower them or raise distractors")
        if self.max_doc_length and self.min_doc_length > self.max_doc_length:
            raise ValueError(f"synthetic:msa options min_doc_length={self.min_doc_length} > "
                             f"max_doc_length={self.max_doc_length}")
        if self.haystack not in ("essay", "noise"):
            raise ValueError(f"synthetic:msa option haystack={self.haystack!r}: valid 'essay', "
                             "'noise'")
        for name in _FLOAT:
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"synthetic:msa option {name}={v!r} must be a finite number >= 0")
        if not (self.answer_weight or self.doc_weight or self.query_weight):
            raise ValueError("synthetic:msa: answer_weight, doc_weight and query_weight are all "
                             "0, so nothing would be trained on")

    @property
    def n_distractors(self) -> int:
        return self.docs - self.positives if self.distractors < 0 else self.distractors


def parse_msa_spec(spec: str) -> tuple[str, MSAOptions]:
    """"synthetic:msa_<task>[:k=v,...]" -> (task, options)."""
    _, task, *rest = spec.split(":", 2)
    if task not in MSA_TASKS:
        raise ValueError(f"data source {spec!r}: unknown MSA task {task!r}; valid: {MSA_TASKS}")
    kwargs: dict[str, Any] = {}
    for item in (rest[0].split(",") if rest and rest[0] else []):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in _INT + _FLOAT + _STR:
            raise ValueError(f"data source {spec!r}: bad option {item!r}; options are key=value "
                             f"with key in {_INT + _FLOAT + _STR}")
        try:
            kwargs[key] = (int(value.replace("_", "")) if key in _INT
                           else float(value) if key in _FLOAT else value)
        except ValueError as e:
            raise ValueError(f"data source {spec!r}: option {key}={value!r} is not a number") from e
    return task, MSAOptions(**kwargs)


def near_keys(rng: np.random.Generator, key: str, n: int, taken: set[str]) -> list[str]:
    """n distinct keys that share one word with ``key`` ("adjective-noun": the same adjective and
    another noun, or the other way round, by a coin each), none of them in ``taken``."""
    adjective, noun = key.split("-")
    out: list[str] = []
    while len(out) < n:
        if rng.random() < 0.5:
            other = f"{adjective}-{NOUNS[int(rng.integers(len(NOUNS)))]}"
        else:
            other = f"{ADJECTIVES[int(rng.integers(len(ADJECTIVES)))]}-{noun}"
        if other not in taken and other not in out:
            out.append(other)
    return out


def same_length_keys(rng: np.random.Generator, n: int, pool: list[str], taken: set[str]
                     ) -> list[str]:
    """n distinct keys drawn from ``pool`` (the keys as long as the needle's), none in ``taken``
    (the source's construction checked that every length's pool holds n + 1)."""
    free = [k for k in pool if k not in taken]
    return [free[int(i)] for i in rng.choice(len(free), size=n, replace=False)]


def fact_text(key: str, value: str) -> str:
    return f"{key} is {value}."


def query_prompt(key: str) -> str:
    return f"{key} is "


def filler(budget: int, fact: np.ndarray, sentences: hs.SentenceSource,
            rng: np.random.Generator) -> np.ndarray:
    """``budget`` tokens of haystack sentences with ``fact`` (may be empty) whole between two of
    them, at a uniformly drawn sentence boundary among those that leave it uncut; the last
    sentence is cut at token level (after the fact)."""
    parts, total, i = [], 0, 0
    while total < budget:
        s = sentences(i)
        i += 1
        parts.append(s)
        total += s.size
    bounds = np.cumsum([0] + [p.size for p in parts])
    fits = np.flatnonzero(bounds <= budget - fact.size)  # boundary 0 always fits
    at = int(rng.choice(fits))  # after the first ``at`` sentences
    body = np.concatenate(parts[:at] + [fact] + parts[at:])
    return body[:budget].astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class MSARow:
    """What row ``index`` holds: the claim the arrays encode (tests decode against it)."""

    key: str
    value: str
    positives: tuple[int, ...]  # document indices holding the needle
    distractors: tuple[int, ...]  # document indices holding another key's fact
    doc_lengths: tuple[int, ...]  # D_j (positions of document j)
    query_length: int  # Q (prompt + answer inputs)
    answer_tokens: np.ndarray  # [A] int32, the value
    arrays: dict[str, np.ndarray]  # the five [T] arrays of the row


class MSASource(GeneratedSource):
    """A DocumentSource of whole MSA rows (see the module docstring); ``whole_rows = True``."""

    whole_rows = True

    def __init__(self, spec: str, cfg: DataConfig):
        self.name = spec
        self.task, self.options = parse_msa_spec(spec)
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.seq_len = cfg.seq_len
        o = self.options
        tok = self.tokenizer
        # The longest fact / query over every key (the value's 7 digits measured on probes).
        keys = [f"{a}-{b}" for a in ADJECTIVES for b in NOUNS]
        longest_key = max(keys, key=lambda k: hs.encode(tok, k).size)
        probes = [number7(np.random.default_rng(s)) for s in range(32)]
        self.longest_fact = max(hs.encode(tok, fact_text(longest_key, v) + " ").size for v in probes)
        self.longest_query = 1 + hs.encode(tok, query_prompt(longest_key)).size + max(
            hs.encode(tok, v).size for v in probes)
        need = self.longest_fact + 1  # [BOS] + the fact; EOS is a target only
        room = cfg.seq_len - self.longest_query
        self.max_doc_length = o.max_doc_length or room // o.docs
        self.min_doc_length = o.min_doc_length or max(2, self.max_doc_length // 2)
        fix = (f"lower docs (now {o.docs}) or max_doc_length, or raise data.seq_len (now "
               f"{cfg.seq_len})")
        if o.docs * self.max_doc_length > room or self.max_doc_length < 1:
            raise ValueError(
                f"data source {spec!r}: {o.docs} documents of up to max_doc_length="
                f"{self.max_doc_length} tokens and a query of up to {self.longest_query} tokens "
                f"do not fit a row of data.seq_len={cfg.seq_len}; {fix}")
        if self.max_doc_length < need:  # every document may hold a fact (positives >= 1)
            how = (f"; raise max_doc_length to >= {need} (and if the row then overflows, {fix})"
                   if o.max_doc_length else f" (max_doc_length is the most that fits {o.docs} "
                   f"documents beside the query); lower docs (now {o.docs}) or raise "
                   f"data.seq_len (now {cfg.seq_len})")
            raise ValueError(
                f"data source {spec!r}: documents of up to max_doc_length={self.max_doc_length} "
                f"tokens cannot hold the longest fact ({need} tokens with BOS){how}")
        if self.min_doc_length > self.max_doc_length:
            raise ValueError(
                f"data source {spec!r}: min_doc_length={self.min_doc_length} exceeds "
                f"max_doc_length={self.max_doc_length} (the longest that fits); {fix}")
        self.keys_of_length: dict[int, list[str]] = {}
        for k in keys:  # grouped by the prompt's length: same_length draws from a key's group
            self.keys_of_length.setdefault(hs.encode(tok, query_prompt(k)).size, []).append(k)
        smallest = min(len(g) for g in self.keys_of_length.values())
        if o.same_length > smallest - 1:
            raise ValueError(
                f"data source {spec!r}: same_length={o.same_length}, but the rarest key length "
                f"has only {smallest} keys (the needle's among them); lower same_length to <= "
                f"{smallest - 1}")
        if o.haystack == "essay":
            hs.encode_sentences(tok, "essay")  # fails now if the corpus has no pydoc topics

    def row(self, index: int) -> MSARow:
        """Row ``index`` and what it claims (see MSARow)."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}: row {index} out of range [0, {len(self)})")
        o, tok, t = self.options, self.tokenizer, self.seq_len
        rng = example_rng(self.task, TRAIN_SEED_BASE + o.seed * 2**32 + index)
        keys = word_keys(rng, 1 + o.n_distractors)
        values = distinct(rng, 1 + o.n_distractors, number7)
        if o.same_length:  # first, so that no near key can take the last of a length's keys
            pool = self.keys_of_length[hs.encode(tok, query_prompt(keys[0])).size]
            at = 1 + o.near_keys
            keys[at:at + o.same_length] = same_length_keys(rng, o.same_length, pool, {keys[0]})
            for i in range(at + o.same_length, len(keys)):  # a random key may be one of them
                while keys[i] in keys[:i]:
                    keys[i] = word_keys(rng, 1)[0]
        if o.near_keys:
            keys[1:1 + o.near_keys] = near_keys(rng, keys[0], o.near_keys, set(keys))
        order = rng.permutation(o.docs)
        positives = tuple(sorted(int(j) for j in order[:o.positives]))
        distractors = tuple(sorted(int(j) for j in order[o.positives:o.positives
                                                           + o.n_distractors]))
        fact_of = {j: fact_text(keys[0], values[0]) for j in positives}
        fact_of.update({j: fact_text(keys[1 + i], values[1 + i]) for i, j in enumerate(distractors)})
        inputs, targets, weights, seg, pos, lengths = [], [], [], [], [], []
        for j in range(o.docs):
            sentences = hs.sentence_source(tok, o.haystack, rng)  # "essay": a new random start
            fact = hs.encode(tok, fact_of[j] + " ") if j in fact_of else np.zeros(0, np.int32)
            lo = max(self.min_doc_length, fact.size + 1)
            if lo > self.max_doc_length:  # construction probed the facts; a rarer tokenization
                raise ValueError(f"{self.name}: row {index}'s fact needs {fact.size + 1} tokens "
                                 f"> max_doc_length={self.max_doc_length}; raise max_doc_length "
                                 "(lowering docs) or data.seq_len")
            d = int(rng.integers(lo, self.max_doc_length + 1))
            doc = np.concatenate([[tok.bos_id], filler(d - 1, fact, sentences, rng),
                                  [tok.eos_id]]).astype(np.int32)
            inputs.append(doc[:-1])
            targets.append(doc[1:])
            weights.append(np.full(d, o.doc_weight, np.float32))
            seg.append(np.full(d, (j + 1) | (ANSWER_BIT if j in positives else 0), np.int32))
            pos.append(np.arange(d, dtype=np.int32))
            lengths.append(d)
        prompt = np.concatenate([[tok.bos_id], hs.encode(tok, query_prompt(keys[0]))])
        answer = hs.encode(tok, values[0])
        query = np.concatenate([prompt, answer, [tok.eos_id]]).astype(np.int32)
        q = query.size - 1
        inputs.append(query[:-1])
        targets.append(query[1:])
        qw = np.full(q, o.query_weight, np.float32)
        qw[prompt.size - 1:] = o.answer_weight  # targets: the answer tokens, then EOS
        weights.append(qw)
        seg.append(np.full(q, -(1 + answer.size), np.int32))
        pos.append(np.arange(o.query_offset, o.query_offset + q, dtype=np.int32))
        used = sum(lengths) + q
        if used > t:  # construction bounds every part; only an unprobed tokenization gets here
            raise ValueError(f"{self.name}: row {index} needs {used} tokens > data.seq_len={t}; "
                             "lower docs or max_doc_length, or raise data.seq_len")
        pad = t - used

        def cat(parts, fill, dtype):
            return np.concatenate(parts + [np.full(pad, fill, dtype)]).astype(dtype)

        arrays = {"inputs": cat(inputs, tok.pad_id, np.int32),
                  "targets": cat(targets, tok.pad_id, np.int32),
                  "loss_weights": cat(weights, 0.0, np.float32),
                  "segment_ids": cat(seg, 0, np.int32), "positions": cat(pos, 0, np.int32)}
        return MSARow(key=keys[0], value=values[0], positives=positives, distractors=distractors,
                      doc_lengths=tuple(lengths), query_length=q,
                      answer_tokens=answer.astype(np.int32), arrays=arrays)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.row(index).arrays
