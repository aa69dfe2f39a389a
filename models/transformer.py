"""The Transformer stack: embedding -> repeated blocks of layers -> final norm -> output head.

Shape letters: B batch, T sequence (new tokens), D d_model, V vocabulary, R block repeats
(n_layers / P), P layers per block (lcm of len(mixers), len(ffns)).

A layer is (residual scheme, RMSNorm + [short convolution] + mixer, RMSNorm + FFN); with
cfg.short_conv > 0 a layer's cache is {"mixer": the mixer's cache, "conv": the convolution's last
inputs}, else it is the mixer's cache itself. A block holds P layers with the
mixer/FFN pattern of the config; the block is repeated R times. With cfg.scan_layers the R blocks
are one module whose parameters carry a leading "layers" axis of size R, run by jax.lax.scan (the
module is split into graphdef/state and merged inside the scan body), so compile time does not grow
with depth. Without it they are R separate modules run in a Python loop. cfg.remat wraps the
per-block body in jax.checkpoint.

The cache (prefill and decode) is a tuple over the R blocks of tuples over their P layers (layer
i = r * P + p is cache[r][p]), one separate buffer per layer between calls. A one-token cached call
(a decode step) runs the blocks in a Python loop, scanned parameters or not (the loop takes block
r's slice of the stacked parameters): a scan would carry the caches as scanned inputs and outputs,
and so copy every layer's whole cache each step, where separate buffers are updated in place
(decode writes one slot per layer); decode programs are small, so their compile time growing with
depth costs little. A cached call on a chunk of tokens (a prefill, or the teacher-forced answer
chunk of eval/answerers.py) with scanned parameters runs the scan instead, the R blocks' caches
stacked on the way in and split on the way out: two copies of the cache, small beside a chunk's
attention, for a program compiled once per block instead of R times (the README's long-context
grid compiled its prefill in ~3 s at R = 4). Blocks whose caches differ in shape (an MSA routing
layer with a memory bank beside one without) keep the loop.

Auxiliary outputs (models/auxiliary.py): after every block call, inside the scan body (and so under
remat), the losses, metrics and intermediates its modules reported are popped and returned as scan
outputs, then named per layer (layer i = r * P + p). Non-parameter state a block updated in place
(nnx.Variables that are not Params) is returned the same way and written back into the model, so
a training step can read it with nnx.state(model, nnx.Not(nnx.Param)). Randomness: a call with
rngs splits one key per repeat (scanned with the blocks); layer p of a block draws from
nnx.Rngs(fold_in(key_r, p)), so every layer gets its own stream, identically with and without scan.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from aiinfra_jax.kernels.compilation import jit

from .config import ModelConfig
from . import auxiliary
from .auxiliary import pop_outputs
from .layers import Embedding, OutputHead, RMSNorm
from .partitioning import constrain
from .registry import get_ffn, get_mixer, get_residual
from .rebuilding import parameter_groups, rebuilding_scan, sublayer_scan
from .short_conv import ShortConv

Aux = dict[str, dict[str, jax.Array]]  # {"losses", "metrics", "intermediates"}
# Logical axes of the activations between sublayers: sharding constraints at every layer boundary
# (models/partitioning.py; no-ops without a mesh), so the compiler does not guess their layout.
_BTD = ("batch", "seq", "embed")


class Layer(nnx.Module):
    """One layer: mixer and FFN sublayers, each pre-normed, combined by the residual scheme."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        self.mixer_name = cfg.mixer_at(index)
        self.ffn_name = cfg.ffns[index % len(cfg.ffns)]
        self.residual = get_residual(cfg.residual)(cfg, rngs=rngs)
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.short_conv = ShortConv(cfg, rngs=rngs) if cfg.short_conv else None
        self.mixer = get_mixer(self.mixer_name)(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.ffn = get_ffn(self.ffn_name)(cfg, rngs=rngs)

    def __call__(self, carry: Any, cache: Any, *, positions: jax.Array,
                 segment_ids: jax.Array | None, rngs: nnx.Rngs | None = None) -> tuple[Any, Any]:
        y, new_cache = self.mixer_sublayer(self.residual.sublayer_input(carry, 0), cache,
                                           positions=positions, segment_ids=segment_ids)
        carry = self.residual.update(carry, y, 0)
        y = self.ffn_sublayer(self.residual.sublayer_input(carry, 1), segment_ids=segment_ids,
                              rngs=rngs)
        carry = self.residual.update(carry, y, 1)
        return carry, new_cache

    # The two sublayers on their own (models/rebuilding.sublayer_scan differentiates each
    # separately; its _PARTS names the attributes each one uses).
    def mixer_sublayer(self, x: jax.Array, cache: Any, *, positions: jax.Array,
                       segment_ids: jax.Array | None) -> tuple[jax.Array, Any]:
        """Sublayer 0: RMSNorm, [short convolution], mixer; x is the residual scheme's input."""
        h = constrain(self.mixer_norm(x), _BTD)
        if self.short_conv is not None:
            h, conv_state = self.short_conv(h, segment_ids=segment_ids,
                                            state=None if cache is None else cache["conv"])
            cache = None if cache is None else cache["mixer"]
        y, new_cache = self.mixer(h, positions=positions, segment_ids=segment_ids, cache=cache)
        if self.short_conv is not None and new_cache is not None:
            new_cache = {"mixer": new_cache, "conv": conv_state}
        return constrain(y, _BTD), new_cache

    def ffn_sublayer(self, x: jax.Array, *, segment_ids: jax.Array | None,
                     rngs: nnx.Rngs | None) -> jax.Array:
        """Sublayer 1: RMSNorm, FFN."""
        h = constrain(self.ffn_norm(x), _BTD)
        return constrain(self.ffn(h, segment_ids=segment_ids, rngs=rngs), _BTD)

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
                 segment_ids: jax.Array | None, key: jax.Array | None = None
                 ) -> tuple[Any, tuple | None]:
        """key: this block's PRNG key (training only); layer i draws from nnx.Rngs(fold_in(key, i))."""
        new_caches = []
        for i, layer in enumerate(self.layers):
            rngs = None if key is None else nnx.Rngs(jax.random.fold_in(key, i))
            carry, new_cache = layer(carry, None if caches is None else caches[i],
                                     positions=positions, segment_ids=segment_ids, rngs=rngs)
            new_caches.append(new_cache)
        return carry, (None if caches is None else tuple(new_caches))


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


