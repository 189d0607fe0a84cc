"""DeepSeek-V3 at its published shapes, with random weights, for accelerator
runs and for measurements that need the real shapes but not the values.

:data:`PUBLISHED_CONFIGS` holds the architecture fields of
``deepseek-ai/DeepSeek-V3``'s ``config.json`` (its ``quantization_config``,
the FP8 block scales of the released weights, left out: the preset is a
shape), built through :func:`models.deepseek.config.config_from_hf`, the
mapping a real checkpoint's ``config.json`` goes through, so a preset and
the checkpoint cannot drift apart. Counted by
:func:`models.deepseek.model.param_shapes` it has 671,026,419,200
parameters (the technical report's 671 B; the card's 685 B adds the 14 B
multi-token-prediction module, which this decoder does not run).

The full model is 1.34 TB in bf16; :func:`random_deepseek` takes
``num_layers`` (the first ``first_k_dense_replace`` stay dense) for a
machine that holds a few layers, and :func:`narrow` keeps what sets the KV
cache (layers, ``kv_lora_rank``, ``qk_rope_head_dim``) at tiny widths
elsewhere, for counting what a latent pool holds in the engine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.config import check_param_dtype
from models.deepseek.config import DeepseekConfig, config_from_hf
from models.deepseek.model import DeepseekModel, init_params, param_shapes
from models.layers.moe import RouterConfig
from paged_jax.checks import check_instance, check_int

PUBLISHED_CONFIGS: dict[str, dict] = {
    # deepseek-ai/DeepSeek-V3 config.json, architecture fields.
    "deepseek-v3": {
        "model_type": "deepseek_v3", "attention_bias": False, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
    },
}
"""Published ``config.json`` values (fields that do not shape the decoder,
such as token ids, left out)."""

PRESETS: dict[str, DeepseekConfig] = {
    name: config_from_hf(cfg, f"{name} preset") for name, cfg in PUBLISHED_CONFIGS.items()}
"""Architecture presets by name."""


def get_preset(name: str) -> DeepseekConfig:
    """The preset called ``name``.

    Raises:
      ValueError: an unknown name; the message lists the presets.
    """
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"unknown DeepSeek preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]


def _config(config) -> DeepseekConfig:
    """``config`` itself, or the preset it names.

    Raises:
      ValueError: an unknown preset name, or neither a name nor a
        :class:`DeepseekConfig`.
    """
    if isinstance(config, str):
        return get_preset(config)
    return check_instance("config", config, DeepseekConfig,
                          what="models.deepseek.config.DeepseekConfig or a preset name")


def num_params(config: DeepseekConfig) -> int:
    """Weights the decoder holds at ``config``'s shapes (:func:`param_shapes`)."""
    config = _config(config)
    return sum(int(np.prod(s)) for s in jax.tree.leaves(param_shapes(config), is_leaf=lambda s: isinstance(s, tuple)))


def with_layers(config: DeepseekConfig, num_layers: int) -> DeepseekConfig:
    """``config`` cut to its first ``num_layers`` layers (the dense ones
    first, as many as it has up to ``num_layers``).

    Raises:
      ValueError: ``config`` neither a :class:`DeepseekConfig` nor a preset
        name; ``num_layers`` not an int in [1, config.num_layers].
    """
    config = _config(config)
    check_int("num_layers", num_layers, 1, config.num_layers + 1)
    return dataclasses.replace(config, num_layers=num_layers)


def narrow(config: DeepseekConfig, *, model_dim: int = 64, num_heads: int = 2, head_dim: int = 16,
           mlp_dim: int = 64, num_experts: int = 8) -> DeepseekConfig:
    """``config`` at tiny widths with what sets its KV cache kept: the
    layers, ``kv_lora_rank`` and ``qk_rope_head_dim`` (a token's latent,
    C + R values a layer), the dense and MoE layer pattern; the model
    width, heads, the non-RoPE and value head dims, the query LoRA (dropped),
    the MLP widths, the experts (``num_experts``, top-2 in one group) and the
    vocabulary (256) shrink. Bytes a token's KV takes are ``config``'s.

    Raises:
      ValueError: ``config`` neither a :class:`DeepseekConfig` nor a preset
        name; a width that is not an int >= 1 (``num_experts`` >= 2).
    """
    config = _config(config)
    for name, value in (("model_dim", model_dim), ("num_heads", num_heads), ("head_dim", head_dim),
                        ("mlp_dim", mlp_dim)):
        check_int(name, value, 1)
    check_int("num_experts", num_experts, 2)
    router = None if config.router is None else RouterConfig(
        num_experts=num_experts, top_k=2, scoring=config.router.scoring, norm_topk_prob=config.router.norm_topk_prob,
        routed_scaling_factor=config.router.routed_scaling_factor)
    return dataclasses.replace(
        config, vocab_size=256, model_dim=model_dim, num_heads=num_heads, q_lora_rank=None, qk_nope_head_dim=head_dim,
        v_head_dim=head_dim, mlp_dim=mlp_dim, router=router, moe_mlp_dim=mlp_dim if router is not None else 0)


def random_deepseek(config: DeepseekConfig | str, *, num_layers: int | None = None, dtype=jnp.bfloat16,
                    seed: int = 0, impl: str = "auto") -> DeepseekModel:
    """A :class:`models.deepseek.model.DeepseekModel` of ``config`` (or the
    preset of that name) with random weights (:func:`init_params`), cut to
    ``num_layers`` when given. Memory: :func:`num_params` times ``dtype``'s
    itemsize (DeepSeek-V3 in bf16: 1.34 TB; about 23 GB a MoE layer).

    Raises:
      ValueError: an unknown preset or a ``config`` that is not one, a bad
        ``num_layers`` or ``seed``, a ``dtype`` other than float32,
        bfloat16 or float16, an unknown ``impl``.
    """
    config = _config(config)
    if num_layers is not None:
        config = with_layers(config, num_layers)
    check_int("seed", seed, 0)
    check_param_dtype(dtype, "dtype")
    return DeepseekModel(config, init_params(config, jax.random.key(seed), dtype), impl=impl)
