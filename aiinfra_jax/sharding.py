"""Device mesh from config, one logical-axis rules table, and helpers to shard params, batches and
(through `activation_rules`) the activations that models constrain.

Model code names the axes of its parameters logically
(`nnx.Param(..., logical_axes=("embed", "mlp"))`) and of its activations at layer boundaries
(`models.partitioning.constrain(x, ("batch", "seq", "embed"))`), and never mentions the mesh.
`RULES` maps each logical name to mesh axes. A dimension that the mapped mesh axes do not divide,
or whose mesh axes an earlier dimension of the same array already uses, stays replicated (so small
models and odd sizes always run; the rule is the same on every backend, and
`aiinfra_jax.models.partitioning.logical_spec` applies it to parameters and activations alike).

Mesh axes (`MeshConfig.axis_names()`, outermost first): "data" (pure data parallelism), "fsdp"
(data parallelism with parameters and optimizer state sharded over it, ZeRO-3 style), "expert"
(expert parallelism: MoE layers split their experts over it; everywhere else it is one more
data-parallel axis, as in MaxText), "context" (the sequence dimension of batches and activations
split over it), "tensor" (Megatron-style tensor parallelism over heads and the FFN's hidden
dimension). Every axis is in every mesh; unused ones have size 1.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from aiinfra_jax.config import ConfigError, MeshConfig
from aiinfra_jax.models.partitioning import logical_spec

log = logging.getLogger(__name__)

MESH_AXES: tuple[str, ...] = MeshConfig.axis_names()
# The data-parallel axes: a batch's rows are split over all of them.
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
# The axes a batch's (and an activation's) sequence dimension is split over.
SEQ_AXES: tuple[str, ...] = ("context",)

# Logical axis name -> mesh axes (used together, in this order). Unlisted names are replicated.
RULES: dict[str, tuple[str, ...]] = {
    # activations
    "batch": BATCH_AXES,
    "seq": SEQ_AXES,
    "length": SEQ_AXES,
    # parameters (and the activation dimensions of the same name)
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "expert": ("expert",),
    "head_dim": (),
    "layers": (),
    "norm": (),
    "conv_width": (),
}


def maybe_initialize_distributed(cfg: MeshConfig) -> None:
    """Calls jax.distributed.initialize() for multi-host runs (when the environment says so)."""
    if cfg.distributed == "off":
        return
    env_says = any(k in os.environ for k in ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS",
                                             "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS",
                                             "OMPI_COMM_WORLD_SIZE"))
    if cfg.distributed == "on" or env_says:
        try:
            jax.distributed.initialize()
        except RuntimeError as e:  # already initialised
            if "already" not in str(e):
                raise


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, ...]:
    """The size of each of MESH_AXES (in that order) on n_devices, with -1 filled in."""
    sizes = cfg.axis_sizes()
    product = "*".join(MESH_AXES)
    fixed = math.prod(s for s in sizes.values() if s != -1)
    rest = [name for name, s in sizes.items() if s == -1]
    if rest:
        if n_devices % fixed:
            raise ConfigError(f"mesh: the fixed axis sizes {sizes} (product {fixed}) do not divide "
                              f"the {n_devices} devices, so mesh.{rest[0]}=-1 has no whole size; "
                              f"change the fixed sizes or set mesh.num_devices to a multiple of "
                              f"{fixed}")
        sizes[rest[0]] = n_devices // fixed
    total = math.prod(sizes.values())
    if total != n_devices:
        raise ConfigError(f"mesh: {product} = {total} ({sizes}) but {n_devices} devices are used; "
                          f"set one axis to -1 or set mesh.num_devices={total}")
    return tuple(sizes[name] for name in MESH_AXES)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if cfg.num_devices:
        if cfg.num_devices > len(devices):
            raise ConfigError(f"mesh.num_devices={cfg.num_devices}: only {len(devices)} devices "
                              f"are visible")
        devices = devices[: cfg.num_devices]
    shape = mesh_shape(cfg, len(devices))
    try:
        arr = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # odd device counts on CPU: a plain reshape is as good
        arr = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(arr, MESH_AXES)


def rules_for_flax(rules: dict[str, tuple[str, ...]] = RULES) -> tuple[tuple, ...]:
    """The rules table as Flax's LogicalRules: ((logical name, mesh axes), ...)."""
    return tuple(rules.items())


