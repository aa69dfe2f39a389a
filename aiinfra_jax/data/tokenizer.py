"""Tokenizers: the byte tokenizer, and loaders for HF ``tokenizer.json`` and tiktoken BPE files.

Every tokenizer follows the ``Tokenizer`` protocol: ``vocab_size``, ``pad_id``, ``bos_id``,
``eos_id``, ``encode(text) -> list[int]`` (no special tokens added) and ``decode(ids) -> str``
(special tokens dropped). The pipeline adds BOS/EOS around each document itself.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import numpy as np

from aiinfra_jax.errors import DataError


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline, the trainer and generation need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _as_int_list(ids: Iterable[int] | np.ndarray) -> list[int]:
    return [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, then PAD=256, BOS=257, EOS=258 (vocab 259).

    ``decode`` drops the special ids and decodes the remaining bytes as UTF-8 with
    ``errors="replace"``: a byte sequence that is not valid UTF-8 (for example a model's sample
    cut in the middle of a multi-byte character) becomes U+FFFD instead of raising.
    """

    PAD = 256
    BOS = 257
    EOS = 258

    vocab_size = 259
    pad_id = PAD
    bos_id = BOS
    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an int32 array (fast path used by the pipeline)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        values = _as_int_list(ids)
        bad = [i for i in values if i < 0 or i >= self.vocab_size]
        if bad:
            raise DataError(
                f"ByteTokenizer.decode: ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        return bytes(i for i in values if i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash("ByteTokenizer")


# Special-token names looked up in a tokenizer.json, most specific first.
_HF_BOS = ("<|begin_of_text|>", "<bos>", "<s>", "[CLS]", "<|endoftext|>")
_HF_EOS = ("<|end_of_text|>", "<|endoftext|>", "<eos>", "</s>", "[SEP]")
_HF_PAD = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``.

    BOS/EOS/PAD are looked up by their usual names (``<s>``, ``</s>``, ``<|endoftext|>``,
    ``<pad>``, ...). BOS and EOS must exist; a file without a pad token pads with EOS (padding
    positions carry segment id 0 and loss weight 0, so the id there is never trained on).
    """

    def __init__(self, path: str):
        try:
            import tokenizers  # pylint: disable=import-outside-toplevel
        except ImportError as e:
            raise DataError(
                f"tokenizer {path!r} is an HF tokenizer.json, but the `tokenizers` package is not "
                "installed; `pip install tokenizers` or use tokenizer='byte'"
            ) from e
        self.path = path
        self._tok = tokenizers.Tokenizer.from_file(path)
        # A tokenizer.json may carry the truncation / padding of the model it was saved for
        # (BERT-style files: truncation at 512): documents are packed whole here, never cut or
        # padded by the tokenizer. And a special token's text inside a document ("</s>" in web
        # text) stays text, as tiktoken's encode_ordinary keeps it: BOS/EOS come from the pipeline.
        self._tok.no_truncation()
        self._tok.no_padding()
        if hasattr(self._tok, "encode_special_tokens"):  # tokenizers >= 0.15
            self._tok.encode_special_tokens = True
        vocab = self._tok.get_vocab(with_added_tokens=True)

        def find(names: tuple[str, ...], what: str, required: bool) -> int | None:
            for name in names:
                if name in vocab:
                    return int(vocab[name])
            if required:
                raise DataError(
                    f"tokenizer {path!r} has no {what} token (looked for {list(names)}); add one to "
                    "the tokenizer.json"
                )
            return None

        self.bos_id = find(_HF_BOS, "BOS", True)
        self.eos_id = find(_HF_EOS, "EOS", True)
        pad = find(_HF_PAD, "PAD", False)
        self.pad_id = self.eos_id if pad is None else pad
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._tok.decode(_as_int_list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"

    def __reduce__(self):  # Pickled by path (grain worker processes rebuild it).
        return (HFTokenizer, (self.path,))


# The cl100k / GPT-4 pre-tokenisation pattern (tiktoken files do not store their pattern).
TIKTOKEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Parses a tiktoken BPE file: one ``<base64 token> <rank>`` pair per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise DataError("expected two fields")
                ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
            except (ValueError, binascii.Error) as e:
                raise DataError(
                    f"tiktoken BPE file {path!r}, line {line_no}: expected '<base64 token> <rank>', "
                    f"got {line[:60]!r} ({e})"
                ) from e
    if not ranks:
        raise DataError(f"tiktoken BPE file {path!r} has no tokens")
    return ranks


class TiktokenTokenizer:
    """A tiktoken BPE file (``<base64 token> <rank>`` lines), encoded with the ``tiktoken`` package.

    The pre-tokenisation pattern is cl100k's (``TIKTOKEN_PATTERN``). Special tokens are appended
    after the largest rank n: ``<|endoftext|>`` = EOS = n+1, ``<|bos|>`` = n+2, ``<|pad|>`` = n+3.
    """

    def __init__(self, path: str):
        ranks = read_tiktoken_ranks(path)
        try:
            import tiktoken  # pylint: disable=import-outside-toplevel
        except ImportError as e:
            raise DataError(
                f"tokenizer {path!r} is a tiktoken BPE file, but the `tiktoken` package is not "
                "installed; `pip install tiktoken` or use tokenizer='byte'"
            ) from e
        self.path = path
        n = max(ranks.values())
        self.eos_id, self.bos_id, self.pad_id = n + 1, n + 2, n + 3
        self.vocab_size = n + 4
        self._enc = tiktoken.Encoding(
            name=os.path.basename(path),
            pat_str=TIKTOKEN_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": self.eos_id, "<|bos|>": self.bos_id, "<|pad|>": self.pad_id},
        )
        self._specials = {self.eos_id, self.bos_id, self.pad_id}

    def encode(self, text: str) -> list[int]:
        # Special-token text inside a document is encoded as ordinary text.
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._enc.decode([i for i in _as_int_list(ids) if i not in self._specials], errors="replace")

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.path!r})"

    def __reduce__(self):  # Pickled by path (grain worker processes rebuild it).
        return (TiktokenTokenizer, (self.path,))


def _looks_like_tiktoken(path: str) -> bool:
    with open(path, "rb") as f:
        first = f.readline().split()
    if len(first) != 2 or not first[1].isdigit():
        return False
    try:
        base64.b64decode(first[0], validate=True)
    except (ValueError, binascii.Error):
        return False
    return True


def load_tokenizer(spec: str) -> Tokenizer:
    """Returns the tokenizer named by ``spec``: "byte", a tokenizer.json path or a tiktoken file path."""
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.isfile(spec):
        raise DataError(
            f"tokenizer {spec!r} is neither 'byte' nor an existing file (an HF tokenizer.json or a "
            "tiktoken BPE file)"
        )
    if spec.endswith(".json"):
        return HFTokenizer(spec)
    if _looks_like_tiktoken(spec):
        return TiktokenTokenizer(spec)
    raise DataError(
        f"tokenizer file {spec!r} is not a tokenizer.json (name must end in .json) nor a tiktoken "
        "BPE file ('<base64 token> <rank>' per line)"
    )
