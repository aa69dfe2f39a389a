"""Task generators, scoring and the synthetic training source.

Length slack: zero. Prompts are assembled in token space, so every prompt has exactly the requested
number of tokens. Depth tolerance: one haystack sentence (plus the needles placed before it).
"""

import subprocess
import sys

import numpy as np
import pytest

from aiinfra_jax.data import ByteTokenizer, DataConfig, open_source
from aiinfra_jax.data.synthetic import SyntheticSource, parse_spec
from aiinfra_jax.eval.tasks import (NIAH_TASKS, TASKS, ContextTooShort, exact_match, expand_tasks,
                                    make_task_example, score, string_match_all, string_match_part)

TOK = ByteTokenizer()
LENGTH_SLACK = 0


@pytest.mark.parametrize("task", sorted(TASKS))
def test_length_depth_and_answer_in_context(task):
    rng = np.random.default_rng()  # fresh draws; the assertion messages name the case
    for length in (int(rng.integers(480, 700)), int(rng.integers(900, 1400))):
        for depth in (0.0, float(rng.uniform()), 1.0):
            seed = int(rng.integers(0, 10_000))
            ex = make_task_example(TOK, task, length, depth, seed)
            assert abs(ex.prompt_tokens.size - length) <= LENGTH_SLACK
            assert ex.prompt_tokens[0] == TOK.bos_id and ex.length == length
            text = TOK.decode(ex.prompt_tokens)
            # Every needle really sits at its recorded offset.
            for needle, off in zip(ex.needles, ex.needle_offsets):
                got = TOK.decode(ex.prompt_tokens[off:off + len(needle.encode())])
                assert got == needle
            # The first needle is at the requested depth, within one haystack sentence.
            start, end = ex.haystack_span
            off0 = ex.needle_offsets[0]
            before = sum(len(n.encode()) + 1 for n, o in zip(ex.needles, ex.needle_offsets)
                         if o < off0)
            hay_pos = off0 - start - before
            assert abs(hay_pos - depth * ex.haystack_tokens) <= ex.max_sentence_tokens, (
                task, length, depth, hay_pos, ex.haystack_tokens)
            assert start <= off0 < end
            # The expected answers are all in the context (before the question).
            hay_text = TOK.decode(ex.prompt_tokens[start:end])
            for ans in ex.answers:
                assert ans in hay_text, (task, ans)
            assert TOK.decode(ex.target_tokens) == ", ".join(ex.answers)
            assert text.endswith(TOK.decode(ex.prompt_tokens[end:]))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_seeding(task):
    a = make_task_example(TOK, task, 800, 0.4, 11)
    b = make_task_example(TOK, task, 800, 0.4, 11)
    c = make_task_example(TOK, task, 800, 0.4, 12)
    np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens)
    assert a.answers == b.answers
    assert a.answers != c.answers
    assert not np.array_equal(a.prompt_tokens, c.prompt_tokens)
    # Same seed, other length and depth: the same keys and values (several answers are listed in
    # context order, which the depth may change).
    d = make_task_example(TOK, task, 1000, 0.9, 11)
    assert sorted(d.answers) == sorted(a.answers) and d.prompt_tokens.size == 1000


def test_niah_variants_differ_as_specified():
    single = make_task_example(TOK, "niah_single_1", 900, 0.5, 3)
    assert "The grass is green." in single.prompt_text(TOK)
    assert len(single.answers) == 1 and len(single.answers[0]) == 7 and single.metric == "exact"
    uuid = make_task_example(TOK, "niah_single_3", 900, 0.5, 3)
    assert len(uuid.answers[0]) == 36 and uuid.answers[0].count("-") == 4
    mk = make_task_example(TOK, "niah_multikey_1", 900, 0.5, 3)
    hay_text = lambda ex: TOK.decode(ex.prompt_tokens[slice(*ex.haystack_span)])  # noqa: E731
    assert hay_text(mk).count("One of the special magic numbers for") == 4
    hay = make_task_example(TOK, "niah_multikey_2", 900, 0.5, 3)
    assert hay_text(hay).count("One of the special magic numbers for") >= 8
    mv = make_task_example(TOK, "niah_multivalue", 900, 0.5, 3)
    assert len(mv.answers) == 4 and mv.metric == "all"
    mq = make_task_example(TOK, "niah_multiquery", 900, 0.5, 3)
    assert len(mq.answers) == 4 and len(set(mq.answers)) == 4


