"""Choosing a kernel implementation: one rule for every op in kernels/.

Implementations (the `implementation=` argument of every public op):
  None          the best available for the platform the function is LOWERED for: "pallas_gpu"
                when lowered for cuda or rocm, "pallas_tpu" for tpu, "xla" for every other platform
                (cpu); an op whose Pallas kernel measured slower than its XLA path on a platform
                picks "xla" there (select's `automatic`; gated_delta on cuda). An automatically
                chosen Pallas kernel that cannot take the given shapes gives way to "xla" on its
                platform, and says so in the log (a warning, emitted when the function is lowered
                for that platform).
  "xla"         the chunked plain-JAX path; runs on every platform.
  "pallas_gpu"  the Pallas kernel for NVIDIA / AMD GPUs (Triton lowering; cuda, rocm).
  "pallas_tpu"  the Pallas kernel for TPUs (Mosaic lowering).

How the choice is made. Nothing here asks for jax.default_backend(): a function traced on a CPU
host may be lowered for cuda or tpu (`jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))`).
So `select` returns a static Selection (implementation per lowering platform) and `run` stages it
with `jax.lax.platform_dependent`: every branch is traced (tracing a kernel needs no accelerator),
and only the branch of the lowering platform is lowered and compiled. The ops call `run` inside
their custom_vjp's forward and backward (every implementation saves the same residuals), so
gradients never differentiate through the platform switch. Cost: tracing an op with
implementation=None also traces the Pallas kernels (a fraction of a second per op); compiled code
and memory are those of the chosen branch alone. Lowering for several platforms at once
(lowering_platforms=("cpu", "cuda")) does not work with a Pallas branch: JAX lowers a pallas_call
for every platform of the module, not only for its branch's.

Static decisions (from shapes, dtypes and the call's arguments) are made at trace time:
  - an unknown implementation name raises a ValueError;
  - an explicit Pallas implementation whose kernel cannot take the shapes raises a ValueError;
  - an explicit Pallas implementation under a mesh with a "context" axis > 1 raises a ValueError
    (kernels/_sharding.py);
  - implementation=None: per platform, a kernel that cannot take the shapes is replaced by "xla"
    (logged when lowered for that platform); otherwise, under a "context" axis > 1, the Pallas
    branches raise the context-parallel ValueError when lowered (the "xla" branch still runs on
    CPU, partitioned by GSPMD).
Platform decisions are made at lowering time: an explicit "pallas_gpu" / "pallas_tpu" without
interpret=True lowers its kernel for its own platforms and, for any other lowering platform (CPU,
or the other accelerator), raises a ValueError naming the implementation, the platform and the fix.
An eager call lowers immediately, so the error comes from the call itself; under jit it comes from
the first call (or .lower()). `interpret=True` runs the chosen Pallas kernel in Pallas interpret
mode on every platform (how the CPU test suite checks kernels): no platform switch at all.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax
from jax.extend import core as _core
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir

from . import _sharding

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu")
# Lowering platforms (jax.lax.platform_dependent names) each Pallas implementation compiles for.
PLATFORMS = {"pallas_gpu": ("cuda", "rocm"), "pallas_tpu": ("tpu",)}

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Branch:
    """What runs on some lowering platforms: an implementation, plus a warning to log or an
    error to raise when the branch is lowered (messages may name the platform as {platform})."""

    implementation: str
    warning: str | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Selection:
    """Implementation per lowering platform (static, hashable: it rides in custom_vjp config).

    per_platform: ((platforms, Branch), ...) for the named platforms; default: every other one.
    """

    default: Branch
    per_platform: tuple[tuple[tuple[str, ...], Branch], ...] = ()

    @staticmethod
    def only(implementation: str) -> "Selection":
        """`implementation` on every platform, unchecked (internal entries and tests)."""
        return Selection(Branch(implementation))


def check_name(op: str, implementation: str | None) -> None:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation={implementation!r} is not one of "
                         f"{(None,) + IMPLEMENTATIONS}")


def select(op: str, implementation: str | None, *, interpret: bool = False,
           unsupported: Callable[[str], str | None] = lambda impl: None,
           automatic: tuple[str, ...] = ("pallas_gpu", "pallas_tpu")) -> Selection:
    """The Selection for one call of `op` (see the module docstring for the rule).

    unsupported(impl) -> None if Pallas implementation `impl` takes this call's shapes, else the
    reason it cannot. automatic: the Pallas implementations implementation=None may choose; on
    the platforms of any other, None means "xla" (an op whose kernel measured slower than its XLA
    path there says so where it passes this). Reads the context mesh (kernels/_sharding.py) for
    the context-parallel check.
    """
    check_name(op, implementation)
    if implementation == "xla":
        return Selection.only("xla")
    blocked = _sharding.context_parallel_error(op)
    if implementation is not None:
        reason = unsupported(implementation)
        if reason is not None:
            raise ValueError(f"{op}: implementation={implementation!r} cannot run these shapes: "
                             f"{reason}. Use implementation=None or 'xla'.")
        if blocked is not None:
            raise ValueError(blocked)
        if interpret:
            return Selection.only(implementation)
        platforms = PLATFORMS[implementation]
        error = (f"{op}: implementation={implementation!r} compiles only for "
                 f"{' / '.join(platforms)}, but this computation is being lowered for "
                 "{platform}. Use implementation=None (the best per platform) or 'xla', or pass "
                 f"interpret=True to run the Pallas kernel in interpret mode.")
        return Selection(Branch(implementation, error=error),
                         ((platforms, Branch(implementation)),))
    per_platform = []
    for impl in ("pallas_gpu", "pallas_tpu"):
        reason = unsupported(impl) if impl in automatic else None
        if impl not in automatic:
            branch = Branch("xla")
        elif reason is not None:
            branch = Branch("xla", warning=f"{op}: {impl} cannot run here ({reason}); using the "
                                           "XLA implementation on {platform}")
        elif blocked is not None:
            branch = Branch(impl, error=blocked)
        else:
            branch = Branch(impl)
        per_platform.append((PLATFORMS[impl], branch))
    return Selection(Branch("xla"), tuple(per_platform))


def shard_plan(op: str, selection: Selection, *, batch: int, heads: int | None = None):
    """How this call's Pallas kernels split over the context mesh (kernels/_sharding.plan), or
    None: no mesh, or no branch of `selection` that may run a kernel."""
    branches = [selection.default] + [b for _, b in selection.per_platform]
    if not any(b.implementation != "xla" and b.error is None for b in branches):
        return None
    return _sharding.plan(op, batch=batch, heads=heads)


def run(selection: Selection, fn: Callable, *args):
    """fn(implementation, *args) with the implementation `selection` picks for the lowering
    platform. One implementation everywhere: a plain call. Otherwise jax.lax.platform_dependent
    (every branch traced; the lowering platform's branch lowered)."""
    if not selection.per_platform:
        return _branch(selection.default, fn)(*args)
    per_platform = {}
    for platforms, branch in selection.per_platform:
        call = _branch(branch, fn)
        for p in platforms:
            per_platform[p] = call
    return jax.lax.platform_dependent(*args, default=_branch(selection.default, fn),
                                      **per_platform)


def _branch(branch: Branch, fn: Callable) -> Callable:
    def call(*args):
        if branch.error is not None:
            args = _notice(args, "error", branch.error)
        elif branch.warning is not None:
            args = _notice(args, "warning", branch.warning)
        return fn(branch.implementation, *args)
    return call


# ----------------------------------------------------------------------------------------------
# Lowering-time notices: an identity on the branch's inputs whose lowering rule logs a warning or
# raises a ValueError. Only the branch of the lowering platform is lowered, so the message appears
# exactly when that platform's code is being built (and, for errors, before any kernel is lowered:
# the notice comes first in its branch).

_notice_p = _core.Primitive("kernel_dispatch_notice")
_notice_p.multiple_results = True


def _notice(args, kind: str, message: str):
    leaves, tree = jax.tree.flatten(args)
    if not leaves:
        return args
    return jax.tree.unflatten(tree, _notice_p.bind(*leaves, kind=kind, message=message))


def _notice_impl(*xs, kind, message):
    # Eager: lower (and run) the identity for the current device, which fires the notice.
    return jax.jit(lambda *ys: _notice_p.bind(*ys, kind=kind, message=message))(*xs)


def _notice_lowering(ctx, *xs, kind, message):
    platforms = tuple(getattr(ctx, "platforms", None) or ctx.module_context.platforms or ())
    text = message.replace("{platform}", " / ".join(platforms) or "this platform")
    if kind == "error":
        raise ValueError(text)
    log.warning("%s", text)
    return list(xs)


_notice_p.def_impl(_notice_impl)
_notice_p.def_abstract_eval(lambda *avals, **_: list(avals))
_mlir.register_lowering(_notice_p, _notice_lowering)
_batching.primitive_batchers[_notice_p] = (
    lambda xs, dims, **params: (_notice_p.bind(*xs, **params), dims))
_ad.primitive_jvps[_notice_p] = (
    lambda primals, tangents, **params: (_notice_p.bind(*primals, **params), list(tangents)))
