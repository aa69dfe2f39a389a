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


def gated_delta_flops(B, T, H, HV, K, V, C=64, *, per_channel=False, backward=False) -> float:
    """FLOPs of the chunkwise gated delta rule (q/k [B,T,H,K], v [B,T,HV,V], chunks of C), for
    benchmarks. Per value head and chunk: the pair matrices k k^T and q k^T (2 C^2 K each; KDA
    evaluates them with per-channel decays, the same count), the UT transform's inverse of a unit
    lower-triangular C x C matrix (~C^3), U1 = A v and W = A k (2 C^2 V, 2 C^2 K) and the state pass
    above (3 [C,K]x[K,V] products and one [C,C]x[C,V]). backward=True: the backward alone, counted
    as twice the forward (an estimate: it recomputes the state pass and transposes every product).
    """
    del H, per_channel
    n = -(-T // C)
    per_chunk = 2 * C * C * (3 * K + 2 * V) + C ** 3 + 6 * C * K * V
    fwd = float(B * HV * n * per_chunk)
    return 2.0 * fwd if backward else fwd


def gated_delta_bytes(B, T, H, HV, K, V, *, itemsize=4, per_channel=False, backward=False
                      ) -> float:
    """Bytes that must move at least: q, k, v, g, beta read and o written once (backward: those
    again plus their gradients)."""
    g = HV * (K if per_channel else 1)
    once = B * T * (2 * H * K + 2 * HV * V) * itemsize + B * T * (g + HV) * 4
    return 2.0 * once if backward else float(once)
