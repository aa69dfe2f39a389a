"""NSA and Attention Residuals training steps with their Pallas kernels (interpret mode) on a
data x fsdp x tensor mesh of 8 simulated CPU devices equal the single-device XLA step: the loss and
every parameter's gradient, at the kernels' tolerances. The kernels run inside shard_map (batch
and heads split), which the jaxpr must show."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from aiinfra_jax import sharding as shd
from aiinfra_jax import steps
from aiinfra_jax.config import MeshConfig
from aiinfra_jax.models import AttnResConfig, ModelConfig, NSAConfig, Transformer

B, T = 4, 64
NSA = NSAConfig(cmp_block_len=8, cmp_stride=4, sel_block_size=16, n_selected=3, n_init=1,
                n_local=1, window=16)
BASE = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                   max_seq_len=T)
CASES = {
    # One NSA layer: the kernels and their shard_map are the same in every layer.
    "nsa": (dataclasses.replace(BASE, mixers=("nsa",), nsa=NSA, n_layers=1), "nsa"),
    "attnres": (dataclasses.replace(BASE, residual="attnres_block",
                                    attnres=AttnResConfig(n_blocks=2)), "attnres"),
}
SHARDED = MeshConfig(data=2, fsdp=2, tensor=2)


def _batch():
    rng = np.random.default_rng()
    tokens = rng.integers(1, 128, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[1, 40:] = 2  # a second document in one row
    seg[2, 50:] = 0  # right padding
    pos = np.where(seg == 2, np.arange(T) - 40, np.arange(T)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": pos,
            "segment_ids": seg, "loss_weights": (seg != 0).astype(np.float32)}


def _loss_and_grads(model_cfg, mesh_cfg, params, batch):
    mesh = shd.make_mesh(mesh_cfg)
    graphdef, abstract_params, rest = steps.abstract_model(model_cfg)

    def loss(params, batch):
        model = steps.merge_model(graphdef, abstract_params, rest, params)
        nll_sum, aux_loss, stats, _ = steps.loss_and_stats(model, batch)
        return nll_sum / stats["weight_sum"] + aux_loss

    fn = shd.with_activation_rules(jax.value_and_grad(loss), mesh)
    params = jax.device_put(params, shd.param_shardings(abstract_params, mesh))
    sharded_batch = shd.shard_batch(batch, mesh)
    jaxpr = jax.make_jaxpr(fn)(params, sharded_batch)
    value, grads = jax.jit(fn)(params, sharded_batch)
    return float(value), jax.device_get(grads), str(jaxpr).count("shard_map")


@pytest.mark.parametrize("case", sorted(CASES))
def test_pallas_step_on_a_mesh_equals_the_single_device_xla_step(case):
    model_cfg, key = CASES[case]
    params, _ = steps.init_variables(Transformer(model_cfg, rngs=nnx.Rngs(0)))
    batch = _batch()
    xla_cfg = dataclasses.replace(model_cfg, **{key: dataclasses.replace(
        getattr(model_cfg, key), implementation="xla")})
    pallas_cfg = dataclasses.replace(model_cfg, **{key: dataclasses.replace(
        getattr(model_cfg, key), implementation="pallas_gpu", interpret=True)})
    ref_loss, ref_grads, ref_maps = _loss_and_grads(xla_cfg, MeshConfig(num_devices=1), params,
                                                    batch)
    loss, grads, maps = _loss_and_grads(pallas_cfg, SHARDED, params, batch)
    assert ref_maps == 0 and maps > 0  # the kernels ran inside shard_map on the mesh
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    flat_ref = jax.tree_util.tree_flatten_with_path(ref_grads)[0]
    flat = jax.tree.leaves(grads)
    for (path, g_ref), g in zip(flat_ref, flat):
        scale = float(np.sqrt(np.mean(np.square(g_ref)))) + 1e-12
        err = float(np.sqrt(np.mean(np.square(np.asarray(g) - g_ref)))) / scale
        assert err < 2e-4, f"{jax.tree_util.keystr(path)}: rms-relative gradient error {err:.2e}"
