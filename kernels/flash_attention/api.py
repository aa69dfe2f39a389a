"""Public flash_attention: validation, implementation choice, custom_vjp wiring, cost helpers.

Letters: B batch, T queries, S keys, Hq query heads, Hkv KV heads (Hq = G * Hkv; query heads
[g*G, (g+1)*G) use KV head g), Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from aiinfra_jax.kernels import _dispatch, _sharding
from aiinfra_jax.kernels.flash_attention import xla as xla_impl
from aiinfra_jax.kernels.flash_attention.mask import AttentionMask, visible_counts
from aiinfra_jax.kernels.flash_attention.tuning import BlockSizes, default_block_sizes

_OP = "flash_attention"
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable; the custom_vjp's non-differentiable config).

    selection: implementation per lowering platform (kernels/_dispatch.py); block_sizes: the
    caller's tiles, or None for each implementation's defaults; shard: how the Pallas kernels are
    split over the context mesh (kernels/_sharding.py), None to call them directly.
    """

    selection: _dispatch.Selection
    mask: AttentionMask
    scale: float
    block_sizes: BlockSizes | None
    interpret: bool
    shard: _sharding.ShardPlan | None = None

    def tiles(self, implementation: str) -> BlockSizes:
        return self.block_sizes or default_block_sizes(implementation, self.mask.window)


def _module(implementation: str):
    if implementation == "pallas_gpu":
        from aiinfra_jax.kernels.flash_attention import pallas_gpu
        return pallas_gpu
    if implementation == "pallas_tpu":
        from aiinfra_jax.kernels.flash_attention import pallas_tpu
        return pallas_tpu
    return xla_impl


# Kernel layouts under a mesh: batch over the batch axes, heads over "tensor"; the rest whole.
_BTHD = ("batch", None, "heads", None)
_BTH = ("batch", None, "heads")
_BT = ("batch", None)


def _fwd_specs(sh):
    x, seg = sh.spec(*_BTHD), sh.spec(*_BT)
    return (x, x, x, seg, seg, sh.spec("batch")), (x, sh.spec(*_BTH))


def _bwd_specs(sh):
    x, seg, rows = sh.spec(*_BTHD), sh.spec(*_BT), sh.spec(*_BTH)
    return (x, x, x, seg, seg, sh.spec("batch"), rows, rows, x), (x, x, x)


def _fwd_impl(st: _Static, implementation: str, q, k, v, q_seg, kv_seg, off):
    bs = st.tiles(implementation)
    if implementation == "xla":
        return xla_impl.flash_attention_fwd(q, k, v, q_seg, kv_seg, off, mask=st.mask,
                                            scale=st.scale, block_q=bs.block_q,
                                            block_k=bs.block_k)
    kernel = functools.partial(_module(implementation).flash_attention_fwd, mask=st.mask,
                               scale=st.scale, block_q=bs.block_q, block_k=bs.block_k,
                               interpret=st.interpret)
    return _sharding.run(st.shard, kernel, (q, k, v, q_seg, kv_seg, off), _fwd_specs)


def _bwd_impl(st: _Static, implementation: str, q, k, v, q_seg, kv_seg, off, lse, delta, do):
    bs = st.tiles(implementation)
    if implementation == "xla":
        return xla_impl.flash_attention_bwd(q, k, v, q_seg, kv_seg, off, lse, delta, do,
                                            mask=st.mask, scale=st.scale,
                                            block_sizes_dq=bs.dq, block_sizes_dkv=bs.dkv)
    kernel = functools.partial(_module(implementation).flash_attention_bwd, mask=st.mask,
                               scale=st.scale, block_sizes_dq=bs.dq, block_sizes_dkv=bs.dkv,
                               interpret=st.interpret)
    return _sharding.run(st.shard, kernel, (q, k, v, q_seg, kv_seg, off, lse, delta, do),
                         _bwd_specs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, q, k, v, q_seg, kv_seg, off):
    return _dispatch.run(st.selection, functools.partial(_fwd_impl, st),
                         q, k, v, q_seg, kv_seg, off)


def _attention_fwd(st: _Static, q, k, v, q_seg, kv_seg, off):
    o, lse = _dispatch.run(st.selection, functools.partial(_fwd_impl, st),
                           q, k, v, q_seg, kv_seg, off)
    return (o, lse), (q, k, v, q_seg, kv_seg, off, o, lse)


def _attention_bwd(st: _Static, res, cotangents):
    q, k, v, q_seg, kv_seg, off, o, lse = res
    do, dlse = cotangents
    # d lse / d s = p, so an lse cotangent enters as delta - dlse (ds = p * (dp - delta + dlse)).
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = delta - jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)
    do = do.astype(q.dtype)
    dq, dk, dv = _dispatch.run(st.selection, functools.partial(_bwd_impl, st),
                               q, k, v, q_seg, kv_seg, off, lse, delta, do)
    return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- validation

