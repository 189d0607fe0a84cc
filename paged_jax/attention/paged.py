"""Paged attention (GQA) over a padded ``[B, T]`` batch: the dispatcher to
the Pallas kernels, and the XLA path that serves CPUs.

:func:`paged_attention` is the door: it validates its arguments once and
dispatches to an implementation (:data:`IMPLS`). :func:`xla_paged_attention`
is the XLA implementation, the gather-everything path the decoder takes on
CPU for the padded batch: it gathers each sequence's pages through its block
table, then attends with a mask built from lengths (PagedAttention, Kwon et
al., SOSP 2023, section 4.1, equation 4: the attention over a sequence is a
sum over its KV blocks). It is a production path, not a reference: the
references the kernels and this path are tested against are the per-sequence
loops ``pallas_kernels.*.ref_*`` (``pallas_kernels.common.ref_ragged_loop``).

Two tiers, as in :mod:`paged_jax.paging.page_state`: the public functions check
shapes, dtypes and (when eager) values at the door and clamp what a traced
call cannot check (``pallas_kernels.common.checked_lengths``); their
``unchecked_*`` twins trust their inputs, for callers that validated at their
own door (:mod:`paged_jax.attention.ragged`, :func:`models.llama.forward`).

Batch convention ("padded ragged"): ``q`` is ``[B, T, N, H]``. Sequence ``b``
has ``q_lens[b] <= T`` real query tokens (the rest is padding) and
``kv_lens[b]`` tokens in the cache *including* those query tokens, whose K/V
must already be written. Query ``t`` sits at position
``kv_lens[b] - q_lens[b] + t`` and sees keys at positions ``<=`` its own
(causal). Decode is ``T = 1, q_lens = 1``; prefill is ``q_lens = kv_lens``;
chunked prefill and mixed batches are anything in between.

Scaling: logits are ``(q . k) * scale`` with ``scale = 1 / sqrt(head_dim)``
unless given; each implementation applies it exactly once. Padding query rows
and sequences with ``kv_lens = 0`` give zeros (they see no key). Masked keys
are removed from both the logits and the values, so NaN in a slot no query
may see (the null page, a freed page) never reaches the output; a NaN or inf
in a logit or value a row does see makes that row's output non-finite, so a
corrupt weight or cache shows instead of being served as tokens.

Axis letters: the alphabet of ``models/__init__.py``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from paged_jax.checks import check_choice
from pallas_kernels import common, paged_attention_cpu, paged_attention_gpu, paged_attention_tpu
from pallas_kernels import ragged_paged_attention as pallas_ragged

IMPLS = ("auto", "xla", "xla_loop", "pallas_gpu", "pallas_tpu", "pallas_ragged")
"""Implementations :func:`paged_attention` can dispatch to.

* ``"auto"``: ``"pallas_tpu"`` on a TPU, ``"pallas_gpu"`` on a GPU, ``"xla"``
  elsewhere (CPU).
* ``"xla"``: :func:`xla_paged_attention`, any ``T``.
* ``"xla_loop"``: ``pallas_kernels.paged_attention_cpu`` for decode (XLA
  loops over sequences and their page blocks, stopping at each length; the
  fast CPU decode path, see ``experiments/kernel_bench``); the XLA path
  for ``T > 1``.
* ``"pallas_gpu"``: ``pallas_kernels.paged_attention_gpu`` (Triton lowering)
  for decode (``T == 1``), ``pallas_kernels.ragged_paged_attention`` for
  ``T > 1``. Page size times pages per compute block must be a power of two
  >= 16.
* ``"pallas_tpu"``: ``pallas_kernels.paged_attention_tpu`` for decode; for
  ``T > 1`` the XLA path (there is no TPU ragged kernel).
* ``"pallas_ragged"``: ``pallas_kernels.ragged_paged_attention`` for every
  ``T`` (what chunked prefill uses).

A Pallas kernel forced on a backend it was not written for runs in Pallas
interpret mode (TPU interpret mode for ``"pallas_tpu"``): slow, for tests.

