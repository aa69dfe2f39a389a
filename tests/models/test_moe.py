"""The "moe" FFN (models/moe.py): routing against a numpy reference, the dropless grouped matmuls
against a dense per-expert loop (forward and gradients), auxiliary losses, padding, the
aux-loss-free bias, the one-expert case, expert parallelism on 8 simulated devices against one
device, and a tiny end-to-end training run.

Shape letters: B batch, T tokens, N = B*T, D d_model, E experts, K top_k, F expert width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_expert_parallel_matches_single_device, assert_ffn_matches_reference
from aiinfra_jax.config import runtime_keys
from aiinfra_jax.models import ModelConfig, auxiliary
from aiinfra_jax.models.layers import SwiGLU
from aiinfra_jax.models.moe import MoE, MoEConfig, grouped_matmul, route

D, F = 16, 8
B, T = 2, 8


def _cfg(**moe) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=D, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32,
                       ffns=("moe",), moe=MoEConfig(**{"expert_d_ff": F, **moe}))


def _filled(make, seed: int, scale) -> nnx.Module:
    """The module `make()` builds, its parameters drawn with numpy (normal, std scale(path)) and
    its other variables zero: nothing runs eagerly in JAX, so nothing compiles op by op."""
    graphdef, params, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    rng = np.random.default_rng(seed)
    nnx.replace_by_pure_dict(params, jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.asarray(rng.normal(0, scale(jax.tree_util.keystr(path)), s.shape),
                                    s.dtype), nnx.to_pure_dict(params)))
    nnx.replace_by_pure_dict(rest, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                                nnx.to_pure_dict(rest)))
    return nnx.merge(graphdef, params, rest)


def _module(seed=0, **moe) -> MoE:
    """A MoE whose weights are larger than init_std: routing far from uniform, outputs of order
    one."""
    cfg = _cfg(**moe)
    return _filled(lambda: MoE(cfg, rngs=nnx.Rngs(0)), seed,
                   lambda name: 1.0 if "w_router" in name else 0.4)


def _x(seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, T, D)), jnp.float32)


@nnx.jit
def _call(m: MoE, x, seg, rngs=None):
    """m(x) compiled; the module's updates (bias, reported outputs) are written back to it."""
    return m(x, segment_ids=seg, rngs=rngs)


def _segments():
    seg = np.ones((B, T), np.int32)
    seg[0, 5:] = 0  # right padding in row 0
    seg[1, :3] = 2  # a second document (not padding) in row 1
    return jnp.asarray(seg)


# ----------------------------------------------------------------------------- routing


def _np_route(scores, bias, k, n_groups, topk_groups):
    """Plain numpy: per token, the groups by the sum of their best two biased scores, then the
    top-k experts of the chosen groups."""
    choice = scores + (0 if bias is None else bias)
    n, e = choice.shape
    size = e // n_groups
    out = []
    for row in choice:
        allowed = np.ones(e, bool)
        if n_groups > 1:
            gs = [np.sort(row[g * size:(g + 1) * size])[::-1][:min(2, size)].sum()
                  for g in range(n_groups)]
            keep = np.argsort(gs)[::-1][:topk_groups]
            allowed = np.repeat(np.isin(np.arange(n_groups), keep), size)
        masked = np.where(allowed, row, -np.inf)
        out.append(sorted(np.argsort(masked)[::-1][:k]))
    return np.asarray(out)


@pytest.mark.parametrize("k,n_groups,topk_groups,with_bias",
                         [(2, 1, 1, False), (3, 4, 2, True), (2, 8, 3, True), (4, 2, 2, False)])
def test_route_matches_numpy(k, n_groups, topk_groups, with_bias):
    rng = np.random.default_rng(k * 10 + n_groups)
    scores = rng.random((32, 8)).astype(np.float32)
    bias = rng.normal(0, 0.3, 8).astype(np.float32) if with_bias else None
    routed = jax.jit(route, static_argnums=(2, 3, 4))  # one compile, not one per op
    ids = np.sort(np.asarray(routed(jnp.asarray(scores),
                                    None if bias is None else jnp.asarray(bias),
                                    k, n_groups, topk_groups)), axis=1)
    np.testing.assert_array_equal(ids, _np_route(scores, bias, k, n_groups, topk_groups))


