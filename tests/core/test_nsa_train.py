"""NSA through the training loop: a tiny run learns; a sharded run matches one device."""

import pytest

from aiinfra_jax.config import load_config
from aiinfra_jax.train import train

# configs/nsa_tiny.py shrunk like tests/core/test_train.py's TINY, with NSA sizes for 32 tokens:
# compression blocks 4 / stride 2, 3 selected blocks of 8 (of 4), a window of 8.
TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
    "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=2", "optim.lr=3e-3",
    "eval.every=0", "eval.batches=2", "eval.final_batches=2", "run.progress=false",
    "checkpoint.every=0", "mesh.num_devices=1",
    "model.nsa.cmp_block_len=4", "model.nsa.cmp_stride=2", "model.nsa.sel_block_size=8",
    "model.nsa.n_selected=3", "model.nsa.n_local=1", "model.nsa.window=8",
]


def tiny(tmp_path, *extra):
    return load_config("configs/nsa_tiny.py", TINY + [f"run.output_dir={tmp_path}"] + list(extra))


def losses(summary):
    return {r["step"]: r["loss"] for r in summary["history"]}


def test_tiny_nsa_run_learns_and_sharded_run_matches(tmp_path):
    """30 steps on one device learn; the first 2 steps on a data=2, fsdp=2, tensor=2 mesh of the 8
    simulated devices (same schedule, stopped early) give the same losses."""
    common = ["run.steps=30", "run.log_every=1", "optim.lr=1e-2"]
    cfg = tiny(tmp_path / "one", *common)
    assert cfg.model.mixers == ("nsa",)
    one = losses(train(cfg, quiet=True))
    assert all(v == v and abs(v) < 1e9 for v in one.values()), one  # finite
    assert one[30] < one[5] - 0.5, one  # bytes start near ln(384) = 5.95
    eight = train(tiny(tmp_path / "eight", *common, "mesh.num_devices=8", "mesh.data=2",
                       "mesh.fsdp=2", "mesh.tensor=2"), stop_after=2, quiet=True)
    assert sorted(losses(eight)) == [1, 2]
    for step, loss in losses(eight).items():
        assert loss == pytest.approx(one[step], rel=2e-5), step
