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
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.config import SMOLLM2_135M, LlamaConfig
from models.llama import Llama
from paged_jax.checks import check_int

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
