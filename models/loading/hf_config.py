"""A Hugging Face ``config.json`` -> :class:`models.config.LlamaConfig`, family
by family, computing what transformers' own modeling code computes or
refusing by name.

Supported ``model_type`` values::

  llama        Llama 2 / 3 / 3.1 / 3.2 / 3.3 (``rope_type`` ``llama3``), SmolLM2,
               TinyLlama, ...
  mistral      a sliding window on every layer
  qwen2        Qwen2 / Qwen2.5: q/k/v biases; a window only on every layer
  qwen3        Qwen3 (dense): RMSNorm on each query and key head before RoPE;
               sliding layers where ``layer_types`` (or ``max_window_layers``)
               puts them
  qwen3_moe    Qwen3-MoE: Qwen3's attention, every MLP a mixture of experts
               (softmax top-k, ``norm_topk_prob``; ``decoder_sparse_step`` 1,
               no ``mlp_only_layers``)
  gemma2       GeGLU, ``sqrt(D)``-scaled embedding, ``1 + w`` norms before and
               after attention and MLP, attention and final logit soft caps,
               ``query_pre_attn_scalar``, sliding and global layers alternating
  gemma3_text  Gemma 2's block with q/k norms, a local RoPE base for sliding
               layers, five sliding layers to one global; no attention soft cap
               (transformers ignores ``attn_logit_softcapping`` there too)
  olmo2        norms after attention and MLP only; q/k RMSNorm over the whole
               projection

RoPE: ``rope_parameters`` (transformers 5; per layer type for Gemma 3) or
``rope_theta`` / ``rope_scaling`` (older; ``rope_scaling`` wins when both are
there, as in transformers 5); rope types ``default``, ``linear``, ``llama3``
and ``yarn`` (:mod:`models.layers.rope`). Defaults for absent fields are the
family's transformers defaults (Gemma 2's soft caps 50 / 30, window 4096,
``query_pre_attn_scalar`` 256; Gemma 3's RoPE bases 1e6 global / 1e4 local).

Refused, each with a ``ValueError`` naming the file, the field and its value:
other model types (``qwen2_moe``, ``mixtral`` and ``gemma3``, the
multimodal wrapper, by name); mixture-of-experts fields on any other type;
rope types ``dynamic``, ``longrope`` and any other; partial rotary
embeddings; an activation other than the family's (SiLU; Gemma's
``gelu_pytorch_tanh``); MLP biases; ``attention_bias`` (it adds an
``o_proj`` bias the decoder lacks); quantized weights; a ``layer_types``
that is not one known type per layer, or marks sliding layers without a
window; Gemma 3's bidirectional attention; a Qwen2 window on some layers
only.
"""

from __future__ import annotations

from typing import Any

from models.config import LAYER_TYPES, LlamaConfig
from models.layers.moe import RouterConfig
from models.layers.rope import RopeScaling, yarn_attention_factor
from paged_jax.checks import is_float, is_int

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "olmo2")
REFUSED_MODEL_TYPES = {
    "qwen2_moe": "Qwen2-MoE is a mixture of experts, which the decoder does not compute",
    "mixtral": "Mixtral is a mixture of experts, which the decoder does not compute",
    "gemma3": "this is the multimodal Gemma 3 config (text_config inside); only text-only checkpoints "
              "(model_type 'gemma3_text') are supported",
}
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
"""Fields whose presence (not null or 0) marks a mixture-of-experts config."""
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

CONFIG = "config.json"
MISSING = object()
_GEMMA = ("gemma2", "gemma3_text")


class Fields:
    """Typed reads of a config object, each error naming the file and field."""

    def __init__(self, cfg: dict[str, Any], path: str):
        self.cfg, self.path = cfg, path

    def bad(self, name, value, why) -> ValueError:
        return ValueError(f"{self.path}: field {name!r} is {value!r}; {why}")

    def get(self, name, default=MISSING):
        if name not in self.cfg:
            if default is MISSING:
                raise ValueError(f"{self.path}: field {name!r} is missing")
            return default
        return self.cfg[name]

    def integer(self, name, default=MISSING, low=1):
        value = self.get(name, default)
        if not is_int(value, low):
            raise self.bad(name, value, f"expected an int >= {low}")
        return value

    def number(self, name, value):
        if not is_float(value, 0, low_open=True):
            raise self.bad(name, value, "expected a finite number > 0")
        return float(value)

    def optional_number(self, name, default):
        value = self.get(name, default)
        return None if value is None else self.number(name, value)

    def flag(self, name, default):
        value = self.get(name, default)
        if value is None:  # transformers configs write some unset flags as null
            return False
        if not isinstance(value, bool):
            raise self.bad(name, value, "expected true or false")
        return value


