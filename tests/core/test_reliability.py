"""Runs that cannot be corrupted (issue 20): a locked run directory, honest logs after restarts,
config.json only after the compatibility check, one-line errors, a full disk, exit statuses.
The trials behind each test are listed in RELIABILITY.md."""

import json
import resource
import signal
import subprocess
import sys
import textwrap

import pytest

from aiinfra_jax.config import ConfigError
from aiinfra_jax.errors import RunLockedError
from aiinfra_jax.eval import perplexity
from aiinfra_jax.train import NonFiniteError, main, train

from helpers import ROOT, cli_args, data_files, tiny


def test_a_second_run_on_a_locked_directory_is_refused_then_a_dead_holder_is_taken_over(
        tmp_path, capsys):
    run_dir = tmp_path / "r"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from aiinfra_jax.rundir import RunLock
            RunLock({str(run_dir)!r}).acquire()
            print("locked", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        cfg = tiny(tmp_path, "run.steps=2", f"run.run_dir={run_dir}")
        with pytest.raises(RunLockedError, match=rf"in use by another run \(pid {holder.pid} on"):
            train(cfg, quiet=True)
        assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"], "nothing is written"
    finally:
        holder.kill()  # like kill -9: the lock file keeps its content, the flock goes with it
        holder.wait()
    s = train(cfg)
    assert s["finished"]
    assert "took over the lock of a run that ended without releasing it" in capsys.readouterr().out
    assert (run_dir / "run.lock").read_text() == "", "released at the end"


def test_a_restart_from_scratch_does_not_repeat_the_killed_attempts_log_lines(tmp_path):
    run_dir = tmp_path / "r"
    (run_dir / "logs").mkdir(parents=True)
    killed = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3) * 2)
    (run_dir / "logs" / "metrics.jsonl").write_text(killed + '{"step": 4, "lo')  # torn last line
    train(tiny(tmp_path, "run.steps=3", "run.log_every=1", f"run.run_dir={run_dir}"), quiet=True)
    lines = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3]
    assert all(r["loss"] != 9.0 for r in lines)


def test_a_refused_resume_keeps_config_json_and_an_allowed_change_is_said(tmp_path, capsys):
    run_dir = tmp_path / "r"
    part = train(tiny(tmp_path, "run.steps=3", f"run.run_dir={run_dir}"), stop_after=1,
                 quiet=True)
    # step 1 is no log point (run.log_every=20): the stop logs the steps since the last one
    assert [r["step"] for r in part["history"]] == [1]
    saved = (run_dir / "config.json").read_text()
    with pytest.raises(Exception, match="d_model"):
        train(tiny(tmp_path, "run.steps=3", f"run.run_dir={run_dir}", "model.d_model=64"),
              quiet=True)
    assert (run_dir / "config.json").read_text() == saved
    capsys.readouterr()
    train(tiny(tmp_path, "run.steps=3", f"run.run_dir={run_dir}", "optim.lr=1e-3"))
    out = capsys.readouterr().out
    assert "settings changed since that checkpoint:\n  optim.lr: checkpoint 0.003, current 0.001" \
        in out
    # step 1 of a 2-step warmup: 3/4 of the peak
    assert "the learning rate at step 1 is 0.00075 under these settings, 0.00225 under the " \
        "checkpoint's" in out
    assert json.loads((run_dir / "config.json").read_text())["optim"]["lr"] == 1e-3


class _FailingHook:
    """An in-loop hook that fails when called (an evaluation that crashes)."""

    name, every = "failing", 2

    def check(self, trainer):
        pass

    def __call__(self, step, model, trainer):
        raise RuntimeError(f"hook failed at step {step}")


