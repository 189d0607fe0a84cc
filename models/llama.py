"""A Llama-family decoder (Flax NNX) that reads and writes a paged KV pool.

RMSNorm, rotary position embeddings (half-split, as Hugging Face Llama), GQA
attention, SwiGLU MLP, tied or untied output embedding. Per-layer weights are
stacked along a leading layer axis and the layers run under ``jax.lax.scan``,
so a 30-layer model compiles one layer body instead of thirty.

The config's family options (:class:`models.config.LlamaConfig`) add what
Llama 3.1, Qwen3, Gemma 2 / 3 and OLMo 2 compute: scaled RoPE
(:mod:`models.layers.rope`), q/k RMSNorm, ``1 + w`` norms, norms after the
sublayers, GeGLU, a scaled embedding, soft caps and a query scale.

Sliding and global layers mixed (Gemma 2 / 3, Qwen3's ``layer_types``) keep
one scan body: each kind's RoPE table is computed once per call and indexed
by the layer's kind, and the attention is a ``jax.lax.cond`` on the kind
between two calls with static windows. Not a window as a traced int per
layer, because every attention path (the XLA work list, the Pallas kernels)
takes the window as a static option and specialises on it (the sliding
branch skips the key blocks before the window): none of them changes, only
the taken branch runs, and the cost is compiling the attention twice.

The KV cache is never module state. :func:`forward` takes a
:class:`paged_jax.paging.kv_cache.KVPool` and returns the updated one; the pool
rides in the scan carry and each layer scatters its new K/V into its own
slice in place, then attends over its pages with
:func:`paged_jax.attention.paged.paged_attention` (:func:`forward`). The engine's
flat ragged forward and the model it holds are in :mod:`models.ragged`,
built from this module's blocks, embedding, layer scan and logits.

Validated at the door: :func:`forward` checks its arguments once per call
(the attention's checks included: ``check_paged_attention``,
``kv_cache.check_slots``), and the layers under it call the ``unchecked_*``
attention and KV writes, which trust their inputs.

Batch convention ("padded ragged", see :mod:`paged_jax.attention.paged`): tokens
``[B, T]``; sequence ``b`` has ``q_lens[b] <= T`` real tokens at positions
``kv_lens[b] - q_lens[b] + t``; ``kv_lens[b]`` counts its cached tokens
including these. Decode is ``T = 1``; prefill, chunked prefill and mixed
batches are the same call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import LlamaConfig
from models.layers.moe import route, routed_experts
from models.layers.rope import apply_rope, rope_angles
from paged_jax.attention import paged as paged_attn
from paged_jax.checks import check_choice
from paged_jax.distributed.sharding import MODEL as EXPERT_AXIS  # the mesh axis experts split over
from paged_jax.paging.kv_cache import KVPool, check_pool, unchecked_write_layer_kv
from paged_jax.paging.slots import slot_mapping


def _normal(rngs: nnx.Rngs, shape, std: float, dtype):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * scale``, computed in f32; with
    ``plus_one`` (Gemma) the factor is ``1 + scale`` and ``scale`` starts at 0.

    ``stack`` prepends axes to the scale (the layer axis of stacked blocks).
    """

    def __init__(self, dim: int, *, eps: float, stack: tuple[int, ...] = (), param_dtype=jnp.float32,
                 plus_one: bool = False):
        self.eps = eps
        self.plus_one = plus_one
        self.scale = nnx.Param(jnp.full(stack + (dim,), 0.0 if plus_one else 1.0, param_dtype))  # [*stack, D]

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return ((1.0 + scale if self.plus_one else scale) * x32).astype(x.dtype)


def _norm(config: LlamaConfig, dim: int, stack: tuple[int, ...], param_dtype) -> RMSNorm:
    return RMSNorm(dim, eps=config.rms_norm_eps, stack=stack, param_dtype=param_dtype,
                   plus_one=config.norm_plus_one)


