"""Multi-process runs on localhost with JAX's distributed runtime: 2 processes x 4 simulated CPU
devices (gloo collectives), launched as a user launches them (python -m aiinfra_jax.train on each,
the launch settings in the environment or in --set mesh.*). They train as 1 process x 8 devices
does, into one run directory that process 0 writes; SIGTERM to one process stops both at the same
step with a checkpoint, and the resumed run goes on with the uninterrupted run's losses; a killed
process stops the other with a message; processes that cannot meet say why.

Every wait is bounded: a launch that runs too long is killed (SIGKILL: JAX's preemption notifier
takes SIGTERM) and fails the test with the processes' logs."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from aiinfra_jax import sharding as shd
from aiinfra_jax.config import ConfigError, MeshConfig, load_config
from aiinfra_jax.errors import EXIT_STOPPED
from aiinfra_jax.train import train

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
    "data.seq_len=32", "data.batch_size=8", "data.streams=2", "optim.warmup_steps=2",
    "optim.lr=3e-3", "eval.every=0", "eval.batches=2", "eval.final_batches=2",
    "run.progress=false", "run.log_every=1", "checkpoint.every=0",
    "mesh.init_timeout_s=60", "mesh.heartbeat_timeout_s=10",
]
STEPS = 40  # the SIGTERM lands a few steps after step 1 (the processes agree on the step)
LAUNCH_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_xla_flags() -> str:
    """The suite's XLA flags (tests/conftest.py: its faster-compiling options) with 4 devices a
    process instead of 8."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(flags + ["--xla_force_host_platform_device_count=4"])


class Launch:
    """The 2 processes of one run, each `python -m aiinfra_jax.train --config configs/tiny.py`
    with 4 CPU devices; their output in files (never a pipe that could fill up). ``via_set``:
    the launch settings as --set mesh.* (else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID); ``extra``: --set values for each process."""

    def __init__(self, tmp_path: Path, name: str, overrides: list[str], *, via_set=False,
                 extra=([], []), processes=2):
        port = _free_port()
        self.logs = [tmp_path / f"{name}.{i}.log" for i in range(processes)]
        self.procs = []
        for i, log in enumerate(self.logs):
            env = dict(os.environ, XLA_FLAGS=_launch_xla_flags(), JAX_PLATFORMS="cpu",
                       PYTHONUNBUFFERED="1")  # (with the suite's compilation cache: conftest.py)
            launch = [f"mesh.coordinator_address=127.0.0.1:{port}", "mesh.num_processes=2",
                      f"mesh.process_id={i}"]
            if not via_set:
                env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                           JAX_PROCESS_ID=str(i))
                launch = []
            cmd = [sys.executable, "-m", "aiinfra_jax.train", "--config", "configs/tiny.py"]
            for o in overrides + launch + list(extra[i]):
                cmd += ["--set", o]
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f,
                                                   stderr=subprocess.STDOUT))

    def wait(self, timeout_s: float = LAUNCH_TIMEOUT_S) -> list[int]:
        deadline = time.monotonic() + timeout_s
        try:
            return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"processes still running after {timeout_s} s:\n{self.output()}")

    def wait_for_a_step(self, metrics: Path, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not (metrics.exists() and metrics.read_text().strip()):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.kill()
                pytest.fail(f"no training step logged:\n{self.output()}")
            time.sleep(0.05)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def output(self) -> str:
        return "\n".join(f"--- process {i}:\n{self.log(i)[-3000:]}" for i in range(len(self.procs)))


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x["loss"] for x in lines if "loss" in x}


@pytest.mark.slow
def test_two_processes_train_as_one_stop_together_and_resume(tmp_path):
    common = TINY + [f"run.steps={STEPS}", f"run.output_dir={tmp_path / 'runs'}"]
    run_dir = tmp_path / "runs" / "tiny"
    # 1 process x 8 devices (this one; tests/conftest.py gives it 8): the same data streams
    one = train(load_config("configs/tiny.py", TINY + [f"run.steps={STEPS}",
                                                        f"run.output_dir={tmp_path / 'one'}"]),
                quiet=True)
    want = {r["step"]: r["loss"] for r in one["history"]}

    # 2 processes x 4 devices; SIGTERM to process 1 alone stops both at the same step, saved.
    first = Launch(tmp_path, "first", common)
    first.wait_for_a_step(run_dir / "logs" / "metrics.jsonl")
    first.procs[1].send_signal(signal.SIGTERM)
    assert first.wait() == [EXIT_STOPPED, EXIT_STOPPED], first.output()  # stopped, resumable
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir())
    assert len(saved) == 1 and 1 <= saved[0] < STEPS, (saved, first.output())
    assert f"stopped at step {saved[0]} (SIGTERM" in first.log(0), first.output()
    assert sorted(_losses(run_dir)) == list(range(1, saved[0] + 1))

    # The same command resumes (the launch settings given as --set this time) and finishes.
    second = Launch(tmp_path, "second", common, via_set=True)
    assert second.wait() == [0, 0], second.output()
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in want.items():  # float32 rounding: the reductions run in another order
        assert got[step] == pytest.approx(loss, rel=1e-5), (step, got[step], loss)
    val = json.loads((run_dir / "eval.json").read_text())["loss"]
    assert val == pytest.approx(one["validation"]["loss"], rel=1e-5)

    # One run directory with one set of files, written by process 0; process 1 printed nothing.
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tiny"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.json", "eval.json",
                                                          "logs", "run.lock", "summary.json"]
    assert (run_dir / "run.lock").read_text() == "", "process 0 released the lock"
    assert len(list((run_dir / "logs").glob("events.out.tfevents*"))) == 2  # one per launch
    mesh = json.loads((run_dir / "config.json").read_text())["mesh"]
    assert (mesh["coordinator_address"], mesh["num_processes"], mesh["process_id"]) == ("", 0, -1)
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [saved[0], STEPS]
    assert "new run in" in first.log(0) and "resumed" in second.log(0)
    assert "done:" in second.log(0)
    for launch in (first, second):
        text = launch.log(1)
        assert not any(w in text for w in ("new run", "resumed", "stopped at", "done:")), text


