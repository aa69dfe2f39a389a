"""The training loop end to end: loss drops, checkpoints, exact resume, NaN stop, meshes, run dirs."""

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from aiinfra_jax.config import ConfigError
from helpers import cli_args, tiny
from aiinfra_jax.rundir import checkpoint_source, choose_run_dir
from aiinfra_jax.errors import EXIT_STOPPED
from aiinfra_jax.train import NonFiniteError, main, train

def losses(summary):
    return {r["step"]: r["loss"] for r in summary["history"]}


def test_end_to_end_trains_checkpoints_and_evaluates(tmp_path):
    cfg = tiny(tmp_path, "run.steps=40", "run.log_every=5", "optim.lr=1e-2",
               "checkpoint.every=20", "eval.every=20", "eval.longctx_every=20",
               "eval.longctx_tasks=passkey", "eval.longctx_lengths=300",
               "eval.longctx_depths=0.5")
    s = train(cfg, quiet=True)
    l = losses(s)
    assert l[40] < l[5] - 0.5, l  # bytes start near ln(384) = 5.95
    run = Path(s["run_dir"])
    assert (run / "config.json").exists() and (run / "eval.json").exists()
    assert json.loads((run / "config.json").read_text())["model"]["vocab_size"] == 384
    lines = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert any("val/loss" in x for x in lines)
    assert [x["step"] for x in lines if "longctx/passkey@300" in x] == [20, 40]
    assert {"loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "perplexity"} <= set(lines[0])
    assert list((run / "logs").glob("events.out.tfevents*"))
    assert np.isfinite(s["validation"]["loss"]) and s["validation"]["tokens"] > 0
    # the perplexity CLI reads the checkpoint back and gives the loop's number
    from aiinfra_jax.eval.perplexity import evaluate_checkpoint
    res = evaluate_checkpoint(run, batches=2)
    assert res["step"] == 40 and res["batches"] == 2
    assert res["loss"] == pytest.approx(s["validation"]["loss"], rel=1e-5)
    # the split (3 documents at this val_fraction) ends first: the count says so
    every = evaluate_checkpoint(run, batches=10**6, overrides=["data.val_fraction=0.002"])
    assert 2 < every["batches"] < 10**6
    with pytest.raises(ValueError, match="max_batches=-1 must be an int >= 0"):
        evaluate_checkpoint(run, batches=-1)
    # a second identical command leaves the finished run alone and starts run-2
    assert choose_run_dir(cfg) == (tmp_path / "tiny-2", False)


@pytest.mark.parametrize("streams", [1, 2])
def test_stopped_and_resumed_run_matches_uninterrupted(tmp_path, streams):
    """Also with the data read as two streams (data.streams, as multi-process runs read it; the
    checkpoint keeps every stream's position)."""
    common = ["run.steps=10", "run.log_every=1", "checkpoint.every=0", f"data.streams={streams}"]
    full = train(tiny(tmp_path / "a", *common), quiet=True)
    part = train(tiny(tmp_path / "b", *common), stop_after=4, quiet=True)
    assert not part["finished"] and part["step"] == 4
    rest = train(tiny(tmp_path / "b", *common), quiet=True)
    assert rest["start_step"] == 4 and rest["run_dir"] == part["run_dir"]
    a, b = losses(full), {**losses(part), **losses(rest)}
    assert sorted(b) == list(range(1, 11))
    for step in range(1, 11):
        assert b[step] == a[step], (step, a[step], b[step])


def test_staged_mixture_resumes_across_its_boundary(tmp_path):
    """A data curriculum (data.stages): stopped at step 3, resumed, the losses equal an
    uninterrupted run's, through the switch of mixture after batch 4."""
    doc = tmp_path / "letters.jsonl"
    doc.write_text("".join(json.dumps({"text": "abcabc" * (i + 1)}) + "\n" for i in range(200)))
    common = ["run.steps=8", "run.log_every=1", "checkpoint.every=0",
              f"data.sources=embedded,{doc}", "data.weights=1,0", "data.stages=[[4, [1, 3]]]"]
    full = train(tiny(tmp_path / "a", *common), quiet=True)
    part = train(tiny(tmp_path / "b", *common), stop_after=3, quiet=True)
    rest = train(tiny(tmp_path / "b", *common), quiet=True)
    a, b = losses(full), {**losses(part), **losses(rest)}
    assert sorted(b) == list(range(1, 9)) and all(a[k] == b[k] for k in a), (a, b)
    # A branch from step 3 with other stages (so a fresh data stream): its stages still follow
    # the steps, so steps 4-6 train on stage 1's mixture and the stream counts from 3.
    step3 = tmp_path / "b" / "tiny" / "checkpoints" / "3"
    branch = train(tiny(tmp_path / "c", *common[1:4], "run.steps=6", "data.weights=1,0",
                        "data.stages=[[5, [0, 1]]]", f"checkpoint.initialize_from={step3}"),
                   quiet=True)
    saved = json.loads((Path(branch["run_dir"]) / "checkpoints" / "6" / "data" / "metadata")
                       .read_text())["data_state"]
    assert (saved["batches"], saved["stage"]) == (6, 1), saved


def test_model_stages_switch_run_time_settings_at_their_step(tmp_path, capsys):
    """model.stages: the compute dtype turns bfloat16 after step 4. Steps 1-4 equal a float32
    run's, steps 5-8 a continuation of its step-4 checkpoint run in bfloat16 (and not the float32
    run's), and a run stopped at 6 resumes inside the stage and matches the uninterrupted one."""
    common = ["run.steps=8", "run.log_every=1", "checkpoint.every=0"]
    staged = [*common, "model.stages=[[4, {dtype: bfloat16}]]"]
    full = losses(train(tiny(tmp_path / "a", *staged)))
    assert "model stages: from step 5: dtype='bfloat16'" in capsys.readouterr().out
    plain = train(tiny(tmp_path / "b", *common), stop_after=4, quiet=True)
    step4 = Path(plain["run_dir"]) / "checkpoints" / "4"
    cont = losses(train(tiny(tmp_path / "c", *common, "model.dtype=bfloat16",
                             f"checkpoint.initialize_from={step4}"), quiet=True))
    assert all(full[k] == losses(plain)[k] for k in range(1, 5)), (full, losses(plain))
    assert all(full[k] == cont[k] for k in range(5, 9)), (full, cont)
    f32 = losses(train(tiny(tmp_path / "b", *common), quiet=True))  # plain, resumed to 8
    assert all(full[k] != f32[k] for k in range(5, 9)), (full, f32)
    part = losses(train(tiny(tmp_path / "d", *staged), stop_after=6, quiet=True))
    rest = losses(train(tiny(tmp_path / "d", *staged), quiet=True))
    assert {**part, **rest} == full, ({**part, **rest}, full)


def test_initialize_from_goes_on_from_another_runs_checkpoint(tmp_path, capsys):
    """checkpoint.initialize_from: a new run takes another run's state at its step (the data stream
    too) and goes on exactly as that run would have; a model setting that keeps the state's shapes
    may differ and is printed; the source run is left as it was; bad sources are refused."""
    common = ["run.steps=8", "run.log_every=1", "checkpoint.every=0"]
    full = train(tiny(tmp_path / "a", *common), quiet=True)
    train(tiny(tmp_path / "b", *common), stop_after=4, quiet=True)
    source = tmp_path / "b" / "tiny"
    before = sorted(p.name for p in (source / "checkpoints").iterdir())
    branch = train(tiny(tmp_path / "c", *common, f"checkpoint.initialize_from={source}"),
                   quiet=True)
    assert branch["start_step"] == 4 and branch["finished"]
    assert sorted(losses(branch)) == list(range(5, 9))
    assert all(losses(branch)[k] == losses(full)[k] for k in range(5, 9)), (losses(branch), full)
    assert sorted(p.name for p in (source / "checkpoints").iterdir()) == before
    # A step folder; a model key that keeps every shape (the init scale) may change, and is named.
    capsys.readouterr()
    train(tiny(tmp_path / "d", *common, "model.init_std=0.05",
               f"checkpoint.initialize_from={source / 'checkpoints' / '4'}"))
    assert "model.init_std: checkpoint 0.02, current 0.05" in capsys.readouterr().out
    # Another run.seed: the same state, a fresh data stream (its position cannot carry over).
    seeded = train(tiny(tmp_path / "h", *common, "run.seed=7",
                        f"checkpoint.initialize_from={source}"))
    assert seeded["finished"] and seeded["start_step"] == 4
    assert "run.seed: checkpoint 0, current 7" in capsys.readouterr().out
    with pytest.raises(Exception, match="d_model|shape"):  # shapes differ: refused
        train(tiny(tmp_path / "e", *common, "model.d_model=64",
                   f"checkpoint.initialize_from={source}"), quiet=True)
    with pytest.raises(ConfigError, match="nothing left to train"):
        train(tiny(tmp_path / "f", "run.steps=4", f"checkpoint.initialize_from={source}"),
              quiet=True)
    with pytest.raises(ConfigError, match="no such directory"):
        train(tiny(tmp_path / "g", *common, f"checkpoint.initialize_from={tmp_path / 'nope'}"),
              quiet=True)


def test_initialize_from_names_a_source_without_checkpoints(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    assert checkpoint_source(str(run)) == (run, None)
    with pytest.raises(ConfigError, match=r"initialize_from=.*no committed checkpoint in .*run"):
        train(tiny(tmp_path / "a", "run.steps=2", f"checkpoint.initialize_from={run}"), quiet=True)
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "logs"]  # nothing created
    (run / "checkpoints" / "7").mkdir(parents=True)
    assert checkpoint_source(str(run)) == (run / "checkpoints", None)
    assert checkpoint_source(str(run / "checkpoints" / "7")) == (run / "checkpoints", 7)
    numbered = tmp_path / "123"  # a run directory named by a number is a run, not a step
    (numbered / "checkpoints").mkdir(parents=True)
    assert checkpoint_source(str(numbered)) == (numbered / "checkpoints", None)


def test_sharded_run_matches_single_device(tmp_path):
    common = ["run.steps=3", "run.log_every=1", "checkpoint.every=0", "optim.grad_accum=2"]
    one = train(tiny(tmp_path / "one", *common, "mesh.num_devices=1"), quiet=True)
    eight = train(tiny(tmp_path / "eight", *common, "mesh.num_devices=8", "mesh.data=2",
                       "mesh.fsdp=2", "mesh.tensor=2"), quiet=True)
    for step, loss in losses(one).items():
        assert losses(eight)[step] == pytest.approx(loss, rel=2e-5), step


def test_non_finite_loss_stops_naming_the_step_and_keeps_checkpoint(tmp_path):
    cfg = tiny(tmp_path, "run.steps=20", "run.log_every=1", "checkpoint.every=1",
               "optim.lr=1e30", "optim.warmup_steps=0", "optim.grad_clip=0",
               "checkpoint.async_save=false")
    with pytest.raises(NonFiniteError, match=r"step \d+: the loss or the gradients are not finite"):
        train(cfg, quiet=True)
    ckpts = [p for p in (tmp_path / "tiny" / "checkpoints").iterdir() if p.name.isdigit()]
    assert ckpts, "the last good checkpoint must be kept"


def test_sigterm_saves_and_exits_with_its_own_status(tmp_path, capsys):
    metrics = tmp_path / "tiny" / "logs" / "metrics.jsonl"

    def killer():
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=killer, daemon=True).start()
    assert main(cli_args(tmp_path, "run.steps=100000", "run.log_every=1",
                         "checkpoint.every=0")) == EXIT_STOPPED
    out = capsys.readouterr().out
    step = int(re.search(r"stopped at step (\d+) \(SIGTERM\)", out).group(1))
    assert "run the same command again to resume" in out and 0 < step < 100000
    steps = [int(p.name) for p in (tmp_path / "tiny" / "checkpoints").iterdir() if p.name.isdigit()]
    assert step in steps


