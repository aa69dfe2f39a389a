"""Small array helpers shared by the kernel implementations (imports only JAX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_precision(dtype):
    """The precision for a float32 dot inside a Pallas kernel: HIGHEST (Triton otherwise runs
    float32 dots as TF32, about 1e-3 relative error, far outside the float32 tolerances); the
    default for other dtypes."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def pad_axis(x, axis: int, size: int, value=0):
    """x padded with `value` at the end of `axis` up to length `size` (None and exact fits pass
    through unchanged)."""
    if x is None or x.shape[axis] == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads, constant_values=value)
