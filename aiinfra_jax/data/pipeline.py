"""The grain pipeline: documents -> tokens -> pieces -> packed rows -> batches.

Letters: B = batch_size rows per (global) batch, T = seq_len tokens per row.

Each batch is a dict of numpy arrays, all [B, T]:
  inputs        int32   token ids (pad_id on padding)
  targets       int32   the next token of the same document (pad_id on padding)
  positions     int32   position within the document piece, restarting at 0 for each segment
  segment_ids   int32   1, 2, 3, ... for the pieces packed into a row; 0 = padding
                        (a whole row keeps its own ids and positions: "Whole rows" below)
  loss_weights  float32 1 where a target exists (every non-padding position; a pre-tokenised
                        source may give its own per-token weights), 0 on padding

Stages (per source, then merged):
  1. split: the documents whose id hashes into the split (``sources.split_indices``);
  2. ``MapDataset.shuffle(seed)`` (+ ``repeat``: grain reseeds the shuffle every epoch);
  3. tokenize: BOS + encode(text) + EOS;
  4. cut into pieces of at most T+1 tokens that overlap by one token; a piece gives
     inputs = piece[:-1] and targets = piece[1:]. The shift happens before packing, so every
     input token of a piece has a target (the last input's target is the piece's last token,
     which is the first input of the next piece), no target ever crosses a document, and
     ``loss_weights`` is 1 on every non-padding position (a whole document of L tokens takes
     L-1 positions: BOS is only an input, EOS only a target). A document with more than T+1 tokens
     ("long") is split into several pieces (long_documents="split"), each its own segment with
     positions restarting at 0, or raises (long_documents="error");
  5. mix the sources by weight (``IterDataset.mix``; the weights count pieces) for training, or
     concatenate them (validation: every document of every source, once);
  6. a window shuffle over pieces, so that the pieces of one long file spread over many batches;
  7. first-fit packing into rows of T, then batching.

Whole rows (a source with ``whole_rows = True``, e.g. ``synthetic:msa_*``): its documents are
dicts of five [T] arrays, ``inputs``, ``targets``, ``loss_weights``, ``segment_ids`` and
``positions``: a row already packed in a layout the packer must not redo (the MSA mixer's
convention: negative query ids, ANSWER_BIT, document-wise positions; see
``aiinfra_jax.data.synthetic_msa``). Such a row is one piece of exactly T tokens, so it fills a
packing bin on its own (stages 4-7 treat it as any piece; the mixture weights count it as one
piece), and its segment ids and positions ride through the packer as grain meta features
(``row_segment_ids``, ``row_positions``; zeros on ordinary pieces) that replace the packer's own
in ``_ToRow``. Only when some source has whole rows do pieces carry these two extra features;
without one the pipeline is exactly as before. A whole row of another length is a DataError.

Packing choice: grain's ``FirstFitPackIterDataset`` rather than ``ConcatThenSplitIterDataset``.
Concat-then-split fills rows completely but cuts documents wherever a row ends, so a row would
start in the middle of a document and long_documents="error" could not be honoured; first-fit
keeps every piece whole in one row (pieces are cut only by the explicit rule of step 4) at the
price of some padding, which many bins (``PACKING_BINS``) keep small.

Streams (``DataConfig.streams`` = S > 1; multi-process runs): stages 1-7 run S times, once per
stream, stream k over the documents k, k + S, ... of each source's split, with its own seeds and
batches of B / S rows; a batch is the streams' rows one after the other (``StreamsIterator``,
aiinfra_jax/data/iterators.py, with the resumable iterators and ``make_iterator``). So
the batches are the same whichever process reads which stream, and each process reads only its
own streams. With S = 1 the pipeline is the single stream above, seeded as it always was.

Finite iteration (``repeat=False``, for validation): one pass over the split in a fixed order; the
last batch is padded to B rows with all-padding rows (segment 0, weight 0), so a perplexity loop
can always use fixed shapes and weight by ``loss_weights``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import grain.experimental as grain_exp
import numpy as np

from aiinfra_jax.data import sources as sources_lib
from aiinfra_jax.data import synthetic  # noqa: F401  (registers the "synthetic:<task>" sources)
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.errors import DataError
from aiinfra_jax.data.tokenizer import Tokenizer

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_weights")
# Pieces held by the window shuffle (each at most T+1 tokens). On the embedded corpus at T=256 a
# 16-row batch then draws from ~14 distinct files (~10 with 4096); filling it takes ~0.6 s.
SHUFFLE_WINDOW = 16384
# First-fit packing bins per packed group; more bins = less padding.
PACKING_BINS = 128
# Reader threads that load and tokenize documents ahead of packing (per process).
READ_THREADS = 4
READ_BUFFER = 64


def _derive_seed(seed: int, *salt: int) -> int:
    """A 32-bit seed for one stage, stable across processes and platforms."""
    return int(np.random.SeedSequence([seed, *salt]).generate_state(1)[0])


class _SplitView:
    """The documents of one split of a source: element i -> {"doc": Document, "id": str}."""

    def __init__(self, source: sources_lib.DocumentSource, indices: np.ndarray):
        self.source = source
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        j = int(self.indices[i])
        return {"doc": self.source[j], "id": self.source.doc_id(j)}

    def __repr__(self) -> str:
        return f"_SplitView({self.source.name!r}, {len(self)} documents)"


class Tokenize(grain.transforms.Map):
    """{"doc", "id"} -> {"tokens": int32 [L], "weights": float32 [L], "id"} with BOS ... EOS.

    A pre-tokenised document (a dict with "tokens" and optional "loss_weights", weight j applying
    to token j as a target) is used as is; a whole row (a dict with "segment_ids", see the module
    docstring) passes on as {"row": the dict, "id"} for ``_Pieces`` to check.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def map(self, element: dict[str, Any]) -> dict[str, Any]:
        doc = element["doc"]
        if isinstance(doc, Mapping) and "segment_ids" in doc:
            return {"row": doc, "id": element["id"]}
        if isinstance(doc, str):
            encode_array = getattr(self.tokenizer, "encode_array", None)
            body = (
                encode_array(doc)
                if encode_array is not None
                else np.asarray(self.tokenizer.encode(doc), dtype=np.int32)
            )
            tokens = np.empty(body.size + 2, dtype=np.int32)
            tokens[0] = self.tokenizer.bos_id
            tokens[1:-1] = body
            tokens[-1] = self.tokenizer.eos_id
            weights = np.ones(tokens.size, dtype=np.float32)
        else:
            tokens = np.asarray(doc["tokens"], dtype=np.int32).reshape(-1)
            if "loss_weights" in doc:
                weights = np.asarray(doc["loss_weights"], dtype=np.float32).reshape(-1)
            else:
                weights = np.ones(tokens.size, dtype=np.float32)
            if weights.shape != tokens.shape or tokens.size < 2:
                raise DataError(
                    f"document {element['id']!r}: pre-tokenised documents need >= 2 tokens and "
                    f"loss_weights of the same length, got {tokens.size} tokens and "
                    f"{weights.size} weights"
                )
        return {"tokens": tokens, "weights": weights, "id": element["id"]}


