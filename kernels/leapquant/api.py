"""Public LeapQuant functions: decode through a quantized recurrent state of a gated-delta layer.

Letters: B batch, T tokens, H query/key heads, HV value heads (HV = G * H), K key head dim,
V value head dim, Dg decay width (1 = GDN, K = KDA).

    spec  = LeapQuantSpec(fmt="int8", window=16)          # quantize.py
    state = encode_state(spec, S_bhkv, decay_dim=1)        # or init_state(...)
    o, state = leapquant_decode(q, k, v, g, beta, state, spec=spec)
    S_bhkv = materialize(state)                            # the dense state it stands for

Implementations (kernels._dispatch names) of the window read, the memory-bound part of a step
(it reads the whole quantized boundary state, twice a step); the rest of the step (record append,
re-quantization every P steps) is XLA in every case:
  "xla"          xla.read_arrays; runs everywhere.
  "pallas_gpu"   pallas_gpu.read, a Triton kernel reading the int8 state in registers (K, V powers
                 of two >= 16; P and r powers of two).
  "pallas_tpu"   pallas_tpu.read, the same for Mosaic (K a multiple of 32, V of 128).
Both are checked against the XLA read in Pallas interpret mode and lowered for cuda / tpu from CPU
(tests/kernels/test_leapquant.py); neither has run on an accelerator yet. implementation=None uses
the kernel of the lowering platform where it takes the shapes, else XLA (logged).
Under a mesh the Pallas read runs in a shard_map (batch over the batch axes, value heads over
"tensor"; kernels._sharding). Decoding is inference-only: no custom VJP.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from .. import _dispatch, _sharding
from . import pallas_gpu, pallas_tpu, xla
from .quantize import LeapQuantSpec

OP = "leapquant_decode"


def encode_state(spec: LeapQuantSpec, S: jax.Array, *, decay_dim: int) -> dict:
    """Dense state S [B,HV,K,V] -> the LeapQuant state at a window start (xla.py's layout)."""
    _check_spec(spec)
    if not hasattr(S, "shape") or len(S.shape) != 4:
        raise ValueError(f"{OP}: the state must be [B,HV,K,V], got {getattr(S, 'shape', S)!r}")
    if decay_dim not in (1, S.shape[2]):
        raise ValueError(f"{OP}: decay_dim={decay_dim} must be 1 (GDN) or K={S.shape[2]} (KDA)")
    return _encode(spec, S, int(decay_dim))


_encode = jax.jit(xla.encode_state, static_argnums=(0, 2))


def init_state(spec: LeapQuantSpec, batch: int, heads: int, K: int, V: int, *,
               decay_dim: int) -> dict:
    """The LeapQuant state of zeros [batch, heads, K, V] (decay_dim 1 = GDN, K = KDA)."""
    _check_spec(spec)
    if decay_dim not in (1, K):
        raise ValueError(f"{OP}: decay_dim={decay_dim} must be 1 (GDN) or K={K} (KDA)")
    return xla.init_state(spec, batch, heads, K, V, decay_dim)


def materialize(state: dict) -> jax.Array:
    """The dense state [B,HV,K,V] float32 a LeapQuant state stands for."""
    return xla.materialize(state)


def state_nbytes(state: dict) -> int:
    """Bytes the arrays of a LeapQuant state occupy in memory (INT6/INT4 in int8 containers;
    quantize.bytes_per_element gives the packed accounting)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)))


def leapquant_decode(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     state: dict, *, spec: LeapQuantSpec, scale: float | None = None,
                     active: jax.Array | None = None, implementation: str | None = None,
                     interpret: bool = False) -> tuple[jax.Array, dict]:
    """Decodes T tokens one at a time through a LeapQuant state (xla.py's record form).

    Args:
      q, k: [B,T,H,K]; v: [B,T,HV,V] (HV a multiple of H); g: [B,T,HV] (GDN) or [B,T,HV,K] (KDA)
        log-decays (<= 0); beta: [B,T,HV]. Any float dtypes (computed in float32).
      state: from encode_state / init_state / a previous call, with the same spec and decay kind.
      spec: the storage (quantize.LeapQuantSpec). scale: output scale, default K^-1/2.
      active: [B,T] bool or None; an inactive (padding) token leaves its row's state unchanged and
        outputs 0.
      implementation: None (the best for the platform the call is lowered for), "xla",
        "pallas_gpu" or "pallas_tpu" (see the module docstring); interpret: run the Pallas kernel
        in interpret mode (any backend).

    Returns:
      (o [B,T,HV,V] float32, new state).
    """
    _check_spec(spec)
    _dispatch.check_name(OP, implementation)
    _validate(q, k, v, g, beta, state, spec, active)
    B, _, _, K = q.shape
    HV, V = v.shape[2:]

    def unsupported(impl):
        module = pallas_gpu if impl == "pallas_gpu" else pallas_tpu
        return module.unsupported_reason(K=K, V=V, P=spec.window, r=spec.r)

    selection = _dispatch.select(OP, implementation, interpret=interpret, unsupported=unsupported)
    shard = _dispatch.shard_plan(OP, selection, batch=B, heads=HV)
    reader = functools.partial(_dispatch.run, selection,
                               functools.partial(_read_impl, shard, bool(interpret)))
    scale = float(K ** -0.5 if scale is None else scale)
    return xla.decode(spec, state, q, k, v, g, beta, scale, active, reader)


def _read_specs(sh):
    def s(rank):
        return sh.spec("batch", "heads", *([None] * (rank - 2)))
    return (s(4),) + (s(3),) * 2 + (s(4),) * 5 + (s(3),) * 3, s(3)


def _read_impl(shard, interpret, implementation, *args):
    if implementation == "xla":
        return xla.read_arrays(*args)
    module = pallas_gpu if implementation == "pallas_gpu" else pallas_tpu
    kernel = functools.partial(module.read, interpret=interpret)
    return _sharding.run(shard, kernel, args, _read_specs)


def _check_spec(spec) -> None:
    if not isinstance(spec, LeapQuantSpec):
        raise ValueError(f"{OP}: spec must be a LeapQuantSpec, got {type(spec).__name__}")


def _validate(q, k, v, g, beta, state, spec, active) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise ValueError(f"{OP}: {name} must be rank 4, got {getattr(x, 'shape', x)!r}")
    if k.shape != q.shape:
        raise ValueError(f"{OP}: k shape {list(k.shape)} must equal q shape {list(q.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if v.shape[:2] != (B, T) or HV % H:
        raise ValueError(f"{OP}: v must be [B,T,HV,V] with B,T = {B},{T} and HV a multiple of "
                         f"H={H}, got {list(v.shape)}")
    if g.shape not in ((B, T, HV), (B, T, HV, K)):
        raise ValueError(f"{OP}: g must be [B,T,HV]={[B, T, HV]} (GDN) or [B,T,HV,K] (KDA), got "
                         f"{list(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"{OP}: beta must be [B,T,HV]={[B, T, HV]}, got {list(beta.shape)}")
    dg = 1 if g.ndim == 3 else K
    want = {"q": (B, HV, K, V), "rec_k": (B, HV, spec.window, K),
            "rec_u": (B, HV, spec.window, V), "rec_g": (B, HV, spec.window, dg),
            "comp_k": (B, HV, spec.r, K)}
    if not isinstance(state, dict) or set(want) - set(state):
        raise ValueError(f"{OP}: state must be a dict from encode_state / init_state")
    for key, shape in want.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{OP}: state[{key!r}] has shape {list(state[key].shape)}, expected "
                             f"{list(shape)} for these inputs and spec (window {spec.window}, "
                             f"rank {spec.r}, {'GDN' if dg == 1 else 'KDA'} decay); encode it "
                             "with the same spec")
    for key, dtype in spec.record_dtypes.items():
        if state[key].dtype != dtype:
            raise ValueError(f"{OP}: state[{key!r}] is stored as {state[key].dtype}, but the spec "
                             f"says {dtype} (record_dtype={spec.record_dtype!r}); encode it with "
                             "the same spec")
    if active is not None and (tuple(active.shape) != (B, T) or active.dtype != np.bool_):
        raise ValueError(f"{OP}: active must be a [B,T]={[B, T]} bool array or None")
