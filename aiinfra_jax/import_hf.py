"""Import a local Hugging Face Llama / Qwen2 / Qwen3 checkpoint as a run directory that training can start from.

    python -m aiinfra_jax.import_hf --model HF_DIR --out runs/NAME [--set KEY=VALUE] [--debug]
    python train.py --config runs/NAME/config.json --set checkpoint.initialize_from=runs/NAME \
        --set run.steps=200 --set optim.lr=1e-4 ...

HF_DIR holds what `save_pretrained` writes: config.json (model_type "llama", "qwen2" or "qwen3"),
model.safetensors (or shards with model.safetensors.index.json) and tokenizer.json. Nothing is
downloaded. The tensors map onto our dense model as aiinfra_jax/hf.py lists (Qwen2's q/k/v biases
and Qwen3's q/k norms as model.dense.qkv_bias / qk_norm; its logits equal transformers' on the
same tokens, to float32 rounding); RoPE scaling, other biases, sliding-window layers and any
tensor without a place in our model are refused by name, before anything is written.

The run directory gets:
  config.json     the run config: the model from HF's config.json (vocab_size, head_dim,
                  rope_theta, rms_norm_eps, tie_word_embeddings, max_position_embeddings as
                  model.max_seq_len), data.tokenizer, the defaults elsewhere, then --set overrides
                  (which may not change the model's shapes)
  checkpoints/0   a training checkpoint at step 0: the parameters (float32 unless
                  --set model.param_dtype=bfloat16), a fresh optimizer state for config.json's
                  optim section, no data-iterator state
  tokenizer.json  HF_DIR's copy, named by data.tokenizer by its absolute path; a tokenizer.json
                  that is our byte tokenizer (aiinfra_jax.hf.byte_tokenizer_json) becomes "byte"
  import.json     the source, and every HF tensor with the name it was mapped to
  summary.json    marks the import finished, so train.py never trains inside it: a run with
                  checkpoint.initialize_from=runs/NAME starts a new run directory (NAME-2 when
                  run.name is unchanged) from its step-0 state. The finetuning run's model section
                  must keep the imported shapes (use this config.json as its --config); its
                  optim section may differ where the optimizer state keeps its structure.

To start a model of another architecture (NSA, gated-delta, ...) from the same directory without
an import step: train.py --set checkpoint.initialize_from=hf:HF_DIR (aiinfra_jax/surgery.py).

Failures are one `error: ...` line (aiinfra_jax.errors; --debug adds the traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax import hf
from aiinfra_jax.checkpoint import Checkpointer
from aiinfra_jax.config import Config, ConfigError, RunConfig, apply_overrides, save_config, \
    to_dict
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.errors import add_debug_flag, quiet_library_tracebacks, report_error
from aiinfra_jax.export import tree_from_tensors, human, read_safetensors
from aiinfra_jax.hf import ExportError
from aiinfra_jax.models.config import ModelConfig
from aiinfra_jax.surgery import state_with_params

__all__ = ["import_hf", "main"]


def _tokenizer(model_dir: Path, out: Path) -> tuple[str, str | None]:
    """(data.tokenizer for the run, the file to copy into it or None)."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise ExportError(f"{model_dir} has no tokenizer.json; save the tokenizer with its "
                          "fast (tokenizers) backend, e.g. AutoTokenizer.from_pretrained(...)"
                          ".save_pretrained(DIR), which writes one")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path} is not a readable tokenizer.json ({e})") from e
    if hf.is_byte_tokenizer_json(data):
        return "byte", None
    return str((out / "tokenizer.json").resolve()), str(path)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} already exists and is not empty; choose a new run "
                          "directory (an import never writes into an existing one)")


