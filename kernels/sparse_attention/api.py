"""Public block-gather sparse attention (the selection branch of Native Sparse Attention).

Letters: B batch, T query tokens, S key tokens, Hq query heads, Hkv KV heads, G = Hq // Hkv,
Dk / Dv head dims, n block slots per (query, KV head), P = block_size, NB = ceil(S / P).

api.py validates inputs, turns causality / q_offset into one per-query `limit` (last visible key
position), normalizes the block indices (duplicates, out-of-range entries and blocks that start past
`limit` become -1), picks the implementation and wires the custom VJP shared by every
implementation:
  impl.forward(q, k, v, idx, limit, q_seg, kv_seg, *, block_size, scale, ...) -> (o, lse)
  impl.backward(q, k, v, idx, limit, q_seg, kv_seg, o, lse, do, delta, ...) -> (dq, dk, dv)
with delta = sum(do * o, -1) - dlse (so a cotangent on the returned lse is honoured too).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _dispatch, _sharding
from . import pallas_gpu, pallas_tpu, xla

OP = "sparse_attention"
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class _Static:
    selection: _dispatch.Selection      # implementation per lowering platform
    block_size: int
    scale: float
    interpret: bool
    shard: _sharding.ShardPlan | None   # the Pallas kernels' split over the mesh (None: direct)


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_indices: jax.Array, *,
                     block_size: int, scale: float | None = None, causal: bool = True,
                     segment_ids=None, q_offset: jax.Array | None = None,
                     return_lse: bool = False, implementation: str | None = None,
                     interpret: bool = False):
    """Attention of each query over the key blocks it selected (NSA selection branch).

    Args:
      q: [B, T, Hq, Dk]; k: [B, S, Hkv, Dk]; v: [B, S, Hkv, Dv]; Hq = G * Hkv, and query heads
        [g*G, (g+1)*G) use KV head g (the grouping of jax.nn.dot_product_attention). float32,
        bfloat16 or float16, all three the same dtype.
      block_indices: int32 [B, T, Hkv, n]: key blocks (keys [i*P, (i+1)*P) intersected with [0, S))
        each query token attends to with each KV head; -1 marks an empty slot. Same layout as
        fla-org/native-sparse-attention's `parallel_nsa` selection indices. A block listed twice
        counts once (dedupe semantics: the visible keys are the union of the listed blocks). With
        concrete indices an entry outside [-1, NB) raises; under tracing it is ignored like -1.
      block_size: P, keys per block (> 0).
      scale: logit scale; default Dk ** -0.5.
      causal: key s is visible to query t only if s <= t + q_offset[b].
      segment_ids: None; int32 [B, T] used for both sides (only when S == T); or a pair
        (q_segment_ids [B, T], kv_segment_ids [B, S]). A key is visible only when its segment id
        equals the query's.
      q_offset: int32 [B] position of query 0 in the key sequence (None = 0); lets decode (T = 1 at
        position p) use the op.
      return_lse: also return the float32 log-sum-exp of the logits [B, T, Hq].
      implementation: None (best for the platform the call is lowered for, falling back to "xla"
        when the kernel cannot take the shapes), "xla", "pallas_gpu" or "pallas_tpu" (explicit
        choices raise when impossible; see kernels._dispatch). Under a mesh (jax.set_mesh) the
        Pallas kernels run in a shard_map: batch over "data"/"fsdp"/"expert", KV heads over
        "tensor" (kernels._sharding); a "context" axis > 1 is refused.
      interpret: run the Pallas kernel in interpret mode (any backend).

    Returns:
      o [B, T, Hq, Dv] in q's dtype, or (o, lse) when return_lse. A query with no visible key gets
      o = 0 and lse = -inf; its gradients are zero (no NaN anywhere).

    Differentiable in q, k, v (custom VJP saving o and lse; no gradient to the indices, segment ids
    or offsets).
    """
    _dispatch.check_name(OP, implementation)
    q_seg, kv_seg = _validate(q, k, v, block_indices, block_size, scale, segment_ids, q_offset)
    G, Dk, Dv = q.shape[2] // k.shape[2], q.shape[3], v.shape[3]

    def unsupported(impl):
        module = pallas_gpu if impl == "pallas_gpu" else pallas_tpu
        return module.unsupported_reason(G=G, Dk=Dk, Dv=Dv, block_size=block_size, dtype=q.dtype)

    selection = _dispatch.select(OP, implementation, interpret=interpret, unsupported=unsupported)
    B, T, Hq, Dk = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = float(Dk ** -0.5 if scale is None else scale)
    limit = query_limits(B, T, S, causal=causal, q_offset=q_offset)
    idx = normalize_indices(block_indices, S=S, block_size=block_size)
    # A block that starts past the query's last visible key is empty: drop it here so that no
    # implementation loads it (and the dK / dV query lists get shorter).
    idx = jnp.where(idx * block_size <= limit[:, :, None, None], idx, -1)
    static = _Static(selection, int(block_size), scale, bool(interpret),
                     _dispatch.shard_plan(OP, selection, batch=B, heads=Hkv))
    o, lse = _attend(q, k, v, idx, limit, q_seg, kv_seg, static)
    return (o, lse) if return_lse else o


# ----------------------------------------------------------------------------------------------
# Custom VJP shared by every implementation.

_MODULES = {"xla": xla, "pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}
# Kernel layouts under a mesh: batch over the batch axes, KV heads over "tensor"; the rest whole.
_BTHD = ("batch", None, "heads", None)


def _fwd_specs(sh):
    x, rows = sh.spec(*_BTHD), sh.spec("batch", None)
    return (x, x, x, x, rows, rows, rows), (x, sh.spec("batch", None, "heads"))


def _bwd_specs(sh):
    x, rows, lse = sh.spec(*_BTHD), sh.spec("batch", None), sh.spec("batch", None, "heads")
    return (x, x, x, x, rows, rows, rows, x, lse, x, lse), (x, x, x)


def _pad_keys(k, v, kv_seg, block_size):
    """The kernels read whole blocks: keys padded up to NB * P (padding is never visible, since
    limit <= S - 1)."""
    S = k.shape[1]
    pad = -(-S // block_size) * block_size - S
    if pad:
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
        if kv_seg is not None:
            kv_seg = jnp.pad(kv_seg, ((0, 0), (0, pad)), constant_values=-1)
    return k, v, kv_seg


def _forward(static: _Static, implementation, q, k, v, idx, limit, q_seg, kv_seg):
    kw = dict(block_size=static.block_size, scale=static.scale)
    if implementation == "xla":
        return xla.forward(q, k, v, idx, limit, q_seg, kv_seg, **kw)
    kernel = functools.partial(_MODULES[implementation].forward, interpret=static.interpret, **kw)
    k, v, kv_seg = _pad_keys(k, v, kv_seg, static.block_size)
    return _sharding.run(static.shard, kernel, (q, k, v, idx, limit, q_seg, kv_seg), _fwd_specs)


def _backward(static: _Static, implementation, q, k, v, idx, limit, q_seg, kv_seg, o, lse, do,
              delta):
    kw = dict(block_size=static.block_size, scale=static.scale)
    if implementation == "xla":
        return xla.backward(q, k, v, idx, limit, q_seg, kv_seg, o, lse, do, delta, **kw)
    kernel = functools.partial(_MODULES[implementation].backward, interpret=static.interpret,
                               **kw)
    S = k.shape[1]
    kp, vp, kv_seg = _pad_keys(k, v, kv_seg, static.block_size)
    dq, dk, dv = _sharding.run(static.shard, kernel,
                               (q, kp, vp, idx, limit, q_seg, kv_seg, o, lse, do, delta),
                               _bwd_specs)
    return dq, dk[:, :S], dv[:, :S]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attend(q, k, v, idx, limit, q_seg, kv_seg, static: _Static):
    return _dispatch.run(static.selection, functools.partial(_forward, static),
                         q, k, v, idx, limit, q_seg, kv_seg)


def _attend_fwd(q, k, v, idx, limit, q_seg, kv_seg, static):
    o, lse = _dispatch.run(static.selection, functools.partial(_forward, static),
                           q, k, v, idx, limit, q_seg, kv_seg)
    return (o, lse), (q, k, v, idx, limit, q_seg, kv_seg, o, lse)


def _attend_bwd(static, residuals, cotangents):
    q, k, v, idx, limit, q_seg, kv_seg, o, lse = residuals
    do, dlse = cotangents
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    delta = delta - jnp.where(jnp.isfinite(lse), dlse, 0.0)
    dq, dk, dv = _dispatch.run(static.selection, functools.partial(_backward, static),
                               q, k, v, idx, limit, q_seg, kv_seg, o, lse, do.astype(q.dtype),
                               delta)
    return dq, dk, dv, None, None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


# ----------------------------------------------------------------------------------------------
# Normalization (plain XLA, before any kernel).

def normalize_indices(block_indices: jax.Array, *, S: int, block_size: int) -> jax.Array:
    """int32 [B,T,Hkv,n] with every entry a unique block id in [0, NB) or -1.

    Repeated ids keep their first slot (later repeats become -1); ids outside [0, NB) become -1.
    """
    nb = -(-S // block_size)
    idx = block_indices.astype(jnp.int32)
    idx = jnp.where((idx >= 0) & (idx < nb), idx, -1)
    n = idx.shape[-1]
    if n > 1:
        same = idx[..., :, None] == idx[..., None, :]                         # [..., n, n]
        earlier = jnp.tril(jnp.ones((n, n), bool), k=-1)                       # j' < j
        dup = jnp.any(same & earlier, axis=-1)
        idx = jnp.where(dup, -1, idx)
    return idx


def query_limits(B: int, T: int, S: int, *, causal: bool, q_offset=None) -> jax.Array:
    """int32 [B, T]: the last key position each query may see (keys past S never)."""
    if not causal:
        return jnp.full((B, T), S - 1, jnp.int32)
    off = jnp.zeros((B,), jnp.int32) if q_offset is None else q_offset.astype(jnp.int32)
    return jnp.minimum(jnp.arange(T, dtype=jnp.int32)[None, :] + off[:, None], S - 1)


# ----------------------------------------------------------------------------------------------
# Validation.

def _shape(x, name):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{OP}: {name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _is_int(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.integer)


def _validate(q, k, v, block_indices, block_size, scale, segment_ids, q_offset):
    """Raises ValueError naming the bad argument; returns (q_segment_ids, kv_segment_ids)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("block_indices", block_indices)):
        if len(_shape(x, name)) != 4:
            raise ValueError(f"{OP}: {name} must have rank 4, got shape {tuple(x.shape)}")
    B, T, Hq, Dk = q.shape
    Bk, S, Hkv, Dkk = k.shape
    if Bk != B or v.shape[0] != B or block_indices.shape[0] != B:
        raise ValueError(f"{OP}: batch sizes differ: q {B}, k {Bk}, v {v.shape[0]}, "
                         f"block_indices {block_indices.shape[0]}")
    if v.shape[1] != S:
        raise ValueError(f"{OP}: k and v sequence lengths differ: k S={S}, v S={v.shape[1]}")
    if v.shape[2] != Hkv:
        raise ValueError(f"{OP}: k and v head counts differ: k Hkv={Hkv}, v Hkv={v.shape[2]}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{OP}: q heads Hq={Hq} must be a positive multiple of k/v heads "
                         f"Hkv={Hkv}")
    if Dkk != Dk:
        raise ValueError(f"{OP}: q head dim Dk={Dk} differs from k head dim {Dkk}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype).name not in _DTYPES:
            raise ValueError(f"{OP}: {name} dtype {jnp.dtype(x.dtype).name} is not supported; "
                             f"use one of {_DTYPES}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{OP}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); "
                         "cast them to one dtype")
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) \
            or block_size <= 0:
        raise ValueError(f"{OP}: block_size must be a positive int, got {block_size!r}")
    if scale is not None and not isinstance(scale, (int, float, np.floating, np.integer)):
        raise ValueError(f"{OP}: scale must be a Python float or None, got {type(scale).__name__}")
    bi = block_indices.shape
    if bi[1] != T or bi[2] != Hkv or bi[3] < 1:
        raise ValueError(f"{OP}: block_indices must have shape [B, T, Hkv, n] = "
                         f"[{B}, {T}, {Hkv}, n>=1], got {bi}")
    if jnp.dtype(block_indices.dtype) != jnp.int32:
        raise ValueError(f"{OP}: block_indices must be int32, got {block_indices.dtype}")
    nb = -(-S // block_size)
    try:
        concrete = np.asarray(block_indices)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        concrete = None
    if concrete is not None and concrete.size:
        lo, hi = int(concrete.min()), int(concrete.max())
        if lo < -1 or hi >= nb:
            raise ValueError(f"{OP}: block_indices must lie in [-1, {nb}) (ceil(S / block_size) "
                             f"= ceil({S} / {block_size})), got values in [{lo}, {hi}]")
    if q_offset is not None:
        if _shape(q_offset, "q_offset") != (B,) or not _is_int(q_offset):
            raise ValueError(f"{OP}: q_offset must be an int32 array of shape [B] = [{B}], got "
                             f"{tuple(q_offset.shape)} {q_offset.dtype}")
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"{OP}: segment_ids as a pair must be (q_segment_ids, "
                             f"kv_segment_ids), got {len(segment_ids)} items")
        q_seg, kv_seg = segment_ids
        expected = ((B, T), (B, S))
    else:
        if S != T:
            raise ValueError(f"{OP}: segment_ids as one [B, T] array needs S == T (got T={T}, "
                             f"S={S}); pass a pair (q_segment_ids, kv_segment_ids)")
        q_seg = kv_seg = segment_ids
        expected = ((B, T), (B, T))
    for name, x, shape in (("q_segment_ids", q_seg, expected[0]),
                           ("kv_segment_ids", kv_seg, expected[1])):
        if _shape(x, f"segment_ids ({name})") != shape or not _is_int(x):
            raise ValueError(f"{OP}: segment_ids ({name}) must be an int32 array of shape "
                             f"{list(shape)}, got {tuple(x.shape)} {x.dtype}")
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Cost model for the benchmarks.

