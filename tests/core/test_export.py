"""Export (safetensors, Hugging Face Llama) and import of HF checkpoints: identical logits both
ways, the naming scheme, the refusals, and finetuning an import with the ordinary loop.

The HF tests need transformers and CPU torch (the `hf` extra, part of `dev`); without them they
are skipped with the install command. Their tiny HF models are built by transformers itself
(random init, save_pretrained): nothing is downloaded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aiinfra_jax import export as ex
from aiinfra_jax import hf, surgery
from aiinfra_jax.checkpoint import Checkpointer
from aiinfra_jax.config import Config, ConfigError, from_dict, load_config, to_dict
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.data.tokenizer import ByteTokenizer, HFTokenizer
from aiinfra_jax.import_hf import main as import_main
from aiinfra_jax.load import load_model
from aiinfra_jax.rundir import initialize_from
from aiinfra_jax.models import DenseConfig, ModelConfig, NSAConfig
from aiinfra_jax.train import train
from aiinfra_jax.trainer import Trainer
from helpers import ROOT, tiny

HF_SKIP = ("needs transformers and CPU torch (test-only): pip install -e '.[hf]' "
           "(torch==2.13.0 is the CPU wheel on this workplace's machines)")
TEXT = "héllo\x00 wörld\t🙂\n end\x7f"


def _hf_libs():
    torch = pytest.importorskip("torch", reason=HF_SKIP)
    transformers = pytest.importorskip("transformers", reason=HF_SKIP)
    return torch, transformers


def _tokens(vocab: int, shape=(2, 40), seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def _logits(model, tokens: np.ndarray) -> np.ndarray:
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return np.asarray(jax.jit(lambda m, t: m(t, positions=pos)[0])(model, jnp.asarray(tokens)))


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _fail(main, argv, capsys) -> str:
    """Runs a CLI expecting the one-line error; returns that line."""
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny dense model trained 2 steps (run directory, its logits on fixed tokens)."""
    root = tmp_path_factory.mktemp("trained")
    run_dir = train(tiny(root, "run.steps=2"), quiet=True)["run_dir"]
    live = load_model(run_dir)
    tokens = _tokens(259)
    return run_dir, tokens, _logits(live.model, tokens)


# ----------------------------------------------------------------------------- safetensors