def _maybe(norm: RMSNorm | None, x: jax.Array) -> jax.Array:
    return x if norm is None else norm(x)


class Attention(nnx.Module):
    """GQA self-attention over the paged KV pool (weights stacked by ``stack``)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...] = (),
                 param_dtype=jnp.float32):
        d, n, k, h = config.model_dim, config.num_q_heads, config.num_kv_heads, config.head_dim
        self.config = config
        self.wq = nnx.Param(_normal(rngs, stack + (d, n, h), d**-0.5, param_dtype))  # [*, D, N, H]
        self.wk = nnx.Param(_normal(rngs, stack + (d, k, h), d**-0.5, param_dtype))  # [*, D, K, H]
        self.wv = nnx.Param(_normal(rngs, stack + (d, k, h), d**-0.5, param_dtype))  # [*, D, K, H]
        self.wo = nnx.Param(_normal(rngs, stack + (n, h, d), (n * h) ** -0.5, param_dtype))  # [*, N, H, D]
        # q/k/v biases (Qwen2), zero until a checkpoint fills them; absent otherwise.
        self.bq = nnx.Param(jnp.zeros(stack + (n, h), param_dtype)) if config.qkv_bias else None  # [*, N, H]
        self.bk = nnx.Param(jnp.zeros(stack + (k, h), param_dtype)) if config.qkv_bias else None  # [*, K, H]
        self.bv = nnx.Param(jnp.zeros(stack + (k, h), param_dtype)) if config.qkv_bias else None  # [*, K, H]
        # q/k RMSNorm: over H (Qwen3, Gemma 3) or the whole N*H / K*H projection (OLMo 2).
        full = config.qk_norm == "full"
        self.q_norm = _norm(config, n * h if full else h, stack, param_dtype) if config.qk_norm else None
        self.k_norm = _norm(config, k * h if full else h, stack, param_dtype) if config.qk_norm else None

    def __call__(self, x, cos, sin, cache, layer, attend):
        """One layer's attention: ``(out [B, T, D], cache)``.

        ``attend(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H], cache,
        layer) -> (out [B, T, N, H], cache)`` is the batch layout's attention:
        the paged paths write ``k``/``v`` into the pool's pages and attend
        over them (``cache`` is the pool); the dense training path attends
        over ``k``/``v`` themselves (``cache`` is None).
        """
        q = jnp.einsum("BTD,DNH->BTNH", x, self.wq[...])
        k = jnp.einsum("BTD,DKH->BTKH", x, self.wk[...])
        v = jnp.einsum("BTD,DKH->BTKH", x, self.wv[...])
        if self.bq is not None:  # before RoPE, as Qwen2
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if self.q_norm is not None:  # before RoPE, on the projections' output
            flat = self.config.qk_norm == "full"
            q = self.q_norm(q.reshape(*q.shape[:2], -1)).reshape(q.shape) if flat else self.q_norm(q)
            k = self.k_norm(k.reshape(*k.shape[:2], -1)).reshape(k.shape) if flat else self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, cache = attend(q, k, v, cache, layer)  # [B, T, N, H]
        return jnp.einsum("BTNH,NHD->BTD", out, self.wo[...]), cache


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(x @ gate) * (x @ up))``; GeGLU (tanh-approximate
    GELU in place of SiLU) with ``config.mlp_activation == "gelu_tanh"``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...] = (),
                 param_dtype=jnp.float32):
        d, f = config.model_dim, config.mlp_dim
        self.w_gate = nnx.Param(_normal(rngs, stack + (d, f), d**-0.5, param_dtype))  # [*, D, F]
        self.w_up = nnx.Param(_normal(rngs, stack + (d, f), d**-0.5, param_dtype))  # [*, D, F]
        self.w_down = nnx.Param(_normal(rngs, stack + (f, d), f**-0.5, param_dtype))  # [*, F, D]
        self.activation = config.mlp_activation

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jnp.einsum("BTD,DF->BTF", x, self.w_gate[...])
        up = jnp.einsum("BTD,DF->BTF", x, self.w_up[...])
        act = jax.nn.silu(gate) if self.activation == "silu" else jax.nn.gelu(gate, approximate=True)
        return jnp.einsum("BTF,FD->BTD", act * up, self.w_down[...])


class MoE(nnx.Module):
    """A mixture-of-experts MLP (Qwen3-MoE's sparse block): the router's
    top-k experts of ``config.router`` per token
    (:func:`models.layers.moe.route`), each a SwiGLU of ``moe_mlp_dim``, run
    by :func:`models.layers.moe.routed_experts` (one-hot on CPU, grouped matmuls elsewhere) and
    summed with the router's weights. The router weight stays float32.

    With ``config.expert_shards`` = S > 1 (expert parallelism,
    :class:`models.sharded.ShardedLlama`, under ``shard_map``) the module
    holds ``E / S`` experts, those of shard ``axis_index("model")``; the
    router (replicated) chooses among all ``E`` and the output is this
    shard's experts' share, which the caller's ``reduce`` sums over the
    axis."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...] = (),
                 param_dtype=jnp.float32):
        d, i, e = config.model_dim, config.moe_mlp_dim, config.router.num_experts
        local = e // config.expert_shards
        self.router = nnx.Param(_normal(rngs, stack + (e, d), d**-0.5, jnp.float32))  # [*, E, D]
        self.w_gate = nnx.Param(_normal(rngs, stack + (local, d, i), d**-0.5, param_dtype))  # [*, E / S, D, I]
        self.w_up = nnx.Param(_normal(rngs, stack + (local, d, i), d**-0.5, param_dtype))  # [*, E / S, D, I]
        self.w_down = nnx.Param(_normal(rngs, stack + (local, i, d), i**-0.5, param_dtype))  # [*, E / S, I, D]
        self.routing, self.shards = config.router, config.expert_shards

    def __call__(self, x: jax.Array) -> jax.Array:
        flat = x.reshape(-1, x.shape[-1])  # [B * T, D]
        weights, experts = route(flat.astype(jnp.float32) @ self.router[...].T, self.routing)
        first = 0 if self.shards == 1 else jax.lax.axis_index(EXPERT_AXIS) * self.w_gate.shape[-3]
        y = routed_experts(flat, experts, weights, self.w_gate[...], self.w_up[...], self.w_down[...],
                           first_expert=first)
        return y.reshape(x.shape).astype(x.dtype)


