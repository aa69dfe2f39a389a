"""Layer scans that do not save every layer's carry for the backward pass.

For residual schemes whose carry is a large buffer that each layer appends to (Attention Residuals:
a [S,B,T,D] buffer of earlier sublayer outputs), plain autodiff through jax.lax.scan saves the
carry at every layer (and every depth-attention call saves its own copy): O(L * S * B * T * D)
memory, and as many buffer copies. Both scans here save a small snapshot per layer instead and
rebuild each layer's input carry from the *final* carry in the backward. That is exact for a
write-once buffer: a layer reads only slots that are final by the time it runs (the later slots
are masked), so the final buffer can stand in for the buffer the layer saw.

The scheme provides (models/attnres.py):
  snapshot(carry) -> small pytree         what the final carry does not hold (count, a partial sum)
  rebuild(final_carry, snapshot) -> carry the carry a layer saw, for its reads

  rebuilding_scan   recomputes each layer's forward in the backward (remat="full").
  sublayer_scan     remat="none": keeps each sublayer's own residuals (its activations: what a
                    plain scan keeps for the standard residual) and recomputes only the cheap
                    residual-scheme reads and writes around them. A layer is split into its
                    residual reads/writes and its two sublayers (models/transformer.Layer's
                    mixer_sublayer and ffn_sublayer), each differentiated separately with
                    jax.vjp in the forward; the vjp residuals travel as scan outputs, minus the
                    parameters they hold (taken from the scanned inputs again in the backward).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from .auxiliary import pop_outputs


def split_inexact(tree):
    """(float leaves or None, other leaves or None) of a pytree, for differentiating only the
    former (a residual carry may hold integer counters)."""
    is_float = lambda x: jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    floats = jax.tree.map(lambda x: x if is_float(x) else None, tree)
    others = jax.tree.map(lambda x: None if is_float(x) else x, tree)
    return floats, others


def merge_split(floats, others):
    return jax.tree.map(lambda f, o: o if f is None else f, floats, others,
                        is_leaf=lambda x: x is None)


def _float0_like(tree):
    return jax.tree.map(lambda a: None if a is None else jnp.zeros(jnp.shape(a), jax.dtypes.float0),
                        tree)


def _with_zero_others(d_floats, primal):
    """Cotangent of `primal` from the cotangent of its float leaves (float0 for the others)."""
    return merge_split(d_floats, _float0_like(split_inexact(primal)[1]))


def rebuilding_scan(body, carry0, xs, extras, *, snapshot, rebuild):
    """jax.lax.scan(body(carry, x, extras) -> (carry, aux)) whose backward does not keep every
    step's carry: the forward saves snapshot(carry) per step (small) and the final carry; the
    backward rebuilds step r's input carry as rebuild(final_carry, snapshot_r), recomputes the
    step under jax.vjp and walks the steps in reverse. Memory O(buffer + steps * snapshot) instead
    of O(steps * buffer), at the cost of recomputing each step's forward (remat="full" pays that
    anyway). extras (positions, segment ids) get no gradient. Always looped: under remat an
    unrolled scan keeps about what no remat keeps (models/transformer.py)."""

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
            c_f, c_o = split_inexact(rebuild(final, snap))
            x_f, x_o = split_inexact(x)

            def f(cf, xf):
                c2, aux = body(merge_split(cf, c_o), merge_split(xf, x_o), extras)
                return split_inexact(c2)[0], aux

            _, vjp = jax.vjp(f, c_f, x_f)
            d_c, d_x = vjp((d_carry_f, da))
            return d_c, d_x

        d_c0, d_xs = jax.lax.scan(step, split_inexact(d_final)[0], (xs, snaps, d_aux),
                                  reverse=True)
        return _with_zero_others(d_c0, carry0), _with_zero_others(d_xs, xs), None

    run.defvjp(fwd, bwd)
    return run(carry0, xs, extras)


# ----------------------------------------------------------------------------------------------
# sublayer_scan

# Which attribute of a Layer each parameter belongs to: sublayer 0 (the mixer), sublayer 1 (the
# FFN), or the residual scheme ("res"), whose reads and writes are recomputed in the backward.
_PARTS = {"mixer_norm": 0, "short_conv": 0, "mixer": 0, "ffn_norm": 1, "ffn": 1,
          "residual": "res"}


def _key_name(k) -> Any:
    return getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))


def parameter_groups(block_state) -> list[tuple[int, Any]] | None:
    """(layer index p, part) for every leaf of a Block's state, in leaf order; None when the block
    cannot be split (a leaf outside layers/<p>/<known attribute>, or one that is not a float)."""
    groups = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(block_state)[0]:
        names = [_key_name(k) for k in path]
        if (len(names) < 3 or names[0] != "layers" or names[2] not in _PARTS
                or not jnp.issubdtype(leaf.dtype, jnp.inexact)):
            return None
        groups.append((int(names[1]), _PARTS[names[2]]))
    return groups


def sublayer_scan(graphdef, states, keys, carry0, extras, *, snapshot: Callable,
                  rebuild: Callable, unroll: int | bool = 1):
    """The layer scan of Transformer.features for remat="none" with a rebuildable carry (see the
    module docstring). states: the Blocks' parameters stacked over the R repeats; keys: [R] PRNG
    keys or None; extras = (positions, segment_ids), no gradient. Returns (final carry,
    (losses, metrics)) with the per-block outputs stacked over R, as the plain scan does. unroll:
    jax.lax.scan's, for the forward and the backward scan alike."""
    leaves0, treedef = jax.tree.flatten(states)
    groups = parameter_groups(states)
    if groups is None:
        raise ValueError("sublayer_scan: the block's parameters do not split into mixer, FFN and "
                         "residual parts (check parameter_groups before calling)")
    n_layers = 1 + max(p for p, _ in groups)
    order = [(p, k) for p in range(n_layers) for k in (0, 1)]
    positions, segment_ids = extras
    # Filled while the forward is traced, read when the backward is: for each sublayer the vjp's
    # tree structure, per residual leaf the index of the parameter leaf it is (or None), and the
    # names of the losses and metrics the sublayer reported (its cotangent's structure).
    layout: dict[tuple[int, int], tuple[Any, list[int | None], tuple]] = {}

    def idx(g):
        return [i for i, gg in enumerate(groups) if gg == g]

    def block_with(leaves, g, values):
        leaves = list(leaves)
        for i, v in zip(idx(g), values):
            leaves[i] = v
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    def no_outputs(block, what):
        out = pop_outputs(block)
        if any(out[kind] for kind in ("losses", "metrics")):
            raise NotImplementedError(f"sublayer_scan: the residual scheme's {what} reported "
                                      f"{sorted(out['losses']) + sorted(out['metrics'])}; only "
                                      "sublayers may report outputs here")

    def read(leaves, p, k):
        def f(res, carry):
            block = block_with(leaves, (p, "res"), res)
            h = block.layers[p].residual.sublayer_input(carry, k)
            no_outputs(block, "sublayer_input")
            return h
        return f

    def write(leaves, p, k):
        def f(res, carry, y):
            block = block_with(leaves, (p, "res"), res)
            carry = block.layers[p].residual.update(carry, y, k)
            no_outputs(block, "update")
            return carry
        return f

    def sublayer(leaves, p, k, key):
        def f(params, h):
            block = block_with(leaves, (p, k), params)
            layer = block.layers[p]
            if k == 0:
                y, _ = layer.mixer_sublayer(h, None, positions=positions,
                                            segment_ids=segment_ids)
            else:
                rngs = None if key is None else nnx.Rngs(jax.random.fold_in(key, p))
                y = layer.ffn_sublayer(h, segment_ids=segment_ids, rngs=rngs)
            out = pop_outputs(block)
            return y, (out["losses"], out["metrics"])
        return f

    def take(leaves, g):
        return [leaves[i] for i in idx(g)]

    def fwd_step(carry, xs):
        leaves, key = xs
        saved, outputs = [], ({}, {})
        for p, k in order:
            snap = snapshot(carry)
            res = take(leaves, (p, "res"))
            h = read(leaves, p, k)(res, carry)
            (y, out), vjp = jax.vjp(sublayer(leaves, p, k, key), take(leaves, (p, k)), h)
            carry = write(leaves, p, k)(res, carry, y)
            # The vjp's residuals, less those that are parameters (rebuilt from xs later).
            v_leaves, v_def = jax.tree.flatten(vjp)
            from_params = [next((i for i, leaf in enumerate(leaves) if leaf is v), None)
                           for v in v_leaves]
            layout[(p, k)] = (v_def, from_params, (tuple(out[0]), tuple(out[1])))
            kept = [v for v, i in zip(v_leaves, from_params) if i is None]
            saved.append((snap, y, kept))
            outputs[0].update(out[0])
            outputs[1].update(out[1])
        return carry, (outputs, saved)

    @jax.custom_vjp
    def run(carry0, states, keys):
        final, (outputs, _) = jax.lax.scan(fwd_step, carry0, (jax.tree.leaves(states), keys),
                                           unroll=unroll)
        return final, outputs

    def run_fwd(carry0, states, keys):
        leaves = jax.tree.leaves(states)
        final, (outputs, saved) = jax.lax.scan(fwd_step, carry0, (leaves, keys), unroll=unroll)
        # Only carry0's non-float leaves (the counter): its float part (the initial buffer) is
        # not needed for the backward, and saving it would keep one more buffer alive.
        return (final, outputs), (final, saved, leaves, keys, split_inexact(carry0)[1])

    def run_bwd(res, cts):
        final, saved, all_leaves, keys, c0_others = res
        d_final, d_outputs = cts

        def bwd_step(d_c, inp):
            leaves, key, step_saved, d_out = inp
            grads = [None] * len(leaves)

            def add(g, values):
                for i, v in zip(idx(g), values):
                    grads[i] = v if grads[i] is None else grads[i] + v

            for (p, k), (snap, y, kept) in reversed(list(zip(order, step_saved))):
                carry = rebuild(final, snap)
                c_f, c_o = split_inexact(carry)
                res = take(leaves, (p, "res"))
                w = write(leaves, p, k)
                _, vjp_w = jax.vjp(lambda r, c, y_: split_inexact(w(r, merge_split(c, c_o), y_))[0],
                                   res, c_f, y)
                d_res_w, d_c_w, dy = vjp_w(d_c)
                v_def, from_params, names = layout[(p, k)]
                kept_iter = iter(kept)
                v_leaves = [next(kept_iter) if i is None else leaves[i] for i in from_params]
                vjp_s = jax.tree.unflatten(v_def, v_leaves)
                d_out_k = tuple({name: d[name] for name in part}
                                for d, part in zip(d_out, names))
                d_params, dh = vjp_s((dy, d_out_k))
                r = read(leaves, p, k)
                _, vjp_r = jax.vjp(lambda r_, c: r(r_, merge_split(c, c_o)), res, c_f)
                d_res_r, d_c_r = vjp_r(dh)
                add((p, k), d_params)
                add((p, "res"), d_res_w)
                add((p, "res"), d_res_r)
                d_c = jax.tree.map(jnp.add, d_c_w, d_c_r)
            return d_c, [jnp.zeros_like(leaf) if g is None else g
                         for leaf, g in zip(leaves, grads)]

        d_c0, d_leaves = jax.lax.scan(
            bwd_step, split_inexact(d_final)[0], (all_leaves, keys, saved, d_outputs),
            reverse=True, unroll=unroll)
        d_states = jax.tree.unflatten(treedef, d_leaves)
        d_keys = None if keys is None else _float0_like(keys)
        return merge_split(d_c0, _float0_like(c0_others)), d_states, d_keys

    run.defvjp(run_fwd, run_bwd)
    return run(carry0, states, keys)
