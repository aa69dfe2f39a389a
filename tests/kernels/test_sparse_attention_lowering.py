"""Every sparse_attention Pallas kernel lowers for its target from the CPU machine, forward and
backward, at a small shape and at the benchmark shape (B=1, T=S=65536, Hq=16, Hkv=1, Dk=Dv=128,
block 64, n=16). Inputs are jax.ShapeDtypeStruct, so nothing is allocated.

Lowering runs the Pallas -> Triton / Mosaic lowering, which catches a kernel that could never
compile on its target (unsupported ops, block shapes, dtypes); it does not run the kernel. The
public sparse_attention with implementation=None picks the kernel from the lowering platform
(kernels._dispatch): the Triton kernel for cuda, the Mosaic kernel for tpu, the XLA path for cpu.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from aiinfra_jax.kernels._testing import lower_text
from aiinfra_jax.kernels.sparse_attention import sparse_attention

# lowering platform -> the custom call its Pallas kernels become
_CUSTOM_CALL = {"cuda": "__gpu", "tpu": "tpu_custom_call", "cpu": None}
# name: (B, T, S, Hq, Hkv, Dk, Dv, block_size, n, dtype, segments, q_offset, causal)
_SHAPES = {
    "small_segments": (2, 40, 56, 4, 2, 16, 32, 16, 3, jnp.float32, True, False, False),
    "small_offset": (1, 24, 40, 3, 1, 16, 16, 16, 5, jnp.bfloat16, False, True, True),
    "benchmark_64k": (1, 65536, 65536, 16, 1, 128, 128, 64, 16, jnp.bfloat16, False, False, True),
}


def _lower(platform, shape, backward):
    B, T, S, Hq, Hkv, Dk, Dv, P, n, dtype, segments, offset, causal = _SHAPES[shape]
    sd = jax.ShapeDtypeStruct
    args = [sd((B, T, Hq, Dk), dtype), sd((B, S, Hkv, Dk), dtype), sd((B, S, Hkv, Dv), dtype),
            sd((B, T, Hkv, n), jnp.int32)]
    extra = []
    if segments:
        extra += [sd((B, T), jnp.int32), sd((B, S), jnp.int32)]
    if offset:
        extra += [sd((B,), jnp.int32)]

    def attend(q, k, v, idx, *rest):
        rest = list(rest)
        seg = (rest.pop(0), rest.pop(0)) if segments else None
        off = rest.pop(0) if offset else None
        o, lse = sparse_attention(q, k, v, idx, block_size=P, causal=causal, segment_ids=seg,
                                  q_offset=off, return_lse=True)
        return o, lse

    def loss(q, k, v, *rest):
        o, lse = attend(q, k, v, *rest)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    fn = jax.grad(loss, argnums=(0, 1, 2)) if backward else attend
    return lower_text(fn, platform, *args, *extra)


@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_lower(platform, backward, shape):
    text = _lower(platform, shape, backward)
    calls = re.findall(r"custom_call @(\w+)", text)
    kernels = [c for c in calls if c == _CUSTOM_CALL[platform]]
    # forward: one kernel; backward: forward (residuals) + dQ + dK/dV.
    assert len(kernels) == (3 if backward else 1), (platform, shape, calls)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_cpu_lowering_is_xla(backward):
    calls = re.findall(r"custom_call @(\w+)", _lower("cpu", "small_segments", backward))
    assert not {"__gpu", "tpu_custom_call"} & set(calls), calls
