"""depth_attention (Attention Residuals): parity of the XLA path and both Pallas kernels (interpret
mode) with the float32 reference, forward and gradients; the two-phase Block AttnRes scheme equals
the naive formula; zero queries give the uniform average; cuda / tpu lowering; validation.

Fresh random inputs every run (the seed is printed in failure messages). Sources get per-token
scales so the RMSNorm of the keys matters; unused buffer slots hold large junk that must not leak.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aiinfra_jax.kernels import _testing
from aiinfra_jax.kernels._testing import lower_text as _lowered
from aiinfra_jax.kernels.depth_attention import (block_depth_attention,
                                                 block_depth_attention_reference, depth_attention,
                                                 depth_attention_reference, merge_partial,
                                                 merge_partial_reference)


def _seed() -> int:
    return int(np.random.default_rng().integers(2**31))


def _inputs(seed, **shapes):
    return _testing.depth_attention_inputs(np.random.default_rng(seed), **shapes)


def _run(fn, q, src, do, dlse):
    """(o, lse, dq, dsrc) of fn(q, src) -> (o, lse) with random cotangents on o and lse."""
    @jax.jit
    def go(q, src):
        (o, lse), vjp = jax.vjp(fn, q, src)
        return (o, lse) + vjp((do.astype(o.dtype), dlse))
    return go(q, src)


_CASES = {  # name: (Q, S, B, T, D, dtype, n_valid)
    "q1_f32_partial": (1, 7, 2, 5, 32, "float32", 4),
    "q3_bf16_full": (3, 4, 1, 6, 64, "bfloat16", 4),
    "q2_f32_one_slot": (2, 5, 3, 1, 16, "float32", 1),
}


@pytest.mark.parametrize("implementation,case", [("xla", c) for c in _CASES] + [
    (impl, c) for impl in ("pallas_gpu", "pallas_tpu") for c in ("q1_f32_partial", "q3_bf16_full")])
def test_parity_with_reference(implementation, case):
    Q, S, B, T, D, dtype, n_valid = _CASES[case]
    seed = _seed()
    q, src, do, dlse = _inputs(seed, Q=Q, S=S, B=B, T=T, D=D, dtype=jnp.dtype(dtype),
                               n_valid=n_valid)
    n = jnp.int32(n_valid)
    expected = _run(lambda q, s: depth_attention_reference(q, s.astype(jnp.float32), n),
                    q, src, do, dlse)
    native = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}.get(implementation) == jax.default_backend()
    actual = _run(lambda q, s: depth_attention(q, s, n, return_lse=True,
                                               implementation=implementation,
                                               interpret=not native), q, src, do, dlse)
    where = f"{implementation}/{case} seed={seed}"
    for name, a, e in zip(("o", "lse", "dq", "dsources"), actual, expected):
        _testing.assert_close(a, e, dtype, what=f"{where}: {name}")
    assert actual[0].dtype == jnp.dtype(dtype) and actual[3].dtype == jnp.dtype(dtype), where
    # unused slots get exactly zero gradient
    assert np.all(np.asarray(actual[3][n_valid:], np.float32) == 0), f"{where}: unused dsources"


def test_zero_queries_give_exactly_the_uniform_average():
    seed = _seed()
    q, src, _, _ = _inputs(seed, Q=2, S=6, B=2, T=3, D=32, dtype=jnp.float32, n_valid=4)
    for impl, interp in (("xla", False), ("pallas_tpu", True)):
        o = jax.jit(lambda q, s: depth_attention(q, s, 4, implementation=impl,
                                                 interpret=interp))(jnp.zeros_like(q), src)
        mean = jnp.mean(src[:4], axis=0)
        np.testing.assert_allclose(o[0], mean, rtol=1e-6, atol=1e-6,
                                   err_msg=f"{impl} seed={seed}")
        np.testing.assert_allclose(o[1], mean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("implementation,has_partial", [("xla", True), ("xla", False),
                                                        ("pallas_gpu", True)])
def test_two_phase_equals_naive_formula_forward_and_gradients(implementation, has_partial):
    seed = _seed()
    rng = np.random.default_rng(seed)
    Q, N, B, T, D, n_finished = 2, 5, 2, 4, 32, 3
    q, blocks, _, _ = _inputs(seed, Q=Q, S=N, B=B, T=T, D=D, dtype=jnp.float32,
                              n_valid=n_finished)
    partial = jnp.asarray(rng.normal(size=(B, T, D)) * 2.0, jnp.float32)
    do = jnp.asarray(rng.normal(size=(Q, B, T, D)), jnp.float32)

    def two_phase(q, blocks, partial):
        return block_depth_attention(q, blocks, jnp.int32(n_finished), partial, has_partial,
                                     implementation=implementation,
                                     interpret=implementation != "xla")

    def naive(q, blocks, partial):
        return block_depth_attention_reference(q, blocks, n_finished, partial, has_partial)

    @jax.jit
    def both(q, blocks, partial, do):
        outs = []
        for fn in (two_phase, naive):
            o, vjp = jax.vjp(fn, q, blocks, partial)
            outs.append((o,) + vjp(do))
        return outs

    outs = both(q, blocks, partial, do)
    for name, a, e in zip(("o", "dq", "dblocks", "dpartial"), *outs):
        _testing.assert_close(a, e, jnp.float32, what=f"{name} seed={seed}")
    if not has_partial:
        assert np.all(np.asarray(outs[0][3]) == 0)


def test_merge_partial_matches_reference():
    seed = _seed()
    q, src, _, _ = _inputs(seed, Q=3, S=3, B=2, T=4, D=16, dtype=jnp.float32, n_valid=3)

    @jax.jit
    def both(q, src, flag):
        o, lse = depth_attention(q, src, return_lse=True)
        partial = src[0] * 0.5 + 1.0
        return (merge_partial(o, lse, q, partial, flag),
                merge_partial_reference(o, lse, q, partial, flag))

    for flag in (True, False):
        a, e = both(q, src, jnp.bool_(flag))
        _testing.assert_close(a, e, jnp.float32, what=f"merge has_partial={flag} seed={seed}")


def test_traced_n_valid_under_jit_and_general_leading_shape():
    seed = _seed()
    q, src, _, _ = _inputs(seed, Q=1, S=5, B=2, T=3, D=16, dtype=jnp.float32, n_valid=2)

    @jax.jit
    def run(q, src, n):
        return (depth_attention(q, src, n), depth_attention(q, src.reshape(5, 6, 16), n),
                depth_attention_reference(q, src, 2)[0])

    jitted, flat, expected = run(q, src, jnp.int32(2))
    _testing.assert_close(jitted, expected, jnp.float32, what=f"traced n_valid seed={seed}")
    _testing.assert_close(flat.reshape(jitted.shape), jitted, jnp.float32, what="[S,N,D]")


# ----------------------------------------------------------------------------------------------
# Lowering for the targets from the CPU machine (nothing runs; inputs are ShapeDtypeStructs).

_CUSTOM_CALL = {"cuda": "__gpu", "tpu": "tpu_custom_call"}
_SHAPES = {  # (Q, S, B, T, D, dtype)
    "small_q3_f32": (3, 5, 1, 7, 64, jnp.float32),
    "full_deep_bf16": (1, 65, 2, 2048, 2048, jnp.bfloat16),     # 32 layers, d_model 2048
}


@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("platform", ["cuda", "tpu", "cpu"])
def test_kernels_lower(platform, backward, shape):
    """implementation=None lowers the platform's kernel for cuda / tpu and the XLA path for cpu."""
    Q, S, B, T, D, dtype = _SHAPES[shape]
    sd = jax.ShapeDtypeStruct

    def attend(q, s, n):
        return depth_attention(q, s, n, return_lse=True)

    def loss(q, s, n):
        o, lse = attend(q, s, n)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    fn = jax.grad(loss, argnums=(0, 1)) if backward else attend
    text = _lowered(fn, platform, sd((Q, D), jnp.float32), sd((S, B, T, D), dtype),
                    sd((), jnp.int32))
    calls = [c for c in re.findall(r"custom_call @(\w+)", text)
             if c in _CUSTOM_CALL.values()]
    want = 0 if platform == "cpu" else 2 if backward else 1
    assert calls == [_CUSTOM_CALL.get(platform)] * want, (platform, shape, calls)


