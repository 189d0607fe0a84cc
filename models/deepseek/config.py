"""The DeepSeek-V3 architecture's shape (Kimi K2 shares it; DeepSeek-V2 and
V2-Lite are the same decoder with softmax routing): multi-head
latent attention (MLA) with an optional query LoRA, the first
``first_k_dense_replace`` layers dense, the others mixture-of-experts with
shared experts, YaRN RoPE with its mscale (DeepSeek-AI, "DeepSeek-V3
Technical Report", 2024, sections 2.1.1-2.1.2; the attention is
DeepSeek-V2's, 2024, section 2.1).

:func:`config_from_hf` reads a Hugging Face ``config.json`` of
``model_type`` ``"deepseek_v3"``, ``"kimi_k2"`` (Kimi K2's, whose
``architectures`` is ``DeepseekV3ForCausalLM``: read as DeepSeek-V3) or
``"deepseek_v2"``
with :mod:`models.loading.hf_config`'s typed fields and RoPE reader, so a
field that is missing, mistyped or asks for what the decoder cannot
compute is refused by name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from models.layers.moe import RouterConfig
from models.layers.rope import RopeScaling
from models.loading.hf_config import CONFIG, Fields, read_rope
from paged_jax.checks import check_bool, check_float, check_instance, check_int
from pallas_kernels import common

MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v2")
"""The ``config.json`` model types :func:`config_from_hf` reads."""


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude factor ``0.1 * mscale * ln(factor) + 1`` (1 for
    ``factor <= 1``): DeepSeek multiplies the attention's softmax scale by
    its square with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``,
    DeepSeek-V3's reference ``softmax_scale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekConfig:
    """A DeepSeek-V3-architecture decoder.

    Attributes:
      vocab_size, model_dim (D), num_layers: as the Llama decoder's.
      num_heads: N, query heads (MLA has no KV heads: every head attends
        the one latent per token).
      q_lora_rank: the query's low-rank bottleneck (1536 in DeepSeek-V3),
        or None for a full query projection (DeepSeek-V2-Lite).
      kv_lora_rank: C, the compressed K/V a token caches (512).
      qk_nope_head_dim: H, each head's query/key dims without RoPE (128).
      qk_rope_head_dim: R, the RoPE part, one key for all heads (64).
      v_head_dim: O, each head's value dims (128).
      mlp_dim: the dense layers' SwiGLU width (``intermediate_size``).
      router: the MoE layers' routing (:class:`models.layers.moe.RouterConfig`),
        or None for a model of dense layers only.
      moe_mlp_dim: each routed expert's SwiGLU width
        (``moe_intermediate_size``).
      num_shared_experts: experts every token runs (one SwiGLU of
        ``num_shared_experts * moe_mlp_dim``), 0 for none.
      first_k_dense_replace: layers before the first MoE layer (all dense
        when it is >= ``num_layers``).
      rope_theta, rope_scaling: RoPE of the ``qk_rope_head_dim`` dims
        (YaRN in DeepSeek-V3, its cos and sin times
        ``rope_scaling.attention_factor``).
      mscale_all_dim: YaRN's ``mscale_all_dim``: the softmax scale is
        ``(H + R) ** -0.5 * yarn_mscale(factor, mscale_all_dim) ** 2``
        (0: unscaled).
      rms_norm_eps: every RMSNorm's epsilon.
      tie_embeddings: the output projection is the embedding.
      max_seq_len: ``max_position_embeddings``, tokens.

    Raises:
      ValueError: a field out of range, named with its value.
    """

    vocab_size: int
    model_dim: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mlp_dim: int
    router: RouterConfig | None = None
    moe_mlp_dim: int = 0
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    mscale_all_dim: float = 0.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int = 4096

    def __post_init__(self):
        for name in ("vocab_size", "model_dim", "num_layers", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "v_head_dim", "mlp_dim", "max_seq_len"):
            check_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            check_int("q_lora_rank", self.q_lora_rank)
        check_int("qk_rope_head_dim", self.qk_rope_head_dim)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.router is not None:
            check_instance("router", self.router, RouterConfig, what="models.layers.moe.RouterConfig or None")
        check_int("first_k_dense_replace", self.first_k_dense_replace, 0)
        check_int("num_shared_experts", self.num_shared_experts, 0)
        if self.router is not None:
            check_int("moe_mlp_dim", self.moe_mlp_dim)
        if self.rope_scaling is not None:
            check_instance("rope_scaling", self.rope_scaling, RopeScaling,
                           what="models.layers.rope.RopeScaling or None")
        check_float("rope_theta", self.rope_theta, 0, low_open=True)
        check_float("mscale_all_dim", self.mscale_all_dim, 0)
        check_float("rms_norm_eps", self.rms_norm_eps, 0, low_open=True)
        check_bool("tie_embeddings", self.tie_embeddings)

    @property
    def latent_dim(self) -> int:
        """C + R: the values one token caches per layer (576 in DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense MLP: the first ``first_k_dense_replace``, or
        every layer of a model without a router."""
        return self.num_layers if self.router is None else min(self.first_k_dense_replace, self.num_layers)

    def kv_bytes_per_token(self, dtype="float32") -> int:
        """Latent-pool bytes one token occupies across all layers: one
        latent of C + R values a layer (no V), plus a quantized pool's f32
        scale (``paged_jax.paging.kv_cache.init_latent_pool``). The
        counterpart of ``LlamaConfig.kv_bytes_per_token``."""
        return self.num_layers * common.kv_bytes_per_token(self.latent_dim, dtype)

    @property
    def query_scale(self) -> float:
        """The attention's softmax scale (:attr:`mscale_all_dim`)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "yarn" and self.mscale_all_dim:
            scale *= yarn_mscale(self.rope_scaling.factor, self.mscale_all_dim) ** 2
        return scale


def config_from_hf(cfg: dict[str, Any], path: str = CONFIG) -> DeepseekConfig:
    """The :class:`DeepseekConfig` of a Hugging Face ``config.json`` (parsed)
    of ``model_type`` ``"deepseek_v3"`` (or ``"kimi_k2"``, the same
    architecture) or ``"deepseek_v2"``, with
    transformers' defaults. DeepSeek-V2 routes with softmax scores,
    ``topk_method`` ``"greedy"`` (no groups) or ``"group_limited_greedy"``,
    weights not normalized (transformers' ``DeepseekV2TopkRouter``).

    Raises:
      ValueError: another ``model_type``; a missing or mistyped field; a
        feature the decoder does not compute (``hidden_act`` other than
        ``silu``, ``attention_bias``, a quantized checkpoint; for V3 a
        ``topk_method`` other than ``noaux_tc`` or ``scoring_func`` other
        than ``sigmoid``; for V2 one other than ``greedy`` /
        ``group_limited_greedy`` or ``softmax``, or ``norm_topk_prob``);
        names ``path``, the field and its value.
    """
    f = Fields(cfg, path)
    model_type = f.get("model_type")
    if model_type not in MODEL_TYPES:
        raise f.bad("model_type", model_type, f"expected one of {', '.join(MODEL_TYPES)}")
    if f.get("quantization_config", None) is not None:
        raise f.bad("quantization_config", cfg["quantization_config"],
                    "quantized checkpoints are not supported (BF16 / F16 / F32 weights only)")
    if f.get("hidden_act", "silu") != "silu":
        raise f.bad("hidden_act", cfg["hidden_act"], "the MLPs are SwiGLU: only 'silu' is supported")
    if f.flag("attention_bias", False):
        raise f.bad("attention_bias", True, "MLA's projections have no biases here")
    v2 = model_type == "deepseek_v2"
    if v2:
        # transformers' DeepseekV2TopkRouter: softmax scores, "greedy" top-k or "group_limited_greedy" (groups
        # scored by their best expert), weights never normalized, times routed_scaling_factor.
        topk_method = f.get("topk_method", "greedy")
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise f.bad("topk_method", topk_method, "DeepSeek-V2 routes by 'greedy' or 'group_limited_greedy'")
        if f.get("scoring_func", "softmax") != "softmax":
            raise f.bad("scoring_func", cfg["scoring_func"], "DeepSeek-V2 scores experts by 'softmax'")
        if f.flag("norm_topk_prob", False):
            raise f.bad("norm_topk_prob", True, "transformers' DeepSeek-V2 never normalizes the chosen weights; "
                                                "a checkpoint that asks to is not supported")
    else:
        topk_method = f.get("topk_method", "noaux_tc")
        if topk_method != "noaux_tc":
            raise f.bad("topk_method", cfg["topk_method"], "DeepSeek-V3 routes by 'noaux_tc' (group-limited top-k "
                                                           "with the correction bias)")
        if f.get("scoring_func", "sigmoid") != "sigmoid":
            raise f.bad("scoring_func", cfg["scoring_func"], "DeepSeek-V3 scores experts by 'sigmoid'")
    layers = f.integer("num_hidden_layers")
    max_pos = f.integer("max_position_embeddings", 4096)
    theta, scaling, _ = read_rope(f, model_type, max_pos)
    rope = f.get("rope_scaling", None) or f.get("rope_parameters", None) or {}
    mscale_all = rope.get("mscale_all_dim", 0) or 0
    if not isinstance(mscale_all, (int, float)) or isinstance(mscale_all, bool) or not math.isfinite(mscale_all) \
            or mscale_all < 0:
        raise f.bad("rope_parameters", rope, f"'mscale_all_dim' must be a number >= 0, got {mscale_all!r}")
    experts = f.integer("n_routed_experts", 0, low=0)
    first_dense = f.integer("first_k_dense_replace", 0, low=0)
    router = None
    if experts and first_dense < layers:
        try:
            grouped = topk_method != "greedy"
            router = RouterConfig(num_experts=experts, top_k=f.integer("num_experts_per_tok"),
                                  scoring="softmax" if v2 else "sigmoid",
                                  n_group=f.integer("n_group", 1) if grouped else 1,
                                  topk_group=f.integer("topk_group", 1) if grouped else 1,
                                  norm_topk_prob=False if v2 else f.flag("norm_topk_prob", True),
                                  routed_scaling_factor=f.number("routed_scaling_factor",
                                                                 f.get("routed_scaling_factor", 1.0)))
        except ValueError as e:
            if str(e).startswith(path):
                raise
            raise ValueError(f"{path}: the routing fields do not make a valid router: {e}") from e
    q_lora = cfg.get("q_lora_rank")
    try:
        return DeepseekConfig(
            vocab_size=f.integer("vocab_size"), model_dim=f.integer("hidden_size"), num_layers=layers,
            num_heads=f.integer("num_attention_heads"),
            q_lora_rank=None if q_lora is None else f.integer("q_lora_rank"),
            kv_lora_rank=f.integer("kv_lora_rank"), qk_nope_head_dim=f.integer("qk_nope_head_dim"),
            qk_rope_head_dim=f.integer("qk_rope_head_dim"), v_head_dim=f.integer("v_head_dim"),
            mlp_dim=f.integer("intermediate_size"), router=router,
            moe_mlp_dim=f.integer("moe_intermediate_size") if router is not None else 0,
            num_shared_experts=f.integer("n_shared_experts", 0, low=0) if router is not None else 0,
            first_k_dense_replace=first_dense, rope_theta=theta, rope_scaling=scaling,
            mscale_all_dim=float(mscale_all), rms_norm_eps=f.number("rms_norm_eps", f.get("rms_norm_eps", 1e-6)),
            tie_embeddings=f.flag("tie_word_embeddings", False), max_seq_len=max_pos)
    except ValueError as e:
        if str(e).startswith(path):
            raise
        raise ValueError(f"{path}: the fields do not make a valid decoder: {e}") from e


def rope_interleaved(cfg: dict[str, Any], path: str = CONFIG) -> bool:
    """Whether the checkpoint's RoPE dims come in interleaved pairs
    ``(x0, x1), (x2, x3), ...`` (``rope_interleave``, transformers' default
    True for DeepSeek-V3; always for DeepSeek-V2, whose rotation multiplies
    the pairs as complex numbers); the loader then reorders those weights so
    the decoder rotates halves, as for every other model here."""
    if cfg.get("model_type") == "deepseek_v2":
        return True
    return Fields(cfg, path).flag("rope_interleave", True)
