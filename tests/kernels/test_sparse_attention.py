"""Parity of sparse_attention (xla, and both Pallas kernels in interpret mode) with the float32
reference, forward and gradients; validation errors; implementation choice.

Fresh random inputs every run (the seed is printed in failure messages). Every parity case has -1
slots, repeated block ids, T and S not multiples of the block size, the first and last key blocks
selected, and one query whose slots are all empty (o = 0, lse = -inf, no NaN in any gradient).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aiinfra_jax.kernels import _testing
from aiinfra_jax.kernels.sparse_attention.tuning import TUNING, xla_tile_size
from aiinfra_jax.kernels.sparse_attention import (sparse_attention, sparse_attention_bytes,
                                                  sparse_attention_flops,
                                                  sparse_attention_reference)


def _inputs(rng, *, B, T, S, Hkv, G, Dk, Dv, P, n, dtype, seg, q_offset):
    key = jax.random.key(int(rng.integers(2**31)))
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, T, Hkv * G, Dk), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, Hkv, Dk), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, Hkv, Dv), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (B, T, Hkv * G, Dv), jnp.float32)
    nb = -(-S // P)
    idx = rng.integers(-1, nb, (B, T, Hkv, n))
    idx[..., 1] = idx[..., 0]                          # repeated ids must count once
    idx[:, -1, :, 0] = nb - 1                          # the last (partial) key block
    idx[:, :, :, -1] = 0                               # the first block, for every query
    idx[0, 0, 0, :] = -1                               # one query sees nothing at all
    idx = jnp.asarray(idx, jnp.int32)
    segments = None
    if seg == "pair":
        segments = (jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32),
                    jnp.asarray(np.sort(rng.integers(0, 3, (B, S)), axis=1), jnp.int32))
    elif seg == "single":
        segments = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)
    offset = None
    if q_offset:
        offset = jnp.asarray(rng.integers(0, S - T + 1, (B,)), jnp.int32)
    return q, k, v, idx, do, segments, offset


def _run(fn, q, k, v, do):
    """(o, lse, dq, dk, dv) of fn(q, k, v) -> (o, lse), with a random cotangent on o and on lse."""
    @jax.jit
    def go(q, k, v, do):
        (o, lse), vjp = jax.vjp(fn, q, k, v)
        dlse = jnp.where(jnp.isfinite(lse), 0.5, 0.0) * jnp.cos(jnp.arange(lse.size)).reshape(
            lse.shape)
        return (o, lse) + vjp((do.astype(o.dtype), dlse))
    return go(q, k, v, do)


# (name, shape / option overrides); T and S are never multiples of P = 16; Dk != Dv.
_BASE = dict(B=2, T=21, S=37, Hkv=2, G=2, Dk=16, Dv=32, P=16, n=4, dtype="float32", causal=True,
             seg=None, q_offset=False)
_CASES = {
    "g1_causal": dict(G=1),
    "g2_noncausal_segpair": dict(causal=False, seg="pair"),
    "g4_bf16_segsingle": dict(G=4, T=37, dtype="bfloat16", seg="single"),
    "g16_decode_offset": dict(B=2, Hkv=1, G=16, T=1, S=45, q_offset=True),
    "g2_offset_bf16": dict(T=5, S=50, q_offset=True, dtype="bfloat16", seg="pair"),
    "g2_noncausal_n1": dict(causal=False, n=2, T=19),
    # Few rows over many blocks: a row recurs in most tiles (the XLA loop's rescaling).
    "g2_few_rows": dict(B=1, T=3, S=200, Hkv=1, n=8, causal=False),
}
_PARAMS = ([("xla", c) for c in _CASES]
           + [(impl, c) for impl in ("pallas_gpu", "pallas_tpu")
              for c in ("g1_causal", "g2_noncausal_segpair", "g4_bf16_segsingle",
                        "g16_decode_offset")])


@pytest.mark.parametrize("implementation,case", _PARAMS)
def test_parity_with_reference(implementation, case):
    _check_parity(implementation, case)


@pytest.mark.parametrize("implementation,case,fields", [
    # A block's entries span several tiles (3 entries of G 2 x P 16 = 96 scores each), and the
    # loop takes one tile a step (sorted, unique rows), two (a row recurs across a step's tiles,
    # its maximum moving after it has sums to rescale) or every tile in one step.
    ("xla", "g2_noncausal_segpair", dict(xla_tile_entries=3, xla_step_scores=96)),
    ("xla", "g2_few_rows", dict(xla_tile_entries=3, xla_step_scores=96)),
    ("xla", "g2_few_rows", dict(xla_tile_entries=3, xla_step_scores=192)),
    ("xla", "g2_noncausal_segpair", dict(xla_tile_entries=3)),
    ("pallas_gpu", "g2_noncausal_segpair", dict(gpu_dkv_max_queries=3)),  # dK / dV lists cut
    ("pallas_tpu", "g2_noncausal_segpair", dict(tpu_max_prefetch=40)),    # several calls
])
def test_parity_when_kernels_split_work(monkeypatch, implementation, case, fields):
    module = importlib.import_module(f"aiinfra_jax.kernels.sparse_attention.{implementation}")
    monkeypatch.setattr(module, "TUNING", dataclasses.replace(module.TUNING, **fields))
    _check_parity(implementation, case)


def test_xla_tile_size_follows_the_entries_per_key_block():
    """A quarter of a key block's average entry list, as a power of two, within [32, 128]: the
    NSA tiny preset's selection (T 2K, n 4, 64 blocks) gets 32, the 8K benchmark's (n 16, 128
    blocks) the cap; a smaller cap wins over the floor (test_parity_when_kernels_split_work)."""
    t = TUNING
    assert xla_tile_size(t, 2048, 4, 64) == 32
    assert xla_tile_size(t, 4096, 4, 64) == 64
    assert xla_tile_size(t, 8192, 16, 128) == 128
    assert xla_tile_size(t, 7, 2, 1) == 32
    assert xla_tile_size(dataclasses.replace(t, xla_tile_entries=3), 2048, 4, 64) == 3


def _check_parity(implementation, case):
    cfg = dict(_BASE, **_CASES[case])
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(cfg["dtype"])
    q, k, v, idx, do, segments, offset = _inputs(
        rng, dtype=dtype, **{n: cfg[n] for n in ("B", "T", "S", "Hkv", "G", "Dk", "Dv", "P", "n",
                                                  "seg", "q_offset")})
    kw = dict(block_size=cfg["P"], causal=cfg["causal"], segment_ids=segments, q_offset=offset)

    f32 = lambda x: x.astype(jnp.float32)
    expected = _run(lambda q, k, v: sparse_attention_reference(f32(q), f32(k), f32(v), idx, **kw),
                    q, k, v, do)
    # Interpret mode except on the kernel's own backend (JAX_PLATFORMS=cuda / tpu runs it for real).
    native = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}.get(implementation) == jax.default_backend()
    actual = _run(lambda q, k, v: sparse_attention(
        q, k, v, idx, return_lse=True, implementation=implementation, interpret=not native, **kw),
        q, k, v, do)
    where = f"{implementation}/{case} seed={seed}"
    for name, a, e in zip(("o", "lse", "dq", "dk", "dv"), actual, expected):
        if name == "lse":
            finite = np.isfinite(np.asarray(e))
            assert np.array_equal(np.isfinite(np.asarray(a)), finite), f"{where}: lse -inf pattern"
            assert not finite.all(), f"{where}: the empty query should have lse = -inf"
            a, e = jnp.where(finite, a, 0.0), jnp.where(finite, e, 0.0)
        else:
            assert a.dtype == dtype, f"{where}: {name} dtype {a.dtype} != {dtype}"
        _testing.assert_close(a, e, dtype, what=f"{where}: {name}")
    assert np.all(np.asarray(actual[0])[0, 0, 0] == 0), f"{where}: o of the empty query"


def test_repeated_indices_count_once():
    rng = np.random.default_rng()
    q, k, v, idx, do, _, _ = _inputs(rng, B=1, T=9, S=40, Hkv=1, G=2, Dk=16, Dv=16, P=8, n=3,
                                     dtype=jnp.float32, seg=None, q_offset=False)
    twice = idx.at[..., 1].set(idx[..., 0])            # slot 1 repeats slot 0
    once = idx.at[..., 1].set(-1)
    a = sparse_attention(q, k, v, twice, block_size=8)
    b = sparse_attention(q, k, v, once, block_size=8)
    _testing.assert_close(a, b, jnp.float32, what="duplicate slot vs. empty slot")


def test_traced_indices_under_jit():
    rng = np.random.default_rng()
    q, k, v, idx, _, _, _ = _inputs(rng, B=1, T=7, S=20, Hkv=1, G=2, Dk=16, Dv=16, P=8, n=2,
                                    dtype=jnp.float32, seg=None, q_offset=False)
    eager = sparse_attention(q, k, v, idx, block_size=8)
    jitted = jax.jit(lambda q, k, v, i: sparse_attention(q, k, v, i, block_size=8))(q, k, v, idx)
    _testing.assert_close(jitted, eager, jnp.float32, what="jit vs eager")


def test_xla_memory_at_64k_tokens():
    """The XLA path's forward + backward at B=1, T=S=64K, Hq=16, Hkv=1, D=128, block 64, n=16
    needs a few GB of temporaries (compiled for CPU, never run)."""
    B, T, Hq, D, P, n = 1, 65536, 16, 128, 64, 16
    sd = jax.ShapeDtypeStruct
    args = (sd((B, T, Hq, D), jnp.bfloat16), sd((B, T, 1, D), jnp.bfloat16),
            sd((B, T, 1, D), jnp.bfloat16), sd((B, T, 1, n), jnp.int32))

    def loss(q, k, v, idx):
        o = sparse_attention(q, k, v, idx, block_size=P, implementation="xla")
        return jnp.sum(o.astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower().compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 4e9, f"XLA sparse_attention fwd+bwd at 64K tokens needs {temp / 1e9:.2f} GB"


# ----------------------------------------------------------------------------------------------
# Implementation choice.

def _small(P=8):
    rng = np.random.default_rng()
    q, k, v, idx, _, _, _ = _inputs(rng, B=1, T=8, S=24, Hkv=1, G=2, Dk=16, Dv=16, P=P, n=2,
                                    dtype=jnp.float32, seg=None, q_offset=False)
    return q, k, v, idx


_KERNEL_CALL = {"cuda": "custom_call @__gpu", "tpu": "custom_call @tpu_custom_call"}


def _lowered(fn, platform, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _uses_kernel(fn, platform, *args) -> bool:
    text = _lowered(fn, platform, *args)
    return any(call in text for call in _KERNEL_CALL.values())


def test_default_implementation_follows_the_lowering_platform():
    q, k, v, idx = _small(P=16)
    auto = lambda *a: sparse_attention(*a, block_size=16)
    assert not _uses_kernel(auto, "cpu", q, k, v, idx)
    for platform, call in _KERNEL_CALL.items():
        assert call in _lowered(auto, platform, q, k, v, idx), platform
    interpreted = lambda *a: sparse_attention(*a, block_size=16, implementation="pallas_tpu",
                                              interpret=True)
    assert "pallas_call" in str(jax.make_jaxpr(interpreted)(q, k, v, idx))


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
def test_explicit_pallas_on_other_platform_without_interpret_raises(implementation):
    q, k, v, idx = _small(P=16)
    own = {"pallas_gpu": "cuda", "pallas_tpu": "tpu"}[implementation]
    fn = lambda *a: sparse_attention(*a, block_size=16, implementation=implementation)
    assert _KERNEL_CALL[own] in _lowered(fn, own, q, k, v, idx)     # its own platform, from CPU
    other = {"cuda": "tpu", "tpu": "cuda"}[own]
    with pytest.raises(ValueError, match=f"{implementation}.*{other}"):
        _lowered(fn, other, q, k, v, idx)
    if {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}[implementation] == jax.default_backend():
        sparse_attention(q, k, v, idx, block_size=16, implementation=implementation)
        return
    with pytest.raises(ValueError, match=implementation):           # eager call on this backend
        sparse_attention(q, k, v, idx, block_size=16, implementation=implementation)


def test_explicit_kernel_that_cannot_take_shapes_raises_and_automatic_falls_back(caplog):
    q, k, v, idx = _small()
    with pytest.raises(ValueError, match="block_size"):
        sparse_attention(q, k, v, idx, block_size=8, implementation="pallas_gpu", interpret=True)
    # block 8 is below both kernels' minimum: XLA on every platform, said in the log when lowered.
    with caplog.at_level(logging.WARNING):
        for platform in _KERNEL_CALL:
            assert not _uses_kernel(lambda *a: sparse_attention(*a, block_size=8), platform,
                                    q, k, v, idx)
    for impl, platform in (("pallas_gpu", "cuda"), ("pallas_tpu", "tpu")):
        assert f"{impl} cannot run here" in caplog.text and f"XLA implementation on {platform}" \
            in caplog.text


def test_unknown_implementation_raises():
    q, k, v, idx = _small()
    with pytest.raises(ValueError, match="implementation"):
        sparse_attention(q, k, v, idx, block_size=8, implementation="triton")


def test_cost_model():
    assert sparse_attention_flops(1, 1, 1, 16, 32, 1, 8) == 2 * 8 * (16 + 32)
    assert sparse_attention_flops(2, 3, 4, 16, 32, 5, 8, backward=True) == (
        2 * 2 * 3 * 4 * 5 * 8 * (3 * 16 + 2 * 32))
    fwd = sparse_attention_bytes(1, 4, 2, 16, 16, 2, 8, Hkv=1, itemsize=2)
    assert fwd >= 4 * 2 * 8 * 32 * 2 and sparse_attention_bytes(
        1, 4, 2, 16, 16, 2, 8, backward=True) > fwd


# ----------------------------------------------------------------------------------------------
# Validation: one test per class of bad input; the message names the argument.

@pytest.mark.parametrize("changes,pattern", [
    (lambda q, k, v, i: dict(q=q[0]), r"\bq must have rank 4"),
    (lambda q, k, v, i: dict(k=k[:, :, :, :, None]), r"\bk must have rank 4"),
    (lambda q, k, v, i: dict(v=jnp.concatenate([v, v])), r"batch sizes differ"),
    (lambda q, k, v, i: dict(v=v[:, :-1]), r"k and v sequence lengths"),
    (lambda q, k, v, i: dict(k=jnp.concatenate([k] * 3, 2), v=jnp.concatenate([v] * 3, 2),
                             block_indices=jnp.concatenate([i] * 3, 2)), r"q heads Hq=2"),
    (lambda q, k, v, i: dict(k=k[..., :8]), r"q head dim Dk=16 differs from k"),
    (lambda q, k, v, i: dict(q=q.astype(jnp.int32)), r"\bq dtype int32 is not supported"),
    (lambda q, k, v, i: dict(k=k.astype(jnp.bfloat16)), r"q, k, v dtypes differ"),
    (lambda q, k, v, i: dict(block_indices=i[:, :-1]), r"block_indices must have shape"),
    (lambda q, k, v, i: dict(block_indices=i.astype(jnp.float32)), r"block_indices must be int32"),
    (lambda q, k, v, i: dict(block_indices=i.at[0, 0, 0, 0].set(3)), r"block_indices must lie in"),
    (lambda q, k, v, i: dict(block_indices=i.at[0, 0, 0, 0].set(-2)), r"block_indices must lie in"),
    (lambda q, k, v, i: dict(block_size=0), r"block_size must be a positive int"),
    (lambda q, k, v, i: dict(q_offset=jnp.zeros((2,), jnp.int32)), r"q_offset must be"),
    (lambda q, k, v, i: dict(segment_ids=jnp.zeros((1, 8), jnp.int32)), r"segment_ids as one"),
    (lambda q, k, v, i: dict(segment_ids=(jnp.zeros((1, 8), jnp.int32),
                                          jnp.zeros((1, 23), jnp.int32))),
     r"segment_ids \(kv_segment_ids\)"),
])
def test_validation_errors(changes, pattern):
    q, k, v, idx = _small()
    args = dict(q=q, k=k, v=v, block_indices=idx)
    kwargs = dict(block_size=8)
    for name, value in changes(q, k, v, idx).items():
        (args if name in args else kwargs)[name] = value
    with pytest.raises(ValueError, match=pattern):
        sparse_attention(args["q"], args["k"], args["v"], args["block_indices"], **kwargs)