@pytest.mark.parametrize("task", NIAH_TASKS)
def test_niah_answer_prefix_restates_the_asked_key(task):
    """With one key asked, the prompt ends with the words that precede its values in its needles,
    and only in those (other keys' needles read differently), as RULER's answer prefix restates
    the query; multiquery asks four keys and ends with "Answer: "."""
    ex = make_task_example(TOK, task, 900, float(np.random.default_rng().uniform()), 7)
    text = ex.prompt_text(TOK)
    lead_in = text.rsplit("\nAnswer: ", 1)[1]
    if task == "niah_multiquery":
        assert lead_in == ""
        return
    assert lead_in.startswith("One of the special magic ") and lead_in.endswith(" is: ")
    hay = TOK.decode(ex.prompt_tokens[slice(*ex.haystack_span)])
    assert f"{lead_in}{ex.answers[0]}." in hay
    owned = [n for n in ex.needles if n.startswith(lead_in)]
    assert len(owned) == (4 if task == "niah_multivalue" else 1), (task, lead_in, ex.needles)


@pytest.mark.parametrize("task", ["niah_multivalue", "niah_multiquery"])
def test_several_answers_follow_the_context_order(task):
    """Answers (and multiquery's asked keys) come in the order their needles stand in the prompt,
    whatever the depths drawn; the first needle (at the requested depth) moves through them."""
    firsts = set()
    for seed, depth in ((0, 0.0), (1, 0.5), (2, 1.0), (3, 0.3)):
        ex = make_task_example(TOK, task, 700, depth, seed)
        text = ex.prompt_text(TOK)
        where = [text.index(f" is: {a}.") for a in ex.answers]
        assert where == sorted(where), (task, seed, ex.answers)
        firsts.add(ex.answers.index(ex.needles[0].rsplit(" ", 1)[1].rstrip(".")))
        if task == "niah_multiquery":
            keys = [ex.needles[i].split(" for ")[1].split(" is: ")[0]
                    for i in np.argsort(ex.needle_offsets)]
            assert text.rsplit("\n", 2)[1] == f"What are all the special magic numbers for " \
                f"{', '.join(keys)}?"
    assert len(firsts) > 1  # not always listed first: the order is the context's


def test_copy_task_string():
    ex = make_task_example(TOK, "copy", 400, 0.5, 5)
    (secret,) = ex.answers
    assert len(secret) == 32 and secret.isalnum() and secret.lower() == secret
    assert ex.prompt_text(TOK).count(secret) == 1 and ex.metric == "exact"
    assert len(make_task_example(TOK, "copy", 400, 0.5, 5, num_chars=8).answers[0]) == 8
    with pytest.raises(ValueError, match="num_chars"):
        make_task_example(TOK, "copy", 400, 0.5, 5, num_chars=0)


def test_bad_requests_are_refused():
    with pytest.raises(ContextTooShort, match="length=50") as info:
        make_task_example(TOK, "niah_multiquery", 50, 0.5, 0)
    assert info.value.needed > 50
    make_task_example(TOK, "niah_multiquery", info.value.needed, 0.5, 0)  # the minimum works
    with pytest.raises(ValueError, match="depth"):
        make_task_example(TOK, "passkey", 500, 1.5, 0)
    with pytest.raises(ValueError, match="unknown task"):
        make_task_example(TOK, "needle", 500, 0.5, 0)
    with pytest.raises(ValueError, match="unknown task"):
        expand_tasks("niah,bogus")
    assert expand_tasks("passkey,niah") == ("passkey",) + NIAH_TASKS


