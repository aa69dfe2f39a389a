"""DataConfig: every setting of the data pipeline (sources, tokenizer, packing, batching).

Shapes produced by the pipeline this config drives: B = batch_size (global batch), T = seq_len.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

LONG_DOCUMENT_MODES = ("split", "error")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Settings of the training / validation data pipeline.

    Attributes:
      sources: source specs. "embedded" is the default corpus (the Python standard library's .py
        files and the pydoc topics); any other spec without a registered scheme is a local path to
        a file or folder (text files such as .txt/.md/.py, .jsonl, .parquet). Registered schemes
        (``register_source`` in ``aiinfra_jax.data.sources``, e.g. "synthetic:niah") take precedence.
      weights: mixture weights, one per source (>= 0, at least one > 0; the weights count
        pieces); empty means equal weights. A source of weight 0 is left out of the mix.
      stages: a curriculum over steps, as in levanter's staged mixtures: ``((start_step, weights),
        ...)``, with start steps > 0 and increasing. From batch ``start_step`` on (batch i trains
        step i + 1), ``weights`` (one per source, as above) replace the previous stage's; before
        the first start step ``weights`` applies. Every source needs a positive weight in some
        stage. Each stage draws its own fresh shuffle (seeded by the stage index), so a source
        used in two stages does not replay its documents; resuming restores the stage and the
        position in it, and a run started from another's checkpoint with another data section
        (checkpoint.initialize_from at step S) opens the stage of step S + 1. Validation always
        uses every document of every source.
      text_field: field of a JSONL record / column of a Parquet table that holds the document text.
      tokenizer: "byte", a path to an HF ``tokenizer.json`` (needs the ``tokenizers`` package) or
        a path to a tiktoken BPE file (needs the ``tiktoken`` package).
      seq_len: T, tokens per row.
      batch_size: B, rows per (global) batch.
      val_fraction: fraction of documents in the validation split; a document's split is decided by
        a stable hash (CRC32) of its id (path relative to the source root, line / row number), so it
        never depends on the seed, the Python process or the order of listing.
      long_documents: "split" cuts a document longer than T into consecutive pieces, each its own
        segment with positions restarting at 0; "error" raises, naming the document and its length.
      num_workers: grain worker processes (0 = everything in this process, with reader threads).
      streams: the data as this many independent row streams. Stream k reads its share of every
        source (document i of a split belongs to stream i mod streams), with its own shuffle and
        packing, and gives batch_size / streams rows of every batch: a batch is stream 0's rows,
        then stream 1's, and so on. What a batch holds depends on ``streams``, never on how many
        processes read it: in a multi-process run each process reads only the streams whose rows
        its devices hold, so ``streams`` must be a multiple of the number of processes; a
        single-process run reads them all. 1 (the default) is the one stream single-process runs
        have always read.

    The shuffles are seeded by ``make_iterator``'s ``seed`` argument; the trainer passes
    ``run.seed``, so one seed fixes a run's initialisation and its data order.
    """

    # Fields that older versions had, with why they went. A config.json saved with one still loads:
    # the config loader drops the field with a logged note (see aiinfra_jax.config), and a
    # checkpoint's saved config is compared without it (checkpoint.initialize_from).
    RETIRED_FIELDS: ClassVar[dict[str, str]] = {
        "shuffle_seed": "the data shuffles have always been seeded by run.seed, which the "
                        "trainer passes; data.shuffle_seed was never read by the trainer",
    }

    sources: tuple[str, ...] = ("embedded",)
    weights: tuple[float, ...] = ()
    text_field: str = "text"
    tokenizer: str = "byte"
    seq_len: int = 256
    batch_size: int = 16
    val_fraction: float = 0.05
    long_documents: str = "split"
    num_workers: int = 0
    stages: tuple[tuple[int, tuple[float, ...]], ...] = ()
    streams: int = 1

    def __post_init__(self) -> None:
        # Config loaders (YAML, --set) may hand in lists; store tuples so the config stays hashable.
        if isinstance(self.sources, (list, tuple)):
            object.__setattr__(self, "sources", tuple(self.sources))
        if isinstance(self.weights, (list, tuple)):
            object.__setattr__(self, "weights", tuple(self.weights))
        if isinstance(self.stages, (list, tuple)):
            object.__setattr__(self, "stages", tuple(
                (st[0], tuple(st[1])) if isinstance(st, (list, tuple)) and len(st) == 2
                and isinstance(st[1], (list, tuple)) else st
                for st in self.stages))

        if isinstance(self.sources, str):
            raise ValueError(
                f"DataConfig.sources={self.sources!r} must be a tuple of source specs, "
                f"e.g. ({self.sources!r},)"
            )
        if not isinstance(self.sources, tuple) or not self.sources:
            raise ValueError(
                f"DataConfig.sources={self.sources!r} must be a non-empty tuple of source specs "
                "('embedded', a local file/folder path, or a registered scheme like 'synthetic:niah')"
            )
        for spec in self.sources:
            if not isinstance(spec, str) or not spec.strip():
                raise ValueError(
                    f"DataConfig.sources contains {spec!r}; every source spec must be a non-empty "
                    "string ('embedded', a local path, or a registered scheme)"
                )
        if self.weights:
            self._check_weights("DataConfig.weights", self.weights)
        self._check_stages()
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(
                f"DataConfig.text_field={self.text_field!r} must be a non-empty string naming the "
                "JSONL field / Parquet column with the text"
            )
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(
                f"DataConfig.tokenizer={self.tokenizer!r} must be 'byte' or a path to a "
                "tokenizer.json (HF tokenizers) or a tiktoken BPE file"
            )
        for name, minimum in (("seq_len", 1), ("batch_size", 1), ("num_workers", 0), ("streams", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < minimum:
                raise ValueError(f"DataConfig.{name}={value!r} must be an integer >= {minimum}")
        if self.batch_size % self.streams:
            raise ValueError(
                f"DataConfig.streams={self.streams} must divide batch_size={self.batch_size} (each "
                "stream gives batch_size / streams rows of every batch)"
            )
        vf = self.val_fraction
        if isinstance(vf, bool) or not isinstance(vf, (int, float)) or not (0.0 <= vf < 1.0):
            raise ValueError(
                f"DataConfig.val_fraction={vf!r} must be a number in [0, 1) "
                "(0 = no validation split)"
            )
        if self.long_documents not in LONG_DOCUMENT_MODES:
            raise ValueError(
                f"DataConfig.long_documents={self.long_documents!r} is not one of "
                f"{LONG_DOCUMENT_MODES}"
            )

    def _check_weights(self, name: str, weights: tuple) -> None:
        if len(weights) != len(self.sources):
            raise ValueError(
                f"{name}={weights!r} has {len(weights)} entries but there are "
                f"{len(self.sources)} sources {self.sources!r}; give one weight per source"
                + (" or () for equal weights" if name == "DataConfig.weights" else "")
            )
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                raise ValueError(f"{name}={weights!r}: every weight must be a finite number >= 0, got {w!r}")
        if not any(w > 0 for w in weights):
            raise ValueError(f"{name}={weights!r}: at least one weight must be > 0")

    def _check_stages(self) -> None:
        if not isinstance(self.stages, tuple):
            raise ValueError(
                f"DataConfig.stages={self.stages!r} must be a tuple of (start_step, weights) pairs"
            )
        previous = 0
        for i, stage in enumerate(self.stages):
            if not (isinstance(stage, tuple) and len(stage) == 2 and isinstance(stage[1], tuple)):
                raise ValueError(
                    f"DataConfig.stages[{i}]={stage!r} must be a pair (start_step, weights), e.g. "
                    f"(500, {(1.0,) * len(self.sources)!r})"
                )
            start, weights = stage
            if not _is_int(start) or start <= previous:
                raise ValueError(
                    f"DataConfig.stages[{i}] starts at step {start!r}; start steps must be integers "
                    f"> 0 and increasing (the previous stage starts at {previous})"
                )
            self._check_weights(f"DataConfig.stages[{i}] weights", weights)
            previous = start
        if self.stages:
            used = [any(w[j] > 0 for _, w in self.stage_weights) for j in range(len(self.sources))]
            unused = [src for src, u in zip(self.sources, used) if not u]
            if unused:
                raise ValueError(
                    f"DataConfig: sources {unused!r} have weight 0 in every stage; remove them or "
                    "give them a positive weight in some stage"
                )
        elif self.weights and not all(w > 0 for w in self.weights):
            unused = [src for src, w in zip(self.sources, self.weights) if w == 0]
            raise ValueError(
                f"DataConfig.weights={self.weights!r} give sources {unused!r} weight 0 and there "
                "are no stages; remove those sources or use them in a stage"
            )

    @staticmethod
    def _normalise(raw: tuple) -> tuple[float, ...]:
        total = float(sum(raw))
        return tuple(float(w) / total for w in raw)

    @property
    def mixture_weights(self) -> tuple[float, ...]:
        """The first stage's weights normalised to sum to 1 (equal weights when ``weights`` is empty)."""
        return self._normalise(self.weights or (1.0,) * len(self.sources))

    @property
    def stage_weights(self) -> tuple[tuple[int, tuple[float, ...]], ...]:
        """``((0, weights), (start_step, weights), ...)``: every stage, weights normalised to sum to 1."""
        return ((0, self.mixture_weights),) + tuple(
            (start, self._normalise(w)) for start, w in self.stages
        )