def test_safetensors_round_trip_is_exact_and_named_per_layer(trained, tmp_path, capsys):
    run_dir, tokens, want = trained
    out = tmp_path / "st"
    assert ex.main(["--checkpoint", str(run_dir), "--format", "safetensors",
                    "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors: 21 tensors" in printed and f"wrote {out}" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "export.json", "model.safetensors", "tokenizer.json"]

    tensors = ex.read_safetensors(out)
    assert tensors["layers.1.mixer.wq"].shape == (32, 2, 16)  # [D,H,Dh]: our shapes, unstacked
    assert tensors["layers.0.mixer.wo"].shape == (2, 16, 32)
    assert tensors["layers.1.ffn.w_down"].shape == (128, 32)
    assert {"embed.table", "final_norm.scale", "head.kernel"} <= set(tensors)
    assert not [n for n in tensors if n.startswith("blocks")]
    cfg = from_dict(json.loads((out / "config.json").read_text()))  # our own config.json
    assert cfg.model.n_layers == 2 and cfg.data.tokenizer == "byte"

    loaded = ex.load_safetensors(out)
    np.testing.assert_array_equal(_logits(loaded.model, tokens), want)  # exact, float32
    assert loaded.step == 2 and loaded.tokenizer == ByteTokenizer()
    # The tokenizer.json beside it is the byte tokenizer, for other tools.
    tok = HFTokenizer(str(out / "tokenizer.json"))
    assert tok.encode(TEXT) == ByteTokenizer().encode(TEXT)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (257, 258, 256)
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_params_source_reads_a_run_by_the_export_naming(trained):
    run_dir = trained[0]
    source = surgery.read_source(f"params:{run_dir}")
    want, _ = ex.model_tensors(load_model(run_dir).model)
    assert sorted(source.tensors) == sorted(want) and source.model.n_layers == 2
    for name, array in want.items():
        np.testing.assert_array_equal(source.tensors[name], array)
    with pytest.raises(ConfigError, match="give a directory after 'params:'"):
        surgery.read_source("params:")


def test_stablehlo_and_onnx_formats_from_the_command_line(trained, tmp_path, capsys):
    """The CLI wiring of the two formats (their own tests: test_export_stablehlo.py,
    test_export_onnx.py): the files, export.json, and the model loads back from either."""
    run_dir, tokens, want = trained
    out = tmp_path / "shlo"
    assert ex.main(["--checkpoint", str(run_dir), "--format", "stablehlo", "--out", str(out),
                    "--platforms", "cpu", "--prompt-lengths", "16", "--batch-size", "2"]) == 0
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["format"] == "stablehlo" and manifest["stablehlo"]
    assert {"stablehlo.json", "run_stablehlo.py", "model.safetensors"} <= {
        p.name for p in out.iterdir()}
    np.testing.assert_array_equal(_logits(ex.load_safetensors(out).model, tokens), want)
    out = tmp_path / "onnx"
    assert ex.main(["--checkpoint", str(run_dir), "--format", "onnx", "--out", str(out)]) == 0
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["onnx"]["files"] == ["model.onnx"] and (out / "model.onnx").is_file()
    assert "tokenizer.json" in {p.name for p in out.iterdir()}
    capsys.readouterr()


def test_sharded_export_force_and_refusals(trained, tmp_path, capsys):
    run_dir, tokens, want = trained
    out = tmp_path / "sharded"
    argv = ["--checkpoint", str(run_dir), "--out", str(out), "--max-shard-size", "40kB"]
    assert ex.main(argv) == 0
    capsys.readouterr()
    index = json.loads((out / ex.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0].startswith("model-00001-of-")
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in
                                                  ex.read_safetensors(out).values())
    np.testing.assert_array_equal(_logits(ex.load_safetensors(out).model, tokens), want)

    assert "--force" in _fail(ex.main, argv, capsys)  # never overwritten without --force
    assert ex.main(argv[:-2] + ["--force"]) == 0  # replaces the earlier export
    assert (out / "model.safetensors").exists() and not (out / ex.INDEX_FILE).exists()
    capsys.readouterr()
    other = tmp_path / "not_an_export"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert "not an export" in _fail(ex.main, ["--checkpoint", str(run_dir), "--out", str(other),
                                               "--force"], capsys)
    assert (other / "notes.txt").read_text() == "keep me"
    assert "no such directory" in _fail(
        ex.main, ["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], capsys)
    (tmp_path / "empty_run").mkdir()
    _fail(ex.main, ["--checkpoint", str(tmp_path / "empty_run"), "--out", str(tmp_path / "y")],
          capsys)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # A step folder with another --step, and stablehlo's settings for another format: refused.
    step_dir = max((p for p in (Path(run_dir) / "checkpoints").iterdir() if p.name.isdigit()),
                   key=lambda p: int(p.name))
    assert "is the folder of step" in _fail(
        ex.main, ["--checkpoint", str(step_dir), "--step", str(int(step_dir.name) + 1),
                  "--out", str(tmp_path / "z")], capsys)
    with pytest.raises(SystemExit):
        ex.main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "z"), "--max-len", "64"])
    assert "--max-len apply to --format stablehlo only" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


def test_load_safetensors_refuses_files_that_do_not_fit(trained, tmp_path):
    run_dir, _, _ = trained
    out = tmp_path / "st"
    ex.export(run_dir, out, say=lambda s: None)
    saved = json.loads((out / "config.json").read_text())
    saved["model"]["d_ff"] = 64
    (out / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ex.ExportError, match=r"layers\.0\.ffn\.w_down.*float32\[128, 32\].*"
                                             r"float32\[64, 32\]"):
        ex.load_safetensors(out)
    raw = bytearray((out / "model.safetensors").read_bytes())
    (out / "model.safetensors").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ex.ExportError, match="truncated or damaged"):
        ex.read_safetensors(out)


