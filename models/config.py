"""The architecture of a Llama-family decoder (:class:`LlamaConfig`): a frozen
config that checks itself and builds its own KV pool; the decoder is
:mod:`models.llama`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from paged_jax.checks import check_bool, check_float, check_int
from paged_jax.kv_cache import KVPool, default_kv_dtype, init_kv_pool
from pallas_kernels import common


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
        read by no one, and freed with the sequence).

    Raises:
      ValueError: a size that is not a positive int, an odd ``head_dim``
        (RoPE pairs dims), ``num_q_heads`` not a multiple of
        ``num_kv_heads``, a non-positive ``rope_theta`` / ``rms_norm_eps``,
        a non-bool ``qkv_bias``, or a ``sliding_window`` that is neither
        None nor a positive int.
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

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        """Parameters, the embedding counted once when tied."""
        d, f, h = self.model_dim, self.mlp_dim, self.head_dim
        per_layer = 2 * d + d * h * (2 * self.num_q_heads + 2 * self.num_kv_heads) + 3 * d * f
        if self.qkv_bias:
            per_layer += h * (self.num_q_heads + 2 * self.num_kv_heads)
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + d

    def kv_bytes_per_token(self, dtype=jnp.float32) -> int:
        """KV-pool bytes one token occupies across all layers (K and V; an
        int8 pool's f32 scales included)."""
        return 2 * self.num_layers * self.num_kv_heads * common.kv_bytes_per_token(self.head_dim, dtype)

    def make_kv_pool(self, num_pages: int, page_size: int, dtype=None) -> KVPool:
        """A zeroed KV pool shaped for this model: ``[num_layers, K, P, L, H]``.

        Args:
          num_pages: P, pages including the null page (>= 2).
          page_size: L, tokens per page (>= 1).
          dtype: storage dtype of K and V: a float dtype, or int8 (with
            per-token scales); default
            :func:`paged_jax.kv_cache.default_kv_dtype` (f32 on CPU, bf16 on
            GPU and TPU).

        Raises:
          ValueError: from :func:`paged_jax.kv_cache.init_kv_pool`.
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
