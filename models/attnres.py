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
Block), "count": int32 []}: slot 0 holds the embedding, `count` counts the sublayers done plus one,
and slots not yet written are masked (the kernels skip them), so one scanned layer body serves every
depth. Cached decoding needs nothing extra: depth attention is per token, so each call rebuilds the
carry from its own tokens' embeddings and decode equals the full forward.

Memory note: under jax.lax.scan + autodiff the buffer is saved at every depth-attention call, i.e.
O(L * S * B * T * D) for training (S = N + 1 is small for Block AttnRes; Full AttnRes grows
quadratically with depth). With remat="full" the Transformer instead runs
models/transformer.rebuilding_scan: it keeps the final buffer and one [B,T,D] slot per layer
(snapshot / rebuild_carry below) and rebuilds each layer's input buffer in the backward:
O((S + L) * B * T * D).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
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

    def sublayer_input(self, carry: Carry, k: int) -> jax.Array:
        return depth_attention(self._query(k), carry["sources"], carry["count"],
                               eps=self.cfg.norm_eps,
                               implementation=self.cfg.attnres.implementation,
                               interpret=self.cfg.attnres.interpret)[0]

    def update(self, carry: Carry, out_btd: jax.Array, k: int) -> Carry:
        del k
        src = carry["sources"]
        src = jax.lax.dynamic_update_index_in_dim(src, out_btd.astype(src.dtype), carry["count"], 0)
        return {"sources": src, "count": carry["count"] + 1}

    # Rebuilding the layer scan's carry (models/transformer.rebuilding_scan, used with remat="full"):
    # at the start of a layer with `done` sublayers finished, slots 0 .. n (n = done // block
    # length: the embedding and the finished blocks) already hold their final values, slot n + 1
    # holds the current block's partial sum (Full: nothing yet) and later slots are zero. So the
    # final buffer plus one [B,T,D] slot per layer rebuilds every layer's input exactly.
    @classmethod
    def _block_len(cls, cfg: ModelConfig) -> int:
        del cfg
        return 1

    @classmethod
    def snapshot(cls, cfg: ModelConfig, carry: Carry) -> Carry:
        n = (carry["count"] - 1) // cls._block_len(cfg)
        slot = jax.lax.dynamic_index_in_dim(carry["sources"], n + 1, 0, keepdims=False)
        return {"slot": slot, "count": carry["count"]}

    @classmethod
    def rebuild_carry(cls, cfg: ModelConfig, final: Carry, snap: Carry) -> Carry:
        src = final["sources"]
        n = (snap["count"] - 1) // cls._block_len(cfg)
        idx = jnp.arange(src.shape[0]).reshape((-1,) + (1,) * (src.ndim - 1))
        rebuilt = jnp.where(idx <= n, src, jnp.where(idx == n + 1, snap["slot"][None], 0))
        return {"sources": rebuilt.astype(src.dtype), "count": snap["count"]}

    @classmethod
    def finalize(cls, cfg: ModelConfig, carry: Carry) -> jax.Array:
        """Parameter-free fallback (uniform average over every slot); the Transformer uses the
        learned DepthAggregate from make_final instead."""
        return depth_attention(jnp.zeros((1, cfg.d_model), jnp.float32), carry["sources"],
                               eps=cfg.norm_eps, implementation=cfg.attnres.implementation,
                               interpret=cfg.attnres.interpret)[0]


@register_residual("attnres_block")
class BlockAttnRes(FullAttnRes):
    """Block AttnRes: slot 1 + n of the buffer holds block n's sum (partial while the block runs);
    a sublayer attends over the finished slots, then merges the partial sum (two phases)."""

    @classmethod
    def _check(cls, cfg: ModelConfig) -> None:
        block_length(cfg)

    @classmethod
    def slots(cls, cfg: ModelConfig) -> int:
        return cfg.attnres.n_blocks + 1

    @classmethod
    def _block_len(cls, cfg: ModelConfig) -> int:
        return block_length(cfg)

    def _position(self, carry: Carry) -> tuple[jax.Array, jax.Array]:
        """(block index n, index of this sublayer within its block)."""
        done = carry["count"] - 1
        bl = block_length(self.cfg)
        return done // bl, done % bl

    def sublayer_input(self, carry: Carry, k: int) -> jax.Array:
        n, i = self._position(carry)
        src = carry["sources"]
        partial = jax.lax.dynamic_index_in_dim(src, n + 1, 0, keepdims=False)
        return block_depth_attention(self._query(k), src, n + 1, partial, i > 0,
                                     eps=self.cfg.norm_eps,
                                     implementation=self.cfg.attnres.implementation,
                               interpret=self.cfg.attnres.interpret)[0]

    def update(self, carry: Carry, out_btd: jax.Array, k: int) -> Carry:
        del k
        n, _ = self._position(carry)
        src = carry["sources"]
        # The slot starts at zero (init_carry), so the first sublayer of a block just adds too.
        slot = jax.lax.dynamic_index_in_dim(src, n + 1, 0, keepdims=False)
        src = jax.lax.dynamic_update_index_in_dim(src, slot + out_btd.astype(src.dtype), n + 1, 0)
        return {"sources": src, "count": carry["count"] + 1}


def attnres_flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the depth attention (scores + weighted sums + RMSNorms), an
    upper bound counting every buffer slot as the scanned body does in XLA."""
    if not cfg.residual.startswith("attnres_"):
        return 0.0
    S = (n_sublayers(cfg) + 1) if cfg.residual == "attnres_full" else cfg.attnres.n_blocks + 1
    return (n_sublayers(cfg) + 1) * S * 7.0 * cfg.d_model


__all__ = ["FullAttnRes", "BlockAttnRes", "DepthAggregate", "block_length",
           "attnres_flops_per_token"]