@functools.partial(jit, static_argnums=(0,))
def _init_block_states(cfg: ModelConfig, keys: jax.Array) -> nnx.State:
    """Parameters of R blocks, block r from keys[r], stacked on a leading axis (one compilation
    instead of many eager ops)."""
    return jax.vmap(lambda key: nnx.state(Block(cfg, rngs=nnx.Rngs(key))))(keys)


def _has_model_state(block: nnx.Module) -> bool:
    """Whether a block keeps non-parameter state (which the rebuilding scan does not carry)."""
    return bool(jax.tree.leaves(nnx.state(block, nnx.Not(nnx.Param))))


def _scans_cached_chunk(cache: tuple, tokens: jax.Array) -> bool:
    """Whether a cached call on a layer-scanned model runs the scan (module docstring): a chunk of
    more than one token, and every block's cache alike in structure, shapes and dtypes."""
    if tokens.shape[1] < 2 or len(cache) < 2:
        return False
    first = jax.tree.structure(cache[0])
    specs = [[(a.shape, a.dtype) for a in jax.tree.leaves(c)] for c in cache]
    return (all(jax.tree.structure(c) == first for c in cache[1:])
            and all(s == specs[0] for s in specs[1:]))


def _per_layer(stacked: dict[str, dict[str, jax.Array]], block_size: int) -> Aux:
    """Block outputs stacked over the R repeats ({kind: {"layers/<p>/<name>": [R, ...]}}) ->
    aux with layer index i = r * P + p: losses summed over layers, metrics per layer and
    averaged over the layers where they are not NaN, intermediates per layer
    (models/auxiliary.py)."""
    aux = auxiliary.empty()
    per_name: dict[str, list] = {}
    for kind, values in stacked.items():
        for key, value in values.items():
            _, p, name = key.split("/", 2)  # "layers/<p>/<name below the layer>"
            for r in range(value.shape[0]):
                i = r * block_size + int(p)
                if kind == "losses":
                    aux["losses"][name] = aux["losses"].get(name, 0.0) + value[r]
                elif kind == "metrics":
                    aux["metrics"][f"{name}/layer_{i}"] = value[r]
                    per_name.setdefault(name, []).append(value[r])
                else:
                    aux["intermediates"][f"layer_{i}/{name}"] = value[r]
    for name, values in per_name.items():
        aux["metrics"][name] = jnp.nanmean(jnp.stack(values))  # NaN: not for that layer
    return aux


