"""The MSA row source (aiinfra_jax.data.synthetic_msa, "synthetic:msa_niah"): whole pre-packed
multi-document rows in the MSA mixer's convention, carried through the pipeline unchanged, mixed
with the corpus, and trained on by a dense + msa model."""

import dataclasses
import re

import numpy as np
import pytest

from aiinfra_jax.data import ByteTokenizer, DataConfig, make_iterator, open_source, pipeline
from aiinfra_jax.data.synthetic_msa import ANSWER_BIT, MSASource
from aiinfra_jax.errors import DataError
from aiinfra_jax.models.attention import msa

TOK = ByteTokenizer()
SPEC = ("synthetic:msa_niah:n=400,seed=3,docs=5,positives=2,distractors=2,query_offset=7,"
        "doc_weight=0.5,query_weight=0.25,answer_weight=2")
T = 400


def _runs(seg):
    """[(start, end, id)] of the constant runs of non-zero ids of one row."""
    out, t = [], 0
    while t < seg.size:
        e = t
        while e < seg.size and seg[e] == seg[t]:
            e += 1
        if seg[t] != 0:
            out.append((t, e, int(seg[t])))
        t = e
    return out


def _check_msa_row(a, value=None, positives=None, answer_weight=None):
    """The convention of one MSA row's arrays (a dict of [T] arrays); returns its document runs."""
    seg, pos, w = a["segment_ids"], a["positions"], a["loss_weights"]
    runs = _runs(seg)
    *docs, (qs, qe, qid) = runs
    assert qid < 0 and all(i > 0 for _, _, i in docs)  # documents, then the one query
    assert [(i & ~ANSWER_BIT) for _, _, i in docs] == list(range(1, len(docs) + 1))
    assert docs[0][0] == 0 and all(p[1] == q[0] for p, q in zip(runs, runs[1:]))  # contiguous
    for s, e, _ in docs:
        np.testing.assert_array_equal(pos[s:e], np.arange(e - s))  # document-wise positions
        np.testing.assert_array_equal(a["targets"][s:e - 1], a["inputs"][s + 1:e])  # shifted
        assert a["inputs"][s] == TOK.bos_id and a["targets"][e - 1] == TOK.eos_id
    n_answer = -qid - 1
    assert n_answer > 0 and a["targets"][qe - 1] == TOK.eos_id
    np.testing.assert_array_equal(a["targets"][qs:qe - 1], a["inputs"][qs + 1:qe])
    assert (seg[qe:] == 0).all() and (pos[qe:] == 0).all() and (w[qe:] == 0).all()  # padding last
    assert (a["inputs"][qe:] == TOK.pad_id).all()
    answer = a["inputs"][qe - n_answer:qe]  # the tokens the router must not read
    weighted = np.flatnonzero(w[qs:qe] == (answer_weight if answer_weight else w[qe - 1]))
    np.testing.assert_array_equal(weighted, np.arange(qe - qs - n_answer - 1, qe - qs))
    np.testing.assert_array_equal(a["targets"][qs:qe][weighted], np.append(answer, TOK.eos_id))
    if value is not None:
        assert TOK.decode(answer) == value
        found = [j for j, (s, e, _) in enumerate(docs) if value in TOK.decode(a["inputs"][s:e])]
        assert found == list(positives)
        assert [j for j, (_, _, i) in enumerate(docs) if i & ANSWER_BIT] == list(positives)
    return docs, (qs, qe, qid)


