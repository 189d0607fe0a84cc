"""The DeepSeek-V3 decoder over latent pages, on the engine's flat batch.

Weights are a pytree of arrays (:func:`init_params`, or
:func:`models.deepseek.loader.load_hf_deepseek`), one stack for the dense
layers and one for the mixture-of-experts layers, each run under
``lax.scan``:

- ``embed`` [V, D], ``final_norm`` [D], ``lm_head`` [V, D] (absent when
  the embedding is tied);
- in both stacks, per layer: ``attn_norm``, ``mlp_norm`` [D]; the query
  ``q_a`` [D, Q], ``q_a_norm`` [Q], ``q_b`` [Q, N, H + R] (or ``q``
  [D, N, H + R] without a query LoRA); the latent ``kv_a`` [D, C + R],
  ``kv_a_norm`` [C]; the up-projections ``w_uk`` [N, H, C] and ``w_uv``
  [N, C, O] (``kv_b_proj`` split per head); ``o`` [N, O, D];
- dense layers: ``gate``, ``up`` [D, F], ``down`` [F, D];
- MoE layers: ``router`` f32[E, D], ``bias`` f32[E] (the
  ``e_score_correction_bias``; sigmoid routers only), ``w_gate``, ``w_up`` [E, D, I], ``w_down``
  [E, I, D], and the shared experts' ``shared_gate``, ``shared_up``
  [D, I_s], ``shared_down`` [I_s, D].

A layer (DeepSeek-V2 section 2.1, V3 section 2.1): RMSNorm, then MLA: the
query ``q_b(norm(q_a x))`` split into its ``nope`` and ``pe`` parts, the
latent ``kv_a x`` split into ``c`` (normed) and ``k_pe``, RoPE on ``q_pe``
and ``k_pe``, ``[c, k_pe]`` written to the latent pool at the batch's
slots, attention in the absorbed form
(:func:`paged_jax.attention.latent.absorbed_ragged_attention`: ``W_UK``
folded into the query, multi-query attention over the latent pages,
``W_UV`` after) through the flat batch's one door, ``o``; a residual;
RMSNorm, then the dense SwiGLU, or the routed experts
(:func:`models.layers.moe.route`, :func:`models.layers.moe.routed_experts`)
plus the shared experts; a residual.

Each row of the flat batch attends in the form its cost picks
(:func:`paged_jax.attention.latent.latent_ragged_attention`): decode
tokens and chunks under 256 tokens absorbed, longer prefill chunks expanded
to per-head keys and values (the crossover measured on CPU,
:mod:`paged_jax.attention.latent`).

Axis letters as in ``models/__init__.py``, with :mod:`paged_jax.attention.latent`'s
C, R, H (non-RoPE head dim), O (value head dim); Q the query LoRA rank, E
experts, I an expert's width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.config import PARAM_DTYPES, check_param_dtype
from models.deepseek.config import DeepseekConfig
from models.layers.moe import route, routed_experts
from models.layers.rope import apply_rope, rope_angles
from paged_jax.attention import paged as paged_attn
from paged_jax.attention.batch import RaggedBatch
from paged_jax.attention.latent import EXPANDED_MIN_TOKENS, latent_ragged_attention
from paged_jax.checks import check_choice, check_instance, check_int
from paged_jax.paging.kv_cache import KVPool, check_slots, default_kv_dtype, init_latent_pool, write_layer_latent
from paged_jax.paging.kv_groups import KVGroups, kv_groups


def _rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, scaled by ``w`` in ``x``'s dtype (transformers'
    ``DeepseekV3RMSNorm``)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * normed.astype(x.dtype)


def _swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def param_shapes(config: DeepseekConfig) -> dict:
    """Every weight's shape, as :func:`init_params` lays them out (module
    docstring): ``{name: shape}`` at the top, ``{"dense" | "moe": {name:
    shape with the stack's layers first}}``."""
    c = config
    D, N, C, R, H, Dv = c.model_dim, c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim

    def layer(n: int) -> dict:
        out = {"attn_norm": (n, D), "mlp_norm": (n, D), "kv_a": (n, D, C + R), "kv_a_norm": (n, C),
               "w_uk": (n, N, H, C), "w_uv": (n, N, C, Dv), "o": (n, N, Dv, D)}
        if c.q_lora_rank is None:
            out["q"] = (n, D, N, H + R)
        else:
            out.update(q_a=(n, D, c.q_lora_rank), q_a_norm=(n, c.q_lora_rank), q_b=(n, c.q_lora_rank, N, H + R))
        return out

    shapes = {"embed": (c.vocab_size, D), "final_norm": (D,)}
    if not c.tie_embeddings:
        shapes["lm_head"] = (c.vocab_size, D)
    dense, moe = c.num_dense_layers, c.num_layers - c.num_dense_layers
    if dense:
        shapes["dense"] = {**layer(dense), "gate": (dense, D, c.mlp_dim), "up": (dense, D, c.mlp_dim),
                           "down": (dense, c.mlp_dim, D)}
    if moe:
        E, Im, Is = c.router.num_experts, c.moe_mlp_dim, c.moe_mlp_dim * c.num_shared_experts
        shapes["moe"] = {**layer(moe), "router": (moe, E, D), "w_gate": (moe, E, D, Im), "w_up": (moe, E, D, Im),
                         "w_down": (moe, E, Im, D)}
        if c.router.scoring == "sigmoid":  # the correction bias: DeepSeek-V3's auxiliary-loss-free balancing
            shapes["moe"]["bias"] = (moe, E)
        if Is:
            shapes["moe"].update(shared_gate=(moe, D, Is), shared_up=(moe, D, Is), shared_down=(moe, Is, D))
    return shapes


FLOAT32_PARAMS = ("router", "bias")
"""Weights kept in float32 whatever the model's dtype (the router's, as
transformers' ``_keep_in_fp32_modules_strict``)."""


def init_params(config: DeepseekConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random weights at ``config``'s shapes (:func:`param_shapes`): normal
    with ``std``, norms 1, the correction bias 0; for accelerator runs and
    tests where no checkpoint fits.

    Raises:
      ValueError: a ``dtype`` other than float32, bfloat16 or float16.
    """
    check_param_dtype(dtype, "dtype")
    shapes = param_shapes(config)
    is_shape = lambda s: isinstance(s, tuple)  # noqa: E731
    keys = iter(jax.random.split(key, len(jax.tree.leaves(shapes, is_leaf=is_shape))))

    def draw(path, shape):
        name, k = path[-1].key, next(keys)
        dt = jnp.float32 if name in FLOAT32_PARAMS else dtype
        if name.endswith("norm"):
            return jnp.ones(shape, dt)
        if name == "bias":
            return jnp.zeros(shape, dt)
        return (std * jax.random.normal(k, shape, jnp.float32)).astype(dt)

    return jax.tree_util.tree_map_with_path(draw, shapes, is_leaf=is_shape)


def check_latent_pool(config: DeepseekConfig, kv: KVPool) -> None:
    """Raises ValueError unless ``kv`` is a latent pool
    (:func:`paged_jax.paging.kv_cache.init_latent_pool`) of ``config``'s
    layers and ``latent_dim`` (float pages, or int8 / fp8 with a scale a
    token)."""
    if not isinstance(kv, KVPool) or not kv.latent:
        raise ValueError("kv must be a latent pool (paged_jax.paging.kv_cache.init_latent_pool: one head of "
                         f"kv_lora_rank + qk_rope_head_dim = {config.latent_dim}, no V) for an MLA model")
    if kv.num_layers != config.num_layers or kv.head_dim != config.latent_dim or kv.k.shape[1] != 1:
        raise ValueError(f"kv is a latent pool of {kv.num_layers} layers, {kv.k.shape[1]} heads of "
                         f"{kv.head_dim}; this model needs {config.num_layers} layers, 1 head of "
                         f"{config.latent_dim}")


def forward_ragged(config: DeepseekConfig, params: dict, batch: RaggedBatch, kv: KVPool, *,
                   impl: str = "auto", expanded_min_tokens: int | None = EXPANDED_MIN_TOKENS,
                   axis: str | None = None) -> tuple[jax.Array, KVPool, jax.Array]:
    """Runs the decoder over a flat ragged batch (mixed prefill chunks and
    decode tokens), writing each token's latent into the pool.

    Args:
      config: the architecture.
      params: its weights (module docstring).
      batch: the flat batch (one layer group).
      kv: the latent pool, ``[layers, 1, P, L, C + R]``.
      impl: the attention implementation
        (:func:`paged_jax.attention.ragged.attend`).
      expanded_min_tokens: rows of at least this many query tokens attend
        in the expanded form, the others absorbed; None: all absorbed
        (:func:`paged_jax.attention.latent.latent_ragged_attention`).
      axis: under ``shard_map`` over a mesh axis (tensor and expert
        parallelism, :class:`models.deepseek.sharded.ShardedDeepseekModel`):
        ``params`` hold this device's share (its query heads, MLP columns,
        experts and shared-expert columns; the rest replicated), and the
        attention's and the MLP's partial outputs are summed over ``axis``
        (two all-reduces a layer). None: one device.

    Returns:
      ``(logits f32[R, V] at batch.logits_rows, kv, finite bool[T])``, as
      :func:`models.ragged.forward_ragged`.

    Raises:
      ValueError: a pool that does not fit (:func:`check_latent_pool`), an
        unknown ``impl``, a batch the attention refuses; (eager) slots that
        are not distinct slots of the pool.
    """
    check_latent_pool(config, kv)
    check_choice("impl", impl, paged_attn.IMPLS)
    if batch.num_groups != 1:
        raise ValueError(f"batch has {batch.num_groups} layer groups; an MLA model's layers are one group")
    c = config
    T, C, R, H, eps = batch.tokens.shape[0], c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.rms_norm_eps
    check_slots(kv, batch.slots, T)
    cos, sin = rope_angles(batch.positions[None], R, c.rope_theta, c.rope_scaling)  # [1, T, R/2]
    reduce = (lambda y: y) if axis is None else (lambda y: jax.lax.psum(y, axis))  # noqa: E731

    def attention(p, h, kv, layer):
        if c.q_lora_rank is None:
            q = jnp.einsum("TD,DNX->TNX", h, p["q"])
        else:
            q = jnp.einsum("TQ,QNX->TNX", _rms(h @ p["q_a"], p["q_a_norm"], eps), p["q_b"])
        q_nope, q_pe = q[..., :H], apply_rope(q[None, :, :, H:], cos, sin)[0]
        latent = h @ p["kv_a"]  # [T, C + R]
        k_pe = apply_rope(latent[None, :, None, C:], cos, sin)[0, :, 0]
        latent = jnp.concatenate([_rms(latent[:, :C], p["kv_a_norm"], eps), k_pe], axis=-1)
        kv = write_layer_latent(kv, layer, latent.astype(jnp.float32), batch.slots)
        out = latent_ragged_attention(q_nope, q_pe, kv.k, layer, batch, p["w_uk"], p["w_uv"], kv_lora_rank=C,
                                      scale=c.query_scale, impl=impl, latent_scales=kv.k_scale,
                                      expanded_min_tokens=expanded_min_tokens)  # f32[T, N, O]
        return reduce(jnp.einsum("TNO,NOD->TD", out.astype(h.dtype), p["o"])), kv

    def dense_mlp(p, h):
        return reduce(_swiglu(h, p["gate"], p["up"], p["down"]))

    def moe_mlp(p, h):
        logits = h.astype(jnp.float32) @ p["router"].T  # [T, E], every expert: the router is replicated
        weights, experts = route(logits, c.router, p.get("bias"))
        first = 0 if axis is None else jax.lax.axis_index(axis) * p["w_gate"].shape[0]  # this shard's experts
        y = routed_experts(h, experts, weights, p["w_gate"], p["w_up"], p["w_down"], first_expert=first)
        if "shared_gate" in p:
            y = y + _swiglu(h, p["shared_gate"], p["shared_up"], p["shared_down"])
        return reduce(y)

    def stack(x, kv, layers: dict, first: int, mlp):
        def body(carry, p):
            x, kv, layer = carry
            a, kv = attention(p, _rms(x, p["attn_norm"], eps), kv, layer)
            x = x + a
            x = x + mlp(p, _rms(x, p["mlp_norm"], eps)).astype(x.dtype)
            return (x, kv, layer + 1), None

        (x, kv, _), _ = jax.lax.scan(body, (x, kv, jnp.int32(first)), layers)
        return x, kv

    x = params["embed"][batch.tokens]  # [T, D]
    if "dense" in params:
        x, kv = stack(x, kv, params["dense"], 0, dense_mlp)
    if "moe" in params:
        x, kv = stack(x, kv, params["moe"], c.num_dense_layers, moe_mlp)
    finite = jnp.all(jnp.isfinite(x), axis=-1)  # [T]
    x = _rms(x[batch.logits_rows], params["final_norm"], eps)
    head = params["embed"] if c.tie_embeddings else params["lm_head"]
    return jnp.einsum("RD,VD->RV", x.astype(jnp.float32), head.astype(jnp.float32)), kv, finite


class DeepseekModel:
    """The engine's view of a DeepSeek-V3 decoder (a
    :class:`paged_jax.engine.step.PagedModel`): ``params`` a pytree, ``apply``
    :func:`forward_ragged`, a latent pool (:meth:`make_kv_pool`).

    Args:
      config: the architecture.
      params: weights as :func:`init_params` lays them out.
      impl: the attention implementation.
      expanded_min_tokens: rows of a call with at least this many query
        tokens attend in the expanded form (:func:`forward_ragged`); None:
        every row absorbed.

    Raises:
      ValueError: a ``config`` that is not a :class:`DeepseekConfig`,
        weights of other shapes than ``config`` gives (the first named),
        or of a dtype other than float32, bfloat16 or float16 (the router
        and its bias: float32), an unknown ``impl``.
    """

    kv_window = None

    def __init__(self, config: DeepseekConfig, params: dict, *, impl: str = "auto",
                 expanded_min_tokens: int | None = EXPANDED_MIN_TOKENS):
        check_instance("config", config, DeepseekConfig, what="models.deepseek.config.DeepseekConfig")
        check_choice("impl", impl, paged_attn.IMPLS)
        if expanded_min_tokens is not None:
            check_int("expanded_min_tokens", expanded_min_tokens)
        want, got = _flat_shapes(param_shapes(config)), _flat_shapes(params)
        for name in sorted(want.keys() | got.keys()):
            if want.get(name) != got.get(name):
                raise ValueError(f"params{name}: shape {got.get(name, 'missing')}, the config gives "
                                 f"{want.get(name, 'no such weight')}")
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            dtype, name = jnp.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype)), jax.tree_util.keystr(path)
            if path[-1].key in FLOAT32_PARAMS and dtype != jnp.float32:
                raise ValueError(f"params{name} has dtype {dtype}; the router's weights are float32")
            if dtype.name not in PARAM_DTYPES:
                raise ValueError(f"params{name} has dtype {dtype}; expected one of {PARAM_DTYPES}")
        self.config, self.params, self.impl, self.expanded_min_tokens = config, params, impl, expanded_min_tokens
        self.vocab_size = config.vocab_size

    @property
    def kv_groups(self) -> KVGroups:
        """One layer group: every layer attends every token."""
        return kv_groups([None] * self.config.num_layers)

    def make_kv_pool(self, num_pages: int, page_size: int, dtype=None) -> KVPool:
        """A zeroed latent pool of ``num_pages`` pages (the null page
        included) of ``page_size`` tokens: ``config.num_layers *
        config.latent_dim`` values a token.

        Raises:
          ValueError: ``num_pages`` < 2, ``page_size`` < 1, or a ``dtype``
            the pool does not take (float32, bfloat16, float16, int8,
            float8_e4m3fn, float8_e5m2; a quantized pool adds 4 bytes of scale a token
            and layer).
        """
        check_int("num_pages", num_pages, 2)
        pool = init_latent_pool(num_layers=self.config.num_layers, num_pages=num_pages, page_size=page_size,
                                latent_dim=self.config.latent_dim, dtype=default_kv_dtype() if dtype is None else dtype)
        check_latent_pool(self.config, pool)
        return pool

    def make_budget_kv_pool(self, num_pages: int, page_size: int, dtype=None, *, grouped: bool = True) -> KVPool:
        """:meth:`make_kv_pool` (every layer attends every token: one layer
        group, so ``grouped`` changes nothing); the counterpart of
        ``models.ragged.RaggedModel.make_budget_kv_pool``."""
        del grouped
        return self.make_kv_pool(num_pages, page_size, dtype)

    def check_kv_pool(self, kv: KVPool) -> None:
        """Raises ValueError unless ``kv`` fits (:func:`check_latent_pool`)."""
        check_latent_pool(self.config, kv)

    def apply(self, params, batch: RaggedBatch, kv: KVPool) -> tuple[jax.Array, KVPool, jax.Array]:
        """:func:`forward_ragged` with this model's config and ``impl``:
        ``(logits f32[R, V], kv, finite bool[T])``."""
        return forward_ragged(self.config, params, batch, kv, impl=self.impl,
                              expanded_min_tokens=self.expanded_min_tokens)


def _flat_shapes(tree) -> dict[str, tuple[int, ...]]:
    """``{path: shape}`` of a tree of arrays or of :func:`param_shapes`' tuples."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda s: isinstance(s, tuple))[0]
    return {jax.tree_util.keystr(k): tuple(np.shape(v)) if not isinstance(v, tuple) else v for k, v in leaves}
