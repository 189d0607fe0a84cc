"""Mixture-of-experts layers: the routers of DeepSeek-V3 / Kimi K2, DeepSeek-V2
and Qwen3-MoE, and the routed experts as a grouped matmul or a one-hot
dispatch.

A token's MLP is replaced by ``top_k`` of ``num_experts`` small MLPs (SwiGLU,
``moe_intermediate_size`` wide), chosen per token by a linear router, their
outputs summed with the router's weights, plus (DeepSeek) shared experts every
token runs. The routers differ in how they score and choose:

- ``scoring="sigmoid"`` (DeepSeek-V3, Kimi K2; DeepSeek-V3 report section
  2.1.2): scores ``sigmoid(logits)``; the choice adds the
  ``e_score_correction_bias`` (auxiliary-loss-free balancing) and is limited
  to ``topk_group`` of ``n_group`` expert groups, a group scored by the sum
  of its two best corrected scores; the weights are the *uncorrected* scores
  of the chosen experts, normalized to sum 1 (``norm_topk_prob``), times
  ``routed_scaling_factor``.
- ``scoring="softmax"``: scores ``softmax(logits)``; with ``n_group > 1`` the
  choice is limited to the ``topk_group`` groups of highest best score
  (DeepSeek-V2's ``group_limited_greedy``; V2-Lite's ``greedy`` is
  ``n_group=1``); the weights are the chosen scores, normalized when
  ``norm_topk_prob`` (Qwen3-MoE), times ``routed_scaling_factor``.

Router arithmetic runs in float32 whatever the activations' dtype, as the
reference implementations do. Ties between equal scores go to the lower
expert index (``jax.lax.top_k``'s order).

Experts: :func:`routed_experts_ragged` sorts the ``tokens x top_k``
assignments by expert and runs three ``jax.lax.ragged_dot`` grouped matmuls
(work proportional to the assignments); :func:`routed_experts_dense` runs
every expert on every token and combines with a one-hot weight matrix (work
``num_experts / top_k`` times more, in plain dense matmuls). Both give the
same outputs; :func:`routed_experts` picks one (the one-hot dispatch on CPU,
where ``experiments.kernels.moe_bench`` measured it faster at 9 of the 10
sizes it tried; grouped matmuls elsewhere). :func:`routed_experts_sharded` splits the
experts over a mesh axis (expert parallelism).

Weights are ``x @ W`` oriented: ``w_gate`` and ``w_up`` ``[E, D, I]``,
``w_down`` ``[E, I, D]`` (a Hugging Face ``gate_up_proj`` ``[E, 2I, D]`` is
split and transposed by the loader).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.checks import check_bool, check_choice, check_int
from paged_jax.paging.page_state import is_traced

SCORINGS = ("softmax", "sigmoid")
"""Router scoring functions (module docstring)."""


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How a mixture-of-experts layer chooses experts (module docstring).

    Attributes:
      num_experts: routed experts, E.
      top_k: experts per token (``num_experts_per_tok``).
      scoring: ``"softmax"`` or ``"sigmoid"``.
      n_group: expert groups (E divisible by it); 1: no group limit.
      topk_group: groups a token may choose from (1 <= ``topk_group`` <=
        ``n_group``; their experts must hold ``top_k``).
      norm_topk_prob: normalize the chosen weights to sum 1 (DeepSeek-V3
        adds 1e-20 to the sum, as its reference does).
      routed_scaling_factor: multiplies the weights after that.

    Raises:
      ValueError: a field out of range, named with its value.
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        check_int("num_experts", self.num_experts)
        check_int("top_k", self.top_k, 1, self.num_experts + 1)
        check_choice("scoring", self.scoring, SCORINGS)
        check_int("n_group", self.n_group, 1, self.num_experts + 1)
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by n_group={self.n_group}")
        check_int("topk_group", self.topk_group, 1, self.n_group + 1)
        if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(f"topk_group={self.topk_group} groups of {self.num_experts // self.n_group} experts "
                             f"hold fewer than top_k={self.top_k}")
        if self.scoring == "sigmoid" and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(f"sigmoid routing scores a group by its two best experts: n_group={self.n_group} "
                             f"leaves {self.num_experts // self.n_group} per group")
        check_bool("norm_topk_prob", self.norm_topk_prob)
        f = self.routed_scaling_factor
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not (math.isfinite(f) and f > 0):
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {f!r}")
        object.__setattr__(self, "routed_scaling_factor", float(f))


def _group_mask(choice: jax.Array, config: RouterConfig, group_score) -> jax.Array:
    """bool[T, E]: the experts of each token's ``topk_group`` best groups."""
    t, e = choice.shape
    groups = choice.reshape(t, config.n_group, e // config.n_group)
    _, best = jax.lax.top_k(group_score(groups), config.topk_group)  # [T, topk_group]
    keep = jnp.zeros((t, config.n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.repeat(keep, e // config.n_group, axis=1)


def route(logits: jax.Array, config: RouterConfig, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Chooses each token's experts and their weights (module docstring).

    Args:
      logits: f[T, E] the router's logits (``x @ router_weight.T``),
        computed in float32 by the caller or cast here.
      config: the router.
      bias: f32[E] DeepSeek-V3's ``e_score_correction_bias`` (sigmoid
        scoring only; None: zeros).

    Returns:
      ``(weights f32[T, top_k], experts i32[T, top_k])``, experts in
      descending order of their choice score. A token whose logits (or a
      bias entry) are NaN or inf gets NaN weights: never a silent choice.

    Raises:
      ValueError: ``logits`` not ``[T, num_experts]``, or a ``bias`` with
        softmax scoring or of another shape.
    """
    logits = jnp.asarray(logits)
    bias = None if bias is None else jnp.asarray(bias)
    if logits.ndim != 2 or logits.shape[1] != config.num_experts:
        raise ValueError(f"logits must be [tokens, num_experts={config.num_experts}], got shape {logits.shape}")
    logits = logits.astype(jnp.float32)
    if config.scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        if bias is not None and bias.shape != (config.num_experts,):
            raise ValueError(f"bias must be [num_experts={config.num_experts}], got shape {bias.shape}")
        choice = scores if bias is None else scores + bias.astype(jnp.float32)
        if config.n_group > 1:  # a group scores the sum of its two best corrected scores
            mask = _group_mask(choice, config, lambda g: jax.lax.top_k(g, 2)[0].sum(-1))
            choice = jnp.where(mask, choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, config.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=1)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    else:
        if bias is not None:
            raise ValueError("bias (e_score_correction_bias) is for scoring='sigmoid'; softmax routers have none")
        scores = jax.nn.softmax(logits, axis=-1)
        if config.n_group > 1:  # DeepSeek-V2's group_limited_greedy: a group scores its best expert
            scores = jnp.where(_group_mask(scores, config, lambda g: g.max(-1)), scores, 0.0)
        weights, experts = jax.lax.top_k(scores, config.top_k)
        if config.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
    bad = ~jnp.isfinite(logits).all(-1, keepdims=True)
    if bias is not None:
        bad |= ~jnp.isfinite(bias).all()
    weights = jnp.where(bad, jnp.nan, weights * config.routed_scaling_factor)
    return weights, experts.astype(jnp.int32)


def _check_experts(x, experts, weights, w_gate, w_up, w_down, *, ids_checked: bool = True) -> None:
    """Shapes and dtypes named; with ``ids_checked`` and concrete
    ``experts``, ids in ``[0, E)``."""
    if x.ndim != 2:
        raise ValueError(f"x must be [tokens, D], got shape {x.shape}")
    t, d = x.shape
    if w_gate.ndim != 3 or w_up.shape != w_gate.shape or w_down.shape != (w_gate.shape[0], w_gate.shape[2], d) \
            or w_gate.shape[1] != d:
        raise ValueError(f"expert weights must be w_gate, w_up [E, D={d}, I] and w_down [E, I, D]; got {w_gate.shape}, "
                         f"{w_up.shape}, {w_down.shape}")
    if experts.shape != weights.shape or experts.ndim != 2 or experts.shape[0] != t:
        raise ValueError(f"experts and weights must both be [tokens={t}, top_k]; got {experts.shape}, {weights.shape}")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"experts must hold integer expert ids, got dtype {experts.dtype}")
    e = w_gate.shape[0]
    if ids_checked and not is_traced(experts):
        ids = np.asarray(experts)
        if ids.size and (ids.min() < 0 or ids.max() >= e):
            raise ValueError(f"experts must be ids in [0, {e}), got ids from {ids.min()} to {ids.max()}")


def routed_experts_ragged(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array,
                          w_up: jax.Array, w_down: jax.Array, *, first_expert=0) -> jax.Array:
    """The routed experts' output as grouped matmuls (``jax.lax.ragged_dot``):
    the ``T * top_k`` assignments sorted by expert, each expert's SwiGLU on
    its rows, weighted and summed back per token.

    Args:
      x: f[T, D] tokens.
      experts: i32[T, top_k] chosen experts (:func:`route`).
      weights: f32[T, top_k] their weights.
      w_gate, w_up: f[E, D, I]; w_down: f[E, I, D]: experts
        ``first_expert .. first_expert + E - 1``.
      first_expert: the id of the first expert these weights hold (an
        expert-parallel shard's, :func:`routed_experts_sharded`); the
        assignments to other experts add nothing here. An int or an i32
        scalar (traced).

    Returns:
      f[T, D] in ``x``'s dtype (the weighted sum in float32).

    Raises:
      ValueError: shapes that do not fit together.
    """
    x, experts, weights = jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights)
    _check_experts(x, experts, weights, w_gate, w_up, w_down, ids_checked=isinstance(first_expert, int)
                   and first_expert == 0)
    t, k = experts.shape
    e = w_gate.shape[0]
    local = experts.reshape(-1) - first_expert
    local = jnp.where((local >= 0) & (local < e), local, e)  # another shard's: sorted last, in no group
    order = jnp.argsort(local, stable=True)
    rows = x[order // k]  # [T*k, D], grouped by expert
    sizes = jnp.bincount(local, length=e + 1)[:e].astype(jnp.int32)  # rows past their sum come back zero
    h = jax.nn.silu(jax.lax.ragged_dot(rows, w_gate, sizes)) * jax.lax.ragged_dot(rows, w_up, sizes)
    y = jax.lax.ragged_dot(h, w_down, sizes).astype(jnp.float32)  # [T*k, D]
    y = y * weights.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[order // k].add(y).astype(x.dtype)


def routed_experts_sharded(mesh: jax.sharding.Mesh, axis: str = "model"):
    """Expert parallelism: :func:`routed_experts_ragged` with the experts
    split over ``mesh``'s ``axis`` (each device holds ``E / n`` consecutive
    experts' weights, ``P(axis)`` on the expert axis), the tokens, choices
    and weights replicated; each device computes its experts' share and a
    ``psum`` over ``axis`` adds them up. (Tokens are not exchanged: an
    all-to-all dispatch pays off when tokens are sharded too, data-parallel
    attention, which the engine does not do.)

    Returns:
      ``f(x, experts, weights, w_gate, w_up, w_down) -> f[T, D]``, the
      arguments as :func:`routed_experts_ragged`'s, jitted; arguments not
      placed so already are put on the mesh first (the expert weights split
      over ``axis``, the rest replicated), so a mesh of explicit axes
      (``jax.make_mesh``'s default) works as an automatic one does.

    Raises:
      ValueError: ``axis`` not in ``mesh`` (here), or (when called) a
        number of experts that ``axis`` does not divide.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {mesh.axis_names}")
    n = mesh.shape[axis]
    P = jax.sharding.PartitionSpec

    def local(x, experts, weights, w_gate, w_up, w_down):
        first = jax.lax.axis_index(axis) * w_gate.shape[0]
        out = routed_experts_ragged(x, experts, weights, w_gate, w_up, w_down, first_expert=first)
        return jax.lax.psum(out.astype(jnp.float32), axis).astype(x.dtype)

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(axis), P(axis), P(axis)),
                                    out_specs=P(), check_vma=False))

    split, whole = jax.sharding.NamedSharding(mesh, P(axis)), jax.sharding.NamedSharding(mesh, P())

    def apply(x, experts, weights, w_gate, w_up, w_down):
        if w_gate.shape[0] % n:
            raise ValueError(f"{w_gate.shape[0]} experts do not split over the mesh's {axis!r} axis of {n} devices")
        _check_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), w_gate, w_up, w_down)
        x, experts, weights = jax.device_put((x, experts, weights), whole)
        w_gate, w_up, w_down = jax.device_put((w_gate, w_up, w_down), split)
        return sharded(x, experts, weights, w_gate, w_up, w_down)

    return apply


def routed_experts_dense(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array,
                         w_up: jax.Array, w_down: jax.Array, *, first_expert=0) -> jax.Array:
    """The routed experts' output by one-hot dispatch: every expert on every
    token, combined by a ``[T, E]`` matrix of the chosen weights (zero
    elsewhere). Same arguments, result and errors as
    :func:`routed_experts_ragged`; ``E / top_k`` times its work."""
    x, experts, weights = jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights)
    _check_experts(x, experts, weights, w_gate, w_up, w_down, ids_checked=isinstance(first_expert, int)
                   and first_expert == 0)
    # [T, E]: each token's weight on each of these experts (another shard's id, or one out of range under jit,
    # is no row of the one-hot: it adds nothing, as in the ragged form)
    combine = jnp.einsum("tk,tke->te", weights.astype(jnp.float32),
                         jax.nn.one_hot(experts - first_expert, w_gate.shape[0]))
    h = jax.nn.silu(jnp.einsum("td,edi->tei", x, w_gate)) * jnp.einsum("td,edi->tei", x, w_up)
    y = jnp.einsum("tei,eid->ted", h, w_down).astype(jnp.float32)
    return jnp.einsum("te,ted->td", combine, y).astype(x.dtype)


