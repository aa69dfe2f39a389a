"""The long-context runner: a tiny random model end to end, stub answerers, early refusals, and
the in-loop training hook."""

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from aiinfra_jax.data import ByteTokenizer
from aiinfra_jax.eval import longctx as lc
from aiinfra_jax.models import ModelConfig, Transformer
from aiinfra_jax.tasks import NIAH_TASKS, TASKS
from aiinfra_jax.tasks.haystack import encode

TOK = ByteTokenizer()


def _tiny_model(max_seq_len=512, seed=None, vocab_size=384):
    seed = int(np.random.default_rng().integers(1 << 30)) if seed is None else seed
    cfg = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                      max_seq_len=max_seq_len)
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def test_tiny_model_end_to_end_writes_all_outputs(tmp_path):
    cfg = lc.LongCtxConfig(tasks=("niah_single_1", "variable_tracking"), lengths=(320, 400),
                           depths=(0.0, 1.0), samples=2, batch_size=3)
    answerer = lc.ModelAnswerer(_tiny_model(), TOK, warmup=True)
    res = lc.run_longctx(answerer, TOK, cfg, out_dir=tmp_path, progress=True,
                         meta={"what": "test"})
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 2 * 2
    rec = json.loads(lines[0])
    for key in ("task", "length", "depth", "sample", "answers", "prediction", "exact", "all",
                "score", "generated_tokens"):
        assert key in rec
    assert {json.loads(x)["length"] for x in lines} == {320, 400}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["accuracy"]) == {"niah_single_1", "variable_tracking"}
    assert set(saved["accuracy"]["niah_single_1"]) == {"320", "400", "mean"}
    assert saved["niah_average"] is not None and saved["meta"] == {"what": "test"}
    t = res["timing"]
    # Batches mix the tasks of one length: 8 prompts per length -> 3 batches of 3 (the last
    # padded), one compiled shape per length (the answers are padded to the length's decode
    # budget); the first batch of each shape is timed apart, the other two enter the rates.
    assert t["warmup_calls"] == 2 and t["warmup_s"] > 0
    assert t["prefill_tokens"] == 2 * 3 * 320 + 2 * 3 * 400
    assert t["prefill_tokens_per_s"] > 0
    # A random model whose first greedy token is EOS for every prompt decodes nothing further.
    eos_first = all(json.loads(x)["generated_tokens"] == 1 for x in lines)
    assert eos_first or (t["decode_tokens"] > 0 and t["decode_tokens_per_s"] > 0)
    md = (tmp_path / "results.md").read_text()
    assert "| niah_single_1 |" in md and "NIAH average" in md and "tokens/s" in md
    assert "the first batch of each of 2 compiled shapes" in md
    # When every batch is the first of its shape there is no rate to print: it says so.
    untimed = dict(res, timing=dict(t, prefill_s=0.0, prefill_tokens_per_s=None))
    assert "No rates: every batch was the first of its compiled shape (2 shapes" in (
        lc.markdown_table(untimed))
    for task in cfg.tasks + ("niah_average",):
        png = (tmp_path / f"heatmap_{task}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    # The NIAH-average heatmap averages the NIAH variants only (here the one NIAH task).
    assert saved["niah_average_by_depth"] == saved["by_depth"]["niah_single_1"]
    # Every prediction decodes what the model produced (at most the answer budget).
    budget = lc.answer_budgets(lc.build_examples(TOK, cfg), cfg)
    assert all(json.loads(x)["generated_tokens"] <= budget[json.loads(x)["length"]] for x in lines)


def test_model_answerer_matches_generate():
    from aiinfra_jax.generate import generate

    model = _tiny_model(vocab_size=TOK.vocab_size)  # no padded ids: both argmaxes agree
    cfg = lc.LongCtxConfig(tasks=("passkey",), lengths=(260,), depths=(0.3,), samples=2)
    exs = lc.build_examples(TOK, cfg)
    ours = lc.ModelAnswerer(model, TOK)(exs, 6)
    ref = generate(model, [e.prompt_tokens.tolist() for e in exs], max_new_tokens=6,
                   eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    assert ours == ref.as_lists()


@pytest.mark.parametrize("mixer", ["dense", "nsa"])
def test_planned_shared_cache_gives_the_same_answers(mixer):
    """plan() gives calls whose caches need within 2x of each other one cache size (the largest),
    so they share compiled programs; the empty slots are masked, so the generated tokens and the
    teacher-forced scores equal those of a cache sized to each call."""
    from aiinfra_jax.models import NSAConfig

    nsa = NSAConfig(cmp_block_len=8, cmp_stride=4, sel_block_size=16, n_selected=3, window=32,
                    implementation="xla")
    cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                      d_ff=64, max_seq_len=1200, mixers=(mixer,), nsa=nsa)
    model = Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
    grid = lc.LongCtxConfig(tasks=("passkey", "niah_single_1"), lengths=(250, 500, 1000),
                            depths=(0.3,), samples=1, batch_size=2)
    exs = lc.build_examples(TOK, grid)
    budgets = lc.answer_budgets(exs, grid)
    calls = [([e for e in exs if e.length == n], budgets[n]) for n in grid.lengths]
    shared = lc.ModelAnswerer(model, TOK)
    sizes = shared.plan(calls)
    # Prompt widths 256 and 512 (+ room) share the larger cache; 1024 + room is more than twice
    # 256 + room, so it keeps its own.
    small, mid, large = sorted(sizes)
    assert sizes == {small: mid, mid: mid, large: large} and mid <= 2 * small < large
    own = lc.ModelAnswerer(model, TOK)
    assert own.plan(calls, share=1.0) == {n: n for n in sizes}
    with pytest.raises(ValueError, match="share=0.5 must be >= 1"):
        own.plan(calls, share=0.5)
    for examples, max_new in calls[:2]:  # the two that share (the third would only cost time)
        assert shared(examples, max_new) == own(examples, max_new)
        np.testing.assert_allclose(shared.teacher_forced(examples), own.teacher_forced(examples),
                                   rtol=1e-5, atol=1e-6)
    if mixer == "dense":  # the runner plans before its first call
        seen = []
        shared._prefill = lambda tokens, lengths, room, f=shared._prefill: (
            seen.append(shared._cache_len[tokens.shape[1] + room]) or f(tokens, lengths, room))
        lc.run_longctx(shared, TOK, dataclasses.replace(grid, lengths=(250, 500)), progress=False)
        assert seen and set(seen) == {mid}


def test_teacher_forced_scores_match_the_full_forward():
    """answer_nll / answer_token_acc equal what the model's own full forward gives, for a batch of
    prompts and answers of different lengths (right-padded in one call)."""
    import jax

    model = _tiny_model(vocab_size=TOK.vocab_size)
    cfg = lc.LongCtxConfig(tasks=("passkey", "niah_single_3", "niah_multivalue"), lengths=(450,),
                           depths=(0.2, 0.9), samples=1)
    exs = lc.build_examples(TOK, cfg)
    got = lc.ModelAnswerer(model, TOK).teacher_forced(exs)
    for ex, (nll, acc) in zip(exs, got):
        seq = np.concatenate([ex.prompt_tokens, ex.target_tokens, [TOK.eos_id]])
        logits, _, _ = model(seq[None, :-1], positions=np.arange(seq.size - 1)[None])
        logits = np.asarray(logits[0, ex.prompt_tokens.size - 1:], np.float64)
        target = seq[ex.prompt_tokens.size:]
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        want_nll = -logp[np.arange(target.size), target].mean()
        want_acc = (logits.argmax(-1) == target).mean()
        assert nll == pytest.approx(want_nll, rel=1e-4, abs=1e-5), ex.task
        assert acc == pytest.approx(want_acc), ex.task
    res = lc.run_longctx(lc.ModelAnswerer(model, TOK), TOK, cfg, progress=False)
    assert res["answer_nll"]["passkey"]["450"] == pytest.approx(got[0][0] / 2 + got[1][0] / 2)
    assert "Teacher-forced" in lc.markdown_table(res)
    off = lc.run_longctx(lc.ModelAnswerer(model, TOK),
                         TOK, lc.LongCtxConfig(**{**cfg.__dict__, "teacher_forced": False}),
                         progress=False)
    assert "answer_nll" not in off and "Teacher-forced" not in lc.markdown_table(off)


class CopyAnswerer:
    """A stub that finds each expected answer's tokens in the prompt and copies them from there
    (raising if one is missing), joined like the target, then EOS: it must score 100%."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, examples, max_new_tokens):
        out = []
        sep = encode(self.tokenizer, ", ").tolist()
        for ex in examples:
            prompt = ex.prompt_tokens.tolist()
            row = []
            for i, ans in enumerate(ex.answers):
                want = encode(self.tokenizer, ans).tolist()
                at = next((j for j in range(len(prompt) - len(want) + 1)
                           if prompt[j:j + len(want)] == want), None)
                if at is None:
                    raise AssertionError(f"{ex.task}: answer {ans!r} is not in the prompt")
                row += (sep if i else []) + prompt[at:at + len(want)]
            out.append((row + [self.tokenizer.eos_id])[:max_new_tokens])
        return out


class RandomAnswerer:
    """A stub that answers with random tokens drawn from the prompt's own token ids."""

    def __init__(self, tokenizer, seed=0):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)

    def __call__(self, examples, max_new_tokens):
        out = []
        for ex in examples:
            n = ex.target_tokens.size
            row = self.rng.choice(ex.prompt_tokens[1:], size=n).tolist()
            out.append((row + [self.tokenizer.eos_id])[:max_new_tokens])
        return out


