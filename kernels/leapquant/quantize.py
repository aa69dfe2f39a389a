"""LeapQuant's storage of one window-boundary state: the spec, quantizers, residual smoothing,
low-rank compensators fitted by power iteration, and the bytes it costs. Shared by reference.py and
xla.py (the definitions are the same for both; they differ in how the window is read).

Letters: K key head dim (rows of a state), V value head dim (columns), r compensator rank,
P window length (records per window), "..." any leading dims (usually [B,HV]).

A boundary state S [...,K,V] (float32) is stored as

    S ~= S0^ = Diag(c) Deq(Q) + sum_{i<r} l_i m_i^T

  Q      [...,K,V]  the quantized residual R / c: INT8/INT6/INT4 symmetric integers in int8
                    containers with one fp32 scale per value column (scale [...,V]), or bf16, or
                    float32 ("none": quantization off);
  c      [...,K]    residual smoothing, c_i = sqrt(mean_j |R_ij|) per key row, floored at
                    smooth_floor * max_i c_i (ones when smoothing is off);
  l, m   [...,r,K], [...,r,V]  compensators, float16, fitted by power iteration with deflation
                    (sqrt of each singular value on both sides, to use float16's range evenly).

What the compensators fit (comp_target). The issue says "fitted to the state"; the brief this was
built from suggested the quantization residual. Both are implemented; the default is "state":
L = rank-r(S) is taken out first and R = S - L is what gets smoothed and quantized. Why: the state
of a delta rule is dominated by a few directions (the issue's outlier/median ratio 176x), and a
per-column scale set by those outliers wastes the integer range of every other entry; removing L
before quantizing is what brings the ratio down (the paper's 176x -> 47x after compensators ->
5.3x after smoothing, which is a chain of *pre*-quantization magnitudes and so only makes sense
with this order). The alternative, "error", quantizes S itself (smoothed) and fits L to the
quantization error S - Deq(Q(S)); rounding error is close to white noise with no low-rank part,
so it gains less (eval/bench_leapquant.py --extra measures both: on layer 0 of an untrained
configs/gdn_tiny.py fed the corpus, 2.8e-3 relative state error after 64K INT8 steps with "state"
against 4.5e-3 with "error"; equal on random states, which have no outliers). R is computed
against the float16-rounded compensators, so their rounding is absorbed into the quantized residual.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST
FORMATS = ("none", "bf16", "int8", "int6", "int4")
COMP_TARGETS = ("state", "error")
RECORD_DTYPES = ("float32", "bfloat16")
RECORD_ACCOUNTING = ("none", "mean", "full")


@dataclasses.dataclass(frozen=True)
class LeapQuantSpec:
    """How recurrent states are stored (static; hashable; a kernel argument, not a model config).

    fmt: "int8" | "int6" | "int4" (symmetric integers, one fp32 scale per value column),
      "bf16" (no integers: the no-integer baseline), "none" (float32: quantization off).
    window: P, decode steps per window; the boundary state is re-quantized only every P steps and
      the steps in between are kept as high-precision records (P = 1: per-step quantization).
    rank: r compensators per state; None = 4 for int8/int6, 8 for int4, 0 for bf16 and none.
    smoothing: residual smoothing; None = on for the integer formats, off for bf16 and none.
    smooth_floor: c_i >= smooth_floor * max_i c_i (keeps near-empty rows from blowing up).
    power_iters: power-iteration steps per compensator.
    comp_target: "state" (default) or "error": what the compensators fit (module docstring).
    record_dtype: "float32" (default) or "bfloat16": how the window's records k~_j and u_j are
      stored (record_dtypes: the log-decays G_j stay float32; xla.py's layout); every read
      computes in float32 after loading. bfloat16 halves most of what a live window holds, at a
      bf16 rounding of each step's update.
    """

    fmt: str = "int8"
    window: int = 16
    rank: int | None = None
    smoothing: bool | None = None
    smooth_floor: float = 1e-2
    power_iters: int = 8
    comp_target: str = "state"
    record_dtype: str = "float32"

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"LeapQuantSpec.fmt={self.fmt!r}: valid formats are {FORMATS}")
        for name, low in (("window", 1), ("power_iters", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"LeapQuantSpec.{name}={value!r} must be an int >= {low}")
        if self.rank is not None and (not isinstance(self.rank, int) or isinstance(self.rank, bool)
                                      or self.rank < 0):
            raise ValueError(f"LeapQuantSpec.rank={self.rank!r} must be None or an int >= 0")
        if self.smoothing not in (None, True, False):
            raise ValueError(f"LeapQuantSpec.smoothing={self.smoothing!r} must be None, True or "
                             "False")
        if not (isinstance(self.smooth_floor, (int, float)) and 0 < self.smooth_floor <= 1):
            raise ValueError(f"LeapQuantSpec.smooth_floor={self.smooth_floor!r} must be in (0, 1]")
        if self.comp_target not in COMP_TARGETS:
            raise ValueError(f"LeapQuantSpec.comp_target={self.comp_target!r}: valid choices are "
                             f"{COMP_TARGETS}")
        if self.record_dtype not in RECORD_DTYPES:
            raise ValueError(f"LeapQuantSpec.record_dtype={self.record_dtype!r}: valid choices are "
                             f"{RECORD_DTYPES}")

    @property
    def bits(self) -> int | None:
        """Integer bits (8, 6, 4), or None for bf16 / none."""
        m = re.fullmatch(r"int(\d+)", self.fmt)
        return int(m.group(1)) if m else None

    @property
    def r(self) -> int:
        """The resolved compensator rank."""
        if self.rank is not None:
            return self.rank
        return {8: 4, 6: 4, 4: 8}.get(self.bits, 0)

    @property
    def smooth(self) -> bool:
        """Whether residual smoothing is on (resolved)."""
        return self.bits is not None if self.smoothing is None else bool(self.smoothing)

    @property
    def record_dtypes(self) -> dict[str, jnp.dtype]:
        """The stored dtype of each record array: {"rec_k", "rec_u", "rec_g"} -> dtype.

        rec_g (the cumulative log-decay G_j since the window start) stays float32 whatever
        record_dtype says: a read weighs record j by exp(G_t - G_j), so an absolute error in G_j
        is a relative error of that record, and bf16 keeps 8 bits of |G_j|, which reaches 7 (GDN)
        to 25 (KDA) within a window on fast-decaying heads (bf16 spacing 0.03-0.125 there).
        Measured at 4K steps (eval/BENCHMARKS.md, "window records in bf16"): with fmt "none" the
        state error of bf16 k~/u is 2.1e-3 on an untrained gdn_tiny layer's stream, 6.0e-3 with G
        in bf16 too (INT8: 4.0e-3 against 7.0e-3; on a kda_tiny layer 5.2e-3 against 5.6e-3);
        equal on slow synthetic decays. G costs 4 bytes a record for GDN, 4 K for KDA (half its
        bf16 record)."""
        dt = jnp.dtype(self.record_dtype)
        return {"rec_k": dt, "rec_u": dt, "rec_g": jnp.dtype(jnp.float32)}


# ----------------------------------------------------------------------------------------------
# Quantizers.

def quantize_columns(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric `bits`-bit quantization of x [...,K,V] with one scale per value column.

    Returns (q [...,K,V] int8 with |q| <= 2^(bits-1) - 1, scale [...,V] float32), so that
    |x - q * scale| <= scale / 2 = max_i |x_ij| / (2 (2^(bits-1) - 1)) elementwise.
    """
    qmax = 2 ** (bits - 1) - 1
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-2)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    q = jnp.clip(jnp.round(x / scale[..., None, :]), -qmax, qmax).astype(jnp.int8)
    return q, scale


