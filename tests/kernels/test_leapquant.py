"""LeapQuant (kernels/leapquant): the windowed record-form read equals the plain recurrence when
unquantized and the dense reference when quantized, the quantizers meet their round-trip bounds,
power iteration recovers a planted low-rank part, per-window INT8 beats per-step INT8 by a wide
margin, the byte accounting matches the paper's figure, and bad input is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aiinfra_jax.kernels._testing import assert_close, lower_text, rel_err
from aiinfra_jax.kernels.gated_delta import gated_delta_rule_reference
from aiinfra_jax.kernels.leapquant import (LeapQuantSpec, bytes_per_element, decode_boundary,
                                           dequantize_columns, encode_boundary, encode_state,
                                           init_state, leapquant_decode,
                                           leapquant_decode_reference, low_rank, materialize,
                                           quantize_columns, stage_outlier_ratios)

# Compiling dominates these tests on 2 cores; backend optimisations change nothing but rounding.
_QUICK = {"xla_backend_optimization_level": 0}


def _inputs(seed, B, T, H, HV, K, V, kda, slow=(1e-4, 3e-2)):
    """L2-normalised q, k; normal v; log-decays with per-head (per-channel for KDA) rates drawn
    log-uniformly in `slow` and jittered per step; sigmoid betas. Drawn with numpy: eager
    jax.random ops would each compile on first use, which costs more than the tests."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = unit(normal(B, T, H, K)), unit(normal(B, T, H, K))
    v = normal(B, T, HV, V)
    gshape = (B, T, HV, K) if kda else (B, T, HV)
    rate = np.exp(rng.uniform(np.log(slow[0]), np.log(slow[1]), gshape[2:]))
    g = (-rate * np.exp(0.3 * normal(*gshape))).astype(np.float32)
    beta = 1 / (1 + np.exp(-normal(B, T, HV)))
    return tuple(jnp.asarray(x) for x in (q, k, v, g, beta))


