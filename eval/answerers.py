"""How a long-context evaluation gets its answers: the ``Answerer`` protocol and the model's.

``ModelAnswerer`` runs a model: batched greedy decoding through the model's own prefill and cached
decode (``aiinfra_jax.generate``), timed, plus the teacher-forced scores of the expected answer.
Anything with the ``Answerer`` call works too (the tests drive the scoring path with stubs that copy
the answer from the prompt or guess). The runner that drives them is ``aiinfra_jax.eval.longctx``.

Letters: B batch of prompts, T prompt tokens, N new tokens (the answer budget).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.kernels.compilation import jit
from aiinfra_jax.generate import decode_loop, prefill
from aiinfra_jax.tasks import Example


# Teacher-forced answers are right-padded to a multiple of this many tokens (and to at least the
# decode budget): one compiled shape per prompt length (each new shape is a compile).
ANSWER_BUCKET = 16
# Prompts likewise, to a multiple of this many tokens.
PROMPT_BUCKET = 128
# ``ModelAnswerer.plan`` lets calls whose caches need between n and CACHE_SHARE * n slots share one
# cache size (the largest of them), so they share compiled programs.
CACHE_SHARE = 2.0


class Answerer(Protocol):
    """Continues each example's prompt; returns generated token ids per example (EOS may end it).

    An answerer may also have ``plan(calls)``: the runner passes it every call it is about to make,
    as (examples, max_new_tokens) pairs, before the first (``ModelAnswerer`` sizes its caches)."""

    def __call__(self, examples: Sequence[Example], max_new_tokens: int) -> list[list[int]]: ...


class ModelAnswerer:
    """Batched greedy decoding with the model's prefill and cached decode, timed separately.

    Greedy picks among the tokenizer's ids only (a padded vocabulary's extra rows are never chosen).
    ``timing`` accumulates seconds and tokens of prefill (B x T per call, padding rows included)
    and of decode (B per step). With ``warmup`` the first call of each new shape, which compiles
    its programs, is timed apart (``warmup_s``, ``warmup_calls``) and left out of the rates; its
    answers are kept (it is not run twice). Without it every call counts, compilation included.
    """

    def __init__(self, model: Any, tokenizer: Any, *, prefill_chunk: int | None = None,
                 warmup: bool = False, score_answers: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.score_answers = score_answers
        self._scores: tuple[tuple[int, ...], list[tuple[float, float]]] | None = None
        # Per-block parameters, sliced once here: the decode loop on a layer-scanned model would
        # slice them inside every step's program (Transformer.unscanned). The prefill and the
        # teacher-forced chunk keep the model as it is: a scanned model compiles its chunk calls
        # once per block instead of once per layer (models/transformer.py).
        unscanned = getattr(model, "unscanned", None)
        self._decoder = model if unscanned is None else unscanned()
        self._graphdef, self._state = nnx.split(self._decoder)  # once: every call's programs
        self._chunk_graphdef, self._chunk_state = nnx.split(model)
        self.prefill_chunk, self.warmup = prefill_chunk, warmup
        cfg = getattr(model, "cfg", None)
        self.max_seq_len = getattr(cfg, "max_seq_len", None)
        self.vocab = int(tokenizer.vocab_size)
        self.timing = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_tokens": 0,
                       "answer_scores_s": 0.0, "warmup_s": 0.0, "warmup_calls": 0}
        self._seen: set[tuple[int, int, int, int | None]] = set()
        self._cache_len: dict[int, int] = {}  # slots a call needs -> slots it gets (see plan)

    def _answers(self, examples: Sequence[Example], min_width: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(answer + EOS tokens [B,W] right-padded, their counts [B]); W is the longest answer or
        min_width, whichever is more, rounded up to a multiple of ANSWER_BUCKET, so that batches
        share compiled shapes. `__call__` passes its decode budget as min_width: the runner gives
        every batch of a length the same budget (longer than any answer at that length), so the
        answers of a length no longer split its batches into two compiled shapes (16 / 48 in the
        README's grid, a second prefill, scoring and decode program per length)."""
        seqs = [np.append(ex.target_tokens, self.tokenizer.eos_id).astype(np.int32)
                for ex in examples]
        counts = np.array([a.size for a in seqs], np.int32)
        width = max(int(counts.max()), int(min_width))
        width = -(-width // ANSWER_BUCKET) * ANSWER_BUCKET
        answers = np.full((len(seqs), width), self.tokenizer.pad_id, np.int32)
        for b, a in enumerate(seqs):
            answers[b, :a.size] = a
        return answers, counts

    def _prefill(self, tokens: np.ndarray, lengths: np.ndarray, room: int):
        need = tokens.shape[1] + room
        return prefill(self.model, tokens, lengths, self._cache_len.get(need, need),
                       chunk_size=self.prefill_chunk)

    def _score(self, logits, cache, lengths, answers: np.ndarray, counts: np.ndarray
               ) -> list[tuple[float, float]]:
        nll, hit = _answer_scores(self._chunk_graphdef, self._chunk_state, cache, logits,
                                  jnp.asarray(answers), jnp.asarray(lengths), self.vocab)
        nll, hit = np.asarray(nll), np.asarray(hit)
        return [(float(nll[b, :n].mean()), float(hit[b, :n].mean()))
                for b, n in enumerate(counts.tolist())]

    def _run(self, tokens: np.ndarray, lengths: np.ndarray, max_new: int, room: int, timed: bool,
             answers: tuple[np.ndarray, np.ndarray] | None = None
             ) -> tuple[list[list[int]], list[tuple[float, float]] | None]:
        """(greedy continuations, teacher-forced scores of `answers` or None); `timed` says whether
        the call enters the rates. The scores come from the prompts' prefill cache before
        decoding starts (see teacher_forced). room: cache slots past the prompt."""
        batch = tokens.shape[0]
        t0 = time.perf_counter()
        logits, cache = self._prefill(tokens, lengths, room)
        jax.block_until_ready((logits, cache))  # dispatch is asynchronous: end the prefill here
        t1 = time.perf_counter()
        scores = None if answers is None else self._score(logits, cache, lengths, *answers)
        t1s = time.perf_counter()
        # One compiled loop of greedy steps (generate's), ending when every row has emitted EOS.
        out, n_out, _ = decode_loop(self._graphdef, self._state, cache, logits,
                                    jnp.asarray(lengths, jnp.int32), max_new, 0.0, 1.0,
                                    self.tokenizer.eos_id, int(self.tokenizer.pad_id), None,
                                    vocab=self.vocab)
        out, n_out = np.asarray(out), np.asarray(n_out)
        steps = int(n_out.max()) - 1  # decode steps run: the loop stops when the last row ends
        t2 = time.perf_counter()
        if timed:
            self.timing["prefill_s"] += t1 - t0
            self.timing["prefill_tokens"] += int(batch * lengths.max())  # not the bucket padding
            self.timing["answer_scores_s"] += t1s - t1
            self.timing["decode_s"] += t2 - t1s
            self.timing["decode_tokens"] += int(batch * steps)
        # Each row's tokens up to its EOS included (the loop pads after it).
        return [out[b, :n].tolist() for b, n in enumerate(n_out.tolist())], scores

    def _room(self, examples: Sequence[Example], max_new_tokens: int
              ) -> tuple[int, tuple[np.ndarray, np.ndarray] | None]:
        """(cache slots past the prompt, the teacher-forced answers or None) of one call."""
        answers = self._answers(examples, max_new_tokens) if self.score_answers else None
        room = max_new_tokens if answers is None else max(max_new_tokens, answers[0].shape[1])
        return room, answers

    def plan(self, calls: Sequence[tuple[Sequence[Example], int]],
             share: float = CACHE_SHARE) -> dict[int, int]:
        """Sizes the caches of the calls to come ((examples, max_new_tokens) each): the cache sizes
        they need, ascending, form groups greedily, each of the sizes within `share` times its
        smallest, and every call of a group gets the group's largest. The decode loop and the
        answer scores compile once per cache size (the prefill still once per prompt width), so
        a grid of 1K and 2K prompts compiles them once instead of twice (eval/BENCHMARKS.md,
        "Generation throughput", 2026-12-07: 3.7 s of a 47 s grid). The price: a call's decode
        reads up to `share` times the cache it needs (the empty slots are masked, so the answers
        are the same), which is why a group stops at 2x instead of spanning a whole 1K-64K grid.
        share=1 turns it off. Returns {slots needed: slots given}."""
        if not share >= 1:
            raise ValueError(f"plan: share={share!r} must be >= 1 (1 = a cache sized to each call)")
        needs = set()
        for examples, max_new_tokens in calls:
            room = self._room(examples, max_new_tokens)[0]
            longest = max(ex.prompt_tokens.size for ex in examples)
            needs.add(self._prompt_width(longest, room) + room)
        left, self._cache_len = sorted(needs), {}
        while left:
            group = [n for n in left if n <= share * left[0]]
            self._cache_len.update({n: group[-1] for n in group})
            left = left[len(group):]
        return dict(self._cache_len)

    def _prompt_width(self, longest: int, room: int) -> int:
        """T of `_prompts` for a longest prompt of `longest` tokens; refuses one that does not fit."""
        if self.max_seq_len is not None and longest + room > self.max_seq_len:
            raise ValueError(f"prompt of {longest} tokens + {room} new tokens exceeds "
                             f"model.max_seq_len={self.max_seq_len}")
        width = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
        if self.max_seq_len is not None:
            width = max(longest, min(width, self.max_seq_len - room))
        return width

    def _prompts(self, examples: Sequence[Example], room: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompts [B,T] right-padded, lengths [B]); T is the longest prompt rounded up to a
        multiple of PROMPT_BUCKET (within max_seq_len - room), so that batches share compiled
        shapes (the padding is masked: it never enters the cache)."""
        lengths = np.array([ex.prompt_tokens.size for ex in examples], np.int32)
        width = self._prompt_width(int(lengths.max()), room)
        tokens = np.full((len(examples), width), self.tokenizer.pad_id, np.int32)
        for b, ex in enumerate(examples):
            tokens[b, :lengths[b]] = ex.prompt_tokens
        return tokens, lengths

    def __call__(self, examples: Sequence[Example], max_new_tokens: int) -> list[list[int]]:
        room, answers = self._room(examples, max_new_tokens)
        tokens, lengths = self._prompts(examples, room)
        shape = (tokens.shape[0], tokens.shape[1], max_new_tokens,
                 None if answers is None else answers[0].shape[1])
        # The first call of a shape compiles; it is timed apart instead of being run twice (the
        # README's grid spent ~14 s running each shape's prefill once more untimed).
        first = self.warmup and shape not in self._seen
        self._seen.add(shape)
        t = time.perf_counter()
        rows, scores = self._run(tokens, lengths, max_new_tokens, room, timed=not first,
                                 answers=answers)
        if first:
            self.timing["warmup_s"] += time.perf_counter() - t
            self.timing["warmup_calls"] += 1
        self._scores = None if scores is None else (tuple(map(id, examples)), scores)
        return rows

    def teacher_forced(self, examples: Sequence[Example]) -> list[tuple[float, float]]:
        """(answer_nll, answer_token_acc) per example, of the expected answer + EOS given the
        prompt. From the prompts' prefill cache: the first answer token is scored by the
        prefill's own logits, the others by one cached chunk of the answer tokens (a few dozen
        tokens instead of a second forward over prompt + answer). With score_answers (the
        default), `__call__` computes them on its way and this returns those for the same
        examples; otherwise it runs the prefill itself."""
        if self._scores is not None and self._scores[0] == tuple(map(id, examples)):
            return self._scores[1]
        answers, counts = self._answers(examples)
        tokens, lengths = self._prompts(examples, answers.shape[1])
        logits, cache = self._prefill(tokens, lengths, answers.shape[1])
        return self._score(logits, cache, lengths, answers, counts)


@functools.partial(jit, static_argnums=(0, 6))
def _answer_scores(graphdef, state, cache, first_logits_bv, answers_bw, lengths_b, vocab: int):
    """Per row, for the answer tokens answers_bw [B,W] (right-padded) that follow the prompt
    whose prefill left `cache` and first_logits_bv: -log p(token) and whether the greedy choice
    (among the tokenizer's `vocab` ids) is the token. Token 0 is scored by the prefill's logits,
    tokens 1.. by one cached call on tokens 0..W-2 at the rows' lengths (the cache is not
    donated: the caller decodes from it afterwards; the padding after a row's answer only
    follows it, causally)."""
    model = nnx.merge(graphdef, state)
    width = answers_bw.shape[1]
    logits = first_logits_bv.astype(jnp.float32)[:, None]
    if width > 1:
        positions = lengths_b[:, None] + jnp.arange(width - 1, dtype=jnp.int32)[None]
        rest, _, _ = model(answers_bw[:, :-1], positions=positions, cache=cache)
        logits = jnp.concatenate([logits, rest.astype(jnp.float32)], axis=1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, answers_bw[..., None], axis=-1)[..., 0]
    hit = logits[..., :vocab].argmax(-1) == answers_bw
    return nll, hit
