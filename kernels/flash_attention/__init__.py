"""flash_attention: masked (causal / sliding-window / compressed-causal / segment) attention.

    from aiinfra_jax.kernels.flash_attention import flash_attention, AttentionMask

cached_attention: a few new queries over a head-major [B,K,S,D] key/value cache (prefill chunks
and decode steps; cached.py).
"""

from aiinfra_jax.kernels.flash_attention.api import (flash_attention, flash_attention_bytes,
                                                     flash_attention_flops, visible_pairs)
from aiinfra_jax.kernels.flash_attention.cached import cached_attention
from aiinfra_jax.kernels.flash_attention.mask import AttentionMask
from aiinfra_jax.kernels.flash_attention.reference import flash_attention_reference
from aiinfra_jax.kernels.flash_attention.tuning import BlockSizes

__all__ = ["AttentionMask", "BlockSizes", "cached_attention", "flash_attention", "flash_attention_bytes",
           "flash_attention_flops", "flash_attention_reference", "visible_pairs"]
