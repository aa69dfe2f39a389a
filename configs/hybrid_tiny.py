"""A tiny hybrid: three Gated DeltaNet layers then one NSA layer (the Qwen3-Next / Kimi Linear
pattern of recurrent layers with an occasional attention layer), at configs/nsa_tiny.py's sizes;
each layer keeps its own kind of decoding cache."""

import dataclasses

from aiinfra_jax.config import load_preset

_NSA = load_preset(__file__.replace("hybrid_tiny.py", "nsa_tiny.py"))

CONFIG = dataclasses.replace(
    _NSA,
    model=dataclasses.replace(_NSA.model, mixers=("gdn", "gdn", "gdn", "nsa")),
    run=dataclasses.replace(_NSA.run, name="hybrid_tiny"),
)
