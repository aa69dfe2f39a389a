"""Prefix-cache snapshots: a model's decode cache saved every N prompt tokens, restorable to resume
from a shared prefix without re-reading it.

Shape letters: B batch, T tokens, N the snapshot interval, V vocabulary.

    logits, cache, snaps = prefill_with_snapshots(model, prompt_bt, every=1024, max_len=...)
    cache = restore_snapshot(snaps[2048])       # a fresh device copy: decode on from token 2048
    logits, cache = extend(model, cache, more_bt, start=2048)

The prompt runs through the model in chunks of N tokens (every row the same length, no padding: a
shared prefix); after each full chunk the whole cache (every layer's) is copied to host memory.
Nothing here is specific to a mixer, but it is what LeapQuant states are for: a "gdn"/"kda" layer
with model.gated_delta.state_quant set re-quantizes its state at the end of every multi-token
call, so each snapshot holds that layer's state as a quantized boundary; its window records are
then empty and left out of the snapshot (ZeroRecords; restore_snapshot recreates them)
(1.19 bytes per state element at K = V = 128 with int8, against 4 for float32; see
kernels/leapquant/quantize.bytes_per_element), plus the short-convolution tail and the lengths.
Restoring a snapshot and continuing (the remaining prompt through `extend` in the same chunks, then
decoding) computes exactly what the uninterrupted run computes: the same quantized states
(tests/models/test_leapquant_mixer.py). Attention layers' KV caches are snapshotted whole
(max_len slots), with no saving.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.kernels.compilation import jit


@functools.partial(jit, static_argnums=(0,))
def _extend(graphdef, state, cache, tokens_bt, start):
    model = nnx.merge(graphdef, state)
    batch, t = tokens_bt.shape
    positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (batch, t))
    logits, cache, _ = model(tokens_bt, positions=positions, cache=cache)
    return logits[:, -1], cache


def extend(model: nnx.Module, cache: Any, tokens: jax.Array, start: int) -> tuple[jax.Array, Any]:
    """Feeds tokens [B,T] (all real, positions start..start+T-1) through the cache. Returns
    (logits [B,V] float32 at the last token, the new cache). The cache is not donated."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"extend: tokens must be [B,T] with T >= 1, got shape {tokens.shape}")
    graphdef, state = nnx.split(model)
    return _extend(graphdef, state, cache, tokens, jnp.int32(start))


# A LeapQuant state's window records (kernels/leapquant/xla.py): after a multi-token call they are
# empty (the state was re-quantized: n = 0, records zeroed), yet as buffers they weigh about as
# much as the quantized state itself or more (16 records of K + V + Dg numbers per head, float32 or
# with k~ and u in bf16 (state_records), against K*V int8).
_RECORDS = ("rec_k", "rec_u", "rec_g")


@dataclasses.dataclass(frozen=True)
class ZeroRecords:
    """An all-zero record buffer a snapshot leaves out (a pytree leaf holding no data);
    restore_snapshot recreates it."""

    shape: tuple[int, ...]
    dtype: Any


def _drop_empty_records(tree: Any) -> Any:
    if isinstance(tree, dict):
        out = {k: _drop_empty_records(v) for k, v in tree.items()}
        if all(k in tree for k in _RECORDS + ("n",)) and not np.any(tree["n"]):
            for k in _RECORDS:
                if not np.any(tree[k]):  # only what is all zeros: restoring is exact
                    out[k] = ZeroRecords(tuple(tree[k].shape), tree[k].dtype)
        return out
    if isinstance(tree, (list, tuple)):
        items = [_drop_empty_records(v) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


def snapshot(cache: Any) -> Any:
    """A host-memory (numpy) copy of a cache pytree, less the empty window records of LeapQuant
    states (ZeroRecords), which is what makes a quantized snapshot small."""
    return _drop_empty_records(jax.device_get(cache))


def restore_snapshot(snap: Any) -> Any:
    """A fresh device copy of a snapshot, safe to hand to a decode step that donates its cache."""
    return jax.tree.map(lambda a: (jnp.zeros(a.shape, a.dtype) if isinstance(a, ZeroRecords)
                                   else jnp.array(a, copy=True)), snap)


def snapshot_nbytes(snap: Any) -> int:
    """Bytes a snapshot holds."""
    return int(sum(0 if isinstance(a, ZeroRecords) else np.asarray(a).nbytes
                   for a in jax.tree.leaves(snap)))


def prefill_with_snapshots(model: nnx.Module, tokens: jax.Array, *, every: int = 1024,
                           max_len: int) -> tuple[jax.Array, Any, dict[int, Any]]:
    """Runs a shared prompt tokens [B,T] (no padding) through a fresh cache of max_len slots in
    chunks of `every` tokens (the last chunk may be shorter), snapshotting the cache after every
    full chunk.

    Returns (logits [B,V] float32 at the last prompt token, the cache after the prompt,
    {n: snapshot of the cache after the first n tokens} for n = every, 2*every, ... <= T).
    Resume from snapshot n with restore_snapshot, then extend(..., tokens[:, n:n+every], start=n)
    chunk by chunk, to reproduce the uninterrupted run exactly.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"prefill_with_snapshots: tokens must be [B,T] with T >= 1, got shape "
                         f"{tokens.shape}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"prefill_with_snapshots: every={every!r} must be a positive int (prompt "
                         "tokens between snapshots; 1024 by default)")
    T = tokens.shape[1]
    if max_len < T:
        raise ValueError(f"prefill_with_snapshots: max_len={max_len} is shorter than the prompt "
                         f"({T} tokens)")
    cache = model.init_cache(tokens.shape[0], max_len)
    snaps, logits = {}, None
    for start in range(0, T, every):
        chunk = tokens[:, start:start + every]
        logits, cache = extend(model, cache, chunk, start)
        if chunk.shape[1] == every:
            snaps[start + every] = snapshot(cache)
    return logits, cache, snaps
