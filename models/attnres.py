"""Attention Residuals (Kimi team, arXiv 2603.15031): softmax attention over depth as the residual
scheme (see registry.py for the interface; kernels/depth_attention for the arithmetic).

Shape letters: B batch, T sequence, D d_model, L n_layers, J = 2L sublayers, N AttnRes blocks.

Conventions (the paper's "layer" is one sublayer: every attention mixer and every FFN is one):
  * Sources. v_0 is the token embedding; v_{j+1} is the output of sublayer j (j = 0 .. J-1, in
    order mixer_0, ffn_0, mixer_1, ...).
  * Scores. Sublayer j has a learned pseudo-query w_j [D], initialised to zero, so training starts
    from the uniform average of its sources. Keys are the RMSNorm (no learned scale; a scale
    would be absorbed into w) of the sources, values the raw sources; z = w . RMSNorm(v), with no
    1/sqrt(D) factor; the softmax runs over depth, per token. The result is the sublayer's input
    (its own pre-norm RMSNorm is applied by the layer, as for the standard residual).
  * "attnres_full": sublayer j attends over v_0 .. v_j (the embedding and every earlier output).
  * "attnres_block": the J sublayers form N = cfg.attnres.n_blocks consecutive blocks of J / N
    sublayers (N must divide J). Block summaries: b_0 = the embedding; b_{n+1} = the sum of the
    outputs of the sublayers of block n (the embedding is not added in). A sublayer of block n
    attends over the finished summaries b_0 .. b_n plus the block's partial sum (the outputs of
    its earlier sublayers in the block); the first sublayer of a block has no partial sum and
    sees only the finished summaries. With N = J (one sublayer per block) this is Full AttnRes.
    Computed in the paper's two phases: one pass over the finished summaries, then an
    online-softmax merge with the partial sum.
  * Final aggregation (both schemes): the model-level query w_out [D] (zero-initialised)
    attends over every source (Full: v_0 .. v_J; Block: b_0 .. b_N); the result feeds the final
    norm. It lives in a small model-level module the Transformer builds through `make_final`.

Layer scan: the carry is {"sources": [S,B,T,D] fixed-size buffer (S = J + 1 for Full, N + 1 for
Block), "count": int32 []} (Block adds "partial" [B,T,D], the running sum of the current block):
slot 0 holds the embedding, `count` counts the sublayers done plus one, and slots not yet written
are masked (the kernels skip them), so one scanned layer body serves every depth. Cached decoding
needs nothing extra: depth attention is per token, so each call rebuilds the carry from its own
tokens' embeddings and decode equals the full forward.

Training memory and copies: plain autodiff through jax.lax.scan saves the buffer at every
depth-attention call, O(L * S * B * T * D) (quadratic in depth for Full AttnRes), and copies it as
often. Instead (cfg.attnres.rebuild, default on) the Transformer runs the scans of
models/rebuilding.py, which keep the final buffer plus a small snapshot per sublayer (snapshot /
rebuild_carry below) and read the final buffer in the backward: O((S + L) * B * T * D). With
remat="none" each sublayer's own activations are kept as for the standard residual; with
remat="full" each layer is recomputed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.kernels.depth_attention import block_depth_attention, depth_attention

from .config import ModelConfig, check_implementation, runtime_field
from .registry import register_config, register_residual

Carry = dict[str, jax.Array]
_AXES = ("depth_query", "norm")  # replicated everywhere (tiny parameters)


@register_config("attnres")
@dataclasses.dataclass(frozen=True)
class AttnResConfig:
    """Attention Residuals (arXiv 2603.15031) settings, used when residual is "attnres_*"."""

    n_blocks: int = 8  # Block AttnRes: layers are grouped into this many blocks
    # Training through the layer scan: rebuild each layer's depth buffer from the final one in the
    # backward instead of saving it per layer (models/rebuilding.py; remat "none" and "full").
    # False: plain autodiff through the scan (more memory and copies; kept for comparison).
    rebuild: bool = runtime_field(True)
    # Depth-attention kernel backend (models/config.py IMPLEMENTATIONS without "cudnn").
    implementation: str | None = runtime_field(None)
    interpret: bool = runtime_field(False)  # Pallas kernels in interpret mode (CPU tests, debugging)

    def __post_init__(self):
        if not isinstance(self.n_blocks, int) or isinstance(self.n_blocks, bool) or self.n_blocks <= 0:
            raise ValueError(f"AttnResConfig.n_blocks={self.n_blocks!r}: must be a positive int "
                             "dividing 2 * n_layers (each mixer and each FFN is one AttnRes layer)")
        check_implementation("AttnResConfig", self.implementation)



def n_sublayers(cfg: ModelConfig) -> int:
    return 2 * cfg.n_layers


def block_length(cfg: ModelConfig) -> int:
    """Sublayers per AttnRes block (J / N); raises a ValueError naming the fix if N does not
    divide J."""
    J, N = n_sublayers(cfg), cfg.attnres.n_blocks
    if J % N:
        valid = [n for n in range(1, J + 1) if J % n == 0]
        raise ValueError(f"AttnResConfig.n_blocks={N}: must divide the 2 * n_layers = {J} "
                         f"sublayers (each mixer and each FFN is one AttnRes layer); valid "
                         f"choices: {valid}")
    return J // N


@jax.custom_vjp
def _set_slot(buf: jax.Array, index: jax.Array, value: jax.Array) -> jax.Array:
    """buf with buf[index] = value (index a traced int32 scalar, value in buf's dtype), updated in
    place. A dynamic_update_slice here is fused by XLA:CPU into each later reader of the buffer
    (the next sublayer's depth-attention passes), each with its own copy of the whole buffer: 6
    copies per layer in a scanned forward (Full AttnRes at d_model 1024: forward 1.58x -> 1.15x the
    standard residual's). A scatter with a second, dropped update (out of range) stays one in-place
    write (as in models/attention/dense.write_cache). The backward keeps the slice ops: the
    scatter's own transpose (a scatter into the cotangent that a gather also reads) made the
    training step slower."""
    idx = jnp.stack([index, jnp.asarray(buf.shape[0], index.dtype)])
    return buf.at[idx].set(jnp.stack([value, value]), mode="drop")


def _set_slot_fwd(buf, index, value):
    return _set_slot(buf, index, value), index


def _set_slot_bwd(index, d_out):
    d_value = jax.lax.dynamic_index_in_dim(d_out, index, 0, keepdims=False)
    d_buf = jax.lax.dynamic_update_index_in_dim(d_out, jnp.zeros_like(d_value), index, 0)
    return d_buf, np.zeros(np.shape(index), jax.dtypes.float0), d_value


_set_slot.defvjp(_set_slot_fwd, _set_slot_bwd)


def _new_carry(x_embed_btd: jax.Array, slots: int) -> Carry:
    buf = jnp.zeros((slots,) + x_embed_btd.shape, x_embed_btd.dtype)
    return {"sources": buf.at[0].set(x_embed_btd), "count": jnp.ones((), jnp.int32)}


class DepthAggregate(nnx.Module):
    """The final aggregation before the output norm: one zero-initialised query over all slots."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.query = nnx.Param(jnp.zeros((1, cfg.d_model), cfg.param_dtype), logical_axes=_AXES)

    def __call__(self, carry: Carry) -> jax.Array:
        src = carry["sources"]
        return depth_attention(self.query[...], src, eps=self.cfg.norm_eps,
                               implementation=self.cfg.attnres.implementation,
                               interpret=self.cfg.attnres.interpret)[0]


@register_residual("attnres_full")
class FullAttnRes(nnx.Module):
    """Full AttnRes: each sublayer's input is a softmax over the embedding and every earlier
    sublayer output (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        del rngs
        self.cfg = cfg
        self._check(cfg)
        # w for the layer's two sublayers: row 0 the mixer, row 1 the FFN.
        self.queries = nnx.Param(jnp.zeros((2, cfg.d_model), cfg.param_dtype), logical_axes=_AXES)

    @classmethod
    def _check(cls, cfg: ModelConfig) -> None:
        del cfg

    @classmethod
    def slots(cls, cfg: ModelConfig) -> int:
        return n_sublayers(cfg) + 1

    @classmethod
    def init_carry(cls, cfg: ModelConfig, x_embed_btd: jax.Array) -> Carry:
        cls._check(cfg)
        return _new_carry(x_embed_btd, cls.slots(cfg))

    @classmethod
    def make_final(cls, cfg: ModelConfig, *, rngs: nnx.Rngs) -> DepthAggregate:
        del rngs
        return DepthAggregate(cfg)

    def _query(self, k: int) -> jax.Array:
        return self.queries[...][k:k + 1]

    @classmethod
    def rebuilds(cls, cfg: ModelConfig) -> bool:
        return cfg.attnres.rebuild

    def sublayer_input(self, carry: Carry, k: int) -> jax.Array:
        return depth_attention(self._query(k), carry["sources"], carry["count"],
                               eps=self.cfg.norm_eps,
                               implementation=self.cfg.attnres.implementation,
                               interpret=self.cfg.attnres.interpret)[0]

    def update(self, carry: Carry, out_btd: jax.Array, k: int) -> Carry:
        del k
        src = carry["sources"]
        src = _set_slot(src, carry["count"], out_btd.astype(src.dtype))
        return {"sources": src, "count": carry["count"] + 1}

    # Rebuilding the layer scan's carry (models/rebuilding.py): the buffer is write-once for every
    # read. A sublayer reads only the slots below its count (Full) or the finished block summaries
    # (Block, whose running partial sum lives in the carry's "partial", not in the buffer), and
    # those hold their final values already; later slots are masked. So the final buffer stands
    # in for the buffer any sublayer saw, and the snapshot is what the buffer does not hold.
    @classmethod
    def snapshot(cls, cfg: ModelConfig, carry: Carry) -> Carry:
        del cfg
        return {k: v for k, v in carry.items() if k != "sources"}

    @classmethod
    def rebuild_carry(cls, cfg: ModelConfig, final: Carry, snap: Carry) -> Carry:
        del cfg
        return {"sources": final["sources"], **snap}

    @classmethod
    def finalize(cls, cfg: ModelConfig, carry: Carry) -> jax.Array:
        """Parameter-free fallback (uniform average over every slot); the Transformer uses the
        learned DepthAggregate from make_final instead."""
        return depth_attention(jnp.zeros((1, cfg.d_model), jnp.float32), carry["sources"],
                               eps=cfg.norm_eps, implementation=cfg.attnres.implementation,
                               interpret=cfg.attnres.interpret)[0]


@register_residual("attnres_block")
class BlockAttnRes(FullAttnRes):
    """Block AttnRes: slot 1 + n of the buffer holds block n's sum once the block is finished
    (written, still partial, after every sublayer of the block; never read before it finishes);
    the carry's "partial" holds the running sum of the current block. A sublayer attends over the
    finished slots, then merges the partial sum (two phases)."""

    @classmethod
    def _check(cls, cfg: ModelConfig) -> None:
        block_length(cfg)

    @classmethod
    def slots(cls, cfg: ModelConfig) -> int:
        return cfg.attnres.n_blocks + 1

    @classmethod
    def init_carry(cls, cfg: ModelConfig, x_embed_btd: jax.Array) -> Carry:
        carry = super().init_carry(cfg, x_embed_btd)
        return {**carry, "partial": jnp.zeros_like(x_embed_btd)}

    def _position(self, carry: Carry) -> tuple[jax.Array, jax.Array]:
        """(block index n, index of this sublayer within its block)."""
        done = carry["count"] - 1
        bl = block_length(self.cfg)
        return done // bl, done % bl

    def sublayer_input(self, carry: Carry, k: int) -> jax.Array:
        n, i = self._position(carry)
        return block_depth_attention(self._query(k), carry["sources"], n + 1, carry["partial"],
                                     i > 0, eps=self.cfg.norm_eps,
                                     implementation=self.cfg.attnres.implementation,
                                     interpret=self.cfg.attnres.interpret)[0]

    def update(self, carry: Carry, out_btd: jax.Array, k: int) -> Carry:
        del k
        n, i = self._position(carry)
        src = carry["sources"]
        # The first sublayer of a block starts a new sum.
        partial = jnp.where(i > 0, carry["partial"], 0) + out_btd.astype(src.dtype)
        src = _set_slot(src, n + 1, partial)
        return {"sources": src, "count": carry["count"] + 1, "partial": partial}


def attnres_flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the depth attention (scores + weighted sums + RMSNorms), an
    upper bound counting every buffer slot as the scanned body does in XLA."""
    if not cfg.residual.startswith("attnres_"):
        return 0.0
    S = (n_sublayers(cfg) + 1) if cfg.residual == "attnres_full" else cfg.attnres.n_blocks + 1
    return (n_sublayers(cfg) + 1) * S * 7.0 * cfg.d_model


__all__ = ["FullAttnRes", "BlockAttnRes", "DepthAggregate", "block_length",
           "attnres_flops_per_token"]