On the engine's flat batch (``paged_jax.attention.ragged.attend``) the Pallas
names select the flat ragged kernel instead
(``pallas_kernels.flat_ragged_attention``: ``"gpu"`` for ``"pallas_gpu"`` and
``"pallas_ragged"``, ``"tpu"`` for ``"pallas_tpu"``) and ``"xla_loop"`` the
XLA work list; the kernels here serve padded ``[B, T]`` batches
(:func:`models.llama.forward`, the benchmarks).
"""


def resolve_impl(impl: str) -> str:
    """``impl`` checked against :data:`IMPLS`, with ``"auto"`` resolved for
    the default backend.

    Raises:
      ValueError: ``impl`` is not in :data:`IMPLS`.
    """
    check_choice("impl", impl, IMPLS)
    if impl == "auto":
        return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "xla")
    return impl


def validate_inputs(q, k_pages, v_pages, block_tables, kv_lens, q_lens, k_scales=None, v_scales=None,
                    layer=None) -> None:
    """Checks shapes and dtypes of a paged-attention call (static facts
    only, so it runs under ``jit``): ``pallas_kernels.common.validate_inputs``,
    the one validator the references and every kernel share.

    Raises:
      ValueError: a rank, shape or dtype mismatch; the message names the
        argument, what it got and what was expected.
    """
    if getattr(q, "ndim", None) != 4:
        raise ValueError(f"q must be [batch, q_tokens, num_q_heads, head_dim], got shape {getattr(q, 'shape', q)}")
    common.validate_inputs(q, k_pages, v_pages, block_tables, kv_lens, q_lens, k_scales, v_scales, layer)


def check_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, impl: str = "auto",
                          scale=None, soft_cap=None, sliding_window=None, k_scales=None, v_scales=None,
                          layer=None):
    """The door's checks of :func:`paged_attention`, for a caller that
    validates once and then calls :func:`unchecked_paged_attention` (for
    example once per model call rather than once per layer). Same arguments;
    ``q`` may be a ``jax.ShapeDtypeStruct`` (only its shape and dtype are
    read).

    Returns:
      ``(impl, kv_lens, q_lens, layer)``: the implementation with ``"auto"``
      resolved, the lengths clamped to their ranges
      (``pallas_kernels.common.checked_lengths``) and the layer as an
      i32[] clamped to the pool (None without a stacked pool): what the
      unchecked call may trust, even under ``jit``.

    Raises:
      ValueError: unknown ``impl``, inputs that fail :func:`validate_inputs`,
        options that are not positive, a page size the chosen kernel cannot
        tile; (eager calls) lengths past a row's block table, ``q_lens >
        kv_lens``, or a layer outside the pool.
    """
    impl = resolve_impl(impl)
    validate_inputs(q, k_pages, v_pages, block_tables, kv_lens, q_lens, k_scales, v_scales, layer)
    common.validate_options(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    kv_lens, q_lens = common.checked_lengths(block_tables, k_pages.shape[-3], k_pages.shape[-2], kv_lens, q_lens,
                                             q.shape[1])
    layer = None if layer is None else common.checked_layer(layer, k_pages.shape[0])[0]
    check_tiling(impl, q.shape[1], k_pages.shape[-2])
    return impl, kv_lens, q_lens, layer


def check_tiling(impl: str, num_q_tokens: int, page_size: int) -> None:
    """Raises ValueError unless the kernel :func:`unchecked_paged_attention`
    picks for ``impl`` (resolved), ``T = num_q_tokens`` and this page size
    can tile it (Triton needs compute blocks of a power of two >= 16 keys)."""
    sizes = _block_sizes(impl, num_q_tokens, page_size)  # __post_init__ checks them
    if isinstance(sizes, paged_attention_gpu.GPUBlockSizes):
        sizes.keys_per_block(page_size)
    elif isinstance(sizes, pallas_ragged.RaggedBlockSizes):
        sizes.check_page_size(page_size)


def query_positions(kv_lens: jax.Array, q_lens: jax.Array, num_q_tokens: int) -> jax.Array:
    """i32[B, T] position of each query token: ``kv_lens - q_lens + t``."""
    return (kv_lens - q_lens)[:, None] + jnp.arange(num_q_tokens, dtype=jnp.int32)[None, :]


def gather_pages(pages: jax.Array, block_tables: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """[K, P, L, H] pages (or the stacked [layers, K, P, L, H] pool and an
    i32[] ``layer``), i32[B, pages_per_seq] -> [K, B, pages_per_seq * L, H].
    The stacked pool is read with one gather, never a copy of the layer."""
    num_kv_heads, _, page_size, head_dim = pages.shape[-4:]
    batch, pages_per_seq = block_tables.shape
    if layer is None:
        picked = pages[:, block_tables]
    else:
        picked = pages[layer, jnp.arange(num_kv_heads)[:, None, None], block_tables[None]]
    return picked.reshape(num_kv_heads, batch, pages_per_seq * page_size, head_dim)


def xla_paged_attention(
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
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """Causal GQA attention of ``q`` over each sequence's paged K/V, in XLA
    (``impl="xla"``); see :func:`unchecked_xla_paged_attention` for the
    arguments and result. With ``layer``, the pages are the stacked pool
    ``[layers, K, P, L, H]`` and layer ``layer`` is read in place.

    Raises:
      ValueError: inputs failing :func:`validate_inputs`, or options that
        are not positive (``pallas_kernels.common.validate_options``);
        (eager) lengths past a row's table or a layer outside the pool.
    """
    _, kv_lens, q_lens, layer = check_paged_attention(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens, impl="xla", scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, layer=layer)
    return unchecked_xla_paged_attention(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens, layer,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
    )


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
def unchecked_xla_paged_attention(
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [K, P, L, H]
    v_pages: jax.Array,  # [K, P, L, H]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array,  # i32[B]
    layer: jax.Array | None = None,  # i32[]
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal GQA attention of ``q`` over each sequence's paged K/V, trusting
    its inputs (checked by :func:`check_paged_attention`).

    Args:
      q: [B, T, N, H] queries, ``q_lens[b]`` real rows per sequence.
      k_pages, v_pages: [K, P, L, H] one layer's pages, or the stacked
        [layers, K, P, L, H] pool with ``layer``.
      block_tables: i32[B, pages_per_seq] page ids; entries past a
        sequence's length may point anywhere in the pool (usually the null
        page).
      kv_lens: i32[B] tokens in the cache per sequence, query tokens
        included, ``<= pages_per_seq * L``.
      q_lens: i32[B] real query tokens per sequence, ``<= min(T, kv_lens)``.
      layer: i32[] the stacked pool's layer (in range), or None.
      scale: logit scale, default ``1 / sqrt(H)``.
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``
        (Gemma 2) before masking.
      sliding_window: if set, a query at position ``p`` sees keys in
        ``(p - sliding_window, p]``.

    Returns:
      [B, T, N, H] in ``q.dtype``; zeros for padding rows and empty
      sequences, non-finite where a logit or value a row sees is. Computed
      in f32.
    """
    batch, num_q_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[-4]
    group = num_q_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)

    k = gather_pages(k_pages, block_tables, layer).astype(jnp.float32)  # [K, B, S, H]
    v = gather_pages(v_pages, block_tables, layer).astype(jnp.float32)  # [K, B, S, H]
    num_keys = k.shape[2]

    q_pos = query_positions(kv_lens, q_lens, num_q_tokens)  # [B, T]
    k_pos = jnp.arange(num_keys, dtype=jnp.int32)  # [S]
    q_real = jnp.arange(num_q_tokens)[None, :] < q_lens[:, None]  # [B, T]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & q_real[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    key_real = k_pos[None, :] < kv_lens[:, None]  # [B, S]
    mask &= key_real[:, None, :]

    # One batched matmul per (KV head, sequence) with the G query heads and T
    # query tokens merged into M = G * T rows: 2.3x faster on CPU than
    # contracting "BTKGH,KBSH" directly (prefill, T = 1024, SmolLM2 heads).
    # q: [B, T, K, G, H] -> [K, B, G * T, H]
    qg = q.astype(jnp.float32).reshape(batch, num_q_tokens, num_kv_heads, group, head_dim) * scale
    qg = qg.transpose(2, 0, 3, 1, 4).reshape(num_kv_heads, batch, group * num_q_tokens, head_dim)
    logits = jnp.einsum("KBMH,KBSH->KBMS", qg, k)
    logits = logits.reshape(num_kv_heads, batch, group, num_q_tokens, num_keys)  # [K, B, G, T, S]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    mask = mask[None, :, None, :, :]  # [1, B, 1, T, S]
    # Masked logits are replaced, not added to, so NaN in a slot no query may
    # see does not propagate.
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # all-masked rows
    probs = jnp.where(mask, jnp.exp(logits - row_max), 0.0)  # [K, B, G, T, S]
    denom = probs.sum(axis=-1, keepdims=True)  # [K, B, G, T, 1]
    v = jnp.where(key_real[None, :, :, None], v, 0.0)  # 0 * NaN would be NaN
    out = jnp.einsum(
        "KBMS,KBSH->KBMH", probs.reshape(num_kv_heads, batch, group * num_q_tokens, num_keys), v
    ).reshape(num_kv_heads, batch, group, num_q_tokens, head_dim)
    # Rows that see no key give zeros, chosen by the mask: a row that sees a
    # key with a NaN (or all -inf) logit has a NaN (or 0) denominator, and its
    # output must be NaN (a corrupt cache must show, not turn into a zero).
    seen = q_real[None, :, None, :, None]  # [1, B, 1, T, 1]: every real row sees its own key
    out = jnp.where(seen, out / jnp.where(seen, denom, 1.0), 0.0)
    out = out.transpose(1, 3, 0, 2, 4)  # [B, T, K, G, H]
    return out.reshape(batch, num_q_tokens, num_q_heads, head_dim).astype(q.dtype)