def _shape(x, name: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{_OP}: {name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _check_int_array(x, name: str, shape: tuple[int, ...]):
    got = _shape(x, name)
    if got != shape:
        raise ValueError(f"{_OP}: {name} must have shape {list(shape)}, got {list(got)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{_OP}: {name} must be an integer array, got dtype {x.dtype}")


def _validate(q, k, v, mask, segment_ids, q_offset, scale, block_sizes):
    qs, ks, vs = _shape(q, "q"), _shape(k, "k"), _shape(v, "v")
    for name, s, layout in (("q", qs, "[B,T,Hq,Dk]"), ("k", ks, "[B,S,Hkv,Dk]"),
                            ("v", vs, "[B,S,Hkv,Dv]")):
        if len(s) != 4:
            raise ValueError(f"{_OP}: {name} must have rank 4 {layout}, got shape {list(s)}")
    b, t, hq, dk = qs
    if ks[0] != b or vs[0] != b:
        raise ValueError(f"{_OP}: k and v batch sizes {ks[0]}, {vs[0]} must equal q's batch {b}")
    if vs[1] != ks[1]:
        raise ValueError(f"{_OP}: v length {vs[1]} must equal k length {ks[1]} (S)")
    if vs[2] != ks[2]:
        raise ValueError(f"{_OP}: v heads {vs[2]} must equal k heads {ks[2]} (Hkv)")
    if ks[3] != dk:
        raise ValueError(f"{_OP}: k head dim {ks[3]} must equal q head dim {dk} (Dk)")
    if min(qs + ks + vs) <= 0:
        raise ValueError(f"{_OP}: q, k, v must have non-empty dims, got q {list(qs)}, "
                         f"k {list(ks)}, v {list(vs)}")
    if hq % ks[2]:
        raise ValueError(f"{_OP}: q heads Hq={hq} must be a multiple of k/v heads Hkv={ks[2]} "
                         f"(grouped-query attention)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype).name not in _FLOAT_DTYPES:
            raise ValueError(f"{_OP}: {name}.dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{_OP}: q, k, v dtypes must match, got q {q.dtype}, k {k.dtype}, "
                         f"v {v.dtype}")
    if not isinstance(mask, AttentionMask):
        raise ValueError(f"{_OP}: mask must be an AttentionMask, got {type(mask).__name__}")
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(f"{_OP}: segment_ids must be an array [B,T] or a pair "
                                 f"(q_segment_ids [B,T], kv_segment_ids [B,S])")
            _check_int_array(segment_ids[0], "segment_ids[0] (q_segment_ids)", (b, t))
            _check_int_array(segment_ids[1], "segment_ids[1] (kv_segment_ids)", (b, ks[1]))
        else:
            if ks[1] != t:
                raise ValueError(f"{_OP}: segment_ids as one array needs S == T (got T={t}, "
                                 f"S={ks[1]}); pass a pair (q_segment_ids, kv_segment_ids)")
            _check_int_array(segment_ids, "segment_ids", (b, t))
    if q_offset is not None:
        _check_int_array(q_offset, "q_offset", (b,))
    if scale is not None and (not isinstance(scale, (int, float, np.floating))
                              or not np.isfinite(scale) or scale <= 0):
        raise ValueError(f"{_OP}: scale must be a positive finite Python float, got {scale!r}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"{_OP}: block_sizes must be a tuning.BlockSizes, got "
                         f"{type(block_sizes).__name__}")


def supports(implementation: str, q_shape, v_shape) -> str | None:
    """None if `implementation` takes these shapes, else the reason it cannot."""
    if implementation == "pallas_gpu" and max(q_shape[-1], v_shape[-1]) > 256:
        return f"head dims {q_shape[-1]}/{v_shape[-1]} > 256 do not fit the Triton kernel"
    return None


# ----------------------------------------------------------------------------- public API

def flash_attention(q, k, v, *, mask: AttentionMask = AttentionMask(), segment_ids=None,
                    q_offset=None, scale: float | None = None, return_lse: bool = False,
                    implementation: str | None = None, interpret: bool = False,
                    block_sizes: BlockSizes | None = None):
    """Masked multi-head attention with an online softmax (never a [T, S] matrix).

    Args:
      q: [B, T, Hq, Dk]; k: [B, S, Hkv, Dk]; v: [B, S, Hkv, Dv]; Hq = G * Hkv (query heads
        [g*G, (g+1)*G) use KV head g). float32, bfloat16 or float16, all the same dtype.
      mask: AttentionMask. Query t sits at position p = t + q_offset[b]. causal: key s visible iff
        s <= p. window=w: exactly w keys including the query itself, p - w < s <= p.
        compressed=(l, d): key i is a compressed token covering raw positions [i*d, i*d + l),
        visible iff i*d + l - 1 <= p. The conditions combine with AND.
      segment_ids: None, int [B, T] (only when S == T), or a pair (q_segment_ids [B, T],
        kv_segment_ids [B, S]); a key is visible only where the ids are equal.
      q_offset: int [B] or None (= 0): position of query row 0 (decode, chunked prefill).
      scale: logit scale, default Dk ** -0.5.
      return_lse: also return lse [B, T, Hq] float32 (natural log).
      implementation: None (best for the platform the call is lowered for, see kernels._dispatch),
        "xla", "pallas_gpu", "pallas_tpu". Under a mesh (jax.set_mesh) the Pallas kernels run in a
        shard_map: batch split over "data"/"fsdp"/"expert", KV heads over "tensor" (see
        kernels._sharding); a "context" axis > 1 is refused.
      interpret: run a Pallas kernel in interpret mode (any backend).
      block_sizes: tile lengths (tuning.BlockSizes); default per implementation.

    Returns o [B, T, Hq, Dv] in q's dtype, or (o, lse). A query with no visible key gets o = 0 and
    lse = -inf, with zero (never NaN) gradients. Differentiable in q, k, v (and lse's cotangent).
    """
    _validate(q, k, v, mask, segment_ids, q_offset, scale, block_sizes)
    selection = _dispatch.select(_OP, implementation, interpret=interpret,
                                 unsupported=lambda impl: supports(impl, q.shape, v.shape))
    return _call(q, k, v, selection, mask=mask, segment_ids=segment_ids, q_offset=q_offset,
                 scale=scale, return_lse=return_lse, interpret=interpret,
                 block_sizes=block_sizes)


def flash_attention_unchecked(q, k, v, *, mask: AttentionMask, segment_ids=None, q_offset=None,
                              scale: float | None = None, return_lse: bool = False,
                              implementation: str, interpret: bool = False,
                              block_sizes: BlockSizes | None = None):
    """Internal entry: runs `implementation` on every platform without the platform check or
    input validation (the public function is the one to use; it lowers for any platform)."""
    _dispatch.check_name(_OP, implementation)
    return _call(q, k, v, _dispatch.Selection.only(implementation), mask=mask,
                 segment_ids=segment_ids, q_offset=q_offset, scale=scale, return_lse=return_lse,
                 interpret=interpret, block_sizes=block_sizes)


def _call(q, k, v, selection, *, mask, segment_ids, q_offset, scale, return_lse, interpret,
          block_sizes):
    b, t = q.shape[:2]
    if segment_ids is None:
        q_seg = kv_seg = None
    elif isinstance(segment_ids, (tuple, list)):
        q_seg, kv_seg = (jnp.asarray(x, jnp.int32) for x in segment_ids)
    else:
        q_seg = kv_seg = jnp.asarray(segment_ids, jnp.int32)
    off = (jnp.zeros((b,), jnp.int32) if q_offset is None
           else jnp.asarray(q_offset, jnp.int32))
    st = _Static(selection=selection, mask=mask,
                 scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
                 block_sizes=block_sizes, interpret=bool(interpret),
                 shard=_dispatch.shard_plan(_OP, selection, batch=b, heads=k.shape[2]))
    o, lse = _attention(st, q, k, v, q_seg, kv_seg, off)
    return (o, lse) if return_lse else o


# ----------------------------------------------------------------------------- cost helpers

def visible_pairs(q_len: int, kv_len: int, mask: AttentionMask = AttentionMask(),
                  q_offset: int = 0) -> int:
    """Exact number of visible (query, key) pairs per batch row and head (no segments)."""
    return int(visible_counts(mask, q_len, kv_len, q_offset).sum())


def flash_attention_flops(batch: int, q_len: int, kv_len: int, num_q_heads: int, head_dim_qk: int,
                          head_dim_v: int | None = None, mask: AttentionMask = AttentionMask(),
                          q_offset: int = 0, backward: bool = False) -> int:
    """Matmul FLOPs counting only visible pairs (tile-skipping kernels do a little more).

    Forward: QK^T and PV = 2 * pairs * (Dk + Dv). Backward: QK^T recompute, dP = dO V^T, dV, dQ,
    dK = 2 * pairs * (3 Dk + 2 Dv).
    """
    dv = head_dim_qk if head_dim_v is None else head_dim_v
    pairs = visible_pairs(q_len, kv_len, mask, q_offset) * batch * num_q_heads
    per_pair = (3 * head_dim_qk + 2 * dv) if backward else (head_dim_qk + dv)
    return 2 * pairs * per_pair


def flash_attention_bytes(batch: int, q_len: int, kv_len: int, num_q_heads: int,
                          num_kv_heads: int, head_dim_qk: int, head_dim_v: int | None = None,
                          dtype="bfloat16", backward: bool = False) -> int:
    """Minimum HBM traffic: each input read once and each output written once (lse in f32)."""
    dv = head_dim_qk if head_dim_v is None else head_dim_v
    it = jnp.dtype(dtype).itemsize
    q = batch * q_len * num_q_heads * head_dim_qk
    kv = batch * kv_len * num_kv_heads * (head_dim_qk + dv)
    o = batch * q_len * num_q_heads * dv
    lse = batch * q_len * num_q_heads * 4
    if not backward:
        return (q + kv + o) * it + lse
    # read q, k, v, o, do, lse; write dq, dk, dv
    return (q + kv + 2 * o) * it + lse + (q + kv) * it
