"""Hugging Face Llama (and Qwen2 / Qwen3) layouts: what `aiinfra_jax.export --format hf` writes and
`aiinfra_jax.import_hf` reads.

Shape letters: D d_model (hidden_size), H query heads, K key/value heads, Dh head_dim, F d_ff
(intermediate_size), V vocabulary, L layers.

Why Llama. Our dense decoder (mixer "dense", FFN "swiglu", residual "standard", no short
convolution) is exactly a Llama decoder: pre-norm RMSNorm (weight * x * rsqrt(mean(x^2) + eps),
in float32), q/k/v/o projections without biases, rotate-half RoPE with inv_freq = theta^(-2i/Dh)
on all of head_dim, GQA with query head h reading KV head h // (H / K), softmax scale Dh^-0.5, and
a SwiGLU MLP down(silu(gate(x)) * up(x)). Qwen2 adds q/k/v biases and Qwen3 an RMSNorm over
head_dim on each query and key head before RoPE: our dense mixer has both as options
(model.dense.qkv_bias, model.dense.qk_norm), so those checkpoints import as such and those models
export as Qwen2ForCausalLM / Qwen3ForCausalLM (a bias on o_proj, Llama's and Qwen3's
attention_bias, and sliding-window layers are refused by name).

Tensor mapping (our per-layer names, aiinfra_jax.export's naming scheme, <-> HF names; HF's
nn.Linear weights are [out, in], ours [in, ...]):

    embed.table                [V,D]       model.embed_tokens.weight          [V,D]
    layers.i.mixer_norm.scale  [D]         model.layers.i.input_layernorm.weight
    layers.i.mixer.wq          [D,H,Dh]    model.layers.i.self_attn.q_proj.weight [H*Dh,D]
    layers.i.mixer.wk / wv     [D,K,Dh]    model.layers.i.self_attn.k_proj / v_proj.weight [K*Dh,D]
    layers.i.mixer.wo          [H,Dh,D]    model.layers.i.self_attn.o_proj.weight [D,H*Dh]
    layers.i.ffn_norm.scale    [D]         model.layers.i.post_attention_layernorm.weight
    layers.i.ffn.w_gate / w_up [D,F]       model.layers.i.mlp.gate_proj / up_proj.weight [F,D]
    layers.i.ffn.w_down        [F,D]       model.layers.i.mlp.down_proj.weight [D,F]
    final_norm.scale           [D]         model.norm.weight
    head.kernel                [D,V]       lm_head.weight [V,D] (absent: tie_word_embeddings)
    layers.i.mixer.bq          [H,Dh]      model.layers.i.self_attn.q_proj.bias [H*Dh] (Qwen2)
    layers.i.mixer.bk / bv     [K,Dh]      model.layers.i.self_attn.k_proj / v_proj.bias [K*Dh]
    layers.i.mixer.q_norm.scale / k_norm.scale [Dh]   model.layers.i.self_attn.q_norm / k_norm.weight
                                                       (Qwen3)

The flattening of heads is h * Dh + d on both sides (HF views q_proj's output as [.., H, Dh]).

Byte tokenizer. Our ByteTokenizer (ids 0..255 = bytes, 256 <pad>, 257 <s> (BOS), 258 </s>
(EOS)) is written as a `tokenizers` tokenizer.json (`byte_tokenizer_json`): a BPE model with no
merges over the 256 byte-level characters (the ByteLevel pre-tokenizer's table, which moves every
byte to one visible character), byte b at id b, the three specials as added tokens, a
ByteLevel decoder, and a post-processor that puts <s> first (our data pipeline starts every
document with BOS). It encodes any text to exactly our byte ids, except that, as in every
tokenizer.json, the text of a special token inside a document ("<s>") becomes that one token
where ByteTokenizer keeps its bytes. Our HFTokenizer reads it back (BOS/EOS/PAD by their
names). Nothing here needs the `tokenizers` package: the JSON is written directly.

The mapping runs on host numpy arrays.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

import numpy as np

from aiinfra_jax.errors import UserError
from aiinfra_jax.models.attention.dense import DenseConfig
from aiinfra_jax.models.config import ModelConfig


class ExportError(UserError, ValueError):
    """A model, checkpoint or directory that cannot be exported or imported as asked; the
    message names the part and the way out."""


# ----------------------------------------------------------------------------- what Llama expresses

# Registered components that have no Llama counterpart, with what they are (for the refusal).
_DESCRIBE = {
    "nsa": "Native Sparse Attention",
    "msa": "Memory Sparse Attention",
    "gdn": "gated DeltaNet",
    "kda": "Kimi Delta Attention",
    "moe": "mixture-of-experts FFN",
    "deamoe": "DeaMoE departments",
    "attnres_full": "Attention Residuals",
    "attnres_block": "Block Attention Residuals",
}


def _named(name: str) -> str:
    return f"{name!r} ({_DESCRIBE[name]})" if name in _DESCRIBE else repr(name)


def unsupported_parts(cfg: ModelConfig) -> list[str]:
    """What of `cfg` a Hugging Face Llama decoder cannot express, one line per part (empty: the
    model exports as Llama)."""
    parts = []
    bad = sorted({m for m in cfg.mixers if m != "dense"})
    if bad:
        parts.append(f"model.mixers={list(cfg.mixers)}: mixer {', '.join(map(_named, bad))} "
                     "(Llama has only dense attention)")
    bad = sorted({f for f in cfg.ffns if f != "swiglu"})
    if bad:
        parts.append(f"model.ffns={list(cfg.ffns)}: FFN {', '.join(map(_named, bad))} "
                     "(Llama has only the SwiGLU MLP)")
    if cfg.residual != "standard":
        parts.append(f"model.residual={cfg.residual!r}: residual scheme {_named(cfg.residual)} "
                     "(Llama has only the pre-norm residual)")
    if cfg.short_conv:
        parts.append(f"model.short_conv={cfg.short_conv}: a short convolution before each mixer "
                     "(Llama has none)")
    if cfg.dense.qk_norm and cfg.dense.qkv_bias:
        parts.append("model.dense.qk_norm and model.dense.qkv_bias together (Qwen3 has q/k "
                     "norms; its attention_bias would also put a bias on o_proj, which we lack)")
    return parts


def check_expressible(cfg: ModelConfig, what: str) -> None:
    """ExportError naming every part of `cfg` that Llama cannot express."""
    parts = unsupported_parts(cfg)
    if parts:
        raise ExportError(
            f"{what} cannot be exported as a Hugging Face Llama model: " + "; ".join(parts)
            + ". Export it with --format safetensors (every model) instead")


# ----------------------------------------------------------------------------- tensor mapping

def _linear_in(a: np.ndarray) -> np.ndarray:
    """Ours [in, *out] -> HF nn.Linear weight [prod(out), in]."""
    return np.ascontiguousarray(a.reshape(a.shape[0], -1).T)


def _linear_out(a: np.ndarray) -> np.ndarray:
    """Ours [*in, out] -> HF nn.Linear weight [out, prod(in)]."""
    return np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)


def _same(a: np.ndarray) -> np.ndarray:
    return a


# (our name below layers.i, HF name below model.layers.i, ours -> HF, HF -> ours given cfg)
_LAYER = [
    ("mixer_norm.scale", "input_layernorm.weight", _same, lambda a, c: a),
    ("mixer.wq", "self_attn.q_proj.weight", _linear_in,
     lambda a, c: a.T.reshape(c.d_model, c.n_heads, c.resolved_head_dim)),
    ("mixer.wk", "self_attn.k_proj.weight", _linear_in,
     lambda a, c: a.T.reshape(c.d_model, c.n_kv_heads, c.resolved_head_dim)),
    ("mixer.wv", "self_attn.v_proj.weight", _linear_in,
     lambda a, c: a.T.reshape(c.d_model, c.n_kv_heads, c.resolved_head_dim)),
    ("mixer.wo", "self_attn.o_proj.weight", _linear_out,
     lambda a, c: a.T.reshape(c.n_heads, c.resolved_head_dim, c.d_model)),
    ("ffn_norm.scale", "post_attention_layernorm.weight", _same, lambda a, c: a),
    ("ffn.w_gate", "mlp.gate_proj.weight", _linear_in, lambda a, c: a.T),
    ("ffn.w_up", "mlp.up_proj.weight", _linear_in, lambda a, c: a.T),
    ("ffn.w_down", "mlp.down_proj.weight", _linear_in, lambda a, c: a.T),
]
_TOP = [
    ("embed.table", "model.embed_tokens.weight", _same, lambda a, c: a),
    ("final_norm.scale", "model.norm.weight", _same, lambda a, c: a),
]
_HEAD = ("head.kernel", "lm_head.weight", lambda a: np.ascontiguousarray(a.T),
         lambda a, c: a.T)


# Qwen2's q/k/v biases ([H*Dh] / [K*Dh] in HF, [H,Dh] / [K,Dh] ours) and Qwen3's q/k norms.
_BIAS = [(f"mixer.b{x}", f"self_attn.{x}_proj.bias", lambda a: np.ascontiguousarray(a.reshape(-1)),
          lambda a, c, x=x: a.reshape(c.n_heads if x == "q" else c.n_kv_heads,
                                      c.resolved_head_dim)) for x in "qkv"]
_QK_NORM = [(f"mixer.{x}_norm.scale", f"self_attn.{x}_norm.weight", _same, lambda a, c: a)
            for x in "qk"]


def _pairs(cfg: ModelConfig) -> list[tuple[str, str, Callable, Callable]]:
    """Every (our name, HF name, to_hf, from_hf) of a Llama-expressible cfg."""
    rows = list(_TOP)
    layer = (_LAYER + (_BIAS if cfg.dense.qkv_bias else [])
             + (_QK_NORM if cfg.dense.qk_norm else []))
    for i in range(cfg.n_layers):
        rows += [(f"layers.{i}.{ours}", f"model.layers.{i}.{theirs}", fwd, back)
                 for ours, theirs, fwd, back in layer]
    if not cfg.tie_embeddings:
        rows.append(_HEAD)
    return rows


def to_hf_tensors(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our named tensors (export's scheme) -> HF Llama state dict; every tensor must map."""
    check_expressible(cfg, "this model")
    out, used = {}, set()
    for ours, theirs, fwd, _ in _pairs(cfg):
        if ours not in tensors:
            raise ExportError(f"tensor {ours!r} is missing from the model; it is not the dense "
                              "Llama-like model its config describes")
        out[theirs] = fwd(np.asarray(tensors[ours]))
        used.add(ours)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ExportError(f"tensors {extra[:5]} have no place in a Hugging Face Llama model; "
                          "export with --format safetensors instead")
    return out