def test_safetensors_files_keep_bfloat16_and_integers(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a": rng.normal(size=(3, 5)).astype(jnp.bfloat16),
               "b": rng.integers(-9, 9, (4,)).astype(np.int32), "c": np.float32(2.5)}
    ex.write_safetensors(tmp_path, tensors, max_shard_bytes=10**6, metadata={}, say=print)
    back = ex.read_safetensors(tmp_path)
    for name, value in tensors.items():
        assert back[name].dtype == np.asarray(value).dtype
        np.testing.assert_array_equal(back[name], value)
    # Shards that disagree with their index, or hold a tensor twice, are refused by name.
    import json
    from safetensors.numpy import save_file
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    files = ex.write_safetensors(sharded, {"a": np.zeros(300, np.float32),
                                           "b": np.ones(300, np.float32)},
                                 max_shard_bytes=1000, metadata={}, say=print)
    assert len(files) == 2
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    save_file({"a": np.zeros(3, np.float32), "b": np.ones(300, np.float32)},
              str(sharded / index["weight_map"]["b"]))
    with pytest.raises(ValueError, match=r"tensor 'a' is in two files|holds 'a', which"):
        ex.read_safetensors(sharded)


def test_names_do_not_depend_on_scan_layers():
    cfg = ModelConfig(vocab_size=384, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=64,
                      mixers=("dense", "dense"), tie_embeddings=True)
    scanned = ex.tensor_shapes(cfg)
    assert scanned == ex.tensor_shapes(dataclasses.replace(cfg, scan_layers=False))
    assert list(scanned)[:3] == ["embed.table", "layers.0.ffn.w_down", "layers.0.ffn.w_gate"]
    assert scanned["layers.3.mixer.wk"].shape == (32, 1, 16) and "head.kernel" not in scanned


# ----------------------------------------------------------------------------- Hugging Face

def test_hf_export_refuses_what_llama_cannot_express(tmp_path, capsys):
    for kw, named in [(dict(mixers=("dense", "nsa")), "Native Sparse Attention"),
                      (dict(ffns=("moe",)), "mixture-of-experts"),
                      (dict(residual="attnres_block"), "Attention Residuals"),
                      (dict(short_conv=4), "short convolution"),
                      (dict(dense=DenseConfig(qk_norm=True, qkv_bias=True)), "o_proj")]:
        parts = hf.unsupported_parts(ModelConfig(n_layers=4, **kw))
        assert len(parts) == 1 and named in parts[0]
    assert hf.unsupported_parts(ModelConfig()) == []
    # Refused from the checkpoint's config, before any array is read (so a stand-in state).
    cfg = Config(model=ModelConfig(vocab_size=384, d_model=32, n_layers=2, n_heads=2,
                                   n_kv_heads=1, mixers=("nsa",), max_seq_len=64,
                                   nsa=NSAConfig(cmp_block_len=8, cmp_stride=4, sel_block_size=16,
                                                 n_selected=3, n_init=1, n_local=1, window=16)),
                 data=DataConfig(seq_len=64))
    with Checkpointer(tmp_path / "nsa" / "checkpoints", config=to_dict(cfg),
                      async_save=False) as ckpt:
        ckpt.save(1, {"params": {"w": jnp.ones(3)}, "step": jnp.int32(1)}, None, force=True)
    line = _fail(ex.main, ["--checkpoint", str(tmp_path / "nsa"), "--format", "hf",
                           "--out", str(tmp_path / "out")], capsys)
    assert "'nsa' (Native Sparse Attention)" in line and "--format safetensors" in line
    assert not (tmp_path / "out").exists()


