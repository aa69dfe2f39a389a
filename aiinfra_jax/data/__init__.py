"""Data: tokenizers, document sources, and the grain pipeline that packs documents into batches.

Importing this package imports grain and numpy only (never `datasets`, `tokenizers` or `tiktoken`).
"""

from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.data.pipeline import (BATCH_KEYS, DataIterator, StagedIterator, make_dataset,
                                       make_iterator)
from aiinfra_jax.data.sources import DocumentSource, open_source, register_source, registered_sources
from aiinfra_jax.data import synthetic  # noqa: F401  (registers the "synthetic:<task>" sources)
from aiinfra_jax.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BATCH_KEYS",
    "ByteTokenizer",
    "DataConfig",
    "DataIterator",
    "DocumentSource",
    "Tokenizer",
    "load_tokenizer",
    "make_dataset",
    "make_iterator",
    "StagedIterator",
    "open_source",
    "register_source",
    "registered_sources",
]