def sparse_attention_flops(B: int, T: int, Hq: int, Dk: int, Dv: int, n: int, block_size: int,
                           backward: bool = False) -> int:
    """Matmul FLOPs with every slot full (K = B*T*Hq*n*P attended keys).

    Forward: Q K^T and P V, 2*K*(Dk + Dv). backward=True gives the backward pass alone: the
    recomputed Q K^T, dO V^T, dS K, dS^T Q and P^T dO, 2*K*(3*Dk + 2*Dv).
    """
    keys = B * T * Hq * n * block_size
    return 2 * keys * (3 * Dk + 2 * Dv) if backward else 2 * keys * (Dk + Dv)


def sparse_attention_bytes(B: int, T: int, Hq: int, Dk: int, Dv: int, n: int, block_size: int,
                           backward: bool = False, *, Hkv: int = 1, itemsize: int = 2) -> int:
    """HBM bytes when each selected block is read once per (query token, KV head group).

    Forward: q, o, lse and the indices once plus B*T*Hkv*n*P*(Dk + Dv) gathered key / value
    elements. backward=True gives the backward pass alone: the gathered blocks twice (dQ pass and
    dK / dV pass), q, o, dO, lse, indices read, dq written, and dk / dv written per gathered block
    (the worst case, no reuse between queries).
    """
    gathered = B * T * Hkv * n * block_size * (Dk + Dv) * itemsize
    q_bytes = B * T * Hq * Dk * itemsize
    o_bytes = B * T * Hq * Dv * itemsize
    small = B * T * Hq * 4 + B * T * Hkv * n * 4                      # lse + indices
    if not backward:
        return gathered + q_bytes + o_bytes + small
    return 3 * gathered + 2 * q_bytes + 2 * o_bytes + 2 * small
