"""The "deamoe" FFN (models/deamoe.py): the SwiGLU it reduces to, the three-stage grouped path
against a dense per-expert loop (forward and gradients), the department limit, padding, config
checks, and a tiny end-to-end training run.

Shape letters: B batch, T tokens, N = B*T, D d_model, E experts, G departments, K top_k,
F department width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_expert_parallel_matches_single_device, assert_ffn_matches_reference
from aiinfra_jax.models import ModelConfig, auxiliary
from aiinfra_jax.models.deamoe import DeaMoE, DeaMoEConfig, department_slots
from aiinfra_jax.models.layers import SwiGLU
from aiinfra_jax.models.moe import route

D, F = 16, 8
B, T = 2, 8


def _cfg(**dea) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=D, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32,
                       ffns=("deamoe",), deamoe=DeaMoEConfig(**{"department_d_ff": F, **dea}))


def _module(seed=0, identity=False, **dea) -> DeaMoE:
    """A DeaMoE with numpy-drawn weights larger than init_std (routing far from uniform, outputs
    of order one); private matrices the identity plus noise, or exactly the identity."""
    cfg = _cfg(**dea)
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: DeaMoE(cfg, rngs=nnx.Rngs(0))),
                                       nnx.Param, ...)
    rng = np.random.default_rng(seed)

    def draw(path, s):
        name = jax.tree_util.keystr(path)
        if "w_private" in name:
            eye = np.broadcast_to(np.eye(s.shape[-1]), s.shape)
            return jnp.asarray(eye if identity else eye + rng.normal(0, 0.3, s.shape), s.dtype)
        return jnp.asarray(rng.normal(0, 1.0 if "w_router" in name else 0.4, s.shape), s.dtype)

    nnx.replace_by_pure_dict(params, jax.tree_util.tree_map_with_path(
        draw, nnx.to_pure_dict(params)))
    nnx.replace_by_pure_dict(rest, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                                nnx.to_pure_dict(rest)))
    return nnx.merge(graphdef, params, rest)


def _x(seed=1, shape=(B, T, D)):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _segments():
    seg = np.ones((B, T), np.int32)
    seg[0, 5:] = 0  # right padding in row 0
    seg[1, :3] = 2  # a second document (not padding) in row 1
    return jnp.asarray(seg)


@jax.jit
def _run_and_pop(state, x, seg):
    model = nnx.merge(*state)
    y = model(x, segment_ids=seg)
    return y, auxiliary.pop_outputs(model)


def _aux(m: DeaMoE, x, seg):
    """(y, the outputs m reported), compiled once per config; m is left as it was."""
    return _run_and_pop(nnx.split(m), x, seg)


# ----------------------------------------------------------------------------- special cases


@pytest.mark.parametrize("placement", ["hidden", "gate"])
def test_one_expert_per_department_identity_private_equals_swiglu(placement):
    """Exact configuration: one expert per department (num_experts = num_departments = 4), every
    department's gate, up and down equal to one SwiGLU's, private matrices exactly the identity,
    softmax router with normalize_topk=True and routed_scaling=1 (the top_k = 2 weights sum to 1).
    Then y = sum_k w_k SwiGLU(x) = SwiGLU(x): equal up to float rounding, whatever the routing."""
    m = _module(identity=True, num_experts=4, num_departments=4, top_k=2, department_limit=2,
                private_placement=placement, router="softmax", normalize_topk=True)
    cfg = dataclasses.replace(m.cfg, d_ff=F, ffns=("swiglu",))
    dense = nnx.eval_shape(lambda: SwiGLU(cfg, rngs=nnx.Rngs(0)))
    for name in ("w_gate", "w_up", "w_down"):
        getattr(m, name)[...] = jnp.broadcast_to(getattr(m, name)[0], getattr(m, name).shape)
        getattr(dense, name).set_value(getattr(m, name)[0])
    x = _x()
    y, out = _aux(m, x, None)
    np.testing.assert_allclose(y, dense(x), rtol=1e-5, atol=1e-6)
    ids = np.asarray(out["intermediates"]["expert_ids"]).reshape(-1, 2)
    assert len(np.unique(ids)) > 1  # the tokens really went to different departments


# ----------------------------------------------------------------------------- dense reference


def _dense_reference(p, x_btd, seg, c: DeaMoEConfig):
    """Every expert applied to every token (a Python loop over experts, its department's shared
    weights and its own private matrix as the F x F block matrix diag(P_e, I), each expert with
    its own down projection), combined with the routing weights."""
    x = x_btd.reshape(-1, D)
    logits = x @ p["w_router"]
    scores = jax.nn.softmax(logits, -1) if c.router == "softmax" else jax.nn.sigmoid(logits)
    ids = route(jax.lax.stop_gradient(scores), p.get("bias"), c.top_k, c.num_departments,
                c.limit)
    w = jnp.take_along_axis(scores, ids, 1)
    if c.normalize_topk:
        w = w / w.sum(-1, keepdims=True)
    w = w * c.routed_scaling * (seg.reshape(-1) != 0)[:, None]
    y = jnp.zeros_like(x)
    per = c.num_experts // c.num_departments
    for e in range(c.num_experts):
        g = e // per
        gate, up, priv = x @ p["w_gate"][g], x @ p["w_up"][g], p["w_private"][e]
        k = priv.shape[0]
        block = jnp.eye(F).at[:k, :k].set(priv)
        if c.private_placement == "hidden":
            z = (jax.nn.silu(gate) * up) @ block
        else:
            z = jax.nn.silu(gate @ block) * up
        y = y + (z @ p["w_down"][g]) * jnp.sum(jnp.where(ids == e, w, 0.0), -1)[:, None]
    return y.reshape(x_btd.shape)


CASES = {
    "hidden-softmax-blocked-subspace": dict(private_placement="hidden", router="softmax",
                                            grouped_matmul="blocked", gmm_block=4, num_experts=8,
                                            num_departments=4, top_k=3, department_limit=2,
                                            private_dim=5),
    "gate-sigmoid-ragged-subspace": dict(private_placement="gate", router="sigmoid",
                                         grouped_matmul="ragged_dot", num_experts=8,
                                         num_departments=4, top_k=3, department_limit=2,
                                         routed_scaling=2.5, normalize_topk=False, private_dim=3),
    "hidden-softmax-ragged-full": dict(private_placement="hidden", router="softmax",
                                       grouped_matmul="ragged_dot", num_experts=8,
                                       num_departments=2, top_k=2, department_limit=None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_three_stage_grouped_path_equals_dense_loop_forward_and_grads(case):
    m = _module(**CASES[case])
    c = m.cfg.deamoe
    if m.bias is not None:
        m.bias[...] = jnp.asarray(np.random.default_rng(7).normal(0, 0.2, m.bias.shape),
                                  jnp.float32)
    x, seg = _x(), _segments()
    y1 = assert_ffn_matches_reference(m, lambda p, x, seg: _dense_reference(p, x, seg, c), x, seg,
                                      _x(3), atol=1e-5)
    assert float(jnp.abs(y1).max()) > 0.1
    assert not np.asarray(y1)[np.asarray(seg) == 0].any()  # padding: weight 0, no compute


# ----------------------------------------------------------------------------- routing


def test_department_slots_and_limit():
    dept = jnp.asarray([[2, 0, 2], [1, 1, 1], [3, 0, 1]], jnp.int32)
    pair, slot = department_slots(dept, 3, 4)
    np.testing.assert_array_equal(pair, [[0, 2, 4], [1, 4, 4], [0, 1, 3]])
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(pair), np.asarray(slot), 1),
                                  dept)

    # limit 1: a token's three experts all from one department, though its unconstrained top-3
    # would span several; the "departments" metric counts it.
    m = _module(num_experts=16, num_departments=4, top_k=3, department_limit=1,
                load_balance_weight=0.5, z_loss_weight=0.25)
    x, seg = _x(4, (4, 16, D)), None
    _, out = _aux(m, x, seg)
    ids = np.asarray(out["intermediates"]["expert_ids"]).reshape(-1, 3)
    distinct = np.asarray([len(set(row // 4)) for row in ids])
    assert distinct.max() == 1
    free = np.argsort(-np.asarray(x.reshape(-1, D) @ m.w_router[...]), axis=1)[:, :3]
    assert max(len(set(row // 4)) for row in free) > 1  # the limit binds
    np.testing.assert_allclose(out["metrics"]["departments"], distinct.mean(), rtol=1e-6)
    assert set(out["losses"]) == {"balance_loss", "z_loss"}
    assert {"balance", "router_z", "load_max", "dropped", "router_entropy", "departments"} <= set(
        out["metrics"])
    assert float(out["metrics"]["dropped"]) == 0.0


def test_config_checks_and_flops():
    m = _module(num_experts=8, num_departments=4, top_k=3, department_limit=2)
    assert m.flops_per_token() == 2 * D * 8 + 2 * 6 * D * F + 3 * 2 * F * F
    m = _module(num_experts=8, num_departments=4, top_k=3, department_limit=2, private_dim=4)
    assert m.w_private.shape == (8, 4, 4)
    assert m.flops_per_token() == 2 * D * 8 + 2 * 6 * D * F + 3 * 2 * 4 * 4
    with pytest.raises(ValueError, match="private_dim=9: exceeds the department width 8"):
        _cfg(private_dim=9)
    assert DeaMoEConfig(department_limit=None).limit == 4
    assert ModelConfig(d_model=32, d_ff=128, ffns=("deamoe",)).deamoe.resolved_d_ff(
        ModelConfig(d_model=32, d_ff=128)) == 64  # d_ff // department_limit
    with pytest.raises(ValueError, match="top_k=5: exceeds"):
        DeaMoEConfig(num_experts=8, num_departments=4, top_k=5, department_limit=2)
    with pytest.raises(ValueError, match="num_departments=3: must divide"):
        DeaMoEConfig(num_experts=8, num_departments=3)
    with pytest.raises(ValueError, match="private_placement"):
        DeaMoEConfig(private_placement="after")


# ----------------------------------------------------------------------------- training


def test_tiny_training_run(tmp_path):
    from helpers import tiny

    from aiinfra_jax.train import train

    cfg = tiny(tmp_path, "model.ffns=deamoe", "model.deamoe.router=sigmoid",
               "model.deamoe.num_experts=8", "model.deamoe.gmm_block=64",
               "model.deamoe.private_placement=gate", "run.steps=8", "run.log_every=1",
               "data.val_fraction=0", "checkpoint.every=0", "checkpoint.async_save=false",
               "run.name=deamoe")
    summary = train(cfg, quiet=True)
    hist = summary["history"]
    assert len(hist) == 8 and all(np.isfinite(h["loss"]) for h in hist)
    assert np.mean([h["loss"] for h in hist[-3:]]) < np.mean([h["loss"] for h in hist[:3]])
    last = hist[-1]
    for key in ("aux_loss/ffn/balance_loss", "aux_loss/ffn/z_loss", "aux/ffn/departments",
                "aux/ffn/dropped", "aux/ffn/load_max/layer_1"):
        assert key in last and np.isfinite(last[key]), key
    assert 1.0 <= last["aux/ffn/departments"] <= 2.0 and last["aux/ffn/dropped"] == 0.0


# ----------------------------------------------------------------------------- expert parallelism


@pytest.mark.parametrize("placement,private_dim", [("hidden", 5), ("gate", None)])
def test_department_parallel_on_8_devices_equals_single_device(placement, private_dim):
    """Departments (with their experts) split over the mesh's "expert" axis, (token, department)
    pairs exchanged by all-to-all inside shard_map (models/deamoe.py, _department_parallel), on
    data=2 x expert=2 x tensor=2: equals one device (helpers.assert_expert_parallel_matches_
    single_device), with padding and sigmoid routing with its bias, 2 departments per device."""
    m = _module(num_experts=8, num_departments=4, top_k=3, department_limit=2, router="sigmoid",
                private_placement=placement, private_dim=private_dim, load_balance_weight=0.5,
                z_loss_weight=0.25)
    m.bias[...] = jnp.asarray(np.random.default_rng(7).normal(0, 0.2, 8), jnp.float32)
    assert_expert_parallel_matches_single_device(m, D)
