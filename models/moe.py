"""Standard mixture-of-experts FFN ("moe" entry of model.ffns): dropless top-k routing over SwiGLU
experts run as grouped matmuls, optional shared experts, router losses and an aux-loss-free bias.

Shape letters: B batch, T tokens, N = B*T tokens flattened, D d_model, E routed experts, K top_k,
M = N*K (token, slot) assignments, F expert_d_ff, G expert groups (n_groups).

Routing (per token, router in float32 whatever the compute dtype):
  logits = x W_router [N,E] (+ Gaussian noise in training when router_noise > 0; the router input
  may be jittered by U(1 - router_jitter, 1 + router_jitter), Switch style)
  scores = softmax(logits) ("softmax") or sigmoid(logits) ("sigmoid", DeepSeek-V3)
  choice = scores + bias (bias: the aux-loss-free balancing bias of the sigmoid router, zero for
           softmax); it only *chooses* experts, the weights are read from `scores`
  group limit (n_groups G > 1): a group's score is the sum of its two best `choice` values (its one
           best when a group holds one expert); only experts of the topk_groups best groups stay
  top-K of the remaining `choice` -> expert ids [N,K]; weights = scores at those ids, divided by
  their sum when normalize_topk, times routed_scaling. Padding tokens (segment id 0) get weight 0.

Dropless dispatch: the M assignments are sorted by expert (padding tokens' assignments after all
real ones), gathered into x_sorted [M,D] and run through three grouped matmuls (gate and up [E,D,F],
down [E,F,D]) whose groups are the per-expert counts of *real* assignments, so no capacity factor,
no token is dropped, and no [N,E,F] buffer is built by this code. Padding assignments lie past the
last group: the grouped matmul never computes them (its output there is zero), they add nothing to
the expert counts, the load metrics, the bias update or the aux losses, and no other token's
output depends on them. The outputs are unsorted with the inverse permutation and combined with
the routing weights; shared experts (one fused SwiGLU of width num_shared_experts * shared_d_ff)
see every token.

Grouped matmul (`grouped_matmul`, a runtime field). "ragged_dot" = `jax.lax.ragged_dot`: it lowers
to XLA's own `chlo.ragged_dot` on GPU and TPU (checked by lowering for "cuda" and "tpu" from the
CPU host), which XLA runs as a grouped GEMM, and it is differentiable with no custom VJP of ours.
tokamax (the Pallas ragged dot the issue names as an alternative; 0.0.12 on PyPI, checked
2026-12-02) is not a dependency: its ragged-dot kernels target Mosaic GPU (sm90 / sm100) and TPU,
none of which this project has had to measure on, and it pulls in qwix, pydantic, tensorboardX and
a pinned typeguard; on a CPU it would run XLA's ragged dot anyway. It belongs behind
kernels/grouped_matmul (the roadmap's next kernel op) once a speed-up over `ragged_dot` is
measured on an accelerator. On CPU, XLA expands `ragged_dot` into a
masked batched dot over all E experts ([E,M,D] x [E,D,F]): E/K times the active FLOPs and an
[E,M,F] temporary, the very blow-up dropless routing exists to avoid. "blocked" is the CPU path
without it: every expert's rows are padded to a multiple of a block of b rows and a
`jax.lax.map` over the blocks multiplies each block by its one expert's matrix (FLOPs
(M + E * b) * D * F; no buffer larger than the padded rows), b = `gmm_block` or, when the call
has fewer rows per expert (decode), the power of two >= M/E (at least 8). None (the default) picks per
platform the function is lowered for, with `jax.lax.platform_dependent` as kernels/_dispatch.py
does: "blocked" on CPU, "ragged_dot" elsewhere. Measured on this 2-core CPU (forward + backward,
16 x 256 tokens, D 256, E 8, K 2, F 352, machine shared and loaded): "ragged_dot" costs what a
dense SwiGLU as wide as all eight experts does (~680-800 ms), "blocked" about what the dense
SwiGLU of equal active FLOPs does (~225-290 ms vs 175-300 ms).

Auxiliary outputs (models/auxiliary.py), per layer:
  losses  "balance_loss" = load_balance_weight * E * sum_i f_i P_i (Switch / GShard): f_i the
          fraction of real assignments sent to expert i (no gradient), P_i the mean router
          probability of expert i over real tokens (softmax probabilities; for the sigmoid router
          its scores normalised per token, as DeepSeek-V3's balance loss); 1 when balanced.
          "z_loss" = z_loss_weight * mean over real tokens of logsumexp(logits)^2 (ST-MoE).
          A loss whose weight is 0 is not reported as a loss (nothing added to the objective).
  metrics "balance" and "router_z" (the same two quantities unweighted, always logged),
          "load_max" (max over experts of the load / the mean load: 1 = balanced, E = collapsed),
          "dropped" (fraction of real assignments the grouped matmuls did not process: computed
          from the group sizes they ran with, 0 when dropless), "router_entropy" (mean over real
          tokens of the entropy, in nats, of the routing distribution above).
  record  "expert_ids" [B,T,K] int32 (returned only with capture_intermediates=True; routing
          traces for the weight-loading measurements).

Aux-loss-free balancing bias (sigmoid router, DeepSeek-V3): a non-parameter variable `bias` [E]
(class RoutingBias), never differentiated. In training -- a call with rngs, which the FFN interface
gives only in training (models/registry.py) -- it moves after routing by
bias_i += bias_update_rate * sign(mean_i load - load_i) from this call's real-token counts. The
Transformer returns non-parameter state that a block updated in place through its layer scan and
remat, and the training step carries it as state["model_state"] (kept unchanged by a non-finite
step) and checkpoints it; evaluation and generation (no rngs) read it and never move it. With
optim.grad_accum = A it moves once per micro-batch (A times per optimizer step).

Parallelism: expert weights carry the logical axis "expert" (aiinfra_jax/sharding.py maps it to
the mesh's "expert" axis), "embed" and "mlp". Without an "expert" mesh axis > 1 the dispatch above
sorts the assignments of the whole call, and under a data-parallel mesh XLA partitions that sort
and gather by itself (correct, not communication-optimal).

Expert parallelism (`expert_parallel`), when the mesh in context (`jax.sharding.
get_abstract_mesh()`, set by the trainer's `with_activation_rules`) has an "expert" axis of size
P > 1, which must divide E: the router, the losses, the metrics and the bias stay outside, on the
whole call (XLA partitions them); the routed experts run inside a `jax.shard_map` over every
non-manual mesh axis. Tokens are split over all of them (data, fsdp, expert, context, tensor: the
FFN is position-wise, so no device repeats another's work; the token count is padded with
unrouted padding tokens to a multiple of their product when it is not one), each device holds
E/P whole experts (its weights gathered over fsdp and tensor by the shard_map's input sharding).
On a device with n local tokens, each destination q along "expert" gets a buffer of
C = n * min(K, E/P) rows: a token's K experts are distinct, so at most min(K, E/P) of its
assignments live on one device, and no assignment can ever overflow its buffer (dropless by
construction, no capacity factor). The assignments, sorted by expert, are scattered into the
[P*C, D] send buffer (with their local expert ids in a [P*C] int buffer; empty rows labelled "no
expert"), one `all_to_all` over "expert" exchanges both, the receiver sorts its P*C rows by local
expert and runs the same three grouped matmuls (empty rows lie past the groups: their outputs
are zero; "blocked" still multiplies their blocks, so its cost follows the buffer, not the real
rows), a second `all_to_all` returns the outputs to the senders, who gather and combine them with
the routing weights. "dropped" is then measured from the group sizes the devices' grouped
matmuls ran with (summed over the token axes), not assumed.
The plumbing (padding the tokens, the shard_map specs, the buffers and the two all_to_alls) is
`expert_parallel_map`, `send_to_owners` and `return_to_senders`, which models/deamoe.py's
department parallelism uses too.
Cost: two all-to-alls of P*C*D activations per layer forward (and two backward), a buffer up to
P*min(K, E/P)/K times the assignments (the price of a fixed, static, never-dropping size; a ragged
all-to-all with exchanged counts would send only the real rows and is the next step where
`jax.lax.ragged_all_to_all` runs).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from .auxiliary import record, report_loss, report_metric
from .config import ModelConfig, runtime_field
from .layers import SwiGLU, make_param, out_proj_std
from .partitioning import mesh_axis_sizes, shard_map_over
from .registry import register_config, register_ffn

ROUTERS = ("softmax", "sigmoid")
GROUPED_MATMULS = (None, "ragged_dot", "blocked")


@register_config("moe")
@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts settings, used by layers whose FFN is "moe" (see the module docstring).

    expert_d_ff None = ModelConfig.resolved_d_ff // top_k (about the dense SwiGLU's active FLOPs
    without shared experts); shared_d_ff None = the expert width.
    """

    num_experts: int = 8
    top_k: int = 2
    expert_d_ff: int | None = None
    num_shared_experts: int = 0
    shared_d_ff: int | None = None
    router: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3 scores with a balancing bias)
    n_groups: int = 1  # expert groups for group-limited routing (1 = no limit)
    topk_groups: int = 1  # a token's experts come from its topk_groups best groups
    routed_scaling: float = 1.0  # routed experts' weights are multiplied by it
    normalize_topk: bool = True  # divide the top-K weights by their sum
    # How the model trains and runs, not what it computes: may change on resume (--set).
    bias_update_rate: float = runtime_field(1e-3)  # sigmoid router's bias step per training call
    load_balance_weight: float = runtime_field(1e-2)
    z_loss_weight: float = runtime_field(1e-3)
    router_jitter: float = runtime_field(0.0)  # training only: router input * U(1-j, 1+j)
    router_noise: float = runtime_field(0.0)  # training only: std of noise added to router logits
    # None (best for the lowering platform: "blocked" on CPU, "ragged_dot" elsewhere) |
    # "ragged_dot" | "blocked"
    grouped_matmul: str | None = runtime_field(None)
    gmm_block: int = runtime_field(128)  # rows per block of the "blocked" grouped matmul

    def __post_init__(self):
        for name in ("num_experts", "top_k", "n_groups", "topk_groups", "gmm_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"MoEConfig.{name}={v!r}: must be a positive int")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"MoEConfig.num_shared_experts={self.num_shared_experts!r}: must be "
                             "an int >= 0")
        for name in ("expert_d_ff", "shared_d_ff"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"MoEConfig.{name}={v!r}: must be a positive int or None")
        if self.router not in ROUTERS:
            raise ValueError(f"MoEConfig.router={self.router!r}: valid choices: {ROUTERS}")
        if self.grouped_matmul not in GROUPED_MATMULS:
            raise ValueError(f"MoEConfig.grouped_matmul={self.grouped_matmul!r}: valid choices: "
                             f"{GROUPED_MATMULS}")
        if self.num_experts % self.n_groups:
            raise ValueError(f"MoEConfig.n_groups={self.n_groups}: must divide num_experts="
                             f"{self.num_experts}")
        if self.topk_groups > self.n_groups:
            raise ValueError(f"MoEConfig.topk_groups={self.topk_groups}: must be <= n_groups="
                             f"{self.n_groups}")
        reachable = self.topk_groups * (self.num_experts // self.n_groups)
        if self.top_k > reachable:
            raise ValueError(f"MoEConfig.top_k={self.top_k}: exceeds the {reachable} experts of "
                             f"the topk_groups={self.topk_groups} best groups (num_experts="
                             f"{self.num_experts}, n_groups={self.n_groups}); lower top_k or raise "
                             "topk_groups")
        for name in ("routed_scaling", "bias_update_rate", "load_balance_weight", "z_loss_weight",
                     "router_jitter", "router_noise"):
            v = getattr(self, name)
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                    or v < 0):
                raise ValueError(f"MoEConfig.{name}={v!r}: must be a finite number >= 0")
        if self.routed_scaling == 0:
            raise ValueError("MoEConfig.routed_scaling=0: must be > 0 (it scales the experts' "
                             "output)")
        if self.router_jitter >= 1:
            raise ValueError(f"MoEConfig.router_jitter={self.router_jitter}: must be < 1")

    def check_model(self, cfg: ModelConfig) -> None:
        """Called by ModelConfig's validation for every model; checks only models with a "moe"
        FFN: the derived expert width must be >= 1."""
        if "moe" in cfg.ffns and self.resolved_expert_d_ff(cfg) < 1:
            raise ValueError(f"ModelConfig.moe: expert_d_ff = d_ff // top_k = "
                             f"{cfg.resolved_d_ff} // {self.top_k} is 0; set model.moe.expert_d_ff")

    def resolved_expert_d_ff(self, cfg: ModelConfig) -> int:
        return self.expert_d_ff if self.expert_d_ff is not None else cfg.resolved_d_ff // self.top_k

    def resolved_shared_d_ff(self, cfg: ModelConfig) -> int:
        """Width of the fused shared-expert SwiGLU (0 without shared experts)."""
        one = self.shared_d_ff if self.shared_d_ff is not None else self.resolved_expert_d_ff(cfg)
        return self.num_shared_experts * one


