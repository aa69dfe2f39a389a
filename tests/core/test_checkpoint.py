"""Tests for aiinfra_jax.checkpoint on 8 simulated CPU devices (see tests/conftest.py)."""

from __future__ import annotations

import logging
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from helpers import data_files, flip_byte_of
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from aiinfra_jax.checkpoint import (
    Checkpointer,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    NoCheckpointError,
    RestoreError,
    check_compatible,
)

# When tensorstore fails a read, orbax's private event loop is sometimes closed before a pending
# tensorstore callback runs; Python then reports "Event loop is closed" as unraisable, during
# whichever test the garbage collector happens to run in. Benign.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

CONFIG = {"model": {"d_model": 32, "n_layers": 2, "mixer": "nsa", "block": (16, 64)}, "optim": {"lr": 1e-3}}


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) == 8, "tests expect 8 simulated CPU devices (tests/conftest.py)"
    return jax.make_mesh((4, 2), ("data", "model"))


def make_state(mesh, seed: int = 0) -> dict:
    """A small training-state-like pytree: sharded/replicated floats, bf16, int step, a tuple node."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    w = jax.device_put(jax.random.normal(k1, (16, 8)), NamedSharding(mesh, P("data", "model")))
    emb = jax.device_put(jax.random.normal(k2, (8, 4)).astype(jnp.bfloat16), NamedSharding(mesh, P(None, "model")))
    b = jax.device_put(jax.random.uniform(k3, (8,)), NamedSharding(mesh, P()))
    return {
        "params": {"w": w, "emb": emb, "b": b},
        "opt_state": ({"mu": w * 0.5, "count": jnp.int32(seed + 3)},),
        "step": jnp.int32(seed + 7),
    }


def abstract_of(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


def test_round_trip_values_dtypes_shardings_data_and_config(tmp_path, mesh):
    state = make_state(mesh, seed=1)
    data_state = {"iterator": {"next_index": 123, "epoch": 2}, "files": ["a.txt", "b.txt"]}
    with Checkpointer(tmp_path / "ckpt", config=CONFIG, async_save=True) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(10, state, data_state)
        ckpt.wait()
        assert ckpt.all_steps() == [10]

    # A fresh process would build a new Checkpointer; restore into *different* shardings.
    other = jax.make_mesh((2, 4), ("data", "model"))
    target = {
        "params": {
            "w": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(other, P("model", None))),
            "emb": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=NamedSharding(other, P("data", None))),
            "b": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(other, P())),
        },
        "opt_state": (
            {
                "mu": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(other, P("data", "model"))),
                "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(other, P())),
            },
        ),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(other, P())),
    }
    ckpt = Checkpointer(tmp_path / "ckpt", config=CONFIG)
    assert ckpt.latest_step() == 10
    restored, restored_data, saved_config = ckpt.restore(target)
    ckpt.close()
    assert_trees_equal(restored, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    assert restored_data == data_state
    assert saved_config["model"]["d_model"] == 32 and saved_config["model"]["block"] == [16, 64]
    assert saved_config["optim"] == CONFIG["optim"]

    # Concrete arrays are accepted as the restore target too (their shardings are used).
    ckpt = Checkpointer(tmp_path / "ckpt", config=CONFIG)
    again, _, _ = ckpt.restore(make_state(mesh, seed=5), step=10)
    ckpt.close()
    assert_trees_equal(again, state)
    assert again["params"]["w"].sharding == state["params"]["w"].sharding


def test_data_state_none_and_sync_save(tmp_path, mesh):
    state = make_state(mesh, seed=2)
    with Checkpointer(tmp_path, config=CONFIG, async_save=False) as ckpt:
        assert ckpt.save(3, state, None)
        restored, data_state, _ = ckpt.restore(abstract_of(state))
    assert data_state is None
    assert_trees_equal(restored, state)


def test_keep_last_n_and_cadence(tmp_path, mesh):
    state = make_state(mesh, seed=3)
    with Checkpointer(tmp_path, config=CONFIG, keep=2, save_every=5) as ckpt:
        saved = [s for s in range(1, 21) if ckpt.save(s, state, {"i": s})]
        assert saved == [5, 10, 15, 20]
        assert ckpt.save(21, state, {"i": 21}, force=True)
        assert not ckpt.save(21, state, {"i": 21}, force=True)  # already saved: not again
        with pytest.raises(ValueError, match=r"step 12 .*newer step 21"):
            ckpt.save(12, state, {"i": 12}, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [20, 21]
        _, data_state, _ = ckpt.restore(abstract_of(state), step=20)
        assert data_state == {"i": 20}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["20", "21"]


def test_latest_step_ignores_partial_folder_and_logs_it(tmp_path, mesh, caplog):
    state = make_state(mesh, seed=4)
    with Checkpointer(tmp_path, config=CONFIG) as ckpt:
        ckpt.save(1, state, {"i": 1})
    # Simulate a save of step 2 killed half-way: orbax's uncommitted folder with some files.
    partial = tmp_path / "2.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / "1", partial)
    shutil.rmtree(partial / "state")
    with caplog.at_level(logging.WARNING, logger="aiinfra_jax.checkpoint"):
        ckpt = Checkpointer(tmp_path, config=CONFIG)
    assert any("2.orbax-checkpoint-tmp" in r.getMessage() and "interrupted" in r.getMessage() for r in caplog.records)
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    restored, data_state, _ = ckpt.restore(abstract_of(state))
    assert data_state == {"i": 1}
    assert_trees_equal(restored, state)
    # Saving step 2 again replaces the partial folder with a committed checkpoint.
    assert ckpt.save(2, state, {"i": 2})
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_in_flight_save_never_removes_last_good_checkpoint(tmp_path, mesh, monkeypatch):
    """keep=1: while step 2 is being written, step 1 must stay; it goes only once 2 is committed."""
    state = make_state(mesh, seed=5)
    ckpt = Checkpointer(tmp_path, config=CONFIG, keep=1, async_save=True)
    ckpt.save(1, state, {"i": 1})
    ckpt.wait()

    gate, consulted = threading.Event(), threading.Event()

    class _GateFuture:  # a commit future that completes only when the test opens the gate
        def result(self, timeout=None):
            consulted.set()
            if not gate.wait(timeout=60):
                raise TimeoutError("test gate never opened")

    original = ocp.JsonCheckpointHandler.async_save

    async def gated_async_save(self, *args, **kwargs):
        futures = await original(self, *args, **kwargs)
        return list(futures or []) + [_GateFuture()]

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", gated_async_save)
    try:
        assert ckpt.save(2, state, {"i": 2})
        names = sorted(p.name for p in tmp_path.iterdir())
        assert "1" in names and "2" not in names, names
        assert any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names
        # Another process looking at the directory now resumes from step 1.
        assert Checkpointer(tmp_path, config=CONFIG).latest_step() == 1
    finally:
        gate.set()
    ckpt.wait()
    ckpt.close()
    assert consulted.is_set(), "the save did not wait on the gated commit future"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]


def test_corrupt_checkpoint_names_step_and_fix(tmp_path, mesh):
    state = make_state(mesh, seed=6)
    with Checkpointer(tmp_path, config=CONFIG) as ckpt:
        ckpt.save(1, state, {"i": 1})
        ckpt.save(2, state, {"i": 2})
    data_files = [p for p in (tmp_path / "2" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for p in data_files:
        p.unlink()
    ckpt = Checkpointer(tmp_path, config=CONFIG)
    with pytest.raises(CorruptCheckpointError) as err:
        ckpt.restore(abstract_of(state))
    msg = str(err.value)
    assert "step 2" in msg and str(tmp_path / "2") in msg and "move" in msg and "(1)" in msg
    # The other step still restores.
    restored, _, _ = ckpt.restore(abstract_of(state), step=1)
    assert_trees_equal(restored, state)
    ckpt.close()

    shutil.rmtree(tmp_path / "1" / "config")
    with Checkpointer(tmp_path, config=CONFIG) as ckpt:
        with pytest.raises(CorruptCheckpointError, match=r"step 1 .*config"):
            ckpt.restore(abstract_of(state), step=1)


def test_an_intact_step_that_does_not_fit_the_mesh_is_not_called_corrupt(tmp_path, mesh):
    """A restore that fails for the arrays asked for (a dimension the mesh axis does not divide),
    not for the files: a RestoreError saying the files are fine, never "move it away"."""
    state = {"w": jnp.arange(6.0)}
    with Checkpointer(tmp_path, config=CONFIG, async_save=False) as ckpt:
        ckpt.save(1, state, None)
    abstract = {"w": jax.ShapeDtypeStruct((6,), jnp.float32,
                                          sharding=NamedSharding(mesh, P("data")))}  # 6 over 4
    with Checkpointer(tmp_path, config=CONFIG) as ckpt:
        with pytest.raises(RestoreError, match=r"step 1 .* is intact \(read back and its "
                                               r"checksums verified just now\).*keep them") as err:
            ckpt.restore(abstract)
        assert "move" not in str(err.value)
        with pytest.raises(RestoreError, match="is intact"):
            ckpt.restore_subtree(abstract)
        restored, _ = ckpt.restore_subtree(
            {"w": jax.ShapeDtypeStruct((6,), jnp.float32, sharding=NamedSharding(mesh, P()))})
        np.testing.assert_array_equal(restored["w"], np.arange(6.0))


def test_incompatible_config_lists_differing_keys(tmp_path, mesh):
    state = make_state(mesh, seed=7)
    with Checkpointer(tmp_path, config=CONFIG) as ckpt:
        ckpt.save(1, state, None)
    new_config = {
        "model": {"d_model": 64, "n_layers": 2, "mixer": "nsa", "block": [16, 64], "rope": True},
        "optim": {"lr": 5e-4},  # other sections may change on resume
    }
    with pytest.raises(IncompatibleCheckpointError) as err:
        Checkpointer(tmp_path, config=new_config).restore(abstract_of(state))
    msg = str(err.value)
    assert "model.d_model: checkpoint 32, current 64" in msg
    assert "model.rope: checkpoint '<missing>', current True" in msg
    assert "block" not in msg and "lr" not in msg  # tuple vs list is not a difference
    assert "2 key(s)" in msg

    # Only the optim section changed: fine.
    ok = {**CONFIG, "optim": {"lr": 5e-4}}
    _, _, saved = Checkpointer(tmp_path, config=ok).restore(abstract_of(state))
    assert saved["optim"] == {"lr": 1e-3}


def test_check_compatible_direct():
    check_compatible({"model": {"a": (1, 2)}}, {"model": {"a": [1, 2]}, "x": 1})
    with pytest.raises(IncompatibleCheckpointError, match=r"data.seq_len: checkpoint 128, current 256"):
        check_compatible({"data": {"seq_len": 128}}, {"data": {"seq_len": 256}}, sections=("model", "data"))


def test_structure_mismatch_names_first_path(tmp_path, mesh):
    state = make_state(mesh, seed=8)
    with Checkpointer(tmp_path, config=CONFIG) as ckpt:
        ckpt.save(1, state, None)
    ckpt = Checkpointer(tmp_path, config=CONFIG)

    wrong_shape = abstract_of(state)
    wrong_shape["params"]["w"] = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=state["params"]["w"].sharding)
    with pytest.raises(IncompatibleCheckpointError, match=r"'params/w' has shape \(16, 8\) in the checkpoint, \(16, 4\) now"):
        ckpt.restore(wrong_shape)

    extra = abstract_of(state)
    extra["params"]["new_gate"] = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=state["params"]["b"].sharding)
    with pytest.raises(IncompatibleCheckpointError, match=r"'params/new_gate' is in the current state but not in the checkpoint"):
        ckpt.restore(extra)

    missing = abstract_of(state)
    del missing["opt_state"][0]["count"]
    with pytest.raises(IncompatibleCheckpointError, match=r"'opt_state/0/count' is in the checkpoint but not"):
        ckpt.restore(missing)

    wrong_dtype = abstract_of(state)
    wrong_dtype["step"] = jax.ShapeDtypeStruct((), jnp.float32, sharding=state["step"].sharding)
    with pytest.raises(IncompatibleCheckpointError, match=r"'step' has dtype int32 in the checkpoint, float32 now"):
        ckpt.restore(wrong_dtype)

    no_sharding = abstract_of(state)
    no_sharding["step"] = jax.ShapeDtypeStruct((), jnp.int32)
    with pytest.raises(ValueError, match=r"'step' has no sharding"):
        ckpt.restore(no_sharding)
    ckpt.close()


def test_directory_with_junk_but_no_checkpoint_is_an_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "old_run").mkdir()
    with pytest.raises(ValueError, match=r"holds files but no checkpoint .*notes.txt.*Fix"):
        Checkpointer(tmp_path, config=CONFIG)


def test_restore_without_checkpoint_is_an_error(tmp_path, mesh):
    state = make_state(mesh, seed=9)
    with Checkpointer(tmp_path / "new", config=CONFIG) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(NoCheckpointError, match=r"no committed checkpoint in .*new"):
            ckpt.restore(abstract_of(state))
        ckpt.save(4, state, None)
        with pytest.raises(ValueError, match=r"step 5 .*available steps: \[4\]"):
            ckpt.restore(abstract_of(state), step=5)


def test_read_only_needs_a_checkpoint_and_never_writes(tmp_path, mesh):
    with pytest.raises(NoCheckpointError, match=r"no checkpoint directory .*missing"):
        Checkpointer(tmp_path / "missing", config=CONFIG, read_only=True)
    assert not (tmp_path / "missing").exists()
    other = tmp_path / "other_run"  # files but no checkpoint: named, not "refusing to start"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "3.orbax-checkpoint-tmp").mkdir()
    with pytest.raises(NoCheckpointError, match=r"no committed checkpoint in .*other_run "
                       r"\(only interrupted saves: 3.orbax-checkpoint-tmp\)"):
        Checkpointer(other, config=CONFIG, read_only=True)
    state = make_state(mesh, seed=2)
    with Checkpointer(tmp_path / "ckpt", config=CONFIG, keep=1, async_save=False) as ckpt:
        ckpt.save(1, state, {"pos": 1})
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    with Checkpointer(tmp_path / "ckpt", config=CONFIG, keep=1, read_only=True) as ckpt:
        restored, data_state, _ = ckpt.restore(abstract_of(state))
        assert data_state == {"pos": 1}
        np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(state["params"]["w"]))
        with pytest.raises(RuntimeError, match="read-only"):
            ckpt.save(2, state, None, force=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before


def test_bad_arguments(tmp_path, mesh):
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, config=CONFIG, keep=0)
    with pytest.raises(ValueError, match="save_every"):
        Checkpointer(tmp_path, config=CONFIG, save_every=-1)
    with pytest.raises(ValueError, match="JSON"):
        Checkpointer(tmp_path, config={"model": {"f": object()}})
    with Checkpointer(tmp_path, config=CONFIG) as ckpt:
        with pytest.raises(ValueError, match="data_state must be JSON"):
            ckpt.save(1, make_state(mesh), {"x": object()})
        with pytest.raises(TypeError, match=r"state leaf 'name'"):
            ckpt.save(1, {"name": "abc", "x": jnp.ones(3)}, None)
        assert ckpt.all_steps() == []


# --------------------------------------------------------------------------------------------------
# Checksums: damaged files are refused, never restored as changed values
# --------------------------------------------------------------------------------------------------


def make_bits_state(mesh, seed: int = 0) -> dict:
    """make_state plus an array of random bits: OCDBT's zstd stores incompressible data verbatim, so
    its shards' bytes can be found (and damaged) in the data files."""
    state = make_state(mesh, seed)
    bits = jax.random.bits(jax.random.key(100 + seed), (64, 32), jnp.uint32)
    state["params"]["bits"] = jax.device_put(bits, NamedSharding(mesh, P("data", "model")))
    return state


