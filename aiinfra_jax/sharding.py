"""Device mesh from config, one logical-axis rules table, and helpers to shard params and batches.

Model code names the axes of its parameters logically (`nnx.Param(..., logical_axes=("embed", "mlp"))`)
and never mentions the mesh. `RULES` maps each logical name to mesh axes. A dimension that the mapped
mesh axes do not divide, or whose mesh axes an earlier dimension of the same array already uses, stays
replicated (so small models and odd sizes always run; the rule is the same on every backend).

Mesh axes: "data" (pure data parallelism), "fsdp" (data parallelism with parameters and optimizer
state sharded over it, ZeRO-3 style), "tensor" (Megatron-style tensor parallelism over heads and the
FFN's hidden dimension).
"""

from __future__ import annotations

import logging
import math
import os

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from aiinfra_jax.config import ConfigError, MeshConfig

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical axis name -> mesh axes (in order of preference). Unlisted names are replicated.
RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
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


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % fixed:
            raise ConfigError(f"mesh: the fixed axis sizes {dict(zip(MESH_AXES, sizes))} (product "
                              f"{fixed}) do not divide the {n_devices} devices")
        sizes[sizes.index(-1)] = n_devices // fixed
    if math.prod(sizes) != n_devices:
        raise ConfigError(f"mesh: data*fsdp*tensor = {math.prod(sizes)} but {n_devices} devices are "
                          f"used; set one axis to -1 or set mesh.num_devices={math.prod(sizes)}")
    return tuple(sizes)


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


def logical_to_spec(logical_axes, shape, mesh: Mesh, rules=RULES) -> P:
    """PartitionSpec for an array with these logical axis names and this shape on `mesh`."""
    if logical_axes is None:
        return P()
    used: set[str] = set()
    spec = []
    for name, dim in zip(logical_axes, shape):
        axes = tuple(a for a in rules.get(name, ()) if mesh.shape.get(a, 1) > 1 and a not in used)
        size = math.prod(mesh.shape[a] for a in axes)
        if axes and dim % size == 0:
            used.update(axes)
            spec.append(axes if len(axes) > 1 else axes[0])
        else:
            spec.append(None)
    return P(*spec)


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


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are split over the data-parallel axes on their leading dimension."""
    return NamedSharding(mesh, P(BATCH_AXES))


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host batch (this process's rows) -> global arrays sharded over the batch axes."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in batch.items()}
