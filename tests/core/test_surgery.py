"""Architecture surgery (aiinfra_jax/surgery.py): which tensors a new model takes from a source of
another architecture, how a dense layer's projections become NSA's and gated-delta's, the report,
and the refusals. The sources (hf:DIR, params:RUN) and a run started from one are tested in
tests/core/test_export.py, beside the export and HF import whose readers they share."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from aiinfra_jax import surgery
from aiinfra_jax.config import ConfigError, load_config
from aiinfra_jax.export import tensor_shapes
from aiinfra_jax.models import AttnResConfig
from helpers import ROOT

SMALL = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64)


def _cfg(preset: str, **fields):
    model = load_config(str(ROOT / "configs" / f"{preset}.py"), []).model
    return dataclasses.replace(model, **{**SMALL, **fields})


def _random(cfg, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s.shape).astype(s.dtype)
            for k, s in tensor_shapes(cfg).items()}


def test_dense_to_nsa_and_gated_delta_adapts_the_projections():
    dense = _cfg("tiny")
    src = surgery.Source(_random(dense, 0), dense, "dense")
    for preset, names in (("nsa_tiny", ("wq", "wk", "wv", "wo")),
                          ("gdn_tiny", ("w_q", "w_k", "w_v", "w_o"))):
        cfg = _cfg(preset)
        fresh = _random(cfg, 1)
        out, report = surgery.transplant(cfg, fresh, src)
        assert set(out) == set(fresh) and report["unused"] == [] and not report["not_adapted"]
        for i in range(2):
            p = f"layers.{i}.mixer."
            q, k, v, o = (out[p + n] for n in names)
            np.testing.assert_array_equal(q, src.tensors[p + "wq"])
            np.testing.assert_array_equal(o, src.tensors[p + "wo"])
            if preset == "nsa_tiny":  # [D,3,K,Dh]: each branch starts as the dense K/V
                for b in range(3):
                    np.testing.assert_array_equal(k[:, b], src.tensors[p + "wk"])
                    np.testing.assert_array_equal(v[:, b], src.tensors[p + "wv"])
                new = ["w_gate", "b_gate", "cmp_pe", "cmp_w1", "cmp_w2", "cmp_b1", "cmp_b2"]
            else:  # [D,H,Dh] from [D,K,Dh]: query head h reads key/value head h // (H/K)
                for h in range(4):
                    np.testing.assert_array_equal(k[:, h], src.tensors[p + "wk"][:, h // 2])
                    np.testing.assert_array_equal(v[:, h], src.tensors[p + "wv"][:, h // 2])
                new = ["w_a", "w_b", "w_gate", "A_log", "dt_bias", "conv", "o_norm"]
            for n in new:
                assert p + n in report["initialised"]
                np.testing.assert_array_equal(out[p + n], fresh[p + n])
            for n in ("ffn.w_up", "mixer_norm.scale"):
                assert report["copied"][f"layers.{i}.{n}"] == f"layers.{i}.{n}"
        assert report["adapted"]["layers.1.mixer." + names[1]][0] == "layers.1.mixer.wk"
        np.testing.assert_array_equal(out["embed.table"], src.tensors["embed.table"])
    text = surgery.summary(report)
    assert "each head repeated 2x): layers.0-1.mixer.w_k, layers.0-1.mixer.w_v" in text


def test_more_layers_and_tensors_that_do_not_fit():
    dense = _cfg("tiny")
    src = surgery.Source(_random(dense, 0), dense, "dense")
    # Two more layers than the source: initialised, and listed as such.
    deeper = _cfg("tiny", n_layers=4)
    out, report = surgery.transplant(deeper, _random(deeper, 1), src)
    assert "layers.3.mixer.wq" in report["initialised"] and not report["unused"]
    assert "layers.{2-3}.mixer.wq" not in surgery.summary(report)
    assert "layers.2-3.mixer.wq" in surgery.summary(report)
    # Another head width: the gated-delta projections cannot take the dense ones, which are
    # then initialised; the report says why, and lists the dense projections as unused.
    gdn = _cfg("gdn_tiny", head_dim=16)
    fresh = _random(gdn, 1)
    out, report = surgery.transplant(gdn, fresh, src)
    assert report["not_adapted"]["layers.0.mixer.w_q"] == "dense wq [32, 4, 8] does not fit " \
        "[32, 4, 16]"
    np.testing.assert_array_equal(out["layers.0.mixer.w_q"], fresh["layers.0.mixer.w_q"])
    assert "layers.1.mixer.wk" in report["unused"]
    assert "not adapted: layers.0.mixer.w_q: dense wq" in surgery.summary(report)
    # Another vocabulary: the error names the tensor, both shapes and the tokenizer.
    other = _cfg("tiny", vocab_size=128)
    with pytest.raises(ConfigError, match=r"'embed.table' is float32\[64, 32\].*\[128, 32\].*"
                                          "data.tokenizer"):
        surgery.transplant(other, _random(other, 1), src)
    # Settings that change what the same tensors compute are named in the report.
    assert report_differs_nothing(src, deeper)
    llama = dataclasses.replace(dense, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True)
    tied = {k: v for k, v in _random(llama, 0).items() if k != "head.kernel"}
    _, report = surgery.transplant(dense, _random(dense, 1), surgery.Source(tied, llama, "llama"))
    assert report["differs"] == {"model.rope_theta": [500000.0, 10000.0],
                                 "model.norm_eps": [1e-5, 1e-6],
                                 "model.tie_embeddings": [True, False]}
    text = surgery.summary(report)
    assert "NOTE model.rope_theta: the source was trained with 500000.0, this model runs " \
        "10000.0 (set model.rope_theta=500000.0" in text
    assert "its head is the embedding, so this model's head.kernel starts random" in text
    # Nothing shared at all.
    alien = surgery.Source({"x": np.zeros(3, np.float32)}, dense, "alien")
    with pytest.raises(ConfigError, match="no tensor of alien fits"):
        surgery.transplant(dense, _random(dense, 1), alien)


def report_differs_nothing(src, cfg) -> bool:
    return surgery.transplant(cfg, _random(cfg, 1), src)[1]["differs"] == {}


def test_dense_to_msa_and_attnres_copies_by_name():
    """MSA's q/k/v/o and an AttnRes model's whole decoder share the dense names and shapes: copied
    as they are; the routers, the temperature and the depth-attention queries start fresh."""
    dense = _cfg("tiny")
    src = surgery.Source(_random(dense, 0), dense, "dense")
    for fields, new in ((dict(mixers=("msa",)), ("mixer.router_q", "mixer.router_k",
                                                 "mixer.temperature")),
                        (dict(residual="attnres_block", attnres=AttnResConfig(n_blocks=2)),
                         ("residual.queries",))):
        cfg = _cfg("tiny", **fields)
        fresh = _random(cfg, 1)
        out, report = surgery.transplant(cfg, fresh, src)
        assert not report["adapted"] and not report["unused"]
        assert set(report["copied"]) == set(src.tensors)
        for name in src.tensors:
            np.testing.assert_array_equal(out[name], src.tensors[name])
        assert {f"layers.{i}.{n}" for i in range(2) for n in new} <= set(report["initialised"])
        assert set(report["initialised"]) == set(fresh) - set(src.tensors)