def _normal(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _quick(f, *static):
    return jax.jit(f, static_argnums=static, compiler_options=_QUICK)


_encode = _quick(encode_boundary, 0)
_ratios = _quick(stage_outlier_ratios, 0)
_recurrence = _quick(gated_delta_rule_reference)


def _decode(spec, S0, q, k, v, g, beta):
    """Encode S0 (zeros when None), decode, materialise: (o, final state dict, dense state), all in
    one compiled program."""
    B, HV, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
    dg = K if g.ndim == 4 else 1

    def run(S0, *args):
        S0 = jnp.zeros((B, HV, K, V)) if S0 is None else S0
        o, state = leapquant_decode(*args, encode_state(spec, S0, decay_dim=dg), spec=spec)
        return o, state, materialize(state)

    return jax.jit(run, compiler_options=_QUICK)(S0, q, k, v, g, beta)


# record_dtype -> the windowed read's relative error against the plain recurrence with fmt
# "none": float32 rounding, or each step's update rounded to bf16 (measured 1.6e-3 .. 2.8e-3 on
# o and the state over 4 seeds, GDN and KDA, at these shapes; bf16's unit roundoff is 2^-9).
_RECORD_TOL = {"float32": 2e-5, "bfloat16": 5e-3}


@pytest.mark.parametrize("records", ["float32", "bfloat16"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_windowed_read_equals_the_recurrence_when_unquantized(kda, records):
    """fmt "none": the boundary state, the records and the window reads reassociate the plain
    recurrence (grouped value heads, T not a multiple of the window, a nonzero initial state);
    exactly up to float32 rounding with float32 records, to bf16 rounding with bf16 ones (which
    the state really stores: k~ and u in bfloat16, the log-decays in float32)."""
    B, T, H, HV, K, V = 2, 23, 1, 2, 8, 6
    q, k, v, g, beta = _inputs(1, B, T, H, HV, K, V, kda, slow=(1e-2, 0.5))
    S0 = _normal(2, B, HV, K, V)
    spec = LeapQuantSpec(fmt="none", window=5, record_dtype=records)
    o, state, S = _decode(spec, S0, q, k, v, g, beta)
    o_ref, S_ref = _recurrence(q, k, v, g, beta, initial_state=S0)
    errs = rel_err(o, o_ref), rel_err(S, S_ref)
    assert max(errs) <= _RECORD_TOL[records], errs
    if records == "bfloat16":
        assert min(errs) > 1e-4, errs  # not exact: the records were rounded
    assert (state["rec_k"].dtype, state["rec_u"].dtype, state["rec_g"].dtype) == (
        jnp.dtype(records), jnp.dtype(records), jnp.float32)
    assert int(state["n"][0]) == T % 5


@pytest.mark.parametrize("K", [8, 48])
def test_record_form_matches_the_dense_reference_when_quantized(K):
    """int8 with compensators and smoothing (KDA decay): the record form and reference.py's dense
    loop re-quantize at the same steps; they differ only where float rounding flips an integer.
    Also at K = 48, a wider state."""
    B, T, H, HV, V = 1, 9, 1, 2, 8
    q, k, v, g, beta = _inputs(3, B, T, H, HV, K, V, True, slow=(1e-2, 0.3))
    S0 = _normal(4, B, HV, K, V)
    spec = LeapQuantSpec(fmt="int8", window=4, rank=2)
    o, _, S = _decode(spec, S0, q, k, v, g, beta)
    o_ref, S_ref = _quick(leapquant_decode_reference, 0)(spec, S0, q, k, v, g, beta)
    assert rel_err(o, o_ref) < 2e-3
    assert rel_err(S, S_ref) < 2e-3


def test_inactive_steps_leave_a_row_as_if_they_were_not_there():
    """`active` (right padding, rows that finished): a row decoded with gaps gives, at its active
    steps, the outputs of that row decoded alone on just those tokens, 0 at the others, and the
    same final state; re-quantization happens at its own window ends (window 4, 11 active steps
    of 17), not the batch's."""
    B, T, H, HV, K, V = 2, 17, 1, 2, 8, 8
    q, k, v, g, beta = _inputs(5, B, T, H, HV, K, V, False, slow=(1e-2, 0.3))
    S0 = _normal(6, B, HV, K, V)
    spec = LeapQuantSpec(fmt="int8", window=4, rank=1)
    active = np.ones((B, T), bool)
    active[1, np.random.default_rng(7).choice(T, T - 11, replace=False)] = False

    def run(S0, active, *args):
        state = encode_state(spec, S0, decay_dim=1)
        return leapquant_decode(*args, state, spec=spec, active=active)

    o, state = jax.jit(run, compiler_options=_QUICK)(S0, jnp.asarray(active), q, k, v, g, beta)
    keep = np.flatnonzero(active[1])
    alone = tuple(x[1:2, keep] for x in (q, k, v, g, beta))
    o1, state1 = jax.jit(run, compiler_options=_QUICK)(S0[1:2], jnp.ones((1, len(keep)), bool),
                                                        *alone)
    np.testing.assert_allclose(o[1, keep], o1[0], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(o[1, ~active[1]]) == 0)
    for name in state:
        np.testing.assert_allclose(state[name][1:2], state1[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    assert int(state["n"][1]) == 11 % 4 and int(state["n"][0]) == T % 4


def test_power_iteration_recovers_a_planted_low_rank_part():
    K, V, r = 24, 16, 3
    rng = np.random.default_rng(5)
    U = np.linalg.qr(rng.standard_normal((K, r)))[0]
    W = np.linalg.qr(rng.standard_normal((V, r)))[0]
    planted = ((U * np.array([20.0, 9.0, 4.0])) @ W.T).astype(np.float32)
    noise = 1e-3 * rng.standard_normal((K, V)).astype(np.float32)
    left, right = map(np.asarray, _quick(low_rank, 1, 2)(jnp.asarray(planted + noise), r, 30))
    assert left.shape == (r, K) and right.shape == (r, V)
    fit = left.T @ right
    assert rel_err(fit, planted) < 2e-3
    # deflation: each term is one singular direction, largest first
    sigmas = np.linalg.norm(left, axis=-1) * np.linalg.norm(right, axis=-1)
    np.testing.assert_allclose(sigmas, [20.0, 9.0, 4.0], rtol=1e-3)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_quantize_round_trip_bounds(bits):
    x = _normal(bits, 3, 16, 12) * np.linspace(0.1, 5, 12, dtype=np.float32)
    q, scale = _quick(quantize_columns, 1)(x, bits)
    qmax = 2 ** (bits - 1) - 1
    assert q.dtype == jnp.int8 and int(np.abs(np.asarray(q, np.int32)).max()) <= qmax
    err = np.abs(np.asarray(dequantize_columns(q, scale)) - np.asarray(x))
    amax = np.abs(np.asarray(x)).max(axis=-2)
    assert np.all(err <= (amax / (2 * qmax))[..., None, :] * (1 + 1e-5))
    # the whole boundary encoding (compensators + smoothing) keeps the same order of error
    spec = LeapQuantSpec(fmt=f"int{bits}")
    e = rel_err(decode_boundary(_encode(spec, x)), x)
    assert e < 1.0 / qmax, (bits, e)


def test_bf16_and_none_round_trips():
    x = _normal(7, 2, 8, 8)
    assert rel_err(decode_boundary(_encode(LeapQuantSpec(fmt="bf16"), x)), x) < 2 ** -8
    assert rel_err(decode_boundary(_encode(LeapQuantSpec(fmt="none"), x)), x) < 1e-7


def test_per_window_int8_beats_per_step_int8():
    """300 decode steps of random normalised inputs with long memories: per-step INT8 rounding
    accumulates an error several times LeapQuant's (measured ~0.036 vs ~0.006 relative)."""
    B, T, H, HV, K, V = 1, 300, 2, 2, 32, 32
    q, k, v, g, beta = _inputs(8, B, T, H, HV, K, V, False)
    _, S_ref = _recurrence(q, k, v, g, beta)
    errs = {}
    for name, spec in (("per_step", LeapQuantSpec(window=1, rank=0, smoothing=False)),
                       ("leapquant", LeapQuantSpec())):
        errs[name] = rel_err(_decode(spec, None, q, k, v, g, beta)[2], S_ref)
    assert errs["leapquant"] < 0.015, errs
    assert errs["per_step"] > 3 * errs["leapquant"], errs


def test_bytes_per_element_accounting():
    assert bytes_per_element(LeapQuantSpec()) == pytest.approx(1.1875)  # the paper's 1.19
    assert bytes_per_element(LeapQuantSpec(fmt="none")) == 4.0
    per_step = LeapQuantSpec(window=1, rank=0, smoothing=False)
    assert bytes_per_element(per_step) == pytest.approx(1 + 4 / 128)
    assert bytes_per_element(LeapQuantSpec(fmt="int4")) == pytest.approx(
        0.5 + 8 / 128 + 2 * 8 * 256 / 128 ** 2)
    mean = bytes_per_element(LeapQuantSpec(), records="mean")
    assert mean == pytest.approx(1.1875 + 7.5 * 4 * 257 / 128 ** 2)
    # bf16 records: k~ and u at 2 bytes, the log-decays (1 for GDN, K for KDA) at 4
    bf16 = LeapQuantSpec(record_dtype="bfloat16")
    assert bytes_per_element(bf16) == pytest.approx(1.1875)
    assert bytes_per_element(bf16, records="mean") == pytest.approx(
        1.1875 + 7.5 * (2 * 256 + 4) / 128 ** 2)
    assert bytes_per_element(bf16, records="full", decay_dim=128) == pytest.approx(
        1.1875 + 15 * (2 * 256 + 4 * 128) / 128 ** 2)


def test_stage_outlier_ratios_fall_for_a_state_with_outliers():
    """A low-rank spike on top of noise, with a few loud key rows: compensators take the spike
    out, smoothing the loud rows."""
    rng = np.random.default_rng(9)
    base = rng.standard_normal((32, 32)) * np.where(np.arange(32) < 3, 8.0, 1.0)[:, None]
    spike = 200.0 * np.outer(rng.standard_normal(32), rng.standard_normal(32)) / 32
    state = jnp.asarray((base + spike).astype(np.float32))
    r = {key: float(v) for key, v in _ratios(LeapQuantSpec(), state).items()}
    assert r["state"] > r["after_compensators"] > r["after_smoothing"], r


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="fmt='int5'"):
        LeapQuantSpec(fmt="int5")
    with pytest.raises(ValueError, match="window=0"):
        LeapQuantSpec(window=0)
    with pytest.raises(ValueError, match="comp_target"):
        LeapQuantSpec(comp_target="both")
    with pytest.raises(ValueError, match=r"record_dtype='bf16'.*'float32', 'bfloat16'"):
        LeapQuantSpec(record_dtype="bf16")
    spec = LeapQuantSpec(fmt="none", window=8)
    q, k, v, g, beta = _inputs(0, 1, 3, 1, 1, 8, 8, False)
    state = init_state(spec, 1, 1, 8, 8, decay_dim=1)
    with pytest.raises(ValueError, match=r"state\['rec_k'\]"):
        leapquant_decode(q, k, v, g, beta, state, spec=LeapQuantSpec(fmt="none", window=4))
    with pytest.raises(ValueError, match=r"state\['rec_g'\]"):  # a GDN state fed KDA decays
        leapquant_decode(q, k, v, jnp.repeat(g[..., None], 8, -1), beta, state, spec=spec)
    with pytest.raises(ValueError, match="powers of two >= 16"):
        leapquant_decode(q, k, v, g, beta, state, spec=spec, implementation="pallas_gpu")
    with pytest.raises(ValueError, match="multiple of 32"):
        leapquant_decode(q, k, v, g, beta, state, spec=spec, implementation="pallas_tpu")
    with pytest.raises(ValueError, match="beta must be"):
        leapquant_decode(q, k, v, g, beta[..., None], state, spec=spec)
    with pytest.raises(ValueError, match=r"state\['rec_k'\] is stored as float32.*bfloat16"):
        leapquant_decode(q, k, v, g, beta, state,  # float32 records, a bf16-records spec
                         spec=LeapQuantSpec(fmt="none", window=8, record_dtype="bfloat16"))


@pytest.mark.parametrize("fmt, records", [("int8", "float32"), ("bf16", "float32"),
                                           ("int8", "bfloat16")])
def test_init_state_is_the_encoding_of_zeros(fmt, records):
    spec = LeapQuantSpec(fmt=fmt, window=3, record_dtype=records)
    direct = init_state(spec, 2, 2, 8, 4, decay_dim=8)
    encoded = _quick(lambda S: encode_state(spec, S, decay_dim=8))(jnp.zeros((2, 2, 8, 4)))
    assert jax.tree.structure(direct) == jax.tree.structure(encoded)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(encoded)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("records", ["float32", "bfloat16"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("impl, K, V", [("pallas_gpu", 16, 16), ("pallas_tpu", 32, 128)])
def test_pallas_read_matches_xla_in_interpret_mode(impl, K, V, kda, records):
    """The Pallas window read (interpret mode) against xla.read_arrays on a random stored state:
    int8 boundary, 2 float16 compensators, 4 records of which 3 are held (the 4th is garbage
    that must be masked out), GDN or KDA cumulative decays; k~ and u stored in `records` (both
    reads widen the same stored values, so bf16 records keep the float32 tolerance)."""
    from aiinfra_jax.kernels.leapquant import pallas_gpu, pallas_tpu, xla
    B, HV, P, r = 2, 2, 4, 2
    dg = K if kda else 1
    rng = np.random.default_rng(13)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    G = -np.abs(f(B, HV, dg))
    rec = jnp.dtype(records)
    args = (rng.integers(-127, 128, (B, HV, K, V)).astype(np.int8), np.abs(f(B, HV, V)),
            1 + np.abs(f(B, HV, K)), f(B, HV, r, K).astype(np.float16),
            f(B, HV, r, V).astype(np.float16), f(B, HV, P, K).astype(rec),
            f(B, HV, P, V).astype(rec),
            G[:, :, None, :] + np.abs(f(B, HV, P, dg)), G, f(B, HV, K),
            np.broadcast_to(np.array([1, 1, 1, 0], np.float32), (B, HV, P)))
    kernel = (pallas_gpu if impl == "pallas_gpu" else pallas_tpu).read
    got, want = jax.jit(lambda *a: (kernel(*a, interpret=True), xla.read_arrays(*a)),
                        compiler_options=_QUICK)(*map(jnp.asarray, args))
    assert_close(got, want, jnp.float32, impl)


@pytest.mark.parametrize("records", ["float32", "bfloat16"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_decode_lowers_for_accelerators(platform, kda, records):
    """implementation=None lowered for cuda gives the Triton read kernel, for tpu the Mosaic one.
    K = V = 128, window 16, rank 4: the paper's shape; float32 or bf16 records."""
    S = jax.ShapeDtypeStruct
    B, H, HV, K = 2, 1, 2, 128
    spec = LeapQuantSpec(record_dtype=records)
    dg = K if kda else 1
    state = jax.tree.map(lambda a: S(a.shape, a.dtype),
                         jax.eval_shape(lambda: init_state(spec, B, HV, K, K, decay_dim=dg)))
    args = (S((B, 1, H, K), jnp.bfloat16), S((B, 1, H, K), jnp.bfloat16),
            S((B, 1, HV, K), jnp.bfloat16), S((B, 1, HV) + ((K,) if kda else ()), jnp.float32),
            S((B, 1, HV), jnp.float32))
    text = lower_text(lambda s, *a: leapquant_decode(*a, s, spec=spec), platform, state, *args)
    if platform == "cuda":
        assert "__gpu" in text and "leapquant_read" in text
    else:
        assert "tpu_custom_call" in text and "leapquant_read_tpu" in text
