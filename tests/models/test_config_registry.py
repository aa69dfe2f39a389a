"""ModelConfig validation and the mixer/FFN/residual registries."""

import dataclasses

import pytest

from aiinfra_jax.models import ModelConfig, padded_vocab_size, registry


@pytest.mark.parametrize("overrides, field", [
    (dict(d_model=250, n_heads=4), "n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(mixers=("dense", "nope")), "mixers"),
    (dict(ffns=("bogus",)), "ffns"),
    (dict(residual="weird"), "residual"),
    (dict(mixers=("dense", "dense", "dense"), n_layers=4), "n_layers"),
    (dict(d_model=0), "d_model"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(head_dim=7), "head_dim"),
    (dict(dtype="float64"), "dtype"),
    (dict(param_dtype="int8"), "param_dtype"),
    (dict(remat="sometimes"), "remat"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(mixers=()), "mixers"),
])
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}="):
        ModelConfig(**overrides)


def test_config_error_lists_registered_names():
    with pytest.raises(ValueError, match="dense"):
        ModelConfig(mixers=("nope",))
    with pytest.raises(ValueError, match="remat"):
        ModelConfig(remat="sometimes")


def test_config_defaults_and_derived_sizes():
    cfg = ModelConfig()
    assert cfg.resolved_head_dim == 64
    assert cfg.resolved_d_ff % 64 == 0 and cfg.resolved_d_ff >= 8 * 256 / 3
    cfg = ModelConfig(mixers=["dense", "dense"], ffns=("swiglu", "swiglu", "swiglu"), n_layers=12)
    assert cfg.mixers == ("dense", "dense")  # lists become tuples (hashable)
    assert cfg.block_size == 6 and cfg.n_repeats == 2
    hash(cfg)
    for remat in ("none", "full", "dots_saveable"):
        ModelConfig(remat=remat)


def test_vocab_fill_in():
    assert padded_vocab_size(257) == 384 and padded_vocab_size(256) == 256
    cfg = ModelConfig().with_vocab(1000)
    assert cfg.vocab_size == 1024
    assert dataclasses.replace(ModelConfig(), vocab_size=300).with_vocab(256).vocab_size == 300
    with pytest.raises(ValueError, match="vocab_size"):
        dataclasses.replace(ModelConfig(), vocab_size=100).with_vocab(256)


def test_registry_lookup_and_errors():
    assert registry.get_mixer("dense").__name__ == "DenseAttention"
    assert registry.get_ffn("swiglu").__name__ == "SwiGLU"
    assert registry.get_residual("standard").__name__ == "StandardResidual"
    with pytest.raises(ValueError, match=r"unknown mixer 'x'.*\['dense'"):
        registry.get_mixer("x")
    with pytest.raises(ValueError, match="swiglu"):
        registry.get_ffn("x")
    with pytest.raises(ValueError, match="standard"):
        registry.get_residual("x")


def test_registering_a_name_twice_fails():
    class Other:
        pass

    with pytest.raises(ValueError, match="already registered"):
        registry.register_mixer("dense")(Other)
    # Re-registering the same class (a module re-import) is allowed.
    cls = registry.get_mixer("dense")
    assert registry.register_mixer("dense")(cls) is cls
