"""MSA's memory bank (aiinfra_jax/memory_bank.py) and cached decoding (models/attention/msa.py):
tiled bank scoring equals the row scoring, decoding from a bank equals the full forward over
[the bank's documents ; the query], a bank round trip / append gives identical answers, and bad
input is refused by name."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aiinfra_jax import memory_bank as mb
from aiinfra_jax.models import ModelConfig, Transformer
from aiinfra_jax.models.attention import msa_routing
from aiinfra_jax.models.attention.msa import MSAConfig, pack_row
from aiinfra_jax.models.attention.msa_routing import (
    bank_document_scores, document_layout, document_scores, pool_chunks, query_roles)

# Chunks of 4, top 2 of 5 documents (a strict subset: the choice matters), layer 1 of 2 routes; a
# short convolution as the preset has (its cache rides beside the mixer's).
MSA = MSAConfig(chunk=4, top_k=2, max_documents=8, routing_layers=(1,), implementation="xla")
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mixers=("msa",),
                  msa=MSA, short_conv=4, max_seq_len=128)
OFFSET = MSA.resolved_query_offset
DOC_LENGTHS = [6, 9, 3, 5, 7]
PROMPTS = [[5, 9, 2, 11, 7], [3, 8, 1]]
ANSWERS = [[4, 12, 6], [10, 2, 13]]


def _docs(seed=0, lengths=DOC_LENGTHS):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, CFG.vocab_size, n).astype(np.int32) for n in lengths]


_MODELS: dict = {}


def _model(seed=0, cfg=CFG):
    key = (seed, cfg)
    if key not in _MODELS:
        _MODELS[key] = Transformer(cfg, rngs=nnx.Rngs(seed))
    return _MODELS[key]


@pytest.mark.parametrize("reduce", [("mean", "max", "max"), ("max", "mean", "mean"),
                                    ("mean", "last", "max")])
def test_tiled_bank_scores_equal_row_scores(monkeypatch, reduce):
    """A bank holding a row's pooled chunks, scored in tiles of 4 chunks (several scan steps and a
    padded tail), gives the row's document scores."""
    head, query, chunk = reduce
    cfg = MSAConfig(chunk=4, top_k=2, head_reduce=head, query_reduce=query, chunk_reduce=chunk)
    seg, _ = pack_row(DOC_LENGTHS, 6, answer_length=2, query_offset=OFFSET, row_length=40)
    seg = jnp.asarray(seg)[None]
    k1, k2 = jax.random.split(jax.random.key(1))
    q_route = jax.random.normal(k1, (1, 40, 4, 8))
    k_route = jax.random.normal(k2, (1, 40, 2, 8))
    layout = document_layout(seg, 4, 8)
    kc = pool_chunks(k_route, layout)
    reads = query_roles(seg)[2]
    want = document_scores(q_route, kc, reads, layout, cfg)[0, :len(DOC_LENGTHS)]
    total = int(np.sum(np.asarray(layout["count"][0]) > 0))
    padded = -(-total // 4) * 4
    route_k = jnp.pad(kc[0, :total], ((0, padded - total), (0, 0), (0, 0)))
    chunk_doc = jnp.pad(layout["chunk_doc"][0, :total], (0, padded - total),
                        constant_values=len(DOC_LENGTHS))
    monkeypatch.setattr(msa_routing, "BANK_TILE", 4)
    got = bank_document_scores(q_route, reads, route_k, chunk_doc, len(DOC_LENGTHS), cfg)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6)
    # A device bank's keys are normalised once (MemoryBank.to_device) and not again.
    unit = bank_document_scores(q_route, reads, msa_routing.unit_keys(route_k), chunk_doc,
                                len(DOC_LENGTHS), cfg, keys_normalized=True)[0]
    np.testing.assert_allclose(np.asarray(unit), np.asarray(want), rtol=0, atol=2e-6)
    raw = bank_document_scores(q_route, reads, 3.0 * route_k, chunk_doc, len(DOC_LENGTHS), cfg,
                               keys_normalized=True)[0]  # the flag really skips the norm
    assert not np.allclose(np.asarray(raw), np.asarray(want), atol=1e-3)


def _full_forward_logits(model, docs, prompt, answer):
    """Logits over the query of the training forward of [docs ; prompt + answer]."""
    query = list(prompt) + list(answer)
    seg, pos = pack_row([d.size for d in docs], len(query), answer_length=len(answer),
                        query_offset=OFFSET)
    tokens = np.concatenate(list(docs) + [np.asarray(query, np.int32)])
    logits, _, _ = model(jnp.asarray(tokens)[None], positions=jnp.asarray(pos)[None],
                         segment_ids=jnp.asarray(seg)[None])
    return np.asarray(logits[0, -len(query):])