def xla_paged_decode_attention(
    q: jax.Array,  # [B, N, H]
    k_pages: jax.Array,  # [K, P, L, H]
    v_pages: jax.Array,  # [K, P, L, H]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    **kwargs,
) -> jax.Array:
    """Decode: one query per sequence attending to its ``lengths[b]`` cached
    tokens (the query's own K/V included). Returns [B, N, H]; zeros where
    ``lengths == 0``. Keyword options as :func:`xla_paged_attention`."""
    q_lens = jnp.minimum(lengths, 1).astype(jnp.int32)
    return xla_paged_attention(q[:, None], k_pages, v_pages, block_tables, lengths, q_lens, **kwargs)[:, 0]


def paged_attention(
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [K, P, L, H] float, or quantized (int8, fp8) with scales
    v_pages: jax.Array,  # [K, P, L, H]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array,  # i32[B]
    *,
    impl: str = "auto",
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,  # f32[K, P, L] with quantized pages
    v_scales: jax.Array | None = None,  # f32[K, P, L] with quantized pages
    layer: int | jax.Array | None = None,  # i32[] with the stacked pool
) -> jax.Array:
    """Paged attention with a choice of implementation (see :data:`IMPLS`).

    Same arguments and result as :func:`xla_paged_attention`, plus ``impl``
    and per-token scales for quantized pages (``pallas_kernels.common``; the XLA
    path dequantizes the pages first, the kernels never do). Queries are
    unscaled: every implementation applies ``scale`` (default
    ``1 / sqrt(H)``) exactly once. Jittable (``impl`` and the options static).

    With ``layer`` the pages are the stacked pool ``[layers, K, P, L, H]``
    (scales ``[layers, K, P, L]``) and every implementation reads layer
    ``layer``'s pages where they sit: no layer slice is copied per call.

    The one place this call is validated (:func:`check_paged_attention`);
    the implementation under it trusts its inputs
    (:func:`unchecked_paged_attention`).

    Raises:
      ValueError: unknown ``impl``, or inputs that fail
        :func:`validate_inputs` / ``pallas_kernels.common.validate_inputs``;
        (eager calls) lengths past a row's block table or ``q_lens >
        kv_lens`` (``pallas_kernels.common.checked_lengths``; under ``jit``
        they are clamped, so no row reads another's pages), or a layer
        outside the pool (clamped under ``jit``).
    """
    options = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    impl, kv_lens, q_lens, layer = check_paged_attention(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens, impl=impl, k_scales=k_scales, v_scales=v_scales,
        layer=layer, **options)
    return unchecked_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_lens, impl=impl,
                                     k_scales=k_scales, v_scales=v_scales, layer=layer, **options)