def config_from_hf(cfg: dict[str, Any], path: str = CONFIG) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face ``config.json`` (parsed).

    Args:
      cfg: the JSON object.
      path: the file, for error messages.

    Raises:
      ValueError: an unsupported ``model_type``, a missing or mistyped
        field, or a feature the decoder cannot compute exactly (see the
        module docstring); names ``path``, the field and its value.
    """
    f = Fields(cfg, path)
    model_type = f.get("model_type")
    if model_type in REFUSED_MODEL_TYPES:
        raise f.bad("model_type", model_type, REFUSED_MODEL_TYPES[model_type])
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise f.bad("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if f.get("quantization_config", None) is not None:
        raise f.bad("quantization_config", cfg["quantization_config"],
                    "quantized checkpoints are not supported (BF16 / F16 / F32 weights only)")
    if model_type == "qwen3_moe":
        moe = _qwen3_moe(f)
    else:
        moe = {}
        for name in MOE_FIELDS:
            if f.get(name, None) not in (None, 0):
                raise f.bad(name, cfg[name], f"mixture-of-experts fields are not supported for {model_type} "
                                             "(dense MLPs only; qwen3_moe and deepseek_v3 / v2 have experts)")
    gemma = model_type in _GEMMA
    if gemma:  # Gemma's modeling code reads hidden_activation and ignores hidden_act
        act = f.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise f.bad("hidden_activation", act, "Gemma's MLP is GeGLU: only 'gelu_pytorch_tanh' is supported")
    else:
        act = f.get("hidden_act", "silu")
        if act != "silu":
            raise f.bad("hidden_act", act, "the decoder's MLP is SwiGLU: only 'silu' is supported")
    if f.flag("mlp_bias", False):
        raise f.bad("mlp_bias", True, "the decoder's MLP has no biases")
    if model_type not in ("mistral", "qwen2") and f.flag("attention_bias", False):
        raise f.bad("attention_bias", True, f"{model_type}'s attention_bias adds an o_proj bias, which the "
                                            "decoder lacks")
    if model_type == "gemma3_text" and f.flag("use_bidirectional_attention", False):
        raise f.bad("use_bidirectional_attention", True, "only causal attention is supported")

    heads = f.integer("num_attention_heads")
    kv_heads = f.integer("num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads
    model_dim = f.integer("hidden_size")
    layers = f.integer("num_hidden_layers")
    if cfg.get("head_dim") is not None:
        head_dim = f.integer("head_dim")
    elif model_dim % heads:
        raise f.bad("hidden_size", model_dim, f"without head_dim it must be a multiple of num_attention_heads={heads}")
    else:
        head_dim = model_dim // heads
    max_pos = f.integer("max_position_embeddings", 2048)

    window, types = _layer_pattern(f, model_type, layers)
    theta, scaling, local_theta = read_rope(f, model_type, max_pos)
    fields = dict(
        vocab_size=f.integer("vocab_size"),
        model_dim=model_dim,
        mlp_dim=f.integer("intermediate_size"),
        num_layers=layers,
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=f.number("rms_norm_eps", f.get("rms_norm_eps", 1e-5 if model_type == "olmo2" else 1e-6)),
        tie_embeddings=f.flag("tie_word_embeddings", gemma),
        max_seq_len=max_pos,
        qkv_bias=model_type == "qwen2",
        sliding_window=window,
        layer_types=types,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        qk_norm={"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmo2": "full"}.get(model_type),
        norm_plus_one=gemma,
        norm_placement="pre_post" if gemma else "post" if model_type == "olmo2" else "pre",
        mlp_activation="gelu_tanh" if gemma else "silu",
        **moe,
    )
    if gemma:
        # transformers multiplies by hidden_size ** 0.5, rounded to the weights' dtype at run time.
        fields.update(
            embed_scale=model_dim ** 0.5,
            attn_soft_cap=f.optional_number("attn_logit_softcapping", 50.0) if model_type == "gemma2" else None,
            final_soft_cap=f.optional_number("final_logit_softcapping", 30.0 if model_type == "gemma2" else None),
            query_scale=f.number("query_pre_attn_scalar", f.get("query_pre_attn_scalar", 256)) ** -0.5,
        )
    try:
        return LlamaConfig(**fields)
    except ValueError as e:  # e.g. heads not a multiple of KV heads
        raise ValueError(f"{path}: the fields do not make a valid decoder: {e}") from e


def _qwen3_moe(f: Fields) -> dict:
    """Qwen3-MoE's experts as :class:`LlamaConfig` fields (transformers'
    ``Qwen3MoeSparseMoeBlock``: softmax over the router's logits, top
    ``num_experts_per_tok``, renormalized with ``norm_topk_prob``), every
    layer sparse: ``decoder_sparse_step`` 1 and no ``mlp_only_layers``
    (the layer scan runs one kind of block; other patterns are refused)."""
    step = f.integer("decoder_sparse_step", 1)
    if step != 1:
        raise f.bad("decoder_sparse_step", step, "only every layer sparse (1) is supported")
    dense_layers = f.get("mlp_only_layers", None) or []
    if dense_layers:
        raise f.bad("mlp_only_layers", dense_layers, "dense layers among the sparse ones are not supported")
    try:
        # The Hub's configs say num_experts; transformers 5 writes its attribute map's num_local_experts.
        experts = f.integer("num_experts" if "num_experts" in f.cfg or "num_local_experts" not in f.cfg
                            else "num_local_experts")
        router = RouterConfig(num_experts=experts, top_k=f.integer("num_experts_per_tok"),
                              scoring="softmax", norm_topk_prob=f.flag("norm_topk_prob", False))
    except ValueError as e:
        if str(e).startswith(f.path):
            raise
        raise ValueError(f"{f.path}: the routing fields do not make a valid router: {e}") from e
    return dict(router=router, moe_mlp_dim=f.integer("moe_intermediate_size"))


def _layer_pattern(f: Fields, model_type: str, layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` for :class:`LlamaConfig`: the window
    and, where layers differ, each layer's type (transformers' rules for
    configs that give no ``layer_types``)."""
    if model_type in ("llama", "olmo2"):
        return None, None
    if model_type == "mistral":
        return (f.integer("sliding_window") if f.get("sliding_window", None) is not None else None), None
    if model_type == "qwen3_moe":  # transformers' Qwen3MoeConfig: the window on every layer, or none
        on = f.flag("use_sliding_window", False) and f.get("sliding_window", None) is not None
        return (f.integer("sliding_window") if on else None), None
    if model_type in _GEMMA:
        if f.get("sliding_window", 4096) is None:
            raise f.bad("sliding_window", None, f"{model_type} needs a window for its sliding layers")
        window = f.integer("sliding_window", 4096)
        if model_type == "gemma2":
            period = 2
        else:  # transformers 5 reads sliding_window_pattern; older exports wrote it, newer ones layer_types
            period = f.integer("sliding_window_pattern", 6)
        default = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
        types = _checked_types(f, layers, f.get("layer_types", None) or default)
    else:  # qwen2, qwen3: a window only with use_sliding_window, on the layers from max_window_layers on
        window = None
        if f.flag("use_sliding_window", False) and f.get("sliding_window", None) is not None:
            window = f.integer("sliding_window")
        types = f.get("layer_types", None)
        if types is None:
            first = f.integer("max_window_layers", 28, low=0) if window is not None else layers
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        types = _checked_types(f, layers, types)
        if window is None and "sliding_attention" in types:
            raise f.bad("layer_types", f.cfg["layer_types"], "marks sliding layers, but use_sliding_window / "
                        "sliding_window give no window")
        if model_type == "qwen2" and window is not None and len(set(types)) > 1:
            raise f.bad("layer_types" if "layer_types" in f.cfg else "max_window_layers",
                        f.cfg.get("layer_types", f.cfg.get("max_window_layers")),
                        "a sliding window on some layers only is not supported for qwen2")
    if "sliding_attention" not in types:
        return None, None  # a window no layer uses
    return window, (None if set(types) == {"sliding_attention"} else types)


