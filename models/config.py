"""The architecture of a Llama-family decoder (:class:`LlamaConfig`): a frozen
config that checks itself and builds its own KV pool; the decoder is
:mod:`models.llama`.

The family is wider than Llama: the fields after ``sliding_window`` describe
what Llama 3.1, Qwen3, Gemma 2, Gemma 3 and OLMo 2 change (scaled RoPE,
q/k norms, ``1 + w`` norms, norms around the sublayers, GeGLU, embedding
scale, soft caps, a query scale, and layers of two kinds: sliding-window
and global). Every default is Llama's, so a config that sets none of them
is the plain Llama decoder.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models.layers.moe import RouterConfig
from models.layers.rope import RopeScaling
from paged_jax.checks import check_bool, check_choice, check_float, check_instance, check_int
from paged_jax.paging.kv_cache import KVPool, default_kv_dtype, init_kv_pool
from pallas_kernels import common

PARAM_DTYPES = ("float32", "bfloat16", "float16")
"""The weight dtypes the decoders take (``param_dtype`` of the loaders,
``dtype`` of the random presets)."""


def check_param_dtype(value, name: str = "param_dtype") -> None:
    """Raises ValueError, naming the argument ``name``, ``value`` and the
    choices, unless ``value`` is one of :data:`PARAM_DTYPES` (a dtype or its
    name)."""
    try:
        dtype_name = repr(value) if value is None else jnp.dtype(value).name
    except TypeError:
        dtype_name = repr(value)
    check_choice(name, dtype_name, PARAM_DTYPES)

LAYER_TYPES = ("full_attention", "sliding_attention")
"""The kinds of attention layer (Hugging Face's ``layer_types`` names)."""
QK_NORMS = (None, "head", "full")
"""``LlamaConfig.qk_norm``: none; RMSNorm over each head's H dims (Qwen3,
Gemma 3); over the whole projection's ``heads * H`` (OLMo 2)."""
NORM_PLACEMENTS = ("pre", "pre_post", "post")
"""``LlamaConfig.norm_placement``: where a block's RMSNorms sit."""
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
"""``LlamaConfig.mlp_activation``: the gate's activation (SwiGLU / GeGLU)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Architecture of a Llama-family decoder.

    Attributes:
      vocab_size: V, tokens in the vocabulary.
      model_dim: D, width of the residual stream.
      mlp_dim: F, hidden width of the SwiGLU MLP.
      num_layers: decoder blocks.
      num_q_heads: N, query heads.
      num_kv_heads: K, key/value heads; must divide ``num_q_heads`` (GQA).
      head_dim: H, per-head width (need not equal D / N).
      rope_theta: RoPE base frequency.
      rms_norm_eps: epsilon inside RMSNorm's square root.
      tie_embeddings: output projection is the input embedding transposed.
      max_seq_len: the longest context the checkpoint was trained for
        (informational; positions beyond it still compute).
      qkv_bias: the q/k/v projections add a bias (Qwen2); the output
        projection never does.
      sliding_window: if set, a query at position ``p`` attends only to keys
        in ``(p - sliding_window, p]`` (Mistral), in every layer and every
        attention path. Only the attention mask changes: the serving engine
        keeps a sequence's pages outside the window allocated (they are
        read by no one, and freed with the sequence). With ``layer_types``,
        only the layers marked ``"sliding_attention"`` use it.
      rope_scaling: the scaled RoPE of the global layers (of every layer
        when ``local_rope_theta`` is None), or None for plain RoPE
        (:class:`models.layers.rope.RopeScaling`; a dict of its fields is taken
        too, as a checkpoint's JSON gives it back).
      layer_types: per layer, ``"full_attention"`` or
        ``"sliding_attention"``; None: every layer is sliding when
        ``sliding_window`` is set (Mistral), else full. A list is taken and
        stored as a tuple.
      local_rope_theta: RoPE base of the sliding layers, which then take no
        ``rope_scaling`` (Gemma 3's ``rope_local_base_freq``); None: they
        use the global layers' RoPE.
      qk_norm: RMSNorm on queries and keys before RoPE: None, ``"head"``
        (over H, one scale of H per projection: Qwen3, Gemma 3) or
        ``"full"`` (over ``N * H`` / ``K * H``: OLMo 2).
      norm_plus_one: every RMSNorm multiplies by ``1 + w`` instead of ``w``
        (Gemma; the stored ``w`` is then near 0).
      norm_placement: ``"pre"``: ``x + f(norm(x))`` (Llama); ``"pre_post"``:
        ``x + norm2(f(norm1(x)))`` (Gemma 2 / 3, four norms per block);
        ``"post"``: ``x + norm(f(x))`` (OLMo 2).
      mlp_activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU with the
        tanh approximation of GELU, Gemma's ``gelu_pytorch_tanh``).
      embed_scale: the token embeddings are multiplied by this, rounded to
        the embedding's dtype first as transformers does (Gemma:
        ``sqrt(model_dim)``); None: not scaled.
      attn_soft_cap: attention logits become ``c * tanh(logits / c)``
        (Gemma 2); None: no cap.
      final_soft_cap: the output logits become ``c * tanh(logits / c)``
        (Gemma 2, some Gemma 3); None: no cap.
      query_scale: the attention logit scale; None: ``head_dim ** -0.5``
        (Gemma: ``query_pre_attn_scalar ** -0.5``).
      router: None for dense MLPs; else every layer's MLP is a mixture of
        experts routed by it (:class:`models.layers.moe.RouterConfig`,
        Qwen3-MoE: softmax top-k; a dict of its fields is taken too), each
        expert a SwiGLU of ``moe_mlp_dim`` (``mlp_dim`` then unused).
      moe_mlp_dim: I, each routed expert's hidden width (>= 1 with a
        router, 0 without).
      expert_shards: the experts split over this many devices of the
        mesh's ``model`` axis (expert parallelism, :mod:`models.sharded`):
        the module holds ``num_experts / expert_shards`` consecutive
        experts, shard ``jax.lax.axis_index("model")``'s, and its output is
        their share (summed over the axis by the caller). 1 (the default):
        every expert here.

    Raises:
      ValueError: a size that is not a positive int, an odd ``head_dim``
        (RoPE pairs dims), ``num_q_heads`` not a multiple of
        ``num_kv_heads``, a non-positive ``rope_theta`` / ``rms_norm_eps``,
        a non-bool ``qkv_bias``, or a ``sliding_window`` that is neither
        None nor a positive int; a ``layer_types`` that is not one of
        :data:`LAYER_TYPES` per layer, marks sliding layers without a
        ``sliding_window`` or a ``sliding_window`` on no layer; a value
        outside :data:`QK_NORMS`, :data:`NORM_PLACEMENTS` or
        :data:`MLP_ACTIVATIONS`; a soft cap, scale or RoPE base that is not
        a positive number. Each names the field and its value.
    """

    vocab_size: int
    model_dim: int
    mlp_dim: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_seq_len: int = 2048
    qkv_bias: bool = False
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None
    qk_norm: str | None = None
    norm_plus_one: bool = False
    norm_placement: str = "pre"
    mlp_activation: str = "silu"
    embed_scale: float | None = None
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    query_scale: float | None = None
    router: RouterConfig | None = None
    moe_mlp_dim: int = 0
    expert_shards: int = 1

    def __post_init__(self):
        for name in ("vocab_size", "model_dim", "mlp_dim", "num_layers", "num_q_heads",
                     "num_kv_heads", "head_dim", "max_seq_len"):
            check_int(name, getattr(self, name))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                "num_q_heads must be a multiple of num_kv_heads, got "
                f"num_q_heads={self.num_q_heads} num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got head_dim={self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            check_float(name, getattr(self, name), 0, low_open=True)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_bool("qkv_bias", self.qkv_bias)
        if self.sliding_window is not None and not isinstance(self.sliding_window, int):  # static attention option
            raise ValueError(f"sliding_window must be None or an int >= 1, got sliding_window={self.sliding_window!r}")
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window)
        # JSON (a checkpoint's metadata, models.loading.checkpoint) gives back a dict
        # and a list; store the frozen, hashable forms.
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rope_scaling is not None:
            check_instance("rope_scaling", self.rope_scaling, RopeScaling, what="models.layers.rope.RopeScaling")
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._check_layer_types()
        for name in ("local_rope_theta", "embed_scale", "attn_soft_cap", "final_soft_cap", "query_scale"):
            if getattr(self, name) is not None:
                check_float(name, getattr(self, name), 0, low_open=True)
        check_choice("qk_norm", self.qk_norm, QK_NORMS)
        check_bool("norm_plus_one", self.norm_plus_one)
        check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        check_choice("mlp_activation", self.mlp_activation, MLP_ACTIVATIONS)
        if isinstance(self.router, dict):
            object.__setattr__(self, "router", RouterConfig(**self.router))
        if self.router is None:
            if self.moe_mlp_dim != 0:
                raise ValueError(f"moe_mlp_dim is the experts' width: it must be 0 without a router, got "
                                 f"moe_mlp_dim={self.moe_mlp_dim!r}")
        else:
            check_instance("router", self.router, RouterConfig, what="models.layers.moe.RouterConfig or None")
            check_int("moe_mlp_dim", self.moe_mlp_dim)
            if self.mlp_activation != "silu":
                raise ValueError(f"the experts are SwiGLU: mlp_activation must be 'silu' with a router, got "
                                 f"mlp_activation={self.mlp_activation!r}")
        check_int("expert_shards", self.expert_shards)
        if self.expert_shards > 1 and (self.router is None or self.router.num_experts % self.expert_shards):
            raise ValueError(f"expert_shards={self.expert_shards} must divide the experts "
                             f"({self.router.num_experts if self.router else 'none: a dense MLP'})")

    def _check_layer_types(self) -> None:
        types = self.layer_types
        if types is None:
            return
        if not isinstance(types, tuple) or len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types must be None or one of {list(LAYER_TYPES)} per layer "
                             f"({self.num_layers} layers), got layer_types={types!r}")
        sliding = "sliding_attention" in types
        if sliding and self.sliding_window is None:
            raise ValueError(f"layer_types marks sliding layers but sliding_window is None, got "
                             f"layer_types={types!r}")
        if not sliding and self.sliding_window is not None:
            raise ValueError(f"sliding_window={self.sliding_window} is set but layer_types marks no sliding "
                             f"layer, got layer_types={types!r}")

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends within ``sliding_window`` only."""
        if self.layer_types is None:
            return (self.sliding_window is not None,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def mixed_layers(self) -> bool:
        """Whether sliding and global layers are mixed (the decoder then
        picks each layer's attention and RoPE at run time)."""
        return len(set(self.sliding_layers)) > 1

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        """Parameters, the embedding counted once when tied."""
        d, f, h = self.model_dim, self.mlp_dim, self.head_dim
        norms = {"pre": 2, "pre_post": 4, "post": 2}[self.norm_placement]
        mlp = 3 * d * f if self.router is None else self.router.num_experts * (3 * d * self.moe_mlp_dim + d)
        per_layer = norms * d + d * h * (2 * self.num_q_heads + 2 * self.num_kv_heads) + mlp
        if self.qkv_bias:
            per_layer += h * (self.num_q_heads + 2 * self.num_kv_heads)
        if self.qk_norm == "head":
            per_layer += 2 * h
        elif self.qk_norm == "full":
            per_layer += h * (self.num_q_heads + self.num_kv_heads)
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + d

    def kv_bytes_per_token(self, dtype=jnp.float32) -> int:
        """KV-pool bytes one token occupies across all layers (K and V; a
        quantized pool's f32 scales included: int8 and fp8 alike take ``H +
        4`` bytes per token, KV head and K or V)."""
        return 2 * self.num_layers * self.num_kv_heads * common.kv_bytes_per_token(self.head_dim, dtype)

    def make_kv_pool(self, num_pages: int, page_size: int, dtype=None) -> KVPool:
        """A zeroed KV pool shaped for this model: ``[num_layers, K, P, L, H]``.

        Args:
          num_pages: P, pages including the null page (>= 2).
          page_size: L, tokens per page (>= 1).
          dtype: storage dtype of K and V: float32, bfloat16, float16, or a
            quantized int8, float8_e4m3fn (alias ``"fp8"``) or float8_e5m2
            (with per-token scales); default
            :func:`paged_jax.paging.kv_cache.default_kv_dtype` (f32 on CPU, bf16 on
            GPU and TPU).

        Raises:
          ValueError: from :func:`paged_jax.paging.kv_cache.init_kv_pool`.
        """
        return init_kv_pool(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            num_pages=num_pages,
            page_size=page_size,
            head_dim=self.head_dim,
            dtype=default_kv_dtype() if dtype is None else dtype,
        )


SMOLLM2_135M = LlamaConfig(
    vocab_size=49152,
    model_dim=576,
    mlp_dim=1536,
    num_layers=30,
    num_q_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_embeddings=True,
    max_seq_len=8192,
)
"""SmolLM2-135M(-Instruct); the GGUF loader reads the same values from metadata."""
