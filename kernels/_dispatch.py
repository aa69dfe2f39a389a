"""Choosing a kernel implementation: one rule for every op in kernels/.

Implementations (the `implementation=` argument of every public op):
  None          the best available for the current backend: "pallas_gpu" on a GPU, "pallas_tpu" on a
                TPU, "xla" elsewhere; an op falls back to "xla" (and says why in the log) when its
                Pallas kernel cannot take the given shapes.
  "xla"         the chunked plain-JAX path; runs on every backend.
  "pallas_gpu"  the Pallas kernel for NVIDIA GPUs (Triton lowering).
  "pallas_tpu"  the Pallas kernel for TPUs (Mosaic lowering).

An explicitly requested implementation that cannot run on this backend raises a ValueError instead
of silently falling back. `interpret=True` runs a Pallas kernel in Pallas interpret mode on any
backend (how the CPU test suite checks kernels).
"""

from __future__ import annotations

import logging

import jax

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu")
_PALLAS_BACKEND = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}

log = logging.getLogger(__name__)


def default_implementation(backend: str | None = None) -> str:
    backend = backend or jax.default_backend()
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "xla")


def resolve_implementation(op: str, implementation: str | None, *, interpret: bool = False,
                           backend: str | None = None) -> str:
    """Returns the implementation to run for `op`, or raises a ValueError naming the fix."""
    backend = backend or jax.default_backend()
    if implementation is None:
        return default_implementation(backend)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation={implementation!r} is not one of "
                         f"{(None,) + IMPLEMENTATIONS}")
    needed = _PALLAS_BACKEND.get(implementation)
    if needed is not None and needed != backend and not interpret:
        raise ValueError(
            f"{op}: implementation={implementation!r} needs a {needed.upper()} backend but JAX's "
            f"default backend is {backend!r}. Use implementation=None (best available) or 'xla', "
            f"or pass interpret=True to run the Pallas kernel in interpret mode.")
    return implementation


def fall_back(op: str, implementation: str, reason: str) -> str:
    """Logs why an automatically chosen Pallas kernel gave way to the XLA path; returns 'xla'."""
    log.warning("%s: %s cannot run here (%s); using the XLA implementation", op, implementation,
                reason)
    return "xla"
