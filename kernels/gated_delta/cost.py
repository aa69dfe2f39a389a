"""cost_estimate for the gated-delta state-pass Pallas kernels (shared by the GPU and TPU
versions).

Letters: B batch, HV value heads, N chunks, C chunk length, K / V head dims.
"""

from __future__ import annotations

from jax.experimental import pallas as pl


def cost_estimate(*, B, HV, N, C, K, V):
    """Per chunk: w S, qg S ([C,K] x [K,V]), m u ([C,C] x [C,V]), kdt u ([K,C] x [C,V]); reads
    the chunk operands once, writes o, reads S0 and writes the final state (all float32)."""
    per_chunk_flops = 2 * C * K * V * 3 + 2 * C * C * V + 3 * K * V + C * V
    per_chunk_bytes = 4 * (3 * C * K + C * V + C * C + K + C * V)
    return pl.CostEstimate(flops=int(B * HV * N * per_chunk_flops), transcendentals=0,
                           bytes_accessed=int(B * HV * (N * per_chunk_bytes + 8 * K * V)))