def _merge_model_level(aux: Aux, outputs: dict[str, dict], capture: bool) -> None:
    """Adds outputs reported by model-level modules (embedding, head, final aggregation)."""
    for name, value in outputs["losses"].items():
        aux["losses"][name] = aux["losses"].get(name, 0.0) + value
    aux["metrics"].update(outputs["metrics"])
    if capture:
        aux["intermediates"].update(outputs["intermediates"])


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
        # Optional mixer hook: a classmethod `after_build(model)` finishes what a mixer cannot set
        # without its layer index (MSA's routing layers), once per mixer kind in the pattern.
        for kind in dict.fromkeys(cfg.mixers):
            after_build = getattr(get_mixer(kind), "after_build", None)
            if after_build is not None:
                after_build(self)

    # Forward -------------------------------------------------------------------------------
    def __call__(self, tokens: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None, cache: tuple | None = None,
                 rngs: nnx.Rngs | None = None, capture_intermediates: bool = False
                 ) -> tuple[jax.Array, tuple | None, Aux]:
        """tokens, positions, segment_ids [B,T] int32 -> (logits [B,T,V] float32, new_cache, aux).

        rngs: randomness for the components that draw it in training (router noise); None =
        deterministic. aux: {"losses", "metrics", "intermediates"} as models/auxiliary.py
        describes; the intermediates only with capture_intermediates=True.
        """
        x, new_cache, aux = self.features(tokens, positions=positions, segment_ids=segment_ids,
                                          cache=cache, rngs=rngs,
                                          capture_intermediates=capture_intermediates)
        logits = self.logits(x)
        _merge_model_level(aux, pop_outputs(self), capture_intermediates)
        return logits, new_cache, aux

    def features(self, tokens: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None, cache: tuple | None = None,
                 rngs: nnx.Rngs | None = None, capture_intermediates: bool = False
                 ) -> tuple[jax.Array, tuple | None, Aux]:
        """Final-normed hidden states [B,T,D] (cfg.dtype), new cache, aux; `logits` maps them to
        [.., V]. Lets generation compute logits only where it needs them."""
        self._check_inputs(tokens, positions, segment_ids, cache)
        cfg = self.cfg
        residual_cls = get_residual(cfg.residual)
        carry = residual_cls.init_carry(cfg, constrain(self.embed(tokens), _BTD))
        keys = None if rngs is None else jax.random.split(rngs(), cfg.n_repeats)

        def body(carry, block_state, block_cache, key, graphdef):
            block = nnx.merge(graphdef, block_state)
            carry, new_block_cache = block(carry, block_cache, positions=positions,
                                           segment_ids=segment_ids, key=key)
            outputs = pop_outputs(block)
            if not capture_intermediates:
                outputs["intermediates"] = {}
            # Non-parameter state the block updated in place (e.g. a routing bias).
            return carry, new_block_cache, outputs, nnx.state(block, nnx.Not(nnx.Param))

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=_remat_policy(cfg.remat),
                                  prevent_cse=not cfg.scan_layers, static_argnums=(4,))

        # Layer-scan steps per loop iteration, for every scan below. Unrolled only
        # - without remat: unrolled, XLA schedules the recomputed forward freely and keeps about
        #   as much as without remat (compiled gradient temporaries of the tiny preset at 12
        #   layers, remat "full": 210 MiB looped, 1583 MiB unrolled, against 1717 MiB for remat
        #   "none"; eval/BENCHMARKS.md, "Attention Residuals training overhead", 2026-12-07);
        # - within one process: unrolled, the layers' gradient all-reduces are independent ops,
        #   which XLA:CPU may start in a different order in each process. With two processes a
        #   killed peer then left the survivor in a mismatched gloo collective (an abort, "Received
        #   data size doesn't match expected size", instead of the lost-contact message:
        #   tests/core/test_multiprocess.py failed 2 of 4 runs, passed 5 of 5 looped). A loop runs
        #   them in order.
        unroll = (cfg.scan_unroll or cfg.n_repeats) if (
            cfg.remat == "none" and jax.process_count() == 1) else 1

        # Residual schemes with a rebuildable carry (models/rebuilding.py) skip saving it per layer.
        rebuilds = getattr(residual_cls, "rebuilds", lambda cfg: False)(cfg)
        rebuild = getattr(residual_cls, "rebuild_carry", None) if rebuilds else None
        template = self._block_template()
        can_rebuild = (cfg.scan_layers and cache is None and rebuild is not None
                       and not capture_intermediates and not _has_model_state(template))
        if (can_rebuild and cfg.remat == "none"
                and parameter_groups(nnx.split(self.blocks)[1]) is not None):
            # Each sublayer keeps its own activations; the carry is rebuilt from the final one.
            graphdef, state = nnx.split(self.blocks)
            carry, (losses, metrics) = sublayer_scan(
                graphdef, state, keys, carry, (positions, segment_ids),
                snapshot=functools.partial(residual_cls.snapshot, cfg),
                rebuild=functools.partial(rebuild, cfg), unroll=unroll)
            stacked = {"losses": losses, "metrics": metrics, "intermediates": {}}
            new_cache = None
        elif can_rebuild and cfg.remat == "full":
            # Recomputing anyway (remat="full"), and the scheme can rebuild each layer's carry
            # from the final one: save a small snapshot per layer instead of the whole carry.
            graphdef, state = nnx.split(self.blocks)

            def plain_body(carry, xs, extras):
                block_state, key = xs
                block = nnx.merge(graphdef, block_state)
                carry, _ = block(carry, None, positions=extras[0], segment_ids=extras[1], key=key)
                outputs = pop_outputs(block)
                return carry, (outputs["losses"], outputs["metrics"])

            carry, (losses, metrics) = rebuilding_scan(  # looped: remat (see unroll above)
                plain_body, carry, (state, keys), (positions, segment_ids),
                snapshot=functools.partial(residual_cls.snapshot, cfg),
                rebuild=functools.partial(rebuild, cfg))
            stacked = {"losses": losses, "metrics": metrics, "intermediates": {}}
            new_cache = None
        elif cfg.scan_layers and (cache is None or _scans_cached_chunk(cache, tokens)):
            graphdef, state = nnx.split(self.blocks)

            def scan_body(carry, xs):
                block_state, block_cache, key = xs
                carry, new_block_cache, outputs, updated = body(carry, block_state, block_cache,
                                                                key, graphdef)
                return carry, (new_block_cache, outputs, updated)

            blocks_cache = None if cache is None else jax.tree.map(lambda *a: jnp.stack(a), *cache)
            carry, (new_cache, stacked, updated) = jax.lax.scan(
                scan_body, carry, (state, blocks_cache, keys), unroll=unroll)
            if cache is None:
                nnx.update(self.blocks, updated)
            else:  # inference: the model's state is left as it is (the loop below says why)
                new_cache = tuple(jax.tree.map(lambda a, r=r: a[r], new_cache)
                                  for r in range(cfg.n_repeats))
        else:
            # A Python loop over the blocks: unscanned models, one-token cached calls, and chunk
            # calls whose blocks' caches differ (see the module docstring: each layer's cache stays
            # its own buffer, updated in place).
            new_blocks_caches, per_block, per_block_updates = [], [], []
            if cfg.scan_layers:
                graphdef, stacked_state = nnx.split(self.blocks)
            for r in range(cfg.n_repeats):
                if cfg.scan_layers:
                    state = jax.tree.map(lambda a: a[r], stacked_state)
                else:
                    graphdef, state = nnx.split(self.blocks[r])
                carry, new_block_cache, outputs, updated = body(
                    carry, state, None if cache is None else cache[r],
                    None if keys is None else keys[r], graphdef)
                if not cfg.scan_layers and cache is None:
                    nnx.update(self.blocks[r], updated)
                new_blocks_caches.append(new_block_cache)
                per_block.append(outputs)
                per_block_updates.append(updated)
            stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_block)
            # Cached calls (prefill, decode) are inference: they never change the model's
            # non-parameter state, and writing it back from inside a decode loop's body would
            # mutate variables of an outer trace.
            if cfg.scan_layers and cache is None:
                nnx.update(self.blocks, jax.tree.map(lambda *a: jnp.stack(a), *per_block_updates))
            new_cache = None if cache is None else tuple(new_blocks_caches)
        x = (residual_cls.finalize(cfg, carry) if self.residual_final is None
             else self.residual_final(carry))
        return constrain(self.final_norm(x), _BTD), new_cache, _per_layer(stacked, cfg.block_size)

    def logits(self, x: jax.Array) -> jax.Array:
        """Output head: [..., T, D] hidden states -> [..., T, V] float32 logits."""
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return constrain(logits, ("batch", "seq", "vocab")) if logits.ndim == 3 else logits

    def _check_inputs(self, tokens, positions, segment_ids, cache) -> None:
        if tokens.ndim != 2:
            raise ValueError(f"Transformer: tokens must be [B,T], got shape {tokens.shape}")
        if positions.shape != tokens.shape:
            raise ValueError(f"Transformer: positions {positions.shape} must match tokens "
                             f"{tokens.shape}")
        if segment_ids is not None and segment_ids.shape != tokens.shape:
            raise ValueError(f"Transformer: segment_ids {segment_ids.shape} must match tokens "
                             f"{tokens.shape}")
        if cache is not None and (len(cache) != self.cfg.n_repeats
                                  or any(len(c) != self.cfg.block_size for c in cache)):
            raise ValueError(f"Transformer: the cache must hold {self.cfg.n_repeats} blocks of "
                             f"{self.cfg.block_size} layer caches (got "
                             f"{[len(c) for c in cache]}); build it with model.init_cache")

    def unscanned(self) -> "Transformer":
        """The same model with per-block parameters (cfg.scan_layers False): block r holds slice
        r of the stacked parameters; self if it is already unscanned. Generation calls it once
        per compiled program, outside its decode loop, so the slices are taken once per call
        instead of once per layer and step (XLA does not hoist them out of the loop by itself)."""
        if not self.cfg.scan_layers:
            return self
        cfg = dataclasses.replace(self.cfg, scan_layers=False)
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
        state = nnx.split(self)[1]
        stacked = state["blocks"]
        state["blocks"] = nnx.State({r: jax.tree.map(lambda a, r=r: a[r], stacked)
                                     for r in range(cfg.n_repeats)})
        return nnx.merge(graphdef, state)

    # Caches, FLOPs, parameters ---------------------------------------------------------------
    def _block_template(self) -> Block:
        return self.blocks if self.cfg.scan_layers else self.blocks[0]

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> tuple:
        """An empty cache: cache[r][p] is the cache of layer r * P + p, its own buffers (see the
        module docstring)."""
        if max_len > self.cfg.max_seq_len:
            raise ValueError(f"init_cache: max_len={max_len} exceeds ModelConfig.max_seq_len="
                             f"{self.cfg.max_seq_len}; raise max_seq_len or shorten the request")
        layers = self._block_template().layers
        return tuple(tuple(layer.init_cache(batch, max_len, dtype or self.cfg.dtype)
                           for layer in layers) for _ in range(self.cfg.n_repeats))

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token: every matmul (including the output head) plus the mixers'
        attention terms at context length seq_len. Multiply by 3 for forward + backward."""
        per_block = sum(layer.flops_per_token(seq_len) for layer in self._block_template().layers)
        head = 2.0 * self.cfg.d_model * self.cfg.vocab_size
        return self.cfg.n_repeats * per_block + head

    def num_params(self) -> int:
        return int(sum(p.size for p in jax.tree.leaves(nnx.state(self, nnx.Param))))
