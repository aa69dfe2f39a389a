"""Flax NNX models (import: aiinfra_jax.models): config, registries, layers, the Transformer."""

from . import attention, attnres, layers, residual  # noqa: F401  (register the built-ins)
from .config import ModelConfig, padded_vocab_size
from .registry import (FFNS, MIXERS, RESIDUALS, get_ffn, get_mixer, get_residual, register_ffn,
                       register_mixer, register_residual)
from .transformer import Transformer

__all__ = ["ModelConfig", "padded_vocab_size", "Transformer", "MIXERS", "FFNS", "RESIDUALS",
           "register_mixer", "register_ffn", "register_residual", "get_mixer", "get_ffn",
           "get_residual"]
