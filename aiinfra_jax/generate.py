"""Batched generation for any registered model: prefill + cached decode, greedy or nucleus sampling.

Shape letters: B batch (prompts), T padded prompt length, V vocabulary, N max_new_tokens,
S cache slots (T + N).

The model is any module with the Transformer interface (`init_cache`, `features`, `logits`,
`__call__(tokens, positions=, segment_ids=, cache=)`); nothing here knows which mixer it runs.
Prompts are right-padded; the prefill marks the padding with segment id 0 so each row's cache length
is its true prompt length, and decoding continues from there (positions = row length).
The model is split into (graphdef, state) and run inside jax.jit, so repeated calls with the same
model and shapes reuse the compiled programs. Inside the decode programs a model with an
`unscanned()` method (the Transformer) is first turned into its per-block form, once, outside the
decode loop: one-token cached calls run the blocks in a Python loop (models/transformer.py), and
per-block parameters keep the loop from slicing the stacked ones again at every step. The prefill
takes the model as it is: a layer-scanned Transformer runs a chunk's blocks in its scan, compiled
once per block instead of once per layer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.kernels.compilation import jit


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    tokens: jax.Array  # [B, N] int32; pad_id after a row's end
    lengths: jax.Array  # [B] int32: generated tokens per row, eos included
    finished: jax.Array  # [B] bool: the row stopped on eos (False: ran out of max_new_tokens)
    prompt_lengths: jax.Array  # [B] int32

    def as_lists(self) -> list[list[int]]:
        """Each row's generated tokens (eos included) as a Python list."""
        toks, lens = np.asarray(self.tokens), np.asarray(self.lengths)
        return [toks[b, :lens[b]].tolist() for b in range(toks.shape[0])]


# Sampling -----------------------------------------------------------------------------------------
def _check_sampling(temperature: float, top_p: float) -> None:
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature={temperature} must be finite and >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")


def sample(logits: jax.Array, rng: jax.Array | None, temperature: float = 0.0,
           top_p: float = 1.0) -> jax.Array:
    """Next tokens [B] int32 from logits [B,V].

    temperature == 0: argmax (rng unused). Otherwise softmax(logits / temperature) restricted to the
    smallest set of most likely tokens whose probability reaches top_p (nucleus sampling).
    temperature and top_p are Python floats (static under jit).
    """
    _check_sampling(temperature, top_p)
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if rng is None:
        raise ValueError("sample: temperature > 0 needs an rng key")
    # The max subtracted first: at a tiny temperature the best logit stays 0 (not -inf with the
    # rest), so sampling tends to the argmax.
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
    if top_p < 1.0:
        order = jnp.argsort(-scaled, axis=-1)  # by rank, so tokens tied at the edge are not all in
        probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < top_p  # the most likely token is always kept
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    return jax.random.categorical(rng, scaled, axis=-1).astype(jnp.int32)


def check_vocab(vocab: int | None, model_vocab: int, who: str) -> None:
    """`vocab` (decode_loop's: ids < vocab only; None = all) must lie within the model's."""
    if vocab is not None and not 1 <= vocab <= model_vocab:
        raise ValueError(f"{who}: vocab={vocab} must be in [1, {model_vocab}] (the model's "
                         "vocabulary)")


# Prefill and decode (pure functions of graphdef + state, jitted) --------------------------------
def inference_model(graphdef, state) -> nnx.Module:
    """The split model merged inside a jitted program, in its per-block form (module docstring)."""
    model = nnx.merge(graphdef, state)
    unscanned = getattr(model, "unscanned", None)
    return model if unscanned is None else unscanned()


@functools.partial(jit, static_argnums=(0, 4, 5))
def run_prefill(graphdef, state, tokens_bt, lengths_b, max_len: int, chunk: int):
    """The compiled prefill of `prefill` on a split model: (logits [B,V] at each row's last prompt
    token, cache). Public for the exporters (export_stablehlo lowers it as it is). The model is
    not unscanned (module docstring)."""
    model = nnx.merge(graphdef, state)
    batch, seq = tokens_bt.shape
    n_chunks = seq // chunk
    cache = model.init_cache(batch, max_len)

    def run_chunk(cache, last_b1d, start, tokens_bc):
        positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
        segment_ids = (positions < lengths_b[:, None]).astype(jnp.int32)
        # Padding ids may be anything (an id past the vocabulary embeds as NaN, which the masked
        # attention's products would spread): token 0 in their place.
        tokens_bc = jnp.where(segment_ids != 0, tokens_bc, 0)
        x, cache, _ = model.features(tokens_bc, positions=positions, segment_ids=segment_ids,
                                     cache=cache)
        # Keep the hidden state of each row's last prompt token once its chunk is reached.
        index = jnp.clip(lengths_b - 1 - start, 0, chunk - 1)
        here = jnp.take_along_axis(x, index[:, None, None], axis=1)  # [B,1,D]
        in_chunk = ((lengths_b - 1 >= start) & (lengths_b - 1 < start + chunk))[:, None, None]
        last_b1d = here if last_b1d is None else jnp.where(in_chunk, here, last_b1d)
        return cache, last_b1d

    if n_chunks == 1:
        cache, last_b1d = run_chunk(cache, None, 0, tokens_bt)
    else:
        # The first chunk fixes the hidden-state dtype; the rest run in a scan.
        cache, last_b1d = run_chunk(cache, None, 0, tokens_bt[:, :chunk])
        chunks_nbc = tokens_bt[:, chunk:].reshape(batch, n_chunks - 1, chunk).transpose(1, 0, 2)

        def body(carry, xs):
            cache, last = carry
            j, tokens_bc = xs
            return run_chunk(cache, last, j * chunk, tokens_bc), None

        js = jnp.arange(1, n_chunks, dtype=jnp.int32)
        (cache, last_b1d), _ = jax.lax.scan(body, (cache, last_b1d), (js, chunks_nbc))
    return model.logits(last_b1d)[:, 0], cache


