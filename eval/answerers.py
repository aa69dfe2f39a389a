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

from aiinfra_jax.generate import decode_step, prefill
from aiinfra_jax.tasks import Example


class Answerer(Protocol):
    """Continues each example's prompt; returns generated token ids per example (EOS may end it)."""

    def __call__(self, examples: Sequence[Example], max_new_tokens: int) -> list[list[int]]: ...


class ModelAnswerer:
    """Batched greedy decoding with the model's prefill and cached decode, timed separately.

    Greedy picks among the tokenizer's ids only (a padded vocabulary's extra rows are never chosen).
    ``timing`` accumulates seconds and tokens of prefill (B x T per call, padding rows included)
    and of decode (B per step). With ``warmup`` each new shape is run once untimed first, so the
    rates exclude compilation.
    """

    def __init__(self, model: Any, tokenizer: Any, *, prefill_chunk: int | None = None,
                 warmup: bool = False):
        self.model, self.tokenizer = model, tokenizer
        # Per-block parameters, sliced once here: decode_step on a layer-scanned model would
        # slice them inside every step's program (Transformer.unscanned).
        unscanned = getattr(model, "unscanned", None)
        self._decoder = model if unscanned is None else unscanned()
        self.prefill_chunk, self.warmup = prefill_chunk, warmup
        cfg = getattr(model, "cfg", None)
        self.max_seq_len = getattr(cfg, "max_seq_len", None)
        self.vocab = int(tokenizer.vocab_size)
        self.timing = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_tokens": 0,
                       "warmup_s": 0.0}
        self._seen: set[tuple[int, int, int]] = set()

    def _greedy(self, logits_bv: Any) -> np.ndarray:
        """Argmax over the tokenizer's ids only (the model's vocabulary is padded past them)."""
        return np.asarray(jax.device_get(logits_bv[:, :self.vocab].argmax(-1)), np.int32)

    def _run(self, tokens: np.ndarray, lengths: np.ndarray, max_new: int, timed: bool
             ) -> list[list[int]]:
        """Greedy decoding; untimed (warm-up) runs stop after one decode step."""
        batch, seq = tokens.shape
        eos = self.tokenizer.eos_id
        t0 = time.perf_counter()
        logits, cache = prefill(self._decoder, tokens, lengths, seq + max_new,
                                chunk_size=self.prefill_chunk)
        next_tok = self._greedy(logits)
        t1 = time.perf_counter()
        out = np.full((batch, max_new), self.tokenizer.pad_id, np.int32)
        done = np.zeros(batch, bool)
        pos = lengths.astype(np.int32).copy()
        steps = 0
        for step in range(max_new):
            out[:, step] = np.where(done, self.tokenizer.pad_id, next_tok)
            done |= next_tok == eos
            if done.all() or step == max_new - 1 or (not timed and steps == 1):
                break
            logits, cache = decode_step(self._decoder, cache, next_tok, pos)
            next_tok = self._greedy(logits)
            pos += 1
            steps += 1
        t2 = time.perf_counter()
        if timed:
            self.timing["prefill_s"] += t1 - t0
            self.timing["prefill_tokens"] += int(batch * seq)
            self.timing["decode_s"] += t2 - t1
            self.timing["decode_tokens"] += int(batch * steps)
        rows = []
        for b in range(batch):
            row = out[b].tolist()
            rows.append(row[:row.index(eos) + 1] if eos in row else row)
        return rows

    def __call__(self, examples: Sequence[Example], max_new_tokens: int) -> list[list[int]]:
        lengths = np.array([ex.prompt_tokens.size for ex in examples], np.int32)
        tokens = np.full((len(examples), int(lengths.max())), self.tokenizer.pad_id, np.int32)
        for b, ex in enumerate(examples):
            tokens[b, :lengths[b]] = ex.prompt_tokens
        if self.max_seq_len is not None and tokens.shape[1] + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt of {tokens.shape[1]} tokens + {max_new_tokens} new tokens "
                             f"exceeds model.max_seq_len={self.max_seq_len}")
        shape = (tokens.shape[0], tokens.shape[1], max_new_tokens)
        if self.warmup and shape not in self._seen:
            t = time.perf_counter()
            self._run(tokens, lengths, max_new_tokens, timed=False)
            self.timing["warmup_s"] += time.perf_counter() - t
        self._seen.add(shape)
        return self._run(tokens, lengths, max_new_tokens, timed=True)

    def teacher_forced(self, examples: Sequence[Example]) -> list[tuple[float, float]]:
        """(answer_nll, answer_token_acc) per example: one forward pass over prompt + answer + EOS
        (right-padded; causal, so the padding changes nothing), logits only at the answer."""
        eos = self.tokenizer.eos_id
        seqs = [np.concatenate([ex.prompt_tokens, ex.target_tokens, [eos]]).astype(np.int32)
                for ex in examples]
        starts = np.array([ex.prompt_tokens.size for ex in examples], np.int32)
        width = max(s.size for s in seqs) - int(starts.min())
        tokens = np.full((len(seqs), int(starts.max()) + width), self.tokenizer.pad_id,
                         np.int32)
        for b, sq in enumerate(seqs):
            tokens[b, :sq.size] = sq
        graphdef, state = nnx.split(self.model)
        nll, hit = _answer_scores(graphdef, state, tokens, starts, width, self.vocab)
        nll, hit = np.asarray(nll), np.asarray(hit)
        out = []
        for b, sq in enumerate(seqs):
            n = sq.size - int(starts[b])  # answer tokens + EOS
            out.append((float(nll[b, :n].mean()), float(hit[b, :n].mean())))
        return out


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _answer_scores(graphdef, state, tokens_bt, starts_b, width: int, vocab: int):
    """Per row, for the `width` targets from starts_b on: -log p(target) and whether the greedy
    choice (among the tokenizer's `vocab` ids) is the target. Only the gathered rows of hidden
    states go through the output head."""
    model = nnx.merge(graphdef, state)
    batch, seq = tokens_bt.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    x, _, _ = model.features(tokens_bt, positions=positions)
    at = starts_b[:, None] - 1 + jnp.arange(width, dtype=jnp.int32)[None]  # predicts token at+1
    h = jnp.take_along_axis(x, at[..., None], axis=1)
    logits = model.logits(h).astype(jnp.float32)
    target = jnp.take_along_axis(tokens_bt, at + 1, axis=1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    hit = logits[..., :vocab].argmax(-1) == target
    return nll, hit