@pytest.mark.slow
def test_a_killed_process_stops_the_other_with_a_message(tmp_path):
    run_dir = tmp_path / "runs" / "tiny"
    launch = Launch(tmp_path, "kill", TINY + ["run.steps=100000", "checkpoint.every=2",
                                              "checkpoint.async_save=false",
                                              f"run.output_dir={tmp_path / 'runs'}"])
    launch.wait_for_a_step(run_dir / "logs" / "metrics.jsonl")
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "2").exists():  # a committed checkpoint to resume from
        if time.monotonic() > deadline or any(p.poll() is not None for p in launch.procs):
            launch.kill()
            pytest.fail(f"no checkpoint of step 2:\n{launch.output()}")
        time.sleep(0.05)
    killed_at = time.monotonic()
    launch.procs[1].kill()
    rc = launch.wait(timeout_s=60)[0]
    assert rc != 0 and time.monotonic() - killed_at < 60, launch.output()
    text = launch.log(0)
    # Our message when a collective fails first; JAX's when its distributed service notices first.
    assert (("lost contact with another process" in text
             and "Start every process again with the same command: the run resumes from its "
                 "last checkpoint (step " in text)
            or "another task died" in text), text[-3000:]


def test_processes_that_cannot_meet_fail_with_a_message(tmp_path):
    common = TINY + [f"run.output_dir={tmp_path / 'runs'}"]
    # Two processes with different configs: both refuse, naming the difference.
    launch = Launch(tmp_path, "apart", common, extra=(["data.seq_len=64"], []))
    assert launch.wait(timeout_s=120) == [1, 1], launch.output()
    for i in range(2):
        assert "process 1 runs another config than process 0:\n  data.seq_len: process 0 64, " \
               "process 1 32" in launch.log(i), launch.output()
    assert not (tmp_path / "runs").exists()
    # One data stream cannot be split over two processes (each would read the other's rows).
    launch = Launch(tmp_path, "one_stream", common + ["data.streams=1"])
    assert launch.wait(timeout_s=120) == [1, 1], launch.output()
    assert "data.streams=1: process 1 of 2 holds rows 4..7 of each batch, which are not whole " \
           "streams of 8 rows" in launch.log(1) and "Set data.streams to a multiple of 2" \
           in launch.log(1), launch.output()
    # A process whose peer never comes gives up after mesh.init_timeout_s, saying what to check.
    lone = Launch(tmp_path, "lone", common + ["mesh.init_timeout_s=2"], processes=1)
    assert lone.wait(timeout_s=120) == [1], lone.output()
    assert "process 0 of 2: after mesh.init_timeout_s=2 s, not every process has joined " \
           "127.0.0.1:" in lone.log(0), lone.output()


def test_launch_settings_come_from_the_mesh_config_or_the_environment(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
                "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    assert shd.launch_settings(MeshConfig()) == ("", None, None)
    shd.maybe_initialize_distributed(MeshConfig())  # nothing says "multi-process": a no-op
    assert not jax.distributed.is_initialized()
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task job is not a multi-process job
    assert shd._cluster_job() is None
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert shd._cluster_job() == "SLURM"  # (JAX reads the rest from the job)
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    assert shd.launch_settings(MeshConfig()) == ("10.0.0.1:1234", 4, 2)
    fields = MeshConfig(coordinator_address="host0:99", num_processes=2, process_id=1)
    assert shd.launch_settings(fields) == ("host0:99", 2, 1)  # a field wins over its variable
    assert fields.without_launch() == MeshConfig()  # what a run directory stores
    monkeypatch.setenv("JAX_PROCESS_ID", "one")
    with pytest.raises(ConfigError, match=r"JAX_PROCESS_ID='one' \(read for mesh.process_id\)"):
        shd.launch_settings(MeshConfig())
    monkeypatch.delenv("JAX_PROCESS_ID")
    with pytest.raises(ConfigError, match="needs the number of processes and this process's id"):
        shd.maybe_initialize_distributed(MeshConfig(num_processes=0))
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
    with pytest.raises(ConfigError, match="but no coordinator"):
        shd.maybe_initialize_distributed(MeshConfig())
    assert not jax.distributed.is_initialized()
    with pytest.raises(ConfigError, match=r"mesh.coordinator_address='host0'.*'host:port'"):
        MeshConfig(coordinator_address="host0")
    with pytest.raises(ConfigError, match=r"mesh.process_id=2: must be in 0..num_processes-1"):
        MeshConfig(num_processes=2, process_id=2)
