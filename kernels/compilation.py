"""XLA compiler options for the project's own jitted programs, chosen per platform.

On the CPU, XLA compiles with LLVM at its backend optimisation level 3 by default. Level 2 compiles
faster, and no program measured here ran slower for it (why level 3 gains nothing was not
investigated; the matmuls are library calls either way). Measured on this 2-core CPU
(eval/BENCHMARKS.md, "Generation throughput", 2026-12-07), each side in its own process,
alternated: the README's long-context grid 52.7 -> 47.2 s (the first batch of each shape,
mostly compilation, 21.7 -> 18.3 s; the prefill 25.3 -> 23.6 s), and the nsa_tiny training step
1.47 -> 1.40 s. Level 1 measured the same as level 2; level 0 ran the prefill at half speed.
Other platforms keep XLA's defaults: nothing was measured there.

JAX has no process-wide setting for this (XLA_FLAGS would also reach the GPU compiler and every
jit of a user's own), so the options go to each jit that the training loop, generation and the
memory bank compile:

    jtrain = jax.jit(step, compiler_options=compiler_options(platform))   # platform known
    @functools.partial(jit, static_argnums=(0,))                         # resolved on first use
    def run_prefill(...): ...

It lives in kernels/, the bottom layer of the import order (kernels <- models <- core <- eval),
so that models/ can use it too.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax

# Per platform name (jax.Device.platform / jax.default_backend()).
OPTIONS: dict[str, dict[str, Any]] = {"cpu": {"xla_backend_optimization_level": 2}}


def compiler_options(platform: str) -> dict[str, Any] | None:
    """The compiler options for programs compiled for `platform` (None: XLA's defaults)."""
    options = OPTIONS.get(platform)
    return None if options is None else dict(options)


class _PlatformJit:
    """jax.jit(fun, **kwargs) with the compiler options of the default backend, created on first
    use (not at import: asking for the backend initialises it, which must wait for
    jax.distributed.initialize in a multi-process run). Attributes (lower, trace, eval_shape,
    clear_cache, ...) are those of the jitted function."""

    def __init__(self, fun: Callable, kwargs: dict[str, Any]):
        functools.update_wrapper(self, fun)
        self._fun, self._kwargs, self._jitted = fun, kwargs, None
        self._nested = jax.jit(fun, **kwargs)

    def _resolve(self):
        if self._jitted is None:
            self._jitted = jax.jit(self._fun, **self._kwargs,
                                   compiler_options=compiler_options(jax.default_backend()))
        return self._jitted

    def __call__(self, *args, **kwargs):
        # Called inside another trace (an exporter's jit, nnx.eval_shape), this jit is staged into
        # the outer program, which is what compiles; jax.jit refuses compiler_options there.
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            return self._nested(*args, **kwargs)
        return self._resolve()(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not set yet (copy, pickle): never resolve for these
            raise AttributeError(name)
        return getattr(self._resolve(), name)


def jit(fun: Callable | None = None, **kwargs: Any):
    """jax.jit for module-level programs, with compiler_options(default backend). Used as
    ``@jit`` or ``@functools.partial(jit, static_argnums=...)`` like jax.jit."""
    if fun is None:
        return functools.partial(jit, **kwargs)
    return _PlatformJit(fun, kwargs)
