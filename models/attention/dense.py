"""Dense causal grouped-query attention ("dense" mixer) with a key/value cache.

Shape letters: B batch, T new tokens, S cache slots (max_len), D d_model, H query heads,
K key/value heads (H = G * K), Dh head_dim.

Without a cache: causal attention restricted to equal segment ids (0 = padding, its own segment).
With a cache {"k": [B,K,Dh,S], "v": [B,K,S,Dh], "lengths": [B] int32}: the T new keys/values
are written at slots lengths[b] .. lengths[b]+T-1, and query i of row b sees slots < lengths[b] +
i + 1. Rows must be right-padded; segment_ids (if given) marks real tokens (nonzero), and each
row's length grows by its count of real tokens. A row whose real tokens do not fit in the S slots
is refused (`cache_room`): nothing of it is written, its length stays, and its outputs are NaN,
so the overflow shows in its logits instead of corrupting the cache.

The cache is head-major, with the keys transposed ([B,K,Dh,S]; values [B,K,S,Dh]), so that
cached calls run the shared kernels.flash_attention.cached_attention as two plain matmuls that read
the cache once (its docstring says what the sequence-major layout, and untransposed keys, cost).
Where cuDNN is chosen (see DenseConfig) a prefill chunk (T > 1) transposes the cache once and runs
cuDNN's fused attention instead.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from aiinfra_jax.kernels.flash_attention import AttentionMask, cached_attention, flash_attention

from ..config import ModelConfig, check_implementation, runtime_field
from ..layers import RMSNorm, apply_rope, make_param, out_proj_std, project
from ..registry import register_config, register_mixer

DenseCache = dict[str, jax.Array]

log = logging.getLogger(__name__)

KERNELS = ("dot_product_attention", "flash_attention")


@register_config("dense")
@dataclasses.dataclass(frozen=True)
class DenseConfig:
    """How dense attention runs (kernel, implementation, interpret: run-time fields, none changes
    what the layer computes), and two architecture options of Qwen-style layers:

    qkv_bias: learned biases on the q, k and v projections (bq [H,Dh], bk / bv [K,Dh]; Qwen2).
    qk_norm: an RMSNorm over head_dim on each query and key head before RoPE (q_norm / k_norm
      scale [Dh], eps = model.norm_eps; Qwen3).

    kernel: "dot_product_attention" = jax.nn.dot_product_attention with a boolean mask;
      "flash_attention" = the shared chunked kernel (kernels/flash_attention: never a [B,H,T,T]
      logits tensor, the choice for long contexts off-GPU) for full forward passes. Cached
      prefill / decode always use kernels.flash_attention.cached_attention on the head-major
      cache (cuDNN for prefill chunks where the implementation rule below picks it).
    implementation: the backend, in the one vocabulary of models/config.py IMPLEMENTATIONS. For
      dot_product_attention: None = cuDNN on a GPU for bfloat16 / float16 compute when the shapes
      allow it (falling back to XLA with a logged warning if cuDNN cannot trace), XLA otherwise;
      "xla" or "cudnn" force one ("cudnn" raises where unavailable). For flash_attention: None,
      "xla", "pallas_gpu" or "pallas_tpu", as for every kernel.
    """

    kernel: str = runtime_field("dot_product_attention")
    implementation: str | None = runtime_field(None)
    interpret: bool = runtime_field(False)  # Pallas kernels in interpret mode (CPU tests, debugging)
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"DenseConfig.kernel={self.kernel!r}: valid choices: {KERNELS}")
        allowed = ((None, "xla", "cudnn") if self.kernel == "dot_product_attention"
                   else (None, "xla", "pallas_gpu", "pallas_tpu"))
        check_implementation(f"DenseConfig (kernel={self.kernel!r})", self.implementation, allowed)


def choose_implementation(requested: str | None, dtype, head_dim: int,
                          backend: str | None = None) -> str:
    """The jax.nn.dot_product_attention implementation to use ("xla" or "cudnn").

    None: "cudnn" on a GPU when the compute dtype is bfloat16/float16 and head_dim is a multiple of
    8 up to 128 (cuDNN's fused attention limits), else "xla". An explicit "cudnn" off a GPU raises.
    """
    backend = backend or jax.default_backend()
    ok_shape = head_dim % 8 == 0 and head_dim <= 128
    ok_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if requested == "cudnn":
        if backend != "gpu" or not ok_shape or not ok_dtype:
            raise ValueError(f"dense.implementation='cudnn' needs a GPU backend (have {backend!r}), "
                             f"bfloat16/float16 compute (have {jnp.dtype(dtype).name}) and "
                             f"head_dim a multiple of 8 <= 128 (have {head_dim}); use "
                             "dense.implementation=None or 'xla'")
        return "cudnn"
    if requested == "xla":
        return "xla"
    return "cudnn" if backend == "gpu" and ok_shape and ok_dtype else "xla"


def sdpa(q_bthd, k_bskd, v_bskd, mask_b1ts, requested: str | None) -> jax.Array:
    """jax.nn.dot_product_attention with a boolean mask on the chosen backend (GQA natively)."""
    impl = choose_implementation(requested, q_bthd.dtype, q_bthd.shape[-1])
    if impl == "cudnn":
        try:
            return jax.nn.dot_product_attention(q_bthd, k_bskd, v_bskd, mask=mask_b1ts,
                                                implementation="cudnn")
        except Exception as err:  # cuDNN missing or shape unsupported: only for automatic choice
            if requested == "cudnn":
                raise
            log.warning("dense attention: cuDNN cannot run here (%s: %s); using XLA",
                        type(err).__name__, err)
    return jax.nn.dot_product_attention(q_bthd, k_bskd, v_bskd, mask=mask_b1ts,
                                        implementation="xla")


def attention_mask(segment_ids_bt: jax.Array | None, batch: int, seq: int) -> jax.Array:
    """Boolean [B,1,T,T] mask: causal and same segment (padding 0 is a segment of its own)."""
    causal = jnp.tril(jnp.ones((seq, seq), jnp.bool_))[None, None]
    if segment_ids_bt is None:
        return jnp.broadcast_to(causal, (batch, 1, seq, seq))
    same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return causal & same[:, None]


def cache_mask(lengths_b: jax.Array, seq: int, slots: int) -> jax.Array:
    """Boolean [B,T,S]: query i of row b sees cache slots < lengths[b] + i + 1."""
    limit_bt = lengths_b[:, None] + jnp.arange(seq, dtype=lengths_b.dtype)[None, :]
    return jnp.arange(slots)[None, None, :] <= limit_bt[:, :, None]


def cache_room(lengths_b: jax.Array, segment_ids: jax.Array | None, seq: int, slots: int
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(added [B], fits [B] bool, write_at [B]) of a cached call with ``seq`` new tokens: the real
    tokens each row adds, whether they fit in its ``slots``, and where its tokens go (a row that
    does not fit writes at ``slots``, past the end, so write_cache drops all of it). Every mixer's
    cache refuses an overflowing row this way (registry, "Mixer"): never a write past the end."""
    if segment_ids is None:
        added = jnp.full_like(lengths_b, seq)
    else:
        added = jnp.sum(segment_ids != 0, axis=1).astype(lengths_b.dtype)
    fits = lengths_b + added <= slots
    return added, fits, jnp.where(fits, lengths_b, slots)


def refuse_rows(y_bt: jax.Array, fits_b: jax.Array) -> jax.Array:
    """y with the rows that did not fit in their cache set to NaN (see cache_room)."""
    fits = fits_b.reshape(fits_b.shape + (1,) * (y_bt.ndim - 1))
    return jnp.where(fits, y_bt, jnp.asarray(jnp.nan, y_bt.dtype))


CACHE_LAYOUTS = ("bskd", "bksd", "bkds")  # a cache buffer's axes: batch, slot, kv head, head dim


def write_cache(buf: jax.Array, new_btkd: jax.Array, lengths_b: jax.Array, *,
                layout: str = "bskd") -> jax.Array:
    """buf ([B,S,K,Dh] for layout "bskd", [B,K,S,Dh] for "bksd", [B,K,Dh,S] for "bkds") with
    new[b, i] ([B,T,K,Dh]) written at slot lengths[b] + i (out-of-range slots dropped)."""
    batch, seq = new_btkd.shape[:2]
    slots_bt = lengths_b[:, None] + jnp.arange(seq, dtype=lengths_b.dtype)[None, :]
    return scatter_slots(buf, slots_bt, new_btkd, layout=layout)


def scatter_slots(buf: jax.Array, slots_bt: jax.Array, new_btkd: jax.Array, *,
                  layout: str = "bskd") -> jax.Array:
    """buf (layouts as write_cache) with new[b, i] ([B,T,K,Dh]) written at slot slots[b, i]
    (out-of-range slots dropped)."""
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"write_cache: layout={layout!r}; choose from {CACHE_LAYOUTS}")
    slot_axis = layout.index("s")
    batch, seq = new_btkd.shape[:2]
    rows_bt = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, seq))
    new = new_btkd.astype(buf.dtype)
    if batch * seq == 1:
        # One update would become a dynamic_update_slice, which XLA:CPU then fuses into each
        # reader of the written cache separately, each fused copy with its own copy of the whole
        # cache (8 copies in a dense decode step at 64K slots, measured: 64 ms for a step whose
        # attention takes 4 ms; 8 copies of NSA's compressed cache at 64K, 0.75 ms of a 2 ms
        # step). A second update at an out-of-range slot (dropped) keeps it a scatter, which XLA
        # updates in place for every reader.
        slots_bt = jnp.concatenate([slots_bt, jnp.full_like(slots_bt, buf.shape[slot_axis])],
                                   axis=1)
        rows_bt = jnp.concatenate([rows_bt, rows_bt], axis=1)
        new = jnp.concatenate([new, new], axis=1)
    # Advanced indices around slices: the indexed dims lead, so every layout takes [B,T,K,Dh].
    if layout == "bkds":
        return buf.at[rows_bt, :, :, slots_bt].set(new, mode="drop")
    if layout == "bksd":
        return buf.at[rows_bt, :, slots_bt].set(new, mode="drop")
    return buf.at[rows_bt, slots_bt].set(new, mode="drop")


