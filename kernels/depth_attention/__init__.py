"""Depth attention for Attention Residuals (arXiv 2603.15031): public API.

    from aiinfra_jax.kernels.depth_attention import depth_attention, block_depth_attention
"""

from .api import block_depth_attention, depth_attention, merge_partial
from .reference import (block_depth_attention_reference, depth_attention_reference,
                        merge_partial_reference)

__all__ = ["depth_attention", "merge_partial", "block_depth_attention",
           "depth_attention_reference", "merge_partial_reference",
           "block_depth_attention_reference"]
