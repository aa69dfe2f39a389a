"""gated_delta (GDN and KDA): parity of the chunked XLA path and of the Pallas state-pass kernels
(interpret mode, forward and backward) with the step-by-step float32 reference, forward output,
final state and the gradients of every input (q, k, v, g, beta, initial_state); the Pallas
backward kernels against the XLA state pass's VJP on the same chunk operands; no state leak across
packed documents; padding T with g = 0, beta = 0 changes nothing (T not a multiple of the chunk);
lowering for cuda and tpu (forward and backward kernels); the implementation choice; validation.

Inputs follow fla-org's test recipes: L2-normalised q and k, beta = sigmoid(N(0,1)), log-decays
logsigmoid(N(0,1)) / 16 (weak) or logsigmoid(N(0,1)) * 10 (strong: up to ~ -20 per step), T not a
multiple of the chunk, grouped value heads HV = 2H, a random initial state, packed documents with
boundaries inside chunks and padding. Fresh random inputs every run (the seed is in the messages).
"""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aiinfra_jax.kernels import _testing
from aiinfra_jax.kernels._testing import lower_text as _lowered
from aiinfra_jax.kernels.gated_delta import gated_delta_rule, gated_delta_rule_reference
from aiinfra_jax.kernels.gated_delta import pallas_gpu, pallas_tpu, xla

# RMS-relative error tolerances of the chunked form against the float32 recurrence, by input
# dtype (fla asserts 5e-3 for chunked kernels). Measured over 40 seeds: float32 <= 1.3e-6 for o,
# <= 5e-6 for the final state and dq, dk, dv, dbeta, dinitial_state, <= 2.4e-5 for dg (strong
# decays; weak ones stay <= 6e-7). bfloat16 inputs reach the reference rounded the same way, so
# what remains is the bfloat16 rounding of o and of the gradients: <= 2.8e-3.
TOLERANCES = {"float32": 1e-4, "bfloat16": 5e-3}


def _seed() -> int:
    return int(np.random.default_rng().integers(2**31))


def _segments(B: int, T: int) -> np.ndarray:
    """[B,T] ids with boundaries inside chunks, a repeated id (1, 2, 1: three documents) and a
    padding run (id 0) in the middle; every row ends in a document."""
    seg = np.ones((B, T), np.int32)
    seg[0, 20:50] = 2
    seg[0, 50:55] = 0
    seg[0, 55:] = 1
    if B > 1:
        seg[1, :] = 3
        seg[1, T - 10:] = 4
    return seg


