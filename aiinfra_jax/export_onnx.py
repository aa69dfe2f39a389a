"""ONNX export of a dense model's forward through jax2onnx, checked in onnxruntime.

    from aiinfra_jax.export_onnx import write_onnx
    info = write_onnx(load_model("runs/tiny"), Path("out"))   # out/model.onnx, info: see below

What the file computes. One graph input and one output:

    tokens  int32   [batch, seq]      token ids (any ids below the model's vocabulary size)
    logits  float32 [batch, seq, V]   V = the model's (padded) vocabulary size

batch and seq are dynamic (ONNX dim_params "batch" and "seq"). Positions are 0..seq-1 in every
row, computed in the graph: each row is one document from its start, with no packed documents
(segment ids) and no KV cache, so a generator built on the file runs the whole prefix again for
every new token. RoPE is computed in the graph, so any seq runs, but quality beyond the training
context is the model's own. The parameters are initializers in their own dtype (bfloat16 weights
stay bfloat16 and are cast in the graph); with a tensor above 1 MB, jax2onnx moves the tensors
into one file beside it, model.onnx.data, which onnx and onnxruntime read from the folder of
model.onnx (keep the two together).

Which models. Dense models only: every mixer "dense", every FFN "swiglu", residual "standard", no
short convolution, the parts aiinfra_jax/hf.py `unsupported_parts` checks for the Llama export;
any other model is refused with an ExportError naming its parts. (Tried with jax2onnx 0.17.1: NSA,
MoE, gated DeltaNet and the short convolution all stop in jax2onnx's symbolic shapes.)

Run-time settings. The file is converted from the model with these settings, whatever the
checkpoint was trained or loaded with (they are run-time fields, so the parameters are the same):
compute dtype float32 (onnxruntime's CPU Einsum has no bfloat16 kernel), dense attention by
jax.nn.dot_product_attention with implementation "xla" (the chunked flash_attention kernel does
not convert, even as "xla": jax2onnx traces with symbolic batch and seq, and the kernel's blocking
compares them; Pallas kernels are GPU/TPU programs), remat none, and per-layer parameters
(`model.unscanned()`: a flat graph; a scanned model converts too, to an ONNX Loop, which is
harder for runtimes to optimize).

The check. `write_onnx` then runs the written file in onnxruntime on random tokens [2, 16] and
compares with the JAX model under the same settings; a difference above
1e-4 * max(1, max |logits|) is an ExportError (float32 gives about 1e-7 on a tiny model). The
numbers go into what it returns, for the export manifest.

Dependencies (imported only here, when called): jax2onnx, onnx (a dependency of jax2onnx) and
onnxruntime. jax2onnx 0.13.0 is the newest release that pip installs beside our orbax-checkpoint
(0.13.1 and later pin orbax-checkpoint<0.11.37, used only by their sandbox scripts); 0.17.1 (the
newest, installed without that pin) converts the model as well.

Conversion cost. jax2onnx imports all of its plugins on first use, including the Equinox
examples, which build and compile models at import (about 14 s on 2 cores). Our model needs only
the plugins for jax.lax / jax.numpy / jax.nn, so `_load_plugins` imports those alone (the files
are byte-identical to a full import's, with jax2onnx 0.13.0 and 0.17.1) when jax2onnx's plugin
loader has the names it looks for, and otherwise leaves the full import to jax2onnx.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.config import apply_overrides
from aiinfra_jax.hf import ExportError, unsupported_parts
from aiinfra_jax.load import LoadedModel
from aiinfra_jax.models import Transformer

__all__ = ["FILE", "OPSET", "RUN_SETTINGS", "check_dense", "check_onnx", "onnx_forward",
           "write_onnx"]

FILE = "model.onnx"
DATA_FILE = FILE + ".data"  # jax2onnx's sidecar for tensors above 1 MB
# Opset 18: the lowest jax2onnx's graph of our model validates with (at 17, ReduceMean takes its
# axes as an attribute and onnxruntime rejects the graph); 18, 21 and 23 give the same logits.
OPSET = 18
# Run-time settings the file is converted with (see the module docstring).
RUN_SETTINGS = ("model.dtype=float32", "model.remat=none",
                "model.dense.kernel=dot_product_attention", "model.dense.implementation=xla")
INPUTS = ("tokens",)
OUTPUTS = ("logits",)
CHECK_SHAPE = (2, 16)
CHECK_RTOL = 1e-4  # of max(1, max |logits|)
INSTALL = "pip install -e '.[onnx]' (jax2onnx and onnxruntime)"

Say = Callable[[str], None]


def check_dense(cfg, what: str) -> None:
    """ExportError naming every part of the model config `cfg` that is not the dense decoder."""
    parts = unsupported_parts(cfg)
    if parts:
        raise ExportError(
            f"{what} cannot be exported as ONNX: only dense models are (the decoder the hf "
            "format writes): " + "; ".join(parts)
            + ". Export it with --format safetensors (every model) instead")


def onnx_forward(loaded: LoadedModel) -> tuple[Transformer, Callable[[jax.Array], jax.Array]]:
    """(the model with RUN_SETTINGS, unscanned, its parameters on the CPU; forward(tokens [B,T]
    int32) -> logits [B,T,V] float32 with positions 0..T-1 in every row)."""
    cfg = apply_overrides(loaded.config, list(RUN_SETTINGS)).model
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    # Every parameter whole on one host device: the converter reads them as constants, and as
    # jax.Arrays (not numpy) their casts to the compute dtype stay in the graph, so bfloat16
    # weights are stored as bfloat16.
    cpu = jax.devices("cpu")[0]
    state = jax.tree.map(lambda a: jax.device_put(a, cpu), nnx.state(loaded.model))
    model = nnx.merge(graphdef, state).unscanned()

    def forward(tokens: jax.Array) -> jax.Array:
        # An iota, not broadcast_to(arange(T)): jax2onnx traces with symbolic B and T.
        positions = jax.lax.broadcasted_iota(jnp.int32, tokens.shape, 1)
        return model(tokens, positions=positions)[0]

    return model, forward


def _libraries():
    try:
        import jax2onnx  # pylint: disable=import-outside-toplevel
        import onnx  # pylint: disable=import-outside-toplevel
        import onnxruntime  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ExportError(f"the onnx format needs jax2onnx and onnxruntime ({e}): {INSTALL}") from e
    return jax2onnx, onnx, onnxruntime


def _load_plugins() -> None:
    """Imports only jax2onnx's plugins for JAX's own primitives, when its loader has the names
    this relies on (see the module docstring); else jax2onnx imports all of them itself."""
    try:
        from jax2onnx.plugins import plugin_system as ps  # pylint: disable=import-outside-toplevel
    except ImportError:
        return
    import_tree, done = getattr(ps, "_import_tree", None), "_already_imported_plugins"
    root = Path(ps.__file__).parent / "jax"
    if not callable(import_tree) or getattr(ps, done, None) is not False or not root.is_dir():
        return
    import_tree(root, "jax2onnx.plugins.jax")
    setattr(ps, done, True)


@contextlib.contextmanager
def _quiet_onnx_ir() -> Iterator[None]:
    """jax2onnx 0.13 leaves shape tensors untyped, and onnx_ir warns once per value that it
    skips their (optional) type information."""
    logger = logging.getLogger("onnx_ir")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _value_info(onnx, value) -> dict[str, Any]:
    tensor = value.type.tensor_type
    shape = [d.dim_param if d.dim_param else int(d.dim_value) for d in tensor.shape.dim]
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)).name
    return {"name": value.name, "dtype": dtype, "shape": shape}


def _op_types(graph, acc: set[str]) -> set[str]:
    for node in graph.node:
        acc.add(node.op_type)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _op_types(sub, acc)
    return acc


def write_onnx(loaded: LoadedModel, tmp: Path, *, say: Say = print, check: bool = True,
               what: str | None = None) -> dict[str, Any]:
    """Writes `tmp`/model.onnx (and model.onnx.data for large tensors) for the dense model of
    `loaded` (see the module docstring), checks it in onnxruntime unless check=False, and returns
    what the export manifest records: files, bytes, opset, ir_version, converter, inputs and
    outputs (name, dtype, shape with "batch"/"seq" for the dynamic dims), op types, the run-time
    settings, and the check's numbers."""
    what = what or f"the model of step {loaded.step}"
    check_dense(loaded.config.model, what)
    jax2onnx, onnx, ort = _libraries()
    converter = f"jax2onnx {importlib.metadata.version('jax2onnx')}"
    trained = loaded.config.model
    if trained.dtype != "float32":
        say(f"note: the ONNX graph computes in float32 (the model's dtype is {trained.dtype}; "
            "onnxruntime's CPU kernels have no bfloat16 einsum)")
    model, forward = onnx_forward(loaded)
    say(f"converting to ONNX with {converter} (opset {OPSET})")
    tmp = Path(tmp)
    path = tmp / FILE
    _load_plugins()
    with _quiet_onnx_ir():
        jax2onnx.to_onnx(forward, [jax.ShapeDtypeStruct(("batch", "seq"), jnp.int32)],
                         model_name="aiinfra_jax_dense", opset=OPSET, return_mode="file",
                         output_path=str(path), input_names=list(INPUTS),
                         output_names=list(OUTPUTS))
    proto = onnx.load(str(path), load_external_data=False)
    files = [FILE] + ([DATA_FILE] if (tmp / DATA_FILE).exists() else [])
    sizes = {f: (tmp / f).stat().st_size for f in files}
    info: dict[str, Any] = {
        "files": files, "bytes": sum(sizes.values()),
        "opset": max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
        "ir_version": int(proto.ir_version),
        "converter": converter,
        "inputs": [_value_info(onnx, v) for v in proto.graph.input],
        "outputs": [_value_info(onnx, v) for v in proto.graph.output],
        "positions": "0..seq-1 in every row (no segment ids, no cache)",
        "op_types": sorted(_op_types(proto.graph, set())),
        "run_settings": list(RUN_SETTINGS) + ["model.scan_layers=false (unscanned)"],
        "param_dtype": trained.param_dtype,
    }
    del proto
    if check:
        info["check"] = check_onnx(path, model, ort, say=say)
    say(f"  {', '.join(f'{f}: {n} bytes' for f, n in sizes.items())}")
    return info


