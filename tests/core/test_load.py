"""load_model: a checkpoint for inference without the trainer (params only, run-time overrides)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from aiinfra_jax.checkpoint import Checkpointer, NoCheckpointError
from aiinfra_jax.config import Config, ConfigError, MeshConfig, to_dict
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.load import load_model
from aiinfra_jax.models import ModelConfig, NSAConfig, Transformer
from aiinfra_jax.steps import init_variables

CFG = Config(
    data=DataConfig(seq_len=128),
    model=ModelConfig(vocab_size=384, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                      mixers=("nsa",), max_seq_len=128,
                      nsa=NSAConfig(cmp_block_len=8, cmp_stride=4, sel_block_size=16,
                                    n_selected=3, n_init=1, n_local=1, window=16)),
    mesh=MeshConfig(num_devices=1))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with one checkpoint (step 7) written the way the trainer writes it."""
    root = tmp_path_factory.mktemp("run")
    model = Transformer(CFG.model, rngs=nnx.Rngs(3))
    params, _ = init_variables(model)
    opt = optax.adam(1e-3)
    state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(7),
             "bad_step": jnp.int32(0)}
    with Checkpointer(root / "checkpoints", config=to_dict(CFG), async_save=False) as ckpt:
        ckpt.save(7, state, None, force=True)
    return root, model


def _logits(model, tokens):
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return np.asarray(jax.jit(lambda m: m(tokens, positions=pos)[0])(model))


def test_loads_params_only_and_matches_the_saved_model(run_dir):
    root, model = run_dir
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (1, 48)), jnp.int32)
    for source in (root, root / "checkpoints", root / "checkpoints" / "7"):
        loaded = load_model(source)
        assert loaded.step == 7 and loaded.tokenizer.vocab_size == 259
        assert loaded.config.model == CFG.model
        np.testing.assert_array_equal(_logits(loaded.model, tokens), _logits(model, tokens))
    # Run-time settings may change (printed by the checkpoint check, not refused).
    loaded = load_model(root, overrides=["model.nsa.implementation=pallas_tpu",
                                         "model.nsa.interpret=true", "model.remat=full"])
    assert loaded.config.model.nsa.implementation == "pallas_tpu"
    np.testing.assert_allclose(_logits(loaded.model, tokens), _logits(model, tokens), rtol=2e-5,
                               atol=2e-5)


def test_refuses_architecture_overrides_and_missing_sources(run_dir, tmp_path):
    root, _ = run_dir
    with pytest.raises(ConfigError, match=r"(?s)only run-time settings.*model.nsa.window: checkpoint 16"):
        load_model(root, overrides=["model.nsa.window=32"])
    with pytest.raises(ConfigError, match="no such directory"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(NoCheckpointError):
        load_model(tmp_path / "empty")
    with pytest.raises(ValueError, match="no committed checkpoint for step 3"):
        load_model(root, step=3)
