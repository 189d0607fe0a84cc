"""What a GGUF file of each supported architecture means, in the terms of a
Hugging Face ``config.json`` and of our decoder's parameters.

A GGUF is what llama.cpp's converter (``convert_hf_to_gguf.py``, now the
``conversion/`` package of ggml-org/llama.cpp) wrote from a Hugging Face
checkpoint. :func:`hf_config_fields` turns its metadata back into the
``config.json`` fields the converter read, so that
:func:`models.loading.hf_config.config_from_hf` applies each family's rules (and
refusals) exactly as for the Hugging Face folder; :func:`layer_tensors`
names the GGUF tensors of each block and where they go. The converter's own
changes to the weights are undone by :func:`models.loading.gguf_loader.load_gguf`:

  architecture   model_type     RoPE pairs (llama.cpp)        weights changed by the converter
  llama,mistral  llama          adjacent (LLAMA_ROPE_TYPE_NORM) attn_q / attn_k rows permuted
  qwen3          qwen3          halves (LLAMA_ROPE_TYPE_NEOX)   none
  qwen3moe       qwen3_moe      halves (NEOX)                   experts stacked: ``ffn_{gate,up,down}_exps``
  gemma2         gemma2         halves (NEOX)                   every ``*norm.weight`` + 1
  gemma3         gemma3_text    halves (NEOX)                   every ``*norm.weight`` + 1 (q/k norms too)
  olmo2          olmo2          halves (NEOX)                   none

Sources: ``llama_model_rope_type`` in llama.cpp's ``src/llama-model.cpp``
(LLAMA is NORM; QWEN3, GEMMA2, GEMMA3, OLMO2 are NEOX, the Hugging Face
``rotate_half`` pairing, so only ``LlamaModel`` permutes: its ``permute``
in ``conversion/llama.py``); ``Gemma2Model`` / ``Gemma3Model.norm_shift``
in ``conversion/gemma.py`` (``data_torch + 1`` for names ending in
``norm.weight``, because Gemma's RMSNorm multiplies by ``1 + w``);
transformers' GGUF reader undoes the same two (``LlamaTensorProcessor``,
``Gemma2TensorProcessor``).

Metadata that the converter does not write, and llama.cpp fixes per
architecture instead (``llama_load_hparams`` for GEMMA2 / GEMMA3), is fixed
the same way here:

- Gemma 2 layers alternate sliding, global (``set_swa_pattern(2)``); Gemma 3
  has five sliding layers to one global (``set_swa_pattern(6)``); a Gemma 3
  without ``attention.sliding_window`` has only global layers.
- Gemma's query scale: ``(n_embd / n_head) ** -0.5`` (integer division) for
  the 27B models (Gemma 2: 46 layers, Gemma 3: 62), else ``head_dim ** -0.5``
  (``f_attention_scale``). A checkpoint whose ``query_pre_attn_scalar`` is
  neither cannot be described by a GGUF.
- Gemma 2's soft caps default to 50 and 30 (``llama_hparams``' defaults,
  also transformers'). Gemma 3's sliding layers take ``rope.freq_base_swa``
  where the converter wrote the Hugging Face local base, else llama.cpp's
  10,000.

Llama 3.1+ RoPE. The converter writes no ``rope.scaling`` keys for
``rope_type: llama3``; ``LlamaModel.generate_extra_tensors`` stores one
factor per frequency pair as ``rope_freqs.weight`` (1 for short
wavelengths, ``factor`` for long ones, ``1 / ((1 - s) / factor + s)``
between), and llama.cpp divides each pair's angle by it (``theta / ff`` in
ggml's ``rope_cache_init``). :func:`llama3_from_factors` finds the llama3
parameters whose frequencies (``models.layers.rope.inv_freq``, transformers'
formula) equal ``base / factor`` for every pair, trying Meta's thresholds
(``low_freq_factor`` 1, ``high_freq_factor`` 4, every Llama 3.x release)
first, then the thresholds the factors themselves imply; factors that no
llama3 scaling reproduces are refused by name.

Qwen3-MoE (``qwen3moe``): the converter (``Qwen3MoeModel``, via
``Qwen2MoeModel``) writes ``expert_count``, ``expert_used_count`` and
``expert_feed_forward_length`` and stacks each layer's experts into one
tensor per projection (``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, D]``,
``ffn_down_exps`` ``[E, D, I]``, NumPy order), the router as
``ffn_gate_inp``. It writes no ``norm_topk_prob``: llama.cpp's
``llm_build_qwen3moe`` always renormalizes the top-k weights (``norm_w``
true, softmax gating), so the config says ``norm_topk_prob: true``, as every
Qwen3-MoE release does.

Refused by name: other architectures (mixture-of-experts ones named), an
``expert_count`` outside ``qwen3moe``, a RoPE over part of the head (``rope.dimension_count``
below the key length), value and key lengths that differ, rope scaling
types other than ``none``, ``linear`` and ``yarn`` (and YaRN keys
transformers has no field for), a sliding window on Qwen3 or OLMo 2 (OLMo
3), ``rope_freqs.weight`` outside the llama architecture.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from models.config import LlamaConfig
from models.layers.rope import RopeScaling, inv_freq

ARCH_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                    "gemma2": "gemma2", "gemma3": "gemma3_text", "olmo2": "olmo2"}
"""GGUF ``general.architecture`` -> the Hugging Face ``model_type`` it was converted from."""
PERMUTED_ARCHS = ("llama", "mistral")
"""Architectures whose ``attn_q`` / ``attn_k`` rows the converter permuted (adjacent-pair RoPE)."""
PLUS_ONE_ARCHS = ("gemma2", "gemma3")
"""Architectures whose ``*norm.weight`` tensors the converter stored as ``1 + w``."""
REFUSED_ARCHS = {
    "qwen2moe": "a mixture of experts", "llama4": "a mixture of experts",
    "olmoe": "a mixture of experts", "gemma3n": "Gemma 3n (per-layer embeddings, AltUp), not Gemma 3",
    "gemma": "Gemma 1, not a supported family (Gemma 2 and 3 are)",
    "deepseek2": "DeepSeek-V2 / V3 (MLA), not a Llama-family decoder: models.deepseek.gguf.load_gguf_deepseek "
                 "(or models.llm.load_model) reads it",
}
_SCALING_KEYS = ("type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow",
                 "yarn_attn_factor", "finetuned")
"""``<arch>.rope.scaling.*`` keys that map onto a transformers RoPE field (``finetuned`` is informational)."""
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""Layer counts llama.cpp types as 27B, whose query scale is ``(n_embd / n_head) ** -0.5``."""
MISSING = object()
"""The default of `arch_keys`' `get` that makes a key required."""


