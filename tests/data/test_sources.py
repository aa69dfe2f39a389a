"""Document sources: the embedded corpus, local text/JSONL/Parquet, the registry, and bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from aiinfra_jax.data import sources as S
from aiinfra_jax.data.config import DataConfig


def _words(rng, n):
    alphabet = list("abcdefghij klmnopqrstuvwxyzé☃\n")
    return "".join(rng.choice(alphabet, size=n))


def test_embedded_corpus_lists_stdlib_and_topics():
    src = S.open_source("embedded", DataConfig())
    assert len(src) > 500
    ids = [src.doc_id(i) for i in range(len(src))]
    assert len(set(ids)) == len(ids)
    assert "os.py" in ids and "json/__init__.py" in ids
    assert not any("site-packages" in i or "__pycache__" in i for i in ids)
    assert "pydoc_data/topics.py" not in ids
    topic_ids = [i for i in ids if i.startswith("pydoc_data.topics/")]
    assert topic_ids, "pydoc topics missing"
    rng = np.random.default_rng()
    for i in rng.choice(len(src), size=5, replace=False):
        assert isinstance(src[int(i)], str)
    assert "import" in src[ids.index("os.py")]
    assert src[ids.index(topic_ids[0])].strip()


def test_embedded_split_deterministic_and_disjoint():
    src = S.open_source("embedded", DataConfig())
    train = S.split_indices(src, "train", 0.05)
    val = S.split_indices(src, "validation", 0.05)
    assert set(train.tolist()).isdisjoint(val.tolist())
    assert len(train) + len(val) == len(src)
    assert 0.02 < len(val) / len(src) < 0.10
    again = S.open_source("embedded", DataConfig())
    np.testing.assert_array_equal(S.split_indices(again, "validation", 0.05), val)
    # A larger fraction only moves documents from train to validation.
    assert set(val.tolist()) <= set(S.split_indices(src, "validation", 0.2).tolist())
    with pytest.raises(ValueError, match="split='test' is not one of"):
        S.split_indices(src, "test", 0.05)


def test_split_is_a_stable_hash():
    # CRC32, not Python's salted hash(): the same in every process.
    code = "from aiinfra_jax.data.sources import split_fraction; print(split_fraction('os.py'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) == S.split_fraction("os.py")


def test_local_text_jsonl_parquet(tmp_path, caplog):
    rng = np.random.default_rng()
    texts = [_words(rng, int(rng.integers(1, 80))) for _ in range(6)]
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(texts[0], encoding="utf-8")
    (folder / "sub" / "b.md").write_text(texts[1], encoding="utf-8")
    (folder / "ignored.bin").write_bytes(b"\x00\x01")
    with open(folder / "c.jsonl", "w", encoding="utf-8") as f:
        for t in texts[2:4]:
            f.write(json.dumps({"body": t, "other": 1}) + "\n")
        f.write("\n")  # blank lines are skipped
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": texts[4:6], "n": [1, 2]}), folder / "d.parquet")

    with caplog.at_level("WARNING"):
        src = S.open_source(str(folder), DataConfig(text_field="body"))
    assert "1 files are not read" in caplog.text and "ignored.bin" in caplog.text
    assert len(src) == 6
    got = {src.doc_id(i): src[i] for i in range(len(src))}
    assert got == {
        "a.txt": texts[0],
        "c.jsonl:1": texts[2],
        "c.jsonl:2": texts[3],
        "d.parquet:0": texts[4],
        "d.parquet:1": texts[5],
        "sub/b.md": texts[1],
    }
    # A symlinked subfolder is read (a link back up is not followed twice).
    linked = tmp_path / "elsewhere"
    linked.mkdir()
    (linked / "w.txt").write_text(texts[0], encoding="utf-8")
    (folder / "wiki").symlink_to(linked, target_is_directory=True)
    (folder / "sub" / "up").symlink_to(folder, target_is_directory=True)
    assert S.open_source(str(folder), DataConfig(text_field="body")).doc_id(6) == "wiki/w.txt"
    # A compressed file is named, in a folder or alone.
    (folder / "e.jsonl.gz").write_bytes(b"\x1f\x8b")
    for path in (folder, folder / "e.jsonl.gz"):
        with pytest.raises(ValueError, match=r"e.jsonl.gz' is compressed; decompress it"):
            S.open_source(str(path), DataConfig(text_field="body"))
    # A single file named explicitly is read whatever its suffix.
    single = tmp_path / "notes.log"
    single.write_text(texts[0], encoding="utf-8")
    one = S.open_source(str(single), DataConfig())
    assert len(one) == 1 and one[0] == texts[0] and one.doc_id(0) == "notes.log"


def test_bad_inputs_are_clear_errors(tmp_path):
    cfg = DataConfig()
    with pytest.raises(ValueError, match=r"data source '.*missing': no such file or folder"):
        S.open_source(str(tmp_path / "missing"), cfg)
    with pytest.raises(ValueError, match=r"scheme 'nosuchscheme' is not registered"):
        S.open_source("nosuchscheme:nope", cfg)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match=r"no matching files \(0 other files\)"):
        S.open_source(str(empty_dir), cfg)
    odd_dir = tmp_path / "odd"
    odd_dir.mkdir()
    (odd_dir / "x.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"no matching files \(1 other files\)"):
        S.open_source(str(odd_dir), cfg)
    empty_file = tmp_path / "empty.txt"
    empty_file.write_text("")
    with pytest.raises(ValueError, match=r"empty.txt' is empty"):
        S.open_source(str(empty_file), cfg)
    blank_jsonl = tmp_path / "blank.jsonl"
    blank_jsonl.write_text("\n\n")
    with pytest.raises(ValueError, match=r"blank.jsonl' is empty \(no JSON lines\)"):
        S.open_source(str(blank_jsonl), cfg)
    bad_field = tmp_path / "field.jsonl"
    bad_field.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"field.jsonl, line 2: no field 'text' \(record has \['body'\]\)"):
        S.open_source(str(bad_field), cfg)
    not_str = tmp_path / "num.jsonl"
    not_str.write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"line 1: field 'text' is a int, expected a string"):
        S.open_source(str(not_str), cfg)
    bad_json = tmp_path / "broken.jsonl"
    bad_json.write_text('{"text": "a"\n')
    with pytest.raises(ValueError, match=r"broken.jsonl, line 1: not valid JSON"):
        S.open_source(str(bad_json), cfg)
    undecodable = tmp_path / "latin1.txt"
    undecodable.write_bytes("caf".encode() + b"\xe9 au lait")
    with pytest.raises(ValueError, match=r"latin1.txt: invalid UTF-8 at byte offset 3"):
        S.open_source(str(undecodable), cfg)
    undecodable_jsonl = tmp_path / "latin1.jsonl"
    undecodable_jsonl.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl: invalid UTF-8 at byte offset 28 \(line 2\)"):
        S.open_source(str(undecodable_jsonl), cfg)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: \['body'\]\)"):
        S.open_source(str(tmp_path / "t.parquet"), cfg)
    # A split that ends up empty is an error, never a silent empty dataset.
    one = tmp_path / "one.txt"
    one.write_text("only document")
    src = S.open_source(str(one), cfg)
    with pytest.raises(ValueError, match=r"the 'validation' split is empty \(1 documents, val_fraction=0.0\)"):
        S.split_indices(src, "validation", 0.0)


def test_registry_longest_prefix_wins():
    calls = []

    class Tiny:
        name = "tiny"

        def __len__(self):
            return 1

        def __getitem__(self, i):
            return "x"

        def doc_id(self, i):
            return "x"

    @S.register_source("unit-test-src")
    def _a(spec, cfg):
        calls.append(("a", spec))
        return Tiny()

    @S.register_source("unit-test-src:deep")
    def _b(spec, cfg):
        calls.append(("b", spec))
        return Tiny()

    try:
        assert isinstance(S.open_source("unit-test-src:x", DataConfig()), S.DocumentSource)
        S.open_source("unit-test-src:deep:1", DataConfig())
        assert calls == [("a", "unit-test-src:x"), ("b", "unit-test-src:deep:1")]
        with pytest.raises(ValueError, match="already registered"):
            S.register_source("unit-test-src")(lambda spec, cfg: Tiny())
    finally:
        S._REGISTRY.pop("unit-test-src", None)
        S._REGISTRY.pop("unit-test-src:deep", None)


def test_data_package_does_not_import_datasets():
    code = "import sys, aiinfra_jax.data; print('datasets' in sys.modules, 'pyarrow' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.stdout.split() == ["False", "False"]