class Block(nnx.Module):
    """Decoder block. ``config.norm_placement``: ``"pre"``: ``x + attn(norm(x))``
    then ``x + mlp(norm(x))``; ``"pre_post"``: ``x + norm(attn(norm(x)))``
    then the same around the MLP; ``"post"``: ``x + norm(attn(x))`` then
    ``x + norm(mlp(x))``. Absent norms are None."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...] = (),
                 param_dtype=jnp.float32):
        pre, post = config.norm_placement != "post", config.norm_placement != "pre"
        d = config.model_dim
        self.attn_norm = _norm(config, d, stack, param_dtype) if pre else None
        self.attn = Attention(config, rngs=rngs, stack=stack, param_dtype=param_dtype)
        self.post_attn_norm = _norm(config, d, stack, param_dtype) if post else None
        self.mlp_norm = _norm(config, d, stack, param_dtype) if pre else None
        mlp = MLP if config.router is None else MoE
        self.mlp = mlp(config, rngs=rngs, stack=stack, param_dtype=param_dtype)
        self.post_mlp_norm = _norm(config, d, stack, param_dtype) if post else None

    def __call__(self, x, cos, sin, cache, layer, attend, reduce=None):
        """``reduce`` (default none) sums the attention and MLP outputs over
        the devices that each computed part of them (tensor parallelism:
        ``psum`` over the model axis, :mod:`models.sharded`) before each
        residual add (and before a post-norm, which needs the whole sum)."""
        reduce = reduce or (lambda y: y)
        h, cache = self.attn(_maybe(self.attn_norm, x), cos, sin, cache, layer, attend)
        x = x + _maybe(self.post_attn_norm, reduce(h))
        x = x + _maybe(self.post_mlp_norm, reduce(self.mlp(_maybe(self.mlp_norm, x))))
        return x, cache


class Llama(nnx.Module):
    """Llama-family decoder with stacked layers.

    Attributes:
      config: the :class:`LlamaConfig`.
      embed: Param [V, D] token embedding.
      blocks: one :class:`Block` whose every weight has a leading
        ``num_layers`` axis.
      final_norm: RMSNorm over D.
      lm_head: Param [V, D], or None when ``config.tie_embeddings``.

    Random initialization: embeddings N(0, ``embed_std``^2), projections
    N(0, 1/fan_in), norm scales 1. The default ``embed_std = 1`` gives
    tests varied logits; training from scratch wants ``D ** -0.5`` (a tied
    output projection then starts at unit-variance logits, the loss near
    ``ln V``). Real checkpoints come from
    :func:`models.smollm2.load_llama_gguf`.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, embed_std: float = 1.0):
        self.config = config
        v, d = config.vocab_size, config.model_dim
        self.embed = nnx.Param(_normal(rngs, (v, d), embed_std, param_dtype))  # [V, D]
        self.blocks = Block(config, rngs=rngs, stack=(config.num_layers,), param_dtype=param_dtype)
        self.final_norm = _norm(config, d, (), param_dtype)
        self.lm_head = (
            None if config.tie_embeddings else nnx.Param(_normal(rngs, (v, d), d**-0.5, param_dtype))
        )

    def output_weight(self) -> jax.Array:
        """[V, D] the output projection (the embedding when tied)."""
        return self.embed[...] if self.lm_head is None else self.lm_head[...]


