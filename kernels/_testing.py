"""Tolerances and comparison helpers shared by every kernel test (stated in one place).

The metric is the relative error of the whole tensor, ||actual - expected|| / ||expected||, as in
fla-org's kernel tests (rmse / rms). The oracle is always the op's float32 reference.
"""

from __future__ import annotations

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
