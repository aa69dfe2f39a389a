"""cost_estimate for the depth-attention Pallas kernels (shared by the GPU and TPU versions).

Letters: Q queries, S sources (depth slots), N tokens, D d_model.
"""

from __future__ import annotations

from jax.experimental import pallas as pl


def cost_estimate(Q, S, N, D, itemsize, backward):
    reads = S * N * D * itemsize
    if not backward:
        return pl.CostEstimate(flops=int(S * N * D * (3 + 4 * Q)), transcendentals=int(S * N * Q),
                               bytes_accessed=int(reads + 4 * Q * N * D + 4 * Q * N))
    return pl.CostEstimate(flops=int(S * N * D * (5 + 10 * Q)), transcendentals=int(S * N * Q),
                           bytes_accessed=int(2 * reads + 4 * Q * N * D + 8 * Q * N))
