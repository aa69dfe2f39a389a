"""Residual schemes: how sublayer outputs are combined into the stream (see registry.py).

Shape letters: B batch, T sequence, D d_model.

"standard" (pre-norm): carry = x; each sublayer reads x (the layer normalises it) and adds its
output back: x <- x + out. A scheme such as Attention Residuals keeps all earlier sublayer outputs
in the carry and mixes them with learned per-layer weights instead.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from .config import ModelConfig
from .registry import register_residual


@register_residual("standard")
class StandardResidual(nnx.Module):
    """x_{k+1} = x_k + sublayer(norm(x_k)); no parameters."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        del cfg, rngs

    @classmethod
    def init_carry(cls, cfg: ModelConfig, x_embed_btd: jax.Array) -> Any:
        del cfg
        return x_embed_btd

    def sublayer_input(self, carry: jax.Array, k: int) -> jax.Array:
        del k
        return carry

    def update(self, carry: jax.Array, out_btd: jax.Array, k: int) -> jax.Array:
        del k
        return carry + out_btd.astype(carry.dtype)

    @classmethod
    def finalize(cls, cfg: ModelConfig, carry: jax.Array) -> jax.Array:
        del cfg
        return carry
