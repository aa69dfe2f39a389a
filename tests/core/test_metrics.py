"""Tests for aiinfra_jax.metrics: writers, progress bar, peak FLOPs / MFU."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aiinfra_jax import metrics as M
from aiinfra_jax.metrics import MetricsWriter, ProgressBar, mfu, peak_flops_per_device


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_hold_the_values(tmp_path):
    rng = np.random.default_rng(0)
    values = rng.normal(size=3)
    with MetricsWriter(tmp_path / "logs", tensorboard=False) as w:
        w.write(1, {"loss": jnp.float32(values[0]), "lr": np.float64(values[1]), "tokens": 4096})
        w.write(2, {"loss": jnp.asarray(values[2], jnp.bfloat16), "step": 2, "ok": True})
    lines = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[0]["loss"] == pytest.approx(values[0], rel=1e-6)
    assert lines[0]["lr"] == values[1]
    assert lines[0]["tokens"] == 4096.0 and isinstance(lines[0]["tokens"], float)
    assert lines[1]["loss"] == pytest.approx(values[2], rel=1e-2)
    assert lines[1]["ok"] == 1.0 and "time" in lines[1]
    assert set(lines[1]) == {"step", "time", "loss", "ok"}


def test_writer_rejects_bad_values(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(ValueError, match=r"metric 'v' must be a scalar"):
            w.write(1, {"v": jnp.ones(3)})
        with pytest.raises(TypeError, match=r"metric .name. must be a real number"):
            w.write(1, {"name": "abc"})
        with pytest.raises(ValueError, match=r"disagrees with step=3"):
            w.write(3, {"step": 4})
    with pytest.raises(ValueError, match="jsonl=True or tensorboard=True"):
        MetricsWriter(tmp_path, jsonl=False, tensorboard=False)


def test_resume_drops_lines_after_the_checkpoint(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for step in range(1, 6):
            w.write(step, {"loss": 1.0 / step})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a torn line from a crash
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=3) as w:
        w.write(4, {"loss": 0.5})
    assert [line["step"] for line in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_tensorboard_event_file_created(tmp_path):
    with MetricsWriter(tmp_path, jsonl=False) as w:
        w.write(7, {"loss": jnp.float32(np.random.default_rng(1).normal())})
    events = list(tmp_path.glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    assert not (tmp_path / "metrics.jsonl").exists()
    # The scalar is really in the event file (tensorboardX writes the tag name in the record).
    assert b"loss" in events[0].read_bytes()


def test_nan_metrics_are_written_without_a_warning_each(tmp_path, caplog):
    """A metric that is NaN by design (an MSA layer that does not route) goes to both files, and
    tensorboardX does not log a warning for it at every step."""
    with caplog.at_level("WARNING"):
        with MetricsWriter(tmp_path) as w:
            for step in (1, 2):
                w.write(step, {"loss": 1.0, "aux/layer_0/recall@1": jnp.float32(jnp.nan)})
    assert not [r for r in caplog.records if "NaN" in r.getMessage()], caplog.text
    assert all(math.isnan(r["aux/layer_0/recall@1"])
               for r in read_jsonl(tmp_path / "metrics.jsonl"))
    assert b"layer_0/recall" in next(tmp_path.glob("events.out.tfevents.*")).read_bytes()


@dataclass
class FakeDevice:
    device_kind: str
    platform: str = "gpu"


@pytest.mark.parametrize(
    "kind, dtype, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
        ("NVIDIA H200", jnp.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA A100-SXM4-80GB", "float32", 156e12),
        ("NVIDIA L4", "bfloat16", 121e12),
        ("TPU v4", "bfloat16", 275e12),
        ("TPU v5 lite", "bfloat16", 197e12),
        ("TPU v5", "bfloat16", 459e12),
        ("TPU v5p", np.float32, 459e12),
        ("TPU v6 lite", "bfloat16", 918e12),
    ],
)
def test_peak_flops_table_lookup(kind, dtype, expected):
    peak, source = peak_flops_per_device(FakeDevice(kind, "tpu" if "TPU" in kind else "gpu"), dtype)
    assert peak == expected
    assert source.startswith("spec table")


def test_peak_flops_unknown_dtype_is_an_error():
    with pytest.raises(ValueError, match=r"int8.*bfloat16"):
        peak_flops_per_device(FakeDevice("NVIDIA H100 80GB HBM3"), "int8")


def test_peak_flops_measured_on_cpu_is_cached(monkeypatch):
    device = jax.devices()[0]
    assert device.platform == "cpu"
    M._MEASURED.clear()
    peak, source = peak_flops_per_device(device, "bfloat16")
    assert source.startswith("measured matmul")
    assert math.isfinite(peak) and 1e6 < peak < 1e15

    def boom(*a, **k):
        raise AssertionError("measured twice: the value should be cached")

    monkeypatch.setattr(M, "_measure_matmul_peak", boom)
    assert peak_flops_per_device(device, "float32") == (peak, source)
    # An accelerator missing from the table is measured too (and said so), not guessed.
    M._MEASURED[("gpu", "NVIDIA Mystery 9000", len(jax.local_devices()))] = 1.5e12
    assert peak_flops_per_device(FakeDevice("NVIDIA Mystery 9000"), "bfloat16")[1].startswith("measured matmul")


def test_mfu_arithmetic():
    rng = np.random.default_rng(2)
    f, tps, n, peak = rng.uniform(1e6, 1e9), rng.uniform(1e3, 1e6), 8, rng.uniform(1e12, 1e15)
    assert mfu(f, tps, n, peak) == pytest.approx(3 * f * tps / (n * peak))
    # 100 MFLOP/token forward, 1M tok/s, 2 devices of 1 PFLOP/s -> 3e14 / 2e15 = 0.15
    assert mfu(100e6, 1e6, 2, 1e15) == pytest.approx(0.15)
    with pytest.raises(ValueError, match="n_devices"):
        mfu(1.0, 1.0, 0, 1.0)
    with pytest.raises(ValueError, match="peak"):
        mfu(1.0, 1.0, 1, 0.0)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_bar_non_tty_prints_periodic_lines():
    clock, out = FakeClock(), io.StringIO()
    bar = ProgressBar(100, desc="run", stream=out, interval_s=10.0, clock=clock)
    assert not bar.tty
    for step in range(1, 101):
        clock.t += 1.0
        bar.update(step, loss=2.0 + 1.0 / step, tokens_per_sec=12345.0, mfu=0.4123)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # first update, then every 10 s (1 step/s), and the final step
    assert [line.split()[1] for line in lines] == [f"{s}/100" for s in (1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100)]
    assert lines[1].startswith("run 11/100  11.0% | loss 2.0909 | 12.3k tok/s | MFU 41.2% | eta 1:29")
    assert lines[-1].endswith("eta 0:00")
    assert lines[0].endswith("eta ?")


def test_progress_bar_tty_redraws_one_line():
    class TTY(io.StringIO):
        def isatty(self):
            return True

    clock, out = FakeClock(), TTY()
    bar = ProgressBar(4, stream=out, clock=clock)
    for step in range(1, 5):
        clock.t += 2.0
        bar.update(step, loss=1.0)
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert "4/4 100.0%" in text

