"""Document sources: the embedded corpus, local files and folders, and a registry for more.

A source is a random-access list of documents (``DocumentSource``): ``len(src)``, ``src[i]`` (a
str, or for pre-tokenised sources a dict ``{"tokens": int array, "loss_weights": float array}``)
and ``src.doc_id(i)`` (a stable name used for the train/validation split). Listing is cheap;
documents are read lazily when the pipeline asks for them.

Spec resolution (``open_source``): a spec equal to a registered name, or starting with
``name + ":"``, goes to that name's factory (longest name wins); every other spec is a local path.
A later module adds sources with ``@register_source("synthetic")`` etc.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sysconfig
import zlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.errors import DataError

Document = str | dict[str, Any]
SPLITS = ("train", "validation")

# Suffixes read as plain text when a folder is scanned (a file named explicitly is read as text
# whatever its suffix, unless it is .jsonl or .parquet).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text", ".markdown", ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".html", ".tex")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".zst", ".bz2", ".xz", ".zip", ".lz4")

logger = logging.getLogger(__name__)


@runtime_checkable
class DocumentSource(Protocol):
    """A random-access collection of documents."""

    name: str

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Document: ...

    def doc_id(self, index: int) -> str: ...


class GeneratedSource:
    """Base of the generated sources (synthetic tasks, MSA rows): `n` documents made on demand
    from their index, named "<name>/<index>"; the first ceil(n * val_fraction) indices are the
    validation split (no hashing of millions of ids). Subclasses set `name` and `options.n`."""

    name: str
    options: Any

    def __len__(self) -> int:
        return self.options.n

    def doc_id(self, index: int) -> str:
        return f"{self.name}/{int(index)}"

    def split_indices(self, split: str, val_fraction: float) -> np.ndarray:
        n_val = math.ceil(self.options.n * val_fraction) if val_fraction > 0 else 0
        return np.arange(n_val) if split == "validation" else np.arange(n_val, self.options.n)


SourceFactory = Callable[[str, DataConfig], DocumentSource]
_REGISTRY: dict[str, SourceFactory] = {}


def register_source(prefix: str) -> Callable[[SourceFactory], SourceFactory]:
    """Decorator: ``factory(spec, cfg) -> DocumentSource`` handles ``prefix`` and ``prefix:...``."""
    if not prefix or os.sep in prefix:
        raise ValueError(f"register_source: prefix {prefix!r} must be a non-empty name without {os.sep!r}")

    def wrap(factory: SourceFactory) -> SourceFactory:
        if prefix in _REGISTRY and _REGISTRY[prefix] is not factory:
            raise ValueError(f"register_source: {prefix!r} is already registered to {_REGISTRY[prefix]!r}")
        _REGISTRY[prefix] = factory
        return factory

    return wrap


def registered_sources() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def open_source(spec: str, cfg: DataConfig) -> DocumentSource:
    """Resolves a source spec (see the module docstring) into a ``DocumentSource``."""
    matches = [p for p in _REGISTRY if spec == p or spec.startswith(p + ":")]
    if matches:
        return _REGISTRY[max(matches, key=len)](spec, cfg)
    path = os.path.expanduser(spec)
    if not os.path.exists(path):
        scheme = spec.split(":", 1)[0] if ":" in spec else None
        hint = (
            f" (scheme {scheme!r} is not registered; registered: {list(registered_sources())})"
            if scheme
            else f" (registered source names: {list(registered_sources())})"
        )
        raise DataError(f"data source {spec!r}: no such file or folder{hint}")
    return open_local(path, cfg.text_field)


# --------------------------------------------------------------------------------------------
# Train / validation split


def split_fraction(doc_id: str) -> float:
    """A stable number in [0, 1) from the document id (CRC32; independent of Python's hash seed)."""
    return zlib.crc32(doc_id.encode("utf-8")) / 2**32


def split_indices(source: DocumentSource, split: str, val_fraction: float) -> np.ndarray:
    """Indices of ``source``'s documents in ``split``; raises if the split is empty.

    A document is in validation when ``split_fraction(doc_id) < val_fraction``. A source may define
    its own ``split_indices(split, val_fraction)`` (e.g. a synthetic task with millions of items).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    own = getattr(source, "split_indices", None)
    if own is not None:
        idx = np.asarray(own(split, val_fraction), dtype=np.int64)
    else:
        in_val = np.fromiter(
            (split_fraction(source.doc_id(i)) < val_fraction for i in range(len(source))),
            dtype=bool,
            count=len(source),
        )
        idx = np.flatnonzero(in_val if split == "validation" else ~in_val)
    if idx.size == 0:
        raise DataError(
            f"data source {source.name!r}: the {split!r} split is empty ({len(source)} documents, "
            f"val_fraction={val_fraction}); add documents"
            + (" or raise val_fraction" if split == "validation" else " or lower val_fraction")
        )
    return idx


# --------------------------------------------------------------------------------------------
# The embedded corpus: the standard library's .py files + the pydoc topics.

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# The topics are documents of their own; their .py file (a 750 kB dict literal) would repeat them.
_SKIP_FILES = frozenset({"pydoc_data/topics.py"})


@dataclasses.dataclass
class EmbeddedCorpus:
    """The Python standard library's own ``.py`` sources plus the ``pydoc_data.topics`` texts.

    Files are listed sorted by their path relative to sysconfig's "stdlib" folder (skipping
    site-packages, dist-packages, __pycache__, hidden folders and pydoc_data/topics.py, whose
    topics are documents of their own) and read lazily as UTF-8 with
    ``errors="replace"``: a few stdlib test files hold deliberately invalid bytes, and the
    corpus is ours, so a replaced byte is not worth an error. Each pydoc topic is one document with
    the id ``pydoc_data.topics/<name>``. The corpus differs slightly between Python versions.
    """

    root: str
    files: tuple[str, ...]
    topics: tuple[str, ...]
    name: str = "embedded"

    @classmethod
    def create(cls) -> EmbeddedCorpus:
        root = sysconfig.get_paths()["stdlib"]
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
            rel_folder = os.path.relpath(folder, root)
            for n in sorted(names):
                rel = (n if rel_folder == "." else os.path.join(rel_folder, n)).replace(os.sep, "/")
                if n.endswith(".py") and rel not in _SKIP_FILES:
                    files.append(rel)
        try:
            from pydoc_data import topics  # pylint: disable=import-outside-toplevel

            topic_names = tuple(sorted(topics.topics))
        except ImportError:  # Some distributions strip pydoc_data; the .py files still suffice.
            topic_names = ()
        if not files and not topic_names:
            raise DataError(f"embedded corpus: no .py files under the stdlib folder {root!r}")
        return cls(root=root, files=tuple(sorted(files)), topics=topic_names)

    def __len__(self) -> int:
        return len(self.files) + len(self.topics)

    def doc_id(self, index: int) -> str:
        if index < len(self.files):
            return self.files[index]
        return "pydoc_data.topics/" + self.topics[index - len(self.files)]

    def __getitem__(self, index: int) -> str:
        index = int(index)
        if index < len(self.files):
            with open(os.path.join(self.root, self.files[index]), "rb") as f:
                return f.read().decode("utf-8", errors="replace")
        from pydoc_data import topics  # pylint: disable=import-outside-toplevel

        return topics.topics[self.topics[index - len(self.files)]]


@register_source("embedded")
def _embedded(spec: str, cfg: DataConfig) -> DocumentSource:
    del cfg
    if spec != "embedded":
        raise DataError(f"data source {spec!r}: the embedded corpus takes no options; use 'embedded'")
    return EmbeddedCorpus.create()


# --------------------------------------------------------------------------------------------
# Local files and folders


def decode_utf8(data: bytes, where: str) -> str:
    """Decodes user text strictly; an invalid byte is a ValueError naming the file and offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where}: invalid UTF-8 at byte offset {e.start} ({data[e.start:e.start + 4]!r}); "
            "convert the file to UTF-8"
        ) from e


