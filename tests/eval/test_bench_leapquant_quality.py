"""bench_leapquant's quality mode end to end on a tiny random GDN checkpoint: the output
structure, fp32 decode = the state_quant=None path exactly, per-step INT8 != fp32."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny

from aiinfra_jax.checkpoint import Checkpointer
from aiinfra_jax.config import to_dict
from aiinfra_jax.eval import bench_leapquant, leapquant_quality
from aiinfra_jax.steps import abstract_model


def _host_params(model_cfg) -> dict:
    """Random parameters made with numpy in the shapes of the model's params (Transformer's own
    initialisation compiles a vmapped block init: ~6 s of XLA on 2 CPU cores for this test):
    normal(0, fan_in^-1/2) matrices, unit norm scales, fla-style A (1..16) and dt (1e-3..1e-1)."""
    rng = np.random.default_rng(0)
    _, abstract, _ = abstract_model(model_cfg)

    def init(path, a):
        name = getattr(path[-1], "key", "")
        if name in ("scale", "o_norm"):
            return np.ones(a.shape, np.float32)
        if name == "A_log":
            return np.log(rng.uniform(1, 16, a.shape)).astype(np.float32)
        if name == "dt_bias":
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), a.shape))
            return np.log(np.expm1(dt)).astype(np.float32)
        fan_in = a.shape[0] if len(a.shape) > 1 else 1
        return (rng.standard_normal(a.shape) / np.sqrt(fan_in)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(init, nnx.to_pure_dict(abstract))


@pytest.fixture(scope="module")
def gdn_run(tmp_path_factory):
    """A run directory holding one checkpoint of a random tiny GDN model, saved as the trainer
    saves (no training step: cheaper, and the quality mode only needs parameters)."""
    root = tmp_path_factory.mktemp("gdn")
    cfg = tiny(root, "model.mixers=gdn", "model.gated_delta.chunk_size=16",
               "model.max_seq_len=64", "model.scan_layers=false")
    cfg = dataclasses.replace(cfg, model=cfg.model.with_vocab(259))
    state = {"params": _host_params(cfg.model), "step": jnp.int32(1), "bad_step": jnp.int32(0)}
    with Checkpointer(root / "checkpoints", config=to_dict(cfg), async_save=False) as ckpt:
        ckpt.save(1, state, None, force=True)
    return root


def test_quality_mode_structure_and_reference(gdn_run, tmp_path, capsys):
    out = tmp_path / "q.json"
    assert bench_leapquant.main(["--quality", "--checkpoint", str(gdn_run), "--docs", "2",
                                 "--length", "20", "--prefill", "0", "--settings",
                                 "int8_per_step,none,int8,int8+bf16rec", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (tmp_path / "q.md").read_text().strip() == capsys.readouterr().out.split(
        "\nwrote ")[0].strip()
    assert [r["setting"] for r in res["rows"]] == ["none", "int8_per_step", "int8",
                                                   "int8+bf16rec"]  # fp32 first
    assert res["docs"] == 2 and len(res["doc_ids"]) == 2 and res["scored_tokens_per_doc"] == 20
    assert all(n >= 21 for n in res["doc_tokens_before_truncation"])
    fp32, per_step, int8, bf16rec = res["rows"]
    # "+bf16rec": the same INT8 state with its window records (k~ and u) in bf16: 2 heads x 16
    # records x 2 bytes saved on each of K = 16 and V = 16; its own (nonzero) logit error
    assert (int8["state_bytes_per_row_per_layer"] - bf16rec["state_bytes_per_row_per_layer"]
            == 2 * 16 * 2 * (16 + 16))
    assert bf16rec["max_abs_logit_diff"] > 0
    # the reference is the state_quant=None path itself: no difference at all
    assert fp32["delta"] == 0.0 and fp32["max_abs_logit_diff"] == 0.0
    assert fp32["setting"] == "none" and fp32["state_bytes_per_row_per_layer"] == 4 * 2 * 16 * 16
    # per-step INT8 rounds the state every step: its logits move
    assert per_step["max_abs_logit_diff"] > 0 and per_step["delta"] != 0.0
    assert per_step["state_bytes_per_row_per_layer"] < fp32["state_bytes_per_row_per_layer"]
    for r in res["rows"]:
        assert np.isfinite(r["loss"]) and r["perplexity"] == pytest.approx(np.exp(r["loss"]))
        assert len(r["doc_loss"]) == 2 and len(r["by_position"]) == 4
        assert r["by_position"][0]["positions"][0] == 0
        assert r["by_position"][-1]["positions"][1] == 19
        assert r["step_ms_median"] > 0 and r["cache_bytes_per_row"] > 0
    # the training forward agrees with the fp32 decode to float rounding
    f = res["forward"]
    assert abs(f["delta"]) < 1e-4 and f["max_abs_logit_diff"] < 1e-3


def test_quality_mode_refuses_a_nan_row(gdn_run, monkeypatch):
    """A non-finite logit (what a refused row gives) is an error, not averaged."""
    real = leapquant_quality._score

    def poisoned(logits, targets, ref):
        return real(logits.at[1, 0].set(jnp.nan), targets, ref)

    monkeypatch.setattr(leapquant_quality, "_score", poisoned)
    with pytest.raises(FloatingPointError, match="non-finite logits .* first row 1"):
        leapquant_quality.quality(gdn_run, docs=2, length=8, settings=["none"], forward=False)


def test_cost_mode_times_every_format_and_counts_state_bytes(tmp_path, capsys):
    """--cost: one row per batch and format, float32 first (the ratios' base), the state bytes per
    row from the arrays (float32: heads*K*V*4; per-step int8: the int8 state plus its scales,
    smoothing and compensators, less than float32 at K=V=16; LeapQuant int8 adds the window's
    records)."""
    out = tmp_path / "cost.json"
    formats = bench_leapquant.COST_CHOICES  # the default rows and int8+bf16rec
    assert bench_leapquant.main(["--cost", "--batches", "1,2", "--cost-heads", "2", "--cost-dim",
                                 "16", "--cost-steps", "5", "--repeats", "1", "--cost-formats",
                                 ",".join(formats), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["format"]) for r in rows] == [
        (b, f) for b in (1, 2) for f in formats]
    by = {(r["batch"], r["format"]): r for r in rows}
    assert all(r["us_per_step"] > 0 for r in rows)
    fp32 = 2 * 16 * 16 * 4
    assert by[1, "none"]["state_bytes_per_row"] == by[2, "none"]["state_bytes_per_row"] == fp32
    assert by[1, "int8"]["state_bytes_per_row"] > by[1, "int8_per_step"]["state_bytes_per_row"]
    assert by[1, "int8_per_step"]["state_bytes_per_row"] < by[1, "none"]["state_bytes_per_row"]
    # bf16 records: 2 heads x 16 records x 2 bytes saved on each of k~ (K=16) and u (V=16)
    assert (by[1, "int8"]["state_bytes_per_row"] - by[1, "int8+bf16rec"]["state_bytes_per_row"]
            == 2 * 16 * 2 * (16 + 16))
    assert "| 2 | int8 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--cost-formats.*int8_bf16rec"):
        bench_leapquant.main(["--cost", "--cost-formats", "int8_bf16rec"])


def test_prefix_mode_settings_name_their_state_fields():
    """--prefix-settings: "none" is float32 states, "+bf16rec" adds bf16 window records, as the
    config overrides each setting's model is loaded with."""
    from aiinfra_jax.config import load_config
    preset = str(Path(__file__).resolve().parents[2] / "configs" / "gdn_tiny.py")
    specs = {s: load_config(preset, bench_leapquant.setting_overrides(s)).model.gated_delta
             .state_spec() for s in bench_leapquant.PREFIX_CHOICES}
    assert specs["none"] is None
    assert (specs["int8"].fmt, specs["int8"].record_dtype) == ("int8", "float32")
    assert specs["int8+bf16rec"] == dataclasses.replace(specs["int8"], record_dtype="bfloat16")
    with pytest.raises(SystemExit, match="--prefix-settings.*int9"):
        bench_leapquant.main(["--prefix", "--prefix-settings", "int8,int9"])


def test_prefix_mode_counts_snapshot_bytes_per_state_format(tmp_path, capsys):
    """--prefix: per setting the snapshots of one shared prompt; int8 snapshots leave out the
    empty window records, so they are smaller than bf16's and much smaller than float32's,
    and the hybrid's attention layers weigh the same in every format."""
    root = Path(__file__).resolve().parents[2] / "configs"
    out = tmp_path / "prefix.json"
    # 32 tokens in chunks of 16: one prefill program per setting (a last partial chunk would
    # compile a second one: 74 -> 35 s for this test on the 2-core CI machine)
    assert bench_leapquant.main(["--prefix", "--prefix-configs",
                                 f"{root / 'gdn_tiny.py'},{root / 'hybrid_tiny.py'}",
                                 "--prefix-tokens", "32", "--prefix-every", "16",
                                 "--prefix-decode", "4", "--set", "model.n_layers=4",
                                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["setting"] for r in rows] == list(bench_leapquant.PREFIX_SETTINGS) * 2
    by = {(Path(r["config"]).name, r["setting"]): r for r in rows}
    gdn = {s: by["gdn_tiny.py", s] for s in bench_leapquant.PREFIX_SETTINGS}
    assert all(r["snapshots"] == 2 and r["snapshot_attention_bytes"] == 0 for r in gdn.values())
    assert (gdn["int8"]["snapshot_bytes"] < gdn["bf16_per_step"]["snapshot_bytes"]
            < gdn["none"]["snapshot_bytes"])
    assert gdn["int8"]["snapshot_recurrent_bytes"] < 0.5 * gdn["none"]["snapshot_recurrent_bytes"]
    hybrid = {s: by["hybrid_tiny.py", s] for s in bench_leapquant.PREFIX_SETTINGS}
    assert len({r["snapshot_attention_bytes"] for r in hybrid.values()}) == 1
    assert hybrid["none"]["snapshot_attention_bytes"] > 0
    assert "| int8 |" in capsys.readouterr().out