def test_host_keeps_at_most_two_steps_in_flight(tmp_path, monkeypatch):
    """Async dispatch must not let the host run ahead of the device (a SIGTERM would then wait for
    every queued step): when the batch of step n + 1 is taken, every step before n has finished."""
    import aiinfra_jax.train as train_mod

    outputs, checked = [], []
    real_steps, real_next = train_mod.Trainer.compiled_steps, train_mod._Prefetcher.next

    def compiled_steps(self, step=0):
        jtrain, jeval = real_steps(self, step)

        def recorded(state, batch):
            state, metrics = jtrain(state, batch)
            outputs.append(metrics)
            return state, metrics
        return recorded, jeval

    def next_batch(self):
        checked.append(all(x.is_ready() for m in outputs[:-1] for x in jax.tree.leaves(m)))
        return real_next(self)

    monkeypatch.setattr(train_mod.Trainer, "compiled_steps", compiled_steps)
    monkeypatch.setattr(train_mod._Prefetcher, "next", next_batch)
    # log_every=5: also across the log points, where the list of pending metrics starts over
    s = train(tiny(tmp_path, "run.steps=12", "run.log_every=5", "checkpoint.every=0"), quiet=True)
    assert s["finished"] and len(outputs) == 12
    assert checked == [True] * 12