def logical_to_spec(logical_axes, shape, mesh: Mesh, rules=RULES) -> P:
    """PartitionSpec for an array with these logical axis names and this shape on `mesh`."""
    return logical_spec(logical_axes, shape, dict(mesh.shape), rules_for_flax(rules))


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: dict[str, tuple[str, ...]] = RULES):
    """Context under which models' `constrain(x, logical_axes)` calls shard activations on `mesh`
    by `rules`: sets the mesh (`jax.set_mesh`; constrain and the kernels' shard_map read it as
    `jax.sharding.get_abstract_mesh()`) and Flax's logical-axis rules (`nnx.logical_axis_rules`).
    Both are read when a function is traced, so the first call of a jitted function (or its
    `.lower()`) must happen inside it:

        with shd.activation_rules(mesh):
            state, metrics = jtrain(state, batch)

    Keep it around the calls that trace, not around a whole program: under a concrete mesh every
    jit must run on that mesh's devices, which breaks unrelated computations on other devices (a
    benchmark's, a checkpoint writer's). For a step function, `with_activation_rules` is simpler.
    Outside a jit only: inside one, use `with_activation_rules`.
    """
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules_for_flax(rules)):
        yield


def with_activation_rules(fn, mesh: Mesh, rules: dict[str, tuple[str, ...]] = RULES):
    """fn run with `rules` and `mesh` in context, entered inside fn itself: wrap a step before
    jitting it,

        jtrain = jax.jit(shd.with_activation_rules(train_step, mesh), in_shardings=...)

    and every trace of it (first call, `.lower()`, a retrace for new shapes) gets the activation
    constraints, while nothing is set outside it. Inside a trace only the abstract mesh can be set
    (`jax.sharding.use_abstract_mesh`), so the jit must learn its devices from its in_shardings or
    its arguments' shardings, as the trainer's steps do."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
                nnx.logical_axis_rules(rules_for_flax(rules)):
            return fn(*args, **kwargs)

    return wrapped


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def map_variables(fn, state):
    """Applies fn(variable) to every nnx.Variable of `state`; returns a plain nested dict.

    The trainer keeps parameters as plain dicts (`nnx.to_pure_dict`) so that jit shardings, optax
    and orbax all see the same simple tree; this gives per-parameter trees of the same structure.
    """
    return nnx.to_pure_dict(jax.tree.map(fn, state, is_leaf=_is_var))


def variable_logical_axes(var) -> tuple[str | None, ...] | None:
    axes = var.get_metadata().get("logical_axes")
    if axes is not None and len(axes) != len(var.shape):
        raise ValueError(f"a parameter of shape {var.shape} declares logical_axes {axes} of a "
                         f"different rank")
    return axes


def param_shardings(state, mesh: Mesh, rules=RULES):
    """NamedShardings (plain nested dict) for an nnx.State, read from `logical_axes` metadata."""
    return map_variables(
        lambda v: NamedSharding(mesh, logical_to_spec(variable_logical_axes(v), v.shape, mesh,
                                                      rules)), state)


def _split_axes(mesh: Mesh, axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)


def batch_spec(mesh: Mesh) -> P:
    """[B, T, ...] batches: rows split over the data-parallel axes (data, fsdp, expert); with a
    context axis of size > 1, the sequence dimension split over it too."""
    rows = tuple(a for a in BATCH_AXES if a in mesh.shape)
    seq = _split_axes(mesh, SEQ_AXES)
    if not seq:
        return P(rows)
    return P(rows, seq[0] if len(seq) == 1 else seq)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """NamedSharding of `batch_spec`: every [B, T] array of a batch gets it."""
    return NamedSharding(mesh, batch_spec(mesh))


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways a batch's rows are split: the product of the data-parallel axes."""
    return math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def context_parallel_size(mesh: Mesh) -> int:
    """How many ways a batch's sequence dimension is split."""
    return math.prod(mesh.shape.get(a, 1) for a in SEQ_AXES)


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host batch (this process's rows) -> global arrays sharded as `batch_sharding`."""
    sharding = batch_sharding(mesh)
    cp = context_parallel_size(mesh)
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        if cp > 1 and (v.ndim < 2 or v.shape[1] % cp):
            raise ValueError(f"batch[{k!r}] has shape {v.shape}: its sequence dimension must be a "
                             f"multiple of the mesh's context axes ({'*'.join(SEQ_AXES)} = {cp}); "
                             f"set data.seq_len to a multiple of {cp}")
        out[k] = jax.make_array_from_process_local_data(sharding, v)
    return out
