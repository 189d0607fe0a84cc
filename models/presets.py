"""Real architectures with random weights, for measuring serving at scale.

Serving throughput under ``ignore_eos`` with fixed output lengths depends on
the shapes (layers, heads, widths, vocabulary) and dtypes, not on the weight
values: a random-weight model of a real architecture measures memory-bound
serving at a realistic scale on a machine that has neither the checkpoint
nor a network (accelerator hosts often have neither).

The shapes are those of the published ``config.json`` files:
``meta-llama/Meta-Llama-3-8B`` (8,030,261,248 parameters),
``Qwen/Qwen2.5-7B`` (7,615,616,512) and ``HuggingFaceTB/SmolLM2-135M-Instruct``
(134,515,008: :data:`models.config.SMOLLM2_135M`, the config the GGUF gives).

``llama-3.1-8b``, ``qwen3-8b`` and ``gemma-3-12b`` are built from the
published config values (:data:`PUBLISHED_CONFIGS`) by
:func:`models.loading.hf_config.config_from_hf`, the mapping a real checkpoint's
``config.json`` goes through, so a preset and the checkpoint it stands for
cannot drift apart: ``meta-llama/Llama-3.1-8B`` (llama3 RoPE scaling, 8,030,261,248
parameters), ``Qwen/Qwen3-8B`` (q/k head norms, 8,190,735,360) and the text
decoder of ``google/gemma-3-12b-it`` (its ``text_config``: five sliding
layers of window 1,024 to one global, local RoPE base 10,000, global 1e6 with
linear factor 8; 11,766,034,176 parameters, without the vision encoder).
gpt-oss (mixture of experts, attention sinks) is not expressible by
:class:`models.config.LlamaConfig`; its attention shapes are in
:data:`paged_jax.memory.PRESETS` only.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.config import SMOLLM2_135M, LlamaConfig
from models.llama import Llama
from models.loading.hf_config import config_from_hf
from paged_jax.checks import check_int

PUBLISHED_CONFIGS: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B config.json (architecture fields).
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "vocab_size": 128256, "attention_bias": False, "mlp_bias": False,
    },
    # Qwen/Qwen3-8B config.json (Qwen3-8B-Base's differs only in max_position_embeddings, 32768).
    "qwen3-8b": {
        "model_type": "qwen3", "hidden_act": "silu", "head_dim": 128, "hidden_size": 4096,
        "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936, "attention_bias": False,
    },
    # google/gemma-3-12b-it config.json, its text_config (model_type gemma3_text;
    # tie_word_embeddings absent: tied, Gemma's default).
    "gemma-3-12b": {
        "model_type": "gemma3_text", "attention_bias": False, "attn_logit_softcapping": None,
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3840, "intermediate_size": 15360, "max_position_embeddings": 131072,
        "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000,
        "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
    },
}
"""Published ``config.json`` values of the presets built through
:func:`models.loading.hf_config.config_from_hf` (fields that do not shape the
decoder, such as token ids, left out)."""

PRESETS: dict[str, LlamaConfig] = {
    "smollm2-135m": SMOLLM2_135M,
    "llama-3-8b": LlamaConfig(
        vocab_size=128256, model_dim=4096, mlp_dim=14336, num_layers=32, num_q_heads=32, num_kv_heads=8,
        head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, tie_embeddings=False, max_seq_len=8192,
    ),
    "qwen2.5-7b": LlamaConfig(
        vocab_size=152064, model_dim=3584, mlp_dim=18944, num_layers=28, num_q_heads=28, num_kv_heads=4,
        head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_embeddings=False, max_seq_len=32768,
        qkv_bias=True,
    ),
    **{name: config_from_hf(cfg, f"{name} preset") for name, cfg in PUBLISHED_CONFIGS.items()},
}
"""Architecture presets by name (see the module docstring for the sources)."""


def _preset(name: str) -> LlamaConfig:
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]


def bytes_to_build(name: str, param_dtype) -> int:
    """Bytes :func:`random_model` needs at its peak: the weights in
    ``param_dtype`` plus the f32 draw of the largest stacked tensor.

    Raises:
      ValueError: an unknown ``name``.
    """
    c = _preset(name)
    largest = max(c.vocab_size * c.model_dim, c.num_layers * c.model_dim * c.mlp_dim,
                  c.num_layers * c.model_dim * c.num_q_heads * c.head_dim)
    return c.num_params * jnp.dtype(param_dtype).itemsize + 4 * largest


def random_model(name: str, *, param_dtype=jnp.bfloat16, seed: int = 0) -> Llama:
    """A :class:`models.llama.Llama` of preset ``name`` with random weights.

    Weights are drawn as at initialisation (normal, fan-in scaled), in
    ``param_dtype``. Memory: ``PRESETS[name].num_params * itemsize`` bytes
    (Llama-3-8B in bf16: 16.1 GB), plus the f32 draw of the largest stacked
    tensor while it is made.

    Args:
      name: a key of :data:`PRESETS`.
      param_dtype: weight dtype (a float dtype).
      seed: the weights' random seed.

    Raises:
      ValueError: an unknown ``name`` (the message lists the presets), a
        non-float ``param_dtype``, or a ``seed`` that is not an int >= 0.
    """
    config = _preset(name)
    check_int("seed", seed, 0)
    if not jnp.issubdtype(jnp.dtype(param_dtype), jnp.floating):
        raise ValueError(f"param_dtype must be a float dtype, got {jnp.dtype(param_dtype)}")
    return Llama(config, rngs=nnx.Rngs(seed), param_dtype=param_dtype)
