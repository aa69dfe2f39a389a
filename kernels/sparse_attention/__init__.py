"""Block-gather sparse attention (NSA selection branch): public API.

    from aiinfra_jax.kernels.sparse_attention import sparse_attention
"""

from .api import sparse_attention, sparse_attention_bytes, sparse_attention_flops
from .reference import sparse_attention_reference

__all__ = ["sparse_attention", "sparse_attention_bytes", "sparse_attention_flops",
           "sparse_attention_reference"]
