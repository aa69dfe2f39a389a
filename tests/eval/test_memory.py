"""The memory-bank CLI (python -m aiinfra_jax.eval.memory) end to end on a 2-step MSA run: build
from a .jsonl collection, query, refuse a document over the limit, and the NIAH-over-bank mode at
two tiny sizes (the second reached by an append)."""

from __future__ import annotations

import json

from helpers import tiny

from aiinfra_jax.eval import memory
from aiinfra_jax.load import load_model


def test_memory_cli_build_query_niah(tmp_path, capsys):
    from aiinfra_jax.train import train

    train(tiny(tmp_path, "model.mixers=msa", "model.msa.chunk=8", "model.msa.top_k=2",
               "run.steps=2", "run.name=msa"))
    run = str(tmp_path / "msa")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": f"doc{j}", "text": text}) + "\n" for j, text in
                            enumerate(["The cat sat on the mat.", "golden-harbor is 1234567.",
                                       "Rain falls in the plain."])))
    bank = str(tmp_path / "bank")
    assert memory.main(["build", "--checkpoint", run, "--docs", str(docs), "--out", bank]) == 0
    assert "3 documents" in capsys.readouterr().out
    assert memory.main(["query", "--checkpoint", run, "--bank", bank, "--prompt",
                        "golden-harbor is ", "--max-new-tokens", "3"]) == 0
    said = capsys.readouterr()
    assert "layer 1 read documents: ['doc" in said.err
    # keys and values left in the bank's files: the same answer from the same documents
    assert memory.main(["query", "--checkpoint", run, "--bank", bank, "--prompt",
                        "golden-harbor is ", "--max-new-tokens", "3", "--kv-on-host"]) == 0
    hosted = capsys.readouterr()

    def read(err):
        return [line for line in err.splitlines() if "read documents" in line]

    assert hosted.out == said.out and read(hosted.err) == read(said.err) != []
    assert memory.main(["build", "--checkpoint", run, "--docs", str(docs), "--out",
                        str(tmp_path / "b2"), "--max-doc-length", "8"]) == 2
    assert "max_doc_length=8" in capsys.readouterr().err
    assert memory.main(["build", "--checkpoint", run, "--docs", str(docs), "--out", bank]) == 2
    assert "already holds a memory bank" in capsys.readouterr().err

    out = tmp_path / "niah"
    assert memory.main(["niah", "--checkpoint", run, "--sizes", "1k,2k", "--queries", "4",
                        "--batch", "4", "--out-dir", str(out), "--seed", "3"]) == 0
    assert "| 2k |" in capsys.readouterr().out
    result = json.loads((out / "memory_niah.json").read_text())
    assert result["seed"] == 3
    # --seed draws another collection; a training seed (2**40 and up) is refused by name
    loaded = load_model(run)
    one, other = (memory.niah_collection(loaded, [1024], 4, seed=s) for s in (3, 4))
    assert one["needles"] != other["needles"]
    assert [d.tolist() for d in memory.niah_collection(loaded, [1024], 4, seed=3)["docs"]] == [
        d.tolist() for d in one["docs"]]
    assert memory.main(["niah", "--checkpoint", run, "--out-dir", str(out),
                        "--seed", str(2 ** 40)]) == 2
    assert "training data" in capsys.readouterr().err
    small, large = result["rows"]
    assert small["tokens"] >= 1024 and large["tokens"] >= 2048
    assert large["documents"] > small["documents"]
    for row in result["rows"]:
        assert 0 <= row["exact_match"] <= 1 and set(row["recall_topk"]) == {"1"}
        assert row["prefill_s"] > 0 and row["decode_s_per_token"] > 0
        assert 0 <= row["answer_token_acc"] <= 1 and row["answer_nll"] > 0
        # One routing layer: "in memory" is its top-k; the in-memory scores cover those queries.
        assert row["needle_in_memory"] == row["recall_topk"]["1"]
        assert (row["exact_match_in_memory"] is None) == (row["needle_in_memory"] == 0)
        assert set(row["near_misses"]) == {"bank", "bank_same_length", "1"}
        # per query: the answer, the choices and each answer token's teacher-forced hit, which
        # the aggregate columns are made of
        queries = row["per_query"]
        assert len(queries) == 4
        ranked = [q for q in queries if all(c[0] == q["doc"] for c in q["choices"].values())]
        assert row["needle_first_everywhere"] == len(ranked) / len(queries)
        assert row["exact_match_first_everywhere"] == (
            sum(q["exact"] for q in ranked) / len(ranked) if ranked else None)
        assert row["exact_match"] == sum(q["exact"] for q in queries) / 4
        assert row["needle_in_memory"] == sum(q["in_memory"] for q in queries) / 4
        for q in queries:
            assert q["exact"] == (q["answer"] == q["value"])
            assert q["in_memory"] == (q["doc"] in q["choices"]["1"])
            assert len(q["forced_hits"]) == len(q["value"]) + 1  # byte digits and EOS
        hits = [q["forced_hits"] for q in queries]
        assert abs(row["answer_token_acc"] - sum(map(sum, hits)) / sum(map(len, hits))) < 1e-12
        by_pos = row["token_acc_by_position"]
        assert by_pos == [sum(h[i] for h in hits) / 4 for i in range(len(hits[0]))]


def test_near_misses_count_wrong_choices_that_share_a_key_word_or_its_length():
    doc_keys = ["bold-river", "bold-stone", None, "calm-river", "dark-sky"]
    needles = [(0, "bold-river", "1"), (4, "dark-sky", "2"), (3, "calm-river", "3")]
    # query 0: first choice 1 shares "bold", same length; query 1: right; query 2: 4 shares
    # nothing and is shorter
    choices = {2: [[1, 0], [4, -1], [4, 3]], 3: [[-1, -1], [3, 0], [0, 1]]}
    out = memory.near_misses(choices, needles, doc_keys, len(doc_keys))
    assert out["2"] == {"word_miss": 1 / 3, "of_wrong": 1 / 2, "length_miss": 1 / 3,
                        "length_of_wrong": 1 / 2}
    # layer 3: query 0 chose nothing; query 1's 3 ("calm-river") shares nothing with "dark-sky"
    # and is longer; query 2's 0 ("bold-river") shares "river" and its length
    assert out["3"] == {"word_miss": 1 / 3, "of_wrong": 1 / 2, "length_miss": 1 / 3,
                        "length_of_wrong": 1 / 2}
    # bank share: "bold-river" has 2 such documents of 5, "dark-sky" 0, "calm-river" 1; of the
    # same length (10 characters): 2, 0 and 2
    assert abs(out["bank"] - (2 / 5 + 0 + 1 / 5) / 3) < 1e-12
    assert abs(out["bank_same_length"] - (2 / 5 + 0 + 2 / 5) / 3) < 1e-12
