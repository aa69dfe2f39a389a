"""Public depth attention (Attention Residuals, arXiv 2603.15031).

Letters: Q queries, S sources (slots of a fixed-size buffer), B batch, T sequence, N = B*T tokens,
D d_model.

  depth_attention        one fused pass: RMSNorm of the keys, scores against the queries, softmax
                         over depth, weighted sum of the raw sources (Full AttnRes; phase 1 of
                         Block AttnRes, batched over every query that shares the finished blocks).
  merge_partial          phase 2 of Block AttnRes: online-softmax merge of a phase-1 result (o, lse)
                         with one more source, the current block's partial sum (cheap, plain JAX).
  block_depth_attention  the two phases composed for one sublayer.

api.py validates inputs, flattens [S,B,T,D] to [S,N,D], picks the implementation and wires the
custom VJP shared by every implementation:
  impl.forward(queries, sources, n_valid, *, eps, ...) -> (o, lse)
  impl.backward(queries, sources, n_valid, o, lse, do, delta, *, eps, ...) -> (dq, dsources)
with delta = sum(do * o, -1) - dlse (so a cotangent on lse, which phase 2 produces, is honoured).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .. import _dispatch, _sharding
from . import pallas_gpu, pallas_tpu, xla
from .reference import rms_inverse

OP = "depth_attention"
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class _Static:
    selection: _dispatch.Selection      # implementation per lowering platform
    eps: float
    interpret: bool
    shard: _sharding.ShardPlan | None   # the Pallas kernels' split over the mesh (None: direct)


def depth_attention(queries: jax.Array, sources: jax.Array, n_valid=None, *, eps: float = 1e-6,
                    return_lse: bool = False, implementation: str | None = None,
                    interpret: bool = False):
    """Softmax attention over depth for every token (see reference.py for the formula).

    Args:
      queries: [Q, D] pseudo-queries (any float dtype; used in float32).
      sources: [S, B, T, D] (or any [S, ..., D]) float32 / bfloat16 / float16: the values; the keys
        are their RMSNorm (no learned scale).
      n_valid: number of leading slots to attend over (the rest of the fixed-size buffer is masked):
        None (= S), a Python int in [1, S], or an int32 scalar array (may be traced; a traced value
        outside [1, S] is clipped to it, a concrete one raises).
      eps: RMSNorm epsilon.
      return_lse: also return the float32 log-sum-exp of the scores [Q, B, T].
      implementation: None (best for the platform the call is lowered for, falling back to "xla"
        when the kernel cannot take the shapes), "xla", "pallas_gpu" or "pallas_tpu" (explicit
        choices raise when impossible; see kernels._dispatch). Under a mesh (jax.set_mesh) the
        Pallas kernels run in a shard_map with the token axis N = B*T split over
        "data"/"fsdp"/"expert" (kernels._sharding); a "context" axis > 1 is refused.
      interpret: run the Pallas kernel in interpret mode (any backend).

    Returns:
      o [Q, B, T, D] in sources' dtype, or (o, lse). Differentiable in queries and sources.
    """
    _dispatch.check_name(OP, implementation)
    n = _validate(queries, sources, n_valid, eps)
    S, D = sources.shape[0], sources.shape[-1]
    lead = sources.shape[1:-1]

    def unsupported(impl):
        module = pallas_gpu if impl == "pallas_gpu" else pallas_tpu
        return module.unsupported_reason(Q=queries.shape[0], S=S, D=D, dtype=sources.dtype)

    selection = _dispatch.select(OP, implementation, interpret=interpret, unsupported=unsupported)
    flat = sources.reshape(S, -1, D)
    static = _Static(selection, float(eps), bool(interpret),
                     _dispatch.shard_plan(OP, selection, batch=flat.shape[1]))
    o, lse = _attend(queries, flat, n, static)
    Q = queries.shape[0]
    # The kernels return o in float32 (the backward's delta = dO . o then has no rounding error);
    # the caller gets the sources' dtype.
    o = o.reshape((Q,) + lead + (D,)).astype(sources.dtype)
    lse = lse.reshape((Q,) + lead)
    return (o, lse) if return_lse else o


def merge_partial(o: jax.Array, lse: jax.Array, queries: jax.Array, partial: jax.Array,
                  has_partial=True, *, eps: float = 1e-6) -> jax.Array:
    """Phase 2: o [Q,B,T,D], lse [Q,B,T] from depth_attention over the finished blocks, merged with
    the partial sum partial [B,T,D] as if it were one more source. has_partial (bool or traced bool
    scalar) False returns o unchanged. Returns [Q,B,T,D] in o's dtype."""
    if partial.shape != o.shape[1:] or lse.shape != o.shape[:-1] or queries.shape[0] != o.shape[0]:
        raise ValueError(f"merge_partial: expected o [Q,B,T,D], lse [Q,B,T], queries [Q,D], "
                         f"partial [B,T,D]; got o {o.shape}, lse {lse.shape}, queries "
                         f"{queries.shape}, partial {partial.shape}")
    out = _merge(o, lse, queries, partial, jnp.asarray(has_partial, jnp.bool_), float(eps))
    return out.astype(o.dtype)