def _validate(config: LlamaConfig, tokens, kv: KVPool, block_tables, kv_lens, q_lens) -> None:
    """What :func:`forward` checks before the attention's own door checks
    (``check_paged_attention``): integer ids (cast to int32 after) and a pool
    that fits the model."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, q_tokens], got shape {tokens.shape}")
    for name, x in (("tokens", tokens), ("block_tables", block_tables), ("kv_lens", kv_lens),
                    ("q_lens", q_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
    check_model_pool(config, kv)


def query_struct(model: Llama, *tokens: int) -> jax.ShapeDtypeStruct:
    """The shape ``[*tokens, N, H]`` and dtype of a layer's queries (from
    the weights, so a tensor-parallel shard's own heads), for checking the
    attention once at the door rather than once per layer."""
    wq = model.blocks.attn.wq[...]  # [layers, D, N, H]
    return jax.ShapeDtypeStruct((*tokens, *wq.shape[-2:]), jnp.result_type(model.embed[...].dtype, wq.dtype))


def _rope_tables(config: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin: f32[kinds, B, T, H/2] for i32[B, T] positions: the global
    layers' RoPE, then the sliding layers' own when ``local_rope_theta`` is
    set (Gemma 3)."""
    tables = [rope_angles(positions, config.head_dim, config.rope_theta, config.rope_scaling)]
    if config.local_rope_theta is not None:
        tables.append(rope_angles(positions, config.head_dim, config.local_rope_theta))
    return jnp.stack([c for c, _ in tables]), jnp.stack([s for _, s in tables])


def embed_tokens(model: Llama, tokens: jax.Array) -> jax.Array:
    """Token embeddings [..., D]; times ``embed_scale`` rounded to the
    embedding's dtype first, as transformers rounds Gemma's ``sqrt(D)``."""
    x = model.embed[...][tokens]
    scale = model.config.embed_scale
    return x if scale is None else x * jnp.asarray(scale, x.dtype)