def import_hf(model_dir: str | Path, out: str | Path, *, overrides: Sequence[str] = (),
              say: Callable[[str], None] = print) -> dict[str, Any]:
    """Imports the HF checkpoint in `model_dir` as the run directory `out` (see the module
    docstring); returns what import.json records."""
    from aiinfra_jax.trainer import Trainer  # pylint: disable=import-outside-toplevel

    model_dir = Path(model_dir).expanduser()
    out = Path(out).expanduser()
    if not (model_dir / "config.json").exists():
        raise ExportError(f"--model {model_dir}: no config.json; pass a directory that "
                          "save_pretrained wrote")
    _check_out(out)
    try:
        hf_cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{model_dir}/config.json cannot be read ({e})") from e
    fields = hf.model_fields_from_hf(hf_cfg, str(model_dir))
    tok_spec, tok_file = _tokenizer(model_dir, out)

    # The run config: HF's model, the tokenizer, defaults elsewhere, then the overrides.
    try:
        model_cfg = ModelConfig(**fields)
    except ValueError as e:
        raise ExportError(f"{model_dir}/config.json: {e}") from e
    seq_len = min(DataConfig.seq_len, model_cfg.max_seq_len)
    base = Config(model=model_cfg,
                  data=DataConfig(tokenizer=tok_file or tok_spec, seq_len=seq_len),
                  run=RunConfig(name=out.name, output_dir=str(out.parent)))
    cfg = apply_overrides(base, list(overrides))
    changed = [k for k, v in fields.items() if k not in ("max_seq_len", "dense")
               and getattr(cfg.model, k) != v]
    changed += [f"dense.{k}" for k in ("qkv_bias", "qk_norm")
                if getattr(cfg.model.dense, k) != getattr(fields["dense"], k)]
    if changed:
        raise ConfigError(f"--set changes what the checkpoint defines ({', '.join(changed)}); "
                          "only run-time settings of the model (and the other sections) may be set")

    tensors = read_safetensors(model_dir)
    total = int(sum(a.nbytes for a in tensors.values()))
    say(f"read {len(tensors)} tensors ({human(total)}) from {model_dir}")
    ours, mapping = hf.from_hf_tensors(tensors, cfg.model, str(model_dir))
    dtype = np.dtype(jnp.dtype(cfg.model.param_dtype))
    ours = {k: np.asarray(v).astype(dtype) for k, v in ours.items()}

    trainer = Trainer(cfg)  # the tokenizer, the mesh and the optimizer of this config
    cfg = trainer.cfg
    if jax.tree.leaves(trainer.rest):
        raise ExportError("the model keeps non-parameter state, which a Llama checkpoint does "
                          "not hold")
    used: set[str] = set()
    params = tree_from_tensors(nnx.to_pure_dict(trainer.abstract_params), ours, cfg.model,
                                str(model_dir), used)
    state = state_with_params(trainer, params)

    if cfg.data.tokenizer != base.data.tokenizer:  # set by an override: kept as given
        tok_spec, tok_file = cfg.data.tokenizer, None
    stored = dataclasses.replace(
        cfg, mesh=cfg.mesh.without_launch(),
        data=dataclasses.replace(cfg.data, tokenizer=tok_spec))
    out.mkdir(parents=True, exist_ok=True)
    try:
        if tok_file is not None:
            shutil.copyfile(tok_file, out / "tokenizer.json")
        with Checkpointer(out / "checkpoints", config=to_dict(stored), async_save=False) as ckpt:
            ckpt.save(0, state, None, force=True)
        save_config(stored, out / "config.json")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # it was empty or absent (_check_out)
        raise
    record = {
        "imported_from": str(model_dir.resolve()),
        "architectures": hf_cfg.get("architectures"),
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "source_dtypes": sorted({np.dtype(a.dtype).name for a in tensors.values()}),
        "param_dtype": cfg.model.param_dtype,
        "tokenizer": tok_spec if tok_file is None else "tokenizer.json (copied)",
        "tensors": {theirs: ours_name for theirs, ours_name in mapping},
    }
    (out / "import.json").write_text(hf.dumps(record))
    (out / "summary.json").write_text(hf.dumps(
        {"run_dir": str(out), "step": 0, "finished": True, "imported_from": str(model_dir)}))
    n = sum(int(np.prod(a.shape)) for a in ours.values())
    say(f"wrote {out}: {n:,} parameters ({cfg.model.param_dtype}) at step 0, tokenizer "
        f"{'byte' if tok_file is None else 'tokenizer.json'}; {len(mapping)} tensors mapped "
        "(import.json lists them)")
    say(f"finetune with: python train.py --config {out}/config.json "
        f"--set checkpoint.initialize_from={out} --set run.steps=N")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a local Hugging Face model directory")
    ap.add_argument("--out", required=True, help="the run directory to create")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="settings of the run config, e.g. --set data.seq_len=512")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    if not args.debug:
        quiet_library_tracebacks()
    try:
        import_hf(args.model, args.out, overrides=args.overrides,
                  say=lambda s: print(s, flush=True))
    except BaseException as e:  # noqa: BLE001 -- a bug is re-raised with its traceback
        status = report_error(e, debug=args.debug, expected=(FileNotFoundError, ValueError))
        if status is None:
            raise
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
