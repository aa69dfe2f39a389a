"""Sharding by logical axis names: activation constraints at layer boundaries, and the one function
that turns logical names into a PartitionSpec.

Model code says what an array's dimensions are, never which mesh axes split them:

    x_btd = constrain(x_btd, ("batch", "seq", "embed"))

so the compiler is told how the activations between layers are laid out instead of guessing it
from the parameters. The rules (logical name -> mesh axes) and the mesh come from context that the
trainer sets (`aiinfra_jax.sharding.activation_rules` or `with_activation_rules`), because models
never import the trainer or `aiinfra_jax.sharding` (where the rules table lives):

* the rules through Flax's logical-axis-rules context (`nnx.logical_axis_rules(rules)`, the same
  thread-local one `flax.linen.partitioning.axis_rules` sets), in Flax's format: a sequence of
  `(logical name, mesh axes)` pairs, the mesh axes a name, a tuple of names or None;
* the mesh through `jax.set_mesh(mesh)` around the call that traces, or
  `jax.sharding.use_abstract_mesh(mesh.abstract_mesh)` inside the traced function, read here with
  `jax.sharding.get_abstract_mesh()`.

`constrain` returns its input unchanged outside a trace (eager calls: a constraint is a hint to the
compiler, and an eager op has none to give), with no rules, or with no mesh of more than one device
(one device, tests that build modules bare). The context is read when a function is traced: a
jitted function traced outside it keeps no constraints until it is traced again.

`logical_spec` is shared with `aiinfra_jax.sharding` (which uses it for parameters), so parameters
and activations follow one rule. For each dimension, the rules for its name are tried in order; a
rule's mesh axes of size 1 (or missing, or manual inside `shard_map`) and those an earlier dimension
of the same array already uses are dropped; the rest are taken if together they divide the
dimension. A dimension no rule fits, or whose name is None or unlisted, is replicated, so small
models and odd sizes always run, the same way on every backend.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
from flax.core.spmd import get_logical_axis_rules  # the getter of nnx.logical_axis_rules
from jax.sharding import PartitionSpec as P

# Flax's LogicalRules: (logical name, mesh axis | tuple of mesh axes | None) pairs.
Rules = Sequence[tuple[str, "str | Sequence[str] | None"]]


def _mesh_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def logical_spec(logical_axes: Sequence[str | None] | None, shape: Sequence[int],
                 mesh_sizes: Mapping[str, int], rules: Rules) -> P:
    """PartitionSpec for an array of this shape whose dimensions carry these logical names, on a
    mesh whose usable axes have these sizes (see the module docstring for the rule)."""
    if logical_axes is None:
        return P()
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} name {len(logical_axes)} dimensions "
                         f"but the array has shape {tuple(shape)}")
    table: dict[str, list[tuple[str, ...]]] = {}
    for name, entry in rules:
        table.setdefault(name, []).append(_mesh_axes(entry))
    used: set[str] = set()
    spec = []
    for name, dim in zip(logical_axes, shape):
        chosen: tuple[str, ...] = ()
        for candidate in table.get(name, ()) if name is not None else ():
            axes = tuple(a for a in candidate if mesh_sizes.get(a, 1) > 1 and a not in used)
            if axes and dim % math.prod(mesh_sizes[a] for a in axes) == 0:
                chosen = axes
                break
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return P(*spec)


def mesh_axis_sizes(mesh) -> dict[str, int]:
    """{axis: size} of a Mesh or AbstractMesh, without the axes that are manual (inside
    shard_map), which a sharding constraint may not name."""
    manual = jax.sharding.AxisType.Manual
    return {name: size for (name, size), kind in zip(mesh.shape.items(), mesh.axis_types)
            if kind != manual}


def _active_spec(x: jax.Array, logical_axes: Sequence[str | None], rules: Rules | None = None):
    """(spec, mesh) that the active rules (or `rules`) and mesh give x, or None outside a trace
    (eager calls), with no rules, or without a mesh of more than one device."""
    if not isinstance(x, jax.core.Tracer):
        return None
    rules = get_logical_axis_rules() if rules is None else rules
    if not rules:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    sizes = mesh_axis_sizes(mesh)
    if all(size == 1 for size in sizes.values()):
        return None
    return logical_spec(logical_axes, x.shape, sizes, rules), mesh


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules: Rules | None = None
              ) -> jax.Array:
    """x with a sharding constraint from its dimensions' logical names, under the active rules
    (or `rules`) and mesh: `jax.lax.with_sharding_constraint` (`jax.sharding.reshard` on a mesh
    whose axes are all Explicit). x itself outside a trace (eager calls), when there are no rules,
    or when there is no mesh with more than one device."""
    active = _active_spec(x, logical_axes, rules)
    if active is None:
        return x
    spec, mesh = active
    if mesh.are_all_axes_explicit:
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def splits(x: jax.Array, logical_axes: Sequence[str | None], dim: int) -> bool:
    """Whether dimension `dim` of x (its dimensions named `logical_axes`) is split over mesh axes
    under the active rules and mesh (what `constrain` would ask for). False outside a trace, with
    no rules or without a mesh of more than one device."""
    active = _active_spec(x, logical_axes)
    return active is not None and active[0][dim] is not None


def shard_map_over(fn, mesh, in_specs, out_specs, check: bool = True):
    """jax.shard_map of fn over every non-manual axis of mesh (the others stay automatic), on
    the JAX releases this project supports (jax.experimental's form before 0.7). check=False
    turns off the varying-axes check (check_vma), for bodies whose scan carries start replicated
    and become per-device (the outputs are then made replicated by a collective)."""
    axis_names = frozenset(mesh_axis_sizes(mesh))
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=axis_names, check_vma=check)
    from jax.experimental.shard_map import shard_map  # pragma: no cover - JAX < 0.7
    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check,
                     auto=frozenset(mesh.axis_names) - axis_names)
