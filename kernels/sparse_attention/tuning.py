"""Block sizes and limits per backend for sparse_attention (one small table; tune by benchmark).

xla_tile_entries      the most (query row, selected block) entries per tile of the XLA path: one
                      tile is one [entries * G, Dk] x [Dk, block_size] matmul against a single key
                      block (each block's entry list is padded to a multiple of the tile, so larger
                      tiles waste up to NB * (entries - 1) padded entries; smaller ones make
                      thinner matmuls and more row gathers).
xla_tiles_per_block   below that cap the tile is sized per shape (xla_tile_size): about a key
                      block's average entry list (T * n / NB) divided by this, as a power of two,
                      at least xla_min_tile_entries.
xla_min_tile_entries  the smallest per-shape tile (thinner matmuls cost more than padding saves).
xla_step_scores       each loop step of the XLA path takes as many tiles as keep its score block
                      (tiles * entries * G * block_size float32) within this: one tile a step left
                      the loop's per-step overhead in charge wherever tiles are small.
                      Measured 2026-12-06 on the 2-core CPU (eval/BENCHMARKS.md "sparse_attention
                      XLA path: several tiles a step"), forward / forward+backward, against the
                      earlier fixed 256-entry tiles one a step: the NSA tiny preset's prefill
                      selection (B 8, T 2K, 2 KV heads x G 2, Dk 64, P 32, n 4: tiles of 32)
                      261 / 602 -> 125 / 244 ms; NSA at 8K (G 16, Dk 32, P 64, n 16: tiles of 128)
                      497 / 1265 -> 439 / 1070 ms. A step of 2^20 scores is faster forward at 8K
                      (380 ms) and slower at the preset's shape (130 / 263 ms); 2^18 no faster
                      at either (127 / 252 ms at the preset's).
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
    xla_tile_entries: int = 128
    xla_tiles_per_block: int = 4
    xla_min_tile_entries: int = 32
    xla_step_scores: int = 1 << 19
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


def xla_tile_size(tuning: SparseAttentionTuning, T: int, n: int, nb: int) -> int:
    """Entries per tile of the XLA path for T query tokens, n block slots and nb key blocks (the
    fields above): a power of two near the average entries per key block over
    xla_tiles_per_block, within [xla_min_tile_entries, xla_tile_entries] (the cap wins)."""
    share = -(-T * n // (nb * tuning.xla_tiles_per_block))
    return min(tuning.xla_tile_entries, max(tuning.xla_min_tile_entries, next_power_of_2(share)))
