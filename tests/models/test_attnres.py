"""Attention Residuals as the model's residual scheme: zero queries give the uniform average, the
scanned model equals a plain-Python transcription of the paper's formulas (Full and Block, every
convention of models/attnres.py), Block AttnRes with one sublayer per block equals Full AttnRes,
cached decode equals the full forward, bad configs fail clearly, and a tiny training run works with
each scheme (Block under remat)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from aiinfra_jax.generate import decode_step, prefill
from aiinfra_jax.models import ModelConfig, Transformer
from aiinfra_jax.models.attnres import BlockAttnRes, DepthAggregate, FullAttnRes
from aiinfra_jax.models import AttnResConfig
from aiinfra_jax.models.moe import MoEConfig

# n_layers = 2: J = 4 sublayers (AttnRes layers).
CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32,
                  max_seq_len=32, residual="attnres_full")
B, T = 2, 6


def _cfg(residual="attnres_full", n_blocks=2, **kw):
    return dataclasses.replace(CFG, residual=residual, attnres=AttnResConfig(n_blocks=n_blocks),
                               **kw)


def _tokens(seed):
    tokens = jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size)
    return tokens, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def _randomize_queries(model, seed):
    """Gives every AttnRes query (per-sublayer and final) random values; deterministic in the
    parameter path, so two models with the same structure get the same queries."""
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    for i, (path, var) in enumerate(sorted(flat.items(), key=lambda kv: str(kv[0]))):
        if any("quer" in str(p) for p in path):
            key = jax.random.fold_in(jax.random.key(seed), i)
            var.set_value(jax.random.normal(key, var[...].shape, jnp.float32) * 0.5)
    nnx.update(model, nnx.from_flat_state(flat))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@jax.jit
def _logits_fn(graphdef, state, tokens, positions):
    return nnx.merge(graphdef, state)(tokens, positions=positions)[0]


def _logits(model, tokens, positions):
    return _logits_fn(*nnx.split(model), tokens, positions)


@jax.jit
def _loss_grads_fn(graphdef, state, tokens, positions):
    def loss_fn(state):
        logits = nnx.merge(graphdef, state)(tokens, positions=positions)[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
    return jax.value_and_grad(loss_fn)(state)


# ----------------------------------------------------------------------------------------------
# The paper's formulas, transcribed with Python lists (no buffer, no masks, no kernel).

def _attend(w, vs, eps):
    vs = jnp.stack([v.astype(jnp.float32) for v in vs])                       # [n,B,T,D]
    keys = vs / jnp.sqrt(jnp.mean(vs * vs, -1, keepdims=True) + eps)
    z = jnp.einsum("d,nbtd->nbt", w.astype(jnp.float32), keys, precision="highest")
    return jnp.einsum("nbt,nbtd->btd", jax.nn.softmax(z, axis=0), vs, precision="highest")


def _naive_logits(model, tokens, positions):
    cfg = model.cfg
    eps = cfg.norm_eps
    layers = [layer for block in model.blocks for layer in block.layers]
    x0 = model.embed(tokens)
    sublayers = []
    for layer in layers:
        q = layer.residual.queries[...]
        sublayers.append((q[0], lambda h, l=layer: l.mixer(l.mixer_norm(h), positions=positions,
                                                          segment_ids=None, cache=None)[0]))
        sublayers.append((q[1], lambda h, l=layer: l.ffn(l.ffn_norm(h))))
    if cfg.residual == "attnres_full":
        sources = [x0]
        for w, f in sublayers:
            sources.append(f(_attend(w, sources, eps)))
        final = sources
    else:
        per_block = len(sublayers) // cfg.attnres.n_blocks
        finished, partial = [x0], None
        for j, (w, f) in enumerate(sublayers):
            # the first sublayer of a block sees only the finished blocks
            y = f(_attend(w, finished + ([] if partial is None else [partial]), eps))
            partial = y if partial is None else partial + y
            if (j + 1) % per_block == 0:
                finished, partial = finished + [partial], None
        final = finished
    x = _attend(model.residual_final.query[...][0], final, eps)
    return model.logits(model.final_norm(x))


def _loop_and_scan(cfg, seed):
    """The same random parameters (queries randomised) as a loop model and a scanned model."""
    loop = Transformer(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(seed))
    _randomize_queries(loop, seed)
    scan = Transformer(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(seed))
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[nnx.state(b) for b in loop.blocks])
    nnx.update(scan.blocks, stacked)
    nnx.update(scan, nnx.state(loop, nnx.Param).filter(lambda p, _: p[0] != "blocks"))
    return loop, scan


# ----------------------------------------------------------------------------------------------

@jax.jit
def _uniform_checks(x, outs):
    """Sublayer inputs of zero-query Full / Block schemes after feeding outs[0..3] (one compile)."""
    full_cfg, block_cfg = _cfg(), _cfg("attnres_block", n_blocks=2)
    full = FullAttnRes(full_cfg, rngs=nnx.Rngs(0))
    carry = FullAttnRes.init_carry(full_cfg, x)
    for k in range(3):
        carry = full.update(carry, outs[k], k % 2)
    full_in = full.sublayer_input(carry, 1)
    block = BlockAttnRes(block_cfg, rngs=nnx.Rngs(0))
    carry = BlockAttnRes.init_carry(block_cfg, x)
    block_ins = []
    for k in range(4):
        carry = block.update(carry, outs[k], k % 2)
        block_ins.append(block.sublayer_input(carry, (k + 1) % 2))
    return full_in, block_ins


def test_zero_initialised_queries_give_exactly_the_uniform_average():
    for module in (FullAttnRes(_cfg(), rngs=nnx.Rngs(0)), DepthAggregate(_cfg())):
        assert all(np.all(np.asarray(v[...]) == 0) for _, v in
                   nnx.to_flat_state(nnx.state(module, nnx.Param)))
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(B, T, CFG.d_model)), jnp.float32)
    o = jnp.asarray(rng.normal(size=(4, B, T, CFG.d_model)) * np.arange(1, 5)[:, None, None, None],
                    jnp.float32)
    full_in, block_ins = _uniform_checks(x, o)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # Full: the 4th sublayer sees the mean of the embedding and the three outputs.
    close(full_in, (x + o[0] + o[1] + o[2]) / 4)
    # Block, 2 sublayers per block (finished blocks: b_0 = x, b_1 = o0 + o1, b_2 = o2 + o3):
    close(block_ins[0], (x + o[0]) / 2)                            # sublayer 1: b_0, partial o0
    close(block_ins[1], (x + o[0] + o[1]) / 2)                     # sublayer 2 (first of block 1)
    close(block_ins[2], (x + o[0] + o[1] + o[2]) / 3)              # sublayer 3: b_0, b_1, o2
    close(block_ins[3], (x + o[0] + o[1] + o[2] + o[3]) / 3)       # final-like: b_0, b_1, b_2


def _check_naive(residual, n_blocks, seed):
    loop, scan = _loop_and_scan(_cfg(residual, n_blocks), seed=seed)
    tokens, positions = _tokens(seed)
    naive = jax.jit(lambda g, st, tok, pos: _naive_logits(nnx.merge(g, st), tok, pos))
    expected = naive(*nnx.split(loop), tokens, positions)
    actual = _logits(scan, tokens, positions)
    assert _rel(actual, expected) < 1e-5, f"{residual} seed={seed}"
    return scan, tokens, positions, actual


def test_full_equals_the_naive_formula_and_block_with_one_sublayer_per_block():
    """The scanned Full AttnRes model equals the paper's formula; with n_blocks = 2 * n_layers
    (one sublayer per block) Block AttnRes, with the same parameters, gives the same logits."""
    seed = int(np.random.default_rng().integers(1000))
    full, tokens, positions, logits = _check_naive("attnres_full", 2, seed)
    block = Transformer(_cfg("attnres_block", 2 * CFG.n_layers), rngs=nnx.Rngs(0))
    nnx.update(block, nnx.state(full))
    assert _rel(_logits(block, tokens, positions), logits) < 1e-6, f"seed={seed}"


def test_block_equals_the_naive_formula():
    """Two sublayers per block: partial sums, the first sublayer of a block, final aggregation."""
    _check_naive("attnres_block", 2, int(np.random.default_rng().integers(1000)))


def test_prefill_and_decode_equal_the_full_forward():
    """Block AttnRes (the scheme with the most state: partial sums); depth attention is per token,
    so any AttnRes scheme needs nothing in the cache."""
    model = Transformer(_cfg("attnres_block", 2), rngs=nnx.Rngs(4))
    _randomize_queries(model, 4)
    lengths = np.array([3, 5], np.int32)
    n_new, L = 2, 7
    full = np.asarray(jax.random.randint(jax.random.key(5), (B, L), 1, CFG.vocab_size))
    ref = np.asarray(_logits(model, jnp.asarray(full), jnp.broadcast_to(jnp.arange(L), (B, L))))
    rows = np.arange(B)
    prompts = full[:, :lengths.max()].copy()
    prompts[np.arange(prompts.shape[1])[None, :] >= lengths[:, None]] = 7     # junk padding
    last, cache = prefill(model, prompts, lengths, L)
    np.testing.assert_allclose(last, ref[rows, lengths - 1], rtol=1e-5, atol=1e-5)
    for i in range(n_new):
        pos = lengths + i
        logits, cache = decode_step(model, cache, full[rows, pos], pos)
        np.testing.assert_allclose(logits, ref[rows, pos], rtol=1e-5, atol=1e-5,
                                   err_msg=f"decode step {i}")


@pytest.mark.parametrize("make,pattern", [
    (lambda: Transformer(_cfg("attnres_block", n_blocks=3), rngs=nnx.Rngs(0)),
     r"AttnResConfig.n_blocks=3: must divide the 2 \* n_layers = 4 sublayers.*\[1, 2, 4\]"),
    (lambda: AttnResConfig(n_blocks=0), r"AttnResConfig.n_blocks=0"),
    (lambda: AttnResConfig(implementation="cuda"), r"AttnResConfig.implementation='cuda'"),
])
def test_bad_configs_fail_clearly(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


@pytest.mark.parametrize("residual", ["attnres_full", "attnres_block"])
def test_tiny_training_run(tmp_path, residual):
    """aiinfra_jax.train.train end to end (Block with remat="full"): the loss drops, and the first
    2 steps on a data=2, fsdp=2, tensor=2 mesh of the 8 simulated devices give the same losses."""
    from aiinfra_jax.config import load_config
    from aiinfra_jax.train import train
    overrides = [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=2", "optim.lr=1e-2",
        "eval.every=0", "eval.batches=1", "eval.final_batches=1", "run.progress=false",
        "mesh.num_devices=1", "run.steps=6", "run.log_every=1", "checkpoint.every=0",
        f"model.residual={residual}", "model.attnres.n_blocks=1", f"run.output_dir={tmp_path}"]
    if residual == "attnres_block":
        overrides.append("model.remat=full")             # remat through the scheme's carry
    summary = train(load_config("configs/tiny.py", overrides), quiet=True)
    losses = {r["step"]: r["loss"] for r in summary["history"]}
    assert all(np.isfinite(v) for v in losses.values())
    assert losses[6] < losses[1] - 0.2, losses
    assert np.isfinite(summary["validation"]["loss"])
    sharded = [o.replace(str(tmp_path), str(tmp_path / "eight")) for o in overrides]
    sharded = [o for o in sharded if o != "mesh.num_devices=1"]
    eight = train(load_config("configs/tiny.py", sharded + [
        "mesh.num_devices=8", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
        stop_after=2, quiet=True)
    eight_losses = {r["step"]: r["loss"] for r in eight["history"]}
    assert sorted(eight_losses) == [1, 2]
    for step, loss in eight_losses.items():
        assert loss == pytest.approx(losses[step], rel=2e-5), step


@pytest.mark.parametrize("residual,n_blocks,remat,extra", [
    ("attnres_full", 2, "full", {}), ("attnres_block", 2, "full", {}),
    ("attnres_block", 1, "full", {}),
    ("attnres_full", 2, "none", {}), ("attnres_block", 2, "none", {}),
    ("attnres_block", 1, "none", {}),
    # An MoE FFN (an auxiliary loss and router noise drawn from the training rngs), a short
    # convolution before the mixer, and two layers per scanned block.
    ("attnres_block", 4, "none", dict(ffns=("swiglu", "moe"), short_conv=4,
                                      moe=MoEConfig(num_experts=4, top_k=2, router_noise=0.5)))])
def test_rebuilding_scans_give_the_same_loss_and_gradients(residual, n_blocks, remat, extra,
                                                           monkeypatch):
    """Training with cfg.attnres.rebuild (the default) runs the layer scan through
    models/rebuilding.py: rebuilding_scan under remat="full" (each layer recomputed), sublayer_scan
    under remat="none" (each sublayer's own vjp kept, the depth reads and writes recomputed); both
    read the final buffer in the backward. Loss, auxiliary loss and every gradient equal plain
    autodiff through the scan (rebuild=False), with packed documents and random queries. Block with
    n_blocks=1 keeps a partial sum across the layers. Without remat sublayer_scan also runs
    unrolled (model.scan_unroll=0), with the same results (under remat the scan stays looped)."""
    cfg = dataclasses.replace(_cfg(residual, n_blocks=n_blocks, n_layers=4, remat=remat), **extra)
    tokens, positions = _tokens(3)
    segs = jnp.asarray(np.repeat([[1, 1, 1, 2, 2, 2]], B, 0), jnp.int32)
    import aiinfra_jax.models.transformer as tf
    name = "rebuilding_scan" if remat == "full" else "sublayer_scan"
    calls = []
    real = getattr(tf, name)
    monkeypatch.setattr(tf, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    grads = {}
    unrolls = (1, 0) if remat == "none" else (1,)
    for rebuild, unroll in [(False, 1)] + [(True, u) for u in unrolls]:
        c = dataclasses.replace(cfg, attnres=dataclasses.replace(cfg.attnres, rebuild=rebuild),
                                scan_unroll=unroll)
        model = Transformer(c, rngs=nnx.Rngs(0))
        _randomize_queries(model, 1)
        graphdef, state = nnx.split(model)

        def loss(state):
            logits, _, aux = nnx.merge(graphdef, state)(
                tokens, positions=positions, segment_ids=segs, rngs=nnx.Rngs(7))
            return (jnp.mean(jax.nn.log_softmax(logits)[..., 0] ** 2)
                    + sum(aux["losses"].values(), 0.0)), aux["losses"]

        grads[rebuild, unroll] = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
        assert bool(calls) == rebuild, f"rebuild={rebuild}: {name} calls {calls}"
        calls.clear()
    (l0, aux0), g0 = grads[False, 1]
    flat0 = dict(nnx.to_flat_state(g0))
    for unroll in unrolls:
        (l1, aux1), g1 = grads[True, unroll]
        assert _rel(l1, l0) < 1e-6
        assert aux0.keys() == aux1.keys() and (bool(aux0) == ("moe" in cfg.ffns))
        for k in aux0:
            assert _rel(aux1[k], aux0[k]) < 1e-6, k
        flat1 = dict(nnx.to_flat_state(g1))
        assert flat0.keys() == flat1.keys()
        for path in flat0:
            a, b = flat1[path][...], flat0[path][...]
            assert float(jnp.max(jnp.abs(b))) > 0 or "bias" in str(path), path
            assert _rel(a, b) < 2e-5, (unroll, path, _rel(a, b))


@pytest.mark.parametrize("remat", ["full", "none"])
def test_rebuilding_scans_keep_training_memory_linear_in_depth(remat):
    """Full AttnRes: with the rebuilding scans the compiled gradient's temporaries no longer hold
    one buffer of 2L + 1 slots per layer (quadratic in depth); at 8 layers they fall well below
    the plain scan's, with and without remat."""
    tokens, positions = _tokens(0)

    def temp_bytes(remat, rebuild):
        cfg = _cfg("attnres_full", n_layers=8, remat=remat)
        cfg = dataclasses.replace(cfg, attnres=dataclasses.replace(cfg.attnres, rebuild=rebuild))
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        fn = jax.jit(jax.grad(lambda s: jnp.sum(
            nnx.merge(graphdef, s)(tokens, positions=positions)[0])))
        return fn.lower(state).compile().memory_analysis().temp_size_in_bytes

    plain, rebuilt = temp_bytes(remat, False), temp_bytes(remat, True)
    assert rebuilt < 0.6 * plain, (rebuilt, plain)


def test_slot_write_matches_a_dynamic_update_slice_with_gradients():
    """models/attnres._set_slot (a scatter in the forward, slice ops in its custom backward) equals
    jax.lax.dynamic_update_index_in_dim in value and gradients, at every slot."""
    from aiinfra_jax.models.attnres import _set_slot
    buf = jax.random.normal(jax.random.key(0), (5, 2, 3, 4))
    value = jax.random.normal(jax.random.key(1), (2, 3, 4))
    weights = jax.random.normal(jax.random.key(2), buf.shape)
    for i in range(5):
        index = jnp.int32(i)
        ours = jax.jit(jax.value_and_grad(
            lambda b, v: jnp.sum(weights * _set_slot(b, index, v) ** 2), argnums=(0, 1)))
        want = jax.value_and_grad(lambda b, v: jnp.sum(weights * jax.lax.dynamic_update_index_in_dim(
            b, v, index, 0) ** 2), argnums=(0, 1))
        (l0, (gb0, gv0)), (l1, (gb1, gv1)) = ours(buf, value), want(buf, value)
        np.testing.assert_allclose(l0, l1, rtol=1e-6)
        np.testing.assert_allclose(gb0, gb1, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(gv0, gv1, rtol=1e-6, atol=1e-7)