# ----------------------------------------------------------------------------------------------
# Implementation choice and validation.

def _small():
    q, src, _, _ = _inputs(_seed(), Q=1, S=3, B=1, T=2, D=16, dtype=jnp.float32, n_valid=3)
    return q, src


def test_default_implementation_and_explicit_choices():
    q, src = _small()
    auto = _lowered(lambda q, s: depth_attention(q, s), "cpu", q, src)
    assert not any(c in auto for c in _CUSTOM_CALL.values())           # XLA on CPU
    for impl, own, other in (("pallas_gpu", "cuda", "tpu"), ("pallas_tpu", "tpu", "cuda")):
        fn = lambda q, s: depth_attention(q, s, implementation=impl)    # noqa: B023
        assert _CUSTOM_CALL[own] in _lowered(fn, own, q, src)
        with pytest.raises(ValueError, match=f"{impl}.*{other}"):
            _lowered(fn, other, q, src)
        if {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}[impl] != jax.default_backend():
            with pytest.raises(ValueError, match=impl):
                depth_attention(q, src, implementation=impl)
    with pytest.raises(ValueError, match="implementation"):
        depth_attention(q, src, implementation="triton")


def test_unsupported_shape_raises_when_explicit_and_falls_back_when_automatic(caplog):
    q = jnp.ones((1, 24), jnp.float32)
    src = jnp.asarray(np.random.default_rng().normal(size=(3, 1, 2, 24)), jnp.float32)
    with pytest.raises(ValueError, match="power of two"):
        depth_attention(q, src, implementation="pallas_gpu", interpret=True)
    with caplog.at_level(logging.WARNING):
        text = _lowered(lambda q, s: depth_attention(q, s), "cuda", q, src)
    assert _CUSTOM_CALL["cuda"] not in text
    assert "pallas_gpu cannot run here" in caplog.text and "XLA implementation on cuda" in \
        caplog.text