def kv_buffers(batch: int, kv_heads: int, head_dim: int, slots: int, dtype: Any
               ) -> dict[str, jax.Array]:
    """Empty key/value buffers of a softmax cache read by cached_attention: k [B,K,Dh,S] (keys
    transposed), v [B,K,S,Dh] (the dense and MSA caches)."""
    return {"k": jnp.zeros((batch, kv_heads, head_dim, slots), dtype),
            "v": jnp.zeros((batch, kv_heads, slots, head_dim), dtype)}


def write_kv(cache: dict[str, jax.Array], k_btkd: jax.Array, v_btkd: jax.Array,
             slots_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(k, v) of kv_buffers' layout with the new keys / values [B,T,K,Dh] written from slot
    slots_b[b] on (write_cache)."""
    return (write_cache(cache["k"], k_btkd, slots_b, layout="bkds"),
            write_cache(cache["v"], v_btkd, slots_b, layout="bksd"))


@register_mixer("dense")
class DenseAttention(nnx.Module):
    """Projections q/k/v/o, RoPE, then attention by cfg.dense (DenseConfig: the kernel and its
    backend)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, k, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        std, pdt = cfg.init_std, cfg.param_dtype
        self.wq = make_param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), std, pdt)
        self.wk = make_param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), std, pdt)
        self.wv = make_param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), std, pdt)
        self.wo = make_param(rngs, (h, dh, d), ("heads", "head_dim", "embed"), out_proj_std(cfg),
                             pdt)
        if cfg.dense.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((h, dh), pdt), logical_axes=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((k, dh), pdt), logical_axes=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((k, dh), pdt), logical_axes=("kv_heads", "head_dim"))
        if cfg.dense.qk_norm:
            self.q_norm = RMSNorm(dh, eps=cfg.norm_eps, param_dtype=pdt)
            self.k_norm = RMSNorm(dh, eps=cfg.norm_eps, param_dtype=pdt)

    def project_qkv(self, x_btd: jax.Array, positions_bt: jax.Array):
        """q [B,T,H,Dh], k and v [B,T,K,Dh] in the compute dtype, RoPE applied to q and k (after
        the biases and q/k norms of DenseConfig.qkv_bias / qk_norm)."""
        dt = jnp.dtype(self.cfg.dtype)
        x = x_btd.astype(dt)
        q = project(x, self.wq[...].astype(dt))
        k = project(x, self.wk[...].astype(dt))
        v = project(x, self.wv[...].astype(dt))
        if self.cfg.dense.qkv_bias:
            q, k, v = (a + b[...].astype(dt) for a, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if self.cfg.dense.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        theta = self.cfg.rope_theta
        return apply_rope(q, positions_bt, theta), apply_rope(k, positions_bt, theta), v

    def __call__(self, x_btd: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None,
                 cache: DenseCache | None = None) -> tuple[jax.Array, DenseCache | None]:
        batch, seq, _ = x_btd.shape
        dt = jnp.dtype(self.cfg.dtype)
        q, k, v = self.project_qkv(x_btd, positions)
        run = self.cfg.dense
        flash = run.kernel == "flash_attention"
        sdpa_impl = None if flash else run.implementation  # cached calls of the flash setting too
        if cache is None and flash:
            # the chunked kernel: no [B,H,T,T] logits, so long contexts fit in memory
            y = flash_attention(q, k, v, mask=AttentionMask(causal=True), segment_ids=segment_ids,
                                implementation=run.implementation, interpret=run.interpret)
            new_cache = None
        elif cache is None:
            mask = attention_mask(segment_ids, batch, seq)
            y = sdpa(q, k, v, mask, sdpa_impl)
            new_cache = None
        else:
            lengths = cache["lengths"]
            slots = cache["v"].shape[2]
            added, fits, write_at = cache_room(lengths, segment_ids, seq, slots)
            k_all, v_all = write_kv(cache, k, v, write_at)
            mask = cache_mask(lengths, seq, slots)
            if seq > 1 and choose_implementation(sdpa_impl, dt, q.shape[-1]) == "cudnn":
                y = sdpa(q, k_all.transpose(0, 3, 1, 2).astype(dt),
                         v_all.swapaxes(1, 2).astype(dt), mask[:, None], sdpa_impl)
            else:
                y = cached_attention(q, k_all, v_all, mask, keys_transposed=True)
            y = refuse_rows(y, fits)
            new_cache = {"k": k_all, "v": v_all, "lengths": lengths + jnp.where(fits, added, 0)}
        out = project(y.astype(dt), self.wo[...].astype(dt), contract=2)
        return out, new_cache

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> DenseCache:
        dtype = jnp.dtype(dtype or self.cfg.dtype)
        return {**kv_buffers(batch, self.cfg.n_kv_heads, self.cfg.resolved_head_dim, max_len,
                             dtype), "lengths": jnp.zeros((batch,), jnp.int32)}

    def flops_per_token(self, seq_len: int) -> float:
        """Projections 2*D*(2H+2K)*Dh plus scores and values 4*H*Dh per attended key; causal
        attention sees (seq_len + 1) / 2 keys on average."""
        c = self.cfg
        dh = c.resolved_head_dim
        proj = 2.0 * c.d_model * dh * (2 * c.n_heads + 2 * c.n_kv_heads)
        attn = 4.0 * c.n_heads * dh * (seq_len + 1) / 2.0
        return proj + attn
