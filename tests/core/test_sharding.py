"""Mesh from config and the logical-axis rules."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from aiinfra_jax import sharding as shd
from aiinfra_jax.config import ConfigError, MeshConfig


def test_mesh_shapes():
    assert len(jax.devices()) == 8
    assert shd.mesh_shape(MeshConfig(), 8) == (8, 1, 1)
    assert shd.mesh_shape(MeshConfig(data=1, fsdp=-1, tensor=2), 8) == (1, 4, 2)
    with pytest.raises(ConfigError, match="do not divide"):
        shd.mesh_shape(MeshConfig(data=-1, fsdp=3), 8)
    with pytest.raises(ConfigError, match="num_devices"):
        shd.mesh_shape(MeshConfig(data=2, fsdp=2, tensor=1), 8)
    mesh = shd.make_mesh(MeshConfig(data=1, fsdp=2, tensor=2, num_devices=4))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="at most one"):
        MeshConfig(data=-1, fsdp=-1)


def test_logical_rules_replicate_what_does_not_divide():
    mesh = shd.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert shd.logical_to_spec(("embed", "mlp"), (64, 128), mesh) == P("fsdp", "tensor")
    # 3 is not divisible by the tensor axis: replicated rather than an error
    assert shd.logical_to_spec(("embed", "heads"), (64, 3), mesh) == P("fsdp", None)
    assert shd.logical_to_spec(("layers", "norm"), (4, 64), mesh) == P(None, None)
    assert shd.logical_to_spec(None, (4,), mesh) == P()
    # a mesh axis is used once per array
    assert shd.logical_to_spec(("heads", "mlp"), (8, 8), mesh) == P("tensor", None)


def test_param_shardings_from_metadata():
    class Toy(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 32)),
                               logical_axes=("embed", "mlp"))
            self.scale = nnx.Param(jnp.ones((16,)), logical_axes=("norm",))

    mesh = shd.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    _, params, _ = nnx.split(nnx.eval_shape(lambda: Toy(nnx.Rngs(0))), nnx.Param, ...)
    sh = shd.param_shardings(params, mesh)
    assert sh["w"].spec == P("fsdp", "tensor")
    assert sh["scale"].spec == P(None)


def test_shard_batch_splits_rows():
    import numpy as np
    mesh = shd.make_mesh(MeshConfig(data=4, fsdp=2))
    batch = {"inputs": np.arange(8 * 5, dtype=np.int32).reshape(8, 5)}
    out = shd.shard_batch(batch, mesh)["inputs"]
    assert out.shape == (8, 5)
    assert len(out.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(out), batch["inputs"])
