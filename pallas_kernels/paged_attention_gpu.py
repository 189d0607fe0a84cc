"""Paged attention for GPUs: a Pallas kernel written for the Triton lowering.

Grid ``(B, K, query blocks, k_splits)``. One program owns one sequence, one KV
head, a block of query rows (all ``G`` query heads of the KV group for
``block_q`` query tokens, so each K/V page is read once per group) and one
split of the sequence's pages. It walks its pages through the block table,
``pages_per_compute_block`` pages at a time, with an online softmax in f32
(FlashAttention, Dao et al. 2022; flash-decoding splits, Dao et al. 2023), and
stops at the last page the rows can see: the sequence length, the causal
limit, and with a sliding window it also starts late. Splits are combined
after the kernel with their log-sum-exp statistics.

For decode (this module's :func:`paged_attention_gpu`), ``block_q = 1``; the
ragged kernel (``pallas_kernels.ragged_paged_attention``) reuses
:func:`flash_paged_call` with a query-block grid axis.

Sources: PagedAttention (Kwon et al., SOSP 2023, section 4.1); JAX's
``jax.experimental.pallas.ops.gpu.paged_attention`` (same grid and split
combination; this one adds causal ragged queries, sliding windows, per-token
scales of quantized (int8, fp8) pages, and scales q itself).

Triton needs power-of-two block shapes and dot operands of at least 16 rows
and columns, so the query group is padded to ``G_pad`` (a power of two with
``block_q * G_pad >= 16``), block tables are padded with page 0 to a power of
two, ``pages_per_compute_block * page_size`` must be a power of two >= 16,
and so must the head dim (64, 128, 256) on a GPU. On CPU the kernel runs in Pallas interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common, tuning

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
"""Finite stand-in for -inf in the running max, so masked rows never give
``-inf - -inf = NaN``; probabilities of masked keys are zeroed explicitly."""


def _is_pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPUBlockSizes:
    """Tiling of :func:`paged_attention_gpu`.

    Attributes:
      pages_per_compute_block: pages loaded and attended per loop step
        (power of two); ``pages_per_compute_block * page_size`` keys per step.
      k_splits: number of programs that share one sequence's pages
        (flash-decoding; a power of two); their partial results are combined
        after the kernel.
      num_warps, num_stages: Triton launch parameters.
    """

    pages_per_compute_block: int = 4
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        common.check_block_sizes(
            self,
            positive=("pages_per_compute_block", "k_splits", "num_warps", "num_stages"),
            pow2=("pages_per_compute_block", "k_splits"),
        )

    def keys_per_block(self, page_size: int) -> int:
        """Keys per compute block, checked: a power of two >= 16 (Triton).

        Raises:
          ValueError: it is not.
        """
        keys = self.pages_per_compute_block * page_size
        if not _is_pow2(keys) or keys < 16:
            raise ValueError(
                "pages_per_compute_block * page_size must be a power of two >= 16 (Triton tiles), got "
                f"{self.pages_per_compute_block} * {page_size} = {keys}"
            )
        return keys


def _kernel(
    # inputs
    layer_ref,  # i32[1] the layer of the stacked pool
    kv_len_ref,  # i32[1] this sequence's kv_len
    q_len_ref,  # i32[1] this sequence's q_len
    block_table_ref,  # i32[pages_per_seq_padded]
    q_ref,  # [M, H] query rows of one KV head, M = block_q * (G_pad / group_splits)
    k_pages_ref,  # [layers, P, L, H] one KV head's pages, every layer
    v_pages_ref,  # [layers, P, L, H] (latent: the same pages)
    *rest,  # (k_scales_ref, v_scales_ref f32[layers, P, L])?, o_ref f32[M, H or C], l_ref f32[M], m_ref f32[M]
    block_q: int,
    group: int,
    group_pad: int,
    group_splits: int,
    blocks_per_split: int,
    pages_per_compute_block: int,
    page_splits: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    quantized: bool,
    latent: int | None,
):
    if quantized:
        k_scales_ref, v_scales_ref, o_ref, l_ref, m_ref = rest
    else:
        (o_ref, l_ref, m_ref), k_scales_ref, v_scales_ref = rest, None, None
    q_block, split = pl.program_id(2), pl.program_id(3)
    rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[2]
    keys = pages_per_compute_block * page_size // page_splits  # a block is pages, or 1 / page_splits of one
    kv_len, q_len, layer = kv_len_ref[0], q_len_ref[0], layer_ref[0]

    # Row r is query token q_block * block_q + r // heads, head (program_id(1) % group_splits) * heads + r % heads
    # of the group: a program holds ``heads`` of the padded group's heads.
    heads = group_pad // group_splits
    row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    token = q_block * block_q + row // heads
    real = (token < q_len) & ((pl.program_id(1) % group_splits) * heads + row % heads < group)
    q_pos = jnp.where(real, kv_len - q_len + token, -1)  # i32[M]; -1 sees nothing

    # Keys the block's real rows can see: [key_lo, key_hi).
    first_token = q_block * block_q
    last_token = jnp.minimum(first_token + block_q, q_len) - 1
    key_hi = kv_len - q_len + last_token + 1
    key_lo = 0 if sliding_window is None else jnp.maximum(kv_len - q_len + first_token - sliding_window + 1, 0)
    block_lo = jnp.maximum(key_lo // keys, split * blocks_per_split)
    block_hi = jnp.minimum(pl.cdiv(key_hi, keys), (split + 1) * blocks_per_split)
    block_hi = jnp.where(first_token < q_len, block_hi, block_lo)  # a padding block does nothing

    compute_dtype = k_pages_ref.dtype if not quantized else q_ref.dtype
    # A latent row is two power-of-two parts (Triton tiles): the latent c (C columns, also the value) and the
    # RoPE key (R): [c, k_pe] of MLA's absorbed form, read once as keys and values both.
    parts = ((0, head_dim),) if latent is None else ((0, latent), (latent, head_dim - latent))
    # The one place q is scaled.
    qs = [(q_ref[:, pl.ds(lo, n)].astype(jnp.float32) * scale).astype(compute_dtype) for lo, n in parts]

    def body(j, carry):
        o_prev, l_prev, m_prev = carry
        # Pages are read where they sit in the stacked pool: no layer is copied out.
        if page_splits == 1:
            page_ids = block_table_ref[pl.ds(j * pages_per_compute_block, pages_per_compute_block)]
            at = (layer, page_ids, slice(None))
        else:  # keys [offset, offset + keys) of one page: a large page at a large head dim
            at = (layer, block_table_ref[j // page_splits], pl.ds((j % page_splits) * keys, keys))
        ks = [k_pages_ref[(*at, pl.ds(lo, n))].reshape(keys, n).astype(compute_dtype) for lo, n in parts]
        v = ks[0] if latent is not None else v_pages_ref[at].reshape(keys, head_dim).astype(compute_dtype)
        at = at[:-1] if page_splits == 1 else at  # the scales' index: no head dim
        k_pos = j * keys + lax.broadcasted_iota(jnp.int32, (keys,), 0)  # i32[keys]
        key_real = k_pos < kv_len
        logits = plgpu.dot(qs[0], ks[0], trans_b=True)  # f32[M, keys]
        if latent is not None:
            logits += plgpu.dot(qs[1], ks[1], trans_b=True)
        if quantized:
            k_scale = k_scales_ref[at].reshape(1, keys)
            logits = logits * k_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        visible = (k_pos[None, :] <= q_pos[:, None]) & key_real[None, :]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        logits = jnp.where(visible, logits, MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(visible, jnp.exp(logits - m_next[:, None]), 0.0)  # f32[M, keys]
        l_next = correction * l_prev + p.sum(axis=-1)
        if quantized:
            # NaN may sit in the scales of slots nobody owns; 0 * NaN is NaN.
            v_scale = jnp.where(key_real, v_scales_ref[at].reshape(keys), 0.0)
            p = p * v_scale[None, :]
        if jnp.issubdtype(v_pages_ref.dtype, jnp.floating):  # and in float or fp8 pages (int8 has no NaN)
            v = jnp.where(key_real[:, None], v, jnp.zeros_like(v))
        o_next = correction[:, None] * o_prev + plgpu.dot(p.astype(compute_dtype), v)
        return o_next, l_next, m_next

    init = (
        jnp.zeros((rows, o_ref.shape[-1]), jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
    )
    o, l, m = lax.fori_loop(block_lo, block_hi, body, init)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def flash_paged_call(
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [layers, K, P, L, H] float, or quantized (int8, fp8)
    v_pages: jax.Array,  # [layers, K, P, L, H]
    layer: jax.Array,  # i32[1]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array,  # i32[B]
    k_scales: jax.Array | None,  # f32[layers, K, P, L]
    v_scales: jax.Array | None,  # f32[layers, K, P, L]
    *,
    block_q: int,
    pages_per_compute_block: int,
    k_splits: int,
    num_warps: int,
    num_stages: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    interpret: bool,
    latent: int | None = None,
) -> jax.Array:
    """The shared kernel launch (inputs already validated, ``layer`` checked
    by ``common.checked_layer``; traceable). Pages are the stacked pool; a
    program reads layer ``layer`` of it in place (a one-layer call passes
    ``x[None]``, ``common.stack_layer``). ``block_q``,
    ``pages_per_compute_block`` and ``num_stages`` are upper bounds, fitted
    to the target chip's shared memory (``pallas_kernels.tuning``; a query
    group too large for one program is split over several,
    ``group_splits``).

    ``latent``: MLA's absorbed form (``paged_jax.attention.latent``): the
    pages are latents ``[c, k_pe]`` (H = C + R, ``latent`` = C), keys and
    values both (``v_pages`` is ``k_pages``, read once), a value the first C
    columns; q is ``[q_lat, q_pe]``; the output is [B, T, N, C]. C and R
    are each a power of two >= 16 (Triton tiles; 512 and 64 in DeepSeek-V3),
    so a row of 576 is read as two tiles.

    Raises:
      ValueError: (at trace time) float8 pages on a GPU below sm89, or no
        tiling that fits the chip (``tuning``).

    Returns:
      [B, T, N, H] (latent: [B, T, N, C]) in ``q.dtype``; zeros for padding
      rows and empty sequences, non-finite where a logit or value a row
      sees is.
    """
    batch, num_q_tokens, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    out_dim = head_dim if latent is None else latent
    tuning.check_gpu_dtype(k_pages.dtype)
    # The tiling asked for is an upper bound: stepped down to fit the chip's shared memory.
    fitted = tuning.fit_gpu_tiling(
        tuning.GPUTiling(block_q=block_q, pages_per_compute_block=pages_per_compute_block, num_stages=num_stages),
        group_pad_for=lambda bq: max(pl.next_power_of_2(group), pl.cdiv(16, bq)), page_size=page_size,
        head_dim=head_dim, itemsize=k_pages.dtype.itemsize)
    block_q, pages_per_compute_block, num_stages = fitted.block_q, fitted.pages_per_compute_block, fitted.num_stages
    page_splits, group_splits = fitted.page_splits, fitted.group_splits
    group_pad = max(pl.next_power_of_2(group), pl.cdiv(16, block_q))
    heads = group_pad // group_splits  # query heads a program holds
    rows = block_q * heads
    num_q_blocks = pl.cdiv(num_q_tokens, block_q)

    # Pad the block table to a power of two (a Triton tile) of at least one
    # compute block per split; both are powers of two, so it divides.
    pages_per_seq = pl.next_power_of_2(max(block_tables.shape[1], pages_per_compute_block * k_splits))
    block_tables = common.pad_block_tables(block_tables, pages_per_seq)
    blocks_per_split = pages_per_seq * page_splits // pages_per_compute_block // k_splits

    # q: [B, T, N, H] -> [B, K * group_splits, T_pad * heads, H], rows ordered (token, head): program h holds
    # heads [(h % group_splits) * heads, ...) of KV head h // group_splits's padded group.
    qr = q.reshape(batch, num_q_tokens, num_kv_heads, group, head_dim)
    qr = jnp.pad(qr, ((0, 0), (0, num_q_blocks * block_q - num_q_tokens), (0, 0), (0, group_pad - group), (0, 0)))
    qr = qr.reshape(batch, num_q_blocks * block_q, num_kv_heads, group_splits, heads, head_dim)
    qr = qr.transpose(0, 2, 3, 1, 4, 5).reshape(batch, num_kv_heads * group_splits, num_q_blocks * rows, head_dim)

    quantized = k_scales is not None
    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        group=group,
        group_pad=group_pad,
        group_splits=group_splits,
        blocks_per_split=blocks_per_split,
        pages_per_compute_block=pages_per_compute_block,
        page_splits=page_splits,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        quantized=quantized,
        latent=latent,
    )
    # A program's pages block is its KV head's pages in every layer; the
    # layer is an index into it (Triton has no scalar prefetch to move a
    # block's origin by a runtime value), so no layer slice is ever copied.
    pages_spec = pl.BlockSpec((num_layers, None, num_pages, page_size, head_dim),
                              lambda b, h, i, s: (0, h // group_splits, 0, 0, 0))
    scales_spec = pl.BlockSpec((num_layers, None, num_pages, page_size),
                               lambda b, h, i, s: (0, h // group_splits, 0, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, i, s: (0,)),  # layer
        pl.BlockSpec((1,), lambda b, h, i, s: (b,)),  # kv_lens
        pl.BlockSpec((1,), lambda b, h, i, s: (b,)),  # q_lens
        pl.BlockSpec((None, pages_per_seq), lambda b, h, i, s: (b, 0)),  # block_tables
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, i, s: (b, h, i, 0)),  # q rows
        pages_spec,  # k_pages
        pages_spec,  # v_pages
    ] + ([scales_spec, scales_spec] if quantized else [])
    stats_shape = (batch, num_kv_heads * group_splits, k_splits, num_q_blocks * rows)
    o, l, m = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads * group_splits, num_q_blocks, k_splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, rows, out_dim), lambda b, h, i, s: (b, h, s, i, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, i, s: (b, h, s, i)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, i, s: (b, h, s, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*stats_shape, out_dim), jnp.float32),
            jax.ShapeDtypeStruct(stats_shape, jnp.float32),
            jax.ShapeDtypeStruct(stats_shape, jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_attention_gpu_{block_q=}_{pages_per_compute_block=}_{page_splits=}_{group_splits=}_{k_splits=}"
             f"{'' if latent is None else f'_{latent=}'}",
    )(layer, kv_lens, q_lens, block_tables, qr, k_pages, v_pages, *((k_scales, v_scales) if quantized else ()))

    # Combine the splits: o = sum_s o_s e^{m_s - m} / sum_s l_s e^{m_s - m}.
    m_all = m.max(axis=2, keepdims=True)
    weight = jnp.exp(m - m_all)  # [B, K * group_splits, k_splits, M_all]
    denom = (l * weight).sum(axis=2)  # [B, K * group_splits, M_all]
    out = (o * weight[..., None]).sum(axis=2) / denom[..., None]  # [B, K * gs, M_all, O]; 0 / 0 where no key is seen
    out = out.reshape(batch, num_kv_heads, group_splits, num_q_blocks * block_q, heads, out_dim)
    out = out.transpose(0, 3, 1, 2, 4, 5).reshape(batch, num_q_blocks * block_q, num_kv_heads, group_pad, out_dim)
    out = out[:, :num_q_tokens, :, :group]  # [B, T, K, G, O]
    # Only padding rows see no key (every other row sees its own): zeros by
    # row, not by ``denom > 0``, which would also zero a NaN ``denom`` (a NaN
    # logit or value the row sees) and serve it as a finite output.
    seen = jnp.arange(num_q_tokens)[None, :] < q_lens[:, None]  # [B, T]
    out = jnp.where(seen[:, :, None, None, None], out, 0.0)
    return out.reshape(batch, num_q_tokens, num_q_heads, out_dim).astype(q.dtype)


@functools.partial(
    jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "block_sizes", "interpret")
)
def _paged_attention_gpu(q, k_pages, v_pages, layer, block_tables, lengths, k_scales, v_scales, *,
                         scale, soft_cap, sliding_window, block_sizes, interpret):
    q_lens = jnp.minimum(lengths, 1)
    return flash_paged_call(
        q[:, None], k_pages, v_pages, layer, block_tables, lengths, q_lens, k_scales, v_scales,
        block_q=1,
        pages_per_compute_block=block_sizes.pages_per_compute_block,
        k_splits=block_sizes.k_splits,
        num_warps=block_sizes.num_warps,
        num_stages=block_sizes.num_stages,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret,
    )[:, 0]


def paged_attention_gpu(
    q: jax.Array,  # [B, N, H] float
    k_pages: jax.Array,  # [K, P, L, H] float, or quantized (int8, fp8)
    v_pages: jax.Array,  # [K, P, L, H] same dtype as k_pages
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    k_scales: jax.Array | None = None,  # f32[K, P, L] with quantized pages
    v_scales: jax.Array | None = None,  # f32[K, P, L] with quantized pages
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_sizes: GPUBlockSizes = GPUBlockSizes(),
    interpret: bool | None = None,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """Paged decode attention: one query token per sequence, GQA.

    Args:
      q: [B, N, H] unscaled queries (the kernel scales them, see
        ``pallas_kernels.common``).
      k_pages, v_pages: [K, P, L, H] one layer's pages, float or quantized
        (int8, fp8); or, with ``layer``, the stacked pool [layers, K, P, L,
        H].
      block_tables: i32[B, pages_per_seq] page ids; entries past a
        sequence's length may be any valid page id (they are never read into
        the output, even if the page holds NaN).
      lengths: i32[B] tokens per sequence, the query's own K/V included
        (0 <= lengths <= pages_per_seq * L).
      k_scales, v_scales: f32[K, P, L] per-token scales for quantized pages
        (f32[layers, K, P, L] with ``layer``).
      scale: logit scale, default ``1 / sqrt(H)``.
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``.
      sliding_window: the query at position ``p`` sees keys in
        ``(p - sliding_window, p]``.
      block_sizes: tiling.
      interpret: Pallas interpret mode; default: unless running on a GPU.
      layer: the layer of a stacked pool, read in place (an integer scalar,
        traced or not); None for one layer's pages.

    Returns:
      [B, N, H] in ``q.dtype``, zeros where ``lengths == 0`` (non-finite
      where a logit or value a sequence sees is); computed in f32
      (bf16 pages are multiplied in bf16 with f32 accumulation).

    Raises:
      ValueError: inputs failing ``common.validate_inputs`` or
        ``common.validate_options``, a page size that does not tile
        (``block_sizes.keys_per_block``), or (eager) a layer outside the
        pool (``common.checked_layer``).
    """
    lengths, layer = common.check_decode_call(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, layer,
                                              scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    block_sizes.keys_per_block(k_pages.shape[-2])
    return unchecked_paged_attention_gpu(
        q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, block_sizes=block_sizes, interpret=interpret, layer=layer,
    )


def unchecked_paged_attention_gpu(q, k_pages, v_pages, block_tables, lengths, k_scales=None, v_scales=None, *,
                                  scale=None, soft_cap=None, sliding_window=None,
                                  block_sizes: GPUBlockSizes = GPUBlockSizes(), interpret=None,
                                  layer=None) -> jax.Array:
    """:func:`paged_attention_gpu` trusting its inputs: no check, and no
    clamp of lengths or layer. For callers that validated at their door
    (``paged_jax.attention.paged.paged_attention``); same arguments and result."""
    layer_index = common.layer_index(layer)
    k_pages, v_pages, k_scales, v_scales = common.stack_layer(k_pages, v_pages, k_scales, v_scales, layer=layer)
    return _paged_attention_gpu(
        q, k_pages, v_pages, layer_index, block_tables, lengths, k_scales, v_scales,
        scale=common.resolve_scale(scale, q.shape[-1]), soft_cap=soft_cap, sliding_window=sliding_window,
        block_sizes=block_sizes, interpret=common.interpret_default(interpret, "gpu"),
    )


ref_paged_attention_gpu = common.ref_paged_decode_loop
"""The truth for :func:`paged_attention_gpu` (same positional arguments):
:func:`pallas_kernels.common.ref_paged_decode_loop`."""
