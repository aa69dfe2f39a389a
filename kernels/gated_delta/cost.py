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


def states_cost_estimate(*, B, HV, N, C, K, V):
    """Backward kernel 1 (gated_delta_states), the recomputation of the chunk states (the forward
    without o): per chunk w S and kdt u; reads w, u1, kdt, decay, writes the state S_n [K,V]."""
    per_chunk_flops = 2 * C * K * V * 2 + 3 * K * V + C * V
    per_chunk_bytes = 4 * (2 * C * K + C * V + K + K * V)
    return pl.CostEstimate(flops=int(B * HV * N * per_chunk_flops), transcendentals=0,
                           bytes_accessed=int(B * HV * (N * per_chunk_bytes + 4 * K * V)))


def backward_cost_estimate(*, B, HV, N, C, K, V):
    """The TPU backward kernel, given the chunk states S_n: per chunk u = u1 - w S recomputed,
    the dS recurrence (m^T do, kdt^T dS, qg^T do, w^T du) and the gradients that sum over V
    (du S^T, do S^T, do u^T, dS u^T, sum_V dS * S): seven C*K*V-sized products, two C*C*V ones.
    Reads the operands, do and S_n, writes every gradient once."""
    per_chunk_flops = 2 * C * K * V * 7 + 2 * C * C * V * 2 + 5 * K * V + 3 * C * V
    per_chunk_bytes = 4 * 2 * (3 * C * K + C * V + C * C + K) + 4 * (C * V + K * V)
    return pl.CostEstimate(flops=int(B * HV * N * per_chunk_flops), transcendentals=0,
                           bytes_accessed=int(B * HV * (N * per_chunk_bytes + 8 * K * V)))


def dstate_cost_estimate(*, B, HV, N, C, K, V):
    """GPU backward, kernel 2 (gated_delta_state_bwd): the reverse dS recurrence alone
    (du = m^T do + kdt^T dS, dS <- decay * dS + qg^T do - w^T du); reads w, qg, m, kdt, decay,
    do, writes du and the per-chunk dS_{n+1}."""
    per_chunk_flops = 2 * C * K * V * 3 + 2 * C * C * V + 4 * K * V + C * V
    per_chunk_bytes = 4 * (3 * C * K + C * C + K + C * V + C * V + K * V)
    return pl.CostEstimate(flops=int(B * HV * N * per_chunk_flops), transcendentals=0,
                           bytes_accessed=int(B * HV * (N * per_chunk_bytes + 8 * K * V)))


def chunk_grads_cost_estimate(*, B, HV, N, C, K, V):
    """GPU backward, kernel 3 (gated_delta_chunk_grads, chunk-parallel): u = u1 - w S, then dw,
    dqg, dm, dkdt, ddecay (the products that sum over V); reads w, u1, S_n, dS_{n+1}, du, do,
    writes the five gradients."""
    per_chunk_flops = 2 * C * K * V * 4 + 2 * C * C * V + 2 * K * V + C * V
    per_chunk_bytes = 4 * (C * K + 3 * C * V + 2 * K * V) + 4 * (3 * C * K + C * C + K)
    return pl.CostEstimate(flops=int(B * HV * N * per_chunk_flops), transcendentals=0,
                           bytes_accessed=int(B * HV * N * per_chunk_bytes))


def gated_delta_flops(B, T, H, HV, K, V, C=64, *, per_channel=False, backward=False) -> float:
    """FLOPs of the chunkwise gated delta rule (q/k [B,T,H,K], v [B,T,HV,V], chunks of C), for
    benchmarks. Per value head and chunk: the pair matrices k k^T and q k^T (2 C^2 K each; KDA
    evaluates them with per-channel decays, the same count), the UT transform's inverse of a unit
    lower-triangular C x C matrix (~C^3), U1 = A v and W = A k (2 C^2 V, 2 C^2 K) and the state pass
    above (3 [C,K]x[K,V] products and one [C,C]x[C,V]). backward=True: the backward alone, counted
    as twice the forward (an estimate: it recomputes the state pass and transposes every product).
    A check of that estimate: XLA's cost analysis of the compiled XLA path (T=2K, 16 heads of 128,
    2026-12-03) counts forward+backward at 3.1x (GDN) and 3.2x (KDA) its forward, against 3x here.
    Its absolute counts (0.4x this formula) do not help: HLO cost analysis counts a while loop's
    body once, not once per chunk, so it leaves out nearly all of the state pass.
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
