"""Auxiliary outputs of a component: losses, metrics and diagnostics, through Flax's `sow`.

A mixer, FFN or residual scheme reports them from inside its `__call__`:

    report_loss(self, "balance", value)        scalar, added to the training objective as given
                                               (weight it by the component's own config field,
                                               a `runtime_field` so `--set` can change it)
    report_metric(self, "recall", value)       scalar, logged per layer and averaged over layers
                                               (NaN in a layer it does not apply to, e.g. an
                                               MSA layer that does not route: left out of the
                                               average)
    record(self, "selected_blocks", array)     any array, for diagnostics (returned on request)

Each is stored on the module as an `nnx.Intermediate` (or subclass) variable under that name, as
`Module.sow` does (a loss reported twice in one pass is summed; a metric or a record keeps the last
value). The Transformer pops them after
every block call inside the layer scan (`pop_outputs`), so they pass through the scan and remat as
ordinary outputs, and returns them as

    aux = {"losses": {name: sum over layers}, "metrics": {name: mean over layers,
           "name/layer_<i>": per layer}, "intermediates": {"layer_<i>/name": array}}

where name is the path below the layer ("ffn/balance", "mixer/gates"). Intermediates are returned
only when the caller asks (`capture_intermediates=True`); otherwise they are dropped inside the
traced function and XLA removes their computation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


class AuxLoss(nnx.Intermediate):
    """A scalar added to the training loss."""


class AuxMetric(nnx.Intermediate):
    """A scalar logged per layer and averaged."""


KINDS = {"losses": AuxLoss, "metrics": AuxMetric, "intermediates": nnx.Intermediate}


def _store(module: nnx.Module, var_type: type, name: str, value: Any, add: bool = False) -> None:
    # What Module.sow does outside nnx.capture (deprecated there since flax 0.12): the value lives
    # in a variable of this type on the module, so nnx.pop(module, var_type) finds it. Done by
    # hand so the same code runs on every flax this project supports.
    current = getattr(module, name, None)
    if current is not None and not isinstance(current, var_type):
        raise ValueError(f"{type(module).__name__}.{name} is already an attribute that is not a "
                         f"{var_type.__name__}; report the output under another name")
    if add and current is not None:
        value = current[...] + value
    setattr(module, name, var_type(value))


def report_loss(module: nnx.Module, name: str, value: jax.Array) -> None:
    _store(module, AuxLoss, name, jnp.asarray(value, jnp.float32), add=True)


def report_metric(module: nnx.Module, name: str, value: jax.Array) -> None:
    _store(module, AuxMetric, name, jnp.asarray(value, jnp.float32))


def record(module: nnx.Module, name: str, value: jax.Array) -> None:
    _store(module, nnx.Intermediate, name, value)


def _flatten(tree: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    if isinstance(tree, dict):
        out = {}
        for key, sub in tree.items():
            out.update(_flatten(sub, prefix + (key,)))
        return out
    return {prefix: tree}


def pop_outputs(module: nnx.Module) -> dict[str, dict[str, Any]]:
    """Removes every reported output from `module` and its submodules: {kind: {path: value}} with
    kind in KINDS and path the attribute names / indices down to the value's name joined by "/"
    ("layers/1/ffn/balance"). The specific kinds are popped before the plain nnx.Intermediate
    (their base class)."""
    out = {}
    for kind, var_type in KINDS.items():
        state = nnx.pop(module, var_type)
        out[kind] = {"/".join(map(str, path)): value
                     for path, value in _flatten(nnx.to_pure_dict(state)).items()
                     if value is not None}
    return out


def empty() -> dict[str, dict]:
    return {kind: {} for kind in KINDS}