@dataclasses.dataclass
class LocalDocuments:
    """Documents from local files: text files (one document each), JSONL lines and Parquet rows.

    Built by ``open_local``, which validates everything up front (one read of each file: decoding,
    JSON syntax, the text field) so that bad data fails before training starts; the texts of
    text and JSONL files are then re-read lazily (only offsets are kept in memory); a Parquet file's
    text column is held as one Arrow string array (the texts' bytes and offsets, not a Python
    string per row), and a row becomes a Python string only when the pipeline reads it.
    """

    name: str
    root: str
    # One entry per document: (relative path, kind, locator). kind "text": locator unused;
    # "jsonl": (byte offset, byte length, line number); "parquet": (table index, row).
    entries: list[tuple[str, str, Any]]
    parquet_columns: list[Any]  # one pyarrow string array per Parquet file
    text_field: str

    def __len__(self) -> int:
        return len(self.entries)

    def doc_id(self, index: int) -> str:
        rel, kind, loc = self.entries[index]
        if kind == "text":
            return rel
        if kind == "jsonl":
            return f"{rel}:{loc[2]}"
        return f"{rel}:{loc[1]}"

    def _path(self, rel: str) -> str:
        return self.root if os.path.isfile(self.root) else os.path.join(self.root, rel)

    def __getitem__(self, index: int) -> str:
        rel, kind, loc = self.entries[int(index)]
        if kind == "text":
            with open(self._path(rel), "rb") as f:
                return decode_utf8(f.read(), self._path(rel))
        if kind == "jsonl":
            offset, length, line_no = loc
            with open(self._path(rel), "rb") as f:
                f.seek(offset)
                line = f.read(length)
            return _jsonl_text(line, self._path(rel), line_no, offset, self.text_field)
        table, row = loc
        return self.parquet_columns[table][row].as_py()


def _jsonl_text(line: bytes, path: str, line_no: int, offset: int, field: str) -> str:
    where = f"{path}, line {line_no}"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: invalid UTF-8 at byte offset {offset + e.start} (line {line_no}); "
            "convert the file to UTF-8"
        ) from e
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{where}: no field {field!r} (record has {keys}); set DataConfig.text_field"
        )
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is a {type(value).__name__}, expected a string")
    return value