def test_copy_stub_scores_100_and_random_stub_near_0():
    cfg = lc.LongCtxConfig(tasks=tuple(TASKS), lengths=(600, 900), depths=(0.0, 0.5, 1.0),
                           samples=1, batch_size=4, seed=int(np.random.default_rng().integers(99)))
    good = lc.run_longctx(CopyAnswerer(TOK), TOK, cfg, progress=False)
    bad = lc.run_longctx(RandomAnswerer(TOK, seed=1), TOK, cfg, progress=False)
    for task in TASKS:
        assert good["accuracy"][task]["mean"] == 1.0, task
        assert bad["accuracy"][task]["mean"] <= 0.1, task
    assert good["niah_average"]["mean"] == 1.0
    assert bad["niah_average"]["mean"] <= 0.05
    assert good["niah_tasks"] == list(NIAH_TASKS)


class _Counting:
    def __init__(self, max_seq_len):
        self.max_seq_len, self.calls = max_seq_len, 0

    def __call__(self, examples, max_new_tokens):
        self.calls += 1
        return [[TOK.eos_id] for _ in examples]


def test_too_long_is_refused_before_any_work():
    stub = _Counting(max_seq_len=420)
    cfg = lc.LongCtxConfig(tasks=("niah_single_1",), lengths=(300, 420), depths=(0.5,))
    with pytest.raises(ValueError, match="max_seq_len=420"):
        lc.run_longctx(stub, TOK, cfg, progress=False)
    assert stub.calls == 0
    # The answer budget counts too: 400 + answer > 405.
    stub = _Counting(max_seq_len=405)
    cfg = lc.LongCtxConfig(tasks=("niah_single_1",), lengths=(400,), depths=(0.5,))
    with pytest.raises(ValueError, match="answer tokens"):
        lc.run_longctx(stub, TOK, cfg, progress=False)
    assert stub.calls == 0
    with pytest.raises(ValueError, match="max_seq_len"):
        lc.ModelAnswerer(_tiny_model(max_seq_len=256, seed=0), TOK)(
            lc.build_examples(TOK, lc.LongCtxConfig(tasks=("passkey",), lengths=(250,),
                                                    depths=(0.5,))), 8)


