"""The grain pipeline: packing invariants, determinism, state save/restore, splits and mixtures."""

import json

import numpy as np
import pytest

from aiinfra_jax.data import BATCH_KEYS, ByteTokenizer, DataConfig, make_dataset, make_iterator

TOK = ByteTokenizer()


def _write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


def _random_docs(rng, n, max_len, alphabet="abcdefghijklmnopqrstuvwxyz é☃\n"):
    chars = list(alphabet)
    return ["".join(rng.choice(chars, size=int(rng.integers(0, max_len)))) for _ in range(n)]


def _expected_pieces(texts, seq_len):
    pieces = []
    for t in texts:
        tokens = [TOK.bos_id] + TOK.encode(t) + [TOK.eos_id]
        pieces += [tuple(tokens[a : a + seq_len + 1]) for a in range(0, len(tokens) - 1, seq_len)]
    return sorted(pieces)


def _check_batch_and_get_pieces(batch, batch_size, seq_len):
    """Asserts the packing invariants of one batch; returns its pieces (inputs + last target)."""
    assert sorted(batch) == sorted(BATCH_KEYS)
    for k in BATCH_KEYS:
        assert batch[k].shape == (batch_size, seq_len), k
    for k in ("inputs", "targets", "positions", "segment_ids"):
        assert batch[k].dtype == np.int32, k
    assert batch["loss_weights"].dtype == np.float32
    pieces = []
    for r in range(batch_size):
        seg = batch["segment_ids"][r]
        inp, tgt, pos, w = (batch[k][r] for k in ("inputs", "targets", "positions", "loss_weights"))
        pad = seg == 0
        n_real = int((~pad).sum())
        assert not pad[:n_real].any(), "padding only at the end of a row"
        assert (inp[pad] == TOK.pad_id).all() and (tgt[pad] == TOK.pad_id).all()
        assert (w[pad] == 0).all() and (pos[pad] == 0).all()
        ids = seg[:n_real]
        assert (np.diff(ids) >= 0).all() and (ids.size == 0 or ids[0] == 1)
        assert set(ids.tolist()) == set(range(1, int(ids.max(initial=0)) + 1)), "segments 1, 2, 3, ..."
        for s in range(1, int(ids.max(initial=0)) + 1):
            m = seg == s
            np.testing.assert_array_equal(pos[m], np.arange(m.sum()))  # positions restart at 0
            np.testing.assert_array_equal(tgt[m][:-1], inp[m][1:])  # next token, same document
            assert (w[m] == 1).all()
            assert inp[m][0] != TOK.eos_id and TOK.bos_id not in tgt[m]
            pieces.append(tuple(inp[m].tolist()) + (int(tgt[m][-1]),))
    return pieces


def _all_batches(it):
    return list(it)


def test_packing_invariants_and_every_token_once(tmp_path):
    rng = np.random.default_rng()
    seq_len, batch_size = 24, 3
    texts = _random_docs(rng, 30, 90)  # many documents longer than seq_len: split into pieces
    cfg = DataConfig(
        sources=(_write_jsonl(tmp_path / "d.jsonl", texts),), seq_len=seq_len, batch_size=batch_size,
        val_fraction=0.0,
    )
    batches = _all_batches(make_iterator(cfg, TOK, "train", seed=int(rng.integers(1000)), repeat=False))
    got = []
    for b in batches:
        got += _check_batch_and_get_pieces(b, batch_size, seq_len)
    assert sorted(got) == _expected_pieces(texts, seq_len)
    # Only the final batch may hold all-padding rows.
    assert all((b["segment_ids"] > 0).any(axis=1).all() for b in batches[:-1])


def test_long_documents_error_names_document(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ["short", "x" * 40, "fine"])
    cfg = DataConfig(sources=(path,), seq_len=16, batch_size=2, val_fraction=0.0, long_documents="error")
    with pytest.raises(ValueError, match=r"document 'd.jsonl:2' has 42 tokens \(with BOS/EOS\), more than seq_len \+ 1 = 17"):
        _all_batches(make_iterator(cfg, TOK, "train", repeat=False))
    # Exactly seq_len + 1 tokens fits one row.
    ok = _write_jsonl(tmp_path / "ok.jsonl", ["y" * 15])
    cfg = DataConfig(sources=(ok,), seq_len=16, batch_size=2, val_fraction=0.0, long_documents="error")
    (b,) = _all_batches(make_iterator(cfg, TOK, "train", repeat=False))
    assert (b["segment_ids"][0] == 1).all() and (b["segment_ids"][1] == 0).all()