def test_flipped_byte_in_array_data_is_refused_naming_step_array_and_good_steps(tmp_path, mesh, caplog):
    state = make_bits_state(mesh, seed=10)
    with Checkpointer(tmp_path, config=CONFIG, keep=3) as ckpt:
        ckpt.save(1, state, {"i": 1})
        ckpt.save(2, state, {"i": 2})
    flip_byte_of(tmp_path / "2", state["params"]["bits"], shard=3)

    ckpt = Checkpointer(tmp_path, config=CONFIG)
    with pytest.raises(CorruptCheckpointError) as err:
        ckpt.restore(abstract_of(state))
    msg = str(err.value)
    assert f"step 2 at {tmp_path / '2'} is damaged" in msg
    assert "array 'params/bits' does not match its checksum in 1 of its 8 shards, e.g. [16:32, 16:32]" in msg
    assert "step 1 verifies" in msg and "restore another step (1)" in msg
    assert f"Fix: move {tmp_path / '2'} out of {tmp_path} (a resume then starts from step 1" in msg
    # The older step is still there, verifies, and restores exactly.
    assert ckpt.all_steps() == [1, 2] and ckpt.verify(1) and ckpt.verified_step == 1
    restored, data_state, _ = ckpt.restore(abstract_of(state), step=1)
    assert_trees_equal(restored, state) and data_state == {"i": 1}
    # A partial restore checks the arrays it reads: params (with bits) is refused, step is fine.
    abstract = abstract_of(state)
    with pytest.raises(CorruptCheckpointError, match=r"step 2 .*'params/bits' does not match"):
        ckpt.restore_subtree({"params": abstract["params"]}, step=2)
    only_step, _ = ckpt.restore_subtree({"step": abstract["step"]}, step=2)
    assert int(only_step["step"]) == int(state["step"])
    with pytest.raises(CorruptCheckpointError, match=r"step 2 .*'params/bits'"):
        ckpt.verify(2)
    ckpt.close()
    assert not any("could not be checked" in r.getMessage() for r in caplog.records)


