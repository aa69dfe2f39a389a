"""Generation: cached decode equals the full forward pass, greedy/nucleus sampling, eos handling."""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aiinfra_jax.generate import decode_step, generate, prefill, sample
from aiinfra_jax.models import ModelConfig, Transformer

# P = 2 layers per block, R = 2 repeats: the cache is a tuple of 2 entries stacked on an axis of 2.
CFG = ModelConfig(vocab_size=96, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64,
                  mixers=("dense", "dense"), max_seq_len=64)
LENGTHS = np.array([3, 6, 5], np.int32)  # right-padded prompts of different lengths
N_NEW = 4
L = int(LENGTHS.max()) + N_NEW


@functools.lru_cache(maxsize=None)
def _model(scan_layers: bool = True) -> Transformer:
    return Transformer(dataclasses.replace(CFG, scan_layers=scan_layers), rngs=nnx.Rngs(0))


@jax.jit
def _forward_fn(graphdef, state, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return nnx.merge(graphdef, state)(tokens, positions=positions)[0]


def _forward(model, tokens):
    return _forward_fn(*nnx.split(model), jnp.asarray(tokens, jnp.int32))


def _sequences(seed=0):
    return np.asarray(jax.random.randint(jax.random.key(seed), (len(LENGTHS), L), 1,
                                         CFG.vocab_size))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_prefill_and_decode_equal_the_full_forward(scan_layers):
    model = _model(scan_layers)
    full = _sequences()
    ref = np.asarray(_forward(model, full))  # [B, L, V]; later tokens cannot affect earlier ones
    rows = np.arange(len(LENGTHS))
    # Right-padded prompts; the padding holds junk that must not matter.
    prompts = full[:, :LENGTHS.max()].copy()
    pad = np.arange(prompts.shape[1])[None, :] >= LENGTHS[:, None]
    prompts[pad] = 7
    last, cache = prefill(model, prompts, LENGTHS, L)
    np.testing.assert_allclose(last, ref[rows, LENGTHS - 1], rtol=1e-5, atol=1e-5)
    assert len(cache) == model.cfg.n_repeats  # cache[r][p]: layer r * P + p, its own buffers
    for block in cache:
        for entry in block:
            np.testing.assert_array_equal(entry["lengths"], LENGTHS)
    for i in range(N_NEW):
        pos = LENGTHS + i
        logits, cache = decode_step(model, cache, full[rows, pos], pos)
        np.testing.assert_allclose(logits, ref[rows, pos], rtol=1e-5, atol=1e-5,
                                   err_msg=f"decode step {i}")
    np.testing.assert_array_equal(cache[0][0]["lengths"], LENGTHS + N_NEW)


def _greedy_reference(model, prompts, n_new):
    """Greedy continuation by repeated full forward passes (no cache)."""
    seqs = [list(p) for p in prompts]
    for _ in range(n_new):
        padded = np.zeros((len(seqs), L), np.int32)
        for b, s in enumerate(seqs):
            padded[b, :len(s)] = s
        logits = np.asarray(_forward(model, padded))
        for b, s in enumerate(seqs):
            s.append(int(np.argmax(logits[b, len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def test_greedy_generation_and_eos():
    model = _model()
    full = _sequences(1)
    prompts = [full[b, :n].tolist() for b, n in enumerate(LENGTHS)]
    out = generate(model, prompts, max_new_tokens=N_NEW)
    expected = _greedy_reference(model, prompts, N_NEW)
    assert out.tokens.shape == (3, N_NEW) and out.tokens.dtype == jnp.int32
    assert out.as_lists() == expected
    np.testing.assert_array_equal(out.lengths, N_NEW)
    assert not np.any(out.finished)
    np.testing.assert_array_equal(out.prompt_lengths, LENGTHS)
    # The same prompts as (tokens, lengths) arrays give the same result.
    tokens = np.where(np.arange(LENGTHS.max())[None] < LENGTHS[:, None], full[:, :6], 0)
    out2 = generate(model, (jnp.asarray(tokens), jnp.asarray(LENGTHS)), max_new_tokens=N_NEW)
    np.testing.assert_array_equal(out2.tokens, out.tokens)

    # Padding ids past the vocabulary (they embedded as NaN, whose masked products turned the
    # padded rows' logits to NaN and their tokens to 0) change nothing.
    far = np.where(np.arange(LENGTHS.max())[None] < LENGTHS[:, None], full[:, :6], 10_000)
    out_far = generate(model, (jnp.asarray(far), jnp.asarray(LENGTHS)), max_new_tokens=N_NEW)
    np.testing.assert_array_equal(out_far.tokens, out.tokens)
    # vocab: sampling stays below a tokenizer's vocabulary when the model's is padded past it
    hot = generate(model, prompts, max_new_tokens=N_NEW, temperature=5.0, rng=jax.random.key(0),
                   vocab=7)
    assert int(np.max(hot.tokens)) < 7

    # eos: the second token generated for row 0 ends that row; others stop at their first eos.
    eos = expected[0][1]
    out3 = generate(model, prompts, max_new_tokens=N_NEW, eos_id=eos, pad_id=95)
    for b, exp in enumerate(expected):
        n = exp.index(eos) + 1 if eos in exp else N_NEW
        assert out3.as_lists()[b] == exp[:n]
        assert int(out3.lengths[b]) == n and bool(out3.finished[b]) == (eos in exp)
        assert np.all(np.asarray(out3.tokens[b, n:]) == 95)
    assert int(out3.lengths[0]) <= 2


def test_sample_greedy_top_p_and_temperature():
    logits = jax.random.normal(jax.random.key(0), (5, 50)) * 3
    argmax = np.argmax(logits, axis=-1)
    np.testing.assert_array_equal(sample(logits, None, 0.0), argmax)
    np.testing.assert_array_equal(sample(logits, jax.random.key(1), 1.0, top_p=1e-6), argmax)
    a = sample(logits, jax.random.key(2), 1.0)
    np.testing.assert_array_equal(a, sample(logits, jax.random.key(2), 1.0))
    assert a.shape == (5,) and a.dtype == jnp.int32


def test_sample_distribution_and_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (4000, 4))
    draws = np.asarray(sample(logits, jax.random.key(3), 1.0))
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, probs, atol=0.03)
    # top_p = 0.7: only the two most likely tokens (0.5 + 0.3 reaches 0.7), renormalised.
    draws = np.asarray(sample(logits, jax.random.key(4), 1.0, top_p=0.7))
    freq = np.bincount(draws, minlength=4) / 4000
    assert freq[2] == 0 and freq[3] == 0
    np.testing.assert_allclose(freq[:2], [0.625, 0.375], atol=0.03)
    # Tokens tied at the nucleus' edge: only as many as reach top_p (0.5 + 0.25 >= 0.6), not both.
    tied = jnp.broadcast_to(jnp.log(jnp.asarray([0.5, 0.25, 0.25], jnp.float32)), (4000, 3))
    freq = np.bincount(np.asarray(sample(tied, jax.random.key(6), 1.0, top_p=0.6)),
                       minlength=3) / 4000
    assert min(freq[1], freq[2]) == 0 and max(freq[1], freq[2]) > 0.25, freq
    # A tiny temperature is the argmax, also when every logit is negative (all were -inf).
    neg = jnp.asarray([[-3.0, -1.0, -2.0, -5.0]])
    assert int(sample(neg, jax.random.key(7), 1e-45)[0]) == 1
    # A high temperature flattens the distribution.
    draws = np.asarray(sample(logits, jax.random.key(5), 100.0))
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, 0.25, atol=0.03)


def test_bad_requests_fail_clearly():
    model = _model()
    with pytest.raises(ValueError, match="rng"):
        generate(model, [[1, 2]], max_new_tokens=2, temperature=0.5)
    with pytest.raises(ValueError, match="lengths"):
        generate(model, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1, 2]], max_new_tokens=CFG.max_seq_len)
    with pytest.raises(ValueError, match="token ids"):
        generate(model, [[1, CFG.vocab_size]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        sample(jnp.zeros((1, 4)), jax.random.key(0), 1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature=inf must be finite"):
        generate(model, [[1, 2]], max_new_tokens=2, temperature=float("inf"),
                 rng=jax.random.key(0))
    with pytest.raises(ValueError, match="vocab=97 must be in"):
        generate(model, [[1, 2]], max_new_tokens=2, vocab=CFG.vocab_size + 1)
    with pytest.raises(ValueError, match=r"prefill: lengths must be in \[1, 2\].*\[0, 3\]"):
        prefill(model, jnp.ones((2, 2), jnp.int32), jnp.asarray([0, 3]), 8)


def test_chunked_prefill_matches_one_shot_prefill():
    model = _model()
    full = _sequences(2)
    prompts = full[:, :LENGTHS.max()]
    last, cache = prefill(model, prompts, LENGTHS, L)
    # Chunks of 4 over 6 prompt tokens: rows end in the first chunk (3) and the second (5, 6).
    last_c, cache_c = prefill(model, prompts, LENGTHS, L, chunk_size=4)
    np.testing.assert_allclose(last_c, last, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache_c[0][0]["lengths"], cache[0][0]["lengths"])
    rows = np.arange(len(LENGTHS))
    logits, _ = decode_step(model, cache, full[rows, LENGTHS], LENGTHS)
    logits_c, _ = decode_step(model, cache_c, full[rows, LENGTHS], LENGTHS)
    np.testing.assert_allclose(logits_c, logits, rtol=1e-5, atol=1e-5)
    out = generate(model, [full[b, :n].tolist() for b, n in enumerate(LENGTHS)],
                   max_new_tokens=N_NEW, prefill_chunk=2)
    ref = generate(model, [full[b, :n].tolist() for b, n in enumerate(LENGTHS)],
                   max_new_tokens=N_NEW)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


@pytest.mark.parametrize("mixer", ["dense", "nsa"])
def test_a_row_past_its_cache_is_refused_never_written(mixer):
    """Issue 20: cache lengths reached 383 with max_len 320. A row whose token does not fit is
    refused: its logits are NaN, its length and its cache slots stay; the other rows go on."""
    cfg = dataclasses.replace(CFG, mixers=(mixer, mixer))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(_sequences()[:2, :6])
    lengths = jnp.array([6, 3], jnp.int32)
    max_len = 8
    _, cache = prefill(model, tokens, lengths, max_len)
    pos = np.array([6, 3])
    for step in range(3):  # row 0 is full after 2 steps; its third token is refused
        before = jax.tree.map(np.asarray, cache)
        logits, cache = decode_step(model, cache, jnp.array([5, 7]), pos)
        finite = np.isfinite(np.asarray(logits)).all(-1)
        assert finite.tolist() == [step < 2, True], (step, finite)
        pos = pos + 1
        layer = cache[0][0]["mixer"] if "mixer" in cache[0][0] else cache[0][0]
        assert np.asarray(layer["lengths"])[0] == min(6 + step + 1, max_len)
    refused = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a)[0], b[0]),
                           cache, before)
    assert all(jax.tree.leaves(refused)), "the refused row's cache changed"


