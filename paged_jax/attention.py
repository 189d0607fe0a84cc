"""XLA reference paged attention (GQA), for decode, prefill and mixed batches.

This is the truth every Pallas kernel is tested against and the path the
decoder takes on CPU. It gathers each sequence's pages through its block
table, then attends with a mask built from lengths (PagedAttention, Kwon et
al., SOSP 2023, section 4.1, equation 4: the attention over a sequence is a
sum over its KV blocks).

Batch convention ("padded ragged"): ``q`` is ``[B, T, N, H]``. Sequence ``b``
has ``q_lens[b] <= T`` real query tokens (the rest is padding) and
``kv_lens[b]`` tokens in the cache *including* those query tokens, whose K/V
must already be written. Query ``t`` sits at position
``kv_lens[b] - q_lens[b] + t`` and sees keys at positions ``<=`` its own
(causal). Decode is ``T = 1, q_lens = 1``; prefill is ``q_lens = kv_lens``;
chunked prefill and mixed batches are anything in between.

Scaling: logits are ``(q . k) * scale`` with ``scale = 1 / sqrt(head_dim)``
unless given; this is the one place the scale is applied. Padding query rows
and sequences with ``kv_lens = 0`` give zeros. Masked keys are removed from
both the logits and the values, so NaN in a slot no query may see (the null
page, a freed page) never reaches the output.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# Axis alphabet: B batch, T query tokens, S key tokens, N query heads,
# K KV heads, G queries per KV head, H head dim, P pages, L page size.


def validate_inputs(q, k_pages, v_pages, block_tables, kv_lens, q_lens) -> None:
    """Checks shapes and dtypes of a paged-attention call (static facts only).

    Raises:
      ValueError: a rank, shape or dtype mismatch; the message names the
        argument, what it got and what was expected.
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, q_tokens, num_q_heads, head_dim], got shape {q.shape}")
    batch, _, num_q_heads, head_dim = q.shape
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_kv_heads, num_pages, page_size, head_dim], got shape {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    num_kv_heads, _, _, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and k_pages ({kv_head_dim}) differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads must be a multiple of num_kv_heads, got {num_q_heads=} {num_kv_heads=}"
        )
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [batch={batch}, pages_per_seq], got shape {block_tables.shape}")
    for name, x in (("kv_lens", kv_lens), ("q_lens", q_lens)):
        if x.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {x.shape}")
    for name, x in (("block_tables", block_tables), ("kv_lens", kv_lens), ("q_lens", q_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")


def query_positions(kv_lens: jax.Array, q_lens: jax.Array, num_q_tokens: int) -> jax.Array:
    """i32[B, T] position of each query token: ``kv_lens - q_lens + t``."""
    return (kv_lens - q_lens)[:, None] + jnp.arange(num_q_tokens, dtype=jnp.int32)[None, :]


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[K, P, L, H] pages, i32[B, pages_per_seq] -> [K, B, pages_per_seq * L, H]."""
    num_kv_heads, _, page_size, head_dim = pages.shape
    batch, pages_per_seq = block_tables.shape
    return pages[:, block_tables].reshape(num_kv_heads, batch, pages_per_seq * page_size, head_dim)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
def ref_paged_attention(
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [K, P, L, H]
    v_pages: jax.Array,  # [K, P, L, H]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array,  # i32[B]
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal GQA attention of ``q`` over each sequence's paged K/V.

    Args:
      q: [B, T, N, H] queries, ``q_lens[b]`` real rows per sequence.
      k_pages, v_pages: [K, P, L, H] one layer's pages.
      block_tables: i32[B, pages_per_seq] page ids; entries past a
        sequence's length may point anywhere in the pool (usually the null
        page).
      kv_lens: i32[B] tokens in the cache per sequence, query tokens included.
      q_lens: i32[B] real query tokens per sequence, ``<= min(T, kv_lens)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``
        (Gemma 2) before masking.
      sliding_window: if set, a query at position ``p`` sees keys in
        ``(p - sliding_window, p]``.

    Returns:
      [B, T, N, H] in ``q.dtype``; zeros for padding rows and empty sequences.
      Computed in f32.
    """
    batch, num_q_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_q_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)

    k = gather_pages(k_pages, block_tables).astype(jnp.float32)  # [K, B, S, H]
    v = gather_pages(v_pages, block_tables).astype(jnp.float32)  # [K, B, S, H]
    num_keys = k.shape[2]

    q_pos = query_positions(kv_lens, q_lens, num_q_tokens)  # [B, T]
    k_pos = jnp.arange(num_keys, dtype=jnp.int32)  # [S]
    q_real = jnp.arange(num_q_tokens)[None, :] < q_lens[:, None]  # [B, T]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & q_real[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    key_real = k_pos[None, :] < kv_lens[:, None]  # [B, S]
    mask &= key_real[:, None, :]

    # q: [B, T, K, G, H]   k: [K, B, S, H]
    qg = q.astype(jnp.float32).reshape(batch, num_q_tokens, num_kv_heads, group, head_dim) * scale
    logits = jnp.einsum("BTKGH,KBSH->BKGTS", qg, jnp.where(key_real[None, :, :, None], k, 0.0))
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    mask = mask[:, None, None, :, :]  # [B, 1, 1, T, S]
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # all-masked rows
    probs = jnp.where(mask, jnp.exp(logits - row_max), 0.0)  # [B, K, G, T, S]
    denom = probs.sum(axis=-1, keepdims=True)
    v = jnp.where(key_real[None, :, :, None], v, 0.0)
    out = jnp.einsum("BKGTS,KBSH->BTKGH", probs, v)  # [B, T, K, G, H]
    denom = denom.transpose(0, 3, 1, 2, 4)  # [B, T, K, G, 1]
    out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
    return out.reshape(batch, num_q_tokens, num_q_heads, head_dim).astype(q.dtype)


def ref_paged_decode_attention(
    q: jax.Array,  # [B, N, H]
    k_pages: jax.Array,  # [K, P, L, H]
    v_pages: jax.Array,  # [K, P, L, H]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    **kwargs,
) -> jax.Array:
    """Decode: one query per sequence attending to its ``lengths[b]`` cached
    tokens (the query's own K/V included). Returns [B, N, H]; zeros where
    ``lengths == 0``. Keyword options as :func:`ref_paged_attention`."""
    q_lens = jnp.minimum(lengths, 1).astype(jnp.int32)
    return ref_paged_attention(q[:, None], k_pages, v_pages, block_tables, lengths, q_lens, **kwargs)[:, 0]


IMPLS = ("auto", "xla")
"""Implementations :func:`paged_attention` can dispatch to."""


def paged_attention(
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [K, P, L, H]
    v_pages: jax.Array,  # [K, P, L, H]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array,  # i32[B]
    *,
    impl: str = "auto",
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Paged attention with a choice of implementation.

    Same arguments and result as :func:`ref_paged_attention`. ``impl``:
    ``"auto"`` picks the best implementation for the default backend (the
    XLA reference on CPU), ``"xla"`` forces the reference.

    Raises:
      ValueError: unknown ``impl``, or inputs that fail
        :func:`validate_inputs`.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl=!r}")
    validate_inputs(q, k_pages, v_pages, block_tables, kv_lens, q_lens)
    return ref_paged_attention(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
    )
