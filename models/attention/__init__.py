"""Token mixers. Importing this package registers the built-in ones ("dense")."""

from . import dense  # noqa: F401  (registers "dense")
from . import nsa  # noqa: F401  (registers "nsa")
from .dense import DenseAttention

__all__ = ["DenseAttention"]