_PROGRAM_TEXT = """
import hashlib, jax, jax.numpy as jnp
from flax import nnx
from aiinfra_jax.generate import run_prefill
from aiinfra_jax.models import ModelConfig, Transformer
cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64,
                  mixers=("nsa", "dense", "gdn"), short_conv=4, max_seq_len=64)
graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
lowered = run_prefill.lower(graphdef, state, jnp.zeros((2, 16), jnp.int32),
                            jnp.array([16, 9], jnp.int32), 24, 16)
from aiinfra_jax.models.attention.nsa_cache import cache_keys
print("|".join(str(list({n for pair in cache_keys(sep).values() for n in pair}))
               for sep in (False, True)))
print(hashlib.sha256(lowered.as_text().encode()).hexdigest())
"""


def test_prefill_program_is_the_same_in_every_process():
    """The compiled programs must not depend on Python's string-hash seed (iterating a set of
    cache buffer names did: the NSA prefill wrote its buffers in a per-process order, so JAX's
    persistent compilation cache missed in every new process). Two seeds whose processes
    iterate both sets of NSA cache names in different orders (checked: else the test would
    prove nothing)."""
    digests, orders = set(), set()
    for seed in (0, 2):
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        out = subprocess.run([sys.executable, "-c", _PROGRAM_TEXT], capture_output=True,
                             text=True, check=True, env=env)
        order, digest = out.stdout.strip().splitlines()[-2:]
        orders.add(order)
        digests.add(digest)
    assert len(orders) == 2 and all(a != b for a, b in zip(*[o.split("|") for o in orders])), (
        "the seeds iterate a set of cache names in one order: pick other seeds", orders)
    assert len(digests) == 1, digests
