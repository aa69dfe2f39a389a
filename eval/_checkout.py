"""Running an eval script as a file from a checkout that is not pip-installed (the GPU machine:
its own python3 and JAX, no install, no network): `python3 eval/<script>.py ...`.

pyproject maps the root's kernels/ and eval/ into the `aiinfra_jax` package, which an uninstalled
checkout does not know. use_this_checkout() puts the repository root first on sys.path (and drops
eval/, which Python put there for the script) and appends the root to aiinfra_jax's __path__, so
`aiinfra_jax.kernels` and `aiinfra_jax.eval` resolve to this checkout's folders, installed or not.
A script calls it before its first `aiinfra_jax` import:

    if __name__ == "__main__" and not __package__:   # run as a file
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # eval/ (runpy and
        import _checkout                                                  # -c do not add it)
        _checkout.use_this_checkout()
"""

from __future__ import annotations

import os
import sys


def use_this_checkout() -> None:
    eval_dir = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(eval_dir)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != eval_dir]
    sys.path.insert(0, root)
    import aiinfra_jax
    if root not in aiinfra_jax.__path__:
        aiinfra_jax.__path__.append(root)