def _inputs(seed, *, B, T, H, HV, K, V, kda, strong, init, segments, dtype):
    """Built in NumPy (eager JAX ops would each compile a small program)."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.normal(size=s).astype(np.float32)              # noqa: E731
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)         # noqa: E731
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)                         # noqa: E731
    q, k = unit(normal(B, T, H, K)), unit(normal(B, T, H, K))
    v = normal(B, T, HV, V)
    g = log_sigmoid(normal(*((B, T, HV, K) if kda else (B, T, HV)))) * (10.0 if strong else 1 / 16)
    beta = 1 / (1 + np.exp(-normal(B, T, HV)))
    h0 = jnp.asarray(normal(B, HV, K, V)) if init else None
    seg = jnp.asarray(_segments(B, T)) if segments else None
    do, dstate = jnp.asarray(normal(B, T, HV, V)), jnp.asarray(normal(B, HV, K, V))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    g, beta = jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32)
    return (q, k, v, g, beta, h0), seg, (do, dstate)


# These tiny programs run in milliseconds; LLVM's optimisation passes were most of their compile
# time (about 3x), so the tests compile with the backend optimisation level 0 (numerics as above).
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, static_argnames=("chunk_size", "implementation"),
                   compiler_options=_FAST_COMPILE)
def _both(args, seg, cot, chunk_size, implementation="xla"):
    """(o, state, grads...) of the chunked path and of the reference, one jit (cases of equal
    shapes share the compiled program: the weak and strong decays differ in values only).
    A Pallas implementation runs in interpret mode."""
    do, dstate = cot

    def chunked(q, k, v, g, beta, h0):
        return gated_delta_rule(q, k, v, g, beta, initial_state=h0, segment_ids=seg,
                                chunk_size=chunk_size, output_final_state=True,
                                implementation=implementation,
                                interpret=implementation != "xla")

    def reference(q, k, v, g, beta, h0):
        return gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0, segment_ids=seg)

    outs = []
    for fn in (chunked, reference):
        (o, state), vjp = jax.vjp(fn, *args)
        outs.append((o, state) + vjp((do.astype(o.dtype), dstate)))
    return outs


_NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
# name: (B, T, H, HV, K, V, kda, strong, init, segments, chunk, dtype). T = 100 is not a multiple
# of the chunk (64); the segments put boundaries inside both chunks and carry a document across.
_CASES = {
    "gdn_weak": (2, 100, 2, 4, 16, 16, False, False, True, True, 64, "float32"),
    "gdn_strong": (2, 100, 2, 4, 16, 16, False, True, True, True, 64, "float32"),
    "kda_weak": (2, 100, 2, 4, 16, 16, True, False, True, True, 64, "float32"),
    "kda_strong": (2, 100, 2, 4, 16, 16, True, True, True, True, 64, "float32"),
    "gdn_bf16": (2, 100, 2, 4, 16, 16, False, False, True, True, 64, "bfloat16"),
}


@pytest.mark.parametrize("implementation,case", [("xla", c) for c in _CASES] + [
    ("pallas_tpu", "kda_strong"), ("pallas_gpu", "gdn_weak")])
def test_chunked_matches_recurrence_forward_state_and_gradients(implementation, case):
    """The Pallas kernels (interpret mode) replace the state pass, forward and backward (the
    custom VJP's backward is the Pallas state_pass_bwd for a Pallas implementation, api.py)."""
    B, T, H, HV, K, V, kda, strong, init, segments, chunk, dtype = _CASES[case]
    seed = _seed()
    args, seg, cot = _inputs(seed, B=B, T=T, H=H, HV=HV, K=K, V=V, kda=kda, strong=strong,
                             init=init, segments=segments, dtype=jnp.dtype(dtype))
    actual, expected = _both(args, seg, cot, chunk, implementation)
    tol = TOLERANCES[dtype]
    where = f"{implementation}/{case} seed={seed}"
    for name, a, e in zip(_NAMES, actual, expected):
        assert a.shape == e.shape, f"{where}: {name} shape {a.shape} != {e.shape}"
        err = _testing.rel_err(a, e)
        assert err <= tol, f"{where}: {name} relative error {err:.2e} > {tol:.0e}"
    o, state, dq = actual[:3]
    assert o.dtype == jnp.dtype(dtype) and dq.dtype == jnp.dtype(dtype), where
    assert state.dtype == jnp.float32, where
    if segments:   # padding positions output exactly zero
        assert np.all(np.asarray(o, np.float32)[0, 50:55] == 0), where


_STATE_NAMES = ("dw", "du1", "dqg", "dm", "dkdt", "ddecay", "dS0")


@functools.partial(jax.jit, static_argnames=("module",), compiler_options=_FAST_COMPILE)
def _state_pass_grads(args, cot, module):
    """(kernel's state_pass_bwd in interpret mode, jax.vjp(xla.state_pass)), one jit."""
    expected = jax.vjp(xla.state_pass, *args)[1](cot)
    return module.state_pass_bwd(args, cot, interpret=True), expected


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("module", [pallas_gpu, pallas_tpu], ids=["pallas_gpu", "pallas_tpu"])
def test_pallas_state_pass_backward_matches_xla_vjp(module, kda):
    """state_pass_bwd (interpret mode) against the XLA scan's VJP on the same chunk operands:
    xla.prepare's output for fresh random inputs (GDN: one decay per head broadcast over K; KDA:
    per key channel; packed documents, so some decays are zero and m, qg, kdt are masked) and
    random cotangents of o and the final state. N = 4 chunks; V = 64 spans two value blocks of
    the Triton kernels (BLOCK_V = 32), so the per-block state slices and kernel 3's loop over V
    are exercised."""
    seed = _seed()
    (q, k, v, g, beta, h0), seg, _ = _inputs(seed, B=1, T=60, H=1, HV=2, K=16, V=64, kda=kda,
                                             strong=False, init=True, segments=True,
                                             dtype=jnp.float32)
    p = jax.jit(functools.partial(xla.prepare, scale=0.25, chunk_size=16))(q, k, v, g, beta, seg)
    args = (p.w, p.u1, p.qg, p.m, p.kdt, p.decay, h0)
    rng = np.random.default_rng(seed + 1)
    cot = (jnp.asarray(rng.normal(size=p.u1.shape), jnp.float32),
           jnp.asarray(rng.normal(size=h0.shape), jnp.float32))
    actual, expected = _state_pass_grads(args, cot, module)
    where = f"{module.__name__.rsplit('.', 1)[-1]}/{'kda' if kda else 'gdn'} seed={seed}"
    tol = TOLERANCES["float32"]
    for name, a, e, x in zip(_STATE_NAMES, actual, expected, args):
        assert a.shape == e.shape == x.shape, f"{where}: {name} shape {a.shape} != {e.shape}"
        assert a.dtype == jnp.float32, f"{where}: {name} dtype {a.dtype}"
        err = _testing.rel_err(a, e)
        assert err <= tol, f"{where}: {name} relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_no_state_leak_across_documents(kda):
    """Document 2 of a packed row equals document 2 run alone (outputs and final state), and
    document 1 equals its own run from the initial state. Weak decays, so that a leak would show.
    Chunks of 32 (four KDA sub-chunks), also checked against the reference."""
    seed = _seed()
    T1 = 40                                 # the boundary falls inside the second chunk of 32
    (q, k, v, g, beta, h0), _, _ = _inputs(seed, B=1, T=2 * T1, H=1, HV=2, K=16, V=16, kda=kda,
                                           strong=False, init=True, segments=False,
                                           dtype=jnp.float32)
    seg = jnp.asarray(np.array([[5] * T1 + [9] * T1], np.int32))

    @functools.partial(jax.jit, compiler_options=_FAST_COMPILE)
    def run(q, k, v, g, beta, h0):
        call = functools.partial(gated_delta_rule, chunk_size=32, output_final_state=True)
        packed = call(q, k, v, g, beta, initial_state=h0, segment_ids=seg)
        # The two documents alone, as two rows of one batch (document 1 from h0, 2 from zeros).
        rows = (jnp.concatenate([x[:, :T1], x[:, T1:]]) for x in (q, k, v, g, beta))
        alone = call(*rows, initial_state=jnp.concatenate([h0, jnp.zeros_like(h0)]))
        reference = gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0,
                                               segment_ids=seg)
        return packed, alone, reference

    (o, state), (o_alone, state_alone), (o_ref, state_ref) = run(q, k, v, g, beta, h0)
    where = f"{'kda' if kda else 'gdn'} seed={seed}"
    tol = TOLERANCES["float32"]
    for what, a, e in (("document 1", o[0, :T1], o_alone[0]), ("document 2", o[0, T1:], o_alone[1]),
                       ("final state", state[0], state_alone[1]),
                       ("packed o vs reference", o, o_ref),
                       ("packed state vs reference", state, state_ref)):
        err = _testing.rel_err(a, e)
        assert err <= tol, f"{where}: {what} relative error {err:.2e} > {tol:.0e}"


