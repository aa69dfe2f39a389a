"""NSA block scores as a Pallas kernel for TPUs (Mosaic lowering).

Letters: B batch, T queries, Sc compressed tokens, Hkv KV heads, G query heads per KV head, Dk head
dim, bq query tile (multiple of 8), nbt selection blocks per output tile (a multiple of 128, or all
nb blocks), NT the token window (a multiple of 128) that can touch an output tile's blocks.

Works on [B, H, T, D] (the wrapper transposes). Grid (B, Hkv, nq, nb / nbt), all parallel. A program
holds the group's G query heads for its query tile and all compressed keys of its KV head in VMEM,
slices the NT keys that can touch its blocks, sums p = exp(q.k * scale - lse) over the G heads and
multiplies by remap weights computed from iotas. Tiles entirely past the tile's last query are
skipped (zeros). The top-k stays in XLA (api.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from aiinfra_jax.kernels.block_selection.reference import (Remap, doc_start_positions,
                                                           token_visible)
from .._util import pad_axis as _pad

_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m




def _kernel(off_ref, q_ref, k_ref, lse_ref, start_ref, out_ref, *, remap: Remap, scale: float,
            bq: int, nbt: int, nt: int, g: int, n_tok: int):
    b, i, jt = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    off = off_ref[b]
    j0 = jt * nbt

    @pl.when(j0 * remap.block_size > i * bq + bq - 1 + off)
    def _skip():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    @pl.when(j0 * remap.block_size <= i * bq + bq - 1 + off)
    def _compute():
        # Start the key window on a 16-row boundary (aligned sublane loads for 32- and 16-bit
        # types); the extra leading tokens get zero remap weight.
        i0 = pl.multiple_of(lax.div(remap.token_window(j0), 16) * 16, 16)
        kw = k_ref[pl.ds(i0, nt), :]
        pos = i * bq + off + lax.broadcasted_iota(jnp.int32, (bq, nt), 0)
        tok = i0 + lax.broadcasted_iota(jnp.int32, (bq, nt), 1)
        vis = token_visible(tok, pos, start_ref[...], n_tok, remap.cmp_block_len,
                            remap.cmp_stride)
        prec = lax.Precision.HIGHEST if kw.dtype == jnp.float32 else None

        def head(h, acc):
            lse = lse_ref[h]                                   # (bq, 1)
            ok = jnp.logical_and(vis, lse > -jnp.inf)
            s = lax.dot_general(q_ref[h], kw, _NT, precision=prec,
                                preferred_element_type=jnp.float32) * scale
            return acc + jnp.where(ok, jnp.exp(jnp.where(ok, s - lse, 0.0)), 0.0)

        p = lax.fori_loop(0, g, head, jnp.zeros((bq, nt), jnp.float32))
        w_tok = i0 + lax.broadcasted_iota(jnp.int32, (nt, nbt), 0)
        w_blk = j0 + lax.broadcasted_iota(jnp.int32, (nt, nbt), 1)
        w = remap.weight(w_tok, w_blk)
        out_ref[...] = lax.dot_general(p, w, _NN, precision=lax.Precision.HIGHEST,
                                       preferred_element_type=jnp.float32)


def block_scores(q, k_cmp, lse_cmp, q_offset, q_segment_ids, *, seq_len: int, remap: Remap,
                 scale: float, block_q: int = 256, block_n: int = 128, interpret: bool = False):
    """Per-group block scores [B, T, Hkv, nb] float32."""
    b, t, hq, dk = q.shape
    sc, hkv = k_cmp.shape[1], k_cmp.shape[2]
    g = hq // hkv
    nb = -(-seq_len // remap.block_size)
    bq = _round_up(min(block_q, max(8, 2048 // g), t), 8)  # G * bq rows of q and lse in VMEM
    nbt = nb if nb <= block_n else _round_up(block_n, 128)
    nt = _round_up(remap.window_len(nbt) + 15, 128)
    tp, nbp = _round_up(t, bq), _round_up(nb, nbt)
    nq, nj = tp // bq, nbp // nbt
    last_first = int(remap.token_window(np.int64((nj - 1) * nbt), xp=np))
    scp = _round_up(max(sc, last_first + nt), 8)

    q_pos = jnp.arange(t, dtype=jnp.int32)[None, :] + q_offset[:, None]
    start = _pad(doc_start_positions(q_segment_ids, q_pos), 1, tp)[:, :, None]   # [B,Tp,1]
    qh = jnp.transpose(_pad(q, 1, tp), (0, 2, 1, 3))                            # [B,Hq,Tp,Dk]
    kh = jnp.transpose(_pad(k_cmp, 1, scp), (0, 2, 1, 3))                       # [B,Hkv,Scp,Dk]
    lse = _pad(jnp.transpose(lse_cmp.astype(jnp.float32), (0, 2, 1)), 2, tp, -jnp.inf)[..., None]
    pairs = b * hq * t * sc // 2
    out = pl.pallas_call(
        functools.partial(_kernel, remap=remap, scale=scale, bq=bq, nbt=nbt, nt=nt, g=g,
                          n_tok=sc),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, nq, nj),
            in_specs=[
                pl.BlockSpec((None, g, bq, dk), lambda bi, h, i, j, o: (bi, h, i, 0)),
                pl.BlockSpec((None, None, scp, dk), lambda bi, h, i, j, o: (bi, h, 0, 0)),
                pl.BlockSpec((None, g, bq, 1), lambda bi, h, i, j, o: (bi, h, i, 0)),
                pl.BlockSpec((None, bq, 1), lambda bi, h, i, j, o: (bi, i, 0)),
            ],
            out_specs=pl.BlockSpec((None, None, bq, nbt), lambda bi, h, i, j, o: (bi, h, i, j)),
        ),
        out_shape=jax.ShapeDtypeStruct((b, hkv, tp, nbp), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "parallel")),
        cost_estimate=pl.CostEstimate(
            flops=int(2 * pairs * dk + 2 * b * hkv * t * nb * nt), transcendentals=int(pairs),
            bytes_accessed=int(q.dtype.itemsize * (q.size + k_cmp.size * nq) + 4 * b * t
                               * (hq + hkv * nb))),
        interpret=interpret,
        name="nsa_block_scores",
    )(q_offset, qh, kh, lse, start)
    return jnp.transpose(out[:, :, :t, :nb], (0, 2, 1, 3))