def check_onnx(path: Path, model: Transformer, ort=None, *, say: Say = print) -> dict[str, Any]:
    """Runs the file at `path` in onnxruntime (CPU) on random tokens CHECK_SHAPE and compares
    with `model` (onnx_forward's) in JAX; ExportError above CHECK_RTOL * max(1, max |logits|)."""
    if ort is None:
        ort = _libraries()[2]
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, CHECK_SHAPE,
                                               dtype=np.int32)
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, t: nnx.merge(graphdef, s)(
        t, positions=jax.lax.broadcasted_iota(jnp.int32, t.shape, 1))[0])
    want = np.asarray(run(state, jnp.asarray(tokens)))
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    got = session.run(list(OUTPUTS), {INPUTS[0]: tokens})[0]
    if got.shape != want.shape:
        raise ExportError(f"{path}: onnxruntime gives logits {got.shape}, JAX {want.shape}")
    diff = float(np.max(np.abs(got.astype(np.float64) - want)))
    scale = float(np.max(np.abs(want)))
    tolerance = CHECK_RTOL * max(1.0, scale)
    result = {"onnxruntime": ort.__version__, "tokens_shape": list(CHECK_SHAPE),
              "max_abs_diff": diff, "max_abs_logit": scale, "tolerance": tolerance}
    if not diff <= tolerance:
        raise ExportError(f"{path}: onnxruntime's logits differ from the JAX model's by {diff:.3g} "
                          f"(max |logit| {scale:.3g}, tolerance {tolerance:.3g}); the converter "
                          "mis-lowered an op, please report it with this file")
    say(f"checked in onnxruntime {ort.__version__}: max |logit difference| {diff:.2g} "
        f"(max |logit| {scale:.3g})")
    return result
