"""Rotary position embeddings (RoPE) and the scaled variants Hugging Face
checkpoints use: plain, ``linear``, ``llama3`` (Llama 3.1 / 3.2 / 3.3) and
``yarn`` (Qwen3's long-context setting).

Each variant only changes the inverse frequencies, and YaRN also multiplies
cos and sin by an attention factor; the rotation itself is Hugging Face's
``rotate_half`` (pair ``i`` is dims ``i`` and ``i + H/2``). The frequencies
are computed on the host in f32 NumPy with the same operations, in the same
order, as transformers' ``modeling_rope_utils`` (the oracle the tests hold
them to): they agree within a few f32 ulps (NumPy's ``pow`` and torch's
differ in the last bit for some dims), far below what moves a logit.

``dynamic`` (NTK scaling that changes with the sequence length),
``longrope`` and every other rope type are not here: the loader refuses
them by name (:mod:`models.loading.hf_loader`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.checks import check_bool, check_choice, check_float, check_int

ROPE_TYPES = ("linear", "llama3", "yarn")
"""The scaled RoPE variants :class:`RopeScaling` describes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """A scaled RoPE: how the inverse frequencies ``theta^(-2i/H)`` change.

    Attributes:
      rope_type: ``"linear"`` (every frequency divided by ``factor``),
        ``"llama3"`` (low frequencies divided by ``factor``, high ones kept,
        a smooth ramp between) or ``"yarn"`` (interpolated and extrapolated
        frequencies mixed by a ramp over dims, cos and sin scaled by
        ``attention_factor``).
      factor: the context extension factor, > 0.
      original_max_position_embeddings: the pretraining context (llama3,
        yarn), tokens.
      low_freq_factor, high_freq_factor: llama3's wavelength thresholds
        (``original / low_freq_factor`` and ``original / high_freq_factor``);
        ``high_freq_factor > low_freq_factor``.
      beta_fast, beta_slow: YaRN's ramp bounds, in rotations.
      truncate: YaRN rounds the ramp bounds to whole dims.
      attention_factor: YaRN's multiplier of cos and sin (resolved by the
        loader from ``factor`` / ``mscale`` as transformers does); 1 for the
        other types.

    Raises:
      ValueError: an unknown ``rope_type``, a non-positive number, llama3 or
        yarn without ``original_max_position_embeddings``, or llama3 with
        ``high_freq_factor <= low_freq_factor``.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def __post_init__(self):
        check_choice("rope_type", self.rope_type, ROPE_TYPES)
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                     "attention_factor"):
            check_float(name, getattr(self, name), 0, low_open=True)
        check_bool("truncate", self.truncate)
        if self.rope_type != "linear":
            check_int("original_max_position_embeddings", self.original_max_position_embeddings)
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor must be > low_freq_factor, got high_freq_factor="
                             f"{self.high_freq_factor} low_freq_factor={self.low_freq_factor}")


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The inverse frequencies of RoPE pairs: f32[H/2], ``theta^(-2i/H)``
    for pair ``i``, changed as ``scaling`` says (None: plain RoPE).

    The f32 operations are transformers' own (``_compute_*_parameters`` in
    ``modeling_rope_utils``), in their order.
    """
    dims = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)  # [H/2]
    base = np.float32(theta) ** dims  # [H/2]
    freq = (np.float32(1.0) / base).astype(np.float32)
    if scaling is None:
        return freq
    s = scaling
    if s.rope_type == "linear":
        return (freq / np.float32(s.factor)).astype(np.float32)
    if s.rope_type == "llama3":
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = np.float32(2 * math.pi) / freq
        scaled = np.where(wavelen > low_wavelen, freq / np.float32(s.factor), freq).astype(np.float32)
        smooth = ((np.float32(old) / wavelen - np.float32(s.low_freq_factor))
                  / np.float32(s.high_freq_factor - s.low_freq_factor))
        smoothed = (1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    # yarn: pairs whose wavelength fits the pretraining context many times
    # (fast rotations) keep their frequency, slow ones are interpolated.
    def correction_dim(rotations):
        return (head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    interpolated = np.float32(1.0) / (np.float32(s.factor) * base)
    return (interpolated * (1 - extrapolation) + freq * extrapolation).astype(np.float32)


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's cos/sin multiplier when a config gives none: ``0.1 ln(factor)
    + 1`` (1 for ``factor <= 1``), or the ratio of that with ``mscale`` and
    with ``mscale_all_dim`` when both are set (transformers'
    ``_compute_yarn_parameters``)."""

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return float(get_mscale(factor))


def rope_angles(positions: jax.Array, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin of RoPE angles.

    Args:
      positions: i32[B, T] token positions.
      head_dim: H (even).
      theta: the RoPE base.
      scaling: the scaled variant, or None for plain RoPE.

    Returns:
      ``(cos, sin)``, each f32[B, T, H/2]: angle ``pos * inv_freq[i]`` for
      pair ``i`` (:func:`inv_freq`), both multiplied by YaRN's attention
      factor when ``scaling`` is YaRN.
    """
    freq = jnp.asarray(inv_freq(head_dim, theta, scaling))  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * freq  # [B, T, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scaling is not None and scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates pairs ``(x[i], x[i + H/2])`` (Hugging Face's ``rotate_half``).

    Args:
      x: [B, T, heads, H].
      cos, sin: f32[B, T, H/2].

    Returns:
      [B, T, heads, H] in ``x.dtype``.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, H/2]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