def test_random_byte_flips_never_restore_changed_values(tmp_path, mesh):
    """Trials restored 12 of 12 single-byte flips silently: now each is refused, or (a flip in bytes
    that no read depends on) restores exactly what was saved."""
    state = make_bits_state(mesh, seed=11)
    with Checkpointer(tmp_path / "orig", config=CONFIG, async_save=False) as ckpt:
        ckpt.save(1, state, None)
    rng = np.random.default_rng(0)
    refused = 0
    for trial in range(8):
        folder = tmp_path / f"trial{trial}"
        shutil.copytree(tmp_path / "orig", folder)
        files = data_files(folder / "1")
        path = files[rng.integers(len(files))]
        raw = bytearray(path.read_bytes())
        raw[rng.integers(len(raw))] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(raw))
        with Checkpointer(folder, config=CONFIG) as ckpt:
            try:
                restored, _, _ = ckpt.restore(abstract_of(state))
            except CorruptCheckpointError:
                refused += 1
                continue
        assert_trees_equal(restored, state)
    assert refused >= 1


def test_changed_json_items_are_refused(tmp_path, mesh):
    state = make_state(mesh, seed=12)
    with Checkpointer(tmp_path, config=CONFIG, async_save=False) as ckpt:
        ckpt.save(1, state, {"position": 1234})
    data_file = tmp_path / "1" / "data" / "metadata"
    data_file.write_text(data_file.read_text().replace("1234", "1235"))
    with Checkpointer(tmp_path, config=CONFIG) as ckpt:
        with pytest.raises(CorruptCheckpointError, match=r"step 1 .*damaged .*'data' item .*does not match"):
            ckpt.restore(abstract_of(state))
    config_file = tmp_path / "1" / "config" / "metadata"
    config_file.write_text(config_file.read_text().replace("0.001", "0.002"))
    with Checkpointer(tmp_path, config=CONFIG) as ckpt:
        with pytest.raises(CorruptCheckpointError, match=r"step 1 .*'config' item does not match"):
            ckpt.saved_config(1)


