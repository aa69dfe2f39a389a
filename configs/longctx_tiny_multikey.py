"""Stage 2 of the long-context recipe: the preset's checkpoint trained on with twice the multikey
share (issue 5, "Tenth attempt" in eval/BENCHMARKS.md).

    python train.py --config configs/longctx_tiny.py            # runs/longctx_tiny, steps 1-3000
    python train.py --config configs/longctx_tiny_multikey.py   # runs/longctx_tiny_multikey, 3001-5500
    python train.py --config configs/longctx_tiny_wordkeys.py   # runs/longctx_tiny_wordkeys, 5501-7500

Steps 3001-5500 start from ``runs/longctx_tiny`` (``checkpoint.initialize_from``: params,
optimizer state and step) with one data stage: the preset's retrieval mixture with the three
multikey variants added as sources of their own, so multikey is 26% of documents instead of 13%.
The cosine schedule is the preset's stretched to 5500 steps, so the learning rate rises again at
step 3000 (to 1.9e-3; the preset ended at 4e-4): the in-loop score dipped at step 4000 before it
rose. Measured (2026-12-01, ~90 min here): NIAH 71.9 / 28.4 / 17.5% at 512 / 1k / 2k (the preset:
63.8 / 34.1 / 16.2%), word-key multikey still 10 / 20%.
"""

import dataclasses
from pathlib import Path

from aiinfra_jax.config import load_preset

_c = load_preset(Path(__file__).with_name("longctx_tiny.py"))
# The preset's retrieval sources with the three multikey variants inserted after `synthetic:niah`,
# each with the same options (loss weights) as the NIAH group.
_src = _c.data.sources
_niah = next(i for i, s in enumerate(_src) if s.startswith("synthetic:niah:"))
SOURCES = (_src[: _niah + 1]
           + tuple(_src[_niah].replace("niah:", f"niah_multikey_{i}:", 1) for i in (1, 2, 3))
           + _src[_niah + 1:])

CONFIG = dataclasses.replace(
    _c,
    data=dataclasses.replace(_c.data, sources=SOURCES,
                             weights=(0.05, 0.30, 0.05, 0.05, 0.05, 0.05, 0.15, 0.05, 0.25),
                             stages=()),
    checkpoint=dataclasses.replace(_c.checkpoint, keep=6, initialize_from="runs/longctx_tiny"),
    run=dataclasses.replace(_c.run, name="longctx_tiny_multikey", steps=5500),
)