def test_scoring_hand_made_cases():
    assert exact_match("1234567", ["1234567"]) == 1.0
    assert exact_match(" 1234567.\nmore text", ["1234567"]) == 1.0
    assert exact_match("1234568", ["1234567"]) == 0.0
    assert exact_match("The number is 1234567", ["1234567"]) == 0.0
    assert string_match_all("The number is 1234567", ["1234567"]) == 1.0
    refs = ["111", "222", "333"]
    assert exact_match("333, 111, 222", refs) == 1.0  # order free
    assert exact_match("111, 222", refs) == 0.0
    assert string_match_all("111, 222", refs) == pytest.approx(2 / 3)
    assert string_match_all("999", refs) == 0.0
    assert string_match_part("x 222 y", refs) == 1.0 and string_match_part("x", refs) == 0.0
    assert string_match_all("ABC-def", ["abc-DEF"]) == 1.0
    assert score("111, 999", refs, "all") == {"exact": 0.0, "all": pytest.approx(1 / 3),
                                              "score": pytest.approx(1 / 3)}
    with pytest.raises(ValueError, match="metric"):
        score("1", ["1"], "f1")
    with pytest.raises(ValueError, match="non-empty"):
        exact_match("1", "1")


def test_synthetic_source_documents():
    cfg = DataConfig(seq_len=700, sources=("synthetic:niah",))
    src = open_source("synthetic:all:n=1000,seed=3,context_weight=0.1,answer_weight=2", cfg)
    assert isinstance(src, SyntheticSource) and len(src) == 1000
    val, train = src.split_indices("validation", 0.05), src.split_indices("train", 0.05)
    assert len(val) == 50 and len(train) == 950 and not set(val) & set(train)
    seen = set()
    for i in range(len(src.tasks)):  # document i is task i mod the number of tasks
        doc = src[i]
        toks, w = doc["tokens"], doc["loss_weights"]
        assert toks.size <= cfg.seq_len + 1 and toks[0] == TOK.bos_id and toks[-1] == TOK.eos_id
        ex = src.example(i)
        seen.add(ex.task)
        n_ans = ex.target_tokens.size + 1
        np.testing.assert_array_equal(w[-n_ans:], 2.0)
        assert TOK.decode(toks[-n_ans:]) == ex.target_text
        assert np.all((w[:-n_ans] == 0.1) | (w[:-n_ans] == 2.0))
        np.testing.assert_array_equal(src[i]["tokens"], toks)  # deterministic
    assert seen == set(src.tasks)
    other = open_source("synthetic:all:n=1000,seed=4", cfg)
    assert not np.array_equal(other[0]["tokens"], src[0]["tokens"])


def test_synthetic_spec_errors():
    assert parse_spec("synthetic:mqar")[0] == "mqar"
    with pytest.raises(ValueError, match="bad option"):
        parse_spec("synthetic:mqar:lenght")
    with pytest.raises(ValueError, match="not a number"):
        parse_spec("synthetic:mqar:num_queries=many")
    # A key that is neither a source option nor a keyword of the generator (a typo) fails at once.
    with pytest.raises(ValueError, match="does not take"):
        open_source("synthetic:mqar:lenght=3", DataConfig())
    with pytest.raises(ValueError, match="num_queries"):  # the generator's own validation
        open_source("synthetic:mqar:num_queries=40", DataConfig())
    with pytest.raises(ValueError, match="unknown task"):
        open_source("synthetic:bogus", DataConfig())
    with pytest.raises(ValueError, match="seq_len"):
        open_source("synthetic:niah_multiquery", DataConfig(seq_len=300))


def test_synthetic_source_refuses_examples_that_cannot_fit_at_construction():
    """The row must hold the longest probed prompt + answer + EOS, not only the first seed's: a
    multiquery source with a row one token short of the worst probe is refused up front (it used
    to fail at the first such document, mid-run), and one token more opens."""
    from aiinfra_jax.data.synthetic import PROBE_SEEDS

    worst, lo = 0, None
    for seed in range(PROBE_SEEDS):
        with pytest.raises(ContextTooShort) as info:
            make_task_example(TOK, "niah_multiquery", 1, 0.5, seed)
        lo = lo or info.value.needed + 8  # the source's min_length: seed 0's minimum + 8
        length = max(lo, info.value.needed)
        ex = make_task_example(TOK, "niah_multiquery", length, 0.5, seed)
        worst = max(worst, length + ex.target_tokens.size + 1)
    with pytest.raises(ValueError, match=f"needing {worst} tokens.*raise data.seq_len"):
        open_source("synthetic:niah_multiquery", DataConfig(seq_len=worst - 2))
    open_source("synthetic:niah_multiquery", DataConfig(seq_len=worst - 1))


