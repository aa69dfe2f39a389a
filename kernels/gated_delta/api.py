"""Public gated delta rule: Gated DeltaNet (GDN) and Kimi Delta Attention (KDA).

Letters: B batch, T sequence, H query/key heads, HV value heads (HV = G * H), K key head dim,
V value head dim.

One function serves both: g of rank 3 ([B,T,HV], one log-decay per head and step) is GDN, g of
rank 4 ([B,T,HV,K], one per key channel) is KDA. The recurrence, the decay order (decay first, then
the delta update) and the packed-document conventions are documented in reference.py.

Implementations (kernels._dispatch names): the chunkwise algorithm is split into a state-independent
preparation, run for all chunks at once in XLA (xla.prepare: decay cumsums, intra-chunk pair
matrices, the UT transform's triangular inverse), and the sequential state pass over the chunks,
which is what the implementation choice selects:
  "xla"          a lax.scan over chunks (xla.state_pass); runs everywhere.
  "pallas_tpu"   the state pass and its backward as Mosaic kernels (pallas_tpu.py).
  "pallas_gpu"   the state pass and its backward as Triton kernels (pallas_gpu.py; C, K, V
                 powers of two >= 16). Explicit only: implementation=None picks "xla" on cuda
                 (AUTOMATIC below), because on the first GPU run (an H200, JAX 0.11.2,
                 eval/BENCHMARKS.md "GPU") these kernels were 4-7x slower than the XLA scan at
                 the same float32 precision (gdn, B=1, 16 heads of 128, bf16 inputs, 4K-64K:
                 forward 13.1 vs 2.0 ms at 4K, forward+backward 536 vs 127 ms at 64K).
The state pass is wrapped in a jax.custom_vjp whose residuals are its inputs (the prepared chunk
operands and S0, the same for every implementation) and whose backward is the selected
implementation's: the Pallas backward kernels (state_pass_bwd: they recompute the chunk states from
those inputs, then run the reverse recurrence; see the kernel modules), or, for "xla", the XLA
scan's VJP, recomputed. Everything else (prepare, the output reshaping) is JAX autodiff. Under a
mesh the Pallas state pass and its backward run in a shard_map with batch split over the batch
axes and value heads over "tensor" (kernels._sharding).

A one-token call (T = 1, a decode step) skips all of that on every platform and implementation:
it is one step of the recurrence in plain JAX (reference.py), a read and a write of the state. The
chunked form would pad the token to a chunk of 8, solve its triangular system and run the state
pass as a loop, whose loop state makes XLA copy the donated decode state first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _dispatch, _sharding
from . import pallas_gpu, pallas_tpu, xla
from .reference import gated_delta_rule_reference

OP = "gated_delta_rule"
# The Pallas implementations implementation=None may pick (the module docstring says why not
# pallas_gpu). pallas_tpu has not run on a TPU yet.
AUTOMATIC = ("pallas_tpu",)
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class _Static:
    selection: _dispatch.Selection      # implementation per lowering platform
    interpret: bool
    shard: _sharding.ShardPlan | None   # the Pallas kernels' split over the mesh (None: direct)


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                     initial_state: jax.Array | None = None,
                     segment_ids: jax.Array | None = None, scale: float | None = None,
                     chunk_size: int = 64, output_final_state: bool = False,
                     implementation: str | None = None, interpret: bool = False):
    """The gated delta rule, chunkwise: GDN when g is [B,T,HV], KDA when g is [B,T,HV,K].

        S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,   o_t = scale S_t^T q_t

    (the state is decayed first, then the delta rule reads the decayed state; reference.py).

    Args:
      q, k: [B,T,H,K]; v: [B,T,HV,V] with HV a multiple of H (q/k head h serves value heads
        [h*G, (h+1)*G), G = HV // H). float32, bfloat16 or float16, all the same dtype; computed in
        float32. fla's recipe L2-normalises q and k (not done here).
      g: log-decays, [B,T,HV] (GDN) or [B,T,HV,K] (KDA), any float dtype; meant to be <= 0 (the
        chunked form is stable for g <= 0).
      beta: [B,T,HV] write strengths (usually sigmoid outputs), any float dtype.
      initial_state: [B,HV,K,V] state before position 0 (any float dtype), or None for zeros.
      segment_ids: [B,T] integers or None. Documents are maximal runs of equal ids; the state
        resets to zero at every document boundary (the initial state feeds the row's first
        document only); id 0 is padding, whose outputs are 0 and whose beta and g count as 0.
      scale: output scale, default K ** -0.5.
      chunk_size: chunk length C of the chunkwise algorithm, a positive multiple of 8 (default 64;
        a sequence shorter than C uses one chunk of T rounded up to 8). KDA splits chunks into
        sub-chunks of 8 positions (xla.SUB_CHUNK).
      output_final_state: also return the state after position T-1.
      implementation: None (best for the platform the call is lowered for, falling back to "xla"
        where the kernel cannot take the shapes), "xla", "pallas_gpu" or "pallas_tpu" (explicit
        choices raise when impossible; see kernels._dispatch). Selects the state pass and its
        backward only (see the module docstring); a "context" mesh axis > 1 is refused by the
        Pallas kernels. Not used when T = 1 (one recurrence step in plain JAX).
      interpret: run the Pallas kernel in interpret mode (any backend).

    Returns:
      o [B,T,HV,V] in q's dtype, or (o, final_state [B,HV,K,V] float32) when output_final_state.
      Differentiable in q, k, v, g, beta and initial_state.
    """
    _dispatch.check_name(OP, implementation)
    _validate(q, k, v, g, beta, initial_state, segment_ids, scale, chunk_size)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if T == 1:  # a decode step: one step of the recurrence (module docstring)
        o, state = gated_delta_rule_reference(q, k, v, g, beta, initial_state=initial_state,
                                              segment_ids=segment_ids, scale=scale)
        o = o.astype(q.dtype)
        return (o, state) if output_final_state else o
    C = xla.chunk_length(T, int(chunk_size))

    def unsupported(impl):
        module = pallas_gpu if impl == "pallas_gpu" else pallas_tpu
        return module.unsupported_reason(C=C, K=K, V=V)

    selection = _dispatch.select(OP, implementation, interpret=interpret, unsupported=unsupported,
                                 automatic=AUTOMATIC)
    static = _Static(selection, bool(interpret),
                     _dispatch.shard_plan(OP, selection, batch=B, heads=HV))
    scale = float(K ** -0.5 if scale is None else scale)
    p = xla.prepare(q, k, v, g, beta, segment_ids, scale=scale, chunk_size=int(chunk_size))
    S0 = (jnp.zeros((B, HV, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    o, state = _state_pass(static, p.w, p.u1, p.qg, p.m, p.kdt, p.decay, S0)
    o = xla.finish(o, p.pad, T).astype(q.dtype)
    return (o, state) if output_final_state else o


# ----------------------------------------------------------------------------------------------
# The state pass: implementation per platform, custom VJP (backward: the same implementation's).

_MODULES = {"pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}


def _specs(sh):
    chunk = sh.spec("batch", "heads", None, None, None)
    state = sh.spec("batch", "heads", None, None)
    return (chunk,) * 6 + (state,), (chunk, state)


def _bwd_specs(sh):
    """Backward: (args..., do, dS_N) in, one gradient per arg out (all split like the args)."""
    chunk = sh.spec("batch", "heads", None, None, None)
    state = sh.spec("batch", "heads", None, None)
    return (chunk,) * 6 + (state, chunk, state), (chunk,) * 6 + (state,)


def _state_impl(static: _Static, implementation, *args):
    if implementation == "xla":
        return xla.state_pass(*args)
    kernel = functools.partial(_MODULES[implementation].state_pass, interpret=static.interpret)
    return _sharding.run(static.shard, kernel, args, _specs)


def _state_bwd_impl(static: _Static, implementation, *args_and_cotangents):
    args, cotangents = args_and_cotangents[:7], args_and_cotangents[7:]
    if implementation == "xla":
        return tuple(jax.vjp(xla.state_pass, *args)[1](cotangents))
    module = _MODULES[implementation]

    def kernel(*xs):
        return tuple(module.state_pass_bwd(xs[:7], xs[7:], interpret=static.interpret))

    return _sharding.run(static.shard, kernel, args_and_cotangents, _bwd_specs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _state_pass(static: _Static, w, u1, qg, m, kdt, decay, S0):
    return _dispatch.run(static.selection, functools.partial(_state_impl, static),
                         w, u1, qg, m, kdt, decay, S0)


def _state_pass_fwd(static, *args):
    out = _dispatch.run(static.selection, functools.partial(_state_impl, static), *args)
    return out, args


def _state_pass_bwd(static, args, cotangents):
    return _dispatch.run(static.selection, functools.partial(_state_bwd_impl, static),
                         *args, *cotangents)


_state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)


# ----------------------------------------------------------------------------------------------
# Validation.

def _shape(x, name: str) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{OP}: {name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _float(x, name: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{OP}: {name} must be a float array, got dtype {x.dtype}")


def _validate(q, k, v, g, beta, initial_state, segment_ids, scale, chunk_size) -> None:
    qs, ks, vs = _shape(q, "q"), _shape(k, "k"), _shape(v, "v")
    for name, s, layout in (("q", qs, "[B,T,H,K]"), ("k", ks, "[B,T,H,K]"),
                            ("v", vs, "[B,T,HV,V]")):
        if len(s) != 4:
            raise ValueError(f"{OP}: {name} must have rank 4 {layout}, got shape {list(s)}")
    if min(qs + vs) <= 0:
        raise ValueError(f"{OP}: q and v must have non-empty dims, got q {list(qs)}, v {list(vs)}")
    if ks != qs:
        raise ValueError(f"{OP}: k shape {list(ks)} must equal q shape {list(qs)} ([B,T,H,K])")
    B, T, H, K = qs
    if vs[:2] != (B, T):
        raise ValueError(f"{OP}: v batch and length {list(vs[:2])} must equal q's {[B, T]}")
    HV = vs[2]
    if HV % H:
        raise ValueError(f"{OP}: value heads HV={HV} must be a multiple of query/key heads H={H} "
                         f"(grouped value heads)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype).name not in _DTYPES:
            raise ValueError(f"{OP}: {name}.dtype must be one of {_DTYPES}, got {x.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{OP}: q, k, v dtypes must match, got q {q.dtype}, k {k.dtype}, "
                         f"v {v.dtype}")
    gs = _shape(g, "g")
    if gs not in ((B, T, HV), (B, T, HV, K)):
        raise ValueError(f"{OP}: g must have shape [B,T,HV]={[B, T, HV]} (GDN) or "
                         f"[B,T,HV,K]={[B, T, HV, K]} (KDA), got {list(gs)}")
    _float(g, "g")
    if _shape(beta, "beta") != (B, T, HV):
        raise ValueError(f"{OP}: beta must have shape [B,T,HV]={[B, T, HV]}, got "
                         f"{list(beta.shape)}")
    _float(beta, "beta")
    if initial_state is not None:
        want = (B, HV, K, vs[3])
        if _shape(initial_state, "initial_state") != want:
            raise ValueError(f"{OP}: initial_state must have shape [B,HV,K,V]={list(want)}, got "
                             f"{list(initial_state.shape)}")
        _float(initial_state, "initial_state")
    if segment_ids is not None:
        if _shape(segment_ids, "segment_ids") != (B, T):
            raise ValueError(f"{OP}: segment_ids must have shape [B,T]={[B, T]}, got "
                             f"{list(segment_ids.shape)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"{OP}: segment_ids must be an integer array, got dtype "
                             f"{segment_ids.dtype}")
    if scale is not None and (not isinstance(scale, (int, float, np.floating))
                              or isinstance(scale, bool) or not np.isfinite(scale) or scale <= 0):
        raise ValueError(f"{OP}: scale must be a positive finite Python float, got {scale!r}")
    if (not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool)
            or chunk_size <= 0 or chunk_size % 8):
        raise ValueError(f"{OP}: chunk_size must be a positive multiple of 8, got {chunk_size!r}")