class _Pieces(grain_exp.FlatMapTransform):
    """Cuts a tokenized document into shifted pieces (stage 4 of the module docstring)."""

    max_fan_out = 1 << 30  # Unbounded: a long document gives ceil((L - 1) / T) pieces.

    def __init__(self, seq_len: int, long_documents: str, whole_rows: bool = False):
        self.seq_len = seq_len
        self.long_documents = long_documents
        self.whole_rows = whole_rows  # pieces carry the ROW_FEATURES (see the module docstring)

    def flat_map(self, element: dict[str, Any]) -> list[dict[str, np.ndarray]]:
        if "row" in element:
            return [_whole_row(element["row"], element["id"], self.seq_len, self.whole_rows)]
        tokens, weights = element["tokens"], element["weights"]
        n, t = tokens.size - 1, self.seq_len  # n = number of (input, target) pairs
        if n > t and self.long_documents == "error":
            raise DataError(
                f"document {element['id']!r} has {tokens.size} tokens (with BOS/EOS), more than "
                f"seq_len + 1 = {t + 1}; set long_documents='split' or raise seq_len"
            )
        pieces = [
            {
                "inputs": tokens[a : min(a + t, n)],
                "targets": tokens[a + 1 : min(a + t, n) + 1],
                "weights": weights[a + 1 : min(a + t, n) + 1],
            }
            for a in range(0, n, t)
        ]
        if self.whole_rows:  # zeros: "not a whole row" (its ids and positions are the packer's)
            for p in pieces:
                p.update({k: np.zeros(p["inputs"].size, np.int32) for k in ROW_FEATURES})
        return pieces


ROW_FEATURES = ("row_segment_ids", "row_positions")  # a whole row's own layout (meta features)
_WHOLE_ROW_KEYS = ("inputs", "targets", "loss_weights", "segment_ids", "positions")


