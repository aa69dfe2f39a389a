"""Tokenizers: byte round trips, specials, loader errors."""

import sys

import numpy as np
import pytest

from aiinfra_jax.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, read_tiktoken_ranks


def _random_text(rng: np.random.Generator, n: int) -> str:
    # ASCII, Latin-1, CJK, and astral-plane (4-byte UTF-8) code points.
    pools = [(32, 127), (0xA0, 0x100), (0x4E00, 0x4F00), (0x1F600, 0x1F650)]
    chars = []
    for _ in range(n):
        lo, hi = pools[rng.integers(len(pools))]
        chars.append(chr(int(rng.integers(lo, hi))))
    return "".join(chars)


def test_byte_round_trip_non_ascii():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    rng = np.random.default_rng()
    for _ in range(20):
        text = _random_text(rng, int(rng.integers(1, 200)))
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert len(ids) == len(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert list(tok.encode_array(text)) == ids
    assert tok.encode("é") == [0xC3, 0xA9]


def test_byte_specials_and_decode_rules():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)
    ids = [tok.bos_id] + tok.encode("naïve ☃") + [tok.eos_id, tok.pad_id, tok.pad_id]
    assert tok.decode(ids) == "naïve ☃"
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == "naïve ☃"
    # A multi-byte character cut in half decodes to U+FFFD instead of raising.
    assert tok.decode(tok.encode("☃")[:2]) == "\ufffd"
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 259\)"):
        tok.decode([65, 259])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])


def test_load_tokenizer_byte_and_missing_file(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match="neither 'byte' nor an existing file"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_hf_tokenizer_without_package_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import -> ImportError
    with pytest.raises(ValueError, match="`tokenizers` package is not installed"):
        load_tokenizer(str(path))


def test_tiktoken_file_parsing_and_missing_package(tmp_path, monkeypatch):
    import base64

    rng = np.random.default_rng()
    tokens = {bytes([b]): r for r, b in enumerate(rng.permutation(256).tolist())}
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in tokens.items()]
    path = tmp_path / "tiny.tiktoken"
    path.write_text("\n".join(lines) + "\n")
    assert read_tiktoken_ranks(str(path)) == tokens
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ValueError, match="`tiktoken` package is not installed"):
        load_tokenizer(str(path))
    bad = tmp_path / "bad.tiktoken"
    bad.write_text(lines[0] + "\nnot-base64!! 7\n")
    with pytest.raises(ValueError, match="line 2: expected '<base64 token> <rank>'"):
        read_tiktoken_ranks(str(bad))
    other = tmp_path / "vocab.txt"
    other.write_text("hello world\n")
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        load_tokenizer(str(other))


def test_tiktoken_round_trip_when_installed(tmp_path):
    pytest.importorskip("tiktoken")
    import base64
    import pickle

    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b"de", b"def", b" r", b"re"):
        ranks[merge] = len(ranks)
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    tok = load_tokenizer(str(path))
    assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.vocab_size) == (260, 261, 262, 263)
    assert tok.encode("def re")[:2] == [257, 258]
    text = _random_text(np.random.default_rng(), 50)
    assert tok.decode([tok.bos_id] + tok.encode(text) + [tok.eos_id]) == text
    assert pickle.loads(pickle.dumps(tok)).encode(text) == tok.encode(text)


def test_hf_tokenizer_round_trip_when_installed(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    import pickle

    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(["def return import class " * 20], trainer)
    path = str(tmp_path / "tokenizer.json")
    hf.save(path)
    tok = load_tokenizer(path)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = _random_text(np.random.default_rng(), 50)
    assert tok.decode([tok.bos_id] + tok.encode(text) + [tok.eos_id]) == text
    assert pickle.loads(pickle.dumps(tok)).encode(text) == tok.encode(text)
    # A file saved with the truncation and padding of a model (BERT-style files truncate at 512)
    # neither cuts nor pads a document; a special token's text inside one stays text.
    hf.enable_truncation(max_length=8)
    hf.enable_padding(length=12, pad_id=0, pad_token="<pad>")
    hf.save(path)
    tok = load_tokenizer(path)
    long_text = "def return import class " * 5
    ids = tok.encode(long_text)
    assert len(ids) > 12 and tok.pad_id not in ids and tok.decode(ids) == long_text
    inner = tok.encode("ab</s>cd")
    assert tok.eos_id not in inner and tok.decode(inner) == "ab</s>cd"