@pytest.mark.parametrize("changes,pattern", [
    (lambda q, s: dict(queries=q[0]), r"queries must have shape \[Q, D\]"),
    (lambda q, s: dict(sources=s[0, 0, 0]), r"sources must have shape"),
    (lambda q, s: dict(queries=q[:, :8]), r"queries D=8 differs from sources D=16"),
    (lambda q, s: dict(sources=s.astype(jnp.int32)), r"sources dtype int32"),
    (lambda q, s: dict(n_valid=0), r"n_valid=0 must lie in \[1, S=3\]"),
    (lambda q, s: dict(n_valid=4), r"n_valid=4 must lie in"),
    (lambda q, s: dict(n_valid=jnp.int32(5)), r"n_valid=5 must lie in"),
    (lambda q, s: dict(n_valid=jnp.ones((2,), jnp.int32)), r"n_valid must be an int"),
    (lambda q, s: dict(n_valid=True), r"n_valid must be an int"),
    (lambda q, s: dict(eps=0.0), r"eps must be a positive"),
])
def test_validation_errors(changes, pattern):
    q, src = _small()
    args = dict(queries=q, sources=src, n_valid=None)
    kwargs = {}
    for name, value in changes(q, src).items():
        (args if name in args else kwargs)[name] = value
    with pytest.raises(ValueError, match=pattern):
        depth_attention(args["queries"], args["sources"], args["n_valid"], **kwargs)