def test_resume_refuses_incompatible_model(tmp_path):
    run_dir = tmp_path / "r"
    train(tiny(tmp_path, "run.steps=2", f"run.run_dir={run_dir}", "checkpoint.every=0"),
          stop_after=1, quiet=True)
    with pytest.raises(Exception, match="d_model"):
        train(tiny(tmp_path, "run.steps=2", f"run.run_dir={run_dir}", "model.d_model=64",
                   "model.n_heads=2"), quiet=True)
    # the checkpoint is still there
    assert [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]


def test_run_directory_choice(tmp_path):
    cfg = tiny(tmp_path, "run.steps=5")
    assert choose_run_dir(cfg) == (tmp_path / "tiny", False)
    (tmp_path / "tiny" / "checkpoints" / "3").mkdir(parents=True)
    assert choose_run_dir(cfg) == (tmp_path / "tiny", True)  # unfinished: resume
    (tmp_path / "tiny" / "summary.json").write_text("{}")
    assert choose_run_dir(cfg) == (tmp_path / "tiny-2", False)  # finished: a new directory
    never = tiny(tmp_path, "run.resume=never")
    (tmp_path / "tiny-2").mkdir()
    assert choose_run_dir(never) == (tmp_path / "tiny-3", False)
    with pytest.raises(ConfigError, match="require"):
        choose_run_dir(tiny(tmp_path / "empty", "run.resume=require"))


