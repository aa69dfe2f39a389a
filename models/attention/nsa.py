"""Native Sparse Attention ("nsa" mixer, arXiv 2502.11089) with a decoding cache.

Shape letters: B batch, T new tokens, S cache slots (max_len) or keys, D d_model, H query heads,
K key/value heads (H = G * K), Dh head_dim, C compressed tokens, J compressed tokens built in one
call, L compression block length (l), F compression-MLP width, n selected blocks.

Three branches share the query and are mixed by per-head sigmoid gates computed from the layer
input:
  cmp  compression: the raw (un-rotated) keys / values of the branch are cut into blocks of L
       tokens with stride d; block i (raw rows [i*d, i*d + L)) becomes one compressed key and one
       compressed value via mean(x + pe) + MLP(x + pe) (pe: learned intra-block position encoding;
       separate weights for K and V). The compressed key is rotated (RoPE) at the position of the
       block's last token. Queries attend through flash_attention's compressed mask (whole block
       in the past).
  slc  selection: select_blocks scores selection blocks of l' raw keys from q, the compressed keys
       and the compression branch's log-sum-exp; sparse_attention attends to the top-n blocks.
  win  sliding window: flash_attention(window=w).
All attention arithmetic lives in the shared kernels (kernels/flash_attention, block_selection,
sparse_attention); NSAConfig.implementation picks their backend (None = best available). A decode
step (one query per row) runs the cmp and win branches and the gathered selected blocks through
kernels.flash_attention.cached_attention instead, on every backend: two small matmuls per branch
over at most C, w and n*l' keys, where the tiled kernels pad the single query to a tile and
loop over key tiles (their fixed cost was most of a decode step); its blocks are ranked by the
compressed branch's own probabilities (select_blocks_from_probs), not by logits computed again.

Packed documents (segment_ids, training): every branch masks by segment; a compressed block that
spans a document boundary gets kv segment id -1, so no query sees it. Blocks and windows are laid
out on the row index, like the kernels' positions.

The decoding cache (its layout, prefill and decode steps) is in models/attention/nsa_cache.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax.kernels.block_selection import select_blocks, select_blocks_from_probs
from aiinfra_jax.kernels.flash_attention import AttentionMask, flash_attention
from aiinfra_jax.kernels.sparse_attention import sparse_attention

from ..auxiliary import record
from ..config import ModelConfig, check_implementation, runtime_field
from ..layers import apply_rope, out_proj_std, project
from ..registry import register_config, register_mixer
# n_compressed is also re-exported: tests and eval/bench_nsa import it from here.
from .nsa_cache import NSACache, NSACacheMixin, attend_one, cache_keys, n_compressed


@register_config("nsa")
@dataclasses.dataclass(frozen=True)
class NSAConfig:
    """Native Sparse Attention (arXiv 2502.11089) settings, used by layers whose mixer is "nsa".

    Sizes: compression blocks of length cmp_block_len (l) with stride cmp_stride (d); selection
    blocks of length sel_block_size (l'), n_selected (n) of them per query and KV group, the n_init
    initial and n_local local blocks always among them; a sliding window of `window` (w) keys.
    """

    cmp_block_len: int = 32
    cmp_stride: int = 16
    sel_block_size: int = 64
    n_selected: int = 16
    n_init: int = 1
    n_local: int = 2
    window: int = 512
    separate_kv: bool = True  # separate K/V projections per branch (the paper's recommendation)
    remap: str = "overlap"  # "overlap" | "eq9": compression -> selection score remap
    cmp_mlp_hidden: int | None = None  # hidden width of the compression MLP; None = head_dim
    # Initial biases of the per-head sigmoid gates (compressed, selected, window): the default
    # starts the window branch at sigmoid(1) = 0.73 and the two sparse branches at 0.27.
    gate_bias: tuple[float, ...] = (-1.0, -1.0, 1.0)
    # Query heads with a window branch: the first `window_heads` of them; None = every head. The
    # other heads' window gate is fixed at 0, so everything they read comes through compression
    # and selection (the n_init / n_local blocks still give them the start and the recent past).
    # A small model otherwise learns to retrieve inside the window only and never trains the far
    # route (eval/BENCHMARKS.md, issue 5). Their window attention is still computed (and counted
    # in flops_per_token): simpler than a per-head kernel call, and cheap next to the rest.
    window_heads: int | None = None
    # Kernel backend of all three branches (models/config.py IMPLEMENTATIONS without "cudnn").
    implementation: str | None = runtime_field(None)
    interpret: bool = runtime_field(False)  # Pallas kernels in interpret mode (CPU tests, debugging)

    def __post_init__(self):
        for name in ("cmp_block_len", "cmp_stride", "sel_block_size", "n_selected", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"NSAConfig.{name}={v!r}: must be a positive int")
        for name in ("n_init", "n_local"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"NSAConfig.{name}={v!r}: must be a non-negative int")
        if self.cmp_stride > self.cmp_block_len:
            raise ValueError(f"NSAConfig.cmp_stride={self.cmp_stride}: must be <= cmp_block_len="
                             f"{self.cmp_block_len} (blocks overlap or touch, never leave gaps)")
        if self.n_init + self.n_local > self.n_selected:
            raise ValueError(f"NSAConfig.n_selected={self.n_selected}: must be >= n_init + n_local "
                             f"= {self.n_init + self.n_local} (the always-selected blocks)")
        if self.remap not in ("overlap", "eq9"):
            raise ValueError(f"NSAConfig.remap={self.remap!r}: valid choices: 'overlap', 'eq9'")
        if self.remap == "eq9" and (self.cmp_block_len % self.cmp_stride
                                    or self.sel_block_size % self.cmp_stride):
            raise ValueError(f"NSAConfig.remap='eq9' needs cmp_stride={self.cmp_stride} to divide "
                             f"cmp_block_len={self.cmp_block_len} and sel_block_size="
                             f"{self.sel_block_size}; use remap='overlap' or change the sizes")
        wh = self.window_heads
        if wh is not None and (not isinstance(wh, int) or isinstance(wh, bool) or wh < 0):
            raise ValueError(f"NSAConfig.window_heads={wh!r}: must be an int >= 0 (the first "
                             "window_heads query heads keep the window branch) or None (all)")
        h = self.cmp_mlp_hidden
        if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h <= 0):
            raise ValueError(f"NSAConfig.cmp_mlp_hidden={h!r}: must be a positive int or None "
                             "(= head_dim)")
        if isinstance(self.gate_bias, list):
            object.__setattr__(self, "gate_bias", tuple(self.gate_bias))
        gb = self.gate_bias
        if (not isinstance(gb, tuple) or len(gb) != 3 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                for x in gb)):
            raise ValueError(f"NSAConfig.gate_bias={gb!r}: must be 3 finite numbers (compressed, "
                             "selected, window gate biases)")
        check_implementation("NSAConfig", self.implementation)

    def check_model(self, cfg: ModelConfig) -> None:
        """Checks against the model's sizes (called by ModelConfig's validation)."""
        if self.window_heads is not None and self.window_heads > cfg.n_heads:
            raise ValueError(f"ModelConfig.nsa: NSAConfig.window_heads={self.window_heads} exceeds "
                             f"n_heads={cfg.n_heads}; use at most n_heads (None = every head)")


BRANCHES = ("cmp", "slc", "win")  # order of the gate's last axis and of NSAConfig.gate_bias


def branch_records(aux: dict) -> list[dict[str, jax.Array]]:
    """Diagnostics: per NSA layer, in layer order, its selected blocks ("idx" [B,T,K,n]) and gates
    ("gates" [B,T,H,3], order BRANCHES), from the aux of a model called with
    capture_intermediates=True (eval/nsa_probe.py reads them)."""
    found: dict[int, dict[str, jax.Array]] = {}
    for key, value in aux["intermediates"].items():
        layer, name = key.split("/", 1)  # "layer_<i>/mixer/<name>"
        if name in ("mixer/selected_blocks", "mixer/gates"):
            entry = found.setdefault(int(layer.removeprefix("layer_")), {})
            entry["idx" if name.endswith("selected_blocks") else "gates"] = value
    return [found[i] for i in sorted(found)]


def require_nsa(mixers: Sequence[str], what: str) -> None:
    """ValueError naming ``what`` unless model.mixers has an NSA layer; the diagnostics call it on
    the run's config before loading a checkpoint."""
    if "nsa" not in mixers:
        raise ValueError(f"{what} needs a model with NSA layers; this one has model.mixers="
                         f"{tuple(mixers)}")