def run_step(model, cache, tokens_b, positions_b):
    """One cached decode step of a merged model: (logits [B,V], cache). Not jitted; the callers
    (decode_step, generate's loop, export_stablehlo) compile it in their own programs."""
    logits, cache, _ = model(tokens_b[:, None], positions=positions_b[:, None], cache=cache)
    return logits[:, 0], cache


# The cache is donated: a decode step updates it in place instead of copying all S slots.
@functools.partial(jit, static_argnums=(0,), donate_argnums=(2,))
def _decode_step(graphdef, state, cache, tokens_b, positions_b):
    return run_step(inference_model(graphdef, state), cache, tokens_b, positions_b)


def prefill(model: nnx.Module, tokens: jax.Array, lengths: jax.Array, max_len: int, *,
            chunk_size: int | None = None) -> tuple[jax.Array, Any]:
    """Runs right-padded prompts tokens [B,T] (true lengths [B], >= 1) through the model in one
    jitted call. Returns (logits [B,V] float32 at each row's last prompt token, cache with room for
    max_len tokens per row).

    chunk_size: feed the prompts in chunks of this many tokens through the cache (a scan inside the
    same jitted call), so attention never holds more than [chunk, max_len] scores per head; the
    prompts are right-padded up to a multiple of it (and the cache made at least that long). None =
    one chunk of T.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
        raise ValueError(f"prefill: tokens must be [B,T] and lengths [B]; got {tokens.shape} and "
                         f"{lengths.shape}")
    seq = tokens.shape[1]
    if max_len < seq:
        raise ValueError(f"prefill: max_len={max_len} is shorter than the prompts ({seq} tokens)")
    try:
        known = np.asarray(lengths)
    except jax.errors.TracerArrayConversionError:  # prefill traced inside a caller's jit
        known = None
    if known is not None and known.size and (known.min() < 1 or known.max() > seq):
        raise ValueError(f"prefill: lengths must be in [1, {seq}] (the prompts' width), got "
                         f"{known.tolist()}")
    if chunk_size is None or chunk_size >= seq:
        chunk = seq
    elif chunk_size < 1:
        raise ValueError(f"prefill: chunk_size={chunk_size} must be a positive int or None")
    else:
        chunk = int(chunk_size)
        padded = -(-seq // chunk) * chunk
        tokens = jnp.pad(tokens, ((0, 0), (0, padded - seq)))
        max_len = max(max_len, padded)
    graphdef, state = nnx.split(model)
    return run_prefill(graphdef, state, tokens, lengths, int(max_len), chunk)


def decode_step(model: nnx.Module, cache: Any, tokens: jax.Array,
                positions: jax.Array) -> tuple[jax.Array, Any]:
    """Feeds one token per row (tokens [B] at positions [B], normally the rows' cache lengths).
    Returns (logits [B,V] float32, updated cache). The cache passed in is donated (updated in
    place, O(1) per step instead of a copy of every slot): use only the returned one afterwards.
    A row whose cache is full (its length = the max_len it was made with) is refused: nothing is
    written and its logits are NaN (checked on the device, so the loop never waits for it);
    `generate` sizes the cache so that this cannot happen."""
    graphdef, state = nnx.split(model)
    return _decode_step(graphdef, state, cache, jnp.asarray(tokens, jnp.int32),
                        jnp.asarray(positions, jnp.int32))


@functools.partial(jit, static_argnums=(0, 5, 6, 7, 8, 9), static_argnames=("vocab",))
def decode_loop(graphdef, state, cache, first_logits, positions_b, max_new: int,
                temperature: float, top_p: float, eos_id: int | None, pad_id: int, rng, *,
                vocab: int | None = None):
    """The compiled decode loop of `generate` after a prefill: (tokens [B,N], generated lengths
    [B], finished [B]); positions_b: the first generated token's positions (the prompt lengths,
    or an MSA query's offset plus them). vocab: pick among ids < vocab only (a tokenizer's ids,
    when the model's vocabulary is padded past them); None = every id."""
    model = inference_model(graphdef, state)
    batch = first_logits.shape[0]

    def pick(logits, step):
        key = None if rng is None else jax.random.fold_in(rng, step)
        return sample(logits if vocab is None else logits[:, :vocab], key, temperature, top_p)

    def is_eos(tok):
        return jnp.zeros_like(tok, jnp.bool_) if eos_id is None else tok == eos_id

    tok = pick(first_logits, 0)
    out = jnp.full((batch, max_new), pad_id, jnp.int32).at[:, 0].set(tok)
    init = (jnp.int32(1), cache, tok, positions_b, is_eos(tok), out, jnp.ones((batch,), jnp.int32))

    def cond(carry):
        step, _, _, _, done, _, _ = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, cache, tok, pos, done, out, n_out = carry
        logits, cache = run_step(model, cache, tok, pos)
        new = jnp.where(done, pad_id, pick(logits, step))
        out = jax.lax.dynamic_update_slice(out, new[:, None], (0, step))
        n_out = n_out + (~done).astype(jnp.int32)
        done = done | is_eos(new)
        return step + 1, cache, new, pos + 1, done, out, n_out

    _, _, _, _, done, out, n_out = jax.lax.while_loop(cond, body, init)
    return out, n_out, done


def _pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    if len(prompts) == 0:
        raise ValueError("generate: prompts is empty")
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.full((len(prompts), int(lengths.max())), pad_id, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = np.asarray(p, np.int32)
    return tokens, lengths


def generate(model: nnx.Module,
             prompts: Sequence[Sequence[int]] | tuple[jax.Array, jax.Array], *,
             max_new_tokens: int, rng: jax.Array | None = None, temperature: float = 0.0,
             top_p: float = 1.0, eos_id: int | None = None, pad_id: int = 0,
             prefill_chunk: int | None = None, vocab: int | None = None) -> GenerateResult:
    """Generates up to max_new_tokens per prompt; a row stops after emitting eos_id.

    prompts: a list of token lists, or (tokens [B,T] right-padded, lengths [B]).
    vocab: generate ids < vocab only; pass the tokenizer's vocab_size when the model's vocabulary
    is padded past it (ModelConfig.with_vocab rounds it up), else sampling can pick an id the
    tokenizer cannot decode. None = every id of the model.
    Batched prefill in one jitted call, then a jitted lax.while_loop of decode steps that ends when
    every row has stopped. Sampling: see `sample` (temperature 0 = greedy; rng needed otherwise).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} must be a positive int")
    _check_sampling(temperature, top_p)
    if temperature > 0 and rng is None:
        raise ValueError("generate: temperature > 0 needs rng=jax.random.key(...)")
    if isinstance(prompts, tuple) and len(prompts) == 2 and hasattr(prompts[0], "shape"):
        tokens, lengths = np.asarray(prompts[0], np.int32), np.asarray(prompts[1], np.int32)
        if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
            raise ValueError(f"generate: (tokens, lengths) must be [B,T] and [B]; got "
                             f"{tokens.shape} and {lengths.shape}")
    else:
        tokens, lengths = _pad_prompts(prompts, pad_id)
    if lengths.min() < 1 or lengths.max() > tokens.shape[1]:
        raise ValueError(f"generate: prompt lengths must be in [1, {tokens.shape[1]}], got "
                         f"{lengths.tolist()}")
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        valid = tokens[np.arange(tokens.shape[1])[None, :] < lengths[:, None]]
        if valid.min() < 0 or valid.max() >= cfg.vocab_size:
            raise ValueError(f"generate: prompt token ids must be in [0, {cfg.vocab_size}), got "
                             f"range [{valid.min()}, {valid.max()}]")
        check_vocab(vocab, cfg.vocab_size, "generate")
        for name, tok in (("eos_id", eos_id), ("pad_id", pad_id)):
            if tok is not None and not 0 <= tok < cfg.vocab_size:
                raise ValueError(f"generate: {name}={tok} is outside the vocabulary "
                                 f"[0, {cfg.vocab_size})")
    max_len = tokens.shape[1] + max_new_tokens
    if cfg is not None and max_len > cfg.max_seq_len:
        raise ValueError(f"generate: prompt length {tokens.shape[1]} + max_new_tokens "
                         f"{max_new_tokens} = {max_len} exceeds ModelConfig.max_seq_len="
                         f"{cfg.max_seq_len}")
    lengths_j = jnp.asarray(lengths)
    first_logits, cache = prefill(model, tokens, lengths_j, max_len, chunk_size=prefill_chunk)
    graphdef, state = nnx.split(model)
    out, n_out, done = decode_loop(graphdef, state, cache, first_logits, lengths_j,
                                    max_new_tokens, float(temperature), float(top_p), eos_id,
                                    int(pad_id), rng, vocab=None if vocab is None else int(vocab))
    return GenerateResult(tokens=out, lengths=n_out, finished=done, prompt_lengths=lengths_j)
