"""Config: presets, overrides, validation errors that name the key, JSON round trip."""

import json
from pathlib import Path

import pytest

from aiinfra_jax.config import (Config, ConfigError, apply_overrides, from_dict, load_config,
                                load_preset, to_dict)
from aiinfra_jax.train import main


def test_defaults_and_tiny_preset_are_valid():
    assert isinstance(Config(), Config)
    cfg = load_preset("configs/tiny.py")
    assert cfg.run.name == "tiny"
    # `configs/tiny` without a suffix finds the file too
    assert load_preset("configs/tiny") == cfg


PRESETS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.py"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_builds_and_round_trips(path):
    """Every committed preset constructs (all validation runs), survives config.json, and its model
    can take a prompt of its training length (max_seq_len bounds generation caches only)."""
    cfg = load_preset(path)
    assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg
    assert cfg.data.seq_len <= cfg.model.max_seq_len


def test_overrides_parse_by_field_type():
    cfg = load_config("configs/tiny.py", ["model.d_model=128", "optim.lr=3e-4",
                                          "checkpoint.async_save=false", "run.name=x",
                                          "model.mixers=dense,dense", "model.head_dim=none"])
    assert cfg.model.d_model == 128 and isinstance(cfg.model.d_model, int)
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.checkpoint.async_save is False
    assert cfg.run.name == "x"
    assert cfg.model.mixers == ("dense", "dense")
    assert cfg.model.head_dim is None
    # untouched fields keep the preset's values
    assert cfg.data.seq_len == load_preset("configs/tiny.py").data.seq_len
    # nested tuples (data.stages) are YAML flow lists; () and [] both work
    cfg = load_config("configs/tiny.py", ["data.sources=embedded,synthetic:copy", "data.weights=1,0",
                                          "data.stages=[[10, [1, 1]], (20, (0.5, 1))]"])
    assert cfg.data.stages == ((10, (1.0, 1.0)), (20, (0.5, 1.0)))
    with pytest.raises(ConfigError, match=r"data.stages\[0\]=\[10\]: expected 2 entries"):
        load_config("configs/tiny.py", ["data.sources=embedded,synthetic:copy", "data.stages=[[10]]"])
    # a list entry holding commas (a source with two options) goes in double quotes
    cfg = load_config("configs/tiny.py", ['data.sources=embedded, "synthetic:copy:repeats=5,num_chars=8"',
                                          "data.weights=[0.5, 0.5]"])
    assert cfg.data.sources == ("embedded", "synthetic:copy:repeats=5,num_chars=8")
    assert cfg.data.weights == (0.5, 0.5)
    with pytest.raises(ConfigError, match="quote one with commas inside"):
        load_config("configs/tiny.py", ['data.sources=embedded,"synthetic:copy'])


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ConfigError, match=r"model\.d_modle.*d_model"):
        apply_overrides(Config(), ["model.d_modle=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'"):
        apply_overrides(Config(), ["modle.d_model=3"])


def test_wrong_type_names_key_and_type():
    with pytest.raises(ConfigError, match=r"model\.d_model='abc'.*int"):
        apply_overrides(Config(), ["model.d_model=abc"])
    with pytest.raises(ConfigError, match=r"checkpoint\.async_save.*bool"):
        apply_overrides(Config(), ["checkpoint.async_save=maybe"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(Config(), ["model.d_model"])


def test_inconsistent_combinations_fail_before_compiling():
    with pytest.raises(ValueError, match="n_heads"):
        apply_overrides(Config(), ["model.d_model=250", "model.n_heads=4"])
    with pytest.raises(ValueError, match="n_kv_heads"):
        apply_overrides(Config(), ["model.n_heads=4", "model.n_kv_heads=3"])
    with pytest.raises(ValueError, match="grad_accum"):
        apply_overrides(Config(), ["data.batch_size=6", "optim.grad_accum=4"])
    with pytest.raises(ValueError, match="mixers"):
        apply_overrides(Config(), ["model.mixers=nonexistent"])
    with pytest.raises(ValueError, match="optim.schedule.*cosine"):
        apply_overrides(Config(), ["optim.schedule=triangle"])
    with pytest.raises(ValueError, match=r"optim.loss_stages\[1\].*increasing"):
        apply_overrides(Config(), ["optim.loss_stages=[[400,1.0,0.1],[300,1.0,1.0]]"])
    with pytest.raises(ValueError, match="optim.lm_weight/aux_weight.*not both 0"):
        apply_overrides(Config(), ["optim.lm_weight=0", "optim.aux_weight=0"])
    msa = ["model.mixers=msa", "model.msa.top_k=4", "data.seq_len=512"]
    with pytest.raises(ValueError, match="query_offset=16 differs.*resolved_query_offset=4"):
        apply_overrides(Config(), msa + ["data.sources=synthetic:msa_niah"])
    with pytest.raises(ValueError, match="docs=8 exceeds model.msa.max_documents=4"):
        apply_overrides(Config(), msa + ["model.msa.max_documents=4",
                                         "data.sources=synthetic:msa_niah:query_offset=4"])
    apply_overrides(Config(), msa + ["data.sources=synthetic:msa_niah:query_offset=4"])
    staged = apply_overrides(Config(), ["optim.lm_weight=0.1", "optim.loss_stages=[[400,1,0.1]]"])
    assert staged.optim.loss_schedule() == ((0, 0.1, 1.0), (400, 1.0, 0.1))


def test_model_stages_parse_validate_and_round_trip():
    """model.stages from the command line: the settings of a stage apply from its step on, on top
    of the earlier ones; only run-time settings may change, with values their checks accept; the
    config survives config.json."""
    msa = ["model.mixers=msa", "data.sources=synthetic:msa_niah:query_offset=16"]
    cfg = apply_overrides(Config(), msa + [
        "model.stages=[[700, {msa.memory_negatives: 1}], [900, {remat: full}]]"])
    m = cfg.model
    assert m.stages == ((700, (("msa.memory_negatives", 1),)), (900, (("remat", "full"),)))
    assert [m.stage_start(s) for s in (0, 699, 700, 2000)] == [0, 0, 700, 900]
    late = m.at_step(900)
    assert (late.msa.memory_negatives, late.remat, late.stages) == (1, "full", ())
    assert (m.at_step(0).msa.memory_negatives, m.at_step(0).remat) == (0, "none")
    assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg
    with pytest.raises(ValueError, match=r"stages\[0\].*msa.top_k.*not run-time settings"):
        apply_overrides(Config(), msa + ["model.stages=[[700, {msa.top_k: 4}]]"])
    with pytest.raises(ValueError, match=r"stages\[0\].*memory_negatives=-1"):
        apply_overrides(Config(), msa + ["model.stages=[[700, {msa.memory_negatives: -1}]]"])
    with pytest.raises(ValueError, match=r"stages\[1\].*increasing"):
        apply_overrides(Config(), msa + ["model.stages=[[700, {remat: full}], [700, {remat: "
                                         "none}]]"])


def test_yaml_preset(tmp_path):
    p = tmp_path / "small.yaml"
    p.write_text("model:\n  d_model: 128\n  n_layers: 2\nrun:\n  steps: 7\n")
    cfg = load_preset(p)
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.run.steps) == (128, 2, 7)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layer: 2\n")
    with pytest.raises(ConfigError, match="n_layer"):
        load_preset(bad)


def test_missing_preset_lists_presets():
    with pytest.raises(ConfigError, match="tiny.py"):
        load_preset("configs/does_not_exist.py")


def test_json_round_trip():
    cfg = load_config("configs/tiny.py", ["model.mixers=dense,dense", "run.steps=5"])
    d = json.loads(json.dumps(to_dict(cfg)))
    assert from_dict(d) == cfg


def test_cli_reports_config_errors(capsys):
    assert main(["--config", "configs/tiny.py", "--set", "model.bogus=1"]) == 2
    assert "model.bogus" in capsys.readouterr().err
    assert main(["--config", "configs/tiny.py", "--set", "run.steps=3", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["steps"] == 3


def test_config_json_of_older_runs_still_loads(caplog):
    """Renamed (model.attention_impl) and retired (data.shuffle_seed) keys of an older run's
    config.json are read, each with a logged note, and compare equal to the current config where
    nothing really changed (a checkpoint from before keeps resuming)."""
    from aiinfra_jax.checkpoint import config_differences


    current = to_dict(Config())
    old = json.loads(json.dumps(current))
    del old["model"]["dense"]
    old["model"]["attention_impl"] = "flash"
    old["data"]["shuffle_seed"] = 0
    with caplog.at_level("WARNING"):
        cfg = from_dict(old)
    assert cfg.model.dense.kernel == "flash_attention" and cfg.data == Config().data
    assert "model.attention_impl='flash' is read as model.dense" in caplog.text
    assert "data.shuffle_seed=0 is ignored" in caplog.text
    assert config_differences(old, current, ("data",)) == []
    assert config_differences(old, current, ("model",), skip=()) == [
        "  model.dense.kernel: checkpoint 'flash_attention', current 'dot_product_attention'"]


@pytest.mark.parametrize("override", ["optim.lr=inf", "optim.lr=nan", "optim.lr=-inf",
                                      "optim.b2=nan", "optim.eps=inf", "optim.weight_decay=nan",
                                      "optim.grad_clip=inf", "optim.min_lr_ratio=nan"])
def test_non_finite_optim_floats_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}=.*must be a finite number; set {key} to a finite"):
        apply_overrides(Config(), [override])


def test_seq_len_must_hold_a_target_and_fit_max_seq_len():
    with pytest.raises(ConfigError, match=r"data.seq_len=1: must be >= 2.*set data.seq_len=2 or more"):
        apply_overrides(Config(), ["data.seq_len=1"])
    with pytest.raises(ConfigError, match=r"data.seq_len=512: exceeds model.max_seq_len=256.*"
                       r"set model.max_seq_len=512 or more.*or lower data.seq_len to 256"):
        apply_overrides(Config(), ["model.max_seq_len=256", "data.seq_len=512"])
    # Raising max_seq_len (a run-time setting) together with seq_len is fine, as is seq_len == max.
    cfg = apply_overrides(Config(), ["model.max_seq_len=8192", "data.seq_len=8192"])
    assert cfg.data.seq_len == cfg.model.max_seq_len == 8192
    assert apply_overrides(Config(), ["data.seq_len=2"]).data.seq_len == 2


def test_bad_values_the_checks_used_to_miss_are_refused_by_name(tmp_path, capsys):
    """Non-finite or non-positive model floats, optim.eps <= 0, run names that are not one plain
    file name, a YAML bool where a string belongs, and a Python preset whose own constructor
    call is refused (a config error naming the preset, not a traceback)."""
    for override, match in [("model.init_std=nan", "init_std.*positive finite"),
                            ("model.rope_theta=inf", "rope_theta.*positive finite"),
                            ("optim.eps=0", r"optim\.eps=0\.0.*must be > 0"),
                            ("run.name=.", "run.name='.'.*file name"),
                            ("run.name=exp[1]", r"run.name='exp\[1\]'.*file name"),
                            ("run.name=a*", "run.name='a\\*'.*file name")]:
        with pytest.raises(ValueError, match=match):
            apply_overrides(Config(), [override])
    yaml_preset = tmp_path / "off.yaml"
    yaml_preset.write_text("mesh:\n  distributed: off\n")
    with pytest.raises(ConfigError, match="mesh.distributed=False.*quote it.*'off'"):
        load_preset(yaml_preset)
    yaml_preset.write_text("mesh:\n  distributed: 'off'\n")
    assert load_preset(yaml_preset).mesh.distributed == "off"
    py_preset = tmp_path / "bad_heads.py"
    py_preset.write_text("from aiinfra_jax.config import Config\nfrom aiinfra_jax.models import "
                         "ModelConfig\nCONFIG = Config(model=ModelConfig(n_heads=3))\n")
    with pytest.raises(ConfigError, match=r"config preset '.*bad_heads.py'.*n_heads.*fix the preset"):
        load_preset(py_preset)
    assert main(["--config", str(py_preset), "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad_heads.py" in err[0], err