def _bank_logits(model, device_bank, prompts, answers):
    """Prefill of the prompts (right-padded, one call) routed over the bank, then the answers fed
    one token per step: logits [B, prompt + answer, V] (prompt positions beyond a row's length
    are padding)."""
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), lengths.max()), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    batch, seq = tokens.shape
    cache = mb.attach_bank(model, model.init_cache(batch, 16),
                           device_bank.arrays, device_bank.max_doc_chunks)
    t = np.arange(seq)[None]
    seg = np.where(t < lengths[:, None], -1, 0).astype(np.int32)
    logits, cache, _ = model(jnp.asarray(tokens), positions=jnp.asarray(OFFSET + t + 0 * seg),
                             segment_ids=jnp.asarray(seg), cache=cache)
    out = [np.asarray(logits)]
    for i in range(len(answers[0])):
        tok = jnp.asarray([a[i] for a in answers], jnp.int32)
        step, cache, _ = model(tok[:, None], positions=jnp.asarray(OFFSET + lengths + i)[:, None],
                               cache=cache)
        out.append(np.asarray(step))
    return out, cache


# Key/value chunks as the routing chunks, rotated routing keys / chunks of 3, unrotated ones.
@pytest.mark.parametrize("kv_chunk,router_rope", [(None, True), (3, False)])
def test_decode_from_bank_equals_full_forward(tmp_path, kv_chunk, router_rope):
    """Documents encoded in rows of 16 tokens (packed otherwise than in the full row), routed
    over in one prefill of two right-padded prompts, answers decoded step by step: every query
    logit equals the training forward over [all documents ; query], and without the bank they
    differ (the memory matters)."""
    model = _model(cfg=dataclasses.replace(CFG, msa=dataclasses.replace(
        MSA, kv_chunk=kv_chunk, router_rope=router_rope)))
    docs = _docs()
    bank = mb.build_bank(model, docs, tmp_path / "bank", max_doc_length=16, row_len=16)
    kv = kv_chunk or 4
    assert bank.n_docs == 5 and bank.n_chunks == sum(-(-n // 4) for n in DOC_LENGTHS)
    assert bank.n_kv_chunks == sum(-(-n // kv) for n in DOC_LENGTHS)
    assert bank.array("layer_1.k").shape == (bank.n_kv_chunks, 2, 8)
    device_bank = bank.to_device()
    steps, cache = _bank_logits(model, device_bank, PROMPTS, ANSWERS)
    chosen = mb.cache_documents(model, cache)
    assert set(chosen) == {1} and chosen[1].shape == (2, 2) and (chosen[1] >= 0).all()
    for b, (prompt, answer) in enumerate(zip(PROMPTS, ANSWERS)):
        want = _full_forward_logits(model, docs, prompt, answer)
        got = np.concatenate([steps[0][b, :len(prompt)]] + [s[b] for s in steps[1:]])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    # Teacher forcing through the bank: prompt + answer in one prefill, the answer unread by the
    # router (msa.py's id -(1 + a)), gives the same logits at every query position.
    for b, (prompt, answer) in enumerate(zip(PROMPTS, ANSWERS)):
        tf, _ = mb.bank_prefill(model, device_bank, np.asarray([prompt + answer], np.int32),
                                np.asarray([len(prompt) + len(answer)]), 16,
                                unread=np.asarray([len(answer)]), every_position=True)
        np.testing.assert_allclose(np.asarray(tf[0]),
                                   _full_forward_logits(model, docs, prompt, answer),
                                   rtol=0, atol=1e-4)
    plain = model.init_cache(2, 16)
    lengths = np.asarray([len(p) for p in PROMPTS])
    tokens = np.zeros((2, 5), np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, :len(p)] = p
    seg = np.where(np.arange(5)[None] < lengths[:, None], -1, 0).astype(np.int32)
    no_memory, _, _ = model(jnp.asarray(tokens), positions=jnp.asarray(OFFSET + np.arange(5))[None]
                            .repeat(2, 0), segment_ids=jnp.asarray(seg), cache=plain)
    assert np.abs(np.asarray(no_memory)[0, :5] - steps[0][0, :5]).max() > 1e-3


def test_generate_from_bank_round_trip_and_append(tmp_path):
    """One bank built at once and one built in two appends store the same arrays, reopen to the
    same answers, and an interrupted append (garbage past the committed rows, the manifest still
    "appending") is read as its committed rows and repaired by the next append."""
    model = _model()
    docs = _docs(seed=3)
    whole = mb.build_bank(model, docs, tmp_path / "whole", max_doc_length=16,
                          ids=[f"d{j}" for j in range(5)])
    mb.build_bank(model, docs[:3], tmp_path / "parts", max_doc_length=16,
                  ids=["d0", "d1", "d2"])
    # An append interrupted after it wrote part of its rows.
    manifest = json.loads((tmp_path / "parts" / "manifest.json").read_text())
    (tmp_path / "parts" / "manifest.json").write_text(json.dumps(dict(manifest, appending=True)))
    with open(tmp_path / "parts" / "layer_1.k.bin", "ab") as f:
        f.write(b"\x7f" * 100)
    assert mb.MemoryBank.open(tmp_path / "parts", model=model).n_docs == 3
    parts = mb.build_bank(model, docs[3:], tmp_path / "parts", append=True, ids=["d3", "d4"])
    reopened = mb.MemoryBank.open(tmp_path / "parts", model=model)
    assert reopened.doc_ids() == whole.doc_ids() == [f"d{j}" for j in range(5)]
    assert parts.manifest == reopened.manifest and not reopened.manifest["appending"]
    for name in ("doc_chunks", "layer_1.route_k", "layer_1.k", "layer_1.v"):
        np.testing.assert_allclose(reopened.array(name), whole.array(name), rtol=0, atol=1e-6)
    # A bank written before kv_chunk existed (no kv_chunk, n_kv_chunks) reads as kv_chunk = chunk.
    old = {k: v for k, v in whole.manifest.items() if k not in ("kv_chunk", "n_kv_chunks")}
    (whole.path / "manifest.json").write_text(json.dumps(old))
    whole = mb.MemoryBank.open(whole.path, model=model)
    assert (whole.kv_chunk, whole.n_kv_chunks) == (4, whole.n_chunks)
    answers = [mb.generate_from_bank(model, b.to_device(), PROMPTS, max_new_tokens=4)
               for b in (whole, reopened)]
    low = mb.generate_from_bank(model, whole.to_device(), PROMPTS, max_new_tokens=4, vocab=5)
    assert int(np.max(np.asarray(low.result.tokens))) < 5  # ids a smaller tokenizer can decode
    with pytest.raises(ValueError, match="max_new_tokens=0 must be a positive int"):
        mb.generate_from_bank(model, whole.to_device(), PROMPTS, max_new_tokens=0)
    for a in answers[1:]:
        np.testing.assert_array_equal(np.asarray(a.result.tokens),
                                      np.asarray(answers[0].result.tokens))
        np.testing.assert_array_equal(a.documents[1], answers[0].documents[1])


def test_bad_banks_and_documents_are_refused(tmp_path):
    model = _model()
    docs = _docs()
    mb.build_bank(model, docs, tmp_path / "bank", max_doc_length=16)
    with pytest.raises(mb.BankError, match="other parameters"):
        mb.MemoryBank.open(tmp_path / "bank", model=_model(seed=1))
    other = dataclasses.replace(CFG, msa=dataclasses.replace(MSA, chunk=8))
    with pytest.raises(mb.BankError, match="another configuration.*msa.chunk"):
        mb.MemoryBank.open(tmp_path / "bank", model=_model(cfg=other))
    with pytest.raises(mb.BankError, match="already holds a memory bank"):
        mb.build_bank(model, docs, tmp_path / "bank", max_doc_length=16)
    with pytest.raises(mb.BankError, match="empty"):
        mb.build_bank(model, [], tmp_path / "empty", max_doc_length=16)
    with pytest.raises(mb.BankError, match="document 1 has 20 tokens.*max_doc_length=16"):
        mb.build_bank(model, _docs(lengths=[5, 20]), tmp_path / "long", max_doc_length=16)
    # Appends refused before anything is written: ids already in the bank (an interrupted build
    # appended again), ids that are not JSON-able, another model's arrays, a wrong id count.
    bank = mb.MemoryBank.open(tmp_path / "bank", model=model)
    enc = mb.encode_documents(model, docs[:2], row_len=256, max_doc_length=16)
    with pytest.raises(mb.BankError, match=r"ids \['0', '1'\] are already in the bank"):
        bank.append(enc, [0, 1])
    with pytest.raises(mb.BankError, match="given twice"):
        bank.append(enc, ["x", "x"])
    with pytest.raises(mb.BankError, match="id .* is not JSON-able"):
        bank.append(enc, [object(), "y"])
    narrow = dataclasses.replace(enc, layers={i: {**a, "k": a["k"][:, :1]}
                                             for i, a in enc.layers.items()})
    with pytest.raises(mb.BankError, match=r"layer 1 k is \[\d+, 1, \d+\].*bank's model"):
        bank.append(narrow, ["x", "y"])
    assert mb.MemoryBank.open(tmp_path / "bank", model=model).manifest == bank.manifest
    with pytest.raises(mb.BankError, match="3 ids for 5 documents"):
        mb.build_bank(model, docs, tmp_path / "ids", ids=["a", "b", "c"], max_doc_length=16)
    assert not (tmp_path / "ids").exists()
    # docs.jsonl cut short (a crash while it was rewritten, before it was written whole)
    listing = (tmp_path / "bank" / "docs.jsonl").read_text()
    (tmp_path / "bank" / "docs.jsonl").write_text("".join(listing.splitlines(True)[:2]))
    with pytest.raises(mb.BankError, match="docs.jsonl names 2 documents, the manifest commits 5"):
        mb.MemoryBank.open(tmp_path / "bank").doc_ids()
    (tmp_path / "bank" / "docs.jsonl").write_text(listing)
    with open(tmp_path / "bank" / "layer_1.v.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(mb.BankError, match="layer_1.v.bin has 10 bytes.*truncated"):
        mb.MemoryBank.open(tmp_path / "bank")
    with pytest.raises(mb.BankError, match="not a memory bank"):
        mb.MemoryBank.open(tmp_path)


def test_keys_and_values_left_on_host_give_the_same_answers(tmp_path):
    """to_device(kv_on_host=True): the keys and values stay in their memory-mapped files and the
    prefill reads the chosen rows through a host callback; the device holds no key/value arrays,
    and the logits, chosen documents and greedy answers equal those of the bank on the device."""
    model = _model()
    bank = mb.build_bank(model, _docs(), tmp_path / "bank", max_doc_length=16)
    on_device, on_host = bank.to_device(), bank.to_device(kv_on_host=True)
    layer = on_host.arrays["layers"][1]
    assert isinstance(layer["k"], msa_routing.HostRows) and layer["k"].shape[0] == bank.n_kv_chunks
    leaves = jax.tree.leaves(on_host.arrays["layers"])  # the routing keys alone
    assert len(leaves) == len(bank.layers) == len(jax.tree.leaves(on_device.arrays["layers"])) // 3
    tokens = np.asarray([[5, 9, 2, 11, 7], [3, 8, 1, 0, 0]], np.int32)
    lengths = np.asarray([5, 3], np.int32)
    want = mb.bank_prefill(model, on_device, tokens, lengths, 12)
    got = mb.bank_prefill(model, on_host, tokens, lengths, 12)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(mb.cache_documents(model, got[1])[1],
                                  mb.cache_documents(model, want[1])[1])
    answers = [mb.generate_from_bank(model, b, PROMPTS, max_new_tokens=4)
               for b in (on_device, on_host)]
    np.testing.assert_array_equal(np.asarray(answers[0].result.tokens),
                                  np.asarray(answers[1].result.tokens))


def test_sharded_bank_scoring_equals_one_device(tmp_path):
    """The bank's chunks split over 8 devices (data 2 x fsdp 2 x tensor 2): every device scores
    its share in a shard_map and the partial scores are combined; the prefill's logits and chosen
    documents equal the single-device ones, and the compiled program holds the combining
    all-reduce."""
    from aiinfra_jax import sharding as shd
    from aiinfra_jax.config import MeshConfig

    model = _model()
    bank = mb.build_bank(model, _docs(seed=5, lengths=[6, 9, 3, 5, 7, 11, 4, 8, 2, 10]),
                         tmp_path / "bank", max_doc_length=16)
    mesh = shd.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    tokens = np.asarray([[5, 9, 2, 11, 7], [3, 8, 1, 0, 0]], np.int32)
    lengths = np.asarray([5, 3], np.int32)
    one = mb.bank_prefill(model, bank.to_device(), tokens, lengths, 12)
    sharded_bank = bank.to_device(mesh)
    assert sharded_bank.arrays["layers"][1]["route_k"].shape[0] % 8 == 0
    assert len(sharded_bank.arrays["layers"][1]["route_k"].sharding.device_set) == 8
    many = mb.bank_prefill(model, sharded_bank, tokens, lengths, 12, mesh=mesh)
    np.testing.assert_allclose(np.asarray(many[0]), np.asarray(one[0]), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(mb.cache_documents(model, many[1])[1],
                                  mb.cache_documents(model, one[1])[1])
    hosted = mb.bank_prefill(model, bank.to_device(mesh, kv_on_host=True), tokens, lengths, 12,
                             mesh=mesh)  # keys and values read from the files by a callback
    np.testing.assert_allclose(np.asarray(hosted[0]), np.asarray(one[0]), rtol=0, atol=1e-5)
    graphdef, state = nnx.split(model)
    with shd.activation_rules(mesh):
        hlo = mb._bank_prefill.lower(graphdef, state, sharded_bank.arrays, jnp.asarray(tokens),
                                     jnp.asarray(lengths), jnp.zeros(2, jnp.int32), 12,
                                     sharded_bank.max_doc_chunks, False).compile().as_text()
    assert "all-reduce" in hlo