def test_import_refuses_what_our_dense_model_lacks():
    base = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2}
    assert hf.model_fields_from_hf(base, "m")["n_kv_heads"] == 2
    dense = {t: hf.model_fields_from_hf({**base, "model_type": t}, "m")["dense"]
             for t in ("qwen2", "qwen3")}
    assert (dense["qwen2"].qkv_bias, dense["qwen2"].qk_norm) == (True, False)
    assert (dense["qwen3"].qkv_bias, dense["qwen3"].qk_norm) == (False, True)
    for change, named in [({"model_type": "gpt2"}, "'gpt2' is not supported"),
                          ({"attention_bias": True}, "biases only on Qwen2's q/k/v"),
                          ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
                          ({"model_type": "qwen2", "use_sliding_window": True}, "sliding-window"),
                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'")]:
        with pytest.raises(hf.ExportError, match=named):
            hf.model_fields_from_hf({**base, **change}, "m")
    # A tensor whose shape the config cannot hold is named, with the sizes the config gives.
    cfg = ModelConfig(**hf.model_fields_from_hf(base, "m"))
    names = [theirs for _, theirs, _, _ in hf._pairs(cfg)]
    tensors = {n: np.zeros((64, 32), np.float32) for n in names}
    with pytest.raises(hf.ExportError, match=r"m: tensor '.*' has shape \[64, 32\], which does "
                                             r"not fit config.json \(hidden_size 32, 2 heads"):
        hf.from_hf_tensors(tensors, cfg, "m")


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_import_and_export_qwen_match_transformers(kind, tmp_path, capsys):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms) import as our dense model with
    model.dense.qkv_bias / qk_norm, with transformers' logits, and export back as the same class."""
    torch, transformers = _hf_libs()
    torch.manual_seed(1)
    cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    config = cls[0](vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1000.0,
                    tie_word_embeddings=False)
    model = cls[1](config).eval()
    with torch.no_grad():  # nonzero biases, non-unit norms: every mapping error shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    src = tmp_path / kind
    model.save_pretrained(src)
    (src / "tokenizer.json").write_text(json.dumps(hf.byte_tokenizer_json()))
    run = tmp_path / "run"
    assert import_main(["--model", str(src), "--out", str(run)]) == 0
    capsys.readouterr()
    loaded = load_model(run)
    assert (loaded.config.model.dense.qkv_bias, loaded.config.model.dense.qk_norm) == \
        (kind == "qwen2", kind == "qwen3")
    tokens = _tokens(259, seed=3)
    theirs = _torch_logits(model, tokens)
    diff = np.abs(_logits(loaded.model, tokens) - theirs).max()
    print(f"{kind} import: max |logit difference| = {diff:.3g}")
    assert diff <= 1e-4
    ex.export(run, tmp_path / "again", fmt="hf", say=lambda s: None)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert type(again) is cls[1]
    assert np.abs(_torch_logits(again, tokens) - theirs).max() <= 1e-4


def test_hf_export_matches_transformers_and_imports_back_exactly(trained, tmp_path, capsys):
    _, transformers = _hf_libs()
    run_dir, tokens, want = trained
    out = tmp_path / "hf"
    assert ex.main(["--checkpoint", str(run_dir), "--format", "hf", "--out", str(out)]) == 0
    assert "model.safetensors: 21 tensors" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    diff = np.abs(_torch_logits(model, tokens) - want).max()
    print(f"hf export, trained tiny model: max |logit difference| = {diff:.3g}")
    assert diff <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok(TEXT).input_ids == [257] + ByteTokenizer().encode(TEXT)  # BOS, then the bytes
    assert tok.decode(tok(TEXT).input_ids, skip_special_tokens=True) == TEXT

    # ... and back: the import of our own HF export gives the very same logits.
    assert import_main(["--model", str(out), "--out", str(tmp_path / "back")]) == 0
    back = load_model(tmp_path / "back", overrides=["mesh.num_devices=1"])  # as `want`
    assert back.config.data.tokenizer == "byte" and back.step == 0
    np.testing.assert_array_equal(_logits(back.model, tokens), want)


