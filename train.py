#!/usr/bin/env python
"""Train a model: a thin CLI over aiinfra_jax.train.

    python train.py --config configs/tiny.py --set model.d_model=256 --set optim.lr=3e-4
"""

import sys

from aiinfra_jax.train import main

if __name__ == "__main__":
    sys.exit(main())
