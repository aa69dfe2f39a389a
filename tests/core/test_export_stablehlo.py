"""`--format stablehlo`: jax.export artifacts of prefill and decode per platform, and the standalone
runner (aiinfra_jax/stablehlo_runner.py, copied as run_stablehlo.py) that generates the live
model's greedy tokens in a fresh process that cannot import this package.

The model is configs/nsa_tiny.py shrunk (1 layer, d_model 32, max_seq_len 64) with random weights
written straight to safetensors shards, as an export writes them, and loaded back with
load_safetensors: no init compile, no training, no checkpoint. XLA compile time of the live model
and of the runner is most of this file's time."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aiinfra_jax import export as ex
from aiinfra_jax import export_stablehlo as es
from aiinfra_jax import stablehlo_runner as runner
from aiinfra_jax.config import load_config, to_dict
from aiinfra_jax.generate import generate
from aiinfra_jax.hf import ExportError
from helpers import ROOT, TINY

# One layer: each NSA layer adds seconds of XLA compile time to both the live model and the runner
# (test_rebuilt_model_is_the_live_one checks the per-layer mapping of 2 layers without compiling).
NSA = ["model.n_layers=1", "model.max_seq_len=64", "model.nsa.cmp_block_len=8",
       "model.nsa.cmp_stride=4", "model.nsa.sel_block_size=16", "model.nsa.n_selected=3",
       "model.nsa.n_local=1", "model.nsa.window=16"]
PROMPTS = [[int(x) for x in np.random.default_rng(1).integers(0, 256, n)] for n in (29, 11)]
N_NEW = 20  # 29 + 20 = 49 tokens: past the window (16), several selection blocks of 16
_KERNEL_CALLS = {"cuda": "custom_call @__gpu", "tpu": "custom_call @tpu_custom_call"}
BLOCKED = ("aiinfra_jax", "flax", "optax", "orbax", "grain")


def _weights_dir(path, *overrides, shard_bytes=10**9):
    """A safetensors export directory (config.json + the tensors) of the tiny NSA model with
    random weights of a scale that keeps the logits well apart; returns (dir, LoadedModel)."""
    cfg = load_config(str(ROOT / "configs" / "nsa_tiny.py"), TINY + NSA + list(overrides))
    cfg = dataclasses.replace(cfg, model=cfg.model.with_vocab(259))
    rng = np.random.default_rng(0)
    tensors = {}
    for name, spec in ex.tensor_shapes(cfg.model).items():
        x = rng.normal(0.0, 0.25, spec.shape)
        tensors[name] = (1.0 + x if name.endswith("scale") else x).astype(spec.dtype)
    path.mkdir()
    ex.write_safetensors(path, tensors, max_shard_bytes=shard_bytes, metadata={},
                         say=lambda s: None)
    (path / "config.json").write_text(json.dumps(to_dict(cfg)))
    return path, ex.load_safetensors(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny NSA model exported for cpu, cuda and tpu (implementations at None: the best per
    platform), one prompt-length bucket; returns (dir, LoadedModel, what write_stablehlo said)."""
    out, loaded = _weights_dir(tmp_path_factory.mktemp("stablehlo") / "export",
                               shard_bytes=20_000)  # shards: the runner reads the index too
    assert loaded.config.model.nsa.implementation is None
    said = []
    info = es.write_stablehlo(loaded, out, batch_size=2, prompt_lengths=(32,), say=said.append)
    return out, loaded, info, said


