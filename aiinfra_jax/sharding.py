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

Multi-process runs: `maybe_initialize_distributed` starts JAX's distributed runtime from the mesh
config or the environment, with bounded waits; `exchange` and `from_process_0` are the meeting
points of the processes (JAX's key-value store, each wait bounded, a DistributedError naming the
process that did not come).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from aiinfra_jax.config import ConfigError, MeshConfig
from aiinfra_jax.errors import UserError
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


class DistributedError(UserError, RuntimeError):
    """The processes of a multi-process run could not meet: one never came, or failed, or they
    disagree. The message names the processes and what to do."""


# Multi-process jobs that jax.distributed.initialize() recognises by itself (cluster detection):
# a variable of the job's environment and how to read its number of processes from it.
_CLUSTERS = (
    ("SLURM_NTASKS", "SLURM", int),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI", int),
    ("TPU_WORKER_HOSTNAMES", "TPU pod", lambda v: len([h for h in v.split(",") if h.strip()])),
)
# Seconds JAX's own initialization timeout gives beyond ours, so that ours (with its message)
# fires first when processes never meet.
_JAX_INIT_MARGIN_S = 15


def _env_int(name: str, key: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} (read for mesh.{key}) is not an integer") from None


def launch_settings(cfg: MeshConfig) -> tuple[str, int | None, int | None]:
    """(coordinator "host:port" or "", process count or None, process id or None): each from
    the mesh config when set there, else from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID; None (or "") leaves it to JAX's cluster detection."""
    coordinator = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip()
    count = cfg.num_processes or _env_int("JAX_NUM_PROCESSES", "num_processes")
    pid = cfg.process_id if cfg.process_id >= 0 else _env_int("JAX_PROCESS_ID", "process_id")
    return coordinator, count, pid


def _cluster_job() -> str | None:
    """The name of the multi-process cluster job this process runs in, if JAX can detect one."""
    for var, name, count in _CLUSTERS:
        value = os.environ.get(var)
        if value:
            try:
                if count(value) > 1:
                    return name
            except ValueError:
                continue
    return None


def maybe_initialize_distributed(cfg: MeshConfig) -> None:
    """Starts JAX's distributed runtime for a multi-process run, before any JAX computation.

    By ``cfg.distributed`` (see MeshConfig): "off" never; "auto" when a coordinator is given
    (``mesh.coordinator_address`` or JAX_COORDINATOR_ADDRESS; then ``num_processes`` and
    ``process_id`` are needed too, from the mesh config or JAX_NUM_PROCESSES / JAX_PROCESS_ID) or
    when the job is a multi-process SLURM, Open MPI or TPU-pod job, whose settings JAX reads
    itself (a bare ``jax.distributed.initialize()``); "on" always. A no-op once initialized.

    Timeouts: every process waits at most ``cfg.init_timeout_s`` for the others to join; past it,
    a watchdog prints which process gave up waiting and what to check, and ends the process (exit
    status 1; JAX itself would abort a moment later with a less telling message). While running, a
    process that sends no heartbeat for ``cfg.heartbeat_timeout_s`` (at once: one whose connection
    closes) counts as dead, and JAX's distributed service stops all the others ("Terminating
    process because the JAX distributed service detected fatal errors ... another task died").
    At exit a process waits at most ``cfg.init_timeout_s`` for the others to finish too.
    """
    if cfg.distributed == "off" or jax.distributed.is_initialized():
        return
    coordinator, count, pid = launch_settings(cfg)
    cluster = _cluster_job()
    if cfg.distributed == "auto" and not coordinator and not cluster:
        if (count or 1) > 1:
            raise ConfigError(f"mesh.num_processes={count} (or JAX_NUM_PROCESSES) but no "
                              "coordinator: set mesh.coordinator_address=HOST:PORT (process 0's "
                              "host and a free port) or JAX_COORDINATOR_ADDRESS on every process")
        return
    if coordinator and not cluster and (count is None or pid is None):
        raise ConfigError(f"mesh.coordinator_address={coordinator!r} needs the number of processes "
                          "and this process's id: set mesh.num_processes and mesh.process_id "
                          "(or JAX_NUM_PROCESSES and JAX_PROCESS_ID) on every process")
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") in (None, "none"):
        # Cross-process collectives of the CPU backend (gloo is the default in recent JAX).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    wanted = {"coordinator_address": coordinator or None, "num_processes": count,
              "process_id": pid,
              "initialization_timeout": cfg.init_timeout_s + _JAX_INIT_MARGIN_S,
              "heartbeat_timeout_seconds": cfg.heartbeat_timeout_s,
              "shutdown_timeout_seconds": cfg.init_timeout_s}
    accepted = inspect.signature(jax.distributed.initialize).parameters
    kwargs = {k: v for k, v in wanted.items() if k in accepted and v is not None}
    where = coordinator or f"the coordinator of the {cluster} job"
    who = (f"process {pid if pid is not None else '?'} of {count or '?'}")
    watchdog = threading.Timer(cfg.init_timeout_s, _give_up_waiting, args=(
        f"{who}: after mesh.init_timeout_s={cfg.init_timeout_s} s, not every process has joined "
        f"{where}. Check that all {count or 'the'} processes were started, each with the same "
        "mesh.coordinator_address (or JAX_COORDINATOR_ADDRESS) and mesh.num_processes (or "
        "JAX_NUM_PROCESSES) and its own mesh.process_id (or JAX_PROCESS_ID)"
        + (f" in 0..{count - 1}" if count else "")
        + ", and that process 0's host accepts connections on that port; then start them all "
        "again.",))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**kwargs)
    except ValueError as e:  # settings JAX could neither read nor detect
        raise ConfigError(f"mesh.distributed={cfg.distributed!r}: jax.distributed.initialize "
                          f"cannot start ({e}); set mesh.coordinator_address, num_processes and "
                          "process_id (or their JAX_* variables), or run in a SLURM / Open MPI / "
                          "TPU-pod job") from e
    except RuntimeError as e:
        if "already" in str(e) and "initialize" in str(e) and jax.distributed.is_initialized():
            return
        raise DistributedError(
            f"{who}: jax.distributed.initialize failed ({e}). It must run before anything "
            "starts JAX's backends (a jax.devices() call, a computation): construct the Trainer "
            "(or call aiinfra_jax.sharding.maybe_initialize_distributed) first") from e
    finally:
        watchdog.cancel()
    log.info("distributed: process %d of %d (%d local devices)", jax.process_index(),
             jax.process_count(), jax.local_device_count())


