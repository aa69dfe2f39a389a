"""Data streams (DataConfig.streams): a batch is the rows of S independent streams, each over its own
share of the documents, so it is the same whichever process reads which stream; one stream is the
pipeline single-process runs always had."""

import dataclasses
import json

import numpy as np
import pytest

from aiinfra_jax.data import (BATCH_KEYS, ByteTokenizer, DataConfig, DataIterator, StagedIterator,
                              StreamsIterator, make_iterator)

TOK = ByteTokenizer()


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _equal(a, b):
    for k in BATCH_KEYS:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _docs_of(batch):
    """The document numbers ("<i>:" prefixes) that start in a batch's rows."""
    out = []
    for row, seg in zip(batch["inputs"], batch["segment_ids"]):
        for s in range(1, int(seg.max(initial=0)) + 1):
            piece = row[seg == s]
            if piece[0] == TOK.bos_id:
                out.append(int(TOK.decode(piece[1:].tolist()).split(":", 1)[0]))
    return out


def test_one_stream_is_the_pipeline_it_always_was():
    cfg = DataConfig(seq_len=32, batch_size=4)
    assert cfg.streams == 1
    it = make_iterator(cfg, TOK, "train", seed=3)
    assert isinstance(it, DataIterator) and "streams" not in it.get_state()["fingerprint"]
    assert isinstance(make_iterator(cfg, TOK, "train", seed=3, streams=[0]), DataIterator)
    staged = DataConfig(seq_len=32, batch_size=4, sources=("embedded", "embedded"),
                        stages=((3, (1.0, 1.0)),))
    assert isinstance(make_iterator(staged, TOK, "train", seed=3), StagedIterator)
    two = make_iterator(dataclasses.replace(staged, streams=2), TOK, "train", seed=3)
    two.start_at(3)  # every stream's stages counted from step 3
    next(two)
    assert [two.get_state()["states"][k]["stage"] for k in ("0", "1")] == [1, 1]


def test_a_batch_is_its_streams_rows_whoever_reads_them(tmp_path, monkeypatch):
    from aiinfra_jax.data import pipeline

    monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW", 64)  # (filling 16384 pieces from 60 documents is slow)
    texts = [f"{i}:" + "xyz" * (i % 7 + 1) for i in range(60)]
    cfg = DataConfig(sources=(_write_jsonl(tmp_path / "d.jsonl", texts),), seq_len=32,
                     batch_size=4, val_fraction=0.0, streams=2)
    whole = make_iterator(cfg, TOK, "train", seed=5)
    halves = [make_iterator(cfg, TOK, "train", seed=5, streams=[k]) for k in (0, 1)]
    assert isinstance(whole, StreamsIterator) and whole.streams == (0, 1)
    for _ in range(6):
        batch, parts = next(whole), [next(h) for h in halves]
        assert batch["inputs"].shape == (4, 32) and parts[0]["inputs"].shape == (2, 32)
        _equal(batch, {k: np.concatenate([p[k] for p in parts]) for k in BATCH_KEYS})
        for k, part in enumerate(parts):  # stream k reads documents k, k + 2, k + 4, ...
            assert all(d % 2 == k for d in _docs_of(part)), (k, _docs_of(part))
    # another stream count is another data stream (and the single stream differs from both)
    other = next(make_iterator(dataclasses.replace(cfg, streams=4), TOK, "train", seed=5))
    assert not np.array_equal(other["inputs"], batch["inputs"])


def test_the_processes_states_resume_the_whole_stream(tmp_path):
    """Each process saves the position of its own streams; merged, they resume every stream (with
    any number of processes)."""
    cfg = DataConfig(seq_len=32, batch_size=4, streams=2)
    halves = [make_iterator(cfg, TOK, "train", seed=1, streams=[k]) for k in (0, 1)]
    for h in halves:
        for _ in range(3):
            next(h)
    state = json.loads(json.dumps(StreamsIterator.merge_states([h.get_state() for h in halves])))
    assert sorted(state["states"]) == ["0", "1"] and state["streams"] == 2
    reference = make_iterator(cfg, TOK, "train", seed=1)
    for _ in range(3):
        next(reference)
    want = [next(reference) for _ in range(2)]
    resumed = make_iterator(cfg, TOK, "train", seed=1)
    resumed.set_state(state)
    one = make_iterator(cfg, TOK, "train", seed=1, streams=[1])
    one.set_state(state)
    for w in want:
        _equal(next(resumed), w)
        _equal(next(one), {k: v[2:] for k, v in w.items()})
    with pytest.raises(ValueError, match="data.streams=2, the config now has 4"):
        make_iterator(DataConfig(seq_len=32, batch_size=4, streams=4), TOK, "train",
                      seed=1).set_state(state)
    with pytest.raises(ValueError, match=r"no position for streams \[1\]"):
        one.set_state(halves[0].get_state())


def test_a_finite_pass_pads_the_streams_that_end_first(tmp_path):
    texts = [f"{i}:" + "ab" * (40 if i == 0 else 1) for i in range(9)]  # stream 0 has more
    cfg = DataConfig(sources=(_write_jsonl(tmp_path / "d.jsonl", texts),), seq_len=16,
                     batch_size=4, val_fraction=0.0, streams=2)
    batches = list(make_iterator(cfg, TOK, "train", repeat=False))
    assert len(batches) > 1
    docs = [d for b in batches for d in _docs_of(b)]
    assert sorted(docs) == list(range(9))  # every document once
    last_1 = max(i for i, b in enumerate(batches) if (b["segment_ids"][2:] > 0).any())
    assert last_1 < len(batches) - 1  # stream 1 ended first: padding rows after it
    for b in batches[last_1 + 1:]:
        assert (b["segment_ids"][2:] == 0).all() and (b["loss_weights"][2:] == 0).all()
        assert (b["inputs"][2:] == TOK.pad_id).all()
    # A process whose streams have ended goes on with padding while others still read.
    it = make_iterator(cfg, TOK, "train", repeat=False, streams=[1])
    flags = [it.next_padded()[1] for _ in range(len(batches) + 2)]
    assert flags == [True] * (last_1 + 1) + [False] * (len(batches) + 1 - last_1)


def test_streams_are_checked():
    with pytest.raises(ValueError, match=r"streams=3 must divide batch_size=4"):
        DataConfig(batch_size=4, streams=3)
    with pytest.raises(ValueError, match=r"streams=0 must be an integer >= 1"):
        DataConfig(streams=0)
    cfg = DataConfig(seq_len=32, batch_size=4, streams=2)
    with pytest.raises(ValueError, match=r"streams=\[2\] must name distinct streams in 0..data.streams-1 = 1"):
        make_iterator(cfg, TOK, "train", streams=[2])


def test_a_stream_without_documents_is_refused(tmp_path):
    cfg = DataConfig(sources=(_write_jsonl(tmp_path / "d.jsonl", ["one", "two"]),),
                     seq_len=16, batch_size=4, val_fraction=0.0, streams=4)
    with pytest.raises(ValueError, match=r"fewer documents than data.streams=4, so stream 2 gets "
                                         r"none"):
        make_iterator(cfg, TOK, "train", streams=[2])
