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


DEFAULTS = {
    # XLA, measured on a 2-core x86 CPU (eval/BENCHMARKS.md, "Dense flash_attention on the CPU"):
    # 512 queries x 256 keys was the best or within noise of it for head dims 32 and 128 at 4K
    # and 8K, forward and backward (256 x 256 lost up to 1.5x at D = 32; 512 x 512 up to 1.3x).
    # The [R, G*512, 256] float32 score tile is 8 MiB at G*R = 16: inside the L3, not the L2.
    # The GPU and TPU entries are starting points, not yet tuned on hardware.
    "xla": BlockSizes(block_q=512, block_k=256),
    # Triton on H100/H200 with D = 128: 128 packed rows x 64 keys forward, 64 x 64 backward.
    "pallas_gpu": BlockSizes(block_q=128, block_k=64, block_q_dq=64, block_k_dq=64,
                             block_q_dkv=64, block_k_dkv=64),
    # Mosaic: key tiles a multiple of 128 lanes; query tiles a multiple of 8 sublanes.
    "pallas_tpu": BlockSizes(block_q=256, block_k=512, block_q_dq=256, block_k_dq=512,
                             block_q_dkv=256, block_k_dkv=512),
}


def default_block_sizes(implementation: str, window: int | None = None) -> BlockSizes:
    """The tiles a call gets when it passes none. The XLA path with a sliding window takes square
    tiles of about a quarter of the window (64 to 256): a query tile then computes about
    (bq + w) / w times the visible pairs instead of (512 + w) / w. Measured at T = 8K, w = 512,
    G = 16 (eval/BENCHMARKS.md): 128 x 128 forward 96 ms and forward+backward 361 ms, against
    169 and 673 ms with 512 x 256."""
    if implementation == "xla" and window is not None:
        side = min(max(next_pow2(window) // 4, 64), 256)
        return BlockSizes(block_q=side, block_k=side)
    return DEFAULTS[implementation]


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()
