"""flash_attention: parity of xla and both Pallas kernels (interpret mode) with the float32
reference, forward and q/k/v gradients; masks, GQA, segments, q_offset, empty rows, validation,
cost helpers.

Tolerances: kernels._testing (relative error of the whole tensor; float32 2e-5, bfloat16 1.5e-2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aiinfra_jax.kernels._testing import assert_close
from aiinfra_jax.kernels.flash_attention import (AttentionMask, BlockSizes, flash_attention,
                                                 flash_attention_flops, flash_attention_reference,
                                                 visible_pairs)

IMPLS = ("xla", "pallas_gpu", "pallas_tpu")

# Small tiles so every case spans several query and key tiles (lengths are not tile multiples).
# The TPU kernel rounds key tiles up to 128 lanes, so its skipping is covered by the long case.
SMALL = BlockSizes(block_q=16, block_k=16)

# name: (mask, B, T, S, Hq, Hkv, Dk, Dv, dtype, segments, q_offset)
CASES = {
    "causal_g1_dk_ne_dv": (AttentionMask(), 2, 45, 45, 2, 2, 16, 8, jnp.float32, None, None),
    "window_g2_segments": (AttentionMask(window=7), 1, 50, 50, 4, 2, 16, 16, jnp.float32, "one",
                           None),
    "compressed_g4_pair_segments": (AttentionMask(compressed=(8, 4)), 2, 40, 9, 4, 1, 16, 16,
                                    jnp.float32, "pair", None),
    "decode_offsets_g16": (AttentionMask(), 2, 3, 40, 16, 1, 16, 16, jnp.float32, None,
                           [0, 37]),
    "bidirectional_bf16": (AttentionMask(causal=False), 1, 33, 33, 4, 2, 32, 16, jnp.bfloat16,
                           None, None),
    "window_compressed_offset_g3_bf16": (AttentionMask(window=12, compressed=(4, 2)), 2, 21, 30,
                                         6, 2, 16, 16, jnp.bfloat16, None, [3, 40]),
}


def _inputs(seed, b, t, s, hq, hkv, dk, dv, dtype, segments, q_offset):
    """Fresh normal inputs from numpy (no per-shape compilation of jax.random)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)

    def sorted_ids(length, n):
        return jnp.asarray(np.sort(rng.integers(0, n, (b, length)), axis=1), jnp.int32)

    q, k, v = normal(b, t, hq, dk), normal(b, s, hkv, dk), normal(b, s, hkv, dv)
    seg = None
    if segments == "one":
        seg = sorted_ids(t, 4)
    elif segments == "pair":
        seg = (sorted_ids(t, 3), sorted_ids(s, 3))
    off = None if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    return q, k, v, seg, off, normal(b, t, hq, dv)


@functools.partial(jax.jit, static_argnames=("mask",))
def _reference_vjp(q, k, v, do, seg, off, *, mask):
    def ref(q, k, v):
        return flash_attention_reference(q, k, v, mask=mask, segment_ids=seg, q_offset=off)

    (o, lse), vjp = jax.vjp(ref, q, k, v)
    return o, lse, vjp((do.astype(jnp.float32), jnp.zeros_like(lse)))


def _check_parity(impl, mask, q, k, v, seg, off, do, dtype, block_sizes):
    def run(q, k, v):
        return flash_attention(q, k, v, mask=mask, segment_ids=seg, q_offset=off,
                               return_lse=True, implementation=impl, interpret=impl != "xla",
                               block_sizes=block_sizes)

    @jax.jit
    def run_vjp(q, k, v, do):
        (o, lse), vjp = jax.vjp(run, q, k, v)
        return o, lse, vjp((do, jnp.zeros_like(lse)))

    o, lse, grads = run_vjp(q, k, v, do)
    o_r, lse_r, grads_r = _reference_vjp(q, k, v, do, seg, off, mask=mask)
    assert o.dtype == q.dtype and lse.dtype == jnp.float32
    assert_close(o, o_r, dtype, "o")
    finite = np.isfinite(np.asarray(lse_r))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert_close(jnp.where(finite, lse, 0.0), jnp.where(finite, lse_r, 0.0), dtype, "lse")
    for name, g, g_r in zip("qkv", grads, grads_r):
        assert g.dtype == dtype
        assert_close(g, g_r, dtype, f"d{name}")
    return o, lse, grads


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_reference(case, impl):
    mask, b, t, s, hq, hkv, dk, dv, dtype, segments, q_offset = CASES[case]
    seed = sorted(CASES).index(case) * 10 + IMPLS.index(impl)
    q, k, v, seg, off, do = _inputs(seed, b, t, s, hq, hkv, dk, dv, dtype, segments, q_offset)
    o, lse, grads = _check_parity(impl, mask, q, k, v, seg, off, do, dtype, SMALL)
    if mask.compressed is not None and q_offset is None:
        # The first l - 1 queries see no whole compressed block: o = 0, lse = -inf, and (checked
        # by assert_close, which rejects non-finite values) finite gradients.
        first = mask.compressed[0] - 1
        assert np.all(np.asarray(o[:, :first]) == 0.0)
        assert np.all(np.isneginf(np.asarray(lse[:, :first])))
        assert np.all(np.asarray(grads[0][:, :first]) == 0.0)


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu"])
def test_long_window_skips_and_unmasks_tiles(impl):
    """Key tiles of 128 (the TPU minimum): tiles past the diagonal and before the window are
    skipped, tiles fully inside the window take the unmasked path, edge tiles apply the mask."""
    mask = AttentionMask(window=200)
    bs = BlockSizes(block_q=64, block_k=128)
    q, k, v, seg, off, do = _inputs(7, 1, 400, 400, 2, 1, 16, 16, jnp.float32, None, None)
    _check_parity(impl, mask, q, k, v, seg, off, do, jnp.float32, bs)


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu"])
def test_lse_cotangent(impl):
    """Gradients flow through the returned lse as well as o."""
    mask = AttentionMask(window=9)
    q, k, v, _, _, do = _inputs(4, 1, 24, 24, 2, 1, 16, 16, jnp.float32,
                                None, None)
    dlse = jax.random.normal(jax.random.PRNGKey(5), (1, 24, 2))

    def loss(fn):
        def f(q, k, v):
            o, lse = fn(q, k, v)
            return jnp.sum(o * do) + jnp.sum(lse * dlse)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)

    got = loss(lambda q, k, v: flash_attention(q, k, v, mask=mask, return_lse=True,
                                               implementation=impl, interpret=impl != "xla",
                                               block_sizes=SMALL))
    want = loss(lambda q, k, v: flash_attention_reference(q, k, v, mask=mask))
    for name, g, w in zip("qkv", got, want):
        assert_close(g, w, jnp.float32, f"d{name}")