def _whole_row(row: Mapping[str, Any], doc_id: str, seq_len: int, expected: bool
               ) -> dict[str, np.ndarray]:
    """A whole row (module docstring) as one seq_len-token piece, its layout in ROW_FEATURES."""
    if not expected:
        raise DataError(f"document {doc_id!r} is a whole row (it has segment_ids), but its source "
                        "does not set whole_rows = True; set it so the pipeline carries the row")
    arrays = {k: np.asarray(row[k]).reshape(-1) for k in _WHOLE_ROW_KEYS if k in row}
    bad = {k: a.size for k, a in arrays.items() if a.size != seq_len}
    if len(arrays) < len(_WHOLE_ROW_KEYS) or bad or not np.any(arrays["segment_ids"] != 0):
        raise DataError(
            f"document {doc_id!r}: a whole row needs {_WHOLE_ROW_KEYS} each of exactly seq_len="
            f"{seq_len} tokens and a non-padding token; got keys {sorted(row)}, wrong sizes {bad}")
    return {"inputs": arrays["inputs"].astype(np.int32),
            "targets": arrays["targets"].astype(np.int32),
            "weights": arrays["loss_weights"].astype(np.float32),
            "row_segment_ids": arrays["segment_ids"].astype(np.int32),
            "row_positions": arrays["positions"].astype(np.int32)}


