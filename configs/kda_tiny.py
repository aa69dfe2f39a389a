"""A tiny Kimi Delta Attention model: configs/tiny.py with every mixer "kda" (per-channel decay;
models/attention/gated_delta.py). Same sizes as configs/gdn_tiny.py."""

import dataclasses

from aiinfra_jax.config import load_preset

_TINY = load_preset(__file__.replace("kda_tiny.py", "tiny.py"))

CONFIG = dataclasses.replace(
    _TINY,
    model=dataclasses.replace(_TINY.model, mixers=("kda",)),
    run=dataclasses.replace(_TINY.run, name="kda_tiny"),
)
