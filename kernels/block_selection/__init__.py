"""block_selection: NSA block scoring (from the compressed branch) and top-n block selection.

    from aiinfra_jax.kernels.block_selection import select_blocks
"""

from aiinfra_jax.kernels.block_selection.api import (block_scores, select_blocks,
                                                     select_blocks_from_probs, select_from_scores)
from aiinfra_jax.kernels.block_selection.reference import (Remap, block_scores_reference,
                                                           select_from_scores_reference)

__all__ = ["Remap", "block_scores", "block_scores_reference", "select_blocks",
           "select_blocks_from_probs", "select_from_scores", "select_from_scores_reference"]