def test_decode_matches_prefill_rows():
    """A decode step at position p (q_offset) equals row p of the full causal prefill."""
    q, k, v, _, _, _ = _inputs(6, 2, 30, 30, 4, 2, 16, 16, jnp.float32,
                               None, None)
    full = flash_attention(q, k, v, implementation="xla", block_sizes=SMALL)
    pos = jnp.array([0, 29], jnp.int32)
    q_step = jnp.stack([q[0, 0:1], q[1, 29:30]])
    step = flash_attention(q_step, k, v, q_offset=pos, implementation="xla", block_sizes=SMALL)
    assert_close(step[:, 0], jnp.stack([full[0, 0], full[1, 29]]), jnp.float32, "decode")


def test_xla_64k_memory_is_a_few_gb():
    """Forward + backward at T = 65536, Hq = 16, Hkv = 1, D = 128 compiles to < 4 GiB of temps."""
    q = jax.ShapeDtypeStruct((1, 65536, 16, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 65536, 1, 128), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, implementation="xla").astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower().compile()
    mem = compiled.memory_analysis()
    if mem is None:
        pytest.fail("memory_analysis() unavailable on this backend")
    assert mem.temp_size_in_bytes < 4 * 2**30, mem.temp_size_in_bytes


# ----------------------------------------------------------------------------- validation

def _qkv(b=1, t=8, s=8, hq=2, hkv=1, dk=8, dv=8, dtype=jnp.float32):
    key = jax.random.PRNGKey(1)
    return (jax.random.normal(key, (b, t, hq, dk), dtype),
            jax.random.normal(key, (b, s, hkv, dk), dtype),
            jax.random.normal(key, (b, s, hkv, dv), dtype))


@pytest.mark.parametrize("kwargs, match", [
    (dict(mask=AttentionMask(), segment_ids=jnp.zeros((1, 7), jnp.int32)), "segment_ids"),
    (dict(segment_ids=(jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 9), jnp.int32))),
     r"segment_ids\[1\]"),
    (dict(segment_ids=jnp.zeros((1, 8), jnp.float32)), "segment_ids"),
    (dict(q_offset=jnp.zeros((2,), jnp.int32)), "q_offset"),
    (dict(implementation="cuda"), "implementation"),
    (dict(implementation="pallas_gpu"), "implementation"),
    (dict(scale=-1.0), "scale"),
    (dict(mask="causal"), "mask"),
])
def test_bad_arguments_are_named(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, **kwargs)


def test_bad_shapes_and_dtypes_are_named():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q must have rank 4"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="k head dim"):
        flash_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="v length"):
        flash_attention(q, k, v[:, :5])
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        flash_attention(*_qkv(hq=3, hkv=2))
    with pytest.raises(ValueError, match="q.dtype"):
        flash_attention(q.astype(jnp.int32), k, v)
    with pytest.raises(ValueError, match="dtypes must match"):
        flash_attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match="needs S == T"):
        flash_attention(*_qkv(s=6), segment_ids=jnp.zeros((1, 8), jnp.int32))


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=0), "window"), (dict(window=2.5), "window"),
    (dict(compressed=(4, 8)), "compressed"), (dict(compressed=(4, 0)), "compressed"),
    (dict(compressed=[8, 4]), "compressed"), (dict(causal=1), "causal"),
])
def test_mask_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionMask(**kwargs)


def test_mask_is_hashable_static():
    assert hash(AttentionMask(window=4)) == hash(AttentionMask(window=4))
    assert AttentionMask(compressed=(8, 4)) != AttentionMask(compressed=(8, 2))


# ----------------------------------------------------------------------------- cost helpers

def test_visible_pairs_and_flops():
    n = 100
    assert visible_pairs(n, n, AttentionMask()) == n * (n + 1) // 2
    assert visible_pairs(n, n, AttentionMask(causal=False)) == n * n
    # window w: row p sees min(p + 1, w) keys
    assert visible_pairs(n, n, AttentionMask(window=10)) == sum(min(p + 1, 10) for p in range(n))
    # compressed (l=8, d=4): row p sees tokens i with 4i + 7 <= p, i < S
    s = 23
    want = sum(min(max((p - 7) // 4 + 1, 0), s) for p in range(n))
    assert visible_pairs(n, s, AttentionMask(compressed=(8, 4))) == want
    # decode: one row at position 999 sees 1000 keys
    assert visible_pairs(1, 1000, AttentionMask(), q_offset=999) == 1000
    f = flash_attention_flops(2, n, n, 4, 64, 32, AttentionMask())
    assert f == 2 * (n * (n + 1) // 2) * 2 * 4 * (64 + 32)
    assert flash_attention_flops(1, n, n, 1, 64, backward=True) == 2 * (n * (n + 1) // 2) * 320
