"""LeapQuant decode in plain JAX: a quantized boundary state plus the window's records, read
without ever re-quantizing inside a window (jit-friendly; lax.scan over tokens).

Letters: B batch, T tokens, HV value heads, K key head dim, V value head dim, P window (records),
r compensators, Dg decay width (1 for GDN's scalar decay, K for KDA's per-channel decay).

Record form (GDN and KDA). One decode step with decay a_t = exp(g_t), write strength beta_t:

    S'  = Diag(a_t) S_{t-1}                 (decay before read, as kernels/gated_delta)
    u_t = v_t - S'^T k_t  = v_t - S_{t-1}^T b_t,  b_t = a_t * k_t
    S_t = S' + k~_t u_t^T,                  k~_t = beta_t k_t
    o_t = scale S_t^T q_t

Inside a window that started from the boundary state S0^ (quantization.decode_boundary: dequantized
residual + compensators, the compensators being identity-decay records at the window start), with
G_t = sum of the window's log-decays through step t (cumulative, [Dg]) and Gamma_{j->t} =
Diag(exp(G_t - G_j)):

    S_t = Gamma_{0->t} S0^ + sum_{j<=t} Gamma_{j->t} k~_j u_j^T
    S_t^T x = S0^T (exp(G_t) x) + sum_j u_j (k~_j . exp(G_t - G_j) x)

so both reads of a step (u_t with x = k_t at G_t, o_t with x = q_t at G_t after appending record t)
are the boundary state read once (`read_arrays`: s * (Q^T (c * y)) + comps; pallas_gpu.read and
pallas_tpu.read do it without any dequantized [K,V] copy) plus P small dot products. After the
P-th record of a window the state is materialised once, re-quantized (quantize.encode_boundary)
and the records are cleared. With fmt "none" this is the plain recurrence reassociated: equal to
it to float32 rounding (with bfloat16 records, to a bf16 rounding of each step's update).

The state (a dict, a pytree; all arrays float32 unless said):
  "q" [B,HV,K,V] int8 / bf16 / f32, "scale" [B,HV,V], "smooth" [B,HV,K],
  "comp_k" [B,HV,r,K] f16, "comp_u" [B,HV,r,V] f16       the boundary (quantize.py)
  "rec_k" [B,HV,P,K] k~_j, "rec_u" [B,HV,P,V] u_j, "rec_g" [B,HV,P,Dg] G_j   the records
  "g_now" [B,HV,Dg] G of the last step (0 at a window start), "n" [B] int32 records held (< P)
Records j >= n are zeros (cleared at every boundary) and masked out of every read. rec_k and
rec_u are float32, or bfloat16 with LeapQuantSpec.record_dtype="bfloat16" (rounded when written;
every reader widens them to float32 after loading); rec_g and g_now stay float32 (the spec's
record_dtypes says why).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .quantize import LeapQuantSpec, decode_boundary, encode_boundary

_HI = jax.lax.Precision.HIGHEST
BOUNDARY_KEYS = ("q", "scale", "smooth", "comp_k", "comp_u")


def _empty_window(spec: LeapQuantSpec, batch: int, heads: int, K: int, V: int,
                  decay_dim: int) -> dict:
    """The window part of a state at a window start: zero records in spec.record_dtypes, the
    clock at 0, no records held."""
    lead, dt = (batch, heads), spec.record_dtypes
    return {"rec_k": jnp.zeros(lead + (spec.window, K), dt["rec_k"]),
            "rec_u": jnp.zeros(lead + (spec.window, V), dt["rec_u"]),
            "rec_g": jnp.zeros(lead + (spec.window, decay_dim), dt["rec_g"]),
            "g_now": jnp.zeros(lead + (decay_dim,), jnp.float32),
            "n": jnp.zeros((batch,), jnp.int32)}


def encode_state(spec: LeapQuantSpec, S: jax.Array, decay_dim: int) -> dict:
    """A dense state S [B,HV,K,V] -> the LeapQuant state at a window start (no records)."""
    B, HV, K, V = S.shape
    return {**encode_boundary(spec, S), **_empty_window(spec, B, HV, K, V, decay_dim)}


def init_state(spec: LeapQuantSpec, batch: int, heads: int, K: int, V: int,
               decay_dim: int) -> dict:
    """The LeapQuant state of a zero recurrent state [batch, heads, K, V]: what encode_state
    gives for zeros (q 0, unit scales and smoothing, zero compensators), built directly."""
    f32, lead = jnp.float32, (batch, heads)
    qdtype = {"none": f32, "bf16": jnp.bfloat16}.get(spec.fmt, jnp.int8)
    return {"q": jnp.zeros(lead + (K, V), qdtype), "scale": jnp.ones(lead + (V,), f32),
            "smooth": jnp.ones(lead + (K,), f32),
            "comp_k": jnp.zeros(lead + (spec.r, K), jnp.float16),
            "comp_u": jnp.zeros(lead + (spec.r, V), jnp.float16),
            **_empty_window(spec, batch, heads, K, V, decay_dim)}


def _valid(state: dict, n: jax.Array) -> jax.Array:
    """[B,1,P] records j < n."""
    P = state["rec_k"].shape[2]
    return (jnp.arange(P)[None, :] < n[:, None])[:, None, :]


def materialize(state: dict) -> jax.Array:
    """The dense state S_t [B,HV,K,V] float32 the LeapQuant state stands for (boundary decayed to
    now plus the held records)."""
    S0 = decode_boundary({key: state[key] for key in BOUNDARY_KEYS})
    g_now = state["g_now"]
    S = jnp.exp(g_now)[..., :, None] * S0
    rec_k, rec_u, rec_g = (state[key].astype(jnp.float32) for key in ("rec_k", "rec_u", "rec_g"))
    decay = jnp.exp(g_now[:, :, None, :] - rec_g)                        # [B,HV,P,Dg]
    k = jnp.where(_valid(state, state["n"])[..., None], decay * rec_k, 0.0)
    return S + jnp.einsum("bhpk,bhpv->bhkv", k, rec_u, precision=_HI)


READ_KEYS = ("q", "scale", "smooth", "comp_k", "comp_u", "rec_k", "rec_u", "rec_g")


def read_arrays(q, scale, smooth, comp_k, comp_u, rec_k, rec_u, rec_g, G, x, valid):
    """S^T x [B,HV,V] from the state's arrays (READ_KEYS order), the cumulative log-decay
    G [B,HV,Dg] of the reading step, x [B,HV,K] and valid [B,HV,P] (1.0 = record held): the
    boundary read as s * (Q^T (c * y)) + compensators with y = exp(G) x, plus the records. The
    contract of pallas_gpu.read. On XLA:CPU the conversion of Q is a float32 temporary of the
    whole state (hoisted into the previous step's re-quantization branch); converting 16 rows
    at a time in a loop avoided it but made a batch-8 step slower (eval/BENCHMARKS.md
    "LeapQuant", cost), so the Pallas kernels are where the int8 state is read in place."""
    y = jnp.exp(G) * x
    qy = jnp.einsum("bhkv,bhk->bhv", q.astype(jnp.float32), smooth * y, precision=_HI)
    c = jnp.einsum("bhrk,bhk->bhr", comp_k.astype(jnp.float32), y, precision=_HI)
    out = scale * qy + jnp.einsum("bhrv,bhr->bhv", comp_u.astype(jnp.float32), c, precision=_HI)
    # records may be stored in bfloat16 (LeapQuantSpec.record_dtype): computed in float32
    rec_k, rec_u, rec_g = (a.astype(jnp.float32) for a in (rec_k, rec_u, rec_g))
    w = jnp.exp(G[:, :, None, :] - rec_g) * x[:, :, None, :]               # [B,HV,P,K]
    coef = jnp.sum(rec_k * w, axis=-1) * valid                              # [B,HV,P]
    return out + jnp.einsum("bhp,bhpv->bhv", coef, rec_u, precision=_HI)


def read(state: dict, G: jax.Array, x: jax.Array, n: jax.Array, reader=read_arrays) -> jax.Array:
    """S^T x [B,HV,V] for the state at cumulative log-decay G [B,HV,Dg], x [B,HV,K], counting
    the first n [B] records; `reader` is read_arrays or a kernel with its contract."""
    B, HV = x.shape[:2]
    valid = jnp.broadcast_to(_valid(state, n), (B, HV, state["rec_k"].shape[2]))
    return reader(*(state[key] for key in READ_KEYS), G, x, valid.astype(jnp.float32))


def requantize(spec: LeapQuantSpec, state: dict, rows: jax.Array) -> dict:
    """Rows [B] bool start a new window: their state is materialised and re-encoded."""
    fresh = encode_state(spec, materialize(state), state["g_now"].shape[-1])
    return jax.tree.map(lambda new, old: jnp.where(
        rows.reshape(rows.shape + (1,) * (old.ndim - 1)), new, old), fresh, state)


def decode_step(spec: LeapQuantSpec, state: dict, q: jax.Array, k: jax.Array, v: jax.Array,
                g: jax.Array, beta: jax.Array, scale: float, active: jax.Array | None = None,
                reader=read_arrays) -> tuple[jax.Array, dict]:
    """One token: q, k [B,HV,K] (grouped heads already repeated), v [B,HV,V], g [B,HV] (GDN) or
    [B,HV,K] (KDA) log-decays, beta [B,HV]; active [B] bool (None = all): inactive rows keep their
    state and output 0; reader: the window read (read_arrays or a kernel). Returns
    (o [B,HV,V] float32, new state)."""
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if g.ndim == 2:
        g = g[..., None]
    n = state["n"]
    act = jnp.ones(n.shape, bool) if active is None else active
    G = state["g_now"] + g
    u = v - read(state, G, k, n, reader)
    kt = beta[..., None] * k
    # An inactive row writes no record and keeps its clock and count, so only the window's small
    # arrays change in a step. Masking the whole state tree instead (new vs old) made every step
    # read and write the whole boundary state whenever `active` is a run-time mask (with None,
    # as in generate's decode, XLA folded the all-true select away).
    slot = ((jnp.arange(spec.window)[None, :] == n[:, None]) & act[:, None])[:, None, :, None]
    new = dict(state)
    for key, x in (("rec_k", kt), ("rec_u", u), ("rec_g", G)):  # stored in spec.record_dtypes
        new[key] = jnp.where(slot, x[:, :, None, :].astype(spec.record_dtypes[key]), state[key])
    new["g_now"] = jnp.where(act[:, None, None], G, state["g_now"])
    new["n"] = n + act.astype(n.dtype)
    o = scale * read(new, G, q, n + 1, reader)  # an inactive row's output is zeroed below
    full = new["n"] >= spec.window  # only active rows reach the window's end
    new = jax.lax.cond(jnp.any(full), lambda s: requantize(spec, s, full), lambda s: s, new)
    if active is not None:
        o = jnp.where(active[:, None, None], o, 0.0)
    return o, new


def decode(spec: LeapQuantSpec, state: dict, q: jax.Array, k: jax.Array, v: jax.Array,
           g: jax.Array, beta: jax.Array, scale: float, active: jax.Array | None = None,
           reader=read_arrays) -> tuple[jax.Array, dict]:
    """T tokens one after the other (lax.scan of decode_step). q, k [B,T,H,K]; v [B,T,HV,V];
    g [B,T,HV] or [B,T,HV,K]; beta [B,T,HV]; active [B,T] bool or None. Returns
    (o [B,T,HV,V] float32, new state)."""
    G = v.shape[2] // q.shape[2]
    q, k = jnp.repeat(q, G, axis=2), jnp.repeat(k, G, axis=2)
    if active is None:
        active = jnp.ones(q.shape[:2], bool)

    def step(s, xs):
        o, s = decode_step(spec, s, *xs[:5], scale, xs[5], reader)
        return s, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, active))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


__all__ = ["encode_state", "init_state", "materialize", "read", "read_arrays", "requantize",
           "decode_step", "decode"]
