"""Short causal convolution on each mixer's input: a cheap local mixer in front of attention.

    y_t = x_t + sum_{k=0}^{W-1} w_k * x_{t-k}        (w [W, D], one filter per channel)

The terms with t - k before the start of x_t's document (another segment of a packed row, or
before position 0) are dropped, so packed documents never see each other, exactly as in attention.

Why: an attention layer alone cannot compare a token with its predecessor; an induction head (find
the earlier occurrence of the current token, copy what followed it) needs a previous-token head in
an earlier layer and forms only after a long plateau. With a short convolution in front, one
attention layer sees "my token and the one before" in its keys and does induction directly. This is
the role of the short convolutions of fla's linear-attention layers (ShortConvolution before the
q/k/v of DeltaNet, gated DeltaNet, Mamba), of Primer's depthwise convolutions (So et al., 2021) and
of Allen-Zhu's Canon layers ("Physics of Language Models, Part 4.1", 2025; this is Canon-A: on the
normed input of the mixer, with a residual). In this repo it turns associative recall from a
plateau of hundreds of steps into a few dozen (eval/BENCHMARKS.md, "Long-context").

Mixer-agnostic: it runs in the Layer before any registered mixer, with its own piece of the layer
cache for decoding (the last W - 1 inputs of each row). Written here rather than taken from a
library because it must follow this repo's packed-segment and per-row cache conventions; it is a
handful of shifted multiply-adds, which XLA fuses.

Shape letters: B batch, T new tokens, W kernel width (ModelConfig.short_conv), D d_model.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .layers import make_param


def causal_conv(x_btc: jax.Array, w_wc: jax.Array, *, segment_ids: jax.Array | None = None,
                state: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Causal depthwise convolution sum_{k<W} w[k] * x[t-k] (one filter per channel C), in x's
    dtype; returns (conv [B,T,C], new state [B,W-1,C] or None).

    Without ``state`` (training): the sequence starts at x[:, 0]; ``segment_ids`` [B,T] (0 =
    padding) keeps the filter inside each document. With ``state`` (prefill / decode): the W - 1
    inputs before x; ``segment_ids`` then only marks right padding (0), and the new state holds
    each row's last W - 1 real inputs. Shared by ShortConv (with a residual) and the gated-delta
    mixers' q/k/v convolutions (models/attention/gated_delta.py).
    """
    width = w_wc.shape[0]
    batch, seq, c = x_btc.shape
    lead = width - 1
    past = jnp.zeros((batch, lead, c), x_btc.dtype) if state is None else state.astype(x_btc.dtype)
    xa = jnp.concatenate([past, x_btc], axis=1)  # [B, W-1+T, C]; x_t is xa[:, t + W - 1]
    if state is None and segment_ids is not None:
        seg = jnp.concatenate([jnp.full((batch, lead), -1, segment_ids.dtype), segment_ids], 1)
    y = jnp.zeros_like(x_btc)
    for k in range(width):
        term = xa[:, lead - k: lead - k + seq] * w_wc[k]
        if state is None and segment_ids is not None and k:
            same = seg[:, lead - k: lead - k + seq] == segment_ids
            term = jnp.where(same[..., None], term, 0)
        y = y + term
    if state is None:
        return y, None
    real = (jnp.full((batch,), seq, jnp.int32) if segment_ids is None
            else jnp.sum(segment_ids != 0, axis=1).astype(jnp.int32))
    idx = real[:, None] + jnp.arange(lead)[None, :]  # the last W-1 real inputs, in xa
    new_state = jnp.take_along_axis(xa, idx[..., None], axis=1)
    return y, new_state.astype(state.dtype)


class ShortConv(nnx.Module):
    """y = x + causal depthwise conv(x), within segments; see the module docstring."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.width = cfg.short_conv
        self.d_model = cfg.d_model
        self.dtype = cfg.dtype
        # The variance of PyTorch's Conv1d default (uniform +-1/sqrt(fan_in), fan_in = W for a
        # depthwise filter), as fla's ShortConvolution gets it: the neighbours start with a say.
        std = 1.0 / math.sqrt(3.0 * self.width)
        self.weight = make_param(rngs, (self.width, cfg.d_model), ("conv_width", "embed"), std,
                                 cfg.param_dtype)

    def __call__(self, x_btd: jax.Array, *, segment_ids: jax.Array | None = None,
                 state: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """x [B,T,D] -> (y [B,T,D], new state [B,W-1,D] or None); see `causal_conv`."""
        dt = jnp.dtype(self.dtype)
        conv, new_state = causal_conv(x_btd.astype(dt), self.weight[...].astype(dt),
                                      segment_ids=segment_ids, state=state)
        return (x_btd.astype(dt) + conv).astype(x_btd.dtype), new_state

    def init_state(self, batch: int, dtype: Any) -> jax.Array:
        """Zeros [B, W-1, D]: the inputs before position 0 (none)."""
        return jnp.zeros((batch, self.width - 1, self.d_model), dtype)

    def flops_per_token(self) -> float:
        return 2.0 * self.width * self.d_model