class _ToRow(grain.transforms.Map):
    """A packed row from grain's packer -> the batch row format (see the module docstring)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def map(self, el: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seg, pos = el["inputs_segment_ids"], el["inputs_positions"]
        if ROW_FEATURES[0] in el and np.any(el[ROW_FEATURES[0]] != 0):  # a whole row: its own
            seg, pos = el["row_segment_ids"], el["row_positions"]
        seg = seg.astype(np.int32)
        pad = seg == 0
        return {
            "inputs": np.where(pad, self.pad_id, el["inputs"]).astype(np.int32),
            "targets": np.where(pad, self.pad_id, el["targets"]).astype(np.int32),
            "positions": np.where(pad, 0, pos).astype(np.int32),
            "segment_ids": seg,
            "loss_weights": np.where(pad, 0.0, el["weights"]).astype(np.float32),
        }


class _PadBatch(grain.transforms.Map):
    """Pads a short final batch to B rows of padding (segment 0, weight 0)."""

    def __init__(self, batch_size: int, pad_id: int):
        self.batch_size = batch_size
        self.pad_id = pad_id

    def map(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = self.batch_size - batch["inputs"].shape[0]
        if missing == 0:
            return batch
        out = {}
        for k, v in batch.items():
            fill = self.pad_id if k in ("inputs", "targets") else 0
            out[k] = np.concatenate([v, np.full((missing,) + v.shape[1:], fill, dtype=v.dtype)])
        return out


def _document_dataset(
    source: sources_lib.DocumentSource, cfg: DataConfig, split: str, seed: int, salt: int,
    stream: int = 0,
) -> grain.MapDataset:
    indices = sources_lib.split_indices(source, split, cfg.val_fraction)
    if cfg.streams > 1:  # stream k: the split's documents k, k + streams, k + 2 * streams, ...
        indices = indices[stream :: cfg.streams]
        if indices.size == 0:
            raise DataError(
                f"data source {source.name!r}: its {split!r} split has fewer documents than "
                f"data.streams={cfg.streams}, so stream {stream} gets none; lower data.streams or "
                "add documents"
            )
    return grain.MapDataset.source(_SplitView(source, indices)).shuffle(seed=_derive_seed(seed, salt, 1))


def check_split(cfg: DataConfig, split: str, streams: Sequence[int] = (0,)) -> None:
    """Raises the DataError that reading ``split`` (of these streams) would raise: an empty split,
    or one with fewer documents than data.streams. A training run checks its validation split so
    at start instead of at its first evaluation, steps into the run."""
    opened = sources_lib.open_sources(cfg)
    for stream in streams:
        for i, src in enumerate(opened):
            _document_dataset(src, cfg, split, 0, i, stream)


def _pieces(ds: grain.MapDataset, cfg: DataConfig, tokenizer: Tokenizer,
            whole_rows: bool = False) -> grain.IterDataset:
    read = grain.ReadOptions(num_threads=READ_THREADS, prefetch_buffer_size=READ_BUFFER)
    it = ds.map(Tokenize(tokenizer)).to_iter_dataset(read)
    return grain_exp.FlatMapIterDataset(it, _Pieces(cfg.seq_len, cfg.long_documents, whole_rows))


def _allow_unparsed_absl_flags() -> None:
    """Grain <= 0.2.18 reads an absl flag in mp_prefetch and raises UnparsedFlagAccessError in a
    program that does not run absl.app (google/grain#1355, fixed upstream by reading the default).
    When nobody parsed the flags, mark them parsed: every flag keeps its default value."""
    from absl import flags  # pylint: disable=import-outside-toplevel

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def make_dataset(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    split: str,
    seed: int = 0,
    num_epochs: int | None = None,
    weights: Sequence[float] | None = None,
    stream: int = 0,
    documents: list[int] | None = None,
) -> grain.IterDataset:
    """The batched grain dataset of ``split`` (see the module docstring), or of one of its
    ``cfg.streams`` streams: batches of batch_size / streams rows (see DataConfig.streams).

    Args:
      cfg: the data settings.
      tokenizer: the tokenizer (its vocab must match the model's).
      split: "train" or "validation".
      seed: seed of all shuffles (the trainer passes ``run.seed``).
      num_epochs: passes over each source; None = forever (training). With a finite number the
        sources are concatenated (not mixed), every document is seen ``num_epochs`` times and
        the last batch is padded to ``batch_size`` rows.
      weights: mixture weights, one per source (None = ``cfg.mixture_weights``); sources of
        weight 0 are left out of the mix. Only for endless iteration.
      stream: which of the ``cfg.streams`` streams (0 with one stream). Each stream draws its own
        shuffles from ``seed`` and its index; with one stream the shuffles are seeded as they
        always were.
      documents: if given, a list that gets each source's number of documents in this split and
        stream appended (the data iterators keep them in their saved state: a source whose
        documents changed cannot resume a position in its shuffle).
    """
    if split not in sources_lib.SPLITS:
        raise ValueError(f"split={split!r} is not one of {sources_lib.SPLITS}")
    if num_epochs is not None and weights is not None:
        raise ValueError("weights only apply to endless iteration (num_epochs=None); a finite pass "
                         "concatenates every source")
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
        raise ValueError(f"num_epochs={num_epochs!r} must be None (forever) or an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an integer >= 0")
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)) or not 0 <= stream < cfg.streams:
        raise ValueError(f"stream={stream!r} must be an integer in 0..data.streams-1 = {cfg.streams - 1}")
    if cfg.streams > 1:
        seed = _derive_seed(seed, 5, cfg.streams, stream)
    rows = cfg.batch_size // cfg.streams
    opened = sources_lib.open_sources(cfg)
    docs = [_document_dataset(src, cfg, split, seed, i, stream) for i, src in enumerate(opened)]
    if documents is not None:
        documents.extend(len(d) for d in docs)
    whole = any(getattr(src, "whole_rows", False) for src in opened)

    if num_epochs is None:
        weights = list(cfg.mixture_weights if weights is None else weights)
        if len(weights) != len(docs) or not any(w > 0 for w in weights):
            raise ValueError(f"weights={weights!r}: need one weight >= 0 per source, one of them > 0")
        pieces = [_pieces(d.repeat(None), cfg, tokenizer, whole)
                  for d, w in zip(docs, weights) if w > 0]
        weights = [w for w in weights if w > 0]
        ds = pieces[0] if len(pieces) == 1 else grain.IterDataset.mix(pieces, weights)
    else:
        merged = docs[0] if len(docs) == 1 else grain.MapDataset.concatenate(docs)
        ds = _pieces(merged.repeat(num_epochs), cfg, tokenizer, whole)

    ds = grain_exp.WindowShuffleIterDataset(ds, window_size=SHUFFLE_WINDOW, seed=_derive_seed(seed, 2))
    features = ("inputs", "targets", "weights") + (ROW_FEATURES if whole else ())
    ds = grain_exp.FirstFitPackIterDataset(
        ds,
        length_struct={k: cfg.seq_len for k in features},
        num_packing_bins=max(PACKING_BINS, rows),
        seed=_derive_seed(seed, 3),
        shuffle_bins=True,
        meta_features=ROW_FEATURES if whole else (),
    )
    ds = ds.map(_ToRow(tokenizer.pad_id))
    finite = num_epochs is not None
    ds = ds.batch(rows, drop_remainder=not finite)
    if finite:
        ds = ds.map(_PadBatch(rows, tokenizer.pad_id))
    if cfg.num_workers > 0:
        _allow_unparsed_absl_flags()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
    return ds