def test_rows_decode_to_what_they_claim():
    assert ANSWER_BIT == msa.ANSWER_BIT
    src = open_source(SPEC, DataConfig(seq_len=T))
    assert isinstance(src, MSASource) and src.whole_rows and len(src) == 400
    lengths = []
    for i in range(12):
        r = src.row(i)
        a = src[i]
        assert all(v.shape == (T,) for v in a.values()) and len(r.positives) == 2
        docs, (qs, qe, qid) = _check_msa_row(a, r.value, r.positives, answer_weight=2.0)
        assert qid == -(1 + r.answer_tokens.size) == -(1 + len(r.value))
        np.testing.assert_array_equal(a["positions"][qs:qe], np.arange(7, 7 + qe - qs))
        assert tuple(e - s for s, e, _ in docs) == r.doc_lengths and len(docs) == 5
        np.testing.assert_array_equal(a["inputs"][qe - len(r.value):qe], r.answer_tokens)
        # the MSA module's own builder gives the same layout
        seg, pos = msa.pack_row(r.doc_lengths, r.query_length, answer_docs=r.positives,
                                answer_length=r.answer_tokens.size, query_offset=7, row_length=T)
        np.testing.assert_array_equal(a["segment_ids"], seg)
        np.testing.assert_array_equal(a["positions"], pos)
        w = a["loss_weights"]
        assert (w[:docs[-1][1]] == 0.5).all()  # doc_weight on every document target
        assert set(np.unique(w[qs:qe])) == {0.25, 2.0}
        for j in r.distractors:  # another key's fact: "<key> is <7 digits>."
            s, e, _ = docs[j]
            text = TOK.decode(a["inputs"][s:e])
            assert " is " in text and r.key not in text
        prompt = TOK.decode(a["inputs"][qs:qe - len(r.value)])
        assert prompt == f"{r.key} is "
        lengths += r.doc_lengths
    assert len(set(lengths)) > 10 and any(n % 4 for n in lengths)  # random, not chunk multiples
    # Determinism: the same seed gives the same row whatever was read before, another seed not.
    again = open_source(SPEC, DataConfig(seq_len=T))
    for k in src[5]:
        np.testing.assert_array_equal(again[5][k], src[5][k])
    other = open_source(SPEC.replace("seed=3", "seed=4"), DataConfig(seq_len=T))
    assert other.row(5).value != src.row(5).value


def test_near_keys_share_one_word_with_the_needle_key():
    src = open_source(SPEC + ",near_keys=2", DataConfig(seq_len=T))
    for i in range(8):
        r = src.row(i)
        docs, _ = _check_msa_row(src[i], r.value, r.positives, answer_weight=2.0)
        words = set(r.key.split("-"))
        for j in r.distractors:
            s, e, _ = docs[j]
            text = TOK.decode(src[i]["inputs"][s:e])
            key = re.search(r"([a-z]+-[a-z]+) is \d{7}\.", text).group(1)
            assert key != r.key and len(words & set(key.split("-"))) == 1, (text, r.key)


def test_same_length_distractors_hold_their_value_where_the_needle_does():
    src = open_source(SPEC + ",near_keys=1,same_length=1", DataConfig(seq_len=T))
    for i in range(8):
        r = src.row(i)
        docs, _ = _check_msa_row(src[i], r.value, r.positives, answer_weight=2.0)
        keys = []
        for j in r.distractors:
            s, e, _ = docs[j]
            text = TOK.decode(src[i]["inputs"][s:e])
            keys.append(re.search(r"([a-z]+-[a-z]+) is \d{7}\.", text).group(1))
        assert len(set(keys + [r.key])) == len(keys) + 1, (keys, r.key)
        same = [k for k in keys if len(k) == len(r.key)]  # the byte tokenizer: length = bytes
        assert len(same) >= 1, (keys, r.key)
        assert sum(len(set(r.key.split("-")) & set(k.split("-"))) == 1 for k in keys) >= 1


def test_mixed_with_the_corpus_and_deterministic(monkeypatch):
    monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW", 64)
    spec = "synthetic:msa_niah:docs=3,min_doc_length=9,distractors=0,haystack=noise"
    cfg = DataConfig(seq_len=128, batch_size=8, sources=("embedded", spec), weights=(0.5, 0.5))
    kinds = {"msa": 0, "plain": 0}
    with make_iterator(cfg, TOK, seed=1) as it:
        batches = [next(it) for _ in range(4)]
    for b in batches:
        assert set(b) == set(pipeline.BATCH_KEYS)
        for r in range(8):
            a = {k: v[r] for k, v in b.items()}
            if (a["segment_ids"] < 0).any():
                kinds["msa"] += 1
                _check_msa_row(a)
                assert (a["positions"][a["segment_ids"] < 0][0]) == 16  # the default offset
            else:  # an ordinary packed row: ids 1, 2, ... and positions from 0 per segment
                kinds["plain"] += 1
                seg = a["segment_ids"]
                assert seg.min() >= 0 and not (seg & ANSWER_BIT).any()
                for s, e, i in _runs(seg):
                    np.testing.assert_array_equal(a["positions"][s:e], np.arange(e - s))
                assert (a["loss_weights"][seg > 0] == 1).all()
    assert kinds["msa"] >= 4 and kinds["plain"] >= 4, kinds
    with make_iterator(cfg, TOK, seed=1) as it:
        for b in batches:
            nb = next(it)
            assert all(np.array_equal(b[k], nb[k]) for k in b)
    with make_iterator(cfg, TOK, seed=2) as it:
        nb = next(it)
        assert not np.array_equal(nb["inputs"], batches[0]["inputs"])


