"""The benchmark CLIs run end to end at toy sizes and write their outputs (no timing asserted)."""

import json

import pytest

from aiinfra_jax.eval import bench_kernels, bench_train


def test_bench_kernels_toy(tmp_path):
    assert bench_kernels.main(["--lengths", "256", "--heads", "2", "--head-dim", "16",
                               "--block", "16", "--n", "4", "--repeats", "1",
                               "--ops", "dense,sparse,window,compressed,select,gdn,gdn_rec",
                               "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    ops = {(r["op"], r["mode"]) for r in res["rows"]}
    assert {("dense_sdpa", "fwd"), ("dense_flash", "fwd+bwd"), ("sparse", "fwd+bwd"),
            ("window", "fwd"), ("compressed", "fwd+bwd"), ("select", "fwd"),
            ("gdn", "fwd+bwd"), ("gdn_rec", "fwd")} <= ops
    assert all("recurrent_speedup" in r for r in res["rows"] if r["op"] == "gdn")
    assert all(r["seconds"] > 0 for r in res["rows"])
    assert all("speedup_vs_dense" in r for r in res["rows"] if not r["op"].startswith("dense"))
    assert res["meta"]["matmul_peak_flop_per_s"] > 0
    assert all(r["peak_fraction"] > 0 for r in res["rows"])
    # torch is in the dev extra (as in CI): its SDPA is timed on the same shapes, and dense_flash
    # rows carry their time over torch's.
    assert {("dense_torch", "fwd"), ("dense_torch", "fwd+bwd")} <= ops
    assert all(r["vs_torch"] > 0 for r in res["rows"] if r["op"] == "dense_flash")
    assert (tmp_path / "results.md").exists() and (tmp_path / "time_vs_length.png").exists()
    # select_blocks' selections: no duplicate blocks, fewer keys attended than the nominal n * P
    # (early queries have fewer blocks), and FLOP/s counted from the keys actually attended.
    for r in (r for r in res["rows"] if r["op"] == "sparse"):
        assert r["duplicate_blocks"] == 0 and r["keys_nominal"] == 4 * 16
        assert 0 < r["keys_actual"] < r["keys_nominal"]
        assert 0 < r["flops_actual"] < r["flops"]


def test_nsa_selection_uses_select_blocks_without_duplicates():
    """The selections bench_kernels times come from select_blocks on compressed scores: causal,
    duplicate-free, and attended keys counted per query as sparse_attention sees them."""
    import jax
    import numpy as np

    T, P, n = 200, 16, 4
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (1, T, 2, 16))
    k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, T, 1, 16)) for i in (1, 2))
    idx, kc, vc, lse = bench_kernels.nsa_selection(q, k, v, block=P, n=n)
    idx = np.asarray(idx)
    assert idx.shape == (1, T, 1, n) and kc.shape == vc.shape == (1, (T - 32) // 16 + 1, 1, 16)
    own = np.arange(T)[None, :, None] // P
    assert np.all(idx.max(-1) == own) and np.all(idx[..., 0] == 0)       # forced blocks
    keys, dups = bench_kernels.attended_keys(idx, P)
    assert dups == 0
    # query t: min(n, own + 1) blocks, all full except its own (t % P + 1 keys so far)
    t = np.arange(T)
    np.testing.assert_array_equal(keys[0, :, 0], (np.minimum(n, t // P + 1) - 1) * P + t % P + 1)
    twice = idx.copy()
    twice[..., 1] = twice[..., 0]
    assert bench_kernels.attended_keys(twice, P)[1] > 0


def test_bench_train_toy(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_train.main([
        "--steps", "6", "--out", str(out),
        "--set", "model.d_model=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2",
        "--set", "model.n_kv_heads=1", "--set", "data.seq_len=32", "--set", "data.batch_size=4",
        "--set", "mesh.num_devices=1"]) == 0
    res = json.loads(out.read_text())
    assert res["tokens_per_sec"] > 0 and res["loop_s_per_step_median"] > 0
    assert "outside_step_frac" in res and res["device"]


def test_bench_nsa_flops_table(tmp_path):
    """The FLOP-ratio table: dense / NSA grows with length (NSA reads O(T/d + n*l' + w) keys per
    query against dense's O(T)); at 32K with the paper's sizes it stays under 5x (the ceiling that
    eval/BENCHMARKS.md reports for the NSA layer's forward speed-up)."""
    from aiinfra_jax.eval import bench_nsa

    bench_nsa.main(["flops", "--widths", "512/8/2", "--lengths", "8192,32768",
                    "--out", str(tmp_path)])
    res = json.loads((tmp_path / "result.json").read_text())
    r8, r32 = (res["rows"][0]["ratios"][k] for k in ("8192", "32768"))
    assert 1.0 < r8 < r32 < 5.0
    assert "| 512 / 8 / 2 (64) |" in (tmp_path / "result.md").read_text()


def test_bench_nsa_layer_table_ratios():
    """The layer table: speed-up over the FLOP ratio (dense / NSA) and, when the torch NSA ran,
    torch's time over ours, from the rows of one invocation."""
    from aiinfra_jax.eval import bench_nsa

    rows = [{"kind": "dense", "seq_len": 8192, "forward_s": 4.0, "fwd_bwd_s": 12.0,
             "flops_fwd": 8.0, "flops_decode": 4.0, "bytes_decode": 8.0},
            {"kind": "nsa", "seq_len": 8192, "forward_s": 1.0, "fwd_bwd_s": 4.0,
             "flops_fwd": 2.0, "flops_decode": 1.0, "bytes_decode": 1.0},
            {"kind": "torch_nsa", "seq_len": 8192, "forward_s": 10.0, "fwd_bwd_s": 60.0}]
    md = bench_nsa.layer_markdown({"device": "cpu", "date": "d", "config": {}, "rows": rows})
    assert "| 8192 | forward | 4.0000 | 1.0000 | 4.0x | 4.0x | 1.00 |" in md
    assert "| 8192 | fwd+bwd | 12.0000 | 4.0000 | 3.0x | 4.0x | 0.75 |" in md
    assert md.rstrip().splitlines()[-1].endswith("| 60.0000 | 15.0x |")
    # decode steps against their cache bytes at the invocation's copy bandwidth
    rows[0].update(decode_s=0.004, bytes_decode=2e7)
    rows[1].update(decode_s=0.0006, bytes_decode=2e6)
    md = bench_nsa.layer_markdown({"device": "cpu", "date": "d", "config": {}, "rows": rows,
                                   "copy_bytes_per_s": 5e9})
    assert md.rstrip().splitlines()[-1] == (
        "- T=8192: dense 4.00 ms / 4.00 ms = 1.00x; nsa 0.60 ms / 0.40 ms = 1.50x")
    assert 1e8 < bench_nsa.copy_bandwidth(repeats=1) < 1e12


@pytest.mark.parametrize("step", ["train", "eval", "decode"])
def test_profile_step_toy(tmp_path, step):
    """The step profiler traces a toy train (or eval, or cached decode) step and maps compiled ops
    back to JAX op names."""
    from aiinfra_jax.eval import profile_step

    assert profile_step.main([
        "--out", str(tmp_path), "--calls", "1", "--top", "3", "--step", step, "--context", "16",
        "--batch", "2",
        "--set", "model.d_model=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2",
        "--set", "model.n_kv_heads=1", "--set", "data.seq_len=32", "--set", "data.batch_size=4",
        "--set", "mesh.num_devices=1"]) == 0
    res = json.loads((tmp_path / "ops.json").read_text())
    assert res["rows"] and res["total_op_seconds_per_call"] > 0
    assert any("dot_general" in r["op_name"] for r in res["rows"])  # the matmuls are found
    assert not any(r["op"].startswith(("while", "Pjit")) for r in res["rows"])


@pytest.mark.parametrize("rounds", [1, 2])
def test_bench_attnres_overhead_toy(tmp_path, rounds):
    """The overhead table times a train step and a forward per scheme and divides by standard's,
    one scheme after the other or in interleaved rounds."""
    from aiinfra_jax.eval import bench_attnres

    assert bench_attnres.main([
        "--skip-quality", "--deep-layers", "0", "--steps", "1", "--rounds", str(rounds),
        "--set", "model.d_model=32",
        "--set", "model.n_heads=2", "--set", "model.n_kv_heads=1", "--set", "model.n_layers=2",
        "--set", "model.attnres.n_blocks=2", "--set", "data.seq_len=16",
        "--set", "data.batch_size=2", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_attnres.json").read_text())["overhead"]
    assert [r["residual"] for r in rows] == ["standard", "attnres_full", "attnres_block"]
    assert rows[0]["train_ratio"] == 1.0
    assert all(r["train_step_s"] > 0 and r["forward_s"] > 0 for r in rows)
    assert all(r["train_calls"] == rounds and r["rounds"] == rounds for r in rows)


def test_bench_attnres_memory_toy(tmp_path):
    """--memory tabulates compiled gradient temporaries; remat=full (AttnRes rebuilding its depth
    buffer) needs less than remat=none for the deeper Full AttnRes model, and for the standard
    residual, also under the preset's unrolled layer scan (model.scan_unroll=0: under remat the
    layers stay looped, since unrolled XLA kept about what remat=none keeps)."""
    from aiinfra_jax.eval import bench_attnres

    assert bench_attnres.main([
        "--skip-overhead", "--skip-quality", "--memory", "--deep-layers", "4",
        "--set", "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.n_kv_heads=1",
        "--set", "model.n_layers=1", "--set", "model.attnres.n_blocks=2",
        "--deep-set", "model.attnres.n_blocks=4", "--set", "data.seq_len=16",
        "--set", "data.batch_size=2", "--set", "model.scan_unroll=0",
        "--residuals", "standard,attnres_full", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_attnres.json").read_text())["memory"]
    mem = {(r["setting"], r["residual"], r["remat"]): r["grad_temp_mib"] for r in rows}
    assert len(mem) == 8  # {shallow, deep} x {standard, Full} x {remat none, full}
    for residual in ("standard", "attnres_full"):
        assert mem[("deep L=4", residual, "full")] < mem[("deep L=4", residual, "none")], mem


def test_bench_moe_quality_parts():
    """eval/bench_moe.py --quality's pieces on fresh tiny models: the FFN weight counts of its table
    equal the modules' parameters (router excluded), layer 0's FFN comes out of a scanned stack
    with its own weights, and the FFN timer returns a time for every batch and the train step."""
    import jax
    import numpy as np
    from flax import nnx

    from aiinfra_jax.config import load_config
    from aiinfra_jax.eval import bench_moe
    from aiinfra_jax.models import Transformer

    small = ["model.d_model=32", "model.n_layers=2", "model.vocab_size=64"]
    for preset, over in (("tiny.py", []), ("moe_tiny.py", bench_moe.FINE),
                         ("deamoe_tiny.py", ["model.deamoe.department_d_ff=24",
                                             "model.deamoe.private_dim=8"])):
        cfg = load_config(f"configs/{preset}", small + over)
        model = Transformer(cfg.model, rngs=nnx.Rngs(0))
        ffn = bench_moe.first_ffn(model, cfg)
        params = nnx.state(ffn, nnx.Param)
        n = sum(int(np.prod(v.shape)) for path, v in jax.tree_util.tree_leaves_with_path(params)
                if "w_router" not in jax.tree_util.keystr(path))
        total, used = bench_moe.ffn_weights(cfg)
        assert n == total and 0 < used <= total, preset
        stacked = model.blocks.layers[0].ffn.w_gate[...] if cfg.model.scan_layers else None
        if stacked is not None:
            np.testing.assert_array_equal(ffn.w_gate[...], stacked[0])
        times = bench_moe.time_ffn(ffn, 32, [1, 3], (2, 8), repeats=1)
        assert set(times["decode"]) == {1, 3} and times["train"] > 0


def test_bench_kernels_skips_a_program_over_the_memory_limit(tmp_path):
    """A program whose compiled temporaries exceed --max-temp-gb is listed, not run."""
    assert bench_kernels.main(["--lengths", "64", "--heads", "1", "--head-dim", "8",
                               "--repeats", "1", "--ops", "gdn_rec", "--no-dense-baseline",
                               "--max-temp-gb", "1e-9", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["rows"] == []
    assert [s.split(":")[0] for s in res["meta"]["skipped"]] == ["gdn_rec fwd at T=64",
                                                                  "gdn_rec fwd+bwd at T=64"]
    assert "Not run: gdn_rec fwd+bwd at T=64" in (tmp_path / "results.md").read_text()


def test_bench_recall_task_and_cli(tmp_path):
    """MQAR batches: every weighted target is the value its key had in the context; the CLI runs
    a toy grid and writes its table."""
    import numpy as np

    from aiinfra_jax.eval import bench_recall

    pairs = int(np.random.default_rng().integers(2, 9))
    x, y, w = (np.asarray(a) for a in bench_recall.recall_batch(np.random.default_rng(), 5, pairs))
    assert x.shape == y.shape == w.shape == (5, 4 * pairs - 1) and w.sum() == 5 * pairs
    for b in range(5):
        context = dict(zip(x[b, 0:2 * pairs:2], x[b, 1:2 * pairs:2]))
        assert len(context) == pairs and all(1 <= k < 64 <= context[k] < 128 for k in context)
        for t in np.flatnonzero(w[b]):
            assert t >= 2 * pairs and y[b, t] == context[x[b, t]]
    # several query passes: every pass asks every key once, each followed by its context value
    x, y, w = (np.asarray(a) for a in bench_recall.recall_batch(np.random.default_rng(), 3, pairs,
                                                                 rounds=3))
    assert x.shape == (3, 8 * pairs - 1) and w.sum() == 3 * 3 * pairs
    for b in range(3):
        context = dict(zip(x[b, 0:2 * pairs:2], x[b, 1:2 * pairs:2]))
        for r in range(3):
            asked = x[b, 2 * pairs * (r + 1):2 * pairs * (r + 2):2]
            assert sorted(asked) == sorted(context)
        assert all(y[b, t] == context[x[b, t]] for t in np.flatnonzero(w[b]))
    assert bench_recall.main(["--mixers", "dense,gdn", "--lrs", "1e-3", "--heads", "1,2",
                              "--steps", "3", "--pairs", "2", "--d-model", "16",
                              "--quant-rounds", "3", "--quant-settings", "int8_per_step,int8",
                              "--quant-batch", "4", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["mixer"], r["heads"]) for r in rows] == [("dense", 1), ("dense", 2), ("gdn", 1),
                                                        ("gdn", 2)]
    assert all(0.0 <= r["final_accuracy"] <= 1.0 and len(r["curve"]) == 3 for r in rows)
    table = (tmp_path / "results.md").read_text()
    assert "| gdn | 0.001 | 2 x 8 |" in table and "| gdn | 0.001 | 2 x 8 | int8 |" in table
    # the recurrent cells decode through every state format, float32 first (the reference, which
    # the training forward matches); the dense cells have no recurrent state
    assert all("quantized" not in r for r in rows[:2])
    for r in rows[2:]:
        q = r["quantized"]
        assert q["tokens"] == 2 * 2 * 4 and q["sequences"] == 4
        assert [s["setting"] for s in q["rows"]] == ["none", "int8_per_step", "int8",
                                                     "training forward"]
        assert q["rows"][0]["max_abs_logit_diff"] == 0.0
        assert q["rows"][-1]["max_abs_logit_diff"] < 1e-4
        assert q["rows"][-1]["accuracy"] == q["rows"][0]["accuracy"]
        assert q["rows"][1]["state_bytes_per_row_per_layer"] < q["rows"][0][
            "state_bytes_per_row_per_layer"]
    with pytest.raises(SystemExit):
        bench_recall.main(["--heads", "3", "--d-model", "16"])
    with pytest.raises(SystemExit, match="2"):  # argparse's exit code for a refused flag
        bench_recall.main(["--quant-rounds", "2", "--quant-settings", "int5"])
