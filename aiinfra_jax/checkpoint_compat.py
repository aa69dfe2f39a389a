"""What a checkpoint must agree with before it is restored: the saved config (``config_differences``,
``check_compatible``) and the state's tree (``to_abstract``, ``first_structure_mismatch``), with
the path naming used in every checkpoint message (``params/layers/0/attn/wq``). Split from
checkpoint.py, whose ``Checkpointer`` raises these errors; the names are re-exported there."""

from __future__ import annotations

import json
import logging
from typing import Any, Collection, Sequence

import jax
import numpy as np

from aiinfra_jax.config import canonical_section, runtime_keys
from aiinfra_jax.errors import UserError

__all__ = [
    "IncompatibleCheckpointError",
    "check_compatible",
    "config_differences",
    "first_structure_mismatch",
    "flatten_by_path",
    "json_normalise",
    "path_str",
    "to_abstract",
]

logger = logging.getLogger("aiinfra_jax.checkpoint")


class IncompatibleCheckpointError(UserError, ValueError):
    """A readable checkpoint does not fit the current run (config or state structure differs)."""


# --------------------------------------------------------------------------------------------------
# Config compatibility
# --------------------------------------------------------------------------------------------------

_MISSING = "<missing>"


def json_normalise(value: Any) -> Any:
    """What ``value`` becomes after a JSON round trip (tuples -> lists, int keys -> str keys)."""
    return json.loads(json.dumps(value))


def _flatten_dict(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        if not value:
            return {prefix: {}}
        flat: dict[str, Any] = {}
        for key, sub in value.items():
            flat.update(_flatten_dict(sub, f"{prefix}.{key}"))
        return flat
    return {prefix: value}


def _canonical(config: dict, section: str) -> Any:
    """``config[section]`` as this version writes it (``canonical_section``), so a checkpoint from
    before a setting was added or renamed compares equal where nothing really changed."""
    value = config.get(section, _MISSING)
    return canonical_section(section, value) if isinstance(value, dict) else value


def config_differences(saved_config: dict, config: dict, sections: Sequence[str], *,
                       skip: Collection[str] = (), only: Collection[str] | None = None
                       ) -> list[str]:
    """One line per dotted key of ``sections`` whose value differs between ``saved_config`` and
    ``config`` (compared after a JSON round trip, so a tuple equals the list it was saved as);
    keys in ``skip`` are left out, and with ``only`` just those keys are compared."""
    if isinstance(sections, str):
        raise TypeError(f"sections must be a sequence of section names, got the string {sections!r}")
    saved = json_normalise(saved_config)
    current = json_normalise(config)
    if not isinstance(saved, dict) or not isinstance(current, dict):
        raise TypeError(
            f"configs must be dicts, got {type(saved_config).__name__} and {type(config).__name__}"
        )
    diffs: list[str] = []
    for section in sections:
        old = _flatten_dict(_canonical(saved, section), section)
        new = _flatten_dict(_canonical(current, section), section)
        for key in sorted(set(old) | set(new)):
            if key in skip or (only is not None and key not in only):
                continue
            old_value, new_value = old.get(key, _MISSING), new.get(key, _MISSING)
            if old_value != new_value:
                diffs.append(f"  {key}: checkpoint {old_value!r}, current {new_value!r}")
    return diffs


def check_compatible(
    saved_config: dict,
    config: dict,
    sections: Sequence[str] = ("model",),
    *,
    source: str = "the checkpoint",
) -> None:
    """Raises ``IncompatibleCheckpointError`` if ``saved_config`` and ``config`` differ in ``sections``
    in anything but run-time settings (``runtime_keys``: kernel implementation, remat, compute
    dtype, ...), whose differences are logged instead.

    The error lists every differing dotted key (``config_differences``) with its saved
    ("checkpoint") and current value; ``source`` names where ``saved_config`` came from.
    """
    runtime = runtime_keys()
    allowed = config_differences(saved_config, config, sections, only=runtime)
    if allowed:
        logger.warning("%s: run-time settings differ from the saved ones (allowed):\n%s", source,
                       "\n".join(allowed))
    diffs = config_differences(saved_config, config, sections, skip=runtime)
    if diffs:
        raise IncompatibleCheckpointError(
            f"{source} was written with a different {'/'.join(sections)} config than the current run; "
            f"{len(diffs)} key(s) differ:\n" + "\n".join(diffs) + "\n"
            "Fix: run with the checkpoint's settings (they are saved in its 'config' item), or start "
            "the new configuration in a fresh checkpoint directory."
        )


# --------------------------------------------------------------------------------------------------
# Tree helpers
# --------------------------------------------------------------------------------------------------


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: tuple) -> str:
    return "/".join(_key_name(k) for k in path) or "<root>"


def flatten_by_path(tree: Any) -> dict[str, Any]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {path_str(path): leaf for path, leaf in leaves}


def to_abstract(abstract_state: Any) -> Any:
    """Checks ``abstract_state`` leaves and turns concrete ``jax.Array`` leaves into ShapeDtypeStructs."""

    def convert(path: tuple, leaf: Any) -> jax.ShapeDtypeStruct:
        if isinstance(leaf, jax.Array):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            if getattr(leaf, "sharding", None) is None:
                raise ValueError(
                    f"abstract_state leaf {path_str(path)!r} has no sharding; build it as "
                    "jax.ShapeDtypeStruct(shape, dtype, sharding=...) (or pass the initialised state) "
                    "so the checkpoint is restored onto the intended devices"
                )
            return leaf
        raise TypeError(
            f"abstract_state leaf {path_str(path)!r} is a {type(leaf).__name__}; expected "
            "jax.ShapeDtypeStruct (with .sharding) or jax.Array"
        )

    return jax.tree_util.tree_map_with_path(convert, abstract_state)


def first_structure_mismatch(saved: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """Describes the first path where the saved metadata and the wanted abstract state differ."""
    problems: list[str] = []
    for path, want in wanted.items():
        if path not in saved:
            problems.append(f"{path!r} is in the current state but not in the checkpoint")
            continue
        have = saved[path]
        have_shape = tuple(getattr(have, "shape", ()) or ())
        if have_shape != tuple(want.shape):
            problems.append(f"{path!r} has shape {have_shape} in the checkpoint, {tuple(want.shape)} now")
            continue
        have_dtype = getattr(have, "dtype", None)
        if have_dtype is not None and np.dtype(have_dtype) != np.dtype(want.dtype):
            problems.append(
                f"{path!r} has dtype {np.dtype(have_dtype).name} in the checkpoint, "
                f"{np.dtype(want.dtype).name} now"
            )
    for path in saved:
        if path not in wanted:
            problems.append(f"{path!r} is in the checkpoint but not in the current state")
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more mismatching path(s))" if len(problems) > 1 else ""
    return problems[0] + more
