"""Ragged paged attention over a flat token batch, in XLA: cost follows the
sum of lengths, not the longest row, and no length is part of the shape.

The engine's mixed prefill+decode batch (vLLM v1's layout; JAX's TPU
``ragged_paged_attention`` packs tokens the same way) is *flat*: the ``T``
tokens of one model call sit in one array, sequence ``s`` owning rows
``[q_starts[s], q_starts[s] + q_lens[s])``, the last ``q_lens[s]`` of its
``kv_lens[s]`` cached tokens. A decoding sequence has ``q_lens = 1``, a
prefill chunk anything up to the whole prompt.

Padding every sequence to the longest (the padded ``[B, T]`` XLA path of
:mod:`paged_jax.attention.paged`) costs ``B x max_len`` per call. Here the work is
split the way flash-decoding and FlashInfer split it, into a list of *work
items*, each one query tile (up to ``tile_q`` consecutive query tokens of one
sequence) against one key block (``pages_per_block`` consecutive pages of the
same sequence, up to the tile's causal limit). The list is walked in chunks
of ``work_chunk`` items by a loop whose trip count is a traced value: each
chunk computes partial softmaxes (max, sum, weighted values) and merges them
into per-tile accumulators (the log-sum-exp merge of Milakov and Gimelshein,
2018). The cost is the sum over tiles of their blocks (the sum of lengths,
plus at most one partial block per tile), rounded up to whole chunks, and
since the amount of work is not a static size, one compiled program serves
every mix of lengths with the same number of tokens.

Tiles and items are derived on device from the per-sequence lengths
(:func:`count_work` gives the host the same numbers), so the call takes only
arrays the engine already has: block tables and three length vectors. The
formula is ``pallas_kernels.flat_batch``'s, which the flat Pallas kernels
tile with too.

On GPU and TPU :func:`attend` runs the flat kernel instead
(``pallas_kernels.flat_ragged_attention``, :data:`FLAT_KERNELS`): the same
packed batch and tiles, one Pallas program per tile and KV head; and
:func:`unchecked_write_attend` lets it write the call's K/V in the same call
(the decoder then issues no scatter of its own). This XLA work list stays
the CPU engine's path (Pallas runs only in interpret mode there).

Pages are read from the stacked pool ``[layers, K, P, L, H]`` with a layer
index, so a layer's slice is never copied out of the pool. A work item only
names block-table entries below its sequence's length, clamped to the table
width, so no length can make a sequence read another's pages.

Neighbour isolation: a tile's accumulators are only ever updated with its
own items, so a sequence's output does not depend, to the bit, on other
sequences' K/V contents. Non-finite values are not hidden: a NaN or inf in a
logit or value a row sees makes its output non-finite; only rows that see no
key (padding) are zeros.

The door. :func:`attend` (the engine's attention, and what
:func:`models.ragged.forward_ragged` checks once per model call with
:func:`check_attend`) and :func:`ragged_paged_attention` validate their
arguments; :func:`unchecked_attend`, :func:`unchecked_write_attend` and
:func:`unchecked_ragged_paged_attention` under them trust theirs, and so does
everything they call (the flat kernel's ``unchecked_`` entry).

Axis letters: the alphabet of ``models/__init__.py`` (T flat query tokens,
E sequence rows, ...); the work list adds U tiles, Q rows of a tile
(``tile_q``), M = G * Q rows of a tile per KV head, W work items of a loop
step, J pages of a work item and C = J * L keys of a work item.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.attention import paged as attention
from paged_jax.attention.batch import RaggedBatch
from paged_jax.checks import check_int
from paged_jax.paging.kv_cache import KVPool, unchecked_write_layer_kv
from pallas_kernels import common
from pallas_kernels import flat_ragged_attention as flat
from pallas_kernels.flat_batch import cdiv, check_flat_batch, check_tiles, count_work, tile_blocks, tiles

# count_work and tile_blocks live in pallas_kernels.flat_batch (the flat kernels' formula) and are re-exported.
__all__ = ["FLAT_KERNELS", "attend", "check_attend", "count_work", "kernel_writes_kv", "ragged_paged_attention",
           "tile_blocks", "unchecked_attend", "unchecked_ragged_paged_attention", "unchecked_write_attend"]

FLAT_KERNELS = {"pallas_gpu": "gpu", "pallas_ragged": "gpu", "pallas_tpu": "tpu"}
"""The ``impl`` names of :data:`paged_jax.attention.paged.IMPLS` that mean a
Pallas kernel, and the flat kernel's implementation each runs on a flat
batch (``pallas_kernels.flat_ragged_attention``). The XLA names (``"xla"``,
``"xla_loop"``) run the work list here."""

FLAT_BLOCK_SIZES = flat.FlatBlockSizes()
"""The flat kernels' tiling (their defaults)."""


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pool: jax.Array,  # [layers, K, P, L, H]
    v_pool: jax.Array,  # [layers, K, P, L, H]
    layer: jax.Array,  # i32[]
    block_tables: jax.Array,  # i32[E, pages_per_seq]
    q_starts: jax.Array,  # i32[E]
    q_lens: jax.Array,  # i32[E]
    kv_lens: jax.Array,  # i32[E]
    *,
    num_tiles: int,
    tile_q: int = 32,
    pages_per_block: int = 4,
    work_chunk: int = 32,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,  # f32[layers, K, P, L] with quantized pools
    v_scales: jax.Array | None = None,  # f32[layers, K, P, L] with quantized pools
) -> jax.Array:
    """Causal GQA attention of a flat token batch over its sequences' pages.

    Args:
      q: [T, N, H] queries (unscaled), flat: sequence ``s`` owns rows
        ``q_starts[s] + t`` for ``t < q_lens[s]``; rows no sequence owns are
        padding.
      k_pool, v_pool: [layers, K, P, L, H] the stacked pool, float or
        quantized (int8, fp8); the new tokens' K/V already written.
      layer: i32[] which layer's pages to read.
      block_tables: i32[E, pages_per_seq] each sequence's pages.
      q_starts: i32[E] first flat row of each sequence's queries.
      q_lens: i32[E] query tokens per sequence; 0 leaves the row out.
      kv_lens: i32[E] cached tokens per sequence, queries included. Query
        ``t`` of sequence ``s`` sits at position ``kv_lens[s] - q_lens[s] + t``
        and sees keys at positions ``<=`` its own. Lengths past the table
        width ``pages_per_seq * L`` are refused eagerly and clamped under
        ``jit`` (``pallas_kernels.common.checked_lengths``, as every
        paged-attention entry point).
      num_tiles: static, at least :func:`count_work`'s first number (tiles
        beyond it would be dropped; :func:`paged_jax.attention.batch.batch_shape`
        guarantees it).
      tile_q: query tokens per tile (static).
      pages_per_block: pages per work item (static).
      work_chunk: work items per loop step (static).
      scale: logit scale, default ``1 / sqrt(H)``.
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``.
      sliding_window: a query at ``p`` sees keys in ``(p - window, p]``.
      k_scales, v_scales: f32[layers, K, P, L] per-token scales of a
        quantized pool (``pallas_kernels.common.quantize_kv``), applied to
        each work item's gathered keys and values; None for a float pool.

    Returns:
      [T, N, H] in ``q.dtype``, computed in f32; zeros in padding rows,
      non-finite where a logit or value a row sees is.

    Raises:
      ValueError: shapes that do not fit each other, a static size below 1,
        options that are not positive; when the lengths are concrete (not
        traced): a length outside its range (``checked_lengths``),
        sequences whose rows overlap or pass ``T``, or ``num_tiles`` below
        :func:`count_work`'s (work would be dropped).
    """
    for name, value in (("num_tiles", num_tiles), ("tile_q", tile_q), ("pages_per_block", pages_per_block),
                        ("work_chunk", work_chunk)):
        check_int(name, value)
    common.validate_options(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    layer, (q_starts, q_lens, kv_lens) = check_flat_batch(q, k_pool, v_pool, layer, block_tables, q_starts, q_lens,
                                                          kv_lens, k_scales, v_scales)
    check_tiles(q_lens, kv_lens, num_tiles=num_tiles, tile_q=tile_q)
    return unchecked_ragged_paged_attention(
        q, k_pool, v_pool, layer, block_tables, q_starts, q_lens, kv_lens, num_tiles=num_tiles, tile_q=tile_q,
        pages_per_block=pages_per_block, work_chunk=work_chunk, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales)


def unchecked_ragged_paged_attention(q, k_pool, v_pool, layer, block_tables, q_starts, q_lens, kv_lens, *,
                                     num_tiles: int, tile_q: int = 32, pages_per_block: int = 4,
                                     work_chunk: int = 32, scale=None, soft_cap=None, sliding_window=None,
                                     k_scales=None, v_scales=None, value_dim: int | None = None,
                                     expand: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """:func:`ragged_paged_attention` trusting its inputs: the same arguments
    and result, with i32 lengths in their ranges (as :func:`check_attend`
    returns them), rows that do not overlap, ``num_tiles`` enough for the
    lengths and ``layer`` an i32[] in the pool.

    ``value_dim``: MLA's latent mode (:func:`attend`'s ``latent_dim``): a
    value is the first ``value_dim`` columns of the key already gathered
    (``v_pool`` and ``v_scales`` are not read), and the output is [T, N,
    value_dim]: one gather a work item, not two.

    ``expand``: MLA's expanded form
    (:func:`paged_jax.attention.latent.expanded_ragged_attention`):
    ``(w_uk [N, H, C], w_uv [N, C, O])`` with ``value_dim`` = C; ``k_pool``
    a latent pool (one KV head of ``[c, k_pe]`` rows) and ``q`` [T, N, H +
    R] the query as the checkpoint computes it (not absorbed). Each work
    item's gathered latents are projected up to per-head keys ``[W_UK c,
    k_pe]`` and values ``W_UV^T c`` once for the tile's ``tile_q``
    queries, which then attend as N heads of a group of one; the output is
    [T, N, O]."""
    t_total, num_q_heads, head_dim = q.shape
    out_dim = head_dim if value_dim is None else value_dim
    num_kv_heads, page_size = k_pool.shape[1], k_pool.shape[3]
    if expand is not None:  # the up-projections as one matmul each over the gathered latents: [C, N * H], [C, N * O]
        lat_dim, out_dim = value_dim, expand[1].shape[2]
        w_k = expand[0].astype(jnp.float32).transpose(2, 0, 1).reshape(lat_dim, -1)
        w_v = expand[1].astype(jnp.float32).transpose(1, 0, 2).reshape(lat_dim, -1)
        num_kv_heads = num_q_heads
    group = num_q_heads // num_kv_heads
    pages_per_seq = block_tables.shape[1]
    block_tokens = pages_per_block * page_size
    rows_m = group * tile_q
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    i32 = jnp.int32

    # --- tiles: U = num_tiles -> (sequence, first row within it), the flat kernels' formula
    t = tiles(q_lens, kv_lens, num_tiles=num_tiles, tile_q=tile_q)
    tile_seq, row0, rows_in_tile, first_pos = t.seq, t.row0, t.rows, t.first_pos  # [U]
    first_block, n_blocks = tile_blocks(first_pos, t.last_pos, block_tokens=block_tokens,
                                        sliding_window=sliding_window, xp=jnp)
    n_blocks = jnp.where(rows_in_tile > 0, n_blocks, 0)
    work_end = jnp.cumsum(n_blocks)  # [U]
    work_begin = work_end - n_blocks
    total_work = work_end[-1]

    # --- queries per tile: [U, Q] flat rows -> [U, K, M, H] (m = g * Q + t)
    r = jnp.arange(tile_q, dtype=i32)
    tile_rows = q_starts[tile_seq][:, None] + row0[:, None] + r[None, :]  # [U, Q]
    row_real = r[None, :] < rows_in_tile[:, None]
    q_tile = q[jnp.where(row_real, tile_rows, 0)].astype(jnp.float32) * scale  # [U, Q, N, H]
    q_tile = q_tile.reshape(num_tiles, tile_q, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    q_tile = q_tile.reshape(num_tiles, num_kv_heads, rows_m, head_dim)
    q_pos = first_pos[:, None] + r[None, :]  # [U, Q]
    c_idx = jnp.arange(block_tokens, dtype=i32)
    j = jnp.arange(pages_per_block, dtype=i32)

    def chunk(c, acc):
        m_acc, l_acc, o_acc = acc  # [U, K, M], [U, K, M], [U, K, M, H]
        w = c * work_chunk + jnp.arange(work_chunk, dtype=i32)  # [W]
        w_real = w < total_work
        w_tile = jnp.minimum(jnp.searchsorted(work_end, w, side="right"), num_tiles - 1).astype(i32)
        w_block = first_block[w_tile] + w - work_begin[w_tile]
        w_seq = tile_seq[w_tile]
        col = w_block[:, None] * pages_per_block + j[None, :]  # [W, J] block-table columns
        col_ok = (col < pages_per_seq) & w_real[:, None]
        pages = jnp.where(col_ok, block_tables[w_seq[:, None], jnp.minimum(col, pages_per_seq - 1)], 0)
        # One gather from the stacked pool; ``k_pool[layer]`` first would
        # copy the whole layer.
        k = k_pool[layer, :, pages].astype(jnp.float32)  # [W, J, K, L, H]
        if k_scales is not None:  # quantized: dequantize the gathered item, never the pool
            k = k * k_scales[layer, :, pages][..., None]  # scales [W, J, K, L]
        if expand is not None:  # [W, J, 1, L, C + R] latents -> per-head keys and values [W, J, N, L, H + R | O]
            lat = k[:, :, 0]
            up = lambda w: (lat[..., :value_dim] @ w).reshape(*lat.shape[:3], num_kv_heads, -1).swapaxes(2, 3)  # noqa: E731
            k_pe = jnp.broadcast_to(lat[:, :, None, :, value_dim:], (*lat.shape[:2], num_kv_heads, *lat.shape[2:3],
                                                                     lat.shape[3] - value_dim))
            k, v = jnp.concatenate([up(w_k), k_pe], axis=-1), up(w_v)
        elif value_dim is not None:  # a latent: the value is the key's first columns, gathered once
            v = k[..., :value_dim]
        else:
            v = v_pool[layer, :, pages].astype(jnp.float32)
            if v_scales is not None:
                v = v * v_scales[layer, :, pages][..., None]
        logits = jnp.einsum("WKMH,WJKLH->WKMJL", q_tile[w_tile], k)
        logits = logits.reshape(work_chunk, num_kv_heads, rows_m, block_tokens)  # [W, K, M, C]
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        k_pos = w_block[:, None] * block_tokens + c_idx[None, :]  # [W, C]
        k_ok = (k_pos < kv_lens[w_seq][:, None]) & w_real[:, None]
        qp = q_pos[w_tile]  # [W, Q]
        mask = (k_pos[:, None, :] <= qp[:, :, None]) & row_real[w_tile][:, :, None] & k_ok[:, None, :]
        if sliding_window is not None:
            mask &= k_pos[:, None, :] > qp[:, :, None] - sliding_window
        mask = jnp.tile(mask, (1, group, 1))[:, None]  # [W, 1, M, C]
        # Masked logits are replaced, not added to, so NaN in a slot no query
        # may see (a freed page, the null page) never propagates.
        logits = jnp.where(mask, logits, -jnp.inf)
        m = jnp.max(logits, axis=-1)  # [W, K, M]
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(mask, jnp.exp(logits - m_safe[..., None]), 0.0)
        v = jnp.where(k_ok.reshape(work_chunk, pages_per_block, 1, page_size, 1), v, 0.0)  # 0 * NaN is NaN
        p_pages = p.reshape(*p.shape[:3], pages_per_block, page_size)  # [W, K, M, J, L]

        def exact(p, v):
            # A non-finite value in a slot the sequence owns reaches exactly the rows that see its key: zeroed
            # in the sum (a key masked for a row, after it or out of its window, would leak: 0 * NaN is NaN),
            # then put back where a row sees it, dimension by dimension as a plain sum would.
            finite = jnp.isfinite(v)
            o = jnp.einsum("WKMJL,WJKLH->WKMH", p, jnp.where(finite, v, 0.0))
            seen = mask[:, 0].reshape(work_chunk, rows_m, pages_per_block, page_size).astype(jnp.float32)
            seen_bad = jnp.einsum("WMJL,WJKLH->WKMH", seen, (~finite).astype(jnp.float32))
            return jnp.where(seen_bad > 0, jnp.nan, o)

        # Only a corrupt cache pays for it: the plain product otherwise.
        o = jax.lax.cond(jnp.all(jnp.isfinite(v)), lambda p, v: jnp.einsum("WKMJL,WJKLH->WKMH", p, v), exact,
                         p_pages, v)
        # Merge into the tiles' accumulators; padding items go nowhere.
        seg = jnp.where(w_real, w_tile, num_tiles)
        m_new = jnp.maximum(m_acc, jax.ops.segment_max(m, seg, num_segments=num_tiles, indices_are_sorted=True))
        m_new_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        keep = jnp.where(jnp.isfinite(m_acc), jnp.exp(m_acc - m_new_safe), 0.0)  # [U, K, M]
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_new_safe[w_tile]), 0.0)  # [W, K, M]
        l_acc = l_acc * keep + jax.ops.segment_sum(p.sum(-1) * alpha, seg, num_segments=num_tiles,
                                                   indices_are_sorted=True)
        o_acc = o_acc * keep[..., None] + jax.ops.segment_sum(o * alpha[..., None], seg, num_segments=num_tiles,
                                                              indices_are_sorted=True)
        return m_new, l_acc, o_acc

    acc = (
        jnp.full((num_tiles, num_kv_heads, rows_m), -jnp.inf, jnp.float32),
        jnp.zeros((num_tiles, num_kv_heads, rows_m), jnp.float32),
        jnp.zeros((num_tiles, num_kv_heads, rows_m, out_dim), jnp.float32),
    )
    _, l_acc, o_acc = jax.lax.fori_loop(0, cdiv(total_work, work_chunk), chunk, acc)
    # Only padding rows see no key (a real row sees its own): zeros by row,
    # not by ``l_acc > 0``, which would also zero a NaN ``l_acc`` (a NaN
    # logit or value the row sees: a corrupt weight served as tokens).
    seen = jnp.tile(row_real, (1, group))[:, None, :]  # [U, 1, M]
    o_tile = jnp.where(seen[..., None], o_acc / jnp.where(seen, l_acc, 1.0)[..., None], 0.0)

    # [U, K, G * Q, H] -> [U, Q, N, H] -> flat rows
    o_tile = o_tile.reshape(num_tiles, num_kv_heads, group, tile_q, out_dim).transpose(0, 3, 1, 2, 4)
    o_tile = o_tile.reshape(num_tiles * tile_q, num_q_heads, out_dim)
    dest = jnp.where(row_real, tile_rows, t_total).reshape(-1)
    out = jnp.zeros((t_total, num_q_heads, out_dim), jnp.float32).at[dest].set(o_tile, mode="drop")
    return out.astype(q.dtype)


def kernel_writes_kv(impl: str) -> bool:
    """Whether ``impl`` (resolved) writes the call's K/V inside its attention
    call (:func:`unchecked_write_attend`: the flat Pallas kernels), so a
    decoder issues no separate scatter."""
    return impl in FLAT_KERNELS


def check_attend(
    q,  # [T, N, H] an array or a jax.ShapeDtypeStruct
    k_pool: jax.Array,  # [layers, K, P, L, H]
    v_pool: jax.Array,  # [layers, K, P, L, H]
    layer,  # i32[] or int
    batch: RaggedBatch,
    *,
    impl: str = "auto",
    k_scales: jax.Array | None = None,  # f32[layers, K, P, L] with quantized pools
    v_scales: jax.Array | None = None,
    latent_dim: int | None = None,
    **options,
) -> tuple[str, jax.Array, RaggedBatch]:
    """The checks of :func:`attend`'s door, for a caller that validates once
    and then calls :func:`unchecked_attend` or :func:`unchecked_write_attend`
    (a decoder: once per model call, not once per layer). Same arguments;
    only ``q``'s shape and dtype are read.

    Returns:
      ``(impl, layer, batch)``: ``impl`` with ``"auto"`` resolved, ``layer``
      as i32[] in the pool and ``batch`` with i32 lengths clamped to their
      ranges: what the unchecked calls may trust, even under ``jit``.

    Raises:
      ValueError: an unknown ``impl`` or option; options that are not
        positive; shapes that do not fit each other; a page size the chosen
        kernel cannot tile; (eager calls) lengths outside their ranges,
        sequences whose rows overlap or pass ``T``, a layer outside the
        pool, or a ``batch.shape`` that cannot hold the batch's classes
        (work would be dropped).
    """
    impl = attention.resolve_impl(impl)
    unknown = set(options) - {"scale", "soft_cap", "sliding_window"}
    if unknown:
        raise ValueError(f"unknown attention options {sorted(unknown)}; expected scale, soft_cap, sliding_window")
    common.validate_options(scale=options.get("scale"), soft_cap=options.get("soft_cap"),
                            sliding_window=options.get("sliding_window"))
    layer, (q_starts, q_lens, kv_lens) = check_flat_batch(q, k_pool, v_pool, layer, batch.block_tables,
                                                          batch.q_starts, batch.q_lens, batch.kv_lens, k_scales,
                                                          v_scales)
    shape, tiling = batch.shape, batch.shape.tiling
    if impl in FLAT_KERNELS:
        FLAT_BLOCK_SIZES.check(FLAT_KERNELS[impl], k_pool.shape[3])
    flat.check_latent_dim(latent_dim, k_pool, v_pool, None, FLAT_KERNELS.get(impl, "xla"), k_scales, v_scales)
    if not isinstance(q_lens, jax.core.Tracer):
        ql, kl = np.asarray(q_lens), np.asarray(kv_lens)
        chunks = int(np.sum(ql > 1))
        if chunks > tiling.max_prefill_chunks or (chunks and not shape.prefill_tiles) or (
                np.any(ql == 1) and not shape.decode_tiles):
            raise ValueError(
                f"batch.shape does not fit batch.q_lens: {chunks} chunks of 2+ tokens (max_prefill_chunks="
                f"{tiling.max_prefill_chunks}), decode_tiles={shape.decode_tiles}, prefill_tiles="
                f"{shape.prefill_tiles}; build it with paged_jax.attention.batch.batch_shape"
            )
        # Decode tiles are one per sequence everywhere; the flat kernels size
        # their chunk tiles from max_prefill_chunks (flat_batch.prefill_tiles),
        # the work list from prefill_tiles.
        check_tiles(np.where(ql == 1, ql, 0), kl, num_tiles=shape.decode_tiles, tile_q=1, what="decode_tiles")
        if impl not in FLAT_KERNELS:
            check_tiles(np.where(ql > 1, ql, 0), kl, num_tiles=shape.prefill_tiles, tile_q=tiling.prefill_tile_q,
                        what="prefill_tiles")
    return impl, layer, batch.replace(q_starts=q_starts, q_lens=q_lens, kv_lens=kv_lens)


def attend(
    q: jax.Array,  # [T, N, H]
    k_pool: jax.Array,  # [layers, K, P, L, H]
    v_pool: jax.Array,  # [layers, K, P, L, H]
    layer: jax.Array,  # i32[]
    batch: RaggedBatch,
    *,
    impl: str = "auto",
    k_scales: jax.Array | None = None,  # f32[layers, K, P, L] with quantized pools
    v_scales: jax.Array | None = None,
    latent_dim: int | None = None,
    **options,
) -> jax.Array:
    """Attention for a :class:`paged_jax.attention.batch.RaggedBatch`: its one-token
    sequences (decode) and its longer chunks, each class in its own pass,
    in one program. Validated here (:func:`check_attend`), computed by
    :func:`unchecked_attend`.

    Args:
      q: [T, N, H] the batch's queries.
      k_pool, v_pool: [layers, K, P, L, H] with this call's K/V written.
      layer: i32[] the layer.
      batch: the flat batch (block tables, starts and lengths, static sizes).
      impl: ``"xla"`` (and ``"xla_loop"``, whose CPU decode loop serves
        padded batches only): :func:`ragged_paged_attention` (decode with
        one-token tiles, chunks with ``batch.shape.tiling.prefill_tile_q``-token
        tiles); a Pallas name of :data:`paged_jax.attention.paged.IMPLS`: the flat
        kernel of :data:`FLAT_KERNELS` over the packed batch as it is
        (``pallas_kernels.flat_ragged_attention``: decode tiles and chunk
        tiles, ``batch.shape.decode_tiles`` and
        ``batch.shape.tiling.max_prefill_chunks`` sizing them). ``"auto"``:
        ``"xla"`` on CPU, the backend's kernel elsewhere.
      k_scales, v_scales: the per-token scales of a quantized pool, else None.
      latent_dim: MLA's absorbed form (:mod:`paged_jax.attention.latent`):
        C of a latent pool's ``[c, k_pe]`` rows, ``v_pool`` is ``k_pool``
        and a value is a key's first C columns (the flat kernels' latent
        mode, ``pallas_kernels.flat_ragged_attention``: the GPU kernel reads
        each latent once); None for K/V pools.
      options: ``scale``, ``soft_cap``, ``sliding_window``.

    Returns:
      [T, N, H] (latent: [T, N, C]) in ``q.dtype``; zeros in padding rows,
      non-finite where a logit or value a row sees is.

    Raises:
      ValueError: as :func:`check_attend`.
    """
    impl, layer, batch = check_attend(q, k_pool, v_pool, layer, batch, impl=impl, k_scales=k_scales,
                                      v_scales=v_scales, latent_dim=latent_dim, **options)
    return unchecked_attend(q, k_pool, v_pool, layer, batch, impl=impl, k_scales=k_scales, v_scales=v_scales,
                            latent_dim=latent_dim, **options)


def unchecked_attend(
    q: jax.Array,  # [T, N, H]
    k_pool: jax.Array,  # [layers, K, P, L, H]
    v_pool: jax.Array,  # [layers, K, P, L, H]
    layer: jax.Array,  # i32[], in the pool
    batch: RaggedBatch,
    *,
    impl: str,
    k_scales: jax.Array | None = None,  # f32[layers, K, P, L] with quantized pools
    v_scales: jax.Array | None = None,
    latent_dim: int | None = None,
    **options,
) -> jax.Array:
    """:func:`attend` trusting its inputs: ``impl``, ``layer`` and ``batch``
    as :func:`check_attend` returns them. Same result."""
    if impl in FLAT_KERNELS:
        return _flat(q, None, None, k_pool, v_pool, layer, batch, None, k_scales, v_scales, impl, options,
                     latent_dim=latent_dim)[0]
    shape, tiling = batch.shape, batch.shape.tiling
    out = jnp.zeros(q.shape[:2] + (latent_dim or q.shape[2],), q.dtype)
    decode, chunk = batch.q_lens == 1, batch.q_lens > 1
    for tiles_, tile_q, ppb, work_chunk, rows in (
        (shape.decode_tiles, 1, tiling.decode_pages_per_block, min(tiling.decode_work_chunk, shape.decode_tiles),
         decode),
        (shape.prefill_tiles, tiling.prefill_tile_q, tiling.prefill_pages_per_block, tiling.prefill_work_chunk,
         chunk),
    ):
        if tiles_ == 0:
            continue
        out = out + unchecked_ragged_paged_attention(
            q, k_pool, v_pool, layer, batch.block_tables, batch.q_starts,
            jnp.where(rows, batch.q_lens, 0), jnp.where(rows, batch.kv_lens, 0),
            num_tiles=tiles_, tile_q=tile_q, pages_per_block=ppb, work_chunk=work_chunk,
            k_scales=k_scales, v_scales=v_scales, value_dim=latent_dim, **options,
        )
    return out


def unchecked_write_attend(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H] the call's new keys, row t the token of query row t
    v: jax.Array,  # [T, K, H]
    kv: KVPool,
    layer: jax.Array,  # i32[], in the pool
    batch: RaggedBatch,
    *,
    impl: str,
    **options,
) -> tuple[jax.Array, KVPool]:
    """Writes the call's K/V at ``batch.slots`` and attends, trusting its
    inputs (``impl``, ``layer`` and ``batch`` from :func:`check_attend`, the
    slots from ``kv_cache.check_slots``). A flat kernel (:func:`kernel_writes_kv`)
    does both in its call; the XLA paths scatter
    (``kv_cache.unchecked_write_layer_kv``) and then attend.

    Returns:
      ``(out [T, N, H] as :func:`attend`, kv)``: the pool with the K/V
      written (quantized for an int8 or fp8 pool), bit for bit what
      ``kv_cache.write_layer_kv`` writes. Donate ``kv``.
    """
    if impl not in FLAT_KERNELS:
        kv = unchecked_write_layer_kv(kv, layer, k, v, batch.slots)
        return unchecked_attend(q, kv.k, kv.v, layer, batch, impl=impl, k_scales=kv.k_scale, v_scales=kv.v_scale,
                                **options), kv
    out, *pool = _flat(q, k, v, kv.k, kv.v, layer, batch, batch.slots, kv.k_scale, kv.v_scale, impl, options)
    return out, KVPool(*pool)


def _flat(q, k_new, v_new, k_pool, v_pool, layer, batch, slots, k_scales, v_scales, impl, options, latent_dim=None):
    """The flat kernel over the whole batch: ``(out, k_pool, v_pool,
    k_scales, v_scales)``."""
    shape = batch.shape
    return flat.unchecked_flat_ragged_paged_attention(
        q, k_new, v_new, k_pool, v_pool, layer, batch.block_tables, batch.q_starts, batch.q_lens, batch.kv_lens,
        slots, k_scales=k_scales, v_scales=v_scales, decode_tiles=shape.decode_tiles,
        prefill_chunks=shape.tiling.max_prefill_chunks if shape.prefill_tiles else 0,
        block_sizes=FLAT_BLOCK_SIZES, impl=FLAT_KERNELS[impl], latent_dim=latent_dim, **options)
