"""Tile sizes for the flash_attention backends (defaults per implementation; override per call).

Letters: bq query tile length, bk key tile length. `_dq` / `_dkv` tiles are for the two backward
kernels (dQ: a query tile loops over key tiles; dK/dV: a key tile loops over query tiles).
For "pallas_gpu" the query tile counts packed rows: the G query heads of a KV group share a tile,
so block_q = 128 with G = 16 holds 8 query positions (see pallas_gpu.py).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile lengths; backward tiles default to the forward ones."""

    block_q: int = 128
    block_k: int = 128
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if val is None and f.name not in ("block_q", "block_k"):
                continue
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"BlockSizes.{f.name} must be a positive int, got {val!r}")

    @property
    def dq(self) -> tuple[int, int]:
        return (self.block_q_dq or self.block_q, self.block_k_dq or self.block_k)

    @property
    def dkv(self) -> tuple[int, int]:
        return (self.block_q_dkv or self.block_q, self.block_k_dkv or self.block_k)


# Starting points (not yet tuned on hardware; the benchmark helper should refine them).
DEFAULTS = {
    # XLA: large chunks amortise the loop overhead; a [B, Hkv, G, 512, 512] f32 tile is 16 MiB
    # at G = 16.
    "xla": BlockSizes(block_q=512, block_k=512),
    # Triton on H100/H200 with D = 128: 128 packed rows x 64 keys forward, 64 x 64 backward.
    "pallas_gpu": BlockSizes(block_q=128, block_k=64, block_q_dq=64, block_k_dq=64,
                             block_q_dkv=64, block_k_dkv=64),
    # Mosaic: key tiles a multiple of 128 lanes; query tiles a multiple of 8 sublanes.
    "pallas_tpu": BlockSizes(block_q=256, block_k=512, block_q_dq=256, block_k_dq=512,
                             block_q_dkv=256, block_k_dkv=512),
}


def default_block_sizes(implementation: str) -> BlockSizes:
    return DEFAULTS[implementation]


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()