# ----------------------------------------------------------------------------------------------
# Implementation choice and validation.

def _small(kda=False):
    (q, k, v, g, beta, h0), seg, _ = _inputs(_seed(), B=1, T=12, H=1, HV=2, K=8, V=8, kda=kda,
                                             strong=False, init=True, segments=False,
                                             dtype=jnp.float32)
    return q, k, v, g, beta, h0


_CUSTOM_CALL = {"cuda": "__gpu", "tpu": "tpu_custom_call"}
_KERNEL_CALLS = re.compile(r"custom_call @(__gpu|tpu_custom_call)\b")
# The kernels (pallas_call names) of one forward + backward per platform.
_KERNEL_NAMES = {"cuda": ("gated_delta_state_fwd", "gated_delta_states", "gated_delta_state_bwd",
                          "gated_delta_chunk_grads"),
                 "tpu": ("gated_delta_state_fwd", "gated_delta_states", "gated_delta_state_bwd")}
_ALL_KERNEL_NAMES = set(_KERNEL_NAMES["cuda"] + _KERNEL_NAMES["tpu"])
_LOWER_SHAPES = {  # (B, T, H, HV, K, V, kda)
    "small_kda": (2, 100, 1, 2, 32, 16, True),
    "bench_gdn_16k": (1, 16384, 16, 32, 128, 128, False),
}


