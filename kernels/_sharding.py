"""Running a Pallas kernel on a sharded mesh: one shard_map rule for every op in kernels/.

A pallas_call is a custom call that XLA's partitioner cannot split, so under a mesh each op wraps
its kernels in `jax.shard_map`: every device runs the kernel on its own slice, with the
partitioning the op allows. The XLA implementations need none of this (GSPMD partitions them).

Mesh axis names (a convention shared with aiinfra_jax/sharding.py, which builds the mesh; kernels
import only JAX, so the names are repeated here rather than imported):
  "data", "fsdp", "expert"  batch (data-parallel) axes: the batch dimension (depth_attention: its
                            token axis N = B*T) is split over those of them that exist, in this
                            order, as long as the product of their sizes divides it; an axis that
                            would not divide is skipped (the kernel is repeated on its devices).
  "tensor"                  the heads axis: KV heads (and with them their query-head groups, so a
                            GQA group never straddles devices) are split over it when its size
                            divides the KV-head count; otherwise heads stay whole on every device.
  "context"                 sequence (context-parallel) axis. The kernels need whole sequences, and
                            splitting keys across devices would mean gathering them silently, so a
                            "context" axis of size > 1 is refused with a ValueError naming it.
Any other axis (and every dimension not named above: sequence, keys, head dims, block indices) is
replicated inside the shard_map: each device sees the whole extent.

The mesh is the one in context when the op is traced (`jax.sharding.get_abstract_mesh()`, set by
`jax.set_mesh(mesh)` around tracing). Without one, or with a mesh of one device, or when every
mesh axis is already manual (the op is called inside the caller's own shard_map), the kernel is
called directly. Axes already manual are left alone; Explicit axes get their inputs resharded to
the kernel's layout first (jax.sharding.reshard), which is what shard_map requires of them
(the XLA paths themselves are written for Auto axes, which is what aiinfra_jax.sharding builds).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp", "expert")
HEADS_AXIS = "tensor"
CONTEXT_AXIS = "context"

_Manual = jax.sharding.AxisType.Manual
_Explicit = jax.sharding.AxisType.Explicit


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How one op call is split over the context mesh (static and hashable).

    mesh: the (abstract) context mesh at the call, kept so that a backward traced later (outside
      the `jax.set_mesh` block) still maps over it.
    batch: the mesh axes the batch (token) dimension is split over, () when none.
    heads: the mesh axis the heads are split over, or None.
    axis_names: the mesh axes the shard_map takes over (every non-manual axis).
    explicit: the Explicit-typed axes among them (inputs are resharded onto those first).
    """

    mesh: object
    batch: tuple[str, ...]
    heads: str | None
    axis_names: frozenset[str]
    explicit: frozenset[str]

    @property
    def batch_spec(self):
        """PartitionSpec entry for the batch dimension."""
        if not self.batch:
            return None
        return self.batch if len(self.batch) > 1 else self.batch[0]

    def spec(self, *dims: str | None) -> P:
        """PartitionSpec of an array whose dimensions are named "batch", "heads" or None
        (replicated), e.g. spec("batch", None, "heads", None) for q [B, T, H, D]."""
        names = {"batch": self.batch_spec, "heads": self.heads, None: None}
        return P(*(names[d] for d in dims))


def _free_axes(mesh) -> dict[str, tuple[int, object]]:
    """name -> (size, type) for the mesh axes that are not already manual."""
    types = getattr(mesh, "axis_types", None) or (None,) * len(mesh.axis_names)
    sizes = dict(mesh.shape)
    return {name: (sizes[name], t) for name, t in zip(mesh.axis_names, types) if t != _Manual}


def _context_mesh():
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except AttributeError:  # pragma: no cover - older JAX without abstract meshes
        return None
    if mesh is None or getattr(mesh, "empty", False) or not mesh.axis_names:
        return None
    return mesh


def context_parallel_error(op: str) -> str | None:
    """The ValueError message when the context mesh splits sequences ("context" axis > 1)."""
    mesh = _context_mesh()
    if mesh is None:
        return None
    size = _free_axes(mesh).get(CONTEXT_AXIS, (1, None))[0]
    if size <= 1:
        return None
    return (f"{op}: the mesh has a {CONTEXT_AXIS!r} axis of size {size}, i.e. sequence-sharded "
            f"(context-parallel) attention, which these Pallas kernels do not support yet (each "
            f"device would need every key). Use a mesh without a {CONTEXT_AXIS!r} axis (or of "
            f"size 1), or implementation='xla'.")


def plan(op: str, *, batch: int, heads: int | None = None) -> ShardPlan | None:
    """The split of one call over the context mesh, or None to call the kernel directly.

    batch: the size of the dimension split over the batch axes; heads: the KV-head count (None
    when the op has no heads axis). Raises ValueError for a "context" axis > 1.
    """
    mesh = _context_mesh()
    if mesh is None:
        return None
    free = _free_axes(mesh)
    if math.prod(size for size, _ in free.values()) <= 1:
        return None
    message = context_parallel_error(op)
    if message is not None:
        raise ValueError(message)
    used, split = [], 1
    for name in BATCH_AXES:
        size = free.get(name, (1, None))[0]
        if size > 1 and batch % (split * size) == 0:
            used.append(name)
            split *= size
    head_size = free.get(HEADS_AXIS, (1, None))[0]
    head_axis = HEADS_AXIS if heads is not None and head_size > 1 and heads % head_size == 0 \
        else None
    return ShardPlan(mesh=mesh, batch=tuple(used), heads=head_axis, axis_names=frozenset(free),
                     explicit=frozenset(n for n, (_, t) in free.items() if t == _Explicit))


def _shard_map(fn, *, mesh, in_specs, out_specs, axis_names):
    # check_vma=False: pallas_call's outputs carry no varying-axes annotation; the specs here say
    # exactly how each output varies.
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=axis_names, check_vma=False)
    from jax.experimental.shard_map import shard_map  # pragma: no cover - JAX < 0.7
    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                     auto=frozenset(mesh.axis_names) - axis_names, check_rep=False)


def _keep(spec: P, axes: frozenset[str]) -> P:
    """spec with only the mesh axes in `axes` (the rest replicated)."""
    def entry(e):
        if e is None:
            return None
        names = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a in axes)
        return None if not names else names if len(names) > 1 else names[0]
    return P(*(entry(e) for e in spec))


def run(shard: ShardPlan | None, fn: Callable, args: Sequence,
        specs: Callable[[ShardPlan], tuple[Sequence[P], object]]) -> object:
    """fn(*args), inside a shard_map over the context mesh when `shard` is a plan.

    specs(shard) -> (in_specs, out_specs): one PartitionSpec per argument (ignored where the
    argument is None, an absent optional input) and a pytree of PartitionSpecs matching fn's
    outputs. Inside, fn sees each device's slice and must return that device's slice of the
    outputs (reducing over shard.batch itself where an output sums over the split dimension).
    """
    if shard is None:
        return fn(*args)
    in_specs, out_specs = specs(shard)
    present = [i for i, a in enumerate(args) if a is not None]

    def body(*xs):
        full = [None] * len(args)
        for i, x in zip(present, xs):
            full[i] = x
        return fn(*full)

    xs = [args[i] for i in present]
    specs = tuple(in_specs[i] for i in present)
    if shard.explicit:
        xs = [jax.sharding.reshard(x, _keep(s, shard.explicit)) for x, s in zip(xs, specs)]
    return _shard_map(body, mesh=shard.mesh, in_specs=specs, out_specs=out_specs,
                      axis_names=shard.axis_names)(*xs)
