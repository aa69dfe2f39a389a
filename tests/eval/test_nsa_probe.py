"""The NSA probe: hand-made hit and chance shares, and a tiny random NSA model end to end."""

import numpy as np
import pytest
from flax import nnx

from aiinfra_jax.data import ByteTokenizer
from aiinfra_jax.eval import nsa_probe as npb
from aiinfra_jax.eval.longctx import LongCtxConfig, build_examples
from aiinfra_jax.models import ModelConfig, Transformer
from aiinfra_jax.models import NSAConfig

TOK = ByteTokenizer()


def test_copy_source_finds_the_first_verbatim_occurrence():
    assert npb.copy_source(np.array([5, 1, 2, 3, 1, 2]), np.array([1, 2])) == 1
    with pytest.raises(ValueError, match="verbatim"):
        npb.copy_source(np.array([5, 1, 2]), np.array([2, 1]))


def test_hit_shares_by_kv_head():
    idx = np.full((10, 2, 3), -1)
    idx[7, 0] = [0, 2, 3]       # head 0 holds block 2 (rows 8-11 at block size 4)
    idx[7, 1] = [0, 1, -1]
    idx[8] = [[0, 1, 2], [2, 0, 1]]
    hits = npb.hit_shares(idx, np.array([7, 8, 9]), np.array([9, 10, 9]), block_size=4)
    np.testing.assert_allclose(hits, [0.5, 1.0, 0.0])


def test_chance_shares_count_forced_and_free_blocks():
    kw = dict(block_size=32, n_selected=4, n_init=1, n_local=2)
    # query row 300: own block 9, 10 blocks, forced {0, 8, 9}, one free slot among 7 blocks.
    np.testing.assert_allclose(npb.chance_shares(np.array([300] * 3), np.array([5, 280, 140]),
                                                 **kw), [1.0, 1.0, 1 / 7])
    # every block fits the selection: always a hit.
    np.testing.assert_allclose(npb.chance_shares(np.array([100]), np.array([40]), **kw), [1.0])


def _nsa_model(n_selected):
    nsa = NSAConfig(cmp_block_len=16, cmp_stride=8, sel_block_size=32, n_selected=n_selected,
                    n_init=1, n_local=1, window=32, implementation="xla")
    cfg = ModelConfig(vocab_size=384, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                      mixers=("nsa",), nsa=nsa, max_seq_len=512)
    return Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30)))), cfg


def test_probe_end_to_end_on_a_tiny_nsa_model():
    examples = build_examples(TOK, LongCtxConfig(tasks=("niah_single_1", "passkey"), lengths=(256,),
                                                 depths=(0.0, 1.0)))
    # Every block selected: each layer (recorded through scan) must report a hit of 1.
    model, cfg = _nsa_model(n_selected=16)
    records = npb.probe(model, examples, cfg.nsa)
    assert len(records) == 4
    for r in records:
        assert len(r["layers"]) == cfg.n_layers and np.isfinite(r["answer_nll"])
        for layer in r["layers"]:
            assert layer["hit"] == 1.0 and layer["chance"] == 1.0
            assert all(0.0 < g < 1.0 for g in layer["gates"])
    # Two blocks (the first and the query's own): a needle at depth 0 of a 256-token prompt lies
    # in neither, so no head may report it.
    model, cfg = _nsa_model(n_selected=2)
    far = [ex for ex in examples if ex.depth == 0.0]
    records = npb.probe(model, far, cfg.nsa)
    for r in records:
        assert r["distance"] > 64
        assert all(layer["hit"] == 0.0 and layer["chance"] == 0.0 for layer in r["layers"])
    summary = npb.summarize(records)
    assert [row["depth"] for row in summary["rows"]] == [0.0]
    assert "hit / chance" in npb.format_summary(summary)


def test_probe_refuses_a_model_without_nsa_layers():
    cfg = ModelConfig(vocab_size=384, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                      max_seq_len=512)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    ex = build_examples(TOK, LongCtxConfig(tasks=("passkey",), lengths=(256,), depths=(0.5,)))
    with pytest.raises(ValueError, match="no NSA layer"):
        npb.probe(model, ex, NSAConfig())


def test_cli_refuses_a_run_without_nsa_before_loading(tmp_path, capsys):
    from aiinfra_jax.config import Config, save_config

    save_config(Config(model=ModelConfig(max_seq_len=600)), tmp_path / "config.json")
    assert npb.main(["--checkpoint", str(tmp_path), "--tasks", "passkey"]) == 1
    err = capsys.readouterr().err
    assert "eval.nsa_probe needs a model with NSA layers" in err and "'dense'" in err
    assert "no checkpoint" not in err  # refused on the config, before the checkpoint is opened
    assert npb.main(["--checkpoint", str(tmp_path / "missing"), "--tasks", "passkey"]) == 1
    assert "not a run directory (no config.json)" in capsys.readouterr().err


def test_branches_off_fixes_their_gates_at_exactly_zero():
    import jax
    import jax.numpy as jnp

    from aiinfra_jax.models.attention.nsa import branch_records, with_branches_off

    model, _ = _nsa_model(n_selected=2)
    tokens = jnp.asarray(np.random.default_rng().integers(0, 256, (1, 96)), jnp.int32)

    def gates(m):
        _, _, aux = jax.jit(lambda m: m(tokens, positions=jnp.arange(96, dtype=jnp.int32)[None],
                                        capture_intermediates=True))(m)
        return np.stack([r["gates"] for r in branch_records(aux)])  # [layers,B,T,H,3]

    before = gates(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    off = nnx.merge(graphdef, with_branches_off(params, ("cmp", "win")), rest)
    after = gates(off)
    assert np.all(after[..., [0, 2]] == 0.0) and np.all(before[..., [0, 2]] > 0.0)
    # The first layer's input is unchanged, so its slc gate is too (later layers' inputs move).
    np.testing.assert_array_equal(after[0, ..., 1], before[0, ..., 1])
    with pytest.raises(ValueError, match="name one or more of cmp, slc, win"):
        with_branches_off(params, ("window",))
    dense = Transformer(ModelConfig(vocab_size=384, d_model=32, n_layers=1, n_heads=2,
                                    n_kv_heads=1, d_ff=64, max_seq_len=512), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no NSA layer"):
        with_branches_off(nnx.state(dense, nnx.Param), ("cmp",))
