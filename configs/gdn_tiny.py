"""A tiny Gated DeltaNet model: configs/tiny.py with every mixer "gdn" (models/attention/gated_delta.py).

4 layers, d_model 256, 4 query/key heads of 64 and 4 value heads of 64, short convolutions of
width 4 on q/k/v, the chunkwise kernel with chunks of 64; constant-size decoding state.
KDA is configs/kda_tiny.py; a GDN/NSA hybrid is configs/hybrid_tiny.py.
"""

import dataclasses

from aiinfra_jax.config import load_preset

_TINY = load_preset(__file__.replace("gdn_tiny.py", "tiny.py"))

CONFIG = dataclasses.replace(
    _TINY,
    model=dataclasses.replace(_TINY.model, mixers=("gdn",)),
    run=dataclasses.replace(_TINY.run, name="gdn_tiny"),
)