def test_bias_chooses_but_does_not_weight_and_moves_toward_balance():
    rate = 0.01
    m = _module(router="sigmoid", bias_update_rate=rate, num_experts=8, top_k=2)
    big = np.zeros(8, np.float32)
    big[3] = 100.0
    m.bias[...] = jnp.asarray(big)  # expert 3 always chosen
    x, seg = _x(), _segments()
    y = _call(m, x, seg)  # no rngs: not training, the bias stays
    ids = np.asarray(m.expert_ids[...]).reshape(-1, 2)
    assert (ids == 3).any(axis=1).all()
    np.testing.assert_array_equal(m.bias[...], big)
    # The weight of expert 3 is its sigmoid score (normalised over the two), not 100 + score.
    logits = np.asarray(x.reshape(-1, D) @ m.w_router[...])
    s = 1 / (1 + np.exp(-logits))
    other = np.where(ids[:, 0] == 3, ids[:, 1], ids[:, 0])
    w3 = s[np.arange(len(s)), 3] / (s[np.arange(len(s)), 3] + s[np.arange(len(s)), other])
    assert np.all(w3 < 1.0) and np.all(w3 > 0.0)
    assert np.isfinite(np.asarray(y)).all()

    # Training call (rngs): bias += rate * sign(mean load - load), counted over real tokens only.
    m.bias[...] = jnp.asarray(np.zeros(8, np.float32))
    _call(m, x, seg, nnx.Rngs(0))
    ids = np.asarray(m.expert_ids[...]).reshape(-1, 2)
    real = np.asarray(seg).reshape(-1) != 0
    counts = np.bincount(ids[real].reshape(-1), minlength=8).astype(np.float32)
    np.testing.assert_allclose(m.bias[...], rate * np.sign(counts.mean() - counts), atol=1e-7)
    assert (np.asarray(m.bias[...]) != 0).any()


# ----------------------------------------------------------------------------- dense reference


def _dense_reference(params, x_btd, seg, c: MoEConfig):
    """Every expert applied to every token (a Python loop over experts), combined with the routing
    weights; shared experts as a SwiGLU of the shared weights."""
    x = x_btd.reshape(-1, D)
    logits = x @ params["w_router"]
    scores = jax.nn.softmax(logits, -1) if c.router == "softmax" else jax.nn.sigmoid(logits)
    bias = params.get("bias")
    ids = route(jax.lax.stop_gradient(scores), bias, c.top_k, c.n_groups, c.topk_groups)
    w = jnp.take_along_axis(scores, ids, 1)
    if c.normalize_topk:
        w = w / w.sum(-1, keepdims=True)
    w = w * c.routed_scaling * (seg.reshape(-1) != 0)[:, None]
    y = jnp.zeros_like(x)
    for e in range(c.num_experts):
        h = jax.nn.silu(x @ params["w_gate"][e]) * (x @ params["w_up"][e])
        y = y + (h @ params["w_down"][e]) * jnp.sum(jnp.where(ids == e, w, 0.0), -1)[:, None]
    if "shared" in params:
        s = params["shared"]
        y = y + (jax.nn.silu(x @ s["w_gate"]) * (x @ s["w_up"])) @ s["w_down"]
    return y.reshape(x_btd.shape)


