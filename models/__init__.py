"""Flax NNX models (import: aiinfra_jax.models): config, registries, layers, the Transformer."""

from . import attention, attnres, deamoe, layers, moe, residual  # noqa: F401  (register built-ins)
from .attention.dense import DenseConfig
from .attention.nsa import NSAConfig
from .attnres import AttnResConfig
from .auxiliary import record, report_loss, report_metric
from .config import ModelConfig, padded_vocab_size, runtime_field
from .registry import (FFNS, MIXERS, RESIDUALS, get_ffn, get_mixer, get_residual, register_config,
                       register_ffn, register_mixer, register_residual)
from .transformer import Transformer

__all__ = ["ModelConfig", "padded_vocab_size", "runtime_field", "Transformer", "MIXERS", "FFNS",
           "RESIDUALS", "register_mixer", "register_ffn", "register_residual", "register_config",
           "get_mixer", "get_ffn", "get_residual", "NSAConfig", "AttnResConfig", "DenseConfig",
           "report_loss", "report_metric", "record"]
