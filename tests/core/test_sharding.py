"""Mesh from config (data, fsdp, expert, context, tensor axes), the logical-axis rules, batch
sharding, and activation constraints (models.partitioning.constrain under shd.activation_rules)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core.spmd import get_logical_axis_rules
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from aiinfra_jax import sharding as shd
from aiinfra_jax.config import ConfigError, MeshConfig, from_dict, to_dict
from aiinfra_jax.models.partitioning import constrain, logical_spec


def sizes(cfg: MeshConfig, n: int = 8) -> dict[str, int]:
    """mesh_shape as {axis: size}, without the axes of size 1."""
    return {a: s for a, s in zip(shd.MESH_AXES, shd.mesh_shape(cfg, n)) if s > 1}


def mesh(**axes):
    return shd.make_mesh(MeshConfig(**axes))


# ------------------------------------------------------------------------------------- mesh


def test_mesh_axes_are_the_config_fields():
    assert shd.MESH_AXES == MeshConfig.axis_names() == ("data", "fsdp", "expert", "context",
                                                        "tensor")
    fields = {f.name for f in dataclasses.fields(MeshConfig)}
    assert set(shd.MESH_AXES) <= fields
    assert MeshConfig(expert=2).axis_sizes() == {"data": -1, "fsdp": 1, "expert": 2, "context": 1,
                                                 "tensor": 1}


def test_mesh_shapes():
    assert len(jax.devices()) == 8
    assert shd.mesh_shape(MeshConfig(), 8) == (8, 1, 1, 1, 1)
    assert sizes(MeshConfig(data=1, fsdp=-1, tensor=2)) == {"fsdp": 4, "tensor": 2}
    assert sizes(MeshConfig(data=-1, expert=2, context=2)) == {"data": 2, "expert": 2,
                                                               "context": 2}
    assert sizes(MeshConfig(data=2, expert=-1)) == {"data": 2, "expert": 4}
    assert sizes(MeshConfig(data=1, context=-1, tensor=2)) == {"context": 4, "tensor": 2}
    with pytest.raises(ConfigError, match=r"do not divide.*mesh\.data=-1.*num_devices"):
        shd.mesh_shape(MeshConfig(data=-1, fsdp=3), 8)
    with pytest.raises(ConfigError, match=r"data\*fsdp\*expert\*context\*tensor = 4.*"
                                          r"num_devices=4"):
        shd.mesh_shape(MeshConfig(data=2, fsdp=2, tensor=1), 8)
    with pytest.raises(ConfigError, match=r"data\*fsdp\*expert\*context\*tensor = 16"):
        shd.mesh_shape(MeshConfig(data=2, expert=2, context=2, tensor=2), 8)
    m = shd.make_mesh(MeshConfig(data=1, fsdp=2, tensor=2, num_devices=4))
    assert dict(m.shape) == {"data": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    m = shd.make_mesh(MeshConfig(data=2, expert=2, context=2))
    assert m.axis_names == shd.MESH_AXES
    assert dict(m.shape) == {"data": 2, "fsdp": 1, "expert": 2, "context": 2, "tensor": 1}


def test_mesh_config_validation_names_the_axis():
    with pytest.raises(ValueError, match="at most one"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="at most one"):
        MeshConfig(data=-1, context=-1)
    with pytest.raises(ConfigError, match=r"mesh\.expert=0"):
        MeshConfig(expert=0)
    with pytest.raises(ConfigError, match=r"mesh\.context=-2"):
        MeshConfig(context=-2)


def test_todays_configs_keep_their_mesh():
    # a config.json written before the expert/context axes loads, and its mesh is the same
    # devices in the same places, with two extra axes of size 1
    cfg = from_dict({"mesh": {"data": 2, "fsdp": 2, "tensor": 2}}).mesh
    assert (cfg.expert, cfg.context) == (1, 1)
    assert to_dict(from_dict({"mesh": {"data": 2}}))["mesh"]["expert"] == 1
    devices = jax.devices()
    try:
        before = mesh_utils.create_device_mesh((2, 2, 2), devices=devices)
    except Exception:
        before = np.asarray(devices, dtype=object).reshape(2, 2, 2)
    m = shd.make_mesh(cfg)
    np.testing.assert_array_equal(m.devices.reshape(2, 2, 2), before)
    # old parameter and batch shardings are unchanged
    assert shd.logical_to_spec(("embed", "mlp"), (64, 128), m) == P("fsdp", "tensor")
    assert shd.data_parallel_size(m) == 4


# ------------------------------------------------------------------------------------- rules


def test_logical_rules_replicate_what_does_not_divide():
    m = mesh(data=2, fsdp=2, tensor=2)
    assert shd.logical_to_spec(("embed", "mlp"), (64, 128), m) == P("fsdp", "tensor")
    # 3 is not divisible by the tensor axis: replicated rather than an error
    assert shd.logical_to_spec(("embed", "heads"), (64, 3), m) == P("fsdp", None)
    assert shd.logical_to_spec(("layers", "norm"), (4, 64), m) == P(None, None)
    assert shd.logical_to_spec(None, (4,), m) == P()
    # a mesh axis is used once per array
    assert shd.logical_to_spec(("heads", "mlp"), (8, 8), m) == P("tensor", None)
    with pytest.raises(ValueError, match="shape"):
        shd.logical_to_spec(("embed",), (4, 4), m)


def test_rules_for_expert_weights_and_sequences():
    m = mesh(data=1, fsdp=2, expert=2, tensor=2)
    # expert weights [E, D, F] and [E, F, D]
    assert shd.logical_to_spec(("expert", "embed", "mlp"), (4, 16, 32), m) == P("expert", "fsdp",
                                                                              "tensor")
    assert shd.logical_to_spec(("layers", "expert", "mlp", "embed"), (2, 4, 32, 16), m) == P(
        None, "expert", "tensor", "fsdp")
    # the router [D, E] is small: its expert dimension is not split when 2 does not divide it
    assert shd.logical_to_spec(("embed", "expert"), (16, 3), m) == P("fsdp", None)
    # activations: rows over every data-parallel axis of size > 1 (expert too), heads over tensor
    assert shd.logical_to_spec(("batch", "seq", "heads", "head_dim"), (8, 16, 4, 8), m) == P(
        ("fsdp", "expert"), None, "tensor", None)
    m = mesh(data=2, fsdp=2, context=2)
    for seq in ("seq", "length"):
        assert shd.logical_to_spec(("batch", seq, "embed"), (4, 16, 32), m) == P(
            ("data", "fsdp"), "context", None)
    # rows that the data axes do not divide stay whole; then the free fsdp axis takes "embed"
    assert shd.logical_to_spec(("batch", "seq", "embed"), (3, 16, 32), m) == P(
        None, "context", "fsdp")


def test_logical_spec_takes_flax_rules_with_fallbacks():
    rules = (("batch", ("data", "fsdp")), ("batch", "data"), ("embed", None), ("mlp", "tensor"))
    mesh_sizes = {"data": 2, "fsdp": 4, "tensor": 2}
    assert logical_spec(("batch", "mlp"), (8, 4), mesh_sizes, rules) == P(("data", "fsdp"),
                                                                          "tensor")
    # 2 rows do not split 8 ways (data*fsdp) but do split 2 ways: the second rule for "batch"
    assert logical_spec(("batch", "embed"), (2, 4), mesh_sizes, rules) == P("data", None)
    assert logical_spec((None, "unknown"), (2, 4), mesh_sizes, rules) == P(None, None)


def test_param_shardings_from_metadata():
    class Toy(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 32)),
                               logical_axes=("embed", "mlp"))
            self.experts = nnx.Param(jax.random.normal(rngs.params(), (2, 16, 32)),
                                     logical_axes=("expert", "embed", "mlp"))
            self.scale = nnx.Param(jnp.ones((16,)), logical_axes=("norm",))

    m = mesh(data=1, fsdp=2, expert=2, tensor=2)
    _, params, _ = nnx.split(nnx.eval_shape(lambda: Toy(nnx.Rngs(0))), nnx.Param, ...)
    sh = shd.param_shardings(params, m)
    assert sh["w"].spec == P("fsdp", "tensor")
    assert sh["experts"].spec == P("expert", "fsdp", "tensor")
    assert sh["scale"].spec == P(None)


# ------------------------------------------------------------------------------------- batches


def test_shard_batch_splits_rows():
    m = mesh(data=4, fsdp=2)
    batch = {"inputs": np.arange(8 * 5, dtype=np.int32).reshape(8, 5)}
    out = shd.shard_batch(batch, m)["inputs"]
    assert out.shape == (8, 5)
    assert len(out.addressable_shards) == 8
    assert {s.data.shape for s in out.addressable_shards} == {(1, 5)}
    np.testing.assert_array_equal(np.asarray(out), batch["inputs"])


def test_batch_rows_over_data_fsdp_expert():
    m = mesh(data=2, fsdp=2, expert=2)
    assert shd.batch_spec(m) == P(("data", "fsdp", "expert"))
    assert shd.data_parallel_size(m) == 8
    assert shd.context_parallel_size(m) == 1
    rows = np.random.default_rng(0).integers(0, 100, (8, 6)).astype(np.int32)
    out = shd.shard_batch({"inputs": rows}, m)["inputs"]
    assert {s.data.shape for s in out.addressable_shards} == {(1, 6)}
    np.testing.assert_array_equal(np.asarray(out), rows)


def test_batch_sequence_over_context():
    m = mesh(data=2, expert=2, context=2)
    assert shd.batch_spec(m) == P(("data", "fsdp", "expert"), "context")
    assert shd.data_parallel_size(m) == 4
    assert shd.context_parallel_size(m) == 2
    rows = np.random.default_rng(1).integers(0, 100, (4, 6)).astype(np.int32)
    out = shd.shard_batch({"inputs": rows, "positions": rows + 1}, m)
    assert {s.data.shape for s in out["inputs"].addressable_shards} == {(1, 3)}
    np.testing.assert_array_equal(np.asarray(out["positions"]), rows + 1)
    with pytest.raises(ValueError, match="seq_len"):
        shd.shard_batch({"inputs": rows[:, :5]}, m)


# ------------------------------------------------------------------------------------- constrain


def _has_constraint(fn, *args) -> bool:
    return "sharding_constraint" in str(jax.make_jaxpr(fn)(*args))


def test_constrain_is_a_no_op_without_mesh_or_rules():
    x = jax.random.normal(jax.random.key(0), (4, 8, 16))
    axes = ("batch", "seq", "embed")
    f = lambda a: constrain(a * 2, axes)  # noqa: E731
    assert constrain(x, axes) is x
    assert not _has_constraint(f, x)
    m = mesh(data=2, fsdp=2, tensor=2)
    with jax.set_mesh(m):  # a mesh but no rules
        assert constrain(x, axes) is x
        assert not _has_constraint(f, x)
    with nnx.logical_axis_rules(shd.rules_for_flax()):  # rules but no mesh
        assert constrain(x, axes) is x
        assert not _has_constraint(f, x)
    with shd.activation_rules(shd.make_mesh(MeshConfig(num_devices=1))):  # one device
        assert constrain(x, axes) is x
        assert not _has_constraint(f, x)


def test_constrain_under_activation_rules_in_jit():
    m = mesh(data=2, fsdp=2, tensor=2)
    x = jax.random.normal(jax.random.key(1), (4, 8, 6, 4))
    axes = ("batch", "seq", "heads", "head_dim")
    want = P(("data", "fsdp"), None, "tensor", None)

    @jax.jit
    def f(a):
        return constrain(jnp.sin(a), axes)

    with shd.activation_rules(m):
        assert _has_constraint(f, x)
        y = f(x)
        assert constrain(x, axes) is x  # eager: nothing to tell a compiler
        z = jax.jit(lambda a: constrain(a, ("batch", "seq", "embed", "head_dim")))(x)
        with pytest.raises(ValueError, match="shape"):
            jax.jit(lambda a: constrain(a, ("batch", "seq")))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(m, want), 4)
    assert {s.data.shape for s in y.addressable_shards} == {(1, 8, 3, 4)}
    np.testing.assert_allclose(np.asarray(y), np.sin(np.asarray(x)), rtol=1e-6)
    # the residual stream's "embed" takes no axis: fsdp is already used by the rows
    assert z.sharding.is_equivalent_to(NamedSharding(m, P(("data", "fsdp"), None, None, None)), 4)
    assert jax.sharding.get_abstract_mesh().empty  # the context is gone afterwards
    m = mesh(data=2, context=4)
    with shd.activation_rules(m):  # the sequence split over "context"
        y = jax.jit(lambda a: constrain(a + 1, axes))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(m, P("data", "context", None, None)), 4)
    assert {s.data.shape for s in y.addressable_shards} == {(2, 2, 6, 4)}


def test_with_activation_rules_sets_the_context_only_inside_the_trace():
    m = mesh(data=2, fsdp=2, tensor=2)
    x = jax.device_put(jax.random.normal(jax.random.key(3), (4, 8, 6, 4)), NamedSharding(m, P()))
    axes = ("batch", "seq", "heads", "head_dim")
    step = jax.jit(shd.with_activation_rules(lambda a: constrain(jnp.cos(a), axes), m))
    assert _has_constraint(step, x)
    y = step(x)
    assert y.sharding.is_equivalent_to(NamedSharding(m, P(("data", "fsdp"), None, "tensor")), 4)
    np.testing.assert_allclose(np.asarray(y), np.cos(np.asarray(x)), rtol=1e-6)
    # nothing is left set outside: no mesh, no rules, and a jit on other devices runs as before
    assert jax.sharding.get_abstract_mesh().empty
    assert not get_logical_axis_rules()
    one = shd.with_activation_rules(lambda a: a + 1, shd.make_mesh(MeshConfig(num_devices=1)))
    z = jax.jit(one)(jax.device_put(jnp.ones((8, 2)), NamedSharding(m, P(("data", "fsdp")))))
    assert len(z.sharding.device_set) == 8


class _Toy(nnx.Module):
    """x [B,T,D] -> x + gelu(x W_in) W_out, with the activation constraints of a real layer."""

    def __init__(self, rngs: nnx.Rngs, d: int = 16, f: int = 32):
        self.w_in = nnx.Param(jax.random.normal(rngs.params(), (d, f)) / d ** 0.5,
                              logical_axes=("embed", "mlp"))
        self.w_out = nnx.Param(jax.random.normal(rngs.params(), (f, d)) / f ** 0.5,
                               logical_axes=("mlp", "embed"))
        self.scale = nnx.Param(1 + 0.1 * jax.random.normal(rngs.params(), (d,)),
                               logical_axes=("norm",))

    def __call__(self, x_btd):
        x_btd = constrain(x_btd, ("batch", "seq", "embed"))
        h_btf = constrain(jax.nn.gelu(x_btd @ self.w_in[...]), ("batch", "seq", "mlp"))
        y_btd = x_btd + (h_btf @ self.w_out[...]) * self.scale[...]
        return constrain(y_btd, ("batch", "seq", "embed"))


def test_sharded_forward_and_grads_match_unsharded():
    graphdef, state = nnx.split(_Toy(nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    x = jax.random.normal(jax.random.key(2), (8, 4, 16))

    def loss(p, x_btd):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, p)
        y = nnx.merge(graphdef, st)(x_btd)
        return jnp.mean(jnp.square(y)), y

    grad_fn = jax.value_and_grad(loss, has_aux=True)
    (ref_loss, ref_y), ref_grads = jax.jit(grad_fn)(params, x)

    m = mesh(data=2, fsdp=2, tensor=2)
    p_sh = shd.param_shardings(state, m)
    assert p_sh["w_in"].spec == P("fsdp", "tensor")
    batch_sh = NamedSharding(m, P(shd.BATCH_AXES))
    # as the trainer would: the step wrapped, jitted with the parameter and batch shardings
    step = jax.jit(shd.with_activation_rules(grad_fn, m), in_shardings=(p_sh, batch_sh))
    p, xs = jax.device_put(params, p_sh), jax.device_put(x, batch_sh)
    assert str(jax.make_jaxpr(step)(p, xs)).count("sharding_constraint") >= 3
    (got_loss, got_y), got_grads = step(p, xs)
    assert got_y.sharding.is_equivalent_to(NamedSharding(m, P(("data", "fsdp"))), 3)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(ref_y), rtol=1e-5, atol=1e-6)
    for k in params:
        np.testing.assert_allclose(np.asarray(got_grads[k]), np.asarray(ref_grads[k]),
                                   rtol=1e-4, atol=1e-6)
