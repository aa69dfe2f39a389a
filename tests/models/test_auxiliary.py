"""The component contract: auxiliary losses, metrics and intermediates, the token mask and rngs
for FFNs, non-parameter state, and component-owned configs.

A toy router FFN registered here ("test_router", config key "test_router") uses all of it: a
load-balance loss over the real tokens only, a max-load metric, router noise drawn from rngs, and an
aux-loss-free routing bias kept as non-parameter state and updated outside the gradient.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aiinfra_jax import steps
from aiinfra_jax.config import ConfigError, Config, OptimConfig, apply_overrides, from_dict, \
    runtime_keys, to_dict
from aiinfra_jax.models import (ModelConfig, Transformer, register_config, register_ffn,
                                registry, report_loss, report_metric, runtime_field)
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models.layers import make_param

E = 4  # experts of the toy router


class RoutingBias(nnx.Variable):
    """Non-parameter state: moved toward balance after every call, never by the gradient."""


@dataclasses.dataclass(frozen=True)
class RouterTestConfig:
    loss_weight: float = runtime_field(0.1)
    noise: float = runtime_field(1.0)
    bias_rate: float = 0.01

    def __post_init__(self):
        if self.loss_weight < 0:
            raise ValueError(f"RouterTestConfig.loss_weight={self.loss_weight}: must be >= 0")


class RouterFFN(nnx.Module):
    def __init__(self, cfg, *, rngs):
        self.cfg = cfg
        self.w_router = make_param(rngs, (cfg.d_model, E), ("embed", None), 0.5, "float32")
        self.w_out = make_param(rngs, (E, cfg.d_model), (None, "embed"), 0.5, "float32")
        self.bias = RoutingBias(jnp.zeros((E,), jnp.float32))

    def __call__(self, x, *, segment_ids=None, rngs=None):
        c = self.cfg.test_router
        logits = x @ self.w_router[...] + self.bias[...]
        if rngs is not None:
            logits = logits + c.noise * jax.random.normal(rngs.router(), logits.shape)
        probs = jax.nn.softmax(logits, axis=-1)
        real = (jnp.ones(x.shape[:2]) if segment_ids is None
                else (segment_ids != 0).astype(jnp.float32))
        load = jnp.einsum("bte,bt->e", probs, real) / jnp.maximum(real.sum(), 1.0)
        report_loss(self, "balance", c.loss_weight * E * jnp.sum(load ** 2))
        report_metric(self, "max_load", jnp.max(load))
        self.bias[...] = self.bias[...] - c.bias_rate * jax.lax.stop_gradient(load - 1.0 / E)
        return probs @ self.w_out[...]

    def flops_per_token(self):
        return 4.0 * self.cfg.d_model * E


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_config("test_router")(RouterTestConfig)
    register_ffn("test_router")(RouterFFN)
    yield
    registry.CONFIGS.pop("test_router")
    registry.FFNS.pop("test_router")


def _cfg(**kw):
    base = dict(vocab_size=64, d_model=16, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=32,
                ffns=("swiglu", "test_router"), max_seq_len=32)
    return ModelConfig(**{**base, **kw})


def _batch(seed=0, b=2, t=12):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(1, 64, (b, t)), jnp.int32)
    seg = np.ones((b, t), np.int32)
    seg[0, 8:] = 0  # right padding
    return tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.asarray(seg)


def test_component_config_is_owned_registered_and_round_trips():
    cfg = _cfg()
    assert cfg.test_router == RouterTestConfig()
    run = apply_overrides(Config(model=cfg, data=DataConfig(seq_len=32)), ["model.test_router.loss_weight=0.5"])
    assert run.model.test_router.loss_weight == 0.5
    assert to_dict(run)["model"]["test_router"]["loss_weight"] == 0.5
    assert from_dict(to_dict(run)) == run
    assert "model.test_router.loss_weight" in runtime_keys()
    assert "model.test_router.bias_rate" not in runtime_keys()
    with pytest.raises(ConfigError, match=r"model.test_router: RouterTestConfig.loss_weight=-1"):
        apply_overrides(run, ["model.test_router.loss_weight=-1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'model.test_router.wieght'"):
        apply_overrides(run, ["model.test_router.wieght=1"])
    with pytest.raises(ValueError, match="unknown field or component config 'tset_router'"):
        ModelConfig(tset_router=RouterTestConfig())
    hash(cfg)


def test_losses_and_metrics_per_layer_through_scan_and_remat():
    tokens, pos, seg = _batch()
    results = {}
    for name, kw in {"scan": {}, "loop": dict(scan_layers=False),
                     "remat": dict(remat="full")}.items():
        model = Transformer(_cfg(**kw), rngs=nnx.Rngs(0))
        _, _, aux = jax.jit(lambda m: m(tokens, positions=pos, segment_ids=seg))(model)
        results[name] = aux
    aux = results["scan"]
    # FFN positions 1 and 3 are routers: two layers report.
    assert set(aux["losses"]) == {"ffn/balance"}
    assert set(aux["metrics"]) == {"ffn/max_load", "ffn/max_load/layer_1", "ffn/max_load/layer_3"}
    np.testing.assert_allclose(aux["metrics"]["ffn/max_load"],
                               (aux["metrics"]["ffn/max_load/layer_1"]
                                + aux["metrics"]["ffn/max_load/layer_3"]) / 2, rtol=1e-6)
    assert aux["intermediates"] == {}
    for other in ("loop", "remat"):
        for kind in ("losses", "metrics"):
            for key, value in aux[kind].items():
                np.testing.assert_allclose(results[other][kind][key], value, rtol=1e-5,
                                           err_msg=f"{other} {kind} {key}")


def test_padding_never_votes_and_rngs_draw_noise():
    tokens, pos, seg = _batch()
    model = Transformer(_cfg(), rngs=nnx.Rngs(0))
    run = jax.jit(lambda m, t, r: m(t, positions=pos, segment_ids=seg, rngs=r)[2]["losses"])
    base = run(model, tokens, None)
    # Other tokens in the padded tail of row 0: the router loss does not move.
    changed = tokens.at[0, 8:].set((tokens[0, 8:] + 5) % 64)
    np.testing.assert_allclose(run(model, changed, None)["ffn/balance"], base["ffn/balance"],
                               rtol=1e-6)
    a, b = run(model, tokens, nnx.Rngs(1)), run(model, tokens, nnx.Rngs(2))
    assert float(a["ffn/balance"]) != float(b["ffn/balance"])
    np.testing.assert_allclose(run(model, tokens, nnx.Rngs(1))["ffn/balance"], a["ffn/balance"])


def test_train_step_adds_the_weighted_loss_and_carries_model_state():
    tokens, pos, seg = _batch(1)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1), "positions": pos,
             "segment_ids": seg, "loss_weights": (seg != 0).astype(jnp.float32)}

    def one_step(weight, schedule=((0, 1.0, 1.0),), at_step=0):
        cfg = _cfg(test_router=RouterTestConfig(loss_weight=weight))
        graphdef, abstract_params, rest = steps.abstract_model(cfg)
        opt = steps.make_optimizer(OptimConfig(), 10, steps.weight_decay_mask(abstract_params))
        params, model_state = steps.init_variables(Transformer(cfg, rngs=nnx.Rngs(0)))
        state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(at_step),
                 "bad_step": jnp.int32(0), "model_state": model_state}
        step = jax.jit(steps.make_train_step(graphdef, abstract_params, rest, opt, 1,
                                             loss_schedule=schedule))
        return state, *step(state, batch)

    before, after, metrics = one_step(0.1)
    _, _, metrics0 = one_step(0.0)
    assert float(metrics["loss"]) == float(metrics0["loss"])  # the LM loss alone
    assert float(metrics["aux_loss"]) > 0 and float(metrics0["aux_loss"]) == 0
    assert float(metrics["grad_norm"]) != float(metrics0["grad_norm"])
    # Loss stages (OptimConfig.loss_stages): the objective's weights by step. Gradients are
    # linear in them: LM x 2 from step 3 doubles the LM-only gradient there, and aux x 0 at step
    # 3 of (1, 1) -> (1, 0) is the LM alone.
    # (Compared at the same step: the step seeds the router's noise.)
    staged = ((0, 1.0, 1.0), (3, 2.0, 0.0))
    lm_only = float(one_step(0.0, at_step=3)[2]["grad_norm"])
    np.testing.assert_allclose(float(one_step(0.0, staged, at_step=3)[2]["grad_norm"]),
                               2 * lm_only, rtol=1e-5)
    np.testing.assert_allclose(float(one_step(0.1, ((0, 1.0, 1.0), (3, 1.0, 0.0)), 3)[2]
                                     ["grad_norm"]), lm_only, rtol=1e-5)
    np.testing.assert_allclose(float(one_step(0.1, staged, at_step=2)[2]["grad_norm"]),
                               float(one_step(0.1, at_step=2)[2]["grad_norm"]), rtol=1e-6)
    assert {"aux_loss/ffn/balance", "aux/ffn/max_load", "aux/ffn/max_load/layer_3"} <= set(metrics)
    bias_before = before["model_state"]["blocks"]["layers"][1]["ffn"]["bias"]
    bias_after = after["model_state"]["blocks"]["layers"][1]["ffn"]["bias"]
    assert bias_after.shape == (2, E)  # stacked over the R = 2 repeats
    assert not np.allclose(bias_after, bias_before)
    # Updated outside the gradient: the optimizer never saw it.
    assert "bias" not in after["params"]["blocks"]["layers"][1]["ffn"]


def test_model_state_is_checkpointed_and_a_resumed_run_matches(tmp_path):
    """The routing bias (non-parameter state) goes through the real loop: saved in the checkpoint,
    restored on resume, and the resumed run's losses, aux metrics and bias equal the uninterrupted
    run's."""
    from aiinfra_jax.config import load_config
    from aiinfra_jax.load import load_model
    from aiinfra_jax.train import train

    def cfg(name):
        return load_config("configs/tiny.py", [
            "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
            "model.ffns=swiglu,test_router", "data.seq_len=32", "data.batch_size=4",
            "run.steps=4", "run.log_every=1", "eval.every=0", "eval.final_batches=1",
            "checkpoint.every=0", "checkpoint.async_save=false", "run.progress=false",
            "mesh.num_devices=1", f"run.output_dir={tmp_path}", f"run.name={name}"])

    whole = train(cfg("whole"), quiet=True)
    train(cfg("parts"), stop_after=2, quiet=True)
    parts = train(cfg("parts"), quiet=True)
    assert parts["start_step"] == 2
    for a, b in zip(whole["history"][2:], parts["history"]):
        assert a["loss"] == b["loss"] and a["aux/ffn/max_load"] == b["aux/ffn/max_load"]
        assert a["aux_loss/ffn/balance"] > 0
    biases = [load_model(s["run_dir"]).model.blocks.layers[1].ffn.bias[...]
              for s in (whole, parts)]
    np.testing.assert_array_equal(*biases)
    assert not np.allclose(biases[0], 0.0)  # it moved during training