def windowed(config: LlamaConfig, layer: jax.Array, attention):
    """``attention(sliding_window)`` for this layer: the window is static
    when every layer is of one kind, else a ``lax.cond`` on the layer's
    kind picks between the two static calls (module docstring)."""
    sliding = config.sliding_layers
    if not config.mixed_layers:
        return attention(config.sliding_window if sliding[0] else None)
    return jax.lax.cond(jnp.asarray(sliding)[layer], lambda: attention(config.sliding_window),
                        lambda: attention(None))


def run_layers(model: Llama, x, positions, cache, attend, reduce=None):
    """The decoder blocks under ``lax.scan`` (one compiled layer body):
    x [B, T, D] at i32[B, T] ``positions`` -> [B, T, D]. ``cache`` (a
    :class:`KVPool`, or None for the dense path) rides in the carry;
    ``attend`` is as in :meth:`Attention.__call__`; ``reduce`` as in
    :meth:`Block.__call__`. Returns ``(x, cache)``."""
    config = model.config
    cos, sin = _rope_tables(config, positions)  # [kinds, B, T, H/2]
    local = config.local_rope_theta is not None
    kinds = jnp.asarray([int(local and s) for s in config.sliding_layers], jnp.int32)  # [layers]
    graphdef, block_state = nnx.split(model.blocks)  # leaves: [layers, ...]

    def layer_body(carry, xs):
        x, cache = carry
        layer, kind, state = xs
        x, cache = nnx.merge(graphdef, state)(x, cos[kind], sin[kind], cache, layer, attend, reduce)
        return (x, cache), None

    layers = jnp.arange(config.num_layers, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(layer_body, (x, cache), (layers, kinds, block_state))
    return x, cache


def _paged(slots: jax.Array, attend_pages):
    """An ``attend`` for :func:`run_layers` over a paged pool: writes the
    layer's new K/V (``[B, T, K, H]``, flattened to one row per token slot)
    at ``slots`` (i32[B * T], checked at the door; quantized to the pool's
    dtype for an int8 or fp8 pool), then ``attend_pages(q, kv, layer)``."""

    def attend(q, k, v, kv: KVPool, layer):
        rows = k.shape[0] * k.shape[1]
        kv = unchecked_write_layer_kv(kv, layer, k.reshape(rows, *k.shape[2:]), v.reshape(rows, *v.shape[2:]),
                                      slots)
        return attend_pages(q, kv, layer), kv

    return attend


def final_logits(model: Llama, x: jax.Array) -> jax.Array:
    """[..., D] final hidden states -> f32[..., V] logits."""
    x = model.final_norm(x)
    logits = jnp.einsum("...D,VD->...V", x, model.output_weight()).astype(jnp.float32)
    cap = model.config.final_soft_cap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def check_model_pool(config: LlamaConfig, kv: KVPool, num_layers: int | None = None) -> None:
    """A pool of ``num_layers`` layer rows (default every layer) with the
    model's KV heads and head dim."""
    want = (config.num_layers if num_layers is None else num_layers, config.num_kv_heads, config.head_dim)
    got = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
    if got != want:
        raise ValueError(f"kv pool must have (num_layers, num_kv_heads, head_dim)={want} for this model, got {got}")
    check_pool(kv)


def forward(
    model: Llama,
    tokens: jax.Array,  # i32[B, T]
    kv: KVPool,  # [layers, K, P, L, H]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array,  # i32[B]
    *,
    impl: str = "auto",
    all_logits: bool = False,
    reduce=None,
) -> tuple[jax.Array, KVPool]:
    """Runs the decoder over a padded ragged batch, writing its K/V into the pool.

    Args:
      model: the decoder.
      tokens: i32[B, T] token ids; row ``b`` has ``q_lens[b]`` real tokens,
        the rest is padding (any valid id).
      kv: the KV pool; page size is ``kv.page_size``.
      block_tables: i32[B, pages_per_seq] each sequence's pages, covering
        positions ``[0, kv_lens[b])``; unused entries should point at the
        null page.
      kv_lens: i32[B] cached tokens per sequence after this call (the new
        tokens included).
      q_lens: i32[B] new tokens per sequence, ``0 <= q_lens <= min(T, kv_lens)``.
      impl: paged-attention implementation (see
        :data:`paged_jax.attention.paged.IMPLS`).
      all_logits: return logits for every query row instead of the last
        real one.
      reduce: for a model holding one device's share of the heads and MLP
        columns (tensor parallelism, :mod:`models.sharded`), the sum over
        the devices (``psum`` over the model axis) of each attention and MLP
        output; None on one device.

    Returns:
      ``(logits, kv)``. ``logits``: f32[B, V] at row ``q_lens[b] - 1`` (zeros
      for ``q_lens[b] = 0``), or f32[B, T, V] with ``all_logits`` (padding
      rows hold values of no meaning). ``kv``: the pool with the new tokens'
      K/V written at slots ``slot_mapping(block_tables, positions)``.

    Raises:
      ValueError: shapes or dtypes that do not fit each other or the model,
        an unknown ``impl`` (``paged_jax.attention.paged.check_paged_attention``,
        which also clamps the lengths under ``jit``); (eager calls) lengths
        outside their ranges.
    """
    config = model.config
    _validate(config, tokens, kv, block_tables, kv_lens, q_lens)
    batch, num_q_tokens = tokens.shape
    block_tables = block_tables.astype(jnp.int32)
    impl, kv_lens, q_lens, _ = paged_attn.check_paged_attention(
        query_struct(model, batch, num_q_tokens), kv.k, kv.v, block_tables, kv_lens.astype(jnp.int32),
        q_lens.astype(jnp.int32), impl=impl, k_scales=kv.k_scale, v_scales=kv.v_scale,
        sliding_window=config.sliding_window, scale=config.query_scale, soft_cap=config.attn_soft_cap,
        layer=0)  # the scan's layers are the pool's (check_model_pool): the layer's type and rank are what is checked

    positions = paged_attn.query_positions(kv_lens, q_lens, num_q_tokens)  # [B, T]
    real = jnp.arange(num_q_tokens, dtype=jnp.int32)[None, :] < q_lens[:, None]  # [B, T]
    slots = slot_mapping(block_tables, positions, real, page_size=kv.page_size).reshape(-1)  # [B * T]
    x = embed_tokens(model, tokens)  # [B, T, D]

    def attend_pages(q, kv, layer):
        return windowed(config, layer, lambda window: paged_attn.unchecked_paged_attention(
            q, kv.k, kv.v, block_tables, kv_lens, q_lens, impl=impl, layer=layer, k_scales=kv.k_scale,
            v_scales=kv.v_scale, sliding_window=window, scale=config.query_scale, soft_cap=config.attn_soft_cap))

    x, kv = run_layers(model, x, positions, kv, _paged(slots, attend_pages), reduce)

    if not all_logits:
        last = jnp.clip(q_lens - 1, 0, num_q_tokens - 1)  # [B]
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
    logits = final_logits(model, x)
    if all_logits:
        return logits, kv  # [B, T, V]
    return jnp.where(q_lens[:, None] > 0, logits[:, 0], 0.0), kv  # [B, V]


def forward_dense(
    model: Llama,
    tokens: jax.Array,  # i32[B, T]
    segment_ids: jax.Array | None = None,  # i32[B, T]
) -> jax.Array:
    """The training forward: causal attention over the batch's own K/V, no
    pages and no cache, logits at every position.

    The same module, weights, RoPE and layer scan as :func:`forward`; only
    the attention differs (:func:`paged_jax.attention.paged.causal_attention` on
    contiguous K/V, against the pool's pages there), so a model trained here
    decodes identically through the paged cache (tests/test_train.py).

    Args:
      model: the decoder.
      tokens: i32[B, T] token ids.
      segment_ids: i32[B, T] packed-sequence ids (contiguous runs; a token
        attends only within its run, and RoPE positions restart at 0 in each
        run); padding is a run of its own. Default: one sequence per row.

    Returns:
      f32[B, T, V] logits; row ``t`` predicts token ``t + 1``.

    Raises:
      ValueError: ``tokens`` not a 2-D integer array, or ``segment_ids`` of
        another shape or a non-integer dtype.
    """
    config = model.config
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [batch, tokens], got {tokens.dtype}{list(tokens.shape)}")
    if segment_ids is None:
        segment_ids = jnp.zeros(tokens.shape, jnp.int32)
    if segment_ids.shape != tokens.shape or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be an integer array shaped like tokens {list(tokens.shape)}, "
                         f"got {segment_ids.dtype}{list(segment_ids.shape)}")
    segment_ids = segment_ids.astype(jnp.int32)
    positions = paged_attn.segment_positions(segment_ids)  # [B, T]
    x = embed_tokens(model, tokens)  # [B, T, D]

    def attend(q, k, v, cache, layer):
        return windowed(config, layer, lambda window: paged_attn.causal_attention(
            q, k, v, segment_ids, sliding_window=window, scale=config.query_scale,
            soft_cap=config.attn_soft_cap)), cache

    x, _ = run_layers(model, x, positions, None, attend)
    return final_logits(model, x)  # [B, T, V]