def test_whole_rows_pass_through_the_pipeline_unchanged():
    """A finite pass over the validation rows gives exactly the source's rows."""
    spec = "synthetic:msa_niah:n=24,docs=4,min_doc_length=40"
    cfg = DataConfig(seq_len=256, batch_size=4, sources=(spec,), val_fraction=0.25)
    src = open_source(spec, cfg)
    want = {src[i]["inputs"].tobytes(): src[i] for i in src.split_indices("validation", 0.25)}
    got = [{k: v[r] for k, v in b.items()}
           for b in make_iterator(cfg, TOK, split="validation", repeat=False)
           for r in range(4) if b["segment_ids"][r].any()]
    assert len(got) == len(want) == 6
    for row in got:
        ref = want[row["inputs"].tobytes()]
        for k in ("targets", "segment_ids", "positions", "loss_weights"):
            np.testing.assert_array_equal(row[k], ref[k], err_msg=k)


@pytest.mark.parametrize("spec,seq_len,match", [
    ("synthetic:msa_niah:docs=8", 128, r"longest fact.*lower docs \(now 8\).*seq_len"),
    ("synthetic:msa_niah:docs=3,max_doc_length=40", 128, r"max_doc_length=40.*seq_len"),
    ("synthetic:msa_niah:docs=2,max_doc_length=20", 128, r"raise max_doc_length to >= 32"),
    ("synthetic:msa_niah:min_doc_length=90,max_doc_length=80", 4096, r"min_doc_length=90"),
    ("synthetic:msa_niah:positives=9", 4096, r"positives=9 exceeds docs=8"),
    ("synthetic:msa_niah:docs=4,distractors=4", 4096, r"distractors=4"),
    ("synthetic:msa_niah:docs=4,distractors=2,near_keys=3", 4096, r"near_keys=3 exceeds"),
    ("synthetic:msa_niah:docs=4,near_keys=2,same_length=2", 4096, r"same_length=2 exceed"),
    ("synthetic:msa_niah:docs=8,same_length=4", 4096, r"same_length=4.*rarest"),
    ("synthetic:msa_niah:haystack=poems", 4096, r"haystack"),
    ("synthetic:msa_niah:dcos=4", 4096, r"bad option"),
    ("synthetic:msa_niah:docs=four", 4096, r"not a number"),
    ("synthetic:msa_bogus", 4096, r"unknown MSA task"),
    ("synthetic:msa_niah:answer_weight=0", 4096, r"nothing would be trained"),
])
def test_rows_that_cannot_be_built_are_refused(spec, seq_len, match):
    with pytest.raises(ValueError, match=match):
        open_source(spec, DataConfig(seq_len=seq_len))


def test_malformed_whole_rows_are_data_errors():
    good = {k: np.ones(8, np.int32) for k in ("inputs", "targets", "loss_weights",
                                             "segment_ids", "positions")}
    pieces = pipeline._Pieces(8, "split", whole_rows=True)
    (piece,) = pieces.flat_map({"row": good, "id": "r"})
    assert set(piece) == {"inputs", "targets", "weights", *pipeline.ROW_FEATURES}
    with pytest.raises(DataError, match="exactly seq_len=8"):
        pieces.flat_map({"row": {**good, "positions": np.ones(7)}, "id": "r"})
    with pytest.raises(DataError, match="whole_rows = True"):
        pipeline._Pieces(8, "split").flat_map({"row": good, "id": "r"})


def test_a_dense_msa_model_trains_on_msa_rows_mixed_with_the_corpus(tmp_path, monkeypatch):
    from helpers import tiny

    from aiinfra_jax.train import train

    cfg = tiny(tmp_path, "model.mixers=dense,msa", "model.msa.chunk=4", "model.msa.top_k=2",
               "model.msa.max_documents=128", "model.msa.implementation=xla",
               "model.msa.routing_loss_weight=1.0", "data.seq_len=128", "data.batch_size=4",
               "run.steps=3", "run.log_every=1", "data.val_fraction=0", "checkpoint.every=0",
               "eval.final_batches=0")
    spec = "synthetic:msa_niah:docs=3,min_doc_length=9,distractors=0,query_offset=2"
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, sources=("embedded", spec), weights=(0.5, 0.5)))
    monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW", 64)
    s = train(cfg, quiet=True)
    hist = s["history"]
    assert len(hist) == 3 and all(np.isfinite(r["loss"]) for r in hist)
    routing = [r[k] for r in hist for k in r if k.startswith("aux_loss/") and "routing" in k]
    assert routing and all(np.isfinite(routing)), hist[0].keys()
    assert any(v > 0 for v in routing)  # some batch held an MSA row with a positive
