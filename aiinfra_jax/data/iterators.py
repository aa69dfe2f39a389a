"""Resumable iterators over the pipeline's batches (aiinfra_jax/data/pipeline.py builds the
datasets): ``DataIterator`` (one dataset), ``StagedIterator`` (DataConfig.stages: the mixture
changes by batch count), ``StreamsIterator`` (DataConfig.streams > 1: each process reads its own
streams), and ``make_iterator``, which picks one. Each saves and restores its exact position as a
JSON-serialisable dict (a checkpoint's data item); a state from another setup is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Self

import grain
import numpy as np

from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.data.pipeline import BATCH_KEYS, _derive_seed, make_dataset
from aiinfra_jax.data.tokenizer import Tokenizer

STATE_FORMAT = 1


def _jsonable(state: Any) -> Any:
    """Grain's iterator state as plain JSON types (raises TypeError if it holds anything else)."""

    def default(o: Any) -> Any:
        if isinstance(o, np.integer):
            return int(o)
        if isinstance(o, np.floating):
            return float(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
        raise TypeError(f"iterator state holds a {type(o).__name__}, which is not JSON-serialisable")

    return json.loads(json.dumps(state, default=default))


class _Resumable:
    """What ``DataIterator`` and ``StagedIterator`` share: iteration, ``with`` and ``close`` over
    the iterator they hold in ``self._it`` (None once closed)."""

    _it: Any

    def __iter__(self) -> Self:
        return self

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops worker processes (only started when ``num_workers > 0``)."""
        if self._it is None:
            return
        close = getattr(self._it, "close", None)
        if close is not None:
            close()
        self._it = None  # Let grain's iterators go now rather than at interpreter shutdown.

    def start_at(self, batches: int) -> None:
        """For a fresh stream of a run that starts at step ``batches`` (checkpoint.initialize_from
        with another data section): the batch count that picks the stage. Only a StagedIterator's
        batches depend on it."""

    def _iterator(self) -> Any:
        if self._it is None:
            raise ValueError(
                f"{type(self).__name__} is closed; make a new one (and set_state) to continue")
        return self._it


class DataIterator(_Resumable):
    """An iterator over batches whose position can be saved and restored exactly.

    ``get_state()`` returns a JSON-serialisable dict (store it in a checkpoint);
    ``set_state(state)`` on an iterator built from the same config, tokenizer, split and seed
    continues with exactly the batches the saved iterator would have produced next. A state from a
    different setup is refused with a ValueError naming what differs.
    """

    def __init__(self, dataset: grain.IterDataset, fingerprint: Mapping[str, Any]):
        self._dataset = dataset
        self._fingerprint = _jsonable(dict(fingerprint))
        self._it = iter(dataset)
        self._copy = bool(self._fingerprint.get("num_workers", 0))

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._iterator())
        if self._copy:
            # Worker batches live in shared memory blocks; copy them out so the blocks are freed now.
            batch = {k: np.array(v, copy=True) for k, v in batch.items()}
        return batch

    def get_state(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "fingerprint": self._fingerprint,
            "grain": _jsonable(self._iterator().get_state()),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        if isinstance(state, Mapping) and "states" in state:  # a StreamsIterator's
            raise ValueError(
                f"data iterator state holds the positions of data.streams={state.get('streams')} "
                "streams, and this iterator reads one stream; resume with the data.streams the "
                "run was saved with"
            )
        if isinstance(state, Mapping) and "stages" in state:  # a StagedIterator's
            raise ValueError(
                "data iterator state is from a staged iterator (data.stages), and this iterator "
                "has no stages; resume with the data.stages the run was saved with"
            )
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT or "grain" not in state:
            raise ValueError(
                f"data iterator state has format {state.get('format') if isinstance(state, Mapping) else state!r}; "
                f"expected a dict from DataIterator.get_state() (format {STATE_FORMAT})"
            )
        saved = state.get("fingerprint", {})
        diff = {
            k: (saved.get(k), self._fingerprint.get(k))
            for k in sorted(set(saved) | set(self._fingerprint))
            if saved.get(k) != self._fingerprint.get(k)
            and (k in saved or k not in _FINGERPRINT_ADDED)  # states saved before a key existed
        }
        if diff:
            details = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"data iterator state was saved with a different data setup ({details}); resume with "
                "the same data config, tokenizer, split and seed"
            )
        self._iterator().set_state(state["grain"])


# Fingerprint keys added after states were first saved: a state without one still restores.
_FINGERPRINT_ADDED = frozenset({"documents"})


def _fingerprint(cfg: DataConfig, tokenizer: Tokenizer, split: str, seed: int, repeat: bool,
                 weights: Sequence[float], stream: int = 0,
                 documents: Sequence[int] = ()) -> dict[str, Any]:
    # (with one stream, the fingerprint of the states saved before streams existed)
    many = {"streams": cfg.streams, "stream": stream} if cfg.streams > 1 else {}
    return {
        "documents": list(documents),  # per source, in the split: a grown folder cannot resume
        "sources": list(cfg.sources),
        "weights": list(weights),
        "text_field": cfg.text_field,
        "tokenizer": repr(tokenizer),
        "vocab_size": tokenizer.vocab_size,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "val_fraction": cfg.val_fraction,
        "long_documents": cfg.long_documents,
        "num_workers": cfg.num_workers,
        "split": split,
        "seed": seed,
        "repeat": repeat,
        **many,
    }


class StagedIterator(_Resumable):
    """Endless batches whose source mixture changes at given batch counts (``DataConfig.stages``).

    Stage k (start step s_k, weights w_k) is a ``DataIterator`` over the mixture w_k with its own
    seed (stage 0 keeps the run's seed, so a config without stages is unchanged); it opens when
    the s_k-th batch is drawn. ``get_state`` / ``set_state`` record the batch count, the stage and
    the position inside the stage, so a resumed run continues with the very batches it would have
    drawn. Same interface as ``DataIterator``. ``stream``: which of ``cfg.streams`` it reads.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, split: str, seed: int,
                 stream: int = 0):
        self._cfg, self._tokenizer, self._split, self._seed = cfg, tokenizer, split, seed
        self._stream = stream
        self._stages = cfg.stage_weights
        self._batches = 0
        self._stage = 0
        self._it: DataIterator | None = self._open(0)

    def _open(self, k: int) -> DataIterator:
        seed = self._seed if k == 0 else _derive_seed(self._seed, 4, k)
        weights = self._stages[k][1]
        documents: list[int] = []
        ds = make_dataset(self._cfg, self._tokenizer, split=self._split, seed=seed, weights=weights,
                          stream=self._stream, documents=documents)
        return DataIterator(ds, _fingerprint(self._cfg, self._tokenizer, self._split, seed, True,
                                             weights, self._stream, documents))

    @property
    def stage(self) -> int:
        """Index of the stage of the last batch drawn (0 before any)."""
        return self._stage

    def __next__(self) -> dict[str, np.ndarray]:
        it = self._iterator()
        k = self._stage
        while k + 1 < len(self._stages) and self._batches >= self._stages[k + 1][0]:
            k += 1
        if k != self._stage:
            it.close()
            self._stage, self._it = k, self._open(k)
            it = self._it
        batch = next(it)
        self._batches += 1
        return batch

    def start_at(self, batches: int) -> None:
        """Counts batches from ``batches`` (before any is drawn): the next batch comes from the
        stage whose start step that count has reached, that stage opened at its beginning."""
        if self._batches:
            raise RuntimeError("start_at: batches were drawn already")
        self._batches = int(batches)

    def get_state(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "stages": [[s, list(w)] for s, w in self._stages],
            "batches": self._batches,
            "stage": self._stage,
            "inner": self._iterator().get_state(),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or "stages" not in state or "inner" not in state:
            raise ValueError(
                "data iterator state is not from a staged iterator (DataConfig.stages); resume "
                "with the data config the run was saved with"
            )
        mine = _jsonable([[s, list(w)] for s, w in self._stages])
        if _jsonable(state["stages"]) != mine:
            raise ValueError(
                f"data iterator state was saved with stages {state['stages']!r}, the config now has "
                f"{mine!r}; resume with the same DataConfig.stages"
            )
        k = int(state["stage"])
        self.close()
        self._it = self._open(k)
        self._it.set_state(state["inner"])
        self._stage, self._batches = k, int(state["batches"])


def _stream_iterator(cfg: DataConfig, tokenizer: Tokenizer, split: str, seed: int, repeat: bool,
                     stream: int) -> DataIterator | StagedIterator:
    if repeat and cfg.stages:
        return StagedIterator(cfg, tokenizer, split, seed, stream)
    documents: list[int] = []
    ds = make_dataset(cfg, tokenizer, split=split, seed=seed, num_epochs=None if repeat else 1,
                      stream=stream, documents=documents)
    return DataIterator(ds, _fingerprint(cfg, tokenizer, split, seed, repeat, cfg.mixture_weights,
                                         stream, documents))


class StreamsIterator(_Resumable):
    """The rows that some of the ``cfg.streams`` streams give to every batch (DataConfig.streams),
    stream after stream: [len(streams) * batch_size / cfg.streams, T] arrays. A process of a
    multi-process run reads the streams whose rows its devices hold; all of them give the whole
    batch.

    Finite passes (validation): a stream that has ended gives rows of padding (segment 0, weight
    0) while others go on; iteration stops when every stream has ended. ``next_padded()`` never
    stops: it also says whether any of its streams still had data, so that processes can agree
    on when a pass ends (aiinfra_jax.trainer).

    ``get_state()``: ``{"format", "streams": cfg.streams, "states": {"k": state of stream k}}``
    with this iterator's streams; ``merge_states`` joins the states of iterators over other
    streams into one (a checkpoint stores all streams, whatever the number of processes), and
    ``set_state`` takes the states of its streams from such a state.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, split: str, seed: int, repeat: bool,
                 streams: Sequence[int]):
        self._cfg = cfg
        self.streams = tuple(int(k) for k in streams)
        self._pad_id = tokenizer.pad_id
        self._ended: set[int] = set()
        self._it = {k: _stream_iterator(cfg, tokenizer, split, seed, repeat, k) for k in self.streams}

    def close(self) -> None:
        if self._it is None:
            return
        for it in self._it.values():
            it.close()
        self._it = None

    def _padding(self) -> dict[str, np.ndarray]:
        shape = (self._cfg.batch_size // self._cfg.streams, self._cfg.seq_len)
        out = {k: np.zeros(shape, np.float32 if k == "loss_weights" else np.int32) for k in BATCH_KEYS}
        out["inputs"][:] = self._pad_id
        out["targets"][:] = self._pad_id
        return out

    def next_padded(self) -> tuple[dict[str, np.ndarray], bool]:
        """(the next rows, whether any of these streams gave data); rows of padding once all ended."""
        its = self._iterator()
        parts = []
        for k in self.streams:
            part = None
            if k not in self._ended:
                try:
                    part = next(its[k])
                except StopIteration:
                    self._ended.add(k)
            parts.append(self._padding() if part is None else part)
        batch = {key: np.concatenate([p[key] for p in parts]) for key in BATCH_KEYS}
        return batch, len(self._ended) < len(self.streams)

    def __next__(self) -> dict[str, np.ndarray]:
        batch, any_data = self.next_padded()
        if not any_data:
            raise StopIteration
        return batch

    def start_at(self, batches: int) -> None:
        for it in self._iterator().values():
            it.start_at(batches)

    def get_state(self) -> dict[str, Any]:
        its = self._iterator()
        return {"format": STATE_FORMAT, "streams": self._cfg.streams,
                "states": {str(k): its[k].get_state() for k in self.streams}}

    @staticmethod
    def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One state holding the streams of every state in ``states`` (from iterators over the
        same config and split: the processes of one run)."""
        first = dict(states[0])
        first["states"] = {k: v for st in states for k, v in st["states"].items()}
        return first

    def set_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or "states" not in state:
            raise ValueError(
                f"data iterator state is not from a data.streams={self._cfg.streams} iterator; "
                "resume with the data config the run was saved with"
            )
        if state.get("streams") != self._cfg.streams:
            raise ValueError(
                f"data iterator state was saved with data.streams={state.get('streams')}, the "
                f"config now has {self._cfg.streams}; resume with the same data.streams"
            )
        missing = [k for k in self.streams if str(k) not in state["states"]]
        if missing:
            raise ValueError(f"data iterator state has no position for streams {missing}; it "
                             "was saved by a run that did not gather every process's streams")
        its = self._iterator()
        for k in self.streams:
            its[k].set_state(state["states"][str(k)])


def make_iterator(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    split: str = "train",
    seed: int = 0,
    repeat: bool = True,
    streams: Sequence[int] | None = None,
) -> DataIterator | StagedIterator | StreamsIterator:
    """A ``DataIterator`` over ``split``: endless when ``repeat``, else one deterministic pass.

    With ``cfg.stages`` an endless iterator is a ``StagedIterator`` (the mixture follows the
    stages); a finite pass is the same either way (every document of every source, once).
    With ``cfg.streams > 1``, or when ``streams`` names some of the streams (this process's; None =
    all of them), a ``StreamsIterator`` over those streams, each as above.
    """
    if streams is not None:
        streams = sorted(int(k) for k in streams)
        if not streams or len(set(streams)) != len(streams) or not 0 <= streams[0] <= streams[-1] < cfg.streams:
            raise ValueError(f"streams={streams!r} must name distinct streams in 0..data.streams-1 "
                             f"= {cfg.streams - 1}")
    if cfg.streams == 1:
        return _stream_iterator(cfg, tokenizer, split, seed, repeat, 0)
    return StreamsIterator(cfg, tokenizer, split, seed, repeat,
                           range(cfg.streams) if streams is None else streams)