def dequantize_columns(q: jax.Array, scale: jax.Array) -> jax.Array:
    """q [...,K,V] (int8 / bf16 / f32), scale [...,V] -> float32 [...,K,V]."""
    return q.astype(jnp.float32) * scale[..., None, :]


def smoothing_factors(r: jax.Array, floor: float) -> jax.Array:
    """c [...,K] float32: sqrt(mean_j |r_ij|) per key row, at least floor * max_i c_i (ones for
    an all-zero r)."""
    c = jnp.sqrt(jnp.mean(jnp.abs(r.astype(jnp.float32)), axis=-1))
    c = jnp.maximum(c, floor * jnp.max(c, axis=-1, keepdims=True))
    return jnp.where(c > 0, c, 1.0)


def low_rank(m: jax.Array, rank: int, iters: int) -> tuple[jax.Array, jax.Array]:
    """Rank-`rank` approximation of m [...,K,V] by power iteration with deflation.

    For i < rank: v <- m_i^T m_i v repeated `iters` times (v unit, from a fixed pseudo-random
    start), sigma u = m_i v, term_i = sigma u v^T, m_{i+1} = m_i - term_i. Returns
    (left [...,rank,K], right [...,rank,V]) float32 with left_i = sqrt(sigma) u,
    right_i = sqrt(sigma) v, so m ~= sum_i left_i right_i^T.
    """
    m = m.astype(jnp.float32)
    K, V = m.shape[-2:]
    lead = m.shape[:-2]
    if not rank:
        return jnp.zeros(lead + (0, K), jnp.float32), jnp.zeros(lead + (0, V), jnp.float32)
    start = jnp.broadcast_to(jax.random.normal(jax.random.key(0x1EA9), (V,), jnp.float32),
                             lead + (V,))

    def iterate(_, v, m):
        w = jnp.einsum("...kv,...v->...k", m, v, precision=_HI)
        v = jnp.einsum("...kv,...k->...v", m, w, precision=_HI)
        return v * jax.lax.rsqrt(jnp.maximum(jnp.sum(v * v, -1, keepdims=True), 1e-37))

    def one_term(m, _):  # a scan over the rank keeps the compiled program small
        v = jax.lax.fori_loop(0, iters, lambda i, v: iterate(i, v, m), start)
        w = jnp.einsum("...kv,...v->...k", m, v, precision=_HI)         # sigma u
        root = jnp.sqrt(jnp.sqrt(jnp.sum(w * w, -1, keepdims=True)))   # sqrt(sigma)
        left = w / jnp.maximum(root, 1e-30)
        right = v * root
        return m - left[..., :, None] * right[..., None, :], (left, right)

    _, (lefts, rights) = jax.lax.scan(one_term, m, None, length=rank)
    return jnp.moveaxis(lefts, 0, -2), jnp.moveaxis(rights, 0, -2)