def _give_up_waiting(message: str) -> None:
    """The end of a process whose peers never came: the message, then exit status 1 (called by a
    watchdog thread while the main thread is stuck inside JAX)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


_meetings = itertools.count()


def _client():
    """JAX's distributed runtime client (its key-value store and barriers), as orbax reaches it."""
    from jax._src import distributed  # pylint: disable=import-outside-toplevel

    return distributed.global_state.client


def exchange(what: str, value: Any, timeout_s: float) -> list[Any]:
    """Every process's ``value`` (JSON-able), by process index: a meeting of all processes, which
    must call it in the same order with the same ``what`` (it names the meeting in errors). With
    one process, ``[value]``. A process that does not arrive within ``timeout_s`` raises a
    DistributedError naming it, in every process that waited for it."""
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return [value]
    client = _client()
    if client is None:
        raise DistributedError(f"{n} processes but JAX's distributed runtime is not running; set "
                               "mesh.distributed=on (or call jax.distributed.initialize() first)")
    key = f"aiinfra_jax/{next(_meetings)}/{what.replace('/', '_')}"
    client.key_value_set(f"{key}/{me}", json.dumps(value))
    values = []
    for i in range(n):
        try:
            values.append(json.loads(client.blocking_key_value_get(f"{key}/{i}",
                                                                   int(timeout_s * 1000))))
        except Exception as e:  # the client raises its runtime's errors (deadline, unavailable)
            raise DistributedError(
                f"process {me} of {n} waited {timeout_s:g} s for process {i} at the meeting "
                f"'{what}', and it never came ({type(e).__name__}: {str(e)[:200]}). Process {i} "
                "failed, hangs, or runs other code or another config: see its log, then start "
                "all processes again (mesh.init_timeout_s sets this wait)") from e
    return values


def from_process_0(what: str, compute: Callable[[], Any], timeout_s: float) -> Any:
    """``compute()`` run on process 0 only, its result (JSON-able; returned as JSON reads it back)
    handed to every process. An exception there is raised in process 0 and, as a ConfigError
    (for a ConfigError) or a DistributedError naming it, in every other process."""
    if jax.process_count() == 1:
        return compute()
    if jax.process_index() == 0:
        try:
            value = compute()
        except Exception as e:
            kind = "config_error" if isinstance(e, ConfigError) else "error"
            exchange(what, {kind: str(e) if kind == "config_error"
                            else f"{type(e).__name__}: {e}"}, timeout_s)
            raise
        mine = {"value": value}
    else:
        mine = None
    got = exchange(what, mine, timeout_s)[0]
    if "config_error" in got:
        raise ConfigError(got["config_error"])
    if "error" in got:
        raise DistributedError(f"process 0 failed at '{what}' ({got['error']}); see its log")
    return got["value"]


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
