"""Data: tokenizers, document sources, and the grain pipeline that packs documents into batches.

The names below load on first use (PEP 562), so importing ``aiinfra_jax.data.config`` or
``aiinfra_jax.data.tokenizer`` (as the config, model loading and export do) never imports grain:
inference and export run where grain is not installed (the GPU machine has none). The pipeline,
the sources and the ``synthetic:<task>`` sources (registered by the pipeline's import) load with
the first name that needs them;
``pyarrow``, ``tokenizers`` and ``tiktoken`` load when a Parquet file or a tokenizer file needs them.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "DataConfig": "config",
    "BATCH_KEYS": "pipeline", "DataIterator": "iterators", "StagedIterator": "iterators",
    "StreamsIterator": "iterators",
    "check_split": "pipeline", "make_dataset": "pipeline", "make_iterator": "iterators",
    "DocumentSource": "sources", "open_source": "sources", "register_source": "sources",
    "registered_sources": "sources",
    "ByteTokenizer": "tokenizer", "Tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_WHERE[name]}")
    if _WHERE[name] == "sources":
        importlib.import_module(f"{__name__}.synthetic")  # registers the "synthetic:<task>" sources
    return getattr(module, name)
