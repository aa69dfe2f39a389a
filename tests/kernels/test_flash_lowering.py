"""Lowering of the flash_attention and block_selection Pallas kernels for CUDA (Triton) and TPU
(Mosaic) from the CPU machine, forward and backward, at a small ragged shape and at the benchmark
shape (B=1, T=65536, Hq=16, Hkv=1, D=128). Catches kernels that could never compile on their
target. The public functions with implementation=None pick the kernel from the lowering platform
(kernels._dispatch), so lowering for cuda / tpu gives the Triton / Mosaic kernel and lowering for
cpu the XLA path.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from aiinfra_jax.kernels._testing import lower_text
from aiinfra_jax.kernels.block_selection import select_blocks
from aiinfra_jax.kernels.flash_attention import AttentionMask, flash_attention

# lowering platform -> the custom call its Pallas kernels become
TARGETS = {"cuda": "__gpu", "tpu": "tpu_custom_call"}
_KERNEL_CALLS = re.compile(r"custom_call @(__gpu|tpu_custom_call)\b")
S = jax.ShapeDtypeStruct

# name: (B, T, S, Hq, Hkv, Dk, Dv, mask, segments, dtype)
SHAPES = {
    "small_window_segments": (2, 40, 40, 4, 2, 24, 16, AttentionMask(window=8), True,
                              jnp.float32),
    "small_compressed": (1, 40, 9, 4, 1, 32, 32, AttentionMask(compressed=(8, 4)), False,
                         jnp.bfloat16),
    "bench_causal_64k": (1, 65536, 65536, 16, 1, 128, 128, AttentionMask(), False,
                         jnp.bfloat16),
    "bench_compressed_32k": (1, 32768, 2047, 16, 1, 128, 128, AttentionMask(compressed=(32, 16)),
                             False, jnp.bfloat16),
}


def _lower(fn, args, platform):
    return lower_text(fn, platform, *args)


def _flash_args(shape):
    b, t, s, hq, hkv, dk, dv, mask, segments, dtype = SHAPES[shape]
    args = (S((b, t, hq, dk), dtype), S((b, s, hkv, dk), dtype), S((b, s, hkv, dv), dtype),
            S((b,), jnp.int32),
            (S((b, t), jnp.int32), S((b, s), jnp.int32)) if segments else None)

    def loss(q, k, v, off, seg):
        o = flash_attention(q, k, v, mask=mask, segment_ids=seg, q_offset=off)
        return jnp.sum(o.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2)), args


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_flash_attention_lowers_forward_and_backward(shape, platform):
    fn, args = _flash_args(shape)
    text = _lower(fn, args, platform)
    for kernel in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
        assert kernel in text, f"{kernel} missing from the {platform} lowering"
    assert f"custom_call @{TARGETS[platform]}" in text


def test_flash_attention_on_cpu_is_xla():
    fn, args = _flash_args("small_window_segments")
    text = _lower(fn, args, "cpu")
    assert not _KERNEL_CALLS.search(text) and "flash_attention_fwd" not in text


def _select_args(b, t, hq, hkv, dk):
    sc = (t - 32) // 16 + 1
    args = (S((b, t, hq, dk), jnp.bfloat16), S((b, sc, hkv, dk), jnp.bfloat16),
            S((b, t, hq), jnp.float32), S((b,), jnp.int32), S((b, t), jnp.int32))

    def select(q, k, lse, off, seg):
        return select_blocks(q, k, lse, seq_len=t, cmp_block_len=32, cmp_stride=16,
                             block_size=64, n_selected=16, n_init=1, n_local=2, remap="overlap",
                             q_offset=off, q_segment_ids=seg)

    return select, args


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("b, t, hq, hkv, dk", [(2, 70, 4, 2, 16), (1, 65536, 16, 1, 128)])
def test_block_selection_lowers(b, t, hq, hkv, dk, platform):
    text = _lower(*_select_args(b, t, hq, hkv, dk), platform)
    assert "nsa_block_scores" in text and f"custom_call @{TARGETS[platform]}" in text


def test_block_selection_on_cpu_is_xla():
    text = _lower(*_select_args(2, 70, 4, 2, 16), "cpu")
    assert not _KERNEL_CALLS.search(text) and "nsa_block_scores" not in text
