"""ONNX export (aiinfra_jax/export_onnx.py): onnxruntime runs the written file with the JAX
model's logits (float32, within 1e-4) at batch and sequence lengths other than the check's, the
dynamic dims are named, a model set to run in bfloat16 with the flash kernel converts to the same
float32 graph, and a model that is not dense is refused naming its parts.

Needs jax2onnx and onnxruntime (test dependencies), imported normally: a missing one fails here.
The tiny models get random parameters of std 0.3 (logits of size ~10, so 1e-4 is a real bound)
without compiling an initializer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime as ort
import pytest
from flax import nnx

from aiinfra_jax.config import apply_overrides
from aiinfra_jax.data.tokenizer import ByteTokenizer
from aiinfra_jax.export_onnx import FILE, OPSET, write_onnx
from aiinfra_jax.hf import ExportError
from aiinfra_jax.load import LoadedModel
from aiinfra_jax.models import Transformer
from helpers import tiny


def _loaded(cfg, state=None) -> LoadedModel:
    """A LoadedModel of cfg (a Config) with `state`, or random parameters of std 0.3."""
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model,
                                                                    rngs=nnx.Rngs(0))))
    if state is None:
        rng = np.random.default_rng(0)
        state = jax.tree.map(
            lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
    return LoadedModel(model=nnx.merge(graphdef, state), tokenizer=ByteTokenizer(), config=cfg,
                       step=7, mesh=None)


def _logits(model, tokens: np.ndarray) -> np.ndarray:
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return np.asarray(jax.jit(lambda m, t: m(t, positions=pos)[0])(model, jnp.asarray(tokens)))


def _session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny dense model (scanned, float32) and fixed tokens with its logits."""
    cfg = tiny(tmp_path_factory.mktemp("onnx"))
    cfg = dataclasses.replace(cfg, model=cfg.model.with_vocab(ByteTokenizer().vocab_size))
    loaded = _loaded(cfg)
    tokens = np.random.default_rng(1).integers(0, 259, (3, 21)).astype(np.int32)
    return loaded, tokens, _logits(loaded.model, tokens)


def test_onnxruntime_logits_match_jax_at_any_batch_and_length(dense, tmp_path):
    loaded, tokens, want = dense
    lines = []
    info = write_onnx(loaded, tmp_path, say=lines.append)
    vocab = loaded.config.model.vocab_size
    assert info["files"] == [FILE] and sorted(p.name for p in tmp_path.iterdir()) == [FILE]
    assert info["bytes"] == (tmp_path / FILE).stat().st_size
    assert info["opset"] == OPSET
    assert info["inputs"] == [{"name": "tokens", "dtype": "int32", "shape": ["batch", "seq"]}]
    assert info["outputs"] == [{"name": "logits", "dtype": "float32",
                                "shape": ["batch", "seq", vocab]}]
    assert info["check"]["max_abs_diff"] <= 1e-4 and info["check"]["tokens_shape"] == [2, 16]
    assert any("checked in onnxruntime" in line for line in lines), lines

    session = _session(tmp_path / FILE)
    assert np.abs(want).max() > 1.0  # logits big enough for 1e-4 to be a real bound
    got = session.run(None, {"tokens": tokens})[0]
    assert got.shape == (3, 21, vocab) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    one = session.run(None, {"tokens": tokens[:1, :1]})[0]  # also batch 1, length 1
    np.testing.assert_allclose(one, want[:1, :1], rtol=0, atol=1e-4)


def test_bfloat16_compute_and_flash_kernel_export_the_float32_graph(dense, tmp_path):
    loaded, tokens, want = dense
    cfg = apply_overrides(loaded.config, ["model.dtype=bfloat16",
                                          "model.dense.kernel=flash_attention",
                                          "model.dense.implementation=xla"])
    lines = []
    info = write_onnx(_loaded(cfg, nnx.state(loaded.model)), tmp_path, say=lines.append)
    assert any("computes in float32" in line for line in lines), lines
    assert "model.dtype=float32" in info["run_settings"]
    got = _session(tmp_path / FILE).run(None, {"tokens": tokens})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)  # the float32 model's logits


def test_models_that_are_not_dense_are_refused_naming_the_parts(dense, tmp_path):
    loaded, _, _ = dense
    cfg = apply_overrides(loaded.config, ["model.mixers=[dense,nsa]", "model.ffns=[moe]",
                                          "model.short_conv=4"])
    with pytest.raises(ExportError) as e:
        write_onnx(dataclasses.replace(loaded, config=cfg), tmp_path, say=lambda _: None)
    message = str(e.value)
    for part in ("cannot be exported as ONNX", "step 7", "'nsa' (Native Sparse Attention)",
                 "'moe' (mixture-of-experts FFN)", "model.short_conv=4", "--format safetensors"):
        assert part in message, message
    assert not list(tmp_path.iterdir())
