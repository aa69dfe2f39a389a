"""Test-wide setup: 8 simulated CPU devices (for the sharding tests), set before JAX is imported."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import helpers` (tests/helpers.py)

# `python -m pytest` puts the repository root on sys.path, where our top-level `kernels/` folder
# (aiinfra_jax.kernels, by pyproject's package-dir) would shadow Hugging Face's `kernels` package,
# which recent transformers 5.x require and import (5.25.0 here) (the export tests then fail with "cannot import name
# 'CUDAProperties' from 'kernels'"). The tests import this project only as the installed
# `aiinfra_jax`, so the root comes off the path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# The suite's programs are tiny and compiled once each, so XLA:CPU's compile time is most of the
# suite's time: without its backend optimizations (-O0) and with its per-op emitters instead of
# the fusion emitters, programs compile about 3x faster (measured on test_train's end-to-end runs:
# 91 s -> 35 s) and compute the same values to float32 rounding (every tolerance below holds).
# AIINFRA_TEST_XLA_OPT=full keeps XLA's defaults (e.g. to check a test that inspects compiled
# code under the optimizations users get).
if os.environ.get("AIINFRA_TEST_XLA_OPT") != "full":
    for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
        if _flag.split("=")[0] not in _flags:
            _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()

# Many tests compile the same tiny programs (a new jit per train() call, per module instance...).
# JAX's persistent compilation cache keys on the program itself, so identical programs compile once
# per test session. The cache lives in a fresh temporary folder: nothing persists between runs.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

# AIINFRA_TEST_JAX_CACHE=off turns it off.
if os.environ.get("AIINFRA_TEST_JAX_CACHE") != "off":
    _cache_dir = os.environ.get("AIINFRA_TEST_JAX_CACHE") or tempfile.mkdtemp(
        prefix="aiinfra-jax-cache-")
    if "AIINFRA_TEST_JAX_CACHE" not in os.environ:
        os.environ["AIINFRA_TEST_JAX_CACHE"] = _cache_dir  # xdist workers share this folder
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    # Also in the environment, so that the processes a test launches (multi-process runs, fresh
    # interpreters) share the cache; set here too, since jax read its environment at import.
    _cache_env = {"JAX_COMPILATION_CACHE_DIR": _cache_dir,
                  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    os.environ.update(_cache_env)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