CASES = {
    "ragged_dot-softmax": dict(grouped_matmul="ragged_dot", router="softmax", num_experts=4,
                               top_k=2, normalize_topk=False),
    "blocked-sigmoid-groups-shared": dict(grouped_matmul="blocked", gmm_block=4, router="sigmoid",
                                          num_experts=8, top_k=3, n_groups=4, topk_groups=2,
                                          num_shared_experts=1, routed_scaling=2.5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dropless_grouped_matmul_equals_dense_loop_forward_and_grads(case):
    moe = CASES[case]
    m = _module(**moe)
    c = m.cfg.moe
    if m.bias is not None:
        m.bias[...] = jnp.asarray(np.random.default_rng(7).normal(0, 0.2, m.bias.shape),
                                  jnp.float32)
    x, seg = _x(), _segments()
    y1 = assert_ffn_matches_reference(m, lambda p, x, seg: _dense_reference(p, x, seg, c), x, seg,
                                      _x(3), atol=1e-6)
    assert float(jnp.abs(y1).max()) > 0.1


@pytest.mark.parametrize("implementation", ["ragged_dot", "blocked", None])
def test_grouped_matmul_rows_past_the_groups_are_zero(implementation):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(13, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)
    sizes = jnp.asarray([4, 0, 6], jnp.int32)  # an empty group; rows 10..12 in no group
    y = jax.jit(grouped_matmul, static_argnums=(3, 4))(x, w, sizes, implementation, 4)
    ref = np.concatenate([x[:4] @ w[0], x[4:10] @ w[2], np.zeros((3, 4))])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- aux and padding


@jax.jit
def _run_and_pop(state, x, seg):
    model = nnx.merge(*state)
    y = model(x, segment_ids=seg)
    return y, auxiliary.pop_outputs(model)


def _aux(m: MoE, x, seg):
    """(y, the outputs m reported), compiled once per config; m is left as it was."""
    graphdef, state = nnx.split(m)
    return _run_and_pop((graphdef, state), x, seg)


def test_balance_loss_alone_reaches_the_router():
    m = _module(num_experts=4, top_k=1, load_balance_weight=1.0, z_loss_weight=0.0)
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    x, seg = _x(), _segments()

    def balance(p):
        model = nnx.merge(graphdef, p, rest)
        model(x, segment_ids=seg)
        out = auxiliary.pop_outputs(model)
        assert set(out["losses"]) == {"balance_loss"}  # weight 0: the z-loss is not a loss
        assert {"router_z", "balance", "load_max", "dropped", "router_entropy"} <= set(
            out["metrics"])
        return out["losses"]["balance_loss"]

    g = nnx.to_pure_dict(jax.jit(jax.grad(balance))(params))
    assert float(jnp.abs(g["w_router"]).max()) > 1e-6
    assert float(jnp.abs(g["w_gate"]).max()) == 0.0  # experts: only the LM loss trains them


def test_metrics_against_numpy():
    m = _module(num_experts=4, top_k=2, load_balance_weight=0.5, z_loss_weight=0.25)
    x, seg = _x(), _segments()
    _, out = _aux(m, x, seg)
    real = np.asarray(seg).reshape(-1) != 0
    logits = np.asarray(x.reshape(-1, D) @ m.w_router[...], np.float64)[real]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=1)[:, :2]
    f = np.bincount(top.reshape(-1), minlength=4) / top.size
    balance = 4 * np.sum(f * p.mean(0))
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(out["losses"]["balance_loss"], 0.5 * balance, rtol=1e-5)
    np.testing.assert_allclose(out["losses"]["z_loss"], 0.25 * np.mean(lse ** 2), rtol=1e-5)
    np.testing.assert_allclose(out["metrics"]["load_max"], 4 * f.max(), rtol=1e-6)
    np.testing.assert_allclose(out["metrics"]["router_entropy"],
                               np.mean(-np.sum(p * np.log(p), -1)), rtol=1e-5)
    assert float(out["metrics"]["dropped"]) == 0.0
    np.testing.assert_array_equal(np.sort(np.asarray(out["intermediates"]["expert_ids"])
                                          .reshape(-1, 2)[real], 1), np.sort(top, 1))


def test_padding_is_never_routed_and_changes_nothing_else():
    m = _module(num_experts=4, top_k=2, load_balance_weight=0.5, z_loss_weight=0.25)
    x, seg = _x(), _segments()
    pad = np.asarray(seg) == 0
    y1, out1 = _aux(m, x, seg)
    x2 = jnp.where(jnp.asarray(pad)[..., None], 50.0 * _x(9), x)  # other tokens in the padding
    y2, out2 = _aux(m, x2, seg)
    np.testing.assert_array_equal(np.asarray(y1)[~pad], np.asarray(y2)[~pad])
    assert not np.asarray(y1)[pad].any() and not np.asarray(y2)[pad].any()  # weight 0, no compute
    for kind in ("losses", "metrics"):
        for name, v in out1[kind].items():
            np.testing.assert_array_equal(v, out2[kind][name], err_msg=name)


# ----------------------------------------------------------------------------- special cases


def test_one_expert_top1_softmax_equals_swiglu():
    m = _module(num_experts=1, top_k=1, router="softmax")
    cfg = dataclasses.replace(m.cfg, d_ff=F, ffns=("swiglu",))
    dense = _filled(lambda: SwiGLU(cfg, rngs=nnx.Rngs(0)), 5, lambda name: 1.0)
    for name in ("w_gate", "w_up", "w_down"):
        getattr(dense, name)[...] = getattr(m, name)[0]
    x = _x()
    np.testing.assert_allclose(_call(m, x, None), dense(x), rtol=1e-5, atol=1e-6)


def test_flops_per_token_counts_active_experts_and_config_fields():
    m = _module(num_experts=8, top_k=2, num_shared_experts=1, shared_d_ff=12)
    assert m.flops_per_token() == 2 * D * 8 + 2 * 6 * D * F + 6 * D * 12
    keys = runtime_keys()
    assert {"model.moe.z_loss_weight", "model.moe.load_balance_weight",
            "model.moe.bias_update_rate", "model.moe.grouped_matmul"} <= keys
    assert "model.moe.num_experts" not in keys and "model.moe.router" not in keys
    with pytest.raises(ValueError, match="top_k=5: exceeds"):
        MoEConfig(num_experts=8, top_k=5, n_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="n_groups=3: must divide"):
        MoEConfig(num_experts=8, n_groups=3)


def test_tiny_training_run_logs_aux_and_moves_the_bias(tmp_path):
    from aiinfra_jax.config import load_config
    from aiinfra_jax.load import load_model
    from aiinfra_jax.train import train

    cfg = load_config("configs/moe_tiny.py", [
        "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
        "model.moe.expert_d_ff=32", "model.moe.router=sigmoid", "model.moe.n_groups=4",
        "model.moe.topk_groups=2", "model.moe.num_shared_experts=1",
        "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=0", "optim.lr=3e-3",
        "run.steps=10", "run.log_every=1", "data.val_fraction=0",  # no eval: one compile less
        "checkpoint.every=0", "checkpoint.async_save=false", "run.progress=false",
        "mesh.num_devices=1", f"run.output_dir={tmp_path}", "run.name=moe"])
    summary = train(cfg, quiet=True)
    hist = summary["history"]
    assert len(hist) == 10
    assert all(np.isfinite(h["loss"]) for h in hist)
    assert np.mean([h["loss"] for h in hist[-3:]]) < np.mean([h["loss"] for h in hist[:3]])
    last = hist[-1]
    for key in ("aux_loss/ffn/balance_loss", "aux_loss/ffn/z_loss", "aux/ffn/load_max",
                "aux/ffn/dropped", "aux/ffn/router_entropy", "aux/ffn/load_max/layer_1"):
        assert key in last and np.isfinite(last[key]), key
    assert last["aux/ffn/dropped"] == 0.0 and last["aux/ffn/load_max"] >= 1.0
    bias = load_model(summary["run_dir"]).model.blocks.layers[0].ffn.bias[...]
    assert bias.shape == (2, 8) and float(jnp.abs(bias).max()) > 0  # moved outside the gradient


# ----------------------------------------------------------------------------- expert parallelism


def test_expert_parallel_on_8_devices_equals_single_device():
    """Experts split over the mesh's "expert" axis, tokens exchanged by all-to-all inside
    shard_map (models/moe.py, expert_parallel), on data=2 x expert=2 x tensor=2: equals one
    device (helpers.assert_expert_parallel_matches_single_device), with padding, group-limited
    sigmoid routing and a shared expert."""
    m = _module(**{**CASES["blocked-sigmoid-groups-shared"], "grouped_matmul": None,
                   "load_balance_weight": 0.5, "z_loss_weight": 0.25})
    m.bias[...] = jnp.asarray(np.random.default_rng(7).normal(0, 0.2, 8), jnp.float32)
    assert_expert_parallel_matches_single_device(m, D)
