"""Block sizes and limits per backend for sparse_attention (one small table; tune by benchmark).

xla_tile_entries      (query row, selected block) entries per tile of the XLA path: one tile is one
                      [entries * G, Dk] x [Dk, block_size] matmul against a single key block (each
                      block's entry list is padded to a multiple of this, so larger tiles waste up
                      to NB * (entries - 1) padded entries; smaller ones make thinner matmuls and
                      more row gathers). 256: NSA's selection at T = 8K, G = 16, Dk = 32 on a
                      2-core CPU ran forward 431 -> 310 ms and forward+backward 1181 -> 915 ms
                      against 64 (512: 331 ms forward).
gpu_min_rows          Triton needs >= 16 rows for a dot: the G query heads of a group are padded up
                      to this (and to a power of two) inside the GPU kernel wrapper.
gpu_max_head_dim      largest (power-of-two padded) Dk / Dv the GPU kernel keeps in registers.
gpu_num_warps / gpu_num_stages  Triton launch parameters.
gpu_dkv_max_queries   the most (query, slot) entries one dK / dV program handles; longer per-block
                      query lists are split into pieces summed afterwards (no straggler programs).
tpu_row_multiple      the G query heads are padded to a multiple of this on TPU (sublane tile).
tpu_min_block_size    the key block must be a multiple of this on TPU (second-minor tile of bf16).
tpu_max_prefetch      the most int32 scalars per prefetched table in one TPU call (SMEM is small; up
                      to 5 tables of 32 KiB each with 8192); longer inputs are split into several
                      calls over query / entry chunks. Not yet checked on TPU hardware.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SparseAttentionTuning:
    xla_tile_entries: int = 256
    gpu_min_rows: int = 16
    gpu_max_head_dim: int = 256
    gpu_num_warps: int = 4
    gpu_num_stages: int = 2
    gpu_dkv_max_queries: int = 512
    tpu_row_multiple: int = 8
    tpu_min_block_size: int = 16
    tpu_max_prefetch: int = 8192

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"SparseAttentionTuning.{field.name}={value!r}: must be a "
                                 "positive int")


TUNING = SparseAttentionTuning()


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()
