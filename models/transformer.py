"""The Transformer stack: embedding -> repeated blocks of layers -> final norm -> output head.

Shape letters: B batch, T sequence (new tokens), D d_model, V vocabulary, R block repeats
(n_layers / P), P layers per block (lcm of len(mixers), len(ffns)).

A layer is (residual scheme, RMSNorm + [short convolution] + mixer, RMSNorm + FFN); with
cfg.short_conv > 0 a layer's cache is {"mixer": the mixer's cache, "conv": the convolution's last
inputs}, else it is the mixer's cache itself. A block holds P layers with the
mixer/FFN pattern of the config; the block is repeated R times. With cfg.scan_layers the R blocks
are one module whose parameters carry a leading "layers" axis of size R, run by jax.lax.scan (the
module is split into graphdef/state and merged inside the scan body), so compile time does not grow
with depth. Without it they are R separate modules run in a Python loop. In both cases the cache is
a tuple over the P layer positions of mixer caches stacked on a leading R axis, and cfg.remat wraps
the per-block body in jax.checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .layers import Embedding, OutputHead, RMSNorm
from .registry import get_ffn, get_mixer, get_residual
from .short_conv import ShortConv

Aux = dict[str, jax.Array]


class Layer(nnx.Module):
    """One layer: mixer and FFN sublayers, each pre-normed, combined by the residual scheme."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        self.mixer_name = cfg.mixers[index % len(cfg.mixers)]
        self.ffn_name = cfg.ffns[index % len(cfg.ffns)]
        self.residual = get_residual(cfg.residual)(cfg, rngs=rngs)
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.short_conv = ShortConv(cfg, rngs=rngs) if cfg.short_conv else None
        self.mixer = get_mixer(self.mixer_name)(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.ffn = get_ffn(self.ffn_name)(cfg, rngs=rngs)

    def __call__(self, carry: Any, cache: Any, *, positions: jax.Array,
                 segment_ids: jax.Array | None) -> tuple[Any, Any, Aux]:
        h = self.mixer_norm(self.residual.sublayer_input(carry, 0))
        if self.short_conv is not None:
            h, conv_state = self.short_conv(h, segment_ids=segment_ids,
                                            state=None if cache is None else cache["conv"])
            cache = None if cache is None else cache["mixer"]
        y, new_cache = self.mixer(h, positions=positions, segment_ids=segment_ids, cache=cache)
        if self.short_conv is not None and new_cache is not None:
            new_cache = {"mixer": new_cache, "conv": conv_state}
        carry = self.residual.update(carry, y, 0)
        h = self.residual.sublayer_input(carry, 1)
        carry = self.residual.update(carry, self.ffn(self.ffn_norm(h)), 1)
        return carry, new_cache, {}

    def init_cache(self, batch: int, max_len: int, dtype: Any) -> Any:
        mixer_cache = self.mixer.init_cache(batch, max_len, dtype)
        if self.short_conv is None:
            return mixer_cache
        return {"mixer": mixer_cache, "conv": self.short_conv.init_state(batch, dtype)}

    def flops_per_token(self, seq_len: int) -> float:
        conv = 0.0 if self.short_conv is None else self.short_conv.flops_per_token()
        return conv + self.mixer.flops_per_token(seq_len) + self.ffn.flops_per_token()


class Block(nnx.Module):
    """P consecutive layers following the config's mixer/FFN pattern."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.layers = nnx.List([Layer(cfg, i, rngs=rngs) for i in range(cfg.block_size)])

    def __call__(self, carry: Any, caches: tuple | None, *, positions: jax.Array,
                 segment_ids: jax.Array | None) -> tuple[Any, tuple | None, Aux]:
        new_caches, aux = [], {}
        for i, layer in enumerate(self.layers):
            carry, new_cache, layer_aux = layer(carry, None if caches is None else caches[i],
                                                positions=positions, segment_ids=segment_ids)
            new_caches.append(new_cache)
            for key, value in layer_aux.items():
                aux[key] = aux.get(key, 0.0) + value
        return carry, (None if caches is None else tuple(new_caches)), aux


def _remat_policy(name: str):
    if name == "full":
        return None
    return getattr(jax.checkpoint_policies, name)


def _prefix_layers_axis(module: nnx.Module) -> None:
    """Prepends the "layers" logical axis to every stacked parameter's logical_axes."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            axes = node.get_metadata("logical_axes", None)
            if axes is not None:
                node.set_metadata("logical_axes", ("layers",) + tuple(axes))


def _init_config(cfg: ModelConfig) -> ModelConfig:
    """cfg with the fields that cannot change a block's parameters set to fixed values, so models
    that differ only in them (remat, scan, tied head, cache size) share one compiled initializer."""
    return dataclasses.replace(cfg, remat="none", scan_layers=True, tie_embeddings=False,
                               max_seq_len=ModelConfig.max_seq_len)


@functools.partial(jax.jit, static_argnums=(0,))
def _init_block_states(cfg: ModelConfig, keys: jax.Array) -> nnx.State:
    """Parameters of R blocks, block r from keys[r], stacked on a leading axis (one compilation
    instead of many eager ops)."""
    return jax.vmap(lambda key: nnx.state(Block(cfg, rngs=nnx.Rngs(key))))(keys)


def _split_inexact(tree):
    """(float leaves or None, other leaves or None) of a pytree, for differentiating only the
    former (a residual carry may hold integer counters)."""
    is_float = lambda x: jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    floats = jax.tree.map(lambda x: x if is_float(x) else None, tree)
    others = jax.tree.map(lambda x: None if is_float(x) else x, tree)
    return floats, others


def _merge_split(floats, others):
    return jax.tree.map(lambda f, o: o if f is None else f, floats, others,
                        is_leaf=lambda x: x is None)


def rebuilding_scan(body, carry0, xs, extras, *, snapshot, rebuild):
    """jax.lax.scan(body(carry, x, extras) -> (carry, aux)) whose backward does not keep every
    step's carry: the forward saves snapshot(carry) per step (small) and the final carry; the
    backward rebuilds step r's input carry as rebuild(final_carry, snapshot_r), recomputes the
    step under jax.vjp and walks the steps in reverse. For residual schemes whose carry is a large
    append-mostly buffer (Attention Residuals): memory O(buffer + steps * snapshot) instead of
    O(steps * buffer), at the cost of recomputing each step's forward (remat="full" pays that
    anyway). extras (positions, segment ids) get no gradient."""

    @jax.custom_vjp
    def run(carry0, xs, extras):
        return jax.lax.scan(lambda c, x: body(c, x, extras), carry0, xs)

    def fwd(carry0, xs, extras):
        def step(c, x):
            snap = snapshot(c)
            c, aux = body(c, x, extras)
            return c, (aux, snap)

        carry, (aux, snaps) = jax.lax.scan(step, carry0, xs)
        return (carry, aux), (carry, snaps, xs, extras)

    def bwd(res, cts):
        final, snaps, xs, extras = res
        d_final, d_aux = cts

        def step(d_carry_f, inp):
            x, snap, da = inp
            c_f, c_o = _split_inexact(rebuild(final, snap))
            x_f, x_o = _split_inexact(x)

            def f(cf, xf):
                c2, aux = body(_merge_split(cf, c_o), _merge_split(xf, x_o), extras)
                return _split_inexact(c2)[0], aux

            _, vjp = jax.vjp(f, c_f, x_f)
            d_c, d_x = vjp((d_carry_f, da))
            return d_c, d_x

        d_c0, d_xs = jax.lax.scan(step, _split_inexact(d_final)[0], (xs, snaps, d_aux),
                                  reverse=True)
        zeros_like = lambda t: jax.tree.map(  # noqa: E731
            lambda a: None if a is None else jnp.zeros(jnp.shape(a), jax.dtypes.float0), t)
        d_carry0 = _merge_split(d_c0, zeros_like(_split_inexact(carry0)[1]))
        d_xs = _merge_split(d_xs, zeros_like(_split_inexact(xs)[1]))
        return d_carry0, d_xs, None

    run.defvjp(fwd, bwd)
    return run(carry0, xs, extras)


class Transformer(nnx.Module):
    """Decoder-only Transformer built from the registries (see module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size <= 0:
            raise ValueError("Transformer: ModelConfig.vocab_size is 0; fill it in from the "
                             "tokenizer first, e.g. cfg = cfg.with_vocab(tokenizer.vocab_size)")
        self.cfg = cfg
        self.embed = Embedding(cfg, rngs=rngs)
        keys = jax.random.split(rngs.params(), cfg.n_repeats)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))
        stacked = _init_block_states(_init_config(cfg), keys)
        if cfg.scan_layers:
            self.blocks = nnx.merge(graphdef, stacked)
            _prefix_layers_axis(self.blocks)
        else:
            self.blocks = nnx.List([nnx.merge(graphdef, jax.tree.map(lambda a: a[r], stacked))
                                    for r in range(cfg.n_repeats)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.head = None if cfg.tie_embeddings else OutputHead(cfg, rngs=rngs)
        # Optional residual-scheme hook: a classmethod `make_final(cfg, *, rngs) -> module` gives
        # model-level parameters (AttnRes's final aggregation query); `module(carry)` then
        # replaces `finalize(cfg, carry)`.
        make_final = getattr(get_residual(cfg.residual), "make_final", None)
        self.residual_final = None if make_final is None else make_final(cfg, rngs=rngs)

    # Forward -------------------------------------------------------------------------------
    def __call__(self, tokens: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None,
                 cache: tuple | None = None) -> tuple[jax.Array, tuple | None, Aux]:
        """tokens, positions, segment_ids [B,T] int32 -> (logits [B,T,V] float32, new_cache, aux).

        aux holds auxiliary losses / statistics (keys starting with "loss/" are added to the loss
        by the trainer); it is empty for dense models.
        """
        x, new_cache, aux = self.features(tokens, positions=positions, segment_ids=segment_ids,
                                          cache=cache)
        return self.logits(x), new_cache, aux

    def features(self, tokens: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None,
                 cache: tuple | None = None) -> tuple[jax.Array, tuple | None, Aux]:
        """Final-normed hidden states [B,T,D] (cfg.dtype), new cache, aux; `logits` maps them to
        [.., V]. Lets generation compute logits only where it needs them."""
        self._check_inputs(tokens, positions, segment_ids, cache)
        cfg = self.cfg
        residual_cls = get_residual(cfg.residual)
        carry = residual_cls.init_carry(cfg, self.embed(tokens))

        def body(carry, block_state, block_cache, graphdef):
            block = nnx.merge(graphdef, block_state)
            return block(carry, block_cache, positions=positions, segment_ids=segment_ids)

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=_remat_policy(cfg.remat),
                                  prevent_cse=not cfg.scan_layers, static_argnums=(3,))

        rebuild = getattr(residual_cls, "rebuild_carry", None)
        if cfg.scan_layers and cache is None and cfg.remat == "full" and rebuild is not None:
            # Recomputing anyway (remat="full"), and the scheme can rebuild each layer's carry
            # from the final one: save a small snapshot per layer instead of the whole carry.
            graphdef, state = nnx.split(self.blocks)

            def plain_body(carry, block_state, extras):
                block = nnx.merge(graphdef, block_state)
                carry, _, aux = block(carry, None, positions=extras[0], segment_ids=extras[1])
                return carry, aux

            carry, aux_stack = rebuilding_scan(
                plain_body, carry, state, (positions, segment_ids),
                snapshot=functools.partial(residual_cls.snapshot, cfg),
                rebuild=functools.partial(rebuild, cfg))
            aux = {k: jnp.sum(v) for k, v in aux_stack.items()}
            new_cache = None
        elif cfg.scan_layers:
            graphdef, state = nnx.split(self.blocks)

            def scan_body(carry, xs):
                block_state, block_cache = xs
                carry, new_block_cache, aux = body(carry, block_state, block_cache, graphdef)
                return carry, (new_block_cache, aux)

            carry, (new_cache, aux_stack) = jax.lax.scan(scan_body, carry, (state, cache))
            aux = {k: jnp.sum(v) for k, v in aux_stack.items()}
        else:
            new_blocks_caches, aux = [], {}
            for r, block in enumerate(self.blocks):
                graphdef, state = nnx.split(block)
                block_cache = None if cache is None else jax.tree.map(lambda a: a[r], cache)
                carry, new_block_cache, block_aux = body(carry, state, block_cache, graphdef)
                new_blocks_caches.append(new_block_cache)
                for k, v in block_aux.items():
                    aux[k] = aux.get(k, 0.0) + v
            new_cache = (None if cache is None else
                         jax.tree.map(lambda *a: jnp.stack(a), *new_blocks_caches))
        x = (residual_cls.finalize(cfg, carry) if self.residual_final is None
             else self.residual_final(carry))
        return self.final_norm(x), new_cache, aux

    def logits(self, x: jax.Array) -> jax.Array:
        """Output head: [..., T, D] hidden states -> [..., T, V] float32 logits."""
        if self.head is None:
            return self.embed.attend(x)
        return self.head(x)

    def _check_inputs(self, tokens, positions, segment_ids, cache) -> None:
        if tokens.ndim != 2:
            raise ValueError(f"Transformer: tokens must be [B,T], got shape {tokens.shape}")
        if positions.shape != tokens.shape:
            raise ValueError(f"Transformer: positions {positions.shape} must match tokens "
                             f"{tokens.shape}")
        if segment_ids is not None and segment_ids.shape != tokens.shape:
            raise ValueError(f"Transformer: segment_ids {segment_ids.shape} must match tokens "
                             f"{tokens.shape}")
        if cache is not None and len(cache) != self.cfg.block_size:
            raise ValueError(f"Transformer: cache has {len(cache)} layer entries, expected "
                             f"{self.cfg.block_size}; build it with model.init_cache")

    # Caches, FLOPs, parameters ---------------------------------------------------------------
    def _block_template(self) -> Block:
        return self.blocks if self.cfg.scan_layers else self.blocks[0]

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> tuple:
        """Tuple over the P layer positions of each mixer's cache, stacked on a leading R axis."""
        if max_len > self.cfg.max_seq_len:
            raise ValueError(f"init_cache: max_len={max_len} exceeds ModelConfig.max_seq_len="
                             f"{self.cfg.max_seq_len}; raise max_seq_len or shorten the request")
        reps = self.cfg.n_repeats
        caches = []
        for layer in self._block_template().layers:
            one = layer.init_cache(batch, max_len, dtype or self.cfg.dtype)
            caches.append(jax.tree.map(lambda a: jnp.broadcast_to(a, (reps,) + a.shape), one))
        return tuple(caches)

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token: every matmul (including the output head) plus the mixers'
        attention terms at context length seq_len. Multiply by 3 for forward + backward."""
        per_block = sum(layer.flops_per_token(seq_len) for layer in self._block_template().layers)
        head = 2.0 * self.cfg.d_model * self.cfg.vocab_size
        return self.cfg.n_repeats * per_block + head

    def num_params(self) -> int:
        return int(sum(p.size for p in jax.tree.leaves(nnx.state(self, nnx.Param))))