# The merge has its own VJP. Under autodiff of the formula XLA:CPU materialised per-token weights
# broadcast to [Q,B,T,D], handed the outer product dz (x) q to a library dot, and fused the merge's
# backward into the depth-attention dv pass over every slot, recomputing it per slot. Written out,
# every [B,T,D] term is one elementwise pass: Block AttnRes's training step at d_model 1024, 12
# layers went from 1.32x to 1.20x the standard residual's (eval/BENCHMARKS.md, issue 26 item 6).

def _merge_terms(lse, queries, partial, eps):
    """(q [Q,D], v [B,T,D], r [B,T], z [Q,B,T], alpha [Q,B,T]) in float32: alpha is the phase-1
    result's weight in the two-source softmax, a / (a + b) = sigmoid(lse - z)."""
    q, v = queries.astype(jnp.float32), partial.astype(jnp.float32)
    r = rms_inverse(v, eps)
    z = jnp.einsum("qd,btd->qbt", q, v, precision=jax.lax.Precision.HIGHEST) * r[None]
    return q, v, r, z, jax.nn.sigmoid(lse - z)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _merge(o, lse, queries, partial, has_partial, eps):
    _, v, _, _, alpha = _merge_terms(lse, queries, partial, eps)
    o32 = o.astype(jnp.float32)
    return jnp.where(has_partial, v[None] + alpha[..., None] * (o32 - v[None]), o32)


def _merge_fwd(o, lse, queries, partial, has_partial, eps):
    return _merge(o, lse, queries, partial, has_partial, eps), (o, lse, queries, partial,
                                                                has_partial)


def _merge_bwd(eps, residuals, g):
    """merged = alpha o + (1 - alpha) v with alpha = sigmoid(lse - z), z = r (q . v):
    d(lse - z) = alpha (1 - alpha) g . (o - v); dz/dv = r q - (r^2 z / D) v; dz/dq = r v."""
    o, lse, queries, partial, has_partial = residuals
    q, v, r, z, alpha = _merge_terms(lse, queries, partial, eps)
    g = g.astype(jnp.float32)
    d_o = jnp.where(has_partial, alpha[..., None] * g, g)
    s = jnp.where(has_partial, alpha * (1 - alpha)
                  * jnp.sum(g * (o.astype(jnp.float32) - v[None]), axis=-1), 0.0)   # d(lse - z)
    w = jnp.where(has_partial, 1 - alpha, 0.0)
    rdz = -s * r[None]                                                             # r dz [Q,B,T]
    D = v.shape[-1]
    d_v = (r * r / D * jnp.sum(s * z, axis=0))[..., None] * v
    for i in range(q.shape[0]):     # Q is small (the sublayers sharing one phase 1)
        d_v = d_v + w[i][..., None] * g[i] + rdz[i][..., None] * q[i]
    d_q = jnp.einsum("qbt,btd->qd", rdz, v, precision=jax.lax.Precision.HIGHEST)
    return (d_o.astype(o.dtype), s.astype(lse.dtype), d_q.astype(queries.dtype),
            d_v.astype(partial.dtype), None)


_merge.defvjp(_merge_fwd, _merge_bwd)


def block_depth_attention(queries: jax.Array, blocks: jax.Array, n_finished, partial: jax.Array,
                          has_partial=True, *, eps: float = 1e-6,
                          implementation: str | None = None, interpret: bool = False) -> jax.Array:
    """Block AttnRes input of the sublayers with pseudo-queries `queries` [Q,D]: phase 1 over the
    finished block summaries blocks[:n_finished] ([N,B,T,D] buffer, one pass batched over the Q
    queries), then phase 2 merges the current block's partial sum [B,T,D] when has_partial.
    Equal to one softmax over (finished blocks, partial). Returns [Q,B,T,D] in blocks' dtype."""
    o, lse = depth_attention(queries, blocks, n_finished, eps=eps, return_lse=True,
                             implementation=implementation, interpret=interpret)
    return merge_partial(o, lse, queries, partial, has_partial, eps=eps)


# ----------------------------------------------------------------------------------------------
# Custom VJP shared by every implementation.