def from_hf_tensors(hf: Mapping[str, np.ndarray], cfg: ModelConfig, where: str
                    ) -> tuple[dict[str, np.ndarray], list[tuple[str, str]]]:
    """An HF Llama state dict -> (our named tensors, [(HF name, our name)] in mapping order).

    A tied lm_head.weight (present in some checkpoints) is checked equal to the embedding and
    skipped; rotary inv_freq buffers are skipped; any other unknown tensor is refused."""
    out, mapping, used = {}, [], set()
    for ours, theirs, _, back in _pairs(cfg):
        if theirs not in hf:
            raise ExportError(f"{where}: tensor {theirs!r} is missing; a {cfg.n_layers}-layer "
                              "Llama checkpoint has it")
        array = np.asarray(hf[theirs])
        try:
            out[ours] = np.ascontiguousarray(back(array, cfg))
        except ValueError as e:  # a reshape that cannot hold it: config.json and tensor disagree
            raise ExportError(
                f"{where}: tensor {theirs!r} has shape {list(array.shape)}, which does not fit "
                f"config.json (hidden_size {cfg.d_model}, {cfg.n_heads} heads and "
                f"{cfg.n_kv_heads} KV heads of head_dim {cfg.resolved_head_dim}, "
                f"intermediate_size {cfg.resolved_d_ff}) ({e}); the config.json is not the "
                "one these weights were saved with") from e
        mapping.append((theirs, ours))
        used.add(theirs)
    if cfg.tie_embeddings and "lm_head.weight" in hf:
        if not np.array_equal(np.asarray(hf["lm_head.weight"]),
                              np.asarray(hf["model.embed_tokens.weight"])):
            raise ExportError(f"{where}: tie_word_embeddings is true but lm_head.weight differs "
                              "from model.embed_tokens.weight; fix config.json")
        used.add("lm_head.weight")
    extra = sorted(n for n in set(hf) - used if not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ExportError(f"{where}: tensors {extra[:5]} have no place in our dense model (a "
                          "Llama without biases or q/k norms); nothing was imported")
    return out, mapping


# ----------------------------------------------------------------------------- configs

def hf_architecture(cfg: ModelConfig) -> tuple[str, str]:
    """(model_type, architecture) of a Llama-expressible cfg: Qwen3 with q/k norms, Qwen2 with
    q/k/v biases alone, Llama otherwise."""
    if cfg.dense.qk_norm:
        return "qwen3", "Qwen3ForCausalLM"
    if cfg.dense.qkv_bias:
        return "qwen2", "Qwen2ForCausalLM"
    return "llama", "LlamaForCausalLM"


def hf_config(cfg: ModelConfig, *, bos_id: int | None, eos_id: int | None,
              pad_id: int | None) -> dict[str, Any]:
    """The config.json of a Llama-expressible cfg (read by transformers 4.x and 5.x: rope_theta
    and rope_parameters both written); a Qwen2 / Qwen3 one for the q/k/v biases / q/k norms."""
    check_expressible(cfg, "this model")
    dtype = cfg.param_dtype
    model_type, arch = hf_architecture(cfg)
    extra: dict[str, Any] = {}
    if model_type != "llama":
        extra = {"use_sliding_window": False, "sliding_window": None,
                 "max_window_layers": cfg.n_layers,
                 "layer_types": ["full_attention"] * cfg.n_layers}
    return {
        **extra,
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.resolved_d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,  # (qk_norm with qkv_bias is refused: unsupported_parts)
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


# Architectures read (model_type): Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms).
_TYPES = ("llama", "qwen2", "qwen3")


def model_fields_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig fields (sizes and architecture) of an HF Llama / Qwen2 / Qwen3 config.json;
    ExportError naming the key for anything our dense model cannot express."""
    kind = hf.get("model_type")
    if kind not in _TYPES:
        raise ExportError(f"{where}: model_type {kind!r} is not supported; Llama, Qwen2 and "
                          f"Qwen3 checkpoints (model_type {', '.join(map(repr, _TYPES))}) can be "
                          "imported")

    def need(key: str) -> Any:
        if key not in hf:
            raise ExportError(f"{where}: config.json has no {key!r}")
        return hf[key]

    # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which we do not have;
    # Qwen2's q/k/v biases are part of the architecture (no flag).
    for key, ok in (("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            raise ExportError(f"{where}: {key}={hf[key]!r}; our dense model has biases only on "
                              "Qwen2's q/k/v projections")
    types = set(hf.get("layer_types") or ["full_attention"])
    if hf.get("use_sliding_window") or types != {"full_attention"}:
        raise ExportError(f"{where}: sliding-window layers (use_sliding_window / layer_types) "
                          "are not supported; our dense model attends to the whole context")
    if hf.get("hidden_act", "silu") != "silu":
        raise ExportError(f"{where}: hidden_act={hf['hidden_act']!r}; our SwiGLU uses 'silu'")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise ExportError(f"{where}: pretraining_tp={hf['pretraining_tp']!r} is not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ExportError(f"{where}: RoPE scaling {rope_type!r} is not supported (our RoPE is the "
                          "plain rotate-half form)")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ExportError(f"{where}: partial_rotary_factor != 1 is not supported")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    heads = need("num_attention_heads")
    d_model = need("hidden_size")
    return {
        "vocab_size": need("vocab_size"),
        "d_model": d_model,
        "n_layers": need("num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or d_model // heads,
        "d_ff": need("intermediate_size"),
        "mixers": ("dense",),
        "dense": DenseConfig(qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3"),
        "ffns": ("swiglu",),
        "residual": "standard",
        "short_conv": 0,
        "rope_theta": float(theta),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_seq_len": int(hf.get("max_position_embeddings") or ModelConfig.max_seq_len),
    }


# ----------------------------------------------------------------------------- tokenizers

BYTE_SPECIALS = {256: "<pad>", 257: "<s>", 258: "</s>"}  # ByteTokenizer.PAD, BOS, EOS


def byte_level_chars() -> list[str]:
    """The character standing for each byte 0..255 in a byte-level tokenizer: printable
    Latin-1 bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) are themselves; every other byte
    (controls, space, 0x7F..0xA0, the soft hyphen 0xAD) is moved, in byte order, to 256, 257, ...
    so that no token is invisible or whitespace."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, moved = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + moved))
            moved += 1
    return chars


def _added(i: int, text: str) -> dict[str, Any]:
    return {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def byte_tokenizer_json() -> dict[str, Any]:
    """A `tokenizers` tokenizer.json equal to our ByteTokenizer (see the module docstring)."""
    bos = BYTE_SPECIALS[257]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added(i, t) for i, t in sorted(BYTE_SPECIALS.items())],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [257], "tokens": [bos]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {c: b for b, c in enumerate(byte_level_chars())}, "merges": []},
    }


def is_byte_tokenizer_json(data: Any) -> bool:
    """Whether a parsed tokenizer.json is our byte tokenizer's (same vocabulary, merges and
    special tokens), so an import can use tokenizer 'byte' instead of the file."""
    if not isinstance(data, dict):
        return False
    mine = byte_tokenizer_json()
    model = data.get("model") or {}
    specials = {t.get("id"): t.get("content") for t in data.get("added_tokens") or []}
    return (model.get("type") == "BPE" and model.get("vocab") == mine["model"]["vocab"]
            and not model.get("merges") and specials == BYTE_SPECIALS
            and (data.get("pre_tokenizer") or {}).get("type") == "ByteLevel")


def tokenizer_config(bos: str | None, eos: str | None, pad: str | None,
                     max_len: int) -> dict[str, Any]:
    """tokenizer_config.json for transformers' AutoTokenizer over a tokenizer.json."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
            "pad_token": pad, "model_max_length": max_len, "clean_up_tokenization_spaces": False}


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