def test_same_seed_same_batches_different_seed_different():
    cfg = DataConfig(seq_len=64, batch_size=4)
    a = make_iterator(cfg, TOK, "train", seed=7)
    b = make_iterator(cfg, TOK, "train", seed=7)
    c = make_iterator(cfg, TOK, "train", seed=8)
    for _ in range(3):
        x, y, z = next(a), next(b), next(c)
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    assert not np.array_equal(x["inputs"], z["inputs"])
    _check_batch_and_get_pieces(x, 4, 64)


@pytest.mark.parametrize("skip, window", [(0, None), (5, None), (45, None), (45, 64)])
def test_state_restore_gives_identical_batches(skip, window, monkeypatch):
    # 45 batches of 4 rows cross a packing group (128 bins) boundary; with a 64-piece shuffle
    # window they also cross several window boundaries.
    if window is not None:
        from aiinfra_jax.data import pipeline

        monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW", window)
    cfg = DataConfig(seq_len=32, batch_size=4)
    it = make_iterator(cfg, TOK, "train", seed=3)
    for _ in range(skip):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(4)]
    resumed = make_iterator(cfg, TOK, "train", seed=3)
    resumed.set_state(json.loads(json.dumps(state)))
    for w in want:
        got = next(resumed)
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(got[k], w[k])


def test_state_from_other_setup_is_refused():
    cfg = DataConfig(seq_len=32, batch_size=4)
    state = make_iterator(cfg, TOK, "train", seed=3).get_state()
    other = make_iterator(DataConfig(seq_len=32, batch_size=8), TOK, "train", seed=3)
    with pytest.raises(ValueError, match=r"different data setup \(batch_size: saved 4, now 8\)"):
        other.set_state(state)
    with pytest.raises(ValueError, match="expected a dict from DataIterator.get_state"):
        other.set_state({"grain": {}})
    # A two-stream state given to a one-stream iterator is named as such.
    two = make_iterator(DataConfig(seq_len=32, batch_size=4, streams=2), TOK, "train", seed=3)
    with pytest.raises(ValueError, match=r"positions of data.streams=2 streams.*one stream"):
        make_iterator(cfg, TOK, "train", seed=3).set_state(two.get_state())
    # A state saved before the fingerprint counted documents still restores.
    old = json.loads(json.dumps(state))
    del old["fingerprint"]["documents"]
    make_iterator(cfg, TOK, "train", seed=3).set_state(old)