def test_a_failed_hook_keeps_its_steps_checkpoint_and_refused_resumes_change_nothing(tmp_path):
    """The checkpoint of a step is saved before that step's evaluation and hooks; a resume that
    the data stream (data section, run.seed) refuses, one past run.steps, one of a finished run
    and run.resume=require without a committed checkpoint are config errors that leave config.json,
    summary.json and the checkpoints as they were."""
    run_dir = tmp_path / "r"
    base = ["run.steps=3", f"run.run_dir={run_dir}", "checkpoint.every=2"]
    with pytest.raises(RuntimeError, match="hook failed at step 2"):
        train(tiny(tmp_path, *base), hooks=[_FailingHook()], quiet=True)
    steps = lambda: sorted(p.name for p in (run_dir / "checkpoints").iterdir())  # noqa: E731
    assert steps() == ["2"]
    config = (run_dir / "config.json").read_text()
    with pytest.raises(ConfigError, match=r"saved with a different data setup.*Fix: resume"):
        train(tiny(tmp_path, *base, "data.batch_size=4", "optim.grad_accum=1"), quiet=True)
    with pytest.raises(ConfigError, match="seed: saved 0, now 7"):
        train(tiny(tmp_path, *base, "run.seed=7"), quiet=True)
    with pytest.raises(ConfigError, match="resumes at step 2, past run.steps=1"):
        train(tiny(tmp_path, *base[1:], "run.steps=1"), quiet=True)
    assert (run_dir / "config.json").read_text() == config and steps() == ["2"]
    assert train(tiny(tmp_path, *base), quiet=True)["finished"]
    summary = (run_dir / "summary.json").read_text()
    with pytest.raises(ConfigError, match="holds a finished run .summary.json, step 3.*"
                                          "raise run.steps"):
        train(tiny(tmp_path, *base, "optim.lr=0.5"), quiet=True)
    assert (run_dir / "summary.json").read_text() == summary
    assert json.loads((run_dir / "config.json").read_text())["optim"]["lr"] != 0.5
    interrupted = tmp_path / "q"  # an interrupted save only: nothing to resume
    (interrupted / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir(parents=True)
    with pytest.raises(ConfigError, match="run.resume='require' but .* holds no committed"):
        train(tiny(tmp_path, "run.steps=3", f"run.run_dir={interrupted}", "run.resume=require"),
              quiet=True)


BAD_DATA = {
    "missing.jsonl": None,
    "empty.jsonl": "",
    # its one document hashes into the train split: no validation split for evaluations
    "one_document.jsonl": '{"text": "one document of a few words"}\n',
    "no_field.jsonl": '{"text": "a b c"}\n{"body": "x"}\n',
    "malformed.jsonl": '{"text": "a b c"}\n{"text": \n',
    "binary.txt": bytes(range(256)) * 8,
}


@pytest.mark.parametrize("name", sorted(BAD_DATA))
def test_bad_data_is_one_error_line_and_creates_nothing(tmp_path, capsys, name):
    path = tmp_path / "data" / name
    path.parent.mkdir()
    content = BAD_DATA[name]
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    out_dir = tmp_path / "runs"
    assert main(cli_args(out_dir, f"data.sources={path}", "run.steps=2")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and name in err[0], err
    assert not out_dir.exists(), "the data is checked before the run directory is created"


def test_a_preset_with_a_yaml_syntax_error_is_one_line(tmp_path, capsys):
    preset = tmp_path / "bad.yaml"
    preset.write_text("model:\n  d_model: [1,\n")
    assert main(["--config", str(preset)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 3, column 1: not valid YAML/JSON" in err[0], err


def test_a_corrupt_checkpoint_given_to_an_evaluation_is_one_line(tmp_path, capsys):

    run_dir = tmp_path / "r"
    cfg = tiny(tmp_path, "run.steps=1", f"run.run_dir={run_dir}", "checkpoint.async_save=false")
    train(cfg, quiet=True)
    for path in data_files(run_dir / "checkpoints" / "1"):  # one flipped bit in every data file
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
    args = ["--checkpoint", str(run_dir), "--batches", "1"]
    assert perplexity.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint step 1"), err
    assert " is damaged" in err or " is unreadable" in err, err
    assert "Traceback" not in err
    assert perplexity.main(args + ["--debug"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_non_finite_from_scratch_names_no_step(tmp_path):
    cfg = tiny(tmp_path, "run.steps=20", "run.log_every=1", "checkpoint.every=0",
               "optim.lr=1e30", "optim.warmup_steps=0", "optim.grad_clip=0")
    with pytest.raises(NonFiniteError, match="no checkpoint was saved before it") as e:
        train(cfg, quiet=True)
    assert "step None" not in str(e.value)


def _run_cli(tmp_path, *extra, fsize: int | None = None, timeout=300):
    def limits():
        if fsize is not None:  # a file system that takes no more than fsize bytes per file
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.Popen([sys.executable, "train.py"] + cli_args(tmp_path, *extra), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=limits)


def test_a_full_disk_names_the_cause_and_the_last_good_checkpoint(tmp_path):
    # Every file is limited to 40 kB: config.json and the logs fit, the first checkpoint's array
    # data does not (the write fails with EFBIG, as a full disk fails with ENOSPC).
    proc = _run_cli(tmp_path, "run.steps=6", "checkpoint.every=3", "run.log_every=1",
                    fsize=40_000)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    # (orbax's background threads may print after it, even into the same line without a newline,
    # as in "RuntimeErrorerror: ...": find our message rather than take the last line)
    ours = [x[x.index("error: "):] for x in err.splitlines() if "error: " in x]
    assert len(ours) == 1, err[-3000:]
    assert ours[0].startswith("error: the file system refused a write: File too large"), ours
    assert "no checkpoint was saved before it" in ours[0], ours