def test_cli_refuses_long_lengths_before_loading(tmp_path, capsys):
    from aiinfra_jax.config import Config, save_config

    save_config(Config(model=ModelConfig(max_seq_len=600)), tmp_path / "config.json")
    rc = lc.main(["--checkpoint", str(tmp_path), "--tasks", "niah_single_1", "--lengths", "1k",
                  "--depths", "3", "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "max_seq_len=600" in err and "no checkpoint" not in err
    # --branches-off names NSA branches: refused for a dense model before loading too.
    rc = lc.main(["--checkpoint", str(tmp_path), "--tasks", "niah_single_1", "--lengths", "256",
                  "--depths", "3", "--no-progress", "--branches-off", "cmp"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "--branches-off needs a model with NSA layers" in err and "'dense'" in err
    assert "no checkpoint" not in err
    # and an unknown branch of an NSA model, also before loading
    save_config(Config(model=ModelConfig(max_seq_len=600, mixers=("nsa",))),
                tmp_path / "config.json")
    rc = lc.main(["--checkpoint", str(tmp_path), "--tasks", "niah_single_1", "--lengths", "256",
                  "--depths", "3", "--no-progress", "--branches-off", "window"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "branches ['window']: name one or more of cmp, slc, win" in err
    assert "no checkpoint" not in err


def test_longctx_scores_hook():
    grid = lc.small_grid(lengths=(256,), tasks=("niah_single_1", "passkey"), depths=(0.5,))
    scores = lc.longctx_scores(_tiny_model(), TOK, grid)
    nll_keys = {"longctx/niah_single_1@256/answer_nll", "longctx/passkey@256/answer_nll"}
    assert set(scores) == {"longctx/niah_single_1@256", "longctx/passkey@256",
                           "longctx/niah_avg@256", "longctx/niah_avg"} | nll_keys
    assert all(0.0 <= v <= 1.0 for k, v in scores.items() if k not in nll_keys)
    assert all(0.0 < scores[k] < 20.0 for k in nll_keys)


def test_config_and_parsing():
    assert lc.parse_length("4k") == 4096 and lc.parse_length("1536") == 1536
    assert lc.parse_depths("3") == (0.0, 0.5, 1.0) and lc.parse_depths("0,25") == (0.0, 0.25)
    cfg = lc.LongCtxConfig(tasks=("niah",), lengths=("2k", "1k"))
    assert cfg.tasks == NIAH_TASKS and cfg.lengths == (1024, 2048)
    with pytest.raises(ValueError, match="LongCtxConfig.lengths"):
        lc.LongCtxConfig(lengths=("1q",))
    with pytest.raises(ValueError, match="LongCtxConfig.depths"):
        lc.LongCtxConfig(depths=(0.5, 1.5))
    with pytest.raises(ValueError, match="LongCtxConfig.tasks"):
        lc.LongCtxConfig(tasks=("nope",))
    with pytest.raises(ValueError, match="LongCtxConfig.samples"):
        lc.LongCtxConfig(samples=0)


def test_task_options_reach_the_generator_and_bad_ones_are_refused_by_name(tmp_path, capsys):
    n = int(np.random.default_rng().integers(3, 12))
    cfg = lc.LongCtxConfig(tasks=("copy", "passkey"), lengths=(400,), depths=(0.5,),
                           task_options={"copy": {"num_chars": n}})
    copy, passkey = lc.build_examples(TOK, cfg)
    assert len(copy.answers[0]) == n
    assert passkey.answers == lc.build_examples(TOK, lc.LongCtxConfig(
        tasks=("passkey",), lengths=(400,), depths=(0.5,)))[0].answers
    assert lc._parse_task_options([f"copy:num_chars={n}", "copy:repeats=2"]) == {
        "copy": {"num_chars": n, "repeats": 2}}
    with pytest.raises(ValueError, match="not among the tasks"):
        lc.LongCtxConfig(tasks=("passkey",), task_options={"copy": {"num_chars": 4}})
    with pytest.raises(ValueError, match="task 'copy' has no option num_pairs; its options: "
                                         "num_chars, repeats"):
        lc.LongCtxConfig(tasks=("copy",), task_options={"copy": {"num_pairs": 4}})
    for bad, match in (("copy", "expected TASK:key=value"), ("copy:num_chars", "bad option"),
                       ("copy:num_pairs=3", "option 'num_pairs=3': task 'copy' has no option "
                                            "num_pairs; its options: num_chars, repeats"),
                       ("copy:num_chars=x", "is not a number")):
        with pytest.raises(ValueError, match=match):
            lc._parse_task_options([bad])
    # the CLI refuses before it looks for a checkpoint
    rc = lc.main(["--checkpoint", str(tmp_path), "--tasks", "copy", "--task-options",
                  "copy:num_pairs=3", "--no-progress"])
    assert rc == 1 and "has no option num_pairs" in capsys.readouterr().err


def test_in_loop_hook_is_registered_checks_its_grid_and_scores():
    """The training loop finds the hook through the entry point group (aiinfra_jax.hooks) when the
    config asks for it; check() refuses a grid that cannot run; a call gives the loop's log keys."""
    from types import SimpleNamespace

    from aiinfra_jax.config import ConfigError, load_config
    from aiinfra_jax.eval.longctx_hook import LongCtxHook
    from aiinfra_jax.hooks import registered_hooks

    def config(*overrides):
        return load_config(None, ["model.max_seq_len=512", "data.seq_len=256",
                                  "eval.longctx_tasks=passkey", "eval.longctx_depths=0.5",
                                  *overrides])

    assert not [h for h in registered_hooks(config()) if h.name == "longctx"]  # longctx_every=0
    (hook,) = [h for h in registered_hooks(config("eval.longctx_every=7")) if h.name == "longctx"]
    assert isinstance(hook, LongCtxHook) and hook.every == 7
    trainer = SimpleNamespace(cfg=config("eval.longctx_every=7"), tokenizer=TOK)
    with pytest.raises(RuntimeError, match="check"):
        hook(7, _tiny_model(), trainer)
    hook.check(trainer)  # lengths () = data.seq_len
    scores = hook(7, _tiny_model(), trainer)
    assert set(scores) == {"longctx/passkey@256", "longctx/passkey@256/answer_nll"}
    for bad, match in (("eval.longctx_lengths=600", "exceed model.max_seq_len=512"),
                       ("eval.longctx_lengths=64", "eval.longctx_"),
                       ("eval.longctx_tasks=nope", "eval.longctx_.*unknown task")):
        with pytest.raises(ConfigError, match=match):
            LongCtxHook(7).check(SimpleNamespace(cfg=config(bad), tokenizer=TOK))


def test_an_earlier_evaluations_folder_is_never_mixed_with_a_new_one(tmp_path):
    out = tmp_path / "step_40"
    lc.prepare_out(out, overwrite=False)  # absent: fine
    out.mkdir()
    (out / "results.json").write_text("{}")
    (out / "heatmap_passkey.png").write_bytes(b"png")
    with pytest.raises(ValueError, match="already holds files.*--overwrite"):
        lc.prepare_out(out, overwrite=False)
    lc.prepare_out(out, overwrite=True)  # an earlier evaluation's: removed whole
    assert not out.exists()
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "keep.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a longctx output folder; nothing is deleted"):
        lc.prepare_out(mine, overwrite=True)
    assert (mine / "keep.txt").read_text() == "keep me"