def check_branches(branches: Sequence[str]) -> None:
    """ValueError unless ``branches`` names one or more of BRANCHES."""
    unknown = sorted(set(branches) - set(BRANCHES))
    if unknown or not branches:
        raise ValueError(f"branches {list(branches)}: name one or more of {', '.join(BRANCHES)}")


def with_branches_off(params: Any, branches: Sequence[str]) -> Any:
    """Diagnostics: a copy of a model's parameters (any pytree) whose NSA layers have the named
    branches' gates fixed at exactly 0: those entries of every b_gate become -inf, so the
    sigmoid is 0 whatever the input. Evaluating the result measures what the branches carry
    (eval/longctx.py --branches-off). ValueError for an unknown branch or a tree without NSA."""
    check_branches(branches)
    off = np.asarray([b in branches for b in BRANCHES])
    found = []

    def edit(path, x):
        if any(getattr(k, "key", getattr(k, "name", None)) == "b_gate" for k in path):
            found.append(path)
            return jnp.where(off, -jnp.inf, x).astype(x.dtype)
        return x

    out = jax.tree_util.tree_map_with_path(edit, params)
    if not found:
        raise ValueError("no NSA layer (no b_gate parameter) in these parameters; --branches-off "
                         "applies to models with 'nsa' mixers")
    return out