def test_longctx_grid_is_checked_before_training(tmp_path):
    with pytest.raises(ConfigError, match="eval.longctx.*231"):
        train(tiny(tmp_path, "eval.longctx_every=5", "eval.longctx_tasks=passkey",
                   "eval.longctx_lengths=128"), quiet=True)
    assert not (tmp_path / "tiny").exists()  # nothing was created
    # A length that fits the model but leaves no room for the answer (the default length is
    # data.seq_len): refused up front too, not at the hook's first call.
    with pytest.raises(ConfigError, match=r"eval.longctx_\*: .*answer tokens .* exceed "
                                          "model.max_seq_len=256"):
        train(tiny(tmp_path, "eval.longctx_every=5", "eval.longctx_tasks=passkey",
                   "data.seq_len=256", "model.max_seq_len=256"), quiet=True)
    assert not (tmp_path / "tiny").exists()


class _RecordingHook:
    """An in-loop hook that records when it was checked and called, and logs one number."""

    name = "recording"

    def __init__(self, every, run_dir):
        self.every, self.run_dir, self.calls, self.checked_before_run_dir = every, run_dir, [], None

    def check(self, trainer):
        self.checked_before_run_dir = not self.run_dir.exists()

    def __call__(self, step, model, trainer):
        from flax import nnx

        assert isinstance(model, nnx.Module)
        self.calls.append(step)
        return {"recording/step": float(step)}


