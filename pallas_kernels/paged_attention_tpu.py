"""Paged decode attention for TPUs: a Pallas (Mosaic) kernel with scalar
prefetch and double-buffered page DMAs.

Grid ``(B, K)``: one program per sequence and KV head, holding all ``G``
query heads of the group. Lengths and the (flattened) block tables are
scalar-prefetched into SMEM (``PrefetchScalarGridSpec``), so a program can
compute page addresses before any vector work. K/V pages stay in HBM
(``memory_space=ANY``); the program copies ``pages_per_compute_block`` pages
at a time into one of two VMEM buffers with async DMAs, starting the copy of
block ``j + 1`` before it computes block ``j`` (double buffering), and stops
at the sequence's last block (a sliding window also skips the blocks before
it). Online softmax in f32.

Sources: PagedAttention (Kwon et al., SOSP 2023); JAX's
``jax.experimental.pallas.ops.tpu.paged_attention`` (same scalar prefetch and
DMA scheme; that one also prefetches across grid steps, casts K/V to bf16 and
leaves q unscaled; this one prefetches within a program, computes in f32 and
scales q, see ``pallas_kernels.common``).

On CPU it runs in TPU interpret mode (``pltpu.InterpretParams``), which
simulates HBM, VMEM, DMAs and semaphores: about 0.1-0.2 s a call. libtpu
compiles it for v5e and v6e (``experiments.lib.aot``, ``tests/test_aot.py``):
the online-softmax step builds its row and column masks from
``broadcasted_iota`` (:func:`key_positions`), because Mosaic cannot relayout
a boolean ``(1, keys)`` row into a ``(keys, 1)`` column.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPUBlockSizes:
    """Tiling of :func:`paged_attention_tpu`.

    Attributes:
      pages_per_compute_block: pages copied and attended per step; each of
        the two VMEM buffers of K (and of V) holds this many pages. Any
        positive value: the block table is padded with page 0 to a multiple.
    """

    pages_per_compute_block: int = 4

    def __post_init__(self):
        common.check_block_sizes(self, positive=("pages_per_compute_block",))


def key_positions(first_key, keys: int):
    """Positions of a key block's ``keys`` keys from ``first_key``, as a row
    i32[1, keys] (for masks over logits columns) and as a column i32[keys,
    1] (for masks over values rows). Both are built with
    ``broadcasted_iota``: reshaping a ``(1, keys)`` mask to ``(keys, 1)``
    is a lane-to-sublane relayout Mosaic refuses ("unsupported shape cast",
    256 keys) or aborts on (``Check failed: rem == 0``, 64 keys) in libtpu
    0.0.42 (v5e, v6e, v4, v5p); interpret mode accepts both."""
    row = first_key + lax.broadcasted_iota(jnp.int32, (1, keys), 1)
    col = first_key + lax.broadcasted_iota(jnp.int32, (keys, 1), 0)
    return row, col


def online_softmax_step(carry, logits, visible, key_real, key_real_col, v, v_scale=None):
    """One key block of a TPU kernel's online softmax (the flash-attention
    recurrence): ``carry = (o f32[M, H], l f32[M, 1], m f32[M, 1])``, the
    block's masked ``logits`` f32[M, keys] (``visible`` bool[M, keys]),
    ``key_real`` bool[1, keys] and ``key_real_col`` bool[keys, 1] (keys that
    hold a written token, as a row and as a column: :func:`key_positions`),
    ``v`` f32[keys, H] and, for a quantized pool, the values' per-key scales
    f32[1, keys]. Values of keys that are not real are zeroed first: NaN
    may sit in the pages (or scales) of slots nobody owns, and 0 * NaN is
    NaN. Returns the new carry."""
    o_prev, l_prev, m_prev = carry
    m_next = jnp.maximum(m_prev, logits.max(axis=-1, keepdims=True))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(visible, jnp.exp(logits - m_next), 0.0)
    l_next = correction * l_prev + p.sum(axis=-1, keepdims=True)
    if v_scale is not None:
        p = p * jnp.where(key_real, v_scale, 0.0)
    v = jnp.where(key_real_col, v, 0.0)
    o_next = correction * o_prev + jnp.einsum("mk,kh->mh", p, v, preferred_element_type=jnp.float32)
    return o_next, l_next, m_next

def next_block_ready(j, block_lo, block_hi, copies):
    """The double-buffered page pipeline of a TPU kernel's key loop, at
    step ``j`` of ``[block_lo, block_hi)``: starts the copies of block
    ``j + 1`` into the other buffer (if there is one), waits for block
    ``j``'s, and returns ``j``'s buffer slot (0 or 1). ``copies(j, slot)``
    gives the DMA descriptors of block ``j`` into ``slot``; block
    ``block_lo``'s must have been started before the loop."""
    slot = (j - block_lo) % 2

    @pl.when(j + 1 < block_hi)
    def _prefetch_next():
        for c in copies(j + 1, 1 - slot):
            c.start()

    for c in copies(j, slot):
        c.wait()
    return slot

