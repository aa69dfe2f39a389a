"""Task generators and scoring (aiinfra_jax.tasks).

Length slack: zero. Prompts are assembled in token space, so every prompt has exactly the requested
number of tokens. Depth tolerance: one haystack sentence (plus the needles placed before it).
"""

import numpy as np
import pytest

from aiinfra_jax.data import ByteTokenizer
from aiinfra_jax.tasks import (NIAH_TASKS, TASKS, ContextTooShort, exact_match, expand_tasks,
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
    assert "The grass is green." in TOK.decode(single.prompt_tokens)
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
    text = TOK.decode(ex.prompt_tokens)
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
        text = TOK.decode(ex.prompt_tokens)
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
    assert TOK.decode(ex.prompt_tokens).count(secret) == 1 and ex.metric == "exact"
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


def test_copy_repeats_mark_every_later_occurrence():
    from aiinfra_jax.tasks.copy import copy_example

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
