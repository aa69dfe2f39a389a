"""Attention of a few new queries over a head-major key/value cache: the prefill-chunk and decode
form of attention that every softmax mixer's cache uses.

Letters: B batch, T new queries, S cache slots, H query heads, K KV heads (H = G * K), D head dim.

The cache is head-major, k and v [B,K,S,D]: for each (row, KV head) its keys and values are
contiguous [S,D] matrices, so attention is two batched matmuls, [G*T,D] x [S,D]^T and
[G*T,S] x [S,D], that read the cache once. In the sequence-major layout [B,S,K,D] (what
jax.nn.dot_product_attention and `flash_attention` take) XLA first copies K and V into matmul
order, on every decode step: for the tiny dense preset at batch 8 and 1K context that copy was
1.6x the bytes of the whole step on this CPU (198 MB -> 126 MB per step, `cost_analysis`).
MaxText makes the same choice configurable ("cache axis order"); here head-major is the one
layout, and the keys may also come transposed, k [B,K,D,S] (keys_transposed=True; the dense and
MSA caches store them so). Then the logits are [G*T,D] x [D,S], the plain product, where [S,D]^T
made XLA:CPU's library dot 3-4x slower for the few rows of a decode step: 0.51 -> 0.13 ms for one
layer of the tiny dense preset at batch 8 and 1088 slots (the logits alone, 8 x 2 KV heads of 64,
the cache hot in L3, quiet 2-core VM, 2026-12-04), 1.3x at 64K slots for one row; at a prefill
chunk's G*T = 1024 rows the two forms cost the same. Inside a whole decode step, whose caches do
not fit in the L3, the logits of a layer went from 0.74-1.16 to 0.44-0.49 ms (eval/BENCHMARKS.md
"Generation throughput").

Why not flash_attention or jax.nn.dot_product_attention: with T = 1 (decode) the whole row of
logits is S floats per head, so a single pass needs no online softmax; the flash kernel's tiling
pads the one query to a tile of 8 and loops over key tiles, and both take sequence-major keys.
A caller that wants cuDNN for a long prefill chunk transposes the cache once and calls
jax.nn.dot_product_attention itself (models/attention/dense.py does): the copy is shared by T
queries there. XLA only: on an accelerator this is a memory-bound pair of matmuls that XLA fuses
well; a Pallas decode kernel would pay off for paged or quantized caches, which we do not have.

Numerics: logits and softmax in float32 (as jax.nn.dot_product_attention's XLA path), the
probabilities cast to the compute dtype (q's) for the second matmul, which accumulates in
float32. A row with no visible slot returns o = 0 and lse = -inf. Differentiable by autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, *,
                     scale: float | None = None, return_lse: bool = False,
                     keys_transposed: bool = False, return_group_probs: bool = False):
    """q [B,T,H,D] over the cache k, v [B,K,S,D] (k [B,K,D,S] with keys_transposed) where
    visible (bool, [B,T,S], or [B,K,T,S] when the KV heads see different slots) is True.

    Returns o [B,T,H,D] in q's dtype; with return_lse also lse [B,T,H] float32 (the log-sum-exp
    of each query's scaled logits over its visible slots; -inf where none is visible); with
    return_group_probs also the attention probabilities summed over each KV head's G query heads,
    [B,T,K,S] float32 without gradient (0 where not visible): what NSA's block selection ranks,
    so a decode step need not compute the compressed logits twice. scale: None = D^-1/2.
    """
    batch, seq, heads, dim = q.shape
    k_bksd = k.shape if k.ndim != 4 or not keys_transposed else (*k.shape[:2], k.shape[3],
                                                                 k.shape[2])
    if (len(k_bksd) != 4 or k_bksd[0] != batch or k_bksd[3] != dim or v.ndim != 4
            or v.shape[:3] != k_bksd[:3]):
        want = "k [B,K,D,S] and v [B,K,S,D]" if keys_transposed else "head-major [B,K,S,D]"
        raise ValueError(f"cached_attention: k and v must be {want} matching q "
                         f"[B,T,H,D]={q.shape}; got k {k.shape}, v {v.shape}")
    kv_heads, slots = k_bksd[1], k_bksd[2]
    if heads % kv_heads:
        raise ValueError(f"cached_attention: {heads} query heads is not a multiple of "
                         f"{kv_heads} KV heads")
    if visible.shape not in ((batch, seq, slots), (batch, kv_heads, seq, slots)):
        raise ValueError(f"cached_attention: visible must be [B,T,S]={(batch, seq, slots)} or "
                         f"[B,K,T,S]={(batch, kv_heads, seq, slots)}, got {visible.shape}")
    scale = dim ** -0.5 if scale is None else scale
    groups = heads // kv_heads
    dt = q.dtype
    # [B,T,K,G,D] -> [B,K,G*T,D]: a KV head's queries as the rows of one matrix
    qm = q.reshape(batch, seq, kv_heads, groups, dim).transpose(0, 2, 3, 1, 4)
    qm = qm.reshape(batch, kv_heads, groups * seq, dim)
    logits = jnp.einsum("bkqd,bkds->bkqs" if keys_transposed else "bkqd,bksd->bkqs", qm,
                        k.astype(dt), preferred_element_type=jnp.float32) * scale
    logits = logits.reshape(batch, kv_heads, groups, seq, slots)
    vis = visible[:, None, None] if visible.ndim == 3 else visible[:, :, None]
    # masked logits: finite, so fully masked rows stay NaN-free in value and gradient
    logits = jnp.where(vis, logits, jnp.finfo(jnp.float32).min)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.where(vis, jnp.exp(logits - top), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(total > 0, total, 1.0)
    o = jnp.einsum("bkqs,bksd->bkqd", probs.reshape(batch, kv_heads, groups * seq, slots)
                   .astype(dt), v.astype(dt), preferred_element_type=jnp.float32)
    o = o.reshape(batch, kv_heads, groups, seq, -1).transpose(0, 3, 1, 2, 4)
    o = o.reshape(batch, seq, heads, -1).astype(dt)
    out = [o]
    if return_lse:
        lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + top, -jnp.inf)
        out.append(lse[..., 0].transpose(0, 3, 1, 2).reshape(batch, seq, heads))
    if return_group_probs:
        out.append(jax.lax.stop_gradient(probs.sum(axis=2)).transpose(0, 2, 1, 3))
    return out[0] if len(out) == 1 else tuple(out)