def test_checkpoint_without_checksums_restores_with_a_warning(tmp_path, mesh, caplog):
    """A step folder written before checksums were stored (the three items an older version wrote)
    is restored, with a logged warning; a new one whose checksums item is missing is refused."""
    state = make_state(mesh, seed=13)
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(tmp_path / "old", item_handlers=handlers) as manager:
        manager.save(5, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"data_state": {"i": 5}}),
            config=ocp.args.JsonSave(CONFIG)))
    with caplog.at_level(logging.WARNING, logger="aiinfra_jax.checkpoint"):
        with Checkpointer(tmp_path / "old", config=CONFIG) as ckpt:
            restored, data_state, _ = ckpt.restore(abstract_of(state))
            assert not ckpt.verify(5) and ckpt.verified_step is None
            # The run goes on: new saves carry checksums.
            ckpt.save(6, state, {"i": 6})
            restored6, _, _ = ckpt.restore(abstract_of(state), step=6)
            assert ckpt.verified_step == 6
    assert_trees_equal(restored, state) and data_state == {"i": 5}
    assert_trees_equal(restored6, state)
    assert any("step 5" in r.getMessage() and "before checkpoints stored checksums" in r.getMessage()
               for r in caplog.records)

    shutil.rmtree(tmp_path / "old" / "6" / "checksums")
    with Checkpointer(tmp_path / "old", config=CONFIG) as ckpt:
        with pytest.raises(CorruptCheckpointError, match=r"step 6 .*'checksums' item is missing"):
            ckpt.restore(abstract_of(state))