EXPERT_IMPLS = ("auto", "ragged", "dense")
"""How :func:`routed_experts` runs the experts."""


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, *, impl: str = "auto", first_expert=0) -> jax.Array:
    """The routed experts' output, by :func:`routed_experts_ragged`
    (``impl="ragged"``) or :func:`routed_experts_dense` (``"dense"``); the
    same arguments, result and errors. ``"auto"``: the one-hot dispatch on
    CPU, where ``experiments.kernels.moe_bench`` measured it 1.15-1.6x
    faster than ``ragged_dot`` at 9 of 10 sizes (1 to 2,048 tokens, 8 and
    64 experts, top-2, model dim 512, experts 256 wide; 1.15x slower at 8
    tokens and 8 experts: XLA's CPU ``ragged_dot`` costs more than running
    every expert), and grouped matmuls elsewhere (GPU, TPU: the work the
    assignments need, not ``E / top_k`` times it; unmeasured here).
    ``first_expert``: as :func:`routed_experts_ragged` (an expert-parallel
    shard's first expert).

    Raises:
      ValueError: an unknown ``impl``, or what the chosen form raises.
    """
    check_choice("impl", impl, EXPERT_IMPLS)
    if impl == "auto":
        impl = "dense" if jax.default_backend() == "cpu" else "ragged"
    fn = routed_experts_dense if impl == "dense" else routed_experts_ragged
    return fn(x, experts, weights, w_gate, w_up, w_down, first_expert=first_expert)
