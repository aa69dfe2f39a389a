"""Token mixers. Importing this package registers the built-in ones ("dense", "nsa", "gdn", "kda", "msa")."""

from . import dense  # noqa: F401  (registers "dense")
from . import gated_delta  # noqa: F401  (registers "gdn" and "kda")
from . import msa  # noqa: F401  (registers "msa")
from . import nsa  # noqa: F401  (registers "nsa")
from .dense import DenseAttention

__all__ = ["DenseAttention"]