def _checked_types(f: Fields, layers: int, types) -> tuple[str, ...]:
    if not isinstance(types, list) or len(types) != layers:
        raise f.bad("layer_types", types, f"expected a list of {layers} layer types")
    unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if unknown:
        raise f.bad("layer_types", types, f"unknown layer types {unknown}; expected 'full_attention' or "
                    "'sliding_attention'")
    return tuple(types)


def read_rope(f: Fields, model_type: str, max_pos: int) -> tuple[float, RopeScaling | None, float | None]:
    """``(rope_theta, rope_scaling, local_rope_theta)`` as transformers 5
    reads them: ``rope_scaling`` if set, else ``rope_parameters``; the base
    from the dict, else the top-level ``rope_theta``."""
    name = "rope_scaling" if f.get("rope_scaling", None) is not None else "rope_parameters"
    rope = f.get(name, None) or {}
    if not isinstance(rope, dict):
        raise f.bad(name, rope, "expected an object or null")
    if f.get("partial_rotary_factor", None) not in (None, 1.0):
        raise f.bad("partial_rotary_factor", f.cfg["partial_rotary_factor"], "partial rotary embeddings are "
                    "not supported")
    nested = set(rope) & set(LAYER_TYPES)
    if model_type != "gemma3_text":
        if nested:
            raise f.bad(name, rope, f"per-layer-type RoPE parameters are not expected for {model_type}")
        top = f.get("rope_theta", None)
        theta, scaling = rope_kind(f, name, rope, 10000.0 if top is None else top, max_pos)
        return theta, scaling, None
    # Gemma 3: global layers take rope_scaling / rope_parameters["full_attention"]
    # (base rope_theta, default 1e6), sliding layers rope_parameters["sliding_attention"]
    # (base rope_local_base_freq, default 1e4), as Gemma3TextConfig.convert_rope_params_to_dict.
    params = f.get("rope_parameters", None) or {}
    if not isinstance(params, dict) or set(params) - set(LAYER_TYPES):
        raise f.bad("rope_parameters", params, "gemma3_text expects RoPE parameters per layer type "
                    f"({', '.join(LAYER_TYPES)})")
    full = dict(params.get("full_attention") or {})
    if name == "rope_scaling":
        full.update(f.cfg["rope_scaling"])
    top, top_local = f.get("rope_theta", None), f.get("rope_local_base_freq", None)
    theta, scaling = rope_kind(f, name, full, 1e6 if top is None else top, max_pos)
    local = params.get("sliding_attention") or {}
    local_theta, local_scaling = rope_kind(f, "rope_parameters", local, 1e4 if top_local is None else top_local,
                                            max_pos)
    if local_scaling is not None:
        raise f.bad("rope_parameters", params, "scaled RoPE on the sliding layers is not supported")
    return theta, scaling, local_theta


