"""The per-platform compiler options (kernels/compilation.py)."""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aiinfra_jax.kernels import compilation


def test_options_are_per_platform_and_copies():
    cpu = compilation.compiler_options("cpu")
    assert cpu == {"xla_backend_optimization_level": 2}
    cpu["xla_backend_optimization_level"] = 0  # the caller's copy, not the table
    assert compilation.compiler_options("cpu") == {"xla_backend_optimization_level": 2}
    assert compilation.compiler_options("cuda") is None
    assert compilation.compiler_options("tpu") is None


def test_jit_behaves_like_jax_jit():
    @functools.partial(compilation.jit, static_argnums=(1,), donate_argnums=(0,))
    def scaled(x, n):
        return jnp.sin(x) * n

    assert scaled.__name__ == "scaled" and scaled.__wrapped__(np.zeros(2), 3).shape == (2,)
    x = np.linspace(0, 1, 5, dtype=np.float32)
    np.testing.assert_array_equal(scaled(jnp.asarray(x), 3), jax.jit(scaled.__wrapped__,
                                                                     static_argnums=(1,))(x, 3))
    # The jitted function's attributes pass through (exporters and tests lower and trace).
    assert "sine" in scaled.lower(jnp.asarray(x), 3).as_text()
    copy.copy(scaled)  # private attributes never resolve the jit (no recursion)


def test_the_options_reach_the_compiler(monkeypatch):
    """An option XLA does not know fails the compilation: proof that the table is passed on."""
    monkeypatch.setitem(compilation.OPTIONS, jax.default_backend(), {"xla_no_such_option": 1})
    fn = compilation.jit(lambda x: x + 1)
    with pytest.raises(Exception, match="xla_no_such_option"):
        fn(jnp.ones(2))


def test_a_call_inside_another_trace_runs_without_options():
    """jax.jit refuses compiler_options on a jit staged into an outer one (an exporter's jit of
    generate.run_prefill, nnx.eval_shape of a model's initialisation)."""
    inner = compilation.jit(lambda x: jnp.cos(x) * 2)
    x = jnp.linspace(0, 1, 4)
    np.testing.assert_allclose(jax.jit(lambda y: inner(y) + 1)(x), jnp.cos(x) * 2 + 1, rtol=1e-6)
    assert jax.eval_shape(inner, x).shape == (4,)
    np.testing.assert_allclose(inner(x), jnp.cos(x) * 2, rtol=1e-6)  # top level: with options