@register_mixer("nsa")
class NSAttention(NSACacheMixin, nnx.Module):
    """NSA token mixer: compressed, selected and sliding-window attention, gated per head.

    Parameters: wq [D,H,Dh]; wk, wv [D,3,K,Dh] (cmp, slc, win; [D,1,K,Dh] with separate_kv=False);
    wo [H,Dh,D]; gates w_gate [D,H,3] ~ N(0, init_std) and b_gate [H,3] = NSAConfig.gate_bias, so
    at initialisation every gate is close to sigmoid(bias) (default: window 0.73, compressed and
    selected 0.27; heads from NSAConfig.window_heads on have their window gate fixed at 0);
    compression MLPs (index 0 keys, 1 values) cmp_pe [2,L,Dh], cmp_w1 [2,L,Dh,F],
    cmp_b1 [2,F], cmp_w2 [2,F,Dh], cmp_b2 [2,Dh] (F = NSAConfig.cmp_mlp_hidden or Dh).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        c = cfg.nsa
        d, h, k, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        std, pdt = cfg.init_std, cfg.param_dtype
        n_kv = 3 if c.separate_kv else 1
        width, blk = c.cmp_mlp_hidden or dh, c.cmp_block_len
        branch_kv = ("embed", "nsa_branch", "kv_heads", "head_dim")
        # name: (shape, logical axes, init std). Drawn from one normal sample (one random program
        # to compile instead of eight; CPU compile time of each threefry draw is ~1 s).
        specs = {
            "wq": ((d, h, dh), ("embed", "heads", "head_dim"), std),
            # K/V projections per branch (cmp, slc, win), or one shared branch.
            "wk": ((d, n_kv, k, dh), branch_kv, std),
            "wv": ((d, n_kv, k, dh), branch_kv, std),
            "wo": ((h, dh, d), ("heads", "head_dim", "embed"), out_proj_std(cfg)),
            # Gates g = sigmoid(x W + b) per head and branch; b starts at NSAConfig.gate_bias.
            "w_gate": ((d, h, 3), ("embed", "heads", "nsa_branch"), std),
            # Compression MLPs, index 0 for keys and 1 for values: pe is the intra-block position
            # encoding; w1 is the [L*Dh -> F] layer, w2 the [F -> Dh] layer.
            "cmp_pe": ((2, blk, dh), ("nsa_kv", "nsa_block", "head_dim"), std),
            "cmp_w1": ((2, blk, dh, width), ("nsa_kv", "nsa_block", "head_dim", "nsa_mlp"),
                       (blk * dh) ** -0.5),
            "cmp_w2": ((2, width, dh), ("nsa_kv", "nsa_mlp", "head_dim"), width ** -0.5),
        }
        sizes = [math.prod(shape) for shape, _, _ in specs.values()]
        flat = jax.random.normal(rngs.params(), (sum(sizes),), jnp.float32)
        offsets = np.cumsum([0] + sizes)
        for (name, (shape, axes, sd)), lo, hi in zip(specs.items(), offsets[:-1], offsets[1:]):
            value = (flat[lo:hi].reshape(shape) * sd).astype(pdt)
            setattr(self, name, nnx.Param(value, logical_axes=axes))
        bias = np.broadcast_to(np.asarray(c.gate_bias, np.float32), (h, 3))
        # biases: never weight-decayed (steps.weight_decay_mask)
        self.b_gate = nnx.Param(jnp.asarray(bias, pdt), logical_axes=("heads", "nsa_branch"),
                                weight_decay=False)
        self.cmp_b1 = nnx.Param(jnp.zeros((2, width), pdt), logical_axes=("nsa_kv", "nsa_mlp"),
                                weight_decay=False)
        self.cmp_b2 = nnx.Param(jnp.zeros((2, dh), pdt), logical_axes=("nsa_kv", "head_dim"),
                                weight_decay=False)

    @classmethod
    def from_dense(cls, cfg: ModelConfig, dense: dict[str, Any]) -> dict[str, tuple[Any, str, str]]:
        """What a dense attention layer's parameters give this layer, for architecture surgery
        (aiinfra_jax/surgery.py): {our name: (array, dense name, how)}. wq and wo as they are;
        the dense wk / wv for each K/V branch (cmp, slc, win), so that every branch starts from
        the dense layer's keys and values. The gates and compression MLPs keep their init."""
        n_kv = 3 if cfg.nsa.separate_kv else 1
        out = {name: (dense[name], name, "copied") for name in ("wq", "wo") if name in dense}
        for name in ("wk", "wv"):
            if name in dense:
                a = dense[name]  # [D,K,Dh]
                out[name] = (np.broadcast_to(a[:, None], (a.shape[0], n_kv) + a.shape[1:]), name,
                             f"repeated for the {n_kv} K/V branch(es)")
        return out

    # Pieces -----------------------------------------------------------------------------------
    def _project(self, x_btd: jax.Array, positions_bt: jax.Array):
        """q [B,T,H,Dh] (rotated), gates [B,T,H,3] float32, and per cache entry its new values
        {name: [B,T,K,Dh]} (slc / win keys rotated, compression inputs not)."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        x = x_btd.astype(dt)
        q = apply_rope(project(x, self.wq[...].astype(dt)), positions_bt,
                       cfg.rope_theta)
        # Branch axis after the tokens: the product is then [B*T, D] x [D, n*K*Dh] on the weights
        # as stored. With it first ("->nbthk") XLA:CPU copied (transposed) wk and wv in every
        # call: 8 weight copies, ~1 ms of a ~8 ms nsa_tiny decode step at batch 8.
        k_btnkd = project(x, self.wk[...].astype(dt))
        v_btnkd = project(x, self.wv[...].astype(dt))
        k_nbtkd = [k_btnkd[:, :, i] for i in range(k_btnkd.shape[2])]
        v_nbtkd = [v_btnkd[:, :, i] for i in range(v_btnkd.shape[2])]
        logits = project(x, self.w_gate[...].astype(dt), preferred_element_type=jnp.float32)
        gates = jax.nn.sigmoid(logits + self.b_gate[...].astype(jnp.float32))
        wh = cfg.nsa.window_heads
        if wh is not None and wh < cfg.n_heads:  # heads >= wh have no window branch
            gates = gates.at[..., 2].multiply((np.arange(cfg.n_heads) < wh).astype(np.float32))
        rot = lambda a: apply_rope(a, positions_bt, cfg.rope_theta)  # noqa: E731
        if cfg.nsa.separate_kv:
            new = {"k_src": k_nbtkd[0], "v_src": v_nbtkd[0], "k_slc": rot(k_nbtkd[1]),
                   "v_slc": v_nbtkd[1], "k_win": rot(k_nbtkd[2]), "v_win": v_nbtkd[2]}
        else:
            new = {"k_src": k_nbtkd[0], "v_src": v_nbtkd[0], "k": rot(k_nbtkd[0]),
                   "v": v_nbtkd[0]}
        return q, gates, new

    def compress(self, k_src: jax.Array, v_src: jax.Array, starts_bj: jax.Array,
                 end_positions_bj: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Compressed keys / values [B,J,K,Dh] of the blocks of raw rows [start, start + L) of
        k_src / v_src [B,S,K,Dh] (un-rotated); keys rotated at end_positions [B,J]. Rows past S
        are clamped (the caller hides such blocks)."""
        dt = jnp.dtype(self.cfg.dtype)
        blk = self.cfg.nsa.cmp_block_len
        b, j = starts_bj.shape
        rows = jnp.clip(starts_bj[:, :, None] + jnp.arange(blk, dtype=jnp.int32), 0,
                        k_src.shape[1] - 1).reshape(b, j * blk, 1, 1)
        win = jnp.stack([jnp.take_along_axis(src.astype(dt), rows, axis=1)
                         .reshape(b, j, blk, *src.shape[2:]) for src in (k_src, v_src)])
        # [2,B,J,L,K,Dh]: the key and value MLPs as one product batched over their stacked
        # parameters. Indexed one at a time (cmp_w1[kv]), XLA:CPU copied each slice of the
        # weights on every call, inside a decode step too (8 copies, ~0.4 ms of an nsa_tiny step).
        pe, w1, b1, w2, b2 = (getattr(self, n)[...].astype(dt)
                              for n in ("cmp_pe", "cmp_w1", "cmp_b1", "cmp_w2", "cmp_b2"))
        win = win + pe[:, None, None, :, None, :]
        # The product contracts (l, d), which are not adjacent in win; XLA then copies one side
        # into matmul order, and it picked the weights (2 x [L*Dh, F] per layer) even in a decode
        # step, where win holds one block. Laying out win [.., K, L, Dh] first makes the copy the
        # activations'; done only when they are the smaller side (not in training).
        if win[0].size <= w1[0].size:
            n2, kv = win.shape[0], win.shape[4]
            flat = jnp.moveaxis(win, 4, 3).reshape(n2, b * j * kv, blk * win.shape[-1])
            hid = jnp.einsum("nrc,ncf->nrf", flat, w1.reshape(n2, -1, w1.shape[-1]))
            hid = hid.reshape(n2, b, j, kv, -1)
        else:
            hid = jnp.einsum("nbjlkd,nldf->nbjkf", win, w1)
        hid = jax.nn.silu(hid + b1[:, None, None, None])
        y = jnp.einsum("nbjkf,nfd->nbjkd", hid, w2)
        out = jnp.mean(win, axis=3) + y + b2[:, None, None, None]
        return apply_rope(out[0], end_positions_bj, self.cfg.rope_theta), out[1]

    def _branches(self, q, gates, kv: dict[str, tuple[jax.Array, jax.Array]], *, seq_len: int,
                  q_offset=None, segment_ids=None, cmp_segment_ids=None, win_offset=None,
                  win_segment_ids=None):
        """Gated sum [B,T,H,Dh] of the three branches. kv: branch -> (k, v) in the compute dtype,
        [B,S,K,Dh], or head-major [B,K,S,Dh] for a decode step (q_offset given, T = 1), where the
        compressed keys come transposed, [B,K,Dh,C]; seq_len: raw key length of the slc keys;
        win_offset: q_offset for the window keys; win_segment_ids: the window call's segment ids
        when they differ from segment_ids (a prefill chunk over the window ring)."""
        c = self.cfg.nsa
        kernel = dict(implementation=c.implementation, interpret=c.interpret)
        decode = q_offset is not None and q.shape[1] == 1  # one query per row, no segments
        k_cmp, v_cmp = kv["cmp"]
        cmp_mask = AttentionMask(compressed=(c.cmp_block_len, c.cmp_stride))
        sel = dict(seq_len=seq_len, cmp_block_len=c.cmp_block_len, cmp_stride=c.cmp_stride,
                   block_size=c.sel_block_size, n_selected=c.n_selected, n_init=c.n_init,
                   n_local=c.n_local, remap=c.remap, q_offset=q_offset)
        if decode:  # the blocks ranked by the compressed branch's own probabilities
            o_cmp, p_cmp = attend_one(q, k_cmp, v_cmp, cmp_mask, q_offset,
                                      return_group_probs=True, keys_transposed=True)
            idx = select_blocks_from_probs(p_cmp, **sel)
        else:
            cmp_seg = None if segment_ids is None else (segment_ids, cmp_segment_ids)
            o_cmp, lse_cmp = flash_attention(q, k_cmp, v_cmp, mask=cmp_mask, segment_ids=cmp_seg,
                                             q_offset=q_offset, return_lse=True, **kernel)
            idx = select_blocks(q, k_cmp, lse_cmp, q_segment_ids=segment_ids, **sel, **kernel)
        # Diagnostics (eval/nsa_probe.py): returned by model(..., capture_intermediates=True).
        record(self, "selected_blocks", idx)
        record(self, "gates", gates)
        k_slc, v_slc = kv["slc"]
        if decode:
            o_slc = self._decode_selected(q, k_slc, v_slc, idx, q_offset)
        else:
            o_slc = sparse_attention(q, k_slc.astype(q.dtype), v_slc.astype(q.dtype), idx,
                                     block_size=c.sel_block_size, segment_ids=segment_ids,
                                     q_offset=q_offset, **kernel)
        k_win, v_win = kv["win"]
        win_mask = AttentionMask(window=c.window)
        if decode:
            o_win = attend_one(q, k_win, v_win, win_mask, win_offset,
                               keys_transposed=c.separate_kv)
        else:
            win_seg = segment_ids if win_segment_ids is None else win_segment_ids
            o_win = flash_attention(q, k_win, v_win, mask=win_mask, segment_ids=win_seg,
                                    q_offset=win_offset, **kernel)
        g = gates.astype(q.dtype)
        return g[..., 0, None] * o_cmp + g[..., 1, None] * o_slc + g[..., 2, None] * o_win

    # Forward ----------------------------------------------------------------------------------
    def __call__(self, x_btd: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None,
                 cache: NSACache | None = None) -> tuple[jax.Array, NSACache | None]:
        dt = jnp.dtype(self.cfg.dtype)
        q, gates, new = self._project(x_btd, positions)
        if cache is None:
            y = self._forward(q, gates, new, positions, segment_ids)
            new_cache = None
        else:
            y, new_cache = self._cached(q, gates, new, positions, segment_ids, cache)
        out = project(y.astype(dt), self.wo[...].astype(dt), contract=2)
        return out, new_cache

    def _forward(self, q, gates, new, positions, segment_ids):
        """Training / full-sequence path (no cache); packed documents via segment_ids."""
        c = self.cfg.nsa
        names = cache_keys(c.separate_kv)
        batch, seq = q.shape[:2]
        n_cmp = n_compressed(seq, c.cmp_block_len, c.cmp_stride)
        starts = jnp.broadcast_to(jnp.arange(n_cmp, dtype=jnp.int32) * c.cmp_stride,
                                  (batch, n_cmp))
        ends = starts + c.cmp_block_len - 1
        end_pos = jnp.take_along_axis(positions, jnp.minimum(ends, seq - 1), axis=1)
        k_cmp, v_cmp = self.compress(new["k_src"], new["v_src"], starts, end_pos)
        cmp_seg = None
        if segment_ids is not None:
            seg = segment_ids.astype(jnp.int32)
            rows = jnp.minimum(starts[:, :, None] + jnp.arange(c.cmp_block_len), seq - 1)
            seg_win = jnp.take_along_axis(seg, rows.reshape(batch, -1), axis=1).reshape(rows.shape)
            one_doc = (seg_win.min(-1) == seg_win.max(-1)) & (ends < seq)
            cmp_seg = jnp.where(one_doc, seg_win[..., 0], -1)
            segment_ids = seg
        kv = {"cmp": (k_cmp, v_cmp), "slc": tuple(new[n] for n in names["slc"]),
              "win": tuple(new[n] for n in names["win"])}
        return self._branches(q, gates, kv, seq_len=seq, segment_ids=segment_ids,
                              cmp_segment_ids=cmp_seg)

    # Cost -------------------------------------------------------------------------------------
    def attended_keys(self, seq_len: int) -> dict[str, float]:
        """Average keys per query of each branch over a causal sequence of seq_len tokens
        (compressed tokens, selected raw keys, window keys)."""
        c = self.cfg.nsa
        p = np.arange(seq_len, dtype=np.float64)
        cmp = np.maximum(np.floor((p - c.cmp_block_len + 1) / c.cmp_stride) + 1, 0)
        lp = c.sel_block_size
        slc = np.minimum(p + 1, (c.n_selected - 1) * lp + p % lp + 1)
        win = np.minimum(p + 1, c.window)
        return {"cmp": float(cmp.mean()), "slc": float(slc.mean()), "win": float(win.mean())}

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token: projections (q, per-branch k/v, o, gates), the compression MLPs
        (one block per d tokens, K and V), the compressed-key scores of the compressed branch and
        again of the block scoring, and 4*H*Dh per key attended in each branch."""
        cfg, c = self.cfg, self.cfg.nsa
        d, h, k, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        n_kv = 3 if c.separate_kv else 1
        width = c.cmp_mlp_hidden or dh
        proj = 2.0 * d * dh * (2 * h + 2 * n_kv * k) + 2.0 * d * h * 3
        mlp = 2 * k * 2.0 * (c.cmp_block_len * dh * width + width * dh) / c.cmp_stride
        keys = self.attended_keys(seq_len)
        attn = 4.0 * h * dh * (keys["cmp"] + keys["slc"] + keys["win"])
        scoring = 2.0 * h * dh * keys["cmp"]
        return proj + mlp + attn + scoring