@pytest.mark.parametrize("shape", list(_LOWER_SHAPES))
@pytest.mark.parametrize("platform,implementation", [
    ("cpu", None), ("cuda", None), ("tpu", None), ("cuda", "pallas_gpu")])
def test_lowering_picks_the_platform_kernel_forward_and_backward(platform, implementation, shape):
    """implementation=None: the Mosaic state pass and its backward kernels when lowered for tpu,
    the XLA scan for cpu and for cuda (the Triton kernels measured slower than it on an H200:
    api.AUTOMATIC); implementation="pallas_gpu": the Triton kernels. value_and_grad, so the
    forward (the kernel) is not dead code."""
    B, T, H, HV, K, V, kda = _LOWER_SHAPES[shape]
    sd = jax.ShapeDtypeStruct
    args = (sd((B, T, H, K), jnp.bfloat16), sd((B, T, H, K), jnp.bfloat16),
            sd((B, T, HV, V), jnp.bfloat16),
            sd((B, T, HV, K) if kda else (B, T, HV), jnp.float32), sd((B, T, HV), jnp.float32),
            sd((B, HV, K, V), jnp.float32), sd((B, T), jnp.int32))

    def loss(q, k, v, g, beta, h0, seg):
        o, s = gated_delta_rule(q, k, v, g, beta, initial_state=h0, segment_ids=seg,
                                output_final_state=True, implementation=implementation)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    text = _lowered(jax.value_and_grad(loss, argnums=tuple(range(6))), platform, *args)
    calls = _KERNEL_CALLS.findall(text)
    present = sorted(name for name in _ALL_KERNEL_NAMES if re.search(rf"\b{name}\b", text))
    if platform == "cpu" or (platform == "cuda" and implementation is None):
        assert not calls and not present, (calls, present)
    else:
        names = _KERNEL_NAMES[platform]
        assert calls == [_CUSTOM_CALL[platform]] * len(names), (platform, shape, calls)
        assert present == sorted(names), (platform, shape, present)


def test_explicit_implementations_and_fallback(caplog):
    (q, k, v, g, beta, _), _, _ = _inputs(_seed(), B=1, T=16, H=1, HV=2, K=16, V=16, kda=False,
                                          strong=False, init=False, segments=False,
                                          dtype=jnp.float32)
    fn = lambda impl: lambda *a: gated_delta_rule(*a, implementation=impl)   # noqa: E731
    for impl, own, other in (("pallas_gpu", "cuda", "tpu"), ("pallas_tpu", "tpu", "cuda")):
        assert _CUSTOM_CALL[own] in _lowered(fn(impl), own, q, k, v, g, beta)
        with pytest.raises(ValueError, match=f"{impl}.*{other}"):
            _lowered(fn(impl), other, q, k, v, g, beta)
        with pytest.raises(ValueError, match=impl):     # called (lowered) on this CPU machine
            jax.jit(fn(impl))(q, k, v, g, beta)
    with pytest.raises(ValueError, match="implementation"):
        gated_delta_rule(q, k, v, g, beta, implementation="triton")
    # K = 24: not a power of two for Triton tiles. Explicit raises; automatic (XLA on cuda, never
    # the Triton kernel) lowers without a kernel and without a fallback warning.
    q24, k24 = (jnp.concatenate([x, x[..., :8]], axis=-1) for x in (q, k))
    with pytest.raises(ValueError, match="powers of two"):
        gated_delta_rule(q24, k24, v, g, beta, implementation="pallas_gpu", interpret=True)
    with caplog.at_level(logging.WARNING):
        text = _lowered(fn(None), "cuda", q24, k24, v, g, beta)
    assert not _KERNEL_CALLS.search(text)
    assert "cannot run here" not in caplog.text


