"""An MSA model's training computation on a data x fsdp x tensor mesh of 8 simulated CPU devices
equals the single-device one (issue 21's 8-device equality test): the total loss (LM + routing),
every parameter's gradient (the router's and the temperature's included) and the routing metrics,
on packed rows whose routing really selects documents (without it the loss changes)."""

import jax
import numpy as np
from flax import nnx

from aiinfra_jax import sharding as shd
from aiinfra_jax import steps
from aiinfra_jax.config import MeshConfig
from aiinfra_jax.models import ModelConfig, Transformer
from aiinfra_jax.models.attention.msa import MSAConfig, pack_row

B, T, V = 4, 64, 128
# Two MSA layers (scanned, as the trainer runs them): layer 0 does not route, layer 1 does.
MSA = MSAConfig(chunk=4, top_k=2, max_documents=8, routing_loss_weight=1.0, implementation="xla")
CFG = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  mixers=("msa",), msa=MSA, max_seq_len=T)
SHARDED = MeshConfig(data=2, fsdp=2, tensor=2)

# One row per data x fsdp shard, each its own layout: documents of lengths that are not multiples
# of the chunk (3 to 5 of them, so top_k 2 selects a proper subset), one positive, a query whose
# last tokens are the answer, right padding.
ROWS = [dict(doc_lengths=[6, 9, 3, 5], query_length=6, answer_docs=[1], answer_length=2),
        dict(doc_lengths=[3, 10, 7], query_length=5, answer_docs=[2], answer_length=3),
        dict(doc_lengths=[11, 2, 5, 7, 9], query_length=7, answer_docs=[0], answer_length=2),
        dict(doc_lengths=[5, 6, 13], query_length=9, answer_docs=[1], answer_length=4)]


def _batch():
    qo = MSA.resolved_query_offset
    seg, pos = (np.stack(x) for x in zip(*(pack_row(**r, query_offset=qo, row_length=T + 1)
                                            for r in ROWS)))
    rng = np.random.default_rng(0)
    tokens = np.where(seg != 0, rng.integers(1, V, seg.shape), 0).astype(np.int32)
    # Inputs are a row's first T tokens. Weights: 1 on the answer tokens (the targets that read
    # the selected documents), 0.1 on every other real target (documents train as plain LM text).
    weights = 0.1 * ((seg[:, :-1] != 0) & (seg[:, 1:] != 0))
    for b, r in enumerate(ROWS):
        answer_end = sum(r["doc_lengths"]) + r["query_length"]  # one past the answer's last token
        weights[b, answer_end - r["answer_length"] - 1:answer_end - 1] = 1.0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": pos[:, :-1],
            "segment_ids": seg[:, :-1], "loss_weights": weights.astype(np.float32)}


def _init():
    """(params, model_state) of CFG as the trainer builds them, in one compiled program (eagerly,
    each initializer op would compile on its own: seconds)."""
    return jax.jit(lambda: steps.init_variables(Transformer(CFG, rngs=nnx.Rngs(0))))()


def _step(mesh_cfg, params, model_state, batch):
    """step(params, model_state, batch) -> ((loss, (nll, aux_loss, aux)), grads), compiled for
    mesh_cfg, and the arguments placed on that mesh as the trainer places them."""
    mesh = shd.make_mesh(mesh_cfg)
    graphdef, abstract_params, rest = steps.abstract_model(CFG)

    def loss(params, model_state, batch):
        model = steps.merge_model(graphdef, abstract_params, rest, params, model_state)
        nll_sum, aux_loss, stats, aux = steps.loss_and_stats(model, batch)
        nll = nll_sum / stats["weight_sum"]
        return nll + aux_loss, (nll, aux_loss, aux)

    fn = shd.with_activation_rules(jax.value_and_grad(loss, has_aux=True), mesh)
    args = (jax.device_put(params, shd.param_shardings(abstract_params, mesh)),
            jax.device_put(model_state, shd.param_shardings(rest, mesh)),
            shd.shard_batch(batch, mesh))
    return jax.jit(fn).lower(*args).compile(), args


def _run(step, args):
    (value, (nll, aux_loss, aux)), grads = step(*args)
    return (float(value), float(nll), float(aux_loss), jax.device_get(aux["metrics"]),
            jax.device_get(grads))


def test_msa_step_on_a_mesh_equals_the_single_device_step():
    params, model_state = _init()
    assert np.asarray(model_state["blocks"]["layers"][0]["mixer"]["routes"]).tolist() == [0, 1]
    batch = _batch()
    ref_step, ref_args = _step(MeshConfig(num_devices=1), params, model_state, batch)
    ref_loss, ref_nll, ref_aux, ref_metrics, ref_grads = _run(ref_step, ref_args)
    step, args = _step(SHARDED, params, model_state, batch)
    # Really split: a row per data x fsdp shard, the attention weights over fsdp and tensor.
    assert args[2]["segment_ids"].sharding.shard_shape((B, T)) == (1, T)
    wq = args[0]["blocks"]["layers"][0]["mixer"]["wq"]
    assert wq.sharding.shard_shape(wq.shape) == (2, 16, 2, 8)
    loss, nll, aux_loss, metrics, grads = _run(step, args)

    # The test can fail: the routing loss is on, and the LM loss depends on the selection: with
    # the routing flags off (on the same compiled step) it moves by over 5x the loss tolerance.
    # (Measured when writing the test: 8x; selecting the 2nd and 3rd ranked documents instead of
    # the top 2 moves the loss by 8.5x its tolerance and the gradients by 4x to 300x theirs.)
    assert ref_aux > 0.05, ref_aux
    off = jax.tree.map(np.zeros_like, model_state)
    _, off_nll, off_aux, _, _ = _run(ref_step, (ref_args[0], off, ref_args[2]))
    assert off_aux == 0.0 and abs(off_nll - ref_nll) > 5 * 2e-5 * ref_loss, (off_nll, ref_nll)

    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    np.testing.assert_allclose(aux_loss, ref_aux, rtol=2e-5)
    assert sorted(metrics) == sorted(ref_metrics) and "mixer/recall@1/layer_1" in metrics
    for name, value in ref_metrics.items():
        np.testing.assert_equal(float(metrics[name]), float(value), err_msg=name)  # NaN == NaN
    mixer = ref_grads["blocks"]["layers"][0]["mixer"]
    for name in ("router_q", "router_k", "temperature"):  # trained by layer 1's routing loss
        assert np.abs(np.asarray(mixer[name][1])).max() > 0, name
    flat_ref = jax.tree_util.tree_flatten_with_path(ref_grads)[0]
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    assert [p for p, _ in flat] == [p for p, _ in flat_ref]
    for (path, g_ref), (_, g) in zip(flat_ref, flat):
        g_ref, g = np.asarray(g_ref, np.float64), np.asarray(g, np.float64)
        scale = float(np.sqrt(np.mean(np.square(g_ref)))) + 1e-12
        err = float(np.sqrt(np.mean(np.square(g - g_ref)))) / scale
        assert err < 2e-4, f"{jax.tree_util.keystr(path)}: rms-relative gradient error {err:.2e}"
