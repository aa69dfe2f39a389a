"""NSA block scores as a Pallas kernel for NVIDIA GPUs (Triton lowering).

Letters: B batch, T queries, Sc compressed tokens, Hkv KV heads, G query heads per KV head, Dk head
dim (padded to a power of two >= 16), bq query tile, nbt selection blocks per output tile, NT the
token window (a power of two) that can touch an output tile's blocks.

Grid (B, Hkv, nq, nb / nbt). A program loads the NT compressed keys that can touch its nbt blocks,
recomputes p = exp(q.k * scale - lse) for each of the G query heads of the group (compressed-causal
and document masks), sums them, and multiplies by the remap weights W[token, block] computed from
iotas: scores[bq, nbt] = P[bq, NT] @ W[NT, nbt]. Tiles whose blocks all lie past every query of the
tile are skipped (zeros; select_from_scores never picks them). The top-k stays in XLA (api.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from aiinfra_jax.kernels.block_selection.reference import (Remap, doc_start_positions,
                                                           token_visible)
from .._util import dot_precision, pad_axis as _pad


def _dot(a, b):
    """a @ b accumulated in float32; float32 operands at full precision (not TF32)."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=dot_precision(b.dtype))


def _pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()




def _kernel(off_ref, q_ref, k_ref, lse_ref, start_ref, out_ref, *, remap: Remap, scale: float,
            bq: int, nbt: int, nt: int, g: int, n_tok: int):
    i, jt = pl.program_id(2), pl.program_id(3)
    off = off_ref[...]
    pos = i * bq + off + jnp.arange(bq, dtype=jnp.int32)
    start = start_ref[...]
    j0 = jt * nbt
    i0 = remap.token_window(j0)
    tok = i0 + jnp.arange(nt, dtype=jnp.int32)
    kw = k_ref[pl.ds(i0, nt), :]
    vis = token_visible(tok[None, :], pos[:, None], start[:, None], n_tok, remap.cmp_block_len,
                        remap.cmp_stride)

    def head(h, acc):
        lse = lse_ref[h, :]
        ok = jnp.logical_and(vis, (lse > -jnp.inf)[:, None])
        s = _dot(q_ref[:, h, :], kw.T) * scale
        return acc + jnp.where(ok, jnp.exp(jnp.where(ok, s - lse[:, None], 0.0)), 0.0)

    # Skip the tile when its first block starts after the last query of the tile.
    # (Arithmetic, not jnp.where(cond, g, 0): the Triton lowering of JAX 0.10-0.11 turns that
    # scalar select of two literals into an i1 select, and the loop bound fails to verify.)
    n_heads = g * (j0 * remap.block_size <= i * bq + bq - 1 + off).astype(jnp.int32)
    p = lax.fori_loop(0, n_heads, head, jnp.zeros((bq, nt), jnp.float32))
    w = remap.weight(tok[:, None], (j0 + jnp.arange(nbt, dtype=jnp.int32))[None, :])
    out_ref[...] = _dot(p, w)


def block_scores(q, k_cmp, lse_cmp, q_offset, q_segment_ids, *, seq_len: int, remap: Remap,
                 scale: float, block_q: int = 32, block_n: int = 16, interpret: bool = False,
                 num_warps: int = 4, num_stages: int = 2):
    """Per-group block scores [B, T, Hkv, nb] float32."""
    b, t, hq, dk = q.shape
    sc, hkv = k_cmp.shape[1], k_cmp.shape[2]
    g = hq // hkv
    nb = -(-seq_len // remap.block_size)
    bq = max(16, min(_pow2(block_q), _pow2(t)))
    nbt = max(16, min(_pow2(block_n), _pow2(nb)))
    nt = max(16, _pow2(remap.window_len(nbt)))
    tp, nbp = -(-t // bq) * bq, -(-nb // nbt) * nbt
    nq, nj = tp // bq, nbp // nbt
    last_first = int(remap.token_window(np.int64((nj - 1) * nbt), xp=np))
    scp = max(sc, last_first + nt)
    dkp = max(16, _pow2(dk))

    q_pos = jnp.arange(t, dtype=jnp.int32)[None, :] + q_offset[:, None]
    start = _pad(doc_start_positions(q_segment_ids, q_pos), 1, tp)
    qg = _pad(_pad(q, 3, dkp), 1, tp).reshape(b, tp, hkv, g, dkp)
    kp = _pad(_pad(k_cmp, 3, dkp), 1, scp)
    lse = _pad(jnp.transpose(lse_cmp.astype(jnp.float32), (0, 2, 1)), 2, tp, -jnp.inf)
    lse = lse.reshape(b, hkv, g, tp)
    pairs = b * hq * t * sc // 2
    out = pl.pallas_call(
        functools.partial(_kernel, remap=remap, scale=scale, bq=bq, nbt=nbt, nt=nt, g=g,
                          n_tok=sc),
        grid=(b, hkv, nq, nj),
        in_specs=[
            pl.BlockSpec((None,), lambda bi, h, i, j: (bi,)),
            pl.BlockSpec((None, bq, None, g, dkp), lambda bi, h, i, j: (bi, i, h, 0, 0)),
            pl.BlockSpec((None, scp, None, dkp), lambda bi, h, i, j: (bi, 0, h, 0)),
            pl.BlockSpec((None, None, g, bq), lambda bi, h, i, j: (bi, h, 0, i)),
            pl.BlockSpec((None, bq), lambda bi, h, i, j: (bi, i)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, nbt), lambda bi, h, i, j: (bi, i, h, j)),
        out_shape=jax.ShapeDtypeStruct((b, tp, hkv, nbp), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=pl.CostEstimate(
            flops=int(2 * pairs * dk + 2 * b * hkv * t * nb * nt), transcendentals=int(pairs),
            bytes_accessed=int(q.dtype.itemsize * (q.size + k_cmp.size * nq) + 4 * b * t
                               * (hq + hkv * nb))),
        interpret=interpret,
        name="nsa_block_scores",
    )(q_offset, qg, kp, lse, start)
    return out[:, :t, :, :nb]
