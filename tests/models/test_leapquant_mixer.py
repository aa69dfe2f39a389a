"""LeapQuant decode states in the "gdn" and "kda" mixers (model.gated_delta.state_quant): generate
runs with the quantized cache, its logits stay close to the float32 cache's (closer than per-step
INT8), bad settings are refused by name, and a prefix-cache snapshot restored and decoded on equals
the uninterrupted run; with the window records in float32 and in bfloat16 (state_records)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aiinfra_jax.generate import decode_step, generate, prefill
from aiinfra_jax.models import ModelConfig, Transformer
from aiinfra_jax.models.attention.gated_delta import GatedDeltaConfig
from aiinfra_jax.models.prefix_cache import (ZeroRecords, extend, prefill_with_snapshots,
                                             restore_snapshot, snapshot_nbytes)

# One model holds a gdn and a kda layer, so every compile covers both mixers.
CFG = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                  max_seq_len=64, mixers=("gdn", "kda"),
                  gated_delta=GatedDeltaConfig(num_v_heads=4, head_v_dim=8, chunk_size=8))


def _model(**quant):
    """The same parameters whatever the state settings (they are run-time fields)."""
    cfg = dataclasses.replace(CFG, gated_delta=dataclasses.replace(CFG.gated_delta, **quant))
    return Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def quant_model(request):
    """LeapQuant int8 states with a window of 4, window records in float32 or bfloat16
    (model.gated_delta.state_records; shared, so its compiled steps are reused)."""
    return _model(state_quant="int8", state_window=4, state_records=request.param)


def _records_dtype(model):
    return jnp.dtype(model.cfg.gated_delta.state_records)


def _qstates(cache):
    """The LeapQuant states of every gated-delta layer in a model cache (any nesting)."""
    if isinstance(cache, dict):
        return [cache["qstate"]] if "qstate" in cache else [
            q for value in cache.values() for q in _qstates(value)]
    if isinstance(cache, (tuple, list)):
        return [q for value in cache for q in _qstates(value)]
    return []


def test_generate_and_decode_with_quantized_states_stay_close_to_float32(quant_model):
    """Right-padded prompts (12 and 7 of 26 tokens), then 14 teacher-forced decode steps with a
    window of 4 (three re-quantizations per row after the quantized prefill). The float32
    reference at each position is a prefill up to it: a prefill runs the chunked kernel on float32
    states and quantizes only its final state, so its logits are float32's (and every call shares
    one compile)."""
    tokens = jax.random.randint(jax.random.key(1), (2, 26), 1, CFG.vocab_size)
    lengths = np.array([12, 7])
    prompts = jnp.where(jnp.arange(26)[None] < lengths[:, None], tokens, 0)
    logits, cache = prefill(quant_model, prompts, jnp.asarray(lengths), 40)
    got, ref = [logits], []
    for i in range(15):
        ref.append(prefill(quant_model, tokens, jnp.asarray(lengths + i), 40)[0])
        if i < 14:
            logits, cache = decode_step(quant_model, cache, tokens[jnp.arange(2), lengths + i],
                                        jnp.asarray(lengths + i))
            got.append(logits)
    got, ref = jnp.stack(got), jnp.stack(ref)
    qstates = _qstates(cache)  # the cache really holds the quantized state, not a float32 one
    assert len(qstates) == 2 and all(q["q"].dtype == jnp.int8 for q in qstates)
    assert all(q[name].dtype == _records_dtype(quant_model) for q in qstates
               for name in ("rec_k", "rec_u"))
    assert "'state'" not in str(jax.tree_util.tree_structure(cache))
    centred = jnp.linalg.norm(ref - ref.mean(-1, keepdims=True))
    err = float(jnp.linalg.norm(got - ref) / centred)
    # measured 1.9e-4 with float32 records, 4.3e-4 with bf16 ones; per-step INT8 gives ~2e-3
    assert 0 < err < 2e-3, err
    # generate decodes through the quantized cache (same prompt shapes: the prefill is reused)
    out = generate(quant_model, (np.asarray(prompts), lengths), max_new_tokens=14)
    assert out.tokens.shape == (2, 14) and bool(jnp.all(out.lengths == 14))
    assert bool(jnp.all((out.tokens >= 0) & (out.tokens < CFG.vocab_size)))


def test_bad_state_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="state_window=0"):
        GatedDeltaConfig(state_quant="int8", state_window=0)
    with pytest.raises(ValueError, match="state_quant='int5'.*bits must be 4, 6 or 8"):
        GatedDeltaConfig(state_quant="int5")
    with pytest.raises(ValueError, match="state_quant='int16_per_step'.*bits must be 4, 6 or 8"):
        GatedDeltaConfig(state_quant="int16_per_step")
    with pytest.raises(ValueError, match="state_quant='fp8'"):
        GatedDeltaConfig(state_quant="fp8")
    with pytest.raises(ValueError, match="state_quant='int8'.*model.mixers.*add a 'gdn' or 'kda'"):
        dataclasses.replace(CFG, mixers=("dense",),
                            gated_delta=GatedDeltaConfig(state_quant="int8"))
    with pytest.raises(ValueError, match="state_rank=9 exceeds"):
        dataclasses.replace(CFG, gated_delta=dataclasses.replace(
            CFG.gated_delta, state_quant="int8", state_rank=9))
    with pytest.raises(ValueError, match="state_comp_target"):
        GatedDeltaConfig(state_quant="int8", state_comp_target="both")
    with pytest.raises(ValueError, match=r"state_records='bf16'.*'float32', 'bfloat16'"):
        GatedDeltaConfig(state_quant="int8", state_records="bf16")
    # off by default, and the per-step baseline is the plain per-step scheme (window 1: its one
    # record lives within a step, float32 whatever state_records says)
    assert GatedDeltaConfig().state_spec() is None
    spec = GatedDeltaConfig(state_quant="int8_per_step", state_records="bfloat16").state_spec()
    assert (spec.window, spec.r, spec.smooth, spec.record_dtype) == (1, 0, False, "float32")
    assert GatedDeltaConfig(state_quant="int8").state_spec().record_dtype == "float32"
    assert GatedDeltaConfig(state_quant="int8",
                            state_records="bfloat16").state_spec().record_dtype == "bfloat16"


def test_a_restored_prefix_snapshot_decodes_like_the_uninterrupted_run(quant_model):
    model = quant_model
    tokens = jax.random.randint(jax.random.key(2), (2, 30), 1, CFG.vocab_size)
    _, cache, snaps = prefill_with_snapshots(model, tokens[:, :24], every=8, max_len=40)
    assert sorted(snaps) == [8, 16, 24]
    snap = snaps[16]
    qstates = _qstates(snap)
    assert len(qstates) == 2
    for q in qstates:  # quantized, at a window boundary: no records held, none stored
        assert q["q"].dtype == np.int8 and not np.any(q["n"])
        assert q["q"].nbytes * 4 == 2 * 4 * 16 * 8 * 4  # vs [B,HV,K,V] float32
        assert all(isinstance(q[name], ZeroRecords) for name in ("rec_k", "rec_u", "rec_g"))
        assert q["rec_u"].dtype == _records_dtype(model)  # restored in the stored dtype
    full = jax.device_get(cache)  # the same cache with its (empty) record buffers
    records = sum(np.asarray(q[name]).nbytes for q in _qstates(full)
                  for name in ("rec_k", "rec_u", "rec_g"))
    assert records > 0 and snapshot_nbytes(snaps[24]) == sum(
        np.asarray(a).nbytes for a in jax.tree.leaves(full)) - records

    def decode_on(cache, start):
        out = []
        for t in range(start, 30):
            logits, cache = decode_step(model, cache, tokens[:, t], jnp.full((2,), t))
            out.append(logits)
        return jnp.stack(out)

    uninterrupted = decode_on(cache, 24)
    resumed = restore_snapshot(snap)
    _, resumed = extend(model, resumed, tokens[:, 16:24], 16)
    np.testing.assert_array_equal(decode_on(resumed, 24), uninterrupted)