def _scan_jsonl(path: str, rel: str, field: str) -> list[tuple[str, str, Any]]:
    entries = []
    offset = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                _jsonl_text(line, path, line_no, offset, field)  # validates
                entries.append((rel, "jsonl", (offset, len(line), line_no)))
            offset += len(line)
    if not entries:
        raise DataError(f"data file {path!r} is empty (no JSON lines)")
    return entries


def _read_parquet_column(path: str, field: str) -> Any:
    """The text column of a Parquet file as one pyarrow string array, validated (strings, no nulls).

    Dependency choice: Parquet is read with pyarrow directly (a declared dependency), not through
    Hugging Face ``datasets``: the pipeline needs random access to one column of local files, which
    pyarrow gives without ``datasets``' cache directory, fingerprinting and Arrow copy of every file.
    """
    try:
        import pyarrow as pa  # pylint: disable=import-outside-toplevel
        import pyarrow.compute as pc  # pylint: disable=import-outside-toplevel
        import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise DataError(
            f"data file {path!r} is Parquet, but the `pyarrow` package is not installed; "
            "`pip install pyarrow` or convert it to JSONL"
        ) from e
    schema = pq.read_schema(path)
    if field not in schema.names:
        raise DataError(
            f"data file {path!r}: no column {field!r} (columns: {schema.names}); set DataConfig.text_field"
        )
    column = pq.read_table(path, columns=[field], memory_map=True).column(field)
    if pa.types.is_string(column.type):  # 64-bit offsets: a column may hold more than 2 GiB of text
        column = column.cast(pa.large_string())
    column = column.combine_chunks()
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(
            f"data file {path!r}: column {field!r} holds {column.type} values, expected strings; "
            "set DataConfig.text_field to the text column"
        )
    if column.null_count:
        row = pc.index(column.is_null(), True).as_py()
        raise DataError(f"data file {path!r}, row {row}: column {field!r} is null, expected a string")
    if len(column) == 0:
        raise DataError(f"data file {path!r} is empty (no rows)")
    return column


def _kind(path: str, explicit: bool) -> str | None:
    lower = path.lower()
    if lower.endswith(COMPRESSED_SUFFIXES):
        raise DataError(f"data file {path!r} is compressed; decompress it (e.g. gunzip / zstd -d): "
                        "text, JSONL and Parquet files are read as they are")
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if explicit or lower.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def open_local(path: str, text_field: str) -> LocalDocuments:
    """Lists and validates the documents of a local file or folder (see ``LocalDocuments``)."""
    if not os.path.exists(path):
        raise DataError(f"data source {path!r}: no such file or folder")
    if os.path.isfile(path):
        files = [(os.path.basename(path), path, _kind(path, explicit=True))]
    else:
        files, skipped, seen = [], [], set()
        # Symlinked subfolders are followed (a corpus assembled from links), each real folder once.
        for folder, dirs, names in os.walk(path, followlinks=True):
            seen.add(os.path.realpath(folder))
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__"
                             and os.path.realpath(os.path.join(folder, d)) not in seen)
            for n in sorted(names):
                if n.startswith("."):
                    continue
                full = os.path.join(folder, n)
                rel = os.path.relpath(full, path).replace(os.sep, "/")
                kind = _kind(full, explicit=False)
                if kind is None:
                    skipped.append(rel)
                    continue
                files.append((rel, full, kind))
        expected = (f"text ({', '.join(TEXT_SUFFIXES)}), JSONL (.jsonl) or Parquet (.parquet) "
                    "files")
        if not files:
            raise DataError(f"data source {path!r}: no matching files ({len(skipped)} other "
                            f"files); expected {expected}")
        if skipped:  # said, never silent: a folder may hold a LICENSE or a .csv beside its data
            logger.warning("data source %r: %d files are not read (not %s): %s%s", path,
                           len(skipped), expected, ", ".join(skipped[:5]),
                           ", ..." if len(skipped) > 5 else "")
        files.sort()

    entries: list[tuple[str, str, Any]] = []
    columns: list[Any] = []
    for rel, full, kind in files:
        if os.path.getsize(full) == 0:
            raise DataError(f"data file {full!r} is empty; remove it or add text")
        if kind == "text":
            with open(full, "rb") as f:
                decode_utf8(f.read(), full)
            entries.append((rel, "text", None))
        elif kind == "jsonl":
            entries.extend(_scan_jsonl(full, rel, text_field))
        else:
            columns.append(_read_parquet_column(full, text_field))
            entries.extend((rel, "parquet", (len(columns) - 1, r)) for r in range(len(columns[-1])))
    return LocalDocuments(
        name=path, root=path, entries=entries, parquet_columns=columns, text_field=text_field
    )


def open_sources(cfg: DataConfig) -> list[DocumentSource]:
    """Opens every source of ``cfg`` (in order)."""
    return [open_source(spec, cfg) for spec in cfg.sources]