def _block_sizes(impl: str, num_q_tokens: int, page_size: int):
    """The kernel tiling :func:`unchecked_paged_attention` uses for ``impl``
    (resolved) and this call's static sizes; None on the XLA path."""
    if impl == "xla" or (impl in ("pallas_tpu", "xla_loop") and num_q_tokens > 1):
        return None
    if impl == "xla_loop":
        return paged_attention_cpu.CPUBlockSizes(pages_per_compute_block=max(1, 128 // page_size))
    # At least 64 keys per compute block: fewer loop steps, and Triton's >= 16.
    ppcb = max(1, 64 // page_size)
    if num_q_tokens == 1 and impl == "pallas_gpu":
        return paged_attention_gpu.GPUBlockSizes(pages_per_compute_block=ppcb)
    if num_q_tokens == 1 and impl == "pallas_tpu":
        return paged_attention_tpu.TPUBlockSizes(pages_per_compute_block=ppcb)
    return pallas_ragged.RaggedBlockSizes(pages_per_compute_block=ppcb)


def unchecked_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, impl: str, scale=None,
                              soft_cap=None, sliding_window=None, k_scales=None, v_scales=None,
                              layer=None) -> jax.Array:
    """:func:`paged_attention` trusting its inputs: the same arguments and
    result, as :func:`check_paged_attention` returns them (``impl``
    resolved, lengths in range, ``layer`` an i32[] in the pool or None). No
    check here nor in the kernel under it (its ``unchecked_<name>``)."""
    options = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    num_q_tokens = q.shape[1]
    sizes = _block_sizes(impl, num_q_tokens, k_pages.shape[-2])
    if sizes is None:  # the XLA path
        if k_scales is not None:
            if layer is not None:  # the XLA path dequantizes one layer, not the pool
                k_pages, v_pages, k_scales, v_scales = (x[layer] for x in (k_pages, v_pages, k_scales, v_scales))
                layer = None
            k_pages, v_pages = common.dequantize_kv(k_pages, k_scales), common.dequantize_kv(v_pages, v_scales)
        return unchecked_xla_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_lens, layer, **options)
    if impl == "pallas_ragged" or num_q_tokens > 1:
        return pallas_ragged.unchecked_ragged_paged_attention(
            q, k_pages, v_pages, block_tables, kv_lens, q_lens, k_scales, v_scales, block_sizes=sizes,
            layer=layer, **options)
    kernel = {"xla_loop": paged_attention_cpu.unchecked_paged_attention_cpu,
              "pallas_gpu": paged_attention_gpu.unchecked_paged_attention_gpu,
              "pallas_tpu": paged_attention_tpu.unchecked_paged_attention_tpu}[impl]
    lengths = jnp.where(q_lens > 0, kv_lens, 0)  # a padding row attends to nothing
    out = kernel(q[:, 0], k_pages, v_pages, block_tables, lengths, k_scales, v_scales, block_sizes=sizes,
                 layer=layer, **options)
    return out[:, None]


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's position within its segment (packed sequences restart at 0).

    Args:
      segment_ids: i32[B, T] segment of each token; tokens of one segment are
        contiguous (a new segment starts wherever the id changes).

    Returns:
      i32[B, T]: ``t - start(t)``, where ``start(t)`` is the first index of
      the run of equal ids that ``t`` belongs to.
    """
    num_tokens = segment_ids.shape[1]
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]  # [1, T]
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)  # [B, T]
    return t - start


def causal_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, T, K, H]
    v: jax.Array,  # [B, T, K, H]
    segment_ids: jax.Array,  # i32[B, T]
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Dense causal GQA attention over contiguous K/V, with packed segments.

    The training path's attention (no pages, no cache): token ``t`` sees
    tokens ``s <= t`` of its own segment (and with ``sliding_window``, only
    ``t - s < sliding_window``). Padding is a segment of its own (for
    example id 0): its rows attend among themselves and their outputs are
    finite and meaningless; the loss masks them. Same scale, soft cap and
    masking semantics as :func:`xla_paged_attention`, so a model trained
    through it decodes identically through the paged cache.

    Args:
      q: [B, T, N, H] queries (RoPE applied).
      k, v: [B, T, K, H] keys and values of the same tokens.
      segment_ids: i32[B, T] segment of each token (contiguous runs).
      scale: logit scale, default ``1 / sqrt(H)``.
      soft_cap: if set, ``soft_cap * tanh(logits / soft_cap)``.
      sliding_window: if set, keys within this many tokens (itself included).

    Returns:
      [B, T, N, H] in ``q.dtype``, computed in f32. Cost O(T^2) per row:
      meant for training lengths, not long-context serving.
    """
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    mask = (t[None, :, None] >= t[None, None, :]) & (
        segment_ids[:, :, None] == segment_ids[:, None, :])  # [B, T, S]
    if sliding_window is not None:
        mask &= t[None, :, None] - t[None, None, :] < sliding_window
    qg = q.astype(jnp.float32).reshape(batch, num_tokens, num_kv_heads, group, head_dim) * scale
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32))
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    # A large finite negative rather than -inf: every row sees its own key,
    # and the gradient through the masked entries stays exactly zero.
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)  # [B, K, G, T, S]
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(jnp.float32))
    return out.reshape(batch, num_tokens, num_q_heads, head_dim).astype(q.dtype)