def test_hooks_are_checked_first_and_called_every_n_steps(tmp_path):
    hook = _RecordingHook(3, tmp_path / "tiny")
    s = train(tiny(tmp_path, "run.steps=7", "run.log_every=7", "checkpoint.every=0"),
              hooks=[hook], quiet=True)
    assert s["finished"] and hook.checked_before_run_dir and hook.calls == [3, 6]
    lines = [json.loads(x) for x in (tmp_path / "tiny" / "logs" / "metrics.jsonl").read_text()
             .splitlines()]
    assert [x["step"] for x in lines if "recording/step" in x] == [3, 6]


def test_a_setting_without_its_hook_is_refused(tmp_path):
    """eval.longctx_every needs the long-context hook: a run given other hooks fails up front."""
    with pytest.raises(ConfigError, match="eval.longctx_every=5 needs the 'longctx' training hook"):
        train(tiny(tmp_path, "eval.longctx_every=5"), hooks=[], quiet=True)
    assert not (tmp_path / "tiny").exists()  # nothing was created


def test_weight_decay_reaches_matrices_only():
    """Every family's biases, decay log-rates and norm scales are left out of weight decay (as
    fla's _no_weight_decay and the config's "matrices only"); every projection is decayed."""
    from flax import nnx

    from aiinfra_jax import steps
    from aiinfra_jax.models import ModelConfig, Transformer

    seen = {}
    for mixers, ffns in ((("dense", "nsa", "gdn", "kda"), ("swiglu",)), (("msa",), ("moe",)),
                         (("dense",), ("deamoe",))):
        cfg = ModelConfig(d_model=64, n_layers=len(mixers), n_heads=2, n_kv_heads=1,
                          mixers=mixers, ffns=ffns, vocab_size=128, max_seq_len=256)
        abstract = nnx.eval_shape(lambda cfg=cfg: Transformer(cfg, rngs=nnx.Rngs(0)))
        mask = steps.weight_decay_mask(nnx.state(abstract, nnx.Param))
        for path, decayed in jax.tree_util.tree_leaves_with_path(mask):
            name = str(getattr(path[-1], "key", path[-1]))
            seen.setdefault(name, set()).add(bool(decayed))
    kept = {n for n, d in seen.items() if d == {False}}
    assert {"b_gate", "cmp_b1", "cmp_b2", "A_log", "dt_bias", "o_norm", "scale"} <= kept
    assert all(n in kept for n in seen if "bias" in n or n.startswith(("b_", "cmp_b")))
    for name in ("wq", "w_q", "w_k", "w_v", "w_o", "w_f1", "w_f2", "router_q", "w_router",
                 "w_private", "w_up", "w_down", "table", "kernel"):
        assert seen[name] == {True}, name


def test_throughput_leaves_out_evaluation_time_but_keeps_the_steps_before_it():
    """The interval's training seconds exclude the time of an evaluation inside it, and only that:
    restarting the clock after it (as before) dropped the steps before it, so tokens/s and MFU were
    overstated (2x with eval.every half of run.log_every)."""
    from aiinfra_jax.train import _Interval

    interval = _Interval()
    time.sleep(0.1)  # "steps"
    with interval.not_training():
        time.sleep(0.5)  # an evaluation
    time.sleep(0.1)
    assert 0.19 < interval.seconds() < 0.45, interval.seconds()