def _shadowed_env(tmp_path):
    """An environment whose PYTHONPATH starts with packages that refuse to import: the runner
    must not need this framework (nor flax & co.)."""
    shadow = tmp_path / "shadow"
    for name in BLOCKED:
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(
            f"raise ImportError('{name} must not be imported by the stablehlo runner')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(shadow), JAX_PLATFORMS="cpu")
    return env


def test_runner_in_a_fresh_process_generates_the_live_models_tokens(exported, tmp_path):
    out, loaded, info, said = exported
    want = generate(loaded.model, PROMPTS, max_new_tokens=N_NEW, temperature=0).as_lists()
    # A stop token that ends the second prompt early and not the first: a row ends after its
    # eos, as in the live model (whose greedy tokens up to that eos are `want`'s).
    eos = next(t for t in want[1][2:] if t not in want[0])
    stopped = [row[:row.index(eos) + 1] if eos in row else row for row in want]
    assert len(stopped[1]) < N_NEW and stopped[0] == want[0] and len(want[0]) == N_NEW

    # A fresh interpreter, aiinfra_jax / flax unimportable, the runner copied into the export;
    # 3 prompts over the export's batch of 2: the second call's batch gets a dummy row.
    env = _shadowed_env(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import aiinfra_jax"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "must not be imported" in probe.stderr
    args = [str(out / es.RUNNER), str(out), "--max-new-tokens", str(N_NEW), "--platform", "cpu",
            "--eos-id", str(eos)]
    for p in PROMPTS + [PROMPTS[1]]:
        args += ["--prompt", ",".join(map(str, p))]
    fresh = subprocess.run([sys.executable] + args, env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert json.loads(fresh.stdout) == stopped + [stopped[1]]

    manifest = json.loads((out / es.MANIFEST).read_text())
    cpu = manifest["platforms"]["cpu"]
    assert cpu["batch"] == 2 and [e["prompt_len"] for e in cpu["prefill"]] == [32]
    assert (out / ex.INDEX_FILE).exists()
    assert manifest["max_len"] == 64 and manifest["vocab_size"] == 384
    assert manifest["tokens"] == {"bos_id": 257, "eos_id": 258, "pad_id": 256}
    assert set(manifest["weights"]) == set(ex.read_safetensors(out))
    buffers = {b["name"]: b for b in manifest["cache"]["buffers"]}
    assert buffers["cache.0.0.k_slc"]["shape"] == ["b", 1, 64, 16]
    assert buffers["cache.0.0.k_slc"]["axes"] == ["batch", "kv_heads", "slot", "head_dim"]
    assert buffers["cache.0.0.k_win"]["axes"] == ["batch", "kv_heads", "head_dim", "window"]
    assert buffers["cache.0.0.v_win"]["axes"] == ["batch", "kv_heads", "window", "head_dim"]
    assert buffers["cache.0.0.v_win"]["shape"] == ["b", 1, 16, 16]  # a ring of min(16, 64) slots
    assert buffers["cache.0.0.k_cmp"]["shape"] == ["b", 1, 16, 15]  # (64 - 8) // 4 + 1
    assert buffers["cache.0.0.lengths"] == {**buffers["cache.0.0.lengths"], "shape": ["b"],
                                            "dtype": "int32", "layer": 0, "mixer": "nsa"}
    assert manifest["symbolic"]["why not symbolic"]  # NSA: fixed batch, bucketed prompts
    assert info["stablehlo"]["files"] == sorted(
        e["file"] for p in manifest["platforms"].values() for e in p["prefill"] + [p["decode"]])
    assert any("stablehlo cpu" in s for s in said)


def test_accelerator_artifacts_hold_the_pallas_kernels(exported):
    out, _, _, _ = exported
    manifest = json.loads((out / es.MANIFEST).read_text())
    assert sorted(manifest["platforms"]) == ["cpu", "cuda", "tpu"]
    for platform, entry in manifest["platforms"].items():
        for item in entry["prefill"] + [entry["decode"]]:
            exp = jax.export.deserialize(bytearray((out / item["file"]).read_bytes()))
            assert exp.platforms == (platform,)
            text = exp.mlir_module()
            if platform == "cpu" or item is entry["decode"]:
                # decode is plain XLA everywhere (cached_attention, select_blocks_from_probs)
                assert not any(call in text for call in _KERNEL_CALLS.values())
            else:  # prefill: the tiled kernels
                assert _KERNEL_CALLS[platform] in text, (platform, item["file"])


def test_clear_errors(exported, tmp_path, capsys):
    out, loaded, _, _ = exported
    empty = tmp_path / "empty"
    empty.mkdir()
    assert runner.main([str(empty), "--prompt", "1,2", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no stablehlo.json" in err[0] and "--format stablehlo" in err[0]
    with pytest.raises(runner.StableHLOError, match="platform 'rocm' was not exported.*cpu, "
                                                    "cuda, tpu"):
        runner.load(out, "rocm")
    bare = tmp_path / "bare"  # the manifest without the weights beside it
    bare.mkdir()
    shutil.copyfile(out / es.MANIFEST, bare / es.MANIFEST)
    with pytest.raises(runner.StableHLOError, match="the weights are missing"):
        runner.load(bare, "cpu")
    model = runner.load(out, "cpu")
    with pytest.raises(runner.StableHLOError,
                       match=r"30 tokens \+ max_new_tokens 40 = 70 exceeds the cache of 64"):
        model.generate([[1] * 30], max_new_tokens=40)
    with pytest.raises(runner.StableHLOError, match="longer than the longest prefill bucket"):
        model.generate([[1] * 40], max_new_tokens=2)
    with pytest.raises(runner.StableHLOError, match=r"outside the vocabulary \[0, 384\)"):
        model.generate([[1, 999]], max_new_tokens=2)
    # Export-side refusals: a platform jax.export does not target, a cache longer than the model.
    with pytest.raises(ExportError, match="choose among cpu, cuda, tpu"):
        es.write_stablehlo(loaded, out, platforms=("metal",))
    with pytest.raises(ExportError, match="max_len=128: must be in"):
        es.write_stablehlo(loaded, out, max_len=128)
    msa = dataclasses.replace(loaded, config=dataclasses.replace(
        loaded.config, model=dataclasses.replace(loaded.config.model, mixers=("msa",))))
    with pytest.raises(ExportError, match="MSA layers.*memory bank"):
        es.write_stablehlo(msa, out)


def test_rebuilt_model_is_the_live_one(tmp_path):
    """The exported functions rebuild the model from the named tensors (per-block parameters, as
    generate.py runs it after unscanned()): for 2 layers of a scanned model, every parameter is
    the live model's, layer by layer (eagerly: nothing compiled)."""
    out, loaded = _weights_dir(tmp_path / "two", "model.n_layers=2")
    assert loaded.config.model.scan_layers and loaded.config.model.n_repeats == 2
    tensors = {k: jnp.asarray(v) for k, v in ex.read_safetensors(out).items()}
    rebuilt = nnx.to_pure_dict(nnx.state(es._model_builder(loaded.config.model)(tensors)))
    live = nnx.to_pure_dict(nnx.state(loaded.model.unscanned()))
    assert jax.tree.structure(rebuilt) == jax.tree.structure(live)
    jax.tree.map(np.testing.assert_array_equal, rebuilt, live)
    with pytest.raises(ExportError, match=r"tensors \['stray'\] are not part of the model"):
        es._model_builder(loaded.config.model)({**tensors, "stray": jnp.zeros(3)})
