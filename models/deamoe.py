"""DeaMoE FFN ("deamoe" entry of model.ffns): mixture-of-experts grouped into departments that
share most of their weights, each expert keeping a small private part (arXiv 2608.14385, whose
equations are not public: every choice below is inferred from the issue's description, and the
uncertain ones are config).

Shape letters: B batch, T tokens, N = B*T tokens flattened, D d_model, E experts, G departments
(E/G experts each), K top_k, L = min(K, department_limit) (department slots per token),
R = N*L (token, department) pairs, M = N*K (token, expert) assignments, F department_d_ff.

Weights: department g has a SwiGLU's three projections, gate and up [G,D,F] and down [G,F,D];
expert e (of department g(e) = e // (E/G)) has one private square matrix P_e [E,p,p] on the first
p = private_dim channels of the department's F (p = F by default: a full square),
initialised to the identity (so at initialisation every expert of a department is that
department's SwiGLU). The router is one [D,E] matrix over all experts. Write [P_e] for the F x F
block matrix diag(P_e, I_{F-p}): the private square on the sub-space, the other F - p channels
shared as they are.

Expert e's output on a token x (private_placement):
  "hidden" (default): z_e = (silu(x Wg_g) * (x Wu_g)) [P_e]; the SiLU (of the GLU) sits between
           the shared gate/up and the private matrix, as the issue says ("a SiLU between shared and
           private parts"). Then y_e = z_e Wd_g.
  "gate":  z_e = silu((x Wg_g) [P_e]) * (x Wu_g): the private matrix turns the gate's
           pre-activation, the SiLU after it. Then y_e = z_e Wd_g.
Both reduce to the department's SwiGLU when P_e = I.

Why a sub-space (private_dim < F): a decode step loads the shared weights of each distinct
department once and the private matrix of each distinct expert. With a full F x F square
(F = 352, D = 256) one private matrix is 46% of a department's 3*D*F shared weights, so a step that
touches a few more experts than a plain MoE loses more bytes than sharing saves (measured: 1.4-1.9x
MoE's bytes; eval/BENCHMARKS.md). "Each expert keeping a small private part" needs p*p << 3*D*F:
p = 64 at F = 176 is 3% of the shared part. The FFN's output is
y = sum_k w_k y_{e_k} = sum_g (sum_{k: g(e_k)=g} w_k z_{e_k}) Wd_g: by linearity the shared down
projection runs once per (token, department), on the weighted sum of that department's private
outputs, never once per expert.

Routing (models/moe.py's router, reused): logits = x W_router [N,E] in float32, scores softmax or
sigmoid (+ the aux-loss-free bias to choose, sigmoid only), then two levels: departments are
ranked by the sum of their two best biased scores (their one best with one expert per department:
DeepSeek-V3's group score, reused as is) and only the experts of a token's department_limit best
departments stay; the top-K of those are its experts. The limit is "soft": it caps the departments
a token may use (distinct departments per token <= department_limit, never more) without forcing
it to use that many (a token whose K best experts share a department uses one), and it needs no
extra loss. department_limit None = no limit (G). Weights: the chosen scores, divided by their sum
when normalize_topk, times routed_scaling; padding tokens (segment id 0) get weight 0, no compute.

Three-stage grouped matmul (no [N,E] or [N,E,F] buffer; the router's [N,E] logits aside):
  1. per department: a token's distinct departments (at most L) fill its L pair slots (empty slots
     and padding tokens are labelled "no department"); the R pairs, sorted by department, run
     through gate and up ([G,D,F], grouped by the per-department pair counts) -> [R,F] per pair
     ("hidden": the GLU h; "gate": the gate's and up's pre-activations).
  2. per expert: the M assignments, sorted by expert, gather their pair's first p channels and
     run them through P_e ([E,p,p], grouped by the per-expert counts) (+ the SiLU and the up
     product for "gate"), are scaled by their routing weight and scatter-added into their pair's
     row -> [R,p]; the other F - p channels are the same for every expert of the department, so
     they are the pair's row times the sum of its assignments' weights -> [R,F].
  3. per department again: the R pair rows, in stage 1's order, run through down ([G,F,D]) ->
     [R,D], summed over each token's L slots -> y [N,D].
The grouped matmul is models/moe.py's (`grouped_matmul`: "ragged_dot" off CPU, "blocked" on CPU).
Active FLOPs per token: router 2*D*E, at most L * (4*D*F + 2*F*D) shared, K * 2*p*p private.

Inferred choices (say which one a run used; all but the first three are config):
  * each department's shared part is a full SwiGLU (gate, up, down), the private part only the
    square matrix; no per-expert biases, no shared (always-on) experts;
  * the private matrices are identity-initialised exactly (no noise added);
  * the department score is DeepSeek-V3's sum of the two best biased expert scores;
  * private_placement "hidden" (after the GLU) by default, "gate" the alternative;
  * private_dim: the private square's side p, on the first p channels of F (the channel order is
    arbitrary at initialisation, so "first" loses nothing); None = F;
  * department_limit 2 by default (top_k 4 of 16 experts in 4 departments);
  * department_d_ff None = ModelConfig.resolved_d_ff // department_limit, so the shared part's
    FLOPs at the limit equal the dense SwiGLU's (the private matrices come on top).

Auxiliary outputs (models/auxiliary.py), per layer: models/moe.py's losses ("balance_loss",
"z_loss") and metrics ("balance", "router_z", "load_max", "dropped", "router_entropy") over
experts ("dropped": real assignments whose (token, department) pair did not get a slot, measured
from the slots; 0 by construction), plus the metric "departments" (mean over real tokens of the
distinct departments a token uses, <= department_limit) and the record "expert_ids" [B,T,K]
(routing traces). The
sigmoid router's balancing bias moves as in models/moe.py (training calls only).

Parallelism: department weights carry the logical axis "expert" on their department dimension
and the private matrices on their expert dimension. Without an "expert" mesh axis > 1, XLA
partitions the dispatch (split over "expert" where it divides them, replicated otherwise).
Expert parallelism, when the mesh in context has an "expert" axis of size P > 1 (it must divide
G; models/moe.py's `expert_parallel_mesh`): the unit is the department, since its experts share
its weights. Each device holds G/P whole departments and their E/P experts' private matrices
(experts of department g are g*E/G ... (g+1)*E/G - 1, so both splits line up). The router, the
losses, the metrics and the bias stay outside, on the whole call; inside a `jax.shard_map` over
every non-manual axis (models/moe.py's `expert_parallel_map`, tokens split over all axes), every
(token, department) pair travels by one all_to_all over "expert" to its department's device with
its token row, its department's local id and its K assignments that belong to that department
(local expert ids and routing weights; the others marked "no expert", weight 0). The owner runs
the three stages on the pairs it received, a second all_to_all returns each pair's [D] output,
and the sender sums its L slots. Buffers: a token's departments are distinct, so at most
min(L, G/P) of its pairs go to one device; n * min(L, G/P) rows per (source, destination) cannot
overflow (dropless by construction). "dropped" is measured from the private matmuls' group sizes
on the devices. Traffic per layer forward: 2 x P * n * min(L, G/P) rows of D (+ 2K small
numbers) per device, i.e. per pair, not per assignment: a pair carries up to K/L assignments for
the price of one row, which is where departments save communication over a plain MoE's
per-assignment rows.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from .auxiliary import record, report_metric
from .config import ModelConfig, runtime_field
from .layers import make_param, out_proj_std
from .moe import (GROUPED_MATMULS, ROUTERS, RoutingBias, expert_parallel_map,
                  expert_parallel_mesh, grouped_matmul, move_bias, report_routing,
                  return_to_senders, route_tokens, send_to_owners, sort_by_group)
from .registry import register_config, register_ffn

PLACEMENTS = ("hidden", "gate")


@register_config("deamoe")
@dataclasses.dataclass(frozen=True)
class DeaMoEConfig:
    """DeaMoE settings, used by layers whose FFN is "deamoe" (see the module docstring)."""

    num_experts: int = 16
    num_departments: int = 4  # must divide num_experts
    top_k: int = 4
    department_limit: int | None = 2  # distinct departments per token at most; None = no limit
    department_d_ff: int | None = None  # None = ModelConfig.resolved_d_ff // department_limit
    private_placement: str = "hidden"  # "hidden" (after the GLU) | "gate" (before the SiLU)
    private_dim: int | None = None  # p: the private square's side, on F's first p channels; None = F
    router: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3 scores with a balancing bias)
    routed_scaling: float = 1.0
    normalize_topk: bool = True
    # How the model trains and runs, not what it computes: may change on resume (--set).
    bias_update_rate: float = runtime_field(1e-3)
    load_balance_weight: float = runtime_field(1e-2)
    z_loss_weight: float = runtime_field(1e-3)
    router_jitter: float = runtime_field(0.0)
    router_noise: float = runtime_field(0.0)
    grouped_matmul: str | None = runtime_field(None)  # as MoEConfig.grouped_matmul
    gmm_block: int = runtime_field(128)

    def __post_init__(self):
        for name in ("num_experts", "num_departments", "top_k", "gmm_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"DeaMoEConfig.{name}={v!r}: must be a positive int")
        for name in ("department_limit", "department_d_ff", "private_dim"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"DeaMoEConfig.{name}={v!r}: must be a positive int or None")
        if self.num_experts % self.num_departments:
            raise ValueError(f"DeaMoEConfig.num_departments={self.num_departments}: must divide "
                             f"num_experts={self.num_experts}")
        if self.department_limit is not None and self.department_limit > self.num_departments:
            raise ValueError(f"DeaMoEConfig.department_limit={self.department_limit}: must be <= "
                             f"num_departments={self.num_departments} (or None: no limit)")
        reachable = self.limit * (self.num_experts // self.num_departments)
        if self.top_k > reachable:
            raise ValueError(f"DeaMoEConfig.top_k={self.top_k}: exceeds the {reachable} experts of "
                             f"a token's department_limit={self.limit} departments; lower top_k "
                             "or raise department_limit")
        if self.private_placement not in PLACEMENTS:
            raise ValueError(f"DeaMoEConfig.private_placement={self.private_placement!r}: valid "
                             f"choices: {PLACEMENTS}")
        if self.router not in ROUTERS:
            raise ValueError(f"DeaMoEConfig.router={self.router!r}: valid choices: {ROUTERS}")
        if self.grouped_matmul not in GROUPED_MATMULS:
            raise ValueError(f"DeaMoEConfig.grouped_matmul={self.grouped_matmul!r}: valid "
                             f"choices: {GROUPED_MATMULS}")
        for name in ("routed_scaling", "bias_update_rate", "load_balance_weight", "z_loss_weight",
                     "router_jitter", "router_noise"):
            v = getattr(self, name)
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                    or v < 0):
                raise ValueError(f"DeaMoEConfig.{name}={v!r}: must be a finite number >= 0")
        if self.routed_scaling == 0:
            raise ValueError("DeaMoEConfig.routed_scaling=0: must be > 0")
        if self.router_jitter >= 1:
            raise ValueError(f"DeaMoEConfig.router_jitter={self.router_jitter}: must be < 1")

    @property
    def limit(self) -> int:
        """The department limit as a number (num_departments when None)."""
        return self.num_departments if self.department_limit is None else self.department_limit

    @property
    def slots(self) -> int:
        """L: a token's department slots, min(top_k, limit)."""
        return min(self.top_k, self.limit)

    def check_model(self, cfg: ModelConfig) -> None:
        """Called by ModelConfig's validation: models with a "deamoe" FFN need a width >= 1 and a
        private square no wider than it."""
        if "deamoe" not in cfg.ffns:
            return
        f = self.resolved_d_ff(cfg)
        if f < 1:
            raise ValueError(f"ModelConfig.deamoe: department_d_ff = d_ff // department_limit = "
                             f"{cfg.resolved_d_ff} // {self.limit} is 0; set "
                             "model.deamoe.department_d_ff")
        if self.private_dim is not None and self.private_dim > f:
            raise ValueError(f"ModelConfig.deamoe.private_dim={self.private_dim}: exceeds the "
                             f"department width {f}; lower private_dim (or None: the full width)")

    def resolved_d_ff(self, cfg: ModelConfig) -> int:
        return (self.department_d_ff if self.department_d_ff is not None
                else cfg.resolved_d_ff // self.limit)

    def resolved_private_dim(self, cfg: ModelConfig) -> int:
        return self.private_dim if self.private_dim is not None else self.resolved_d_ff(cfg)


def department_slots(dept_nk: jax.Array, slots: int, n_departments: int
                     ) -> tuple[jax.Array, jax.Array]:
    """A token's distinct departments in its L slots: (pair_nl [N,L] department per slot,
    n_departments where empty; slot_nk [N,K] the slot of each assignment's department).
    Requires at most L distinct departments per token (the routing's limit guarantees it)."""
    n, k = dept_nk.shape
    srt = jnp.sort(dept_nk, axis=1)
    first = jnp.concatenate([jnp.ones((n, 1), bool), srt[:, 1:] != srt[:, :-1]], axis=1)
    slot_sorted = jnp.where(first, jnp.cumsum(first, axis=1) - 1, slots)  # repeats: nowhere
    pair_nl = jnp.full((n, slots), n_departments, jnp.int32).at[
        jnp.arange(n)[:, None], slot_sorted].set(srt.astype(jnp.int32), mode="drop")
    slot_nk = jnp.argmax(pair_nl[:, None, :] == dept_nk[:, :, None], axis=-1).astype(jnp.int32)
    return pair_nl, slot_nk


def department_experts(x_nd: jax.Array, row_r: jax.Array, dept_r: jax.Array,
                       expert_m: jax.Array, pair_m: jax.Array, weight_m: jax.Array,
                       counts_e: jax.Array, weights: tuple[jax.Array, ...], *, placement: str,
                       implementation: str | None, block: int) -> jax.Array:
    """y_r [R,D]: the three-stage grouped matmul (module docstring) for R (token, department)
    pairs. Pair r reads token row row_r[r] of x_nd and belongs to department dept_r[r] (G: none);
    assignment m runs expert expert_m[m] (E: none) for pair pair_m[m] with weight weight_m[m]
    (counts_e [E]: the real assignments per expert). weights = (gate [G,D,F], up [G,D,F],
    private [E,p,p], down [G,F,D]) in the compute dtype."""
    w_gate, w_up, w_private, w_down = weights
    dt = x_nd.dtype
    g, e, p = w_gate.shape[0], w_private.shape[0], w_private.shape[-1]
    r = dept_r.shape[0]
    gmm = lambda a, w, sizes: grouped_matmul(a, w, sizes, implementation, block)  # noqa: E731
    # 1. per department: gate and up, once per (token, department).
    order1, counts1, inverse1 = sort_by_group(dept_r, g)
    x_r = jnp.take(x_nd, jnp.take(row_r, order1), axis=0)
    gate = jnp.take(gmm(x_r, w_gate, counts1), inverse1, axis=0)  # [R,F], pair order
    up = jnp.take(gmm(x_r, w_up, counts1), inverse1, axis=0)
    # 2. per expert: the private matrix on the first p channels, weighted, summed into the
    # assignment's pair; the other channels are shared, weighted by the pair's weight sum.
    order2, _, _ = sort_by_group(expert_m, e)
    src = jnp.take(pair_m, order2)
    if placement == "hidden":
        h = jax.nn.silu(gate) * up
        z = gmm(jnp.take(h[:, :p], src, axis=0), w_private, counts_e)
        rest = h[:, p:]
    else:
        z = (jax.nn.silu(gmm(jnp.take(gate[:, :p], src, axis=0), w_private, counts_e))
             * jnp.take(up[:, :p], src, axis=0))
        rest = jax.nn.silu(gate[:, p:]) * up[:, p:]
    z = z.astype(jnp.float32) * jnp.take(weight_m, order2)[:, None]  # rows past: zero
    w_r = jnp.zeros((r,), jnp.float32).at[pair_m].add(weight_m)  # no assignment: weight 0
    s_r = jnp.concatenate([jnp.zeros((r, p), jnp.float32).at[src].add(z),
                           rest.astype(jnp.float32) * w_r[:, None]], axis=1).astype(dt)
    # 3. per department again: the shared down projection, once per (token, department).
    y_r = gmm(jnp.take(s_r, order1, axis=0), w_down, counts1)
    return jnp.take(y_r, inverse1, axis=0)


@register_ffn("deamoe")
class DeaMoE(nnx.Module):
    """Departments of experts sharing a SwiGLU, each expert a private square matrix (see the
    module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        c = cfg.deamoe
        d, e, g, f = cfg.d_model, c.num_experts, c.num_departments, c.resolved_d_ff(cfg)
        pd = cfg.param_dtype
        self.w_router = make_param(rngs, (d, e), ("embed", None), cfg.init_std, "float32")
        self.w_gate = make_param(rngs, (g, d, f), ("expert", "embed", "mlp"), cfg.init_std, pd)
        self.w_up = make_param(rngs, (g, d, f), ("expert", "embed", "mlp"), cfg.init_std, pd)
        self.w_down = make_param(rngs, (g, f, d), ("expert", "mlp", "embed"), out_proj_std(cfg),
                                 pd)
        p = c.resolved_private_dim(cfg)
        self.w_private = nnx.Param(jnp.broadcast_to(jnp.eye(p, dtype=pd), (e, p, p)),
                                   logical_axes=("expert", None, None))
        self.bias = (RoutingBias(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
                     if c.router == "sigmoid" else None)

    def __call__(self, x_btd: jax.Array, *, segment_ids: jax.Array | None = None,
                 rngs: nnx.Rngs | None = None) -> jax.Array:
        c = self.cfg.deamoe
        dt = jnp.dtype(self.cfg.dtype)
        b, t, d = x_btd.shape
        e, g, k, slots = c.num_experts, c.num_departments, c.top_k, c.slots
        n = b * t
        x_nd = x_btd.reshape(n, d).astype(dt)
        real_n = (jnp.ones((n,), bool) if segment_ids is None
                  else segment_ids.reshape(n) != 0)
        real_f = real_n.astype(jnp.float32)
        logits, ids_nk, weights_nk = route_tokens(
            x_nd, self.w_router[...], None if self.bias is None else self.bias[...], real_n,
            router=c.router, top_k=k, n_groups=g, topk_groups=c.limit,
            normalize_topk=c.normalize_topk, routed_scaling=c.routed_scaling,
            jitter=c.router_jitter, noise=c.router_noise, rngs=rngs)
        dept_nk = ids_nk // (e // g)
        pair_nl, slot_nk = department_slots(dept_nk, slots, g)
        pair_nl = jnp.where(real_n[:, None], pair_nl, g)  # padding: no department
        expert_m = jnp.where(jnp.repeat(real_n, k), ids_nk.reshape(-1), e)
        counts = jnp.zeros((e + 1,), jnp.int32).at[expert_m].add(1)[:e]
        pair_m = (jnp.arange(n, dtype=jnp.int32)[:, None] * slots + slot_nk).reshape(-1)
        weights = tuple(w[...].astype(dt) for w in (self.w_gate, self.w_up, self.w_private,
                                                    self.w_down))
        mesh = expert_parallel_mesh(g, "model.deamoe.num_departments")
        if mesh is None:
            y_nd = department_experts(
                x_nd, jnp.arange(n * slots) // slots, pair_nl.reshape(-1), expert_m, pair_m,
                weights_nk.reshape(-1), counts, weights, placement=c.private_placement,
                implementation=c.grouped_matmul, block=c.gmm_block)
            y_nd = jnp.sum(y_nd.reshape(n, slots, d).astype(jnp.float32), axis=1).astype(dt)
            # Measured, not assumed: a real assignment whose pair slot holds another department
            # (only if a token had more than L departments, which the routing rules out) was not
            # processed.
            lost_m = jnp.take(pair_nl.reshape(-1), pair_m) != dept_nk.reshape(-1)
            processed = jnp.zeros((e + 1,), jnp.int32).at[
                jnp.where(lost_m, e, expert_m)].add(1)[:e]
        else:
            y_nd, processed = self._department_parallel(
                x_nd, pair_nl, expert_m.reshape(n, k), slot_nk, weights_nk, weights, mesh)

        report_routing(self, logits, counts, real_f, router=c.router, top_k=k,
                       load_balance_weight=c.load_balance_weight, z_loss_weight=c.z_loss_weight,
                       processed_e=processed)
        used = jnp.sum(pair_nl < g, axis=1).astype(jnp.float32)
        report_metric(self, "departments",
                      jnp.sum(used * real_f) / jnp.maximum(real_f.sum(), 1.0))
        record(self, "expert_ids", ids_nk.reshape(b, t, k))
        if self.bias is not None and rngs is not None and c.bias_update_rate > 0:
            move_bias(self.bias, counts, c.bias_update_rate)
        return y_nd.reshape(b, t, d)

    def _department_parallel(self, x_nd, pair_nl, ids_nk, slot_nk, weights_nk, weights, mesh
                             ) -> tuple[jax.Array, jax.Array]:
        """Expert parallelism (module docstring): departments (with their experts) split over the
        mesh's "expert" axis; each (token, department) pair travels to its department's device
        with its token row and its assignments in that department (local expert ids, weights),
        the owner runs the three stages on what it received, the pair's output comes back.
        Returns (y [N,D], processed [E])."""
        c = self.cfg.deamoe
        g, e, k, slots = c.num_departments, c.num_experts, c.top_k, c.slots
        per = e // g

        def body(x, pair, ids, slot, w, *ws):
            n_loc = x.shape[0]
            g_loc, e_loc = ws[0].shape[0], ws[2].shape[0]
            pair_r = pair.reshape(-1)
            order, _, inverse = sort_by_group(pair_r, g)  # by department, hence by device
            # A pair's assignments: the token's experts whose slot it is and whose department
            # it holds (always both; checked, so an assignment can only run where it belongs).
            mine = ((slot[:, None, :] == jnp.arange(slots)[None, :, None])
                    & (ids[:, None, :] // per == pair[:, :, None])
                    & (ids[:, None, :] < e))  # [n,L,K]; padding tokens' pairs go nowhere
            e_rk = jnp.where(mine, ids[:, None, :] % e_loc, e_loc).reshape(-1, k)
            w_rk = jnp.where(mine, w[:, None, :], 0.0).reshape(-1, k)
            # A token's departments are distinct: at most min(L, g_loc) of its pairs per device.
            slot_s, (x_recv, d_recv, e_recv, w_recv) = send_to_owners(
                pair_r[order] // g_loc, n_loc * min(slots, g_loc),
                [(jnp.take(x, order // slots, axis=0), 0), (pair_r[order] % g_loc, g_loc),
                 (jnp.take(e_rk, order, axis=0), e_loc), (jnp.take(w_rk, order, axis=0), 0)])
            rows = x_recv.shape[0]
            expert_m = e_recv.reshape(-1)
            counts = jnp.zeros((e_loc + 1,), jnp.int32).at[expert_m].add(1)[:e_loc]
            y_recv = department_experts(
                x_recv, jnp.arange(rows), d_recv, expert_m,
                jnp.repeat(jnp.arange(rows, dtype=jnp.int32), k), w_recv.reshape(-1), counts, ws,
                placement=c.private_placement, implementation=c.grouped_matmul,
                block=c.gmm_block)
            y_s = return_to_senders(y_recv, slot_s)
            y_r = jnp.take(y_s, inverse, axis=0).reshape(n_loc, slots, -1)
            return jnp.sum(y_r.astype(jnp.float32), axis=1).astype(x.dtype), counts

        return expert_parallel_map(
            body, mesh, [(x_nd, 0), (pair_nl, g), (ids_nk, e), (slot_nk, 0), (weights_nk, 0)],
            list(weights))

    def flops_per_token(self) -> float:
        """Active forward FLOPs: router, the shared SwiGLU of at most L departments, K private
        matrices."""
        c, d = self.cfg.deamoe, self.cfg.d_model
        f, p = c.resolved_d_ff(self.cfg), c.resolved_private_dim(self.cfg)
        return 2.0 * d * c.num_experts + c.slots * 2.0 * 3 * d * f + c.top_k * 2.0 * p * p