def _fp16(x: jax.Array) -> jax.Array:
    """x rounded to float16, clipped into its finite range."""
    return jnp.clip(x, -65504.0, 65504.0).astype(jnp.float16)


# ----------------------------------------------------------------------------------------------
# One boundary state.

def encode_boundary(spec: LeapQuantSpec, S: jax.Array) -> dict:
    """S [...,K,V] -> the stored boundary: {"q": [...,K,V] (int8, bfloat16 or float32),
    "scale": [...,V] f32, "smooth": [...,K] f32, "comp_k": [...,r,K] f16, "comp_u": [...,r,V]
    f16} (module docstring)."""
    S = S.astype(jnp.float32)
    K, V = S.shape[-2:]
    r, lead = spec.r, S.shape[:-2]
    comp_k = jnp.zeros(lead + (r, K), jnp.float16)
    comp_u = jnp.zeros(lead + (r, V), jnp.float16)
    R = S
    if r and spec.comp_target == "state":
        left, right = low_rank(S, r, spec.power_iters)
        comp_k, comp_u = _fp16(left), _fp16(right)
        R = S - _comp_dense(comp_k, comp_u)
    c = (smoothing_factors(R, spec.smooth_floor) if spec.smooth
         else jnp.ones(lead + (K,), jnp.float32))
    x = R / c[..., :, None]
    if spec.bits is not None:
        q, scale = quantize_columns(x, spec.bits)
    else:
        q = x.astype(jnp.bfloat16) if spec.fmt == "bf16" else x
        scale = jnp.ones(lead + (V,), jnp.float32)
    out = {"q": q, "scale": scale, "smooth": c, "comp_k": comp_k, "comp_u": comp_u}
    if r and spec.comp_target == "error":
        left, right = low_rank(S - decode_boundary(out), r, spec.power_iters)
        out["comp_k"], out["comp_u"] = _fp16(left), _fp16(right)
    return out