class StepFn:
    """A jitted pure decoder step with the model's weights bound.

    ``step(tokens, kv, block_tables, kv_lens, q_lens) -> (logits, kv)`` has
    :func:`forward`'s meaning (last-token logits f32[B, V] unless built with
    ``all_logits``). The pool argument is donated: the caller must use the
    returned pool and drop the one it passed in.

    Weights are an explicit argument of the jitted function (split once from
    the model at construction), not closed-over constants, so XLA does not
    fold 0.5 GB of weights into the program. Each distinct set of input
    shapes traces and compiles once; ``num_compilations`` counts them.
    """

    def __init__(self, model: Llama, *, impl: str = "auto", all_logits: bool = False):
        check_choice("impl", impl, paged_attn.IMPLS)
        graphdef, params = nnx.split(model)
        self.config: LlamaConfig = model.config
        self.vocab_size = model.config.vocab_size  # the engine checks prompt ids against it
        self.impl = impl
        self.all_logits = all_logits
        self.num_compilations = 0
        self._params = params

        def step(params, tokens, kv, block_tables, kv_lens, q_lens):
            self.num_compilations += 1  # runs at trace time only
            return forward(nnx.merge(graphdef, params), tokens, kv, block_tables, kv_lens, q_lens,
                           impl=impl, all_logits=all_logits)

        self._jitted = jax.jit(step, donate_argnums=(2,))

    def __call__(self, tokens, kv, block_tables, kv_lens, q_lens) -> tuple[jax.Array, KVPool]:
        return self._jitted(self._params, tokens, kv, block_tables, kv_lens, q_lens)

    def lower(self, tokens, kv, block_tables, kv_lens, q_lens):
        """``jax.jit(...).lower`` for inspection (HLO, cost analysis)."""
        return self._jitted.lower(self._params, tokens, kv, block_tables, kv_lens, q_lens)


def make_step_fn(model: Llama, *, impl: str = "auto", all_logits: bool = False) -> StepFn:
    """The engine's step: a jitted ``(tokens, kv, block_tables, kv_lens,
    q_lens) -> (logits f32[B, V], kv)`` with the pool donated; see
    :class:`StepFn`. ``step.num_compilations`` counts traces.

    Raises:
      ValueError: unknown ``impl``.
    """
    return StepFn(model, impl=impl, all_logits=all_logits)
