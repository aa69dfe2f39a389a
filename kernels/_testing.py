"""Tolerances and comparison helpers shared by every kernel test (stated in one place).

The metric is the relative error of the whole tensor, ||actual - expected|| / ||expected||, as in
fla-org's kernel tests (rmse / rms). The oracle is always the op's float32 reference.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

# Relative-error tolerances by input dtype: float32 near 1e-5, bfloat16 near 1e-2.
TOLERANCES = {"float32": 2e-5, "bfloat16": 1.5e-2}


def tolerance(dtype) -> float:
    return TOLERANCES[jnp.dtype(dtype).name]


def rel_err(actual, expected) -> float:
    a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    denom = np.linalg.norm(e)
    return float(np.linalg.norm(a - e) / max(denom, 1e-30))


def assert_close(actual, expected, dtype, what: str = "output") -> None:
    """Asserts rel_err(actual, expected) <= tolerance(dtype), naming `what` on failure."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = rel_err(actual, expected)
    tol = tolerance(dtype)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.1e} ({jnp.dtype(dtype).name})"


TRITON_CALL = "__gpu$xla.gpu.triton"   # the custom call a Pallas Triton kernel lowers to


@contextlib.contextmanager
def verified_triton_modules():
    """Runs the MLIR verifier on every Triton module that Pallas builds inside the block and
    yields the list of verified kernels (their count grows as lowering goes on).

    Lowering for cuda on a CPU stops at the serialized Triton module; the GPU's Triton compiler
    verifies it first thing, so a module that lowers here can still fail there ("Failed to parse
    Triton module": a JAX 0.10-0.11 lowering bug made an i1 loop bound out of a scalar jnp.where
    of two literals in block_selection, seen on the first H200 run). Verifying here catches that
    class of failure on the CPU. Uses JAX's private Triton lowering module (there is no public
    hook): if a JAX moves it, this raises ImportError / AttributeError naming it, never passes
    silently."""
    from jax._src.pallas.triton import lowering as triton_lowering
    lower = triton_lowering.lower_jaxpr_to_triton_module
    verified: list = []

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        op = result.module.operation
        if op.verify() is False:    # recent MLIR bindings raise MLIRError themselves
            raise RuntimeError("a Pallas Triton module fails MLIR verification:\n"
                               + op.get_asm(print_generic_op_form=True)[:4000])
        verified.append(op)
        return result

    triton_lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield verified
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = lower


def lower_text(fn, platform: str, *args) -> str:
    """jax.jit(fn) traced on args (arrays or ShapeDtypeStructs) and lowered for `platform`, as
    StableHLO text. For "cuda", every Triton module on the way is verified
    (verified_triton_modules) and their number must equal the Triton calls in the text."""
    if platform != "cuda":
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    with verified_triton_modules() as verified:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    calls = text.count(TRITON_CALL)
    assert len(verified) == calls, f"{calls} Triton call(s) but {len(verified)} module(s) verified"
    return text


def depth_attention_inputs(rng: np.random.Generator, *, Q, S, B, T, D, dtype, n_valid):
    """Random depth_attention operands (tests and eval/bench_gpu): queries q [Q,D] float32, sources
    [S,B,T,D] in `dtype` with per-token scales in [0.3, 3) and junk of magnitude 1e3 in the unused
    slots >= n_valid, and cotangents do [Q,B,T,D], dlse [Q,B,T] float32."""
    q = jnp.asarray(rng.normal(size=(Q, D)), jnp.float32)
    src = rng.normal(size=(S, B, T, D)) * rng.uniform(0.3, 3.0, (S, B, T, 1))
    src[n_valid:] = 1e3 * rng.normal(size=(S - n_valid, B, T, D))
    src = jnp.asarray(src, jnp.float32).astype(dtype)
    do = jnp.asarray(rng.normal(size=(Q, B, T, D)), jnp.float32)
    dlse = jnp.asarray(rng.normal(size=(Q, B, T)), jnp.float32)
    return q, src, do, dlse
