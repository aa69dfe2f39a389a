"""leapquant: near-lossless 8-bit recurrent states for gated-delta (GDN / KDA) decoding.

    from aiinfra_jax.kernels.leapquant import LeapQuantSpec, encode_state, leapquant_decode

A window-boundary state quantized once per window of P steps (INT8/6/4 with per-column scales,
residual smoothing, float16 low-rank compensators; quantize.py), the window's steps kept as
high-precision records (float32, or bfloat16: LeapQuantSpec.record_dtype) and read without
re-quantizing (xla.py; the window read also as Pallas kernels, pallas_gpu.py / pallas_tpu.py,
chosen per platform in api.py); reference.py is the dense oracle.
"""

from .api import (encode_state, init_state, leapquant_decode, materialize, state_nbytes)
from .quantize import (RECORD_DTYPES, LeapQuantSpec, bytes_per_element, decode_boundary,
                       dequantize_columns, encode_boundary, low_rank, outlier_ratio,
                       quantize_columns, smoothing_factors, stage_outlier_ratios)
from .reference import leapquant_decode_reference

__all__ = ["LeapQuantSpec", "RECORD_DTYPES", "leapquant_decode", "leapquant_decode_reference",
           "encode_state", "init_state", "materialize", "state_nbytes", "bytes_per_element",
           "encode_boundary", "decode_boundary", "quantize_columns", "dequantize_columns",
           "smoothing_factors", "low_rank", "outlier_ratio", "stage_outlier_ratios"]
