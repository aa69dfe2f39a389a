"""Building blocks: parameter helper, RMSNorm, RoPE, SwiGLU FFN, embedding lookup and output head.

Shape letters: B batch, T sequence, D d_model, F d_ff, H heads, Dh head_dim, V vocabulary.
Parameters live in cfg.param_dtype and carry logical axis names (metadata `logical_axes`);
computation runs in cfg.dtype (parameters are cast at use).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .partitioning import constrain, splits
from .registry import register_ffn


def make_param(rngs: nnx.Rngs, shape: Sequence[int], logical_axes: Sequence[str], std: float,
               dtype) -> nnx.Param:
    """A normal(0, std) initialised parameter tagged with its logical axis names."""
    if len(shape) != len(logical_axes):
        raise ValueError(f"shape {tuple(shape)} and logical_axes {tuple(logical_axes)} differ "
                         "in rank")
    value = jax.random.normal(rngs.params(), tuple(shape), jnp.float32) * std
    return nnx.Param(value.astype(dtype), logical_axes=tuple(logical_axes))


def project(x: jax.Array, w: jax.Array, *, contract: int = 1, w_transposed: bool = False,
            preferred_element_type=None) -> jax.Array:
    """x [B,T,*c] times the weight w [*c,*o] ([*o,*c] with w_transposed) -> [B,T,*o]: the
    trailing `contract` dims of x against the matching dims of w, as one 2-D product
    [B*T, prod(c)] x [prod(c), prod(o)], which is what `jnp.einsum("btd,dhk->bthk", x, w)` and
    the like compute.

    Why not the einsum: differentiated, its weight gradient contracts two token dims (b, t), and
    XLA:CPU lowers a dot with several contracting dims by first transposing both operands into
    one [K, ...] matrix each: a copy of the activations per projection, written with page-strided
    reads. One flattened token dim is one contracting dim, which the CPU's library takes as is.
    Measured (eval/BENCHMARKS.md, "Training loop", 2026-12-07): training steps 1.38x faster for
    the tiny preset, 1.27x for nsa_tiny, 1.4-1.5x for gdn_tiny, 1.19x at d_model 1024; decoding
    unchanged. Other backends see the same products either way.

    The tokens are flattened only when the sequence is not split over a mesh axis ("seq" under
    the active sharding rules): merging a batch dim split over data axes with a sequence split
    over context axes is not a local reshape, and GSPMD would move the activations to make it one.
    Nor under symbolic (exported) batch and sequence sizes, whose names an ONNX graph would lose.
    """
    lead = x.shape[:x.ndim - contract]
    csize = math.prod(x.shape[x.ndim - contract:])
    out = w.shape[:w.ndim - contract] if w_transposed else w.shape[contract:]
    w2 = w.reshape(-1, csize) if w_transposed else w.reshape(csize, -1)
    concrete = all(isinstance(d, int) for d in lead)  # not an export's symbolic batch / seq
    if len(lead) >= 2 and concrete and not splits(x, ("batch", "seq") + (None,) * (x.ndim - 2), 1):
        x2 = x.reshape(math.prod(lead), csize)
    else:
        x2 = x.reshape(lead + (csize,))
    dims = (((x2.ndim - 1,), (1 if w_transposed else 0,)), ((), ()))
    y = jax.lax.dot_general(x2, w2, dims, preferred_element_type=preferred_element_type)
    return y.reshape(lead + out)


def out_proj_std(cfg: ModelConfig) -> float:
    """Init std of projections writing into the residual stream (scaled by depth, GPT-2 style)."""
    return cfg.init_std / (2 * cfg.n_layers) ** 0.5


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale, computed in float32, returned in x's dtype."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype="float32"):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the rotary angles at integer positions [...]: [..., head_dim // 2] float32."""
    inv_freq = theta ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_bthd: jax.Array, positions_bt: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half form) of x [B,T,H,Dh] at positions [B,T].

    Rotating queries and keys by their positions makes q.k depend only on the position difference,
    so per-document positions of packed rows (and cache slots) just work.
    """
    head_dim = x_bthd.shape[-1]
    if head_dim % 2:
        raise ValueError(f"apply_rope: head_dim must be even, got {head_dim}")
    if positions_bt.shape != x_bthd.shape[:2]:
        raise ValueError(f"apply_rope: positions {positions_bt.shape} must be x's [B,T] "
                         f"{x_bthd.shape[:2]}")
    cos, sin = rope_angles(positions_bt, head_dim, theta)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    x1, x2 = jnp.split(x_bthd.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthd.dtype)


@register_ffn("swiglu")
class SwiGLU(nnx.Module):
    """y = (silu(x W_gate) * (x W_up)) W_down with W_gate, W_up [D,F] and W_down [F,D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, f = cfg.d_model, cfg.resolved_d_ff
        self.w_gate = make_param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, cfg.param_dtype)
        self.w_up = make_param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, cfg.param_dtype)
        self.w_down = make_param(rngs, (f, d), ("mlp", "embed"), out_proj_std(cfg), cfg.param_dtype)

    def __call__(self, x_btd: jax.Array, *, segment_ids: jax.Array | None = None,
                 rngs: nnx.Rngs | None = None) -> jax.Array:
        del segment_ids, rngs  # position-wise and deterministic
        dt = jnp.dtype(self.cfg.dtype)
        x = x_btd.astype(dt)
        gate = project(x, self.w_gate[...].astype(dt))
        up = project(x, self.w_up[...].astype(dt))
        return project(jax.nn.silu(gate) * up, self.w_down[...].astype(dt))

    def flops_per_token(self) -> float:
        return 2.0 * 3 * self.cfg.d_model * self.cfg.resolved_d_ff


class Embedding(nnx.Module):
    """Token embedding table [V,D]; `attend` gives the tied output head's logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.table = make_param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                                cfg.init_std, cfg.param_dtype)

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        # The table gathered over its embed (fsdp) axis first, as FSDP does: a lookup from a
        # table split on D would give rows split on D, which collides with the batch split.
        table = constrain(self.table[...], ("vocab", None))
        return jnp.take(table, tokens_bt, axis=0).astype(self.cfg.dtype)

    def attend(self, x_btd: jax.Array) -> jax.Array:
        """Logits [B,T,V] float32 = x @ table^T."""
        dt = jnp.dtype(self.cfg.dtype)
        return project(x_btd.astype(dt), self.table[...].astype(dt), w_transposed=True,
                       preferred_element_type=jnp.float32)


class OutputHead(nnx.Module):
    """Untied output projection [D,V]; logits in float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.kernel = make_param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                 cfg.init_std, cfg.param_dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        dt = jnp.dtype(self.cfg.dtype)
        return project(x_btd.astype(dt), self.kernel[...].astype(dt),
                       preferred_element_type=jnp.float32)