def test_import_hf_matches_transformers_and_finetunes(tmp_path, capsys):
    torch, transformers = _hf_libs()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms and larger weights: every mapping error shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    src = tmp_path / "hf_llama"
    model.save_pretrained(src)
    # A tokenizer.json that is not ours: byte-level, with Llama 3's special-token names.
    tok_json = hf.byte_tokenizer_json()
    names = {256: "<|pad|>", 257: "<|begin_of_text|>", 258: "<|end_of_text|>"}
    for t in tok_json["added_tokens"]:
        t["content"] = names[t["id"]]
    tok_json["post_processor"] = None
    (src / "tokenizer.json").write_text(json.dumps(tok_json))

    run = tmp_path / "imported"
    assert import_main(["--model", str(src), "--out", str(run)]) == 0
    assert "finetune with" in capsys.readouterr().out
    assert import_main(["--model", str(src), "--out", str(run)]) == 1  # never into a run
    capsys.readouterr()
    loaded = load_model(run)
    assert loaded.step == 0 and loaded.config.model.tie_embeddings
    assert (loaded.config.model.head_dim, loaded.config.model.rope_theta) == (16, 500.0)
    assert loaded.config.data.tokenizer == str((run / "tokenizer.json").resolve())
    assert loaded.tokenizer.bos_id == 257
    tokens = _tokens(300, seed=2)
    theirs = _torch_logits(model, tokens)
    diff = np.abs(_logits(loaded.model, tokens) - theirs).max()
    print(f"import_hf: max |logit difference| = {diff:.3g} (logits up to "
          f"{np.abs(theirs).max():.3g})")
    assert diff <= 1e-4
    record = json.loads((run / "import.json").read_text())
    assert record["tensors"]["model.layers.1.self_attn.o_proj.weight"] == "layers.1.mixer.wo"

    # Exported back to HF (tied embeddings, head_dim 16 != 48 / 4): transformers agrees again.
    ex.export(run, tmp_path / "again", fmt="hf", say=lambda s: None)
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["tie_word_embeddings"] and saved["head_dim"] == 16
    assert "lm_head.weight" not in ex.read_safetensors(tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    diff = np.abs(_torch_logits(again, tokens) - theirs).max()
    print(f"import_hf then export --format hf: max |logit difference| = {diff:.3g}")
    assert diff <= 1e-4
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "again")(TEXT).input_ids \
        == ByteTokenizer().encode(TEXT)  # that tokenizer.json adds no BOS

    # Finetune it with the ordinary loop: a new run directory starting from the import.
    cfg = load_config(str(run / "config.json"), [
        f"checkpoint.initialize_from={run}", "run.steps=2", "data.seq_len=32",
        "data.batch_size=4", "eval.every=0", "eval.final_batches=1", "run.progress=false",
        "mesh.num_devices=1"])
    summary = train(cfg, quiet=True)
    assert summary["start_step"] == 0 and summary["step"] == 2
    assert summary["run_dir"] != str(run) and np.isfinite(summary["final_train_loss"])

    # Architecture surgery straight from the HF directory: the state a new NSA run starts from
    # (aiinfra_jax/surgery.py through rundir.initialize_from, as train.py calls it; training it
    # is the ordinary loop above) has K/V branches that start as the Llama k/v projections.
    cfg = load_config(str(ROOT / "configs" / "nsa_tiny.py"), [
        f"checkpoint.initialize_from=hf:{src}", f"data.tokenizer={run / 'tokenizer.json'}",
        "model.d_model=48", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=16", "model.d_ff=80", "model.rope_theta=500.0", "model.norm_eps=1e-5",
        "model.tie_embeddings=true", "model.vocab_size=300", "mesh.num_devices=1"])
    lines = []
    state, data_state = initialize_from(Trainer(cfg), lines.append, tmp_path / "nsa")
    assert data_state is None and int(state["step"]) == 0
    assert "8 adapted" in lines[0] and "layers.0-1.mixer.cmp_w1" in "\n".join(lines)
    report = json.loads((tmp_path / "nsa" / "initialize.json").read_text())
    assert not report["unused"] and "layers.1.mixer.w_gate" in report["initialised"]
    assert report["source"] == f"{src} (Hugging Face)"
    wk = np.asarray(state["params"]["blocks"]["layers"][0]["mixer"]["wk"])  # [R,D,3,K,Dh]
    k_proj = model.model.layers[1].self_attn.k_proj.weight.detach().numpy()  # [K*Dh, D]
    for b in range(3):
        np.testing.assert_array_equal(wk[1, :, b], k_proj.T.reshape(48, 2, 16))