def rope_kind(f: Fields, name: str, rope: dict, theta_default, max_pos: int) -> tuple[float, RopeScaling | None]:
    """One RoPE dict -> ``(theta, RopeScaling or None)``, with transformers'
    defaults (``_compute_*_parameters``, ``standardize_rope_params``)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise f.bad(name, rope, f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)}; "
                    "'dynamic' and 'longrope' change with the sequence length or need per-dim factors)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise f.bad(name, rope, "partial rotary embeddings are not supported")
    theta = f.number("rope_theta", rope.get("rope_theta", theta_default))
    if kind == "default":
        return theta, None

    def num(key, default=MISSING):
        value = rope.get(key, default)
        if value is MISSING:
            raise f.bad(name, rope, f"rope type {kind!r} needs {key!r}")
        if not is_float(value, 0, low_open=True):
            raise f.bad(name, rope, f"{key!r} must be a finite number > 0, got {value!r}")
        return float(value)

    if kind == "linear":
        return theta, RopeScaling(rope_type="linear", factor=num("factor"))
    # A top-level original_max_position_embeddings wins (transformers' standardize_rope_params).
    original = f.cfg.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", max_pos))
    if not is_int(original, 1):
        raise f.bad(name, rope, f"'original_max_position_embeddings' must be an int >= 1, got {original!r}")
    try:
        if kind == "llama3":
            return theta, RopeScaling(rope_type="llama3", factor=num("factor"), original_max_position_embeddings=original,
                                      low_freq_factor=num("low_freq_factor"), high_freq_factor=num("high_freq_factor"))
        if "factor" not in rope:  # transformers refuses it too (a KeyError); factor None is its ratio below
            raise f.bad(name, rope, f"rope type {kind!r} needs 'factor'")
        factor = num("factor") if rope["factor"] is not None else max_pos / original
        for key in ("mscale", "mscale_all_dim", "beta_fast", "beta_slow"):  # numbers where given (0: off)
            if rope.get(key) is not None and not is_float(rope[key], 0):
                raise f.bad(name, rope, f"{key!r} must be a finite number >= 0, got {rope[key]!r}")
        attention = rope.get("attention_factor")
        if attention is None:
            attention = yarn_attention_factor(factor, rope.get("mscale"), rope.get("mscale_all_dim"))
        truncate = rope.get("truncate", True)
        if not isinstance(truncate, bool):
            raise f.bad(name, rope, f"'truncate' must be true or false, got {truncate!r}")
        return theta, RopeScaling(rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                                  beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                                  truncate=truncate, attention_factor=float(attention))
    except (ValueError, TypeError) as e:
        if isinstance(e, ValueError) and str(e).startswith(f.path):
            raise
        raise f.bad(name, rope, f"not a valid {kind!r} RoPE: {e}") from e
