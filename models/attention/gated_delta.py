"""Gated DeltaNet ("gdn") and Kimi Delta Attention ("kda") token mixers: linear attention with a
delta-rule recurrent state, trained through the chunkwise kernel, decoded step by step.

Shape letters: B batch, T new tokens, D d_model, H query/key heads, HV value heads (a multiple of
H), K key head dim, V value head dim, W convolution width.

One layer (the layout of fla-org's GatedDeltaNet / KimiDeltaAttention layers and of Qwen3-Next):

    q, k = SiLU(conv(x W_q)), SiLU(conv(x W_k))      [B,T,H,K], then L2-normalised over K
    v    = SiLU(conv(x W_v))                          [B,T,HV,V]
    beta = sigmoid(x W_b)                             [B,T,HV]
    GDN: g = -exp(A_log) * softplus(x W_a + dt_bias)                [B,T,HV]    (one decay a head)
    KDA: g = -exp(A_log) * softplus(x W_f1 W_f2 + dt_bias)          [B,T,HV,K]  (one a key channel;
         W_f1 [D,V] W_f2 [V,HV*K] is fla's low-rank gate); with kda_gate_bound = c > 0 the bounded
         form g = -c * sigmoid(exp(A_log) * (x W_f1 W_f2 + dt_bias)) keeps every decay >= e^-c
    o    = gated_delta_rule(q, k, v, g, beta)          (kernels/gated_delta; scale K^-1/2)
    y    = (RMSNorm_V(o) * SiLU(x W_gate)) W_o         gated RMSNorm per value head, output proj.

conv is a causal depthwise convolution of width W (models/short_conv.causal_conv; 0 = off)
inside each document. Initialisation as fla documents it: A uniform in [1, 16) (A_log = log A),
dt log-uniform in [1e-3, 1e-1] with dt_bias its inverse softplus, normal(init_std) projections,
the output projection scaled by depth like every residual writer here.

Training (no cache): packed documents (segment_ids) reset the state at every boundary inside the
kernel, so nothing leaks across documents. Cache (prefill / decode): {"state": [B,HV,K,V] float32,
"conv": [B,W-1,C] the last W-1 projected q/k/v inputs (C = 2HK + HV*V), "lengths": [B]}; constant
memory and time per token whatever the context length. Right padding (segment_ids 0) in a cached
call writes nothing: its beta and g are zeroed, so the state passes through it unchanged, and the
convolution tail keeps each row's last real inputs. A recurrent state has no slot limit, so a
cached call never overflows (max_len only sizes nothing here); positions are not used (no RoPE).

Quantized decode states (LeapQuant, kernels/leapquant; off by default; its window read picks its
implementation from the lowering platform, implementation=None): with
`model.gated_delta.state_quant` = "int8" | "int6" | "int4" | "bf16" the cache holds
{"qstate": the LeapQuant state (a quantized window-boundary state, its scales, smoothing and float16
compensators, plus the current window's high-precision records), "conv", "lengths"} instead of the
float32 "state". A one-token call (decode) runs the record form (kernels/leapquant/xla.py: the
boundary state is read without a dequantized copy and re-quantized every state_window steps); a
longer call (prefill, or a prefill chunk) runs the chunked kernel from the dense state the cache
stands for and quantizes its final state, starting a new window (rows with no real token in the
call keep theirs untouched). `model.gated_delta.state_records="bfloat16"` stores the window's
records k~ and u in bf16 (float32 by default). "<fmt>_per_step" (e.g. "int8_per_step",
"bf16_per_step") is the naive baseline: the state rounded after every step (window 1, no
compensators, no smoothing).
models/prefix_cache.py snapshots such caches every N prompt tokens and restores them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.kernels.gated_delta import gated_delta_rule
from aiinfra_jax.kernels.leapquant import (RECORD_DTYPES, LeapQuantSpec, encode_state,
                                           init_state, leapquant_decode, materialize)

from ..config import ModelConfig, check_implementation, runtime_field
from ..layers import make_param, out_proj_std, project
from ..registry import register_config, register_mixer
from ..short_conv import causal_conv


@register_config("gated_delta")
@dataclasses.dataclass(frozen=True)
class GatedDeltaConfig:
    """Settings of the "gdn" and "kda" mixers (see the module docstring).

    num_heads: query/key heads H (0 = ModelConfig.n_heads); num_v_heads: value heads HV, a
    multiple of H (0 = H); head_k_dim K (0 = ModelConfig's head_dim); head_v_dim V (0 = K).
    conv_width: W of the q/k/v short convolutions (0 = off). kda_gate_bound: see the docstring
    (0 = the unbounded softplus gate). chunk_size: the kernel's chunk. implementation / interpret:
    the kernel's backend (run-time).

    Quantized decode states (run-time; see the module docstring and kernels/leapquant):
    state_quant: None (off: float32 states), "int8" / "int6" / "int4" / "bf16" (LeapQuant: a
    quantized boundary state per window of state_window steps plus the window's records), or
    "<fmt>_per_step" (the naive baseline, rounded every step). state_window: steps per window
    (16). state_rank: compensators per state (None = 4, 8 at int4, 0 for bf16). state_smoothing:
    residual smoothing (None = on for the integer formats). state_comp_target: "state" (fit the
    compensators to the state, then quantize the residual) or "error" (fit them to the
    quantization error); see kernels/leapquant/quantize.py. state_records: "float32" or
    "bfloat16", how a window's records k~ and u are stored (their log-decays stay float32):
    bfloat16 halves most of a live window's bytes at a bf16 rounding of each step's update
    (eval/BENCHMARKS.md, "window records in bf16"). The "<fmt>_per_step" baselines ignore
    state_window, state_rank, state_smoothing, state_comp_target and state_records: a window of
    1 holds its one record only within the step that writes it, so it stays float32.
    """

    num_heads: int = 0
    num_v_heads: int = 0
    head_k_dim: int = 0
    head_v_dim: int = 0
    conv_width: int = 4
    kda_gate_bound: float = 0.0
    chunk_size: int = runtime_field(64)
    implementation: str | None = runtime_field(None)
    interpret: bool = runtime_field(False)
    state_quant: str | None = runtime_field(None)
    state_window: int = runtime_field(16)
    state_rank: int | None = runtime_field(None)
    state_smoothing: bool | None = runtime_field(None)
    state_comp_target: str = runtime_field("state")
    state_records: str = runtime_field("float32")

    def __post_init__(self):
        for name in ("num_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"GatedDeltaConfig.{name}={value!r} must be an int >= 0")
        if self.conv_width == 1:
            raise ValueError("GatedDeltaConfig.conv_width=1 is a per-channel scale, not a "
                             "convolution: use 0 (off) or >= 2")
        if not (isinstance(self.kda_gate_bound, (int, float)) and
                math.isfinite(self.kda_gate_bound) and self.kda_gate_bound >= 0):
            raise ValueError(f"GatedDeltaConfig.kda_gate_bound={self.kda_gate_bound!r} must be a "
                             "finite number >= 0 (0 = unbounded)")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 8 or self.chunk_size % 8:
            raise ValueError(f"GatedDeltaConfig.chunk_size={self.chunk_size!r} must be a positive "
                             "multiple of 8")
        check_implementation("GatedDeltaConfig", self.implementation,
                             (None, "xla", "pallas_gpu", "pallas_tpu"))
        self.state_spec()  # validates the state_* fields

    def state_spec(self) -> LeapQuantSpec | None:
        """The kernels/leapquant storage spec of the decode state, or None (float32 states).
        Raises ValueError naming the model.gated_delta.state_* field that is wrong."""
        w = self.state_window
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"model.gated_delta.state_window={w!r} must be an int >= 1 (steps "
                             "per quantization window; 16 is LeapQuant's default)")
        r = self.state_rank
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 0):
            raise ValueError(f"model.gated_delta.state_rank={r!r} must be None (4; 8 at int4) or "
                             "an int >= 0")
        if self.state_smoothing not in (None, True, False):
            raise ValueError(f"model.gated_delta.state_smoothing={self.state_smoothing!r} must be "
                             "None (on for integer formats), True or False")
        if self.state_comp_target not in ("state", "error"):
            raise ValueError(f"model.gated_delta.state_comp_target={self.state_comp_target!r} "
                             "must be 'state' or 'error'")
        if self.state_records not in RECORD_DTYPES:
            raise ValueError(f"model.gated_delta.state_records={self.state_records!r} must be one "
                             f"of {RECORD_DTYPES} (how a window's records are stored)")
        q = self.state_quant
        if q is None:
            return None
        choices = "None, 'int8', 'int6', 'int4', 'bf16' or one of those + '_per_step'"
        if not isinstance(q, str):
            raise ValueError(f"model.gated_delta.state_quant={q!r} must be {choices}")
        fmt, per_step = (q[:-len("_per_step")], True) if q.endswith("_per_step") else (q, False)
        m = re.fullmatch(r"int(\d+)", fmt)
        if m and int(m.group(1)) not in (4, 6, 8):
            raise ValueError(f"model.gated_delta.state_quant={q!r}: {m.group(1)} bits is not "
                             "supported; bits must be 4, 6 or 8 ('int8', 'int6', 'int4')")
        if fmt not in ("int8", "int6", "int4", "bf16"):
            raise ValueError(f"model.gated_delta.state_quant={q!r} must be {choices}")
        if per_step:
            return LeapQuantSpec(fmt=fmt, window=1, rank=0, smoothing=False)
        return LeapQuantSpec(fmt=fmt, window=w, rank=r, smoothing=self.state_smoothing,
                             comp_target=self.state_comp_target, record_dtype=self.state_records)

    def dims(self, cfg: ModelConfig) -> tuple[int, int, int, int]:
        """(H, HV, K, V) resolved against the model config."""
        h = self.num_heads or cfg.n_heads
        hv = self.num_v_heads or h
        k = self.head_k_dim or cfg.resolved_head_dim
        return h, hv, k, self.head_v_dim or k

    def check_model(self, cfg: ModelConfig) -> None:
        if not any(m in ("gdn", "kda") for m in cfg.mixers):
            if self.state_quant is not None:
                raise ValueError(f"model.gated_delta.state_quant={self.state_quant!r} quantizes "
                                 f"the recurrent states of 'gdn'/'kda' mixers, but model.mixers="
                                 f"{cfg.mixers} has none: add a 'gdn' or 'kda' mixer or set "
                                 "model.gated_delta.state_quant=None")
            return
        h, hv, kd, vd = self.dims(cfg)
        if hv % h:
            raise ValueError(f"model.gated_delta.num_v_heads={hv} must be a multiple of the "
                             f"query/key heads {h}")
        spec = self.state_spec()
        if spec is not None and spec.r > min(kd, vd):
            raise ValueError(f"model.gated_delta.state_rank={spec.r} exceeds the state's rank "
                             f"limit min(K, V) = {min(kd, vd)}: lower it")


class _GatedDelta(nnx.Module):
    """The layer of both mixers; `per_channel_decay` tells KDA (True) from GDN (False)."""

    per_channel_decay = False

    @classmethod
    def from_dense(cls, cfg: ModelConfig, dense: dict[str, Any]) -> dict[str, tuple[Any, str, str]]:
        """What a dense attention layer's parameters give this layer, for architecture surgery
        (aiinfra_jax/surgery.py): {our name: (array, dense name, how)}. The projections of
        q, k, v and the output, as in attention-to-linear-attention conversions (e.g. "The Mamba
        in the Llama"): w_q <- wq, w_o <- wo, and w_k / w_v <- wk / wv with each key/value head
        repeated for the heads that share it (H / K, HV / K). The decay, beta, output gate,
        convolution and norm keep their init. A dense tensor whose heads or widths do not fit is
        left out (the layer then initialises that projection, and the report says so)."""
        h, hv, kd, vd = cfg.gated_delta.dims(cfg)
        out = {}
        for ours, theirs, heads in (("w_q", "wq", h), ("w_k", "wk", h), ("w_v", "wv", hv)):
            a = dense.get(theirs)  # [D, heads or K, Dh]
            if a is not None and heads % a.shape[1] == 0:
                reps = heads // a.shape[1]
                out[ours] = (np.repeat(a, reps, axis=1), theirs,
                             "copied" if reps == 1 else f"each head repeated {reps}x")
        if "wo" in dense:
            out["w_o"] = (dense["wo"], "wo", "copied")
        return out

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        c = cfg.gated_delta
        h, hv, kd, vd = c.dims(cfg)
        d, std, pdt = cfg.d_model, cfg.init_std, cfg.param_dtype
        self.w_q = make_param(rngs, (d, h, kd), ("embed", "heads", "head_dim"), std, pdt)
        self.w_k = make_param(rngs, (d, h, kd), ("embed", "heads", "head_dim"), std, pdt)
        self.w_v = make_param(rngs, (d, hv, vd), ("embed", "heads", "head_dim"), std, pdt)
        self.w_b = make_param(rngs, (d, hv), ("embed", "heads"), std, pdt)
        self.w_gate = make_param(rngs, (d, hv, vd), ("embed", "heads", "head_dim"), std, pdt)
        self.w_o = make_param(rngs, (hv, vd, d), ("heads", "head_dim", "embed"), out_proj_std(cfg),
                              pdt)
        if self.per_channel_decay:  # fla's low-rank gate projection D -> V -> HV*K
            self.w_f1 = make_param(rngs, (d, vd), ("embed", "head_dim"), std, pdt)
            self.w_f2 = make_param(rngs, (vd, hv, kd), ("head_dim", "heads", "head_dim"), std, pdt)
            bias_shape, bias_axes = (hv, kd), ("heads", "head_dim")
        else:
            self.w_a = make_param(rngs, (d, hv), ("embed", "heads"), std, pdt)
            bias_shape, bias_axes = (hv,), ("heads",)
        a = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)
        # the decay's log-rate and bias are never weight-decayed (steps.weight_decay_mask)
        self.A_log = nnx.Param(jnp.log(a), logical_axes=("heads",), weight_decay=False)
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = jnp.exp(jax.random.uniform(rngs.params(), bias_shape, jnp.float32, lo, hi))
        dt = jnp.maximum(dt, 1e-4)
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)), logical_axes=bias_axes,
                                 weight_decay=False)
        self.o_norm = nnx.Param(jnp.ones((vd,), pdt), logical_axes=("norm",))
        self.dims = (h, hv, kd, vd)
        self.conv_channels = 2 * h * kd + hv * vd
        if c.conv_width:
            conv_std = 1.0 / math.sqrt(3.0 * c.conv_width)  # PyTorch Conv1d's default variance
            self.conv = make_param(rngs, (c.conv_width, self.conv_channels),
                                   ("conv_width", "embed"), conv_std, pdt)

    # -- the pieces

    def _decay(self, x: jax.Array) -> jax.Array:
        """g (log-decays <= 0), float32: [B,T,HV] for GDN, [B,T,HV,K] for KDA."""
        a = jnp.exp(self.A_log[...])
        if self.per_channel_decay:
            z = project(x, self.w_f1[...].astype(x.dtype))
            z = project(z, self.w_f2[...].astype(x.dtype))
            z = z.astype(jnp.float32) + self.dt_bias[...]
            bound = self.cfg.gated_delta.kda_gate_bound
            if bound:
                return -bound * jax.nn.sigmoid(a[:, None] * z)
            return -a[:, None] * jax.nn.softplus(z)
        z = project(x, self.w_a[...].astype(x.dtype)).astype(jnp.float32)
        return -a * jax.nn.softplus(z + self.dt_bias[...])

    def _qkv(self, x, segment_ids, conv_state):
        """Projections, short convolution and SiLU: (q, k [B,T,H,K] L2-normalised, v [B,T,HV,V],
        new convolution state or None)."""
        h, hv, kd, vd = self.dims
        dt = x.dtype
        qkv = jnp.concatenate([
            project(x, self.w_q[...].astype(dt).reshape(x.shape[-1], -1)),
            project(x, self.w_k[...].astype(dt).reshape(x.shape[-1], -1)),
            project(x, self.w_v[...].astype(dt).reshape(x.shape[-1], -1)),
        ], axis=-1)
        new_conv = None
        if self.cfg.gated_delta.conv_width:
            qkv, new_conv = causal_conv(qkv, self.conv[...].astype(dt), segment_ids=segment_ids,
                                        state=conv_state)
        qkv = jax.nn.silu(qkv)
        q, k, v = jnp.split(qkv, [h * kd, 2 * h * kd], axis=-1)
        q = _l2norm(q.reshape(*x.shape[:2], h, kd))
        k = _l2norm(k.reshape(*x.shape[:2], h, kd))
        return q, k, v.reshape(*x.shape[:2], hv, vd), new_conv

    def _output(self, x, o):
        """Gated RMSNorm per value head, then the output projection."""
        dt = x.dtype
        o32 = o.astype(jnp.float32)
        o32 = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + self.cfg.norm_eps)
        gate = project(x, self.w_gate[...].astype(dt))
        y = (o32 * self.o_norm[...].astype(jnp.float32)).astype(dt) * jax.nn.silu(gate)
        return project(y, self.w_o[...].astype(dt), contract=2)

    def recurrence_inputs(self, x_btd: jax.Array) -> tuple[jax.Array, ...]:
        """What this layer feeds the recurrence for inputs x [B,T,D] (one document, no cache):
        (q, k [B,T,H,K] L2-normalised, v [B,T,HV,V], g [B,T,HV] or [B,T,HV,K] log-decays,
        beta [B,T,HV]). For state studies (eval/bench_leapquant.py)."""
        x = x_btd.astype(jnp.dtype(self.cfg.dtype))
        q, k, v, _ = self._qkv(x, None, None)
        beta = jax.nn.sigmoid(project(x, self.w_b[...].astype(x.dtype))
                              .astype(jnp.float32))
        return q, k, v, self._decay(x), beta

    # -- the mixer interface (models/registry.py)

    def __call__(self, x_btd: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None, cache: dict | None = None):
        del positions  # no positional encoding: the recurrence is ordered by itself
        c = self.cfg.gated_delta
        x = x_btd.astype(jnp.dtype(self.cfg.dtype))
        q, k, v, new_conv = self._qkv(x, segment_ids,
                                      None if cache is None else cache.get("conv"))
        g = self._decay(x)
        beta = jax.nn.sigmoid(project(x, self.w_b[...].astype(x.dtype))
                              .astype(jnp.float32))
        run = dict(scale=self.dims[2] ** -0.5, chunk_size=c.chunk_size,
                   implementation=c.implementation, interpret=c.interpret)
        if cache is None:
            o = gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids, **run)
            return self._output(x, o), None
        # Cached: every new token continues its row's sequence; right padding writes nothing.
        if segment_ids is None:
            added = jnp.full_like(cache["lengths"], x.shape[1])
        else:
            real = segment_ids != 0
            added = jnp.sum(real, axis=1).astype(cache["lengths"].dtype)
            beta = jnp.where(real[..., None], beta, 0.0)
            g = jnp.where(real.reshape(real.shape + (1,) * (g.ndim - 2)), g, 0.0)
        if "qstate" in cache:
            o, qstate = self._quantized_step(cache["qstate"], q, k, v, g, beta, segment_ids,
                                             added, run)
            new_cache = {"qstate": qstate}
        else:
            o, state = gated_delta_rule(q, k, v, g, beta, initial_state=cache["state"],
                                        output_final_state=True, **run)
            new_cache = {"state": state}
        new_cache["lengths"] = cache["lengths"] + added
        if new_conv is not None:
            new_cache["conv"] = new_conv
        return self._output(x, o), new_cache

    def _quantized_step(self, qstate, q, k, v, g, beta, segment_ids, added, run):
        """The cached call on a LeapQuant state: (o [B,T,HV,V], new qstate)."""
        spec = self.cfg.gated_delta.state_spec()
        if q.shape[1] == 1:  # decode: the record form, no re-quantization inside a window
            active = None if segment_ids is None else segment_ids != 0
            o, new = leapquant_decode(q, k, v, g, beta, qstate, spec=spec, scale=run["scale"],
                                      active=active)
            return o.astype(q.dtype), new
        # prefill (or a chunk of it): the chunked kernel from the dense state, then a new window
        o, state = gated_delta_rule(q, k, v, g, beta, initial_state=materialize(qstate),
                                    output_final_state=True, **run)
        new = encode_state(spec, state, decay_dim=self._decay_dim)
        wrote = added > 0
        new = jax.tree.map(lambda a, b: jnp.where(wrote.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                           new, qstate)
        return o, new

    @property
    def _decay_dim(self) -> int:
        return self.dims[2] if self.per_channel_decay else 1

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> dict:
        del max_len  # a recurrent state: constant size
        _, hv, kd, vd = self.dims
        spec = self.cfg.gated_delta.state_spec()
        if spec is None:
            cache = {"state": jnp.zeros((batch, hv, kd, vd), jnp.float32)}
        else:
            cache = {"qstate": init_state(spec, batch, hv, kd, vd, decay_dim=self._decay_dim)}
        cache["lengths"] = jnp.zeros((batch,), jnp.int32)
        width = self.cfg.gated_delta.conv_width
        if width:
            cache["conv"] = jnp.zeros((batch, width - 1, self.conv_channels),
                                      jnp.dtype(dtype or self.cfg.dtype))
        return cache

    def flops_per_token(self, seq_len: int) -> float:
        """Projections and convolution, plus the chunkwise recurrence: per value head and token
        about 6*K*V (state read, write and output) + 2*C*(K+V) (intra-chunk terms, C the chunk);
        independent of seq_len."""
        del seq_len
        h, hv, kd, vd = self.dims
        d = self.cfg.d_model
        proj = 2.0 * d * (2 * h * kd + 3 * hv * vd + hv)  # q, k, v, gate, out; beta
        proj += 2.0 * d * (vd + hv * kd if self.per_channel_decay else hv)  # decay gate
        conv = 2.0 * self.cfg.gated_delta.conv_width * self.conv_channels
        chunk = min(self.cfg.gated_delta.chunk_size, 64)
        return proj + conv + hv * (6.0 * kd * vd + 2.0 * chunk * (kd + vd))


@register_mixer("gdn")
class GatedDeltaNet(_GatedDelta):
    """Gated DeltaNet: one decay per head and step."""


@register_mixer("kda")
class KimiDeltaAttention(_GatedDelta):
    """Kimi Delta Attention: one decay per key channel, head and step."""

    per_channel_decay = True


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