def test_a_source_whose_documents_changed_cannot_resume(tmp_path):
    """A folder that gained a file since the state was saved: its shuffle is another, so the
    saved position would repeat some documents and skip others; refused by name."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(3):
        _write_jsonl(folder / f"{i}.jsonl", [f"document {i}.{j} " * 3 for j in range(20)])
    cfg = DataConfig(sources=(str(folder),), seq_len=32, batch_size=4, val_fraction=0.0)
    it = make_iterator(cfg, TOK, "train", seed=3)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    _write_jsonl(folder / "3.jsonl", ["one more document"])
    with pytest.raises(ValueError, match=r"different data setup \(documents: saved \[60\], "
                                          r"now \[61\]\)"):
        make_iterator(cfg, TOK, "train", seed=3).set_state(state)


def _doc_ids(pieces):
    """The document numbers ("{i}:" prefixes) of the pieces that open a document (start with BOS)."""
    return {int(TOK.decode(list(p[1:])).split(":", 1)[0]) for p in pieces if p[0] == TOK.bos_id}


def test_validation_split_finite_deterministic_and_disjoint(tmp_path):
    rng = np.random.default_rng()
    texts = _random_docs(rng, 40, 60)
    texts = [f"{i}:{t}" for i, t in enumerate(texts)]  # distinct documents
    path = _write_jsonl(tmp_path / "d.jsonl", texts)
    cfg = DataConfig(sources=(path,), seq_len=32, batch_size=4, val_fraction=0.4)
    runs = [_all_batches(make_iterator(cfg, TOK, "validation", repeat=False)) for _ in range(2)]
    assert len(runs[0]) == len(runs[1]) > 0
    for x, y in zip(*runs):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    val_pieces = [p for b in runs[0] for p in _check_batch_and_get_pieces(b, 4, 32)]
    train_pieces = [
        p for b in make_dataset(cfg, TOK, split="train", num_epochs=1)
        for p in _check_batch_and_get_pieces(b, 4, 32)
    ]
    assert sorted(val_pieces + train_pieces) == _expected_pieces(texts, 32)
    # The split is by document: each side holds exactly the pieces of its own documents. (Pieces
    # themselves may repeat across documents, e.g. two tails "t<eos>", so compare documents.)
    val_docs, train_docs = _doc_ids(val_pieces), _doc_ids(train_pieces)
    assert val_docs and train_docs and val_docs.isdisjoint(train_docs)
    assert val_docs | train_docs == set(range(len(texts)))
    assert sorted(val_pieces) == _expected_pieces([texts[i] for i in val_docs], 32)
    assert sorted(train_pieces) == _expected_pieces([texts[i] for i in train_docs], 32)
    # All-padding rows appear only at the end of the last batch.
    empty = np.concatenate([(b["segment_ids"] == 0).all(axis=1) for b in runs[0]])
    assert not empty[: len(empty) - 4].any()
    assert (np.diff(empty[-4:].astype(int)) >= 0).all()


def test_two_epochs_see_every_piece_twice_in_new_order(tmp_path):
    rng = np.random.default_rng()
    texts = [f"{i}:{t}" for i, t in enumerate(_random_docs(rng, 12, 20))]
    cfg = DataConfig(sources=(_write_jsonl(tmp_path / "d.jsonl", texts),), seq_len=64, batch_size=2, val_fraction=0.0)
    pieces = [p for b in make_dataset(cfg, TOK, split="train", num_epochs=2) for p in _check_batch_and_get_pieces(b, 2, 64)]
    assert sorted(pieces) == sorted(_expected_pieces(texts, 64) * 2)


def test_mixture_follows_weights(tmp_path, monkeypatch):
    from aiinfra_jax.data import pipeline

    monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW", 512)  # tiny documents: keep the test fast
    a = _write_jsonl(tmp_path / "a.jsonl", ["a" * int(n) for n in np.random.default_rng().integers(1, 10, 50)])
    b = _write_jsonl(tmp_path / "b.jsonl", ["b" * int(n) for n in np.random.default_rng().integers(1, 10, 50)])
    cfg = DataConfig(sources=(a, b), weights=(1.0, 3.0), seq_len=32, batch_size=8, val_fraction=0.0)
    it = make_iterator(cfg, TOK, "train")
    counts = {ord("a"): 0, ord("b"): 0}
    for _ in range(30):
        batch = next(it)
        for piece in _check_batch_and_get_pieces(batch, 8, 32):
            counts[piece[1]] += 1
    frac_a = counts[ord("a")] / sum(counts.values())
    assert 0.18 < frac_a < 0.32, counts
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(2)]
    resumed = make_iterator(cfg, TOK, "train")
    resumed.set_state(state)
    for w in want:
        got = next(resumed)
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(got[k], w[k])


@pytest.mark.parametrize("resume_at", [2, 3, 5])
def test_stages_switch_the_mixture_and_resume_across_a_boundary(tmp_path, monkeypatch, resume_at):
    from aiinfra_jax.data import StagedIterator, pipeline

    monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW", 64)
    rng = np.random.default_rng()
    paths = [_write_jsonl(tmp_path / f"{c}.jsonl", [c * int(n) for n in rng.integers(1, 10, 30)])
             for c in "abc"]
    # Batches 0-2: only a; 3-4: only b; from 5: b and c.
    cfg = DataConfig(sources=tuple(paths), weights=(1, 0, 0), stages=((3, (0, 1, 0)), (5, (0, 1, 1))),
                     seq_len=16, batch_size=4, val_fraction=0.0)

    def letters(batch):
        return {chr(p[1]) for p in _check_batch_and_get_pieces(batch, 4, 16)}

    it = make_iterator(cfg, TOK, "train", seed=1)
    assert isinstance(it, StagedIterator)
    seen = [letters(next(it)) for _ in range(8)]
    assert seen[:3] == [{"a"}] * 3 and seen[3:5] == [{"b"}] * 2, seen
    assert set().union(*seen[5:]) == {"b", "c"} and it.stage == 2

    it = make_iterator(cfg, TOK, "train", seed=1)
    for _ in range(resume_at):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(3)]
    resumed = make_iterator(cfg, TOK, "train", seed=1)
    resumed.set_state(state)
    for w in want:
        got = next(resumed)
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(got[k], w[k])

    # A fresh stream for a run that starts at step 4 (checkpoint.initialize_from with another
    # data section): its stages follow the steps, so batch 4 is already b's.
    late = make_iterator(cfg, TOK, "train", seed=1)
    late.start_at(4)
    assert letters(next(late)) == {"b"} and late.stage == 1
    assert set().union(*(letters(next(late)) for _ in range(3))) == {"b", "c"}
    with pytest.raises(RuntimeError, match="drawn already"):
        late.start_at(0)

    moved = DataConfig(sources=tuple(paths), weights=(1, 0, 0), stages=((4, (0, 1, 0)), (5, (0, 1, 1))),
                       seq_len=16, batch_size=4, val_fraction=0.0)
    with pytest.raises(ValueError, match="saved with stages .* resume with the same DataConfig.stages"):
        make_iterator(moved, TOK, "train", seed=1).set_state(state)
    plain = make_iterator(DataConfig(sources=tuple(paths), seq_len=16, batch_size=4), TOK, "train")
    with pytest.raises(ValueError, match=r"from a staged iterator \(data.stages\), and this "
                                         "iterator has no stages"):
        plain.set_state(state)
    with pytest.raises(ValueError, match="not from a staged iterator"):
        make_iterator(cfg, TOK, "train", seed=1).set_state(plain.get_state())
    # A finite pass ignores the stages: every document of every source once.
    pieces = [p for b in make_iterator(cfg, TOK, "train", repeat=False)
              for p in _check_batch_and_get_pieces(b, 4, 16)]
    assert {chr(p[1]) for p in pieces} == {"a", "b", "c"}


def test_pretokenized_documents_keep_their_loss_weights(tmp_path):
    from aiinfra_jax.data import sources as S

    rng = np.random.default_rng()
    docs = []
    for _ in range(10):
        n = int(rng.integers(3, 12))
        docs.append({"tokens": rng.integers(0, 256, n), "loss_weights": (rng.random(n) < 0.5).astype(np.float32)})

    class Pretok:
        name = "pretok"

        def __len__(self):
            return len(docs)

        def __getitem__(self, i):
            return docs[i]

        def doc_id(self, i):
            return f"pretok/{i}"

    S.register_source("unit-test-pretok")(lambda spec, cfg: Pretok())
    try:
        cfg = DataConfig(sources=("unit-test-pretok",), seq_len=16, batch_size=2, val_fraction=0.0)
        got = {}
        for batch in make_iterator(cfg, TOK, "train", repeat=False):
            for r in range(2):
                seg = batch["segment_ids"][r]
                for s in range(1, seg.max() + 1):
                    m = seg == s
                    key = tuple(batch["inputs"][r][m].tolist()) + (int(batch["targets"][r][m][-1]),)
                    got[key] = batch["loss_weights"][r][m]
        assert len(got) == len(docs)
        for d in docs:
            np.testing.assert_array_equal(got[tuple(d["tokens"].tolist())], d["loss_weights"][1:])
    finally:
        S._REGISTRY.pop("unit-test-pretok", None)


def test_bad_split_and_epochs():
    with pytest.raises(ValueError, match=r"split='val' is not one of \('train', 'validation'\)"):
        make_dataset(DataConfig(), TOK, split="val")
    with pytest.raises(ValueError, match="num_epochs=0 must be None"):
        make_dataset(DataConfig(), TOK, split="train", num_epochs=0)
    with pytest.raises(ValueError, match="seed=-1 must be an integer >= 0"):
        make_dataset(DataConfig(), TOK, split="train", seed=-1)


def test_worker_processes_restore_exactly():
    cfg = DataConfig(seq_len=32, batch_size=4, num_workers=1)
    with make_iterator(cfg, TOK, "train", seed=5) as it:
        first = next(it)
        _check_batch_and_get_pieces(first, 4, 32)
        state = it.get_state()
        want = [next(it) for _ in range(3)]
    with pytest.raises(ValueError, match="DataIterator is closed"):
        next(it)
    with make_iterator(cfg, TOK, "train", seed=5) as resumed:
        resumed.set_state(json.loads(json.dumps(state)))
        for w in want:
            got = next(resumed)
            for k in BATCH_KEYS:
                np.testing.assert_array_equal(got[k], w[k])