def test_synthetic_generator_options_reach_the_generator():
    cfg = DataConfig(tokenizer="byte", seq_len=512)
    name, opts = parse_spec("synthetic:mqar:num_queries=16,context_weight=0.1")
    assert name == "mqar" and opts.task_options == (("num_queries", 16),)
    assert opts.context_weight == 0.1
    dense, plain = (open_source(s, cfg) for s in ("synthetic:mqar:num_queries=16", "synthetic:mqar"))
    i = int(np.random.default_rng().integers(len(plain)))
    # num_queries - 1 inline recalls are marked for training (the last query is the answer).
    assert len(dense.example(i).extra_weighted) == 15
    assert len(plain.example(i).extra_weighted) == 3
    assert np.sum(dense[i]["loss_weights"] > 0) > np.sum(plain[i]["loss_weights"] > 0)


def test_copy_repeats_mark_every_later_occurrence():
    from aiinfra_jax.eval.tasks.copy import copy_example

    seed = int(np.random.default_rng().integers(1 << 30))
    ex = copy_example(TOK, "copy", 420, 0.4, seed, num_chars=24, repeats=4)
    secret = ex.answers[0]
    text = TOK.decode(ex.prompt_tokens)
    assert text.count(secret) == 4 and len(ex.extra_weighted) == 3
    first = text.index(secret)
    for start, end in ex.extra_weighted:
        assert TOK.decode(ex.prompt_tokens[start:end]) == secret and start > first
    assert copy_example(TOK, "copy", 420, 0.4, seed, num_chars=24).extra_weighted == ()
    with pytest.raises(ValueError, match="repeats=0 must be an int >= 1"):
        copy_example(TOK, "copy", 420, 0.4, seed, repeats=0)


def test_synthetic_depth_range():
    cfg = DataConfig(tokenizer="byte", seq_len=512)
    src = open_source("synthetic:copy:min_depth=0.9,max_depth=1.0", cfg)
    for i in np.random.default_rng().integers(len(src), size=5):
        ex = src.example(int(i))
        assert 0.9 <= ex.depth <= 1.0
        # the needle ends within one filler sentence of the question
        needle_end = ex.needle_offsets[0] + len(TOK.encode(ex.needles[0]))
        assert ex.haystack_span[1] - needle_end <= 0.1 * ex.haystack_tokens + ex.max_sentence_tokens
    assert {src.example(i).depth for i in range(3)} != {1.0}
    assert open_source("synthetic:copy:min_depth=1", cfg).example(7).depth == 1.0
    with pytest.raises(ValueError, match="0 <= min_depth <= max_depth <= 1"):
        parse_spec("synthetic:copy:min_depth=0.8,max_depth=0.5")


def test_data_package_does_not_import_eval():
    code = ("import sys, aiinfra_jax.data; "
            "print(any(m.startswith('aiinfra_jax.eval') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_longctx_tiny_preset_sources_open():
    from pathlib import Path

    from aiinfra_jax.config import load_preset

    root = Path(__file__).resolve().parents[2]
    cfg = load_preset(root / "configs" / "longctx_tiny.py")
    synthetic = [s for s in cfg.data.sources if s.startswith("synthetic:")]
    assert synthetic and "embedded" in cfg.data.sources
    for spec in synthetic:
        src = open_source(spec, cfg.data)
        doc = src[int(np.random.default_rng().integers(len(src)))]
        assert doc["tokens"].size <= cfg.data.seq_len + 1
    # Room to evaluate at 4x the training length, answer included.
    assert cfg.model.max_seq_len >= 4 * cfg.data.seq_len + 64


def test_training_documents_are_not_evaluation_examples():
    src = open_source("synthetic:niah_single_1:n=100", DataConfig(seq_len=512))
    ex = src.example(int(src.split_indices("train", 0.05)[0]))
    evals = {make_task_example(TOK, "niah_single_1", 400, 0.5, s).answers for s in range(200)}
    assert ex.answers not in evals and ex.seed >= 2**40
