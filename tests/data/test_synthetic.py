"""The synthetic training source (aiinfra_jax.data.synthetic): task examples as pre-tokenised
training documents."""

import subprocess
import sys

import numpy as np
import pytest

from aiinfra_jax.data import ByteTokenizer, DataConfig, open_source
from aiinfra_jax.data.synthetic import SyntheticSource, parse_spec
from aiinfra_jax.tasks import ContextTooShort, make_task_example

TOK = ByteTokenizer()


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
    with pytest.raises(ValueError, match="task 'mqar' has no option lenght; its options: "):
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
