"""eval/bench_gpu.py on the CPU. The GPU machine has neither grain nor datasets and no network, so
the script must run from a bare checkout with only JAX: here it runs as a file from an
uninstalled-looking checkout with those modules blocked, in Pallas interpret mode at tiny shapes
(every kernel gets a passing parity row; timing rows carry their ratios). Every timing row of the
real configuration's code is also lowered for cuda (--lower-only), and the parity cases cover
every kernel folder with a pallas_gpu.py at the kernel tests' tolerances."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aiinfra_jax.eval import bench_gpu, gpu_parity
from aiinfra_jax.kernels import _testing

ROOT = Path(__file__).resolve().parents[2]
# Absent on the GPU machine (its image has JAX, flax, optax, orbax, pyarrow... but not these).
BLOCKED = ("grain", "datasets", "tensorboardX")

# Runs eval/bench_gpu.py as a file (python eval/bench_gpu.py ...) with BLOCKED unimportable and
# the editable install's finder removed, from a folder outside the checkout: the script must find
# the kernels itself, as on a machine where the project is not pip-installed.
_DRIVER = """
import importlib.abc, runpy, sys
BLOCKED = {blocked!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None

sys.meta_path[:] = [Block()] + [f for f in sys.meta_path
                                if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks
                     if not getattr(h, "__module__", "").startswith("__editable__")]
sys.path_importer_cache.clear()
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED + ("aiinfra_jax",):
        del sys.modules[name]
sys.argv = [{script!r}] + {argv!r}
try:
    runpy.run_path({script!r}, run_name="__main__")
    rc = 0
except SystemExit as exc:
    rc = exc.code
print("RC", rc)
print("LOADED", [m for m in sys.modules if m.split(".")[0] in BLOCKED
                 or m == "aiinfra_jax.data" or m.startswith("aiinfra_jax.data.")])
print("KERNELS", list(sys.modules["aiinfra_jax.kernels"].__path__))
"""


def _run_bare(script: str, argv: list[str], tmp_path: Path, out_dir: Path,
              data_package: bool = False) -> str:
    """Runs eval/<script> as a file from a bare checkout (_DRIVER); its stdout, after checking
    that it exited 0 without loading grain or datasets (nor aiinfra_jax.data unless
    data_package), and found this checkout's kernels."""
    code = _DRIVER.format(blocked=BLOCKED, script=str(ROOT / "eval" / script), argv=argv)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OUT": str(out_dir), "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "RC 0" in proc.stdout, log[-4000:]
    loaded = ast.literal_eval(proc.stdout.split("LOADED ", 1)[1].split("\n", 1)[0])
    if data_package:
        loaded = [m for m in loaded if not m.startswith("aiinfra_jax.")]
    assert not loaded, log[-4000:]      # no grain or datasets (no data pipeline at all)
    assert str(ROOT / "kernels") in proc.stdout.split("KERNELS", 1)[1]
    return proc.stdout


def test_leapquant_cost_runs_from_a_bare_checkout_without_grain(tmp_path):
    """bench_leapquant --cost (decode step time per state format) is the GPU machine's LeapQuant
    check too: it must not need grain (only its quality mode reads the data pipeline)."""
    out = tmp_path / "cost.json"
    _run_bare("bench_leapquant.py", ["--cost", "--batches", "1", "--cost-heads", "1",
                                     "--cost-dim", "16", "--cost-steps", "4", "--repeats", "1",
                                     "--out", str(out)], tmp_path, tmp_path, data_package=True)
    rows = json.loads(out.read_text())["rows"]
    assert {r["format"] for r in rows} >= {"none", "int8"}
    assert all(r["us_per_step"] > 0 for r in rows)


def test_tiny_interpret_run_from_a_bare_checkout_without_grain(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # timing: one op, forward (every op's rows, both modes, are lowered in the next test; the
    # parity rows already run each kernel's backward)
    _run_bare("bench_gpu.py", ["--interpret", "--tiny", "--ops", "flash", "--modes", "fwd"],
              tmp_path, out_dir)

    md = (out_dir / "bench_gpu.md").read_text()        # the default: $OUT/bench_gpu.md
    data = json.loads((out_dir / "bench_gpu.json").read_text())
    assert "status: complete" in md and "interpret mode" in md

    # a passing parity row for every kernel folder that has a Pallas GPU kernel
    kernels = bench_gpu.pallas_gpu_kernels()
    assert set(kernels) >= {"flash_attention", "sparse_attention", "block_selection",
                            "depth_attention", "gated_delta"}
    for kernel in kernels:
        rows = [r for r in data["parity"] if r["kernel"] == kernel]
        assert rows and all(r["pass"] for r in rows), (kernel, rows)
        assert re.search(rf"^\| {kernel} \|.*\| pass \|", md, re.M), kernel
        assert all(r["rel_err"] <= r["tol"] for r in rows)

    # timing rows: the Pallas kernel, the cuDNN stand-in and XLA, with both ratios
    timing = {r["impl"]: r for r in data["timing"]}
    assert set(timing) == {"pallas_gpu", "cudnn*", "xla"}, data["timing"]
    assert all(r["seconds"] > 0 and r["mode"] == "fwd" for r in timing.values())
    assert timing["pallas_gpu"]["vs_cudnn"] > 0 and timing["pallas_gpu"]["vs_xla"] > 0
    assert timing["cudnn*"]["vs_cudnn"] == 1.0
    assert "| flash | pallas_gpu | 128 | fwd |" in md and "stands in for cuDNN" in md
    assert not data["skipped"]


def test_every_timing_row_lowers_for_cuda(tmp_path):
    """--lower-only: every op's rows (native Pallas kernels, not interpret) lower for cuda with
    their Triton kernels, each module passing the MLIR verifier; cuDNN needs a GPU to trace, so
    its rows are skipped with the reason."""
    out = tmp_path / "lowered.md"
    assert bench_gpu.main(["--lower-only", "--tiny", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["op"], r["impl"], r["mode"]): r for r in data["timing"]}
    assert not [r for r in data["timing"] if "error" in r]
    for op in bench_gpu.TIMED_OPS:
        modes = ("fwd",) if op == "select" else ("fwd", "fwd+bwd")
        for mode in modes:
            row = rows[(op, "pallas_gpu", mode)]
            assert row["triton_calls"] >= 1, (op, mode)
            assert row["triton_verified"] == row["triton_calls"], (op, mode)
            assert rows[(op, "xla", mode)]["triton_calls"] == 0, (op, mode)
    skipped = [s["what"] for s in data["skipped"]]
    assert len(skipped) == 4 and all("cudnn" in s for s in skipped)
    assert "traces only where cuDNN is" in out.read_text()


def test_work_past_the_budget_is_skipped_with_a_reason(tmp_path):
    out = tmp_path / "b.md"
    run = bench_gpu.make_run(["--lower-only", "--tiny", "--budget-s", "0", "--out", str(out)])
    bench_gpu.run_timing(run)
    assert not run.timing and run.skipped
    assert "budget" in run.skipped[0]["reason"] and "## Skipped" in out.read_text()


def test_without_a_gpu_it_asks_for_interpret_or_lower_only(capsys):
    assert bench_gpu.main(["--tiny"]) == 2
    err = capsys.readouterr().err
    assert "--interpret" in err and "--lower-only" in err


def test_parity_cases_cover_every_pallas_gpu_kernel_at_the_tests_tolerances():
    kernels = {p.parent.name for p in (ROOT / "kernels").glob("*/pallas_gpu.py")}
    for tiny in (False, True):
        cases = gpu_parity.parity_cases(tiny)
        assert {c.kernel for c in cases} == kernels, "a kernel without cases in eval/gpu_parity.py"
        for c in cases:
            want = (gpu_parity.GATED_DELTA_TOLERANCES if c.kernel == "gated_delta"
                    else _testing.TOLERANCES)[c.dtype]
            assert c.tol == want, c
    # gated_delta's tolerances are its test's own
    text = (ROOT / "tests" / "kernels" / "test_gated_delta.py").read_text()
    found = re.search(r"^TOLERANCES = (\{.*\})$", text, re.M)
    assert found and ast.literal_eval(found.group(1)) == gpu_parity.GATED_DELTA_TOLERANCES


def test_gated_delta_tile_tuning_checks_every_variant_before_timing_it(tmp_path):
    """eval/tune_gated_delta_gpu.py (the next GPU session's A/B of the Triton state pass's tiles)
    in interpret mode: each variant matches the XLA state pass, forward and backward, and gets
    times; a malformed variant is refused by name."""
    from aiinfra_jax.eval import tune_gated_delta_gpu as tune
    out = tmp_path / "tune.json"
    assert tune.main(["--interpret", "--tiny", "--variants", "16x4,32x8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["xla", "16x4", "32x8"]
    for r in rows[1:]:
        assert r["fwd_err"] <= tune.TOLERANCE and r["bwd_err"] <= tune.TOLERANCE
        assert r["fwd_s"] > 0 and r["bwd_s"] > 0
    with pytest.raises(SystemExit, match="BVxW"):
        tune.main(["--interpret", "--tiny", "--variants", "32-8"])