@pytest.mark.parametrize("changes,pattern", [
    (lambda a: dict(q=a["q"][0]), r"q must have rank 4"),
    (lambda a: dict(k=a["k"][:, :, :, :4]), r"k shape \[1, 12, 1, 4\] must equal q shape"),
    (lambda a: dict(v=a["v"][:, :5]), r"v batch and length"),
    (lambda a: dict(q=a["q"].repeat(3, 2), k=a["k"].repeat(3, 2)), r"HV=2 must be a multiple"),
    (lambda a: dict(v=a["v"].astype(jnp.bfloat16)), r"dtypes must match"),
    (lambda a: dict(q=a["q"].astype(jnp.int32)), r"q.dtype must be one of"),
    (lambda a: dict(g=a["g"][..., None]), r"g must have shape \[B,T,HV\]"),
    (lambda a: dict(g=a["g"].astype(jnp.int32)), r"g must be a float array"),
    (lambda a: dict(beta=a["beta"][..., :1]), r"beta must have shape"),
    (lambda a: dict(initial_state=a["initial_state"][:, :1]), r"initial_state must have shape"),
    (lambda a: dict(segment_ids=jnp.zeros((1, 11), jnp.int32)), r"segment_ids must have shape"),
    (lambda a: dict(segment_ids=jnp.zeros((1, 12))), r"segment_ids must be an integer"),
    (lambda a: dict(scale=-1.0), r"scale must be a positive"),
    (lambda a: dict(chunk_size=12), r"chunk_size must be a positive multiple of 8"),
])
def test_validation_errors(changes, pattern):
    q, k, v, g, beta, h0 = _small()
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    args.update(changes(args))
    with pytest.raises(ValueError, match=pattern):
        gated_delta_rule(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"),
                         args.pop("beta"), **args)


def test_sub_chunk_pairs_hand_written_vjp_matches_autodiff():
    """xla._sub_chunk_pairs (KDA's exact within-sub-chunk products) has a written-out VJP; it
    equals autodiff of the plain formula, with strong decays (exponents down to about -100)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    L, n, c, K = 3, 2, 16, 8
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)      # noqa: E731
    xs, y = (normal(L, n, c, K), normal(L, n, c, K)), normal(L, n, c, K)
    gam = jnp.cumsum(-jnp.abs(normal(L, n, c, K)) * 4.0, axis=2)
    cots = (normal(L, n, c, c), normal(L, n, c, c))

    def plain(xs, y, gam):
        e = xla._sub_chunk_exp(gam)
        return tuple(jnp.sum(x[..., :, None, :] * y[..., None, :, :] * e, axis=-1) for x in xs)

    out, vjp = jax.vjp(xla._sub_chunk_pairs, xs, y, gam)
    ref, ref_vjp = jax.vjp(plain, xs, y, gam)
    grads, ref_grads = jax.tree.leaves(vjp(cots)), jax.tree.leaves(ref_vjp(cots))
    for name, a, e in zip(("A", "M", "dx_A", "dx_M", "dy", "dgam"),
                          list(out) + grads, list(ref) + ref_grads):
        err = _testing.rel_err(a, e)
        assert err <= 1e-5, f"seed={seed}: {name} relative error {err:.2e}"