def _comp_dense(comp_k: jax.Array, comp_u: jax.Array) -> jax.Array:
    return jnp.einsum("...rk,...rv->...kv", comp_k.astype(jnp.float32),
                      comp_u.astype(jnp.float32), precision=_HI)


def decode_boundary(b: dict) -> jax.Array:
    """The boundary state S0^ [...,K,V] float32 that `encode_boundary` stored."""
    S = dequantize_columns(b["q"], b["scale"]) * b["smooth"][..., :, None]
    return S + _comp_dense(b["comp_k"], b["comp_u"])


def outlier_ratio(x: jax.Array) -> jax.Array:
    """max |x| / median |x| over the last two dims [...,K,V] -> [...]."""
    a = jnp.abs(x.astype(jnp.float32)).reshape(x.shape[:-2] + (-1,))
    return jnp.max(a, -1) / jnp.maximum(jnp.median(a, -1), 1e-30)


def stage_outlier_ratios(spec: LeapQuantSpec, S: jax.Array) -> dict:
    """Outlier/median magnitude ratios [...] of what is quantized, through the stages: "state" (S
    itself), "after_compensators" (S - L, L the rank-r fit of S; r = spec.r or 4 when 0),
    "after_smoothing" ((S - L) / c)."""
    r = spec.r or 4
    left, right = low_rank(S, r, spec.power_iters)
    R = S - _comp_dense(_fp16(left), _fp16(right))
    c = smoothing_factors(R, spec.smooth_floor)
    return {"state": outlier_ratio(S), "after_compensators": outlier_ratio(R),
            "after_smoothing": outlier_ratio(R / c[..., :, None])}


def bytes_per_element(spec: LeapQuantSpec, K: int = 128, V: int = 128, *,
                      records: str = "none", decay_dim: int = 1) -> float:
    """Bytes per state element of one [K,V] state stored as `spec` says.

    Accounting (packed storage; in memory INT6/INT4 sit in int8 containers):
      boundary   bits/8 per element (int8 1, int6 0.75, int4 0.5; bf16 2; none 4)
      scales     4 V bytes (one fp32 per value column; integer formats only)
      smoothing  4 K bytes (fp32 c per key row; when smoothing is on)
      comps      2 r (K + V) bytes (float16 compensators)
      records    per record k~ [K], u [V] and the cumulative log-decay [decay_dim] (1 for GDN,
                 K for KDA) at spec.record_dtypes: 4 (K + V + decay_dim) bytes in float32,
                 2 (K + V) + 4 decay_dim with record_dtype bfloat16; times: "none" 0 (the persistent
                 state: what a prefix-cache snapshot at a window boundary holds, and the paper's
                 amortised figure), "mean" (P - 1) / 2 (the average fill between steps),
                 "full" P - 1 (the most held between steps; P for window 1 is never held).
    At K = V = 128, int8, r = 4, smoothing: 1 + 1/32 + 1/32 + 1/8 = 1.1875 (the paper's 1.19),
    against 4 for float32.
    """
    if records not in RECORD_ACCOUNTING:
        raise ValueError(f"bytes_per_element: records={records!r} must be one of "
                         f"{RECORD_ACCOUNTING}")
    per = {"none": 4.0, "bf16": 2.0}.get(spec.fmt)
    total = K * V * (per if per is not None else spec.bits / 8)
    if spec.bits is not None:
        total += 4 * V
    if spec.smooth:
        total += 4 * K
    total += 2 * spec.r * (K + V)
    held = {"none": 0.0, "mean": (spec.window - 1) / 2, "full": spec.window - 1}[records]
    size = {key: dt.itemsize for key, dt in spec.record_dtypes.items()}
    total += held * (size["rec_k"] * K + size["rec_u"] * V + size["rec_g"] * decay_dim)
    return total / (K * V)