def f32_value(value: float) -> float:
    """A float GGUF stored as f32, as the shortest decimal that rounds to
    the same f32 (1e-5 reads back as 9.9999997e-06): the value the
    checkpoint's author wrote."""
    return float(str(np.float32(value)))


def arch_keys(meta: Mapping[str, Any], arch: str, path: str):
    """``(get, bad)`` for the ``<arch>.*`` metadata keys: ``get(suffix[,
    default])`` reads one (a ValueError naming the file and key when it is
    absent without a default); ``bad(suffix, why)`` is the ValueError for a
    value the decoder cannot take, naming the key and its value."""

    def get(suffix: str, default=MISSING):
        key = f"{arch}.{suffix}"
        if key not in meta:
            if default is MISSING:
                raise ValueError(f"GGUF {path!r} lacks metadata key {key!r}")
            return default
        return meta[key]

    def bad(suffix: str, why: str) -> ValueError:
        return ValueError(f"GGUF {path!r}: {arch}.{suffix}={meta[f'{arch}.{suffix}']!r}; {why}")

    return get, bad


def hf_config_fields(meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]],
                     rope_factors: np.ndarray | None, path: str) -> dict[str, Any]:
    """The Hugging Face ``config.json`` fields a GGUF's metadata stands for.

    Args:
      meta: metadata key -> value (``general.architecture``,
        ``<arch>.block_count``, ...).
      tensor_shapes: tensor name -> shape in NumPy order (``[out, in]``).
      rope_factors: ``rope_freqs.weight`` as f32[H/2], or None.
      path: the file, for messages.

    Returns:
      A dict for :func:`models.loading.hf_config.config_from_hf` (``model_type``,
      ``hidden_size``, ``rope_parameters``, ``layer_types``, ...).

    Raises:
      ValueError: an unsupported architecture, a missing required key, or
        a feature the decoder cannot compute (module docstring); names
        ``path`` and the key.
    """
    if "general.architecture" not in meta:
        raise ValueError(f"GGUF {path!r} lacks metadata key 'general.architecture'")
    arch = meta["general.architecture"]
    if arch in REFUSED_ARCHS:
        raise ValueError(f"GGUF {path!r}: architecture {arch!r} is {REFUSED_ARCHS[arch]}, which the decoder does "
                         f"not compute; supported: {sorted(ARCH_MODEL_TYPES)}")
    if arch not in ARCH_MODEL_TYPES:
        raise ValueError(f"GGUF {path!r}: architecture must be one of {sorted(ARCH_MODEL_TYPES)}, got {arch!r}")

    get, bad = arch_keys(meta, arch, path)
    if get("expert_count", 0) and arch != "qwen3moe":
        raise bad("expert_count", f"mixture-of-experts {arch} models are not supported (qwen3moe is)")
    heads, layers, model_dim = int(get("attention.head_count")), int(get("block_count")), int(get("embedding_length"))
    kv_heads = get("attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):  # llama.cpp allows a per-layer list
        raise bad("attention.head_count_kv", "a KV head count per layer is not supported")
    head_dim = int(get("attention.key_length", model_dim // heads))
    if get("attention.value_length", head_dim) != head_dim:
        raise bad("attention.value_length", f"value heads must be as wide as key heads ({head_dim})")
    if get("rope.dimension_count", head_dim) != head_dim:
        raise bad("rope.dimension_count", f"partial RoPE is not supported (head_dim={head_dim})")
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError(f"GGUF {path!r} lacks tensor 'token_embd.weight'")
    fields: dict[str, Any] = dict(
        model_type=ARCH_MODEL_TYPES[arch], num_hidden_layers=layers, hidden_size=model_dim,
        intermediate_size=int(get("feed_forward_length")), num_attention_heads=heads,
        num_key_value_heads=int(kv_heads), head_dim=head_dim,
        rms_norm_eps=f32_value(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length", 2048)),
        # Gemma 3's converter trims the embedding to the tokenizer's size and writes no vocab_size.
        vocab_size=int(get("vocab_size", tensor_shapes["token_embd.weight"][0])),
        tie_word_embeddings="output.weight" not in tensor_shapes,
    )
    if arch == "qwen3moe":
        fields.update(num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                      moe_intermediate_size=int(get("expert_feed_forward_length")), norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])
    rope = _rope_parameters(arch, meta, get, bad, rope_factors, head_dim, path)
    window = get("attention.sliding_window", None) or None
    if arch in ("gemma2", "gemma3"):
        if arch == "gemma2" and window is None:
            raise ValueError(f"GGUF {path!r} lacks metadata key 'gemma2.attention.sliding_window'")
        period = 2 if arch == "gemma2" else 6
        fields["layer_types"] = ["full_attention" if window is None or i % period == period - 1
                                 else "sliding_attention" for i in range(layers)]
        if window is not None:
            fields["sliding_window"] = int(window)
        wide = model_dim // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
        fields["query_pre_attn_scalar"] = wide
        if arch == "gemma2":
            fields["attn_logit_softcapping"] = f32_value(get("attn_logit_softcapping", 50.0))
            fields["final_logit_softcapping"] = f32_value(get("final_logit_softcapping", 30.0))
            fields["rope_parameters"] = rope
        else:
            cap = get("final_logit_softcapping", None)
            fields["final_logit_softcapping"] = f32_value(cap) if cap else None
            fields["rope_parameters"] = {"full_attention": rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": f32_value(get("rope.freq_base_swa", 10000.0))}}
    else:
        if window is not None and arch != "llama":  # llama.cpp's llama architecture ignores it (Mistral 7B v0.1)
            raise bad("attention.sliding_window", f"sliding-window layers are not supported for {arch} GGUFs")
        if get("rope.freq_base_swa", None) is not None:
            raise bad("rope.freq_base_swa", f"a separate RoPE base for sliding layers is not expected for {arch}")
        fields["rope_parameters"] = rope
    return fields


def _rope_parameters(arch, meta, get, bad, rope_factors, head_dim, path) -> dict[str, Any]:
    """The (global layers') ``rope_parameters`` dict of a GGUF."""
    theta = f32_value(get("rope.freq_base", 10000.0))
    unknown = sorted(k for k in meta if k.startswith(f"{arch}.rope.scaling.")
                     and k.rsplit(".", 1)[-1] not in _SCALING_KEYS)
    if unknown:
        raise ValueError(f"GGUF {path!r}: RoPE scaling keys {unknown} have no transformers equivalent")
    kind = get("rope.scaling.type", "none")
    if rope_factors is not None:
        if arch not in PERMUTED_ARCHS:
            raise ValueError(f"GGUF {path!r}: tensor 'rope_freqs.weight' is not expected for {arch} (llama.cpp's "
                             "converter writes it for Llama 3.1+ only)")
        if kind != "none":
            raise bad("rope.scaling.type", "'rope_freqs.weight' and a rope scaling type at once are not supported")
        scaling = llama3_from_factors(rope_factors, head_dim, theta, path)
        if scaling is None:
            return {"rope_type": "default", "rope_theta": theta}
        return {"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings}
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": f32_value(get("rope.scaling.factor"))}
    if kind == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": f32_value(get("rope.scaling.factor")),
                "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
        for suffix, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                             ("yarn_attn_factor", "attention_factor")):
            value = get(f"rope.scaling.{suffix}", None)
            if value is not None:
                rope[name] = f32_value(value)
        return rope
    raise bad("rope.scaling.type", "supported: 'none', 'linear', 'yarn' (and Llama 3.1's rope_freqs.weight)")


def llama3_from_factors(factors: np.ndarray, head_dim: int, theta: float, path: str) -> RopeScaling | None:
    """The llama3 :class:`RopeScaling` whose frequencies are llama.cpp's
    ``inv_freq(head_dim, theta) / factors`` (module docstring).

    Args:
      factors: f32[H/2], ``rope_freqs.weight``.
      head_dim: H.
      theta: the RoPE base.
      path: the file, for messages.

    Returns:
      The scaling, or None when every factor is 1 (plain RoPE).

    Raises:
      ValueError: the factors are not H/2 positive numbers, or no llama3
        scaling reproduces them within 1e-5 (relative); names ``path``.
    """
    factors = np.asarray(factors, np.float32)
    if factors.shape != (head_dim // 2,) or not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ValueError(f"GGUF {path!r}: rope_freqs.weight must hold {head_dim // 2} positive factors (one per "
                         f"RoPE pair), got shape {factors.shape}")
    if (factors == 1).all():
        return None
    base = inv_freq(head_dim, theta).astype(np.float64)  # [H/2]
    x = base / (2 * math.pi)  # 1 / wavelength
    ff = factors.astype(np.float64)
    factor = float(ff.max())
    medium = (ff != 1) & (ff != factor)
    s = (1 / ff - 1 / factor) / (1 - 1 / factor)  # llama3's smoothing per pair; 0 long, 1 short wavelengths
    # smooth = (original * x - low) / (high - low): with Meta's low 1 and high 4, original = (1 + 3 s) / x.
    meta_original = round(float(np.median((1 + 3 * s[medium]) / x[medium]))) if medium.any() else 8192
    candidates = [(meta_original, 1.0, 4.0)]
    x_low, x_high = _thresholds(x, ff, factor, s, medium)
    original = max(1, round(1 / x_low))
    candidates.append((original, original * x_low, original * x_high))
    want = base / ff
    for original, low, high in candidates:
        try:
            scaling = RopeScaling(rope_type="llama3", factor=f32_value(factor),
                                  original_max_position_embeddings=original, low_freq_factor=low,
                                  high_freq_factor=high)
        except ValueError:
            continue
        if np.allclose(inv_freq(head_dim, theta, scaling), want, rtol=1e-5, atol=0):
            return scaling
    raise ValueError(f"GGUF {path!r}: rope_freqs.weight {factors.tolist()} matches no llama3 RoPE scaling of base "
                     f"{theta} (the only frequency factors the decoder computes)")


def _thresholds(x, ff, factor, s, medium) -> tuple[float, float]:
    """``(1 / low_wavelen, 1 / high_wavelen)`` consistent with the factors:
    fitted to the smoothing of two or more middle pairs, else placed inside
    the gaps between the pairs kept (factor 1) and those divided by
    ``factor``."""
    if medium.sum() >= 2:  # s = (x - x_low) / (x_high - x_low) is a line in x
        slope, intercept = np.polyfit(x[medium], s[medium], 1)
        x_low = -intercept / slope
        return float(x_low), float(x_low + 1 / slope)
    kept, divided = x[ff == 1], x[ff == factor]
    x_a = float(kept.min()) if kept.size else 2 * float(x.max())  # the longest wavelength kept
    x_b = float(divided.max())  # the shortest wavelength divided
    if not medium.any():
        return x_b + (x_a - x_b) / 3, x_b + 2 * (x_a - x_b) / 3
    x_m, s_m = float(x[medium][0]), float(s[medium][0])
    d = 0.5 * min(x_m - x_b, (x_a - x_m) * s_m / (1 - s_m))
    return x_m - d, x_m - d + d / s_m


def check_rope_factors(factors: np.ndarray, config: LlamaConfig, path: str) -> None:
    """Checks that ``config``'s RoPE equals llama.cpp's with ``rope_freqs.weight``.

    Raises:
      ValueError: it does not (within 1e-5 relative), naming ``path``.
    """
    factors = np.asarray(factors, np.float32)
    want = inv_freq(config.head_dim, config.rope_theta).astype(np.float64) / factors.astype(np.float64)
    got = inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    if factors.shape != got.shape or not np.allclose(got, want, rtol=1e-5, atol=0):
        raise ValueError(f"GGUF {path!r} has tensors the decoder does not read: ['rope_freqs.weight'] (llama.cpp's "
                         f"RoPE frequency factors of Llama 3.1+, which the config's rope_scaling="
                         f"{config.rope_scaling} does not reproduce; load_gguf reads them into the config)")


def layer_tensors(config: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """Per-block GGUF tensors (``blk.{i}.<name>``) -> our parameter path
    under ``blocks``, for the config's norm placement, q/k norms and biases.

    Names are gguf-py's (``TENSOR_NAMES``): Llama's ``post_attention_layernorm``
    is the pre-MLP norm ``ffn_norm``; Gemma's and OLMo 2's is
    ``post_attention_norm``, and Gemma's ``pre_feedforward_layernorm`` is
    ``ffn_norm``.
    """
    norms = {
        "pre": {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm"},
        "pre_post": {"attn_norm": "attn_norm", "post_attention_norm": "post_attn_norm", "ffn_norm": "mlp_norm",
                     "post_ffw_norm": "post_mlp_norm"},
        "post": {"post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_mlp_norm"},
    }[config.norm_placement]
    out = {f"{gguf}.weight": (ours, "scale") for gguf, ours in norms.items()}
    out.update({"attn_q.weight": ("attn", "wq"), "attn_k.weight": ("attn", "wk"), "attn_v.weight": ("attn", "wv"),
                "attn_output.weight": ("attn", "wo")})
    if config.router is None:
        out.update({"ffn_gate.weight": ("mlp", "w_gate"), "ffn_up.weight": ("mlp", "w_up"),
                    "ffn_down.weight": ("mlp", "w_down")})
    else:  # every layer's experts stacked, one tensor a projection (Qwen3-MoE)
        out.update({"ffn_gate_inp.weight": ("mlp", "router"), "ffn_gate_exps.weight": ("mlp", "w_gate"),
                    "ffn_up_exps.weight": ("mlp", "w_up"), "ffn_down_exps.weight": ("mlp", "w_down")})
    if config.qk_norm is not None:
        out.update({"attn_q_norm.weight": ("attn", "q_norm", "scale"),
                    "attn_k_norm.weight": ("attn", "k_norm", "scale")})
    if config.qkv_bias:
        out.update({"attn_q.bias": ("attn", "bq"), "attn_k.bias": ("attn", "bk"), "attn_v.bias": ("attn", "bv")})
    return out