def _kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1] the layer of the stacked pool
    lengths_ref,  # i32[B]
    block_tables_ref,  # i32[B * pages_per_seq]
    # inputs
    q_ref,  # [G, H] this program's query heads
    k_pages_ref,  # [layers, K, P, L, H] in HBM
    v_pages_ref,  # [layers, K, P, L, H] in HBM
    *rest,  # (k_scales_ref, v_scales_ref f32[layers, K, P, L] in HBM)?, o_ref [G, H], scratch
    pages_per_seq: int,
    pages_per_compute_block: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    quantized: bool,
):
    if quantized:
        k_scales_ref, v_scales_ref, o_ref, k_buf, v_buf, k_scale_buf, v_scale_buf, sems = rest
    else:
        o_ref, k_buf, v_buf, sems = rest
    b, h = pl.program_id(0), pl.program_id(1)
    _, _, _, page_size, head_dim = k_pages_ref.shape
    layer = layer_ref[0]
    keys = pages_per_compute_block * page_size
    length = lengths_ref[b]

    block_hi = pl.cdiv(length, keys)
    block_lo = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0) // keys

    def copies(j, slot):
        """The DMAs that bring compute block ``j`` into buffer ``slot``."""
        out = []
        for i in range(pages_per_compute_block):
            page = block_tables_ref[b * pages_per_seq + j * pages_per_compute_block + i]
            pairs = [(k_pages_ref, k_buf), (v_pages_ref, v_buf)]
            if quantized:
                pairs += [(k_scales_ref, k_scale_buf), (v_scales_ref, v_scale_buf)]
            for src, dst in pairs:
                # The page's DMA source is its place in the stacked pool: no layer is copied out.
                out.append(pltpu.make_async_copy(src.at[layer].at[h].at[page], dst.at[slot].at[i], sems.at[slot]))
        return out

    q = q_ref[...].astype(jnp.float32) * scale  # the one place q is scaled; f32[G, H]

    def body(j, carry):
        slot = next_block_ready(j, block_lo, block_hi, copies)
        k = k_buf[slot].reshape(keys, head_dim).astype(jnp.float32)
        v = v_buf[slot].reshape(keys, head_dim).astype(jnp.float32)
        k_pos, k_pos_col = key_positions(j * keys, keys)  # i32[1, keys], i32[keys, 1]
        key_real = k_pos < length
        logits = jnp.einsum("gh,th->gt", q, k, preferred_element_type=jnp.float32)  # f32[G, keys]
        if quantized:
            logits = logits * k_scale_buf[slot].reshape(1, keys)
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        visible = key_real
        if sliding_window is not None:
            visible &= k_pos > length - 1 - sliding_window
        logits = jnp.where(visible, logits, -jnp.inf)
        # m stays finite: block j has a visible key
        return online_softmax_step(carry, logits, visible, key_real, k_pos_col < length, v,
                                   v_scale_buf[slot].reshape(1, keys) if quantized else None)

    @pl.when(block_lo < block_hi)
    def _prefetch_first():
        for c in copies(block_lo, 0):
            c.start()

    group = q_ref.shape[0]
    init = (
        jnp.zeros((group, head_dim), jnp.float32),
        jnp.zeros((group, 1), jnp.float32),
        jnp.full((group, 1), -jnp.inf, jnp.float32),
    )
    o, l, _ = lax.fori_loop(block_lo, block_hi, body, init)
    # l is 0 only when the program saw no key (length 0): every block it
    # walks holds a visible key, whose p is 1 at the max. ``l != 0``, not
    # ``l > 0``: a NaN l (a NaN logit or value it sees) must stay NaN.
    o_ref[...] = jnp.where(l != 0, o / jnp.where(l != 0, l, 1.0), 0.0).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "block_sizes", "interpret")
)
def _paged_attention_tpu(q, k_pages, v_pages, layer, block_tables, lengths, k_scales, v_scales, *,
                         scale, soft_cap, sliding_window, block_sizes, interpret):
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    ppcb = block_sizes.pages_per_compute_block
    block_tables = common.pad_block_tables(block_tables, ppcb)
    pages_per_seq = block_tables.shape[1]
    quantized = k_scales is not None

    # Mosaic tiles the last two dims of a block as (8, 128): with a group
    # that is not a multiple of 8, give q a unit sublane dim and f32 (the
    # trick of JAX's TPU kernel).
    if group % 8:
        q_in = q.reshape(batch, num_q_heads, 1, head_dim).astype(jnp.float32)
        q_spec = pl.BlockSpec((None, group, None, head_dim), lambda b, h, *_: (b, h, 0, 0))
    else:
        q_in = q
        q_spec = pl.BlockSpec((None, group, head_dim), lambda b, h, *_: (b, h, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    buf = lambda dtype: pltpu.VMEM((2, ppcb, page_size, head_dim), dtype)  # noqa: E731
    scale_buf = pltpu.VMEM((2, ppcb, page_size), jnp.float32)
    scratch = [buf(k_pages.dtype), buf(v_pages.dtype)]
    if quantized:
        scratch += [scale_buf, scale_buf]
    scratch.append(pltpu.SemaphoreType.DMA((2,)))

    kernel = functools.partial(
        _kernel,
        pages_per_seq=pages_per_seq,
        pages_per_compute_block=ppcb,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        quantized=quantized,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, num_kv_heads),
            in_specs=[q_spec, any_spec, any_spec] + ([any_spec, any_spec] if quantized else []),
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(q_in.shape, q_in.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=f"paged_attention_tpu_ppcb{ppcb}",
    )(layer, lengths, block_tables.reshape(-1), q_in, k_pages, v_pages, *((k_scales, v_scales) if quantized else ()))
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def paged_attention_tpu(
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
    block_sizes: TPUBlockSizes = TPUBlockSizes(),
    interpret: bool | None = None,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """Paged decode attention on TPU: one query token per sequence, GQA.

    Args:
      q: [B, N, H] unscaled queries (scaled in the kernel, see
        ``pallas_kernels.common``).
      k_pages, v_pages: [K, P, L, H] one layer's pages, float or quantized; or,
        with ``layer``, the stacked pool [layers, K, P, L, H], whose pages
        are copied straight from where they sit (the layer index is
        scalar-prefetched into SMEM with the lengths and tables).
      block_tables: i32[B, pages_per_seq] page ids; entries past a sequence's
        length may be any valid page id (their content never reaches the
        output, NaN included). The whole table is prefetched into SMEM.
      lengths: i32[B] tokens per sequence, the query's own included
        (``0 <= lengths <= pages_per_seq * L``).
      k_scales, v_scales: f32[K, P, L] per-token scales for quantized pages
        (f32[layers, K, P, L] with ``layer``).
      scale: logit scale, default ``1 / sqrt(H)``.
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``.
      sliding_window: the query at position ``p`` sees keys in
        ``(p - sliding_window, p]``.
      block_sizes: tiling.
      interpret: TPU interpret mode; default: unless running on a TPU.
      layer: the layer of a stacked pool (integer scalar, traced or not);
        None for one layer's pages.

    Returns:
      [B, N, H] in ``q.dtype``; zeros where ``lengths == 0``, non-finite
      where a logit or value a sequence sees is. Computed in f32.

    Raises:
      ValueError: inputs failing ``common.validate_inputs`` or
        ``common.validate_options``; (eager) lengths past a row's table or a
        layer outside the pool.
    """
    lengths, layer = common.check_decode_call(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, layer,
                                              scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    return unchecked_paged_attention_tpu(
        q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, block_sizes=block_sizes, interpret=interpret, layer=layer,
    )


def unchecked_paged_attention_tpu(q, k_pages, v_pages, block_tables, lengths, k_scales=None, v_scales=None, *,
                                  scale=None, soft_cap=None, sliding_window=None,
                                  block_sizes: TPUBlockSizes = TPUBlockSizes(), interpret=None,
                                  layer=None) -> jax.Array:
    """:func:`paged_attention_tpu` trusting its inputs: no check, and no
    clamp of lengths or layer. For callers that validated at their door
    (``paged_jax.attention.paged.paged_attention``); same arguments and result."""
    layer_index = common.layer_index(layer)
    k_pages, v_pages, k_scales, v_scales = common.stack_layer(k_pages, v_pages, k_scales, v_scales, layer=layer)
    return _paged_attention_tpu(
        q, k_pages, v_pages, layer_index, block_tables, lengths, k_scales, v_scales,
        scale=common.resolve_scale(scale, q.shape[-1]), soft_cap=soft_cap, sliding_window=sliding_window,
        block_sizes=block_sizes, interpret=common.interpret_default(interpret, "tpu"),
    )


ref_paged_attention_tpu = common.ref_paged_decode_loop
"""The truth for :func:`paged_attention_tpu` (same positional arguments):
:func:`pallas_kernels.common.ref_paged_decode_loop`."""