_MODULES = {"xla": xla, "pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}


# Kernel layouts under a mesh: the token axis N (= B*T, batch-major) split over the batch axes;
# queries, depth slots, D and n_valid whole on every device.
def _fwd_specs(sh):
    return (P(), sh.spec(None, "batch", None), P()), (sh.spec(None, "batch", None),
                                                      sh.spec(None, "batch"))


def _bwd_specs(sh):
    tokens, rows = sh.spec(None, "batch", None), sh.spec(None, "batch")
    return (P(), tokens, P(), tokens, rows, tokens, rows), (P(), tokens)


def _forward(static: _Static, implementation, queries, sources, n_valid):
    if implementation == "xla":
        return xla.forward(queries, sources, n_valid, eps=static.eps)
    kernel = functools.partial(_MODULES[implementation].forward, eps=static.eps,
                               interpret=static.interpret)
    return _sharding.run(static.shard, kernel, (queries, sources, n_valid), _fwd_specs)


def _backward(static: _Static, implementation, queries, sources, n_valid, o, lse, do, delta):
    if implementation == "xla":
        return xla.backward(queries, sources, n_valid, o, lse, do, delta, eps=static.eps)
    module = _MODULES[implementation]

    def kernel(*args):
        dq, ds = module.backward(*args, eps=static.eps, interpret=static.interpret)
        if static.shard is not None and static.shard.batch:
            # dq sums over tokens: add up the devices' partial sums.
            dq = jax.lax.psum(dq, static.shard.batch)
        return dq, ds

    return _sharding.run(static.shard, kernel, (queries, sources, n_valid, o, lse, do, delta),
                         _bwd_specs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attend(queries, sources, n_valid, static: _Static):
    return _dispatch.run(static.selection, functools.partial(_forward, static),
                         queries, sources, n_valid)


def _attend_fwd(queries, sources, n_valid, static):
    o, lse = _dispatch.run(static.selection, functools.partial(_forward, static),
                           queries, sources, n_valid)
    return (o, lse), (queries, sources, n_valid, o, lse)


def _attend_bwd(static, residuals, cotangents):
    queries, sources, n_valid, o, lse = residuals
    do, dlse = cotangents
    do = do.astype(jnp.float32)
    delta = jnp.sum(do * o, axis=-1) - dlse
    dq, ds = _dispatch.run(static.selection, functools.partial(_backward, static),
                           queries, sources, n_valid, o, lse, do, delta)
    return dq.astype(queries.dtype), ds.astype(sources.dtype), None


_attend.defvjp(_attend_fwd, _attend_bwd)


# ----------------------------------------------------------------------------------------------
# Validation.

def _validate(queries, sources, n_valid, eps) -> jax.Array:
    """Raises ValueError naming the bad argument; returns n_valid as an int32 scalar array."""
    for name, x in (("queries", queries), ("sources", sources)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{OP}: {name} must be an array, got {type(x).__name__}")
        if jnp.dtype(x.dtype).name not in _DTYPES:
            raise ValueError(f"{OP}: {name} dtype {jnp.dtype(x.dtype).name} is not supported; "
                             f"use one of {_DTYPES}")
    if queries.ndim != 2 or queries.shape[0] < 1:
        raise ValueError(f"{OP}: queries must have shape [Q, D] with Q >= 1, got {queries.shape}")
    if sources.ndim < 2 or sources.shape[0] < 1:
        raise ValueError(f"{OP}: sources must have shape [S, ..., D] with S >= 1, got "
                         f"{sources.shape}")
    if queries.shape[1] != sources.shape[-1]:
        raise ValueError(f"{OP}: queries D={queries.shape[1]} differs from sources D="
                         f"{sources.shape[-1]}")
    if not isinstance(eps, (int, float, np.floating)) or isinstance(eps, bool) or eps <= 0:
        raise ValueError(f"{OP}: eps must be a positive Python float, got {eps!r}")
    S = sources.shape[0]
    if n_valid is None:
        return jnp.asarray(S, jnp.int32)
    if isinstance(n_valid, bool):
        raise ValueError(f"{OP}: n_valid must be an int or an int32 scalar array, got a bool")
    if isinstance(n_valid, (int, np.integer)):
        if not 1 <= n_valid <= S:
            raise ValueError(f"{OP}: n_valid={n_valid} must lie in [1, S={S}]")
        return jnp.asarray(n_valid, jnp.int32)
    if not hasattr(n_valid, "dtype") or not jnp.issubdtype(n_valid.dtype, jnp.integer) \
            or jnp.shape(n_valid) != ():
        raise ValueError(f"{OP}: n_valid must be an int or an integer scalar array, got "
                         f"{getattr(n_valid, 'shape', type(n_valid).__name__)} "
                         f"{getattr(n_valid, 'dtype', '')}")
    try:
        value = int(n_valid)
    except (jax.errors.TracerIntegerConversionError, jax.errors.ConcretizationTypeError, TypeError):
        value = None
    if value is not None and not 1 <= value <= S:
        raise ValueError(f"{OP}: n_valid={value} must lie in [1, S={S}]")
    return jnp.clip(jnp.asarray(n_valid, jnp.int32), 1, S)