def test_rotation_never_deletes_the_newest_verified_checkpoint(tmp_path, mesh, caplog):
    """keep=2: step 2 is damaged on disk after it was written; later saves must not rotate away
    step 1, the newest that verifies, until a newer step verifies."""
    state = make_bits_state(mesh, seed=14)
    ckpt = Checkpointer(tmp_path, config=CONFIG, keep=2)
    ckpt.save(1, state, {"i": 1})
    ckpt.save(2, state, {"i": 2})
    ckpt.wait()
    flip_byte_of(tmp_path / "2", state["params"]["bits"])
    with caplog.at_level(logging.ERROR, logger="aiinfra_jax.checkpoint"):
        ckpt.save(3, state, {"i": 3})  # would delete 1: 2 is read back first, fails, 1 verifies
        ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3] and ckpt.verified_step == 1
    assert any("step 2" in r.getMessage() and "fails verification" in r.getMessage()
               for r in caplog.records)
    ckpt.save(4, state, {"i": 4})  # 3 verifies: 1 (and the damaged 2) can go
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4] and ckpt.verified_step == 3
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4"]

    # keep=1: while a run trains, the newest verified step stays beside the newest one; close()
    # reads the newest back and then leaves exactly one.
    other = tmp_path.parent / (tmp_path.name + "-keep1")
    ckpt = Checkpointer(other, config=CONFIG, keep=1)
    for step in (1, 2, 3):
        ckpt.save(step, state, {"i": step})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3] and ckpt.verified_step == 2
    flip_byte_of(other / "3", state["params"]["bits"])
    ckpt.close()  # 3 fails: 2 is kept
    assert sorted(p.name for p in other.iterdir()) == ["2", "3"]