class RoutingBias(nnx.Variable):
    """The sigmoid router's aux-loss-free balancing bias [E]: non-parameter state, moved outside
    the gradient (see the module docstring)."""


# ----------------------------------------------------------------------------- routing


def route(scores_ne: jax.Array, bias_e: jax.Array | None, top_k: int, n_groups: int = 1,
          topk_groups: int = 1) -> jax.Array:
    """Expert ids [N,K] int32: the top-K of scores + bias (bias only chooses), restricted to the
    experts of each token's topk_groups best groups when n_groups > 1 (a group's score: the sum of
    its two best biased scores, or its best one when a group holds one expert)."""
    choice = scores_ne if bias_e is None else scores_ne + bias_e
    n, e = choice.shape
    if n_groups > 1:
        per_group = choice.reshape(n, n_groups, e // n_groups)
        best = jax.lax.top_k(per_group, min(2, e // n_groups))[0]
        _, top_groups = jax.lax.top_k(best.sum(-1), topk_groups)  # [N, topk_groups]
        keep_ng = jnp.zeros((n, n_groups), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
        keep_ne = jnp.repeat(keep_ng, e // n_groups, axis=1)
        choice = jnp.where(keep_ne, choice, -jnp.inf)
    return jax.lax.top_k(choice, top_k)[1].astype(jnp.int32)


def routing_distribution(logits_ne: jax.Array, router: str) -> jax.Array:
    """Per-token distribution over experts [N,E] used by the balance loss and the entropy:
    softmax probabilities, or the sigmoid scores normalised to sum 1."""
    if router == "softmax":
        return jax.nn.softmax(logits_ne, axis=-1)
    s = jax.nn.sigmoid(logits_ne)
    return s / jnp.maximum(s.sum(-1, keepdims=True), 1e-20)


def route_tokens(x_nd: jax.Array, w_router_de: jax.Array, bias_e: jax.Array | None,
                 real_n: jax.Array, *, router: str, top_k: int, n_groups: int, topk_groups: int,
                 normalize_topk: bool, routed_scaling: float, jitter: float = 0.0,
                 noise: float = 0.0, rngs: nnx.Rngs | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router (float32) of the module docstring: (logits [N,E], expert ids [N,K] int32,
    weights [N,K] float32, 0 for padding tokens). Jitter and noise are drawn from rngs.router()
    (training only: rngs given)."""
    xr = x_nd.astype(jnp.float32)
    if rngs is not None and jitter > 0:
        xr = xr * jax.random.uniform(rngs.router(), xr.shape, jnp.float32, 1.0 - jitter,
                                     1.0 + jitter)
    logits = xr @ w_router_de.astype(jnp.float32)  # [N,E]
    if rngs is not None and noise > 0:
        logits = logits + noise * jax.random.normal(rngs.router(), logits.shape)
    scores = jax.nn.softmax(logits, axis=-1) if router == "softmax" else jax.nn.sigmoid(logits)
    bias = None if bias_e is None else jax.lax.stop_gradient(bias_e)
    ids_nk = route(jax.lax.stop_gradient(scores), bias, top_k, n_groups, topk_groups)
    weights_nk = jnp.take_along_axis(scores, ids_nk, axis=1)
    if normalize_topk:
        weights_nk = weights_nk / jnp.maximum(weights_nk.sum(-1, keepdims=True), 1e-20)
    weights_nk = weights_nk * routed_scaling * real_n.astype(jnp.float32)[:, None]
    return logits, ids_nk, weights_nk


def report_routing(module: nnx.Module, logits_ne: jax.Array, counts_e: jax.Array,
                   real_n: jax.Array, *, router: str, top_k: int, load_balance_weight: float,
                   z_loss_weight: float, processed_e: jax.Array | None = None) -> None:
    """The aux losses and metrics of the module docstring, over the real tokens (real_n [N]
    float32). counts_e [E]: real assignments routed to each expert; processed_e [E]: those the
    grouped matmuls ran (default counts_e), from which "dropped" is measured."""
    e = logits_ne.shape[-1]
    n_real = jnp.maximum(real_n.sum(), 1.0)
    assigned = n_real * top_k
    f_e = counts_e.astype(jnp.float32) / assigned  # no gradient (integer counts)
    probs = routing_distribution(logits_ne, router)
    p_e = jnp.einsum("ne,n->e", probs, real_n) / n_real
    balance = e * jnp.sum(f_e * p_e)
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_ne, axis=-1)) * real_n) / n_real
    if load_balance_weight > 0:
        report_loss(module, "balance_loss", load_balance_weight * balance)
    if z_loss_weight > 0:
        report_loss(module, "z_loss", z_loss_weight * z)
    sg = jax.lax.stop_gradient
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-20)), axis=-1)
    report_metric(module, "balance", sg(balance))
    report_metric(module, "router_z", sg(z))
    report_metric(module, "load_max", jnp.max(f_e) * e)
    wanted = jnp.sum(real_n) * top_k  # real assignments routed
    processed = counts_e if processed_e is None else processed_e
    report_metric(module, "dropped", (wanted - processed.sum()) / jnp.maximum(wanted, 1.0))
    report_metric(module, "router_entropy", sg(jnp.sum(entropy * real_n) / n_real))


def move_bias(bias: RoutingBias, counts_e: jax.Array, rate: float) -> None:
    """The aux-loss-free update, in place: bias_i += rate * sign(mean load - load_i)."""
    load = counts_e.astype(jnp.float32)
    bias[...] = bias[...] + rate * jnp.sign(load.mean() - load)


def sort_by_group(group_m: jax.Array, n_groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(order [M], counts [n_groups] int32, inverse [M]) for rows labelled group_m in
    [0, n_groups]: order sorts them by group (stable), label n_groups (rows in no group) last;
    counts leaves those out; x[order][inverse] == x."""
    order = jnp.argsort(group_m, stable=True)
    counts = jnp.zeros((n_groups + 1,), jnp.int32).at[group_m].add(1)[:n_groups]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(group_m.shape[0], dtype=order.dtype))
    return order, counts, inverse


# ----------------------------------------------------------------------------- grouped matmul


def grouped_matmul(x_md: jax.Array, w_edf: jax.Array, group_sizes_e: jax.Array,
                   implementation: str | None = None, block: int = 128) -> jax.Array:
    """y [M,F] with rows of group e (consecutive, sizes group_sizes [E]) multiplied by w[e]; rows
    past sum(group_sizes) are zero. Accumulates in float32, returns x's dtype."""
    if implementation is None:  # per the platform the call is lowered for (kernels/_dispatch.py)
        branch = lambda impl: lambda *a: grouped_matmul(*a, implementation=impl,  # noqa: E731
                                                        block=block)
        return jax.lax.platform_dependent(x_md, w_edf, group_sizes_e, cpu=branch("blocked"),
                                          default=branch("ragged_dot"))
    if implementation == "ragged_dot":
        return jax.lax.ragged_dot(x_md, w_edf, group_sizes_e,
                                  preferred_element_type=jnp.float32).astype(x_md.dtype)
    if implementation != "blocked":
        raise ValueError(f"grouped_matmul: implementation={implementation!r}: valid choices: "
                         f"{GROUPED_MATMULS}")
    m, d = x_md.shape
    e = w_edf.shape[0]
    # No block larger than the rows could fill on average (a power of two >= m/E, at least 8): at
    # decode (m = batch * K rows) a 128-row block would multiply E blocks of mostly zero rows.
    block = min(block, max(8, 1 << (-(-m // e) - 1).bit_length()))
    n_blocks = -(-m // block) + e  # sum_e ceil(size_e / block) never exceeds it
    sizes = group_sizes_e.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    padded = -(-sizes // block) * block
    padded_ends = jnp.cumsum(padded)
    rows = jnp.arange(m, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), e - 1)
    dest = padded_ends[group] - padded[group] + rows - (ends[group] - sizes[group])
    dest = jnp.where(rows < ends[-1], dest, n_blocks * block)  # past the last group: dropped
    x_pad = jnp.zeros((n_blocks * block, d), x_md.dtype).at[dest].set(x_md, mode="drop")
    block_group = jnp.searchsorted(padded_ends, jnp.arange(n_blocks) * block, side="right")
    block_group = jnp.minimum(block_group, e - 1)  # blocks past the end: zero rows, any expert

    def one_block(args):
        xb, g = args
        return jnp.dot(xb, w_edf[g], preferred_element_type=jnp.float32).astype(x_md.dtype)

    y_pad = jax.lax.map(one_block, (x_pad.reshape(n_blocks, block, d), block_group))
    y_pad = y_pad.reshape(n_blocks * block, -1)
    return jnp.take(y_pad, dest, axis=0, mode="fill", fill_value=0)


def swiglu_experts(x_md: jax.Array, w_gate_edf: jax.Array, w_up_edf: jax.Array,
                   w_down_efd: jax.Array, group_sizes_e: jax.Array,
                   implementation: str | None = None, block: int = 128) -> jax.Array:
    """y [M,D]: rows of group e through expert e's SwiGLU (three grouped matmuls); rows past
    sum(group_sizes) are zero."""
    gmm = lambda a, w: grouped_matmul(a, w, group_sizes_e, implementation, block)  # noqa: E731
    h_mf = jax.nn.silu(gmm(x_md, w_gate_edf)) * gmm(x_md, w_up_edf)
    return gmm(h_mf, w_down_efd)


# ----------------------------------------------------------------------------- expert parallelism

EXPERT_AXIS = "expert"
# The mesh axes the tokens of an expert-parallel call are split over, in mesh order: every axis
# (the FFN is position-wise), so no device repeats another's work.
TOKEN_AXES = ("data", "fsdp", "expert", "context", "tensor")


def expert_parallel_mesh(num_experts: int, field: str = "model.moe.num_experts"):
    """The context mesh (abstract) when its "expert" axis is > 1 and not manual, else None. Raises
    ValueError when that axis does not divide num_experts (the config `field` holding it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False) or not mesh.axis_names:
        return None
    size = mesh_axis_sizes(mesh).get(EXPERT_AXIS, 1)
    if size <= 1:
        return None
    if num_experts % size:
        raise ValueError(f"{field}={num_experts}: expert parallelism needs a multiple of the "
                         f"mesh's {EXPERT_AXIS!r} axis ({size}); change {field} or mesh.expert")
    return mesh


def expert_parallel_map(body, mesh, tokens: list[tuple[jax.Array, object]],
                        weights: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(y [N,D], processed [E]): `body(*token_shards, *weight_shards) -> (y [n_loc,D], counts
    [E/P])` inside a shard_map over every non-manual axis of `mesh` (module docstring, "Expert
    parallelism"). `tokens`: per-token arrays [N,...] with the value that pads them (the token
    count is padded to a multiple of the token axes' product with tokens routed nowhere, cut off
    again after); they split over every axis, `weights` ([E or G, ...]) over "expert" only. The
    counts (the rows each device's grouped matmuls ran) are summed over the token axes that hold
    the same experts and concatenated over "expert"."""
    sizes = mesh_axis_sizes(mesh)
    axes = tuple(a for a in TOKEN_AXES if sizes.get(a, 1) > 1)
    others = tuple(a for a in axes if a != EXPERT_AXIS)  # token axes that hold the same experts
    split = math.prod(sizes[a] for a in axes)
    n = tokens[0][0].shape[0]
    pad = -n % split
    args = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=v) if pad else a
            for a, v in tokens]

    def wrapped(*a):
        y, counts = body(*a)
        return y, (jax.lax.psum(counts, others) if others else counts)

    specs = tuple(P(axes, *([None] * (a.ndim - 1))) for a in args) + tuple(
        P(EXPERT_AXIS, *([None] * (w.ndim - 1))) for w in weights)
    y, processed = shard_map_over(wrapped, mesh, specs, (P(axes, None), P(EXPERT_AXIS)))(*args,
                                                                                       *weights)
    return y[:n], processed


def send_to_owners(dest_s: jax.Array, cap: int, payloads: list[tuple[jax.Array, object]]
                   ) -> tuple[jax.Array, list[jax.Array]]:
    """Inside expert_parallel_map's body: rows sorted by destination device along "expert"
    (dest_s [S]; P = no destination, never sent) go out by one all_to_all per payload ([S,...]
    rows, with the value that fills empty buffer rows). Each destination has a buffer of `cap`
    rows per source; the caller guarantees no source sends more (dropless). Returns (slot_s [S]:
    each row's place in the buffers, for return_to_senders; the received payloads [P*cap,...]:
    source q's rows at q*cap, empty rows filled)."""
    p_ex = jax.lax.axis_size(EXPERT_AXIS)
    sent = jnp.zeros((p_ex + 1,), jnp.int32).at[dest_s].add(1)[:p_ex]
    first = jnp.cumsum(sent) - sent
    rank = jnp.arange(dest_s.shape[0], dtype=jnp.int32) - first[jnp.minimum(dest_s, p_ex - 1)]
    slot_s = jnp.where(dest_s < p_ex, dest_s * cap + rank, p_ex * cap)  # nowhere: dropped
    received = [_all_to_all(jnp.full((p_ex * cap,) + rows.shape[1:], fill, rows.dtype)
                            .at[slot_s].set(rows, mode="drop")) for rows, fill in payloads]
    return slot_s, received


def return_to_senders(y_received: jax.Array, slot_s: jax.Array) -> jax.Array:
    """The inverse trip of send_to_owners: the outputs of the received rows [P*cap,...] go back,
    and each sent row gets its own (rows never sent: zero) -> [S,...]."""
    return jnp.take(_all_to_all(y_received), slot_s, axis=0, mode="fill", fill_value=0)


def _all_to_all(v: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(v, EXPERT_AXIS, 0, 0, tiled=True)


def expert_parallel(x_nd: jax.Array, expert_nk: jax.Array, weights_nk: jax.Array,
                    w_gate_edf: jax.Array, w_up_edf: jax.Array, w_down_efd: jax.Array, *, mesh,
                    implementation: str | None = None, block: int = 128
                    ) -> tuple[jax.Array, jax.Array]:
    """The routed experts with experts split over the mesh's "expert" axis (module docstring,
    "Expert parallelism"): (y [N,D] = sum_k weights[n,k] * expert_{expert[n,k]}(x[n]),
    processed [E] int32, the assignments each expert's grouped matmuls ran).

    expert_nk [N,K] int32: a token's K distinct experts, E (no expert) for padding tokens' slots.
    """
    k = expert_nk.shape[1]
    e = w_gate_edf.shape[0]

    def body(x, ids, w, wg, wu, wd):
        n_loc = x.shape[0]
        e_loc = wg.shape[0]
        # A token's K experts are distinct, so at most min(K, e_loc) of them live on one device:
        # a buffer of n_loc * min(K, e_loc) rows per (source, destination) cannot overflow.
        expert_m = ids.reshape(-1)
        order, _, inverse = sort_by_group(expert_m, e)  # by expert, hence by destination
        slot_s, (x_recv, e_recv) = send_to_owners(
            expert_m[order] // e_loc, n_loc * min(k, e_loc),
            [(jnp.take(x, order // k, axis=0), 0), (expert_m[order] % e_loc, e_loc)])
        order2, counts, inverse2 = sort_by_group(e_recv, e_loc)  # empty slots past the groups
        y_sorted = swiglu_experts(jnp.take(x_recv, order2, axis=0), wg, wu, wd, counts,
                                  implementation, block)
        y_s = return_to_senders(jnp.take(y_sorted, inverse2, axis=0), slot_s)
        y_nkd = jnp.take(y_s, inverse, axis=0).reshape(n_loc, k, -1)
        y = jnp.einsum("nkd,nk->nd", y_nkd, w.astype(x.dtype),
                       preferred_element_type=jnp.float32).astype(x.dtype)
        return y, counts

    return expert_parallel_map(body, mesh, [(x_nd, 0), (expert_nk, e), (weights_nk, 0)],
                               [w_gate_edf, w_up_edf, w_down_efd])


# ----------------------------------------------------------------------------- the FFN


@register_ffn("moe")
class MoE(nnx.Module):
    """Dropless top-K mixture of SwiGLU experts (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        c = cfg.moe
        d, e, f = cfg.d_model, c.num_experts, c.resolved_expert_d_ff(cfg)
        pd = cfg.param_dtype
        self.w_router = make_param(rngs, (d, e), ("embed", None), cfg.init_std, "float32")
        self.w_gate = make_param(rngs, (e, d, f), ("expert", "embed", "mlp"), cfg.init_std, pd)
        self.w_up = make_param(rngs, (e, d, f), ("expert", "embed", "mlp"), cfg.init_std, pd)
        self.w_down = make_param(rngs, (e, f, d), ("expert", "mlp", "embed"), out_proj_std(cfg),
                                 pd)
        fs = c.resolved_shared_d_ff(cfg)
        self.shared = SwiGLU(dataclasses.replace(cfg, d_ff=fs), rngs=rngs) if fs else None
        self.bias = (RoutingBias(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
                     if c.router == "sigmoid" else None)

    def __call__(self, x_btd: jax.Array, *, segment_ids: jax.Array | None = None,
                 rngs: nnx.Rngs | None = None) -> jax.Array:
        c = self.cfg.moe
        dt = jnp.dtype(self.cfg.dtype)
        b, t, d = x_btd.shape
        e, k = c.num_experts, c.top_k
        n = b * t
        x_nd = x_btd.reshape(n, d).astype(dt)
        real_n = (jnp.ones((n,), bool) if segment_ids is None
                  else segment_ids.reshape(n) != 0)
        real_f = real_n.astype(jnp.float32)
        logits, ids_nk, weights_nk = route_tokens(
            x_nd, self.w_router[...], None if self.bias is None else self.bias[...], real_n,
            router=c.router, top_k=k, n_groups=c.n_groups, topk_groups=c.topk_groups,
            normalize_topk=c.normalize_topk, routed_scaling=c.routed_scaling,
            jitter=c.router_jitter, noise=c.router_noise, rngs=rngs)
        # Real assignments' experts; padding tokens' assignments get the label e (no expert).
        expert_m = jnp.where(jnp.repeat(real_n, k), ids_nk.reshape(-1), e)
        counts = jnp.zeros((e + 1,), jnp.int32).at[expert_m].add(1)[:e]  # real assignments
        weights = [w[...].astype(dt) for w in (self.w_gate, self.w_up, self.w_down)]
        mesh = expert_parallel_mesh(e)
        if mesh is None:
            y_nd, processed = self._dispatch(x_nd, expert_m, weights_nk, weights, counts), None
        else:
            y_nd, processed = expert_parallel(
                x_nd, expert_m.reshape(n, k), weights_nk, *weights, mesh=mesh,
                implementation=c.grouped_matmul, block=c.gmm_block)
        if self.shared is not None:
            y_nd = y_nd + self.shared(x_nd[None])[0]

        report_routing(self, logits, counts, real_f, router=c.router, top_k=k,
                       load_balance_weight=c.load_balance_weight, z_loss_weight=c.z_loss_weight,
                       processed_e=processed)
        record(self, "expert_ids", ids_nk.reshape(b, t, k))
        if self.bias is not None and rngs is not None and c.bias_update_rate > 0:
            move_bias(self.bias, counts, c.bias_update_rate)
        return y_nd.reshape(b, t, d)

    def _dispatch(self, x_nd, expert_m, weights_nk, weights, counts) -> jax.Array:
        """Single-program dropless dispatch (module docstring): y [N,D]."""
        c = self.cfg.moe
        n, d = x_nd.shape
        order_m, _, inverse_m = sort_by_group(expert_m, c.num_experts)
        x_md = jnp.take(x_nd, order_m // c.top_k, axis=0)
        y_md = swiglu_experts(x_md, *weights, counts, c.grouped_matmul, c.gmm_block)
        y_nkd = jnp.take(y_md, inverse_m, axis=0).reshape(n, c.top_k, d)
        return jnp.einsum("nkd,nk->nd", y_nkd, weights_nk.astype(x_nd.dtype),
                          preferred_element_type=jnp.float32).astype(x_nd.dtype)

    def flops_per_token(self) -> float:
        """Active forward FLOPs: router, the top_k routed SwiGLU experts and the shared experts."""
        c, d = self.cfg.moe, self.cfg.d_model
        routed = c.top_k * 2.0 * 3 * d * c.resolved_expert_d_ff(self.cfg)
        shared = 2.0 * 3 * d * c.resolved_shared_d_ff(self.cfg)
        return 2.0 * d * c.num_experts + routed + shared
