"""The TPU implementation of :mod:`pallas_kernels.flat_ragged_attention`: a
Pallas (Mosaic) kernel that writes the call's new K/V into the pool and
attends the flat batch's query tiles, with scalar prefetch and
double-buffered page DMAs.

Grid ``(U, K)``, sequential (``"arbitrary"`` on both axes): one program per
query tile and KV head, holding the tile's ``Q`` tokens times the ``G`` query
heads of the KV head (``M = Q * G`` rows). The tiles' sequence, causal limit
and row count, the block tables and the new tokens' slots are
scalar-prefetched into SMEM, so a program computes page addresses before any
vector work. K/V pages stay in HBM (``memory_space=ANY``); a program copies
``pages_per_compute_block`` pages at a time into one of two VMEM buffers,
starting block ``j + 1``'s copy before computing block ``j``, and walks only
the blocks its queries see (:func:`pallas_kernels.flat_batch.tile_blocks`,
the XLA work list's formula). Online softmax in f32.

MLA's latent mode (``latent_dim`` C): the pool holds latents ``[c, k_pe]``
and nothing is written; a block is one page DMA into one VMEM buffer, scored
as keys, its first C columns the values (one scale row for an int8 / fp8
pool), so each latent is read once and the output is C wide.

The write. The pool is both an input and an output (``input_output_aliases``;
the caller donates it). The grid's first program writes every new token's
K/V (and scales) into its slot before it attends, and only then does any
program read a page: the grid runs in order on one core, so all writes
precede all reads. Mosaic refuses a DMA at an offset that is not a multiple
of the (8, 128) tile ("Offsets along tiled dimensions must be aligned to
tiles"), so a token is never copied alone: the tokens are visited sorted by
slot (``write_order``, scalar-prefetched), and each aligned chunk of
``min(L, 32)`` slots of a page that receives tokens is read into VMEM,
merged with its new rows (``jnp.where`` on a row iota) and written back
whole, once per chunk; a quantized pool's scales are read, merged and
written as the page's whole f32 row. tpu-inference's v3 kernel
instead merges each sequence's new K/V into the block it has fetched and
writes it back as it goes (its ``_fetch_bkv`` / ``_update_kv_cache``), so a
sequence reads its own new tokens from the input; that would not let a
sequence read K/V another sequence of the same call writes into a shared
page, which the engine's same-step prefix sharing relies on
(``paged_jax.engine.kv_manager``). Quantization (int8, fp8) is the XLA
``common.quantize_kv`` before the kernel, so the bytes written are those of
``paged_jax.paging.kv_cache.write_layer_kv``.

Facts borrowed from tpu-inference's ragged paged attention v3
(``tpu_inference/kernels/ragged_paged_attention/v3/kernel.py``): lengths,
flattened page indices and query offsets scalar-prefetched; K/V stay in HBM
and are fetched by DMA into double buffers; a sequential (``"arbitrary"``)
grid because later work depends on earlier; the new K/V passed to the kernel
and the cache updated through an aliased output.

On CPU it runs in TPU interpret mode (``pltpu.InterpretParams``), which
simulates HBM, VMEM, DMAs and semaphores. libtpu compiles it for v5e and v6e
at the test suite's presets, page sizes and pool dtypes (every one the engine
builds with ``compile_kernels --full``; ``experiments.lib.aot``,
``tests/test_aot.py``, ``results/kernel_compile.md``), and inside the
engine's whole step (``experiments.lib.aot_step``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels.flat_batch import prefill_tiles, tile_blocks, tiles
from pallas_kernels.paged_attention_tpu import key_positions, next_block_ready, online_softmax_step

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
"""Finite stand-in for -inf in the running max: a row that sees no key in a
block keeps a finite max and zero probabilities instead of ``-inf - -inf``."""


def write_chunk_rows(page_size: int) -> int:
    """Rows of a page the kernel reads and writes back as one piece when it
    writes new K/V: ``min(L, 32)``. HBM pools of 16-bit and 8-bit dtypes are
    tiled along the page's token axis (libtpu 0.0.42: tiles of 8 rows for
    bf16 and for int8 at L = 16, 32 for int8 and fp8 at L = 64), and a DMA
    must start and end on a tile ("Offsets along tiled dimensions must be
    aligned to tiles"), so one token's row cannot be copied on its own; a
    chunk of ``min(L, 32)`` rows at a multiple of itself always is."""
    return min(page_size, 32)


def _kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1]
    tile_seq_ref,  # i32[U] each tile's sequence
    tile_end_ref,  # i32[U] each tile's causal limit: its last query's position + 1
    tile_rows_ref,  # i32[U] each tile's query tokens
    block_tables_ref,  # i32[E * pages_per_seq]
    slots_ref,  # i32[T] the new tokens' flat slots (-1: none)
    write_order_ref,  # i32[T] the rows with a slot, by slot (so by chunk); then the others
    num_writes_ref,  # i32[1] rows with a slot
    # inputs, then outputs, then scratch
    *refs,
    group: int,
    pages_per_seq: int,
    pages_per_compute_block: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    quantized: bool,
    write: bool,
    latent: int | None,
):
    # K, V pages (and their scales); MLA's latent mode: the latent pages (and their scales) alone, read once
    n_pool = (2 if quantized else 1) if latent else (4 if quantized else 2)
    q_ref, refs = refs[0], refs[1:]  # q: [M, H] this tile's rows of KV head h
    new = refs[:n_pool] if write else ()  # f32[T, K, H] K/V (quantized values), f32[T, K, 1] scales; in HBM
    refs = refs[len(new):]
    pool_in, refs = refs[:n_pool], refs[n_pool:]  # [layers, K, P, L, H] (scales [layers, K, P, L]) in HBM
    o_ref, refs = refs[0], refs[1:]  # f32[M, H] (latent: f32[M, C])
    pool = refs[:n_pool] if write else pool_in  # aliased outputs: the same buffers, written
    refs = refs[n_pool:] if write else refs
    bufs, refs = refs[:n_pool], refs[n_pool:]  # VMEM [2, ppcb, L(, H)] each
    n_data = n_pool // 2 if quantized else n_pool  # the pages' buffers; the scales' follow
    k_buf, v_buf = bufs[0], (None if latent else bufs[1])
    k_scale_buf = bufs[n_data] if quantized else None
    v_scale_buf = (k_scale_buf if latent else bufs[n_data + 1]) if quantized else None
    # The write's VMEM (a call that writes): [2, K, C, H] in the pool's dtype and in f32, f32[2, K, H];
    # (quantized) f32[2, K, L] and f32[2, K, 1]
    chunk_io, chunk_f32, new_rows = refs[:3] if write else (None,) * 3
    scale_rows, new_scales = refs[3:5] if write and quantized else (None, None)
    sems, write_sem = refs[-2:]

    u, h = pl.program_id(0), pl.program_id(1)
    rows_m, head_dim = q_ref.shape
    page_size = pool[0].shape[3]
    keys = pages_per_compute_block * page_size
    layer = layer_ref[0]

    if write:
        num_kv_heads = pool[0].shape[1]
        chunk = chunk_io.shape[2]
        chunks_per_page = page_size // chunk

        def chunk_copy(key, i, to_pool):
            """The DMA of chunk ``key`` (``page * chunks_per_page + c``) of K
            (``i = 0``) or V (1), every KV head, between the pool and VMEM."""
            page, first = key // chunks_per_page, pl.multiple_of((key % chunks_per_page) * chunk, chunk)
            place = pool[i].at[layer, :, page, pl.ds(first, chunk)]  # [K, C, H]
            return pltpu.make_async_copy(chunk_io.at[i], place, write_sem) if to_pool else \
                pltpu.make_async_copy(place, chunk_io.at[i], write_sem)

        def sync(copies):
            for c in copies:
                c.start()
            for c in copies:
                c.wait()

        def scale_copies(key, to_pool):
            """(quantized) The DMAs of the scales of chunk ``key``'s page,
            K's and V's, every KV head: the page's whole f32[K, L] row (a
            one-token DMA of an f32 row is refused too: "dynamic offset
            times the element size is a multiple of the word size")."""
            if not quantized:
                return []
            page = key // chunks_per_page
            return [pltpu.make_async_copy(scale_rows.at[i], pool[2 + i].at[layer, :, page], write_sem) if to_pool
                    else pltpu.make_async_copy(pool[2 + i].at[layer, :, page], scale_rows.at[i], write_sem)
                    for i in range(2)]

        def load(key):  # the chunk's old rows, in f32 (and its page's scales)
            sync([chunk_copy(key, i, False) for i in range(2)] + scale_copies(key, False))
            for i in range(2):
                chunk_f32[i] = chunk_io[i].astype(jnp.float32)

        def store(key):  # the merged chunk back into the pool
            for i in range(2):
                chunk_io[i] = chunk_f32[i].astype(chunk_io.dtype)
            sync([chunk_copy(key, i, True) for i in range(2)] + scale_copies(key, True))

        @pl.when((u == 0) & (h == 0))
        def _write_new_kv():
            # Rows come by slot, so a chunk's new rows are consecutive: each
            # chunk is read once, gets its rows, and is written back once.
            chunk_row = lax.broadcasted_iota(jnp.int32, (chunk, head_dim), 0)

            def token(i, current):
                t = write_order_ref[i]
                slot = slots_ref[t]
                key, row = slot // chunk, slot % chunk

                @pl.when(key != current)
                def _next_chunk():
                    @pl.when(current >= 0)
                    def _():
                        store(current)

                    load(key)

                sync([pltpu.make_async_copy(new[i].at[t], new_rows.at[i], write_sem) for i in range(2)])
                for i in range(2):
                    for head in range(num_kv_heads):
                        chunk_f32[i, head] = jnp.where(chunk_row == row, new_rows[i, pl.ds(head, 1), :],
                                                       chunk_f32[i, head])
                if quantized:
                    sync([pltpu.make_async_copy(new[2 + i].at[t], new_scales.at[i], write_sem) for i in range(2)])
                    token_lane = lax.broadcasted_iota(jnp.int32, (num_kv_heads, page_size), 1)
                    for i in range(2):
                        scale_rows[i] = jnp.where(token_lane == slot % page_size, new_scales[i], scale_rows[i])
                return key

            last = lax.fori_loop(0, num_writes_ref[0], token, jnp.int32(-1))

            @pl.when(last >= 0)
            def _():
                store(last)

    seq, end, rows = tile_seq_ref[u], tile_end_ref[u], tile_rows_ref[u]
    first_pos = end - rows
    block_lo, n_blocks = tile_blocks(first_pos, end - 1, block_tokens=keys, sliding_window=sliding_window, xp=jnp)
    block_hi = jnp.where(rows > 0, block_lo + n_blocks, block_lo)

    def copies(j, slot):
        """The DMAs that bring key block ``j`` into buffer ``slot``."""
        out = []
        for i in range(pages_per_compute_block):
            page = block_tables_ref[seq * pages_per_seq + j * pages_per_compute_block + i]
            for src, buf in zip(pool, bufs):
                # The page's DMA source is its place in the stacked pool: no layer is copied out.
                out.append(pltpu.make_async_copy(src.at[layer].at[h].at[page], buf.at[slot].at[i], sems.at[slot]))
        return out

    # Row r is query token r // G of the tile, head r % G of the group.
    token_of_row = lax.broadcasted_iota(jnp.int32, (rows_m, 1), 0) // group
    real = token_of_row < rows
    q_pos = jnp.where(real, first_pos + token_of_row, -1)  # i32[M, 1]; -1 sees nothing
    q = q_ref[...].astype(jnp.float32) * scale  # the one place q is scaled

    def body(j, carry):
        slot = next_block_ready(j, block_lo, block_hi, copies)
        k = k_buf[slot].reshape(keys, head_dim).astype(jnp.float32)
        # A latent [c, k_pe] is a key; its c (the first C columns, lane-aligned when C is a multiple of 128)
        # is the value: one DMA and one VMEM buffer per block instead of two.
        v = k[:, :latent] if latent else v_buf[slot].reshape(keys, head_dim).astype(jnp.float32)
        k_pos, k_pos_col = key_positions(j * keys, keys)  # i32[1, keys], i32[keys, 1]
        key_real = k_pos < end  # keys past the tile's causal limit: unwritten or another's
        logits = jnp.einsum("mh,kh->mk", q, k, preferred_element_type=jnp.float32)  # f32[M, keys]
        if quantized:
            logits = logits * k_scale_buf[slot].reshape(1, keys)
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        visible = (k_pos <= q_pos) & key_real
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        logits = jnp.where(visible, logits, MASK_VALUE)
        return online_softmax_step(carry, logits, visible, key_real, k_pos_col < end, v,
                                   v_scale_buf[slot].reshape(1, keys) if quantized else None)

    @pl.when(block_lo < block_hi)
    def _prefetch_first():
        for c in copies(block_lo, 0):
            c.start()

    init = (
        jnp.zeros((rows_m, latent or head_dim), jnp.float32),
        jnp.zeros((rows_m, 1), jnp.float32),
        jnp.full((rows_m, 1), MASK_VALUE, jnp.float32),
    )
    o, l, _ = lax.fori_loop(block_lo, block_hi, body, init)
    # Only padding rows see no key (a real row sees its own): zeros by row,
    # not by ``l > 0``, which would also zero a NaN ``l``.
    o_ref[...] = jnp.where(real, o / jnp.where(real, l, 1.0), 0.0).astype(o_ref.dtype)


def _call(q, new, pool, layer, block_tables, tile, first_row, slots, *, tile_q, pages_per_compute_block, scale,
          soft_cap, sliding_window, interpret, latent=None):
    """One class's tiles (``tile``, ``flat_batch.Tiles``; ``first_row`` i32[U]
    their first flat rows) through the kernel (``new`` empty: no write).
    ``pool`` is (K, V pages, K, V scales if quantized), or with ``latent``
    (C) the latent pages (and their scales) alone, and ``new`` empty.

    Returns:
      ``(o f32[U, Q, N, H] (latent: [U, Q, N, C]), pool)``.
    """
    t_total, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = pool[0].shape
    group = num_q_heads // num_kv_heads
    num_tiles = tile.seq.shape[0]
    rows_m = tile_q * group
    n_data = 1 if latent else 2  # page arrays; scales follow them
    quantized = len(pool) == 2 * n_data
    out_dim = latent or head_dim
    block_tables = common.pad_block_tables(block_tables, pages_per_compute_block)
    pages_per_seq = block_tables.shape[1]

    # q tiles [U, Q, N, H] -> [U, K, Q * G, H], rows ordered (token, head)
    r = jnp.arange(tile_q, dtype=jnp.int32)
    src = first_row[:, None] + r[None, :]
    real = r[None, :] < tile.rows[:, None]
    qt = q[jnp.where(real, src, 0)].reshape(num_tiles, tile_q, num_kv_heads, group, head_dim)
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows_m, head_dim)

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    tile_spec = pl.BlockSpec((None, None, rows_m, head_dim), lambda u, h, *_: (u, h, 0, 0))
    out_spec = pl.BlockSpec((None, None, rows_m, out_dim), lambda u, h, *_: (u, h, 0, 0))
    scratch = [pltpu.VMEM((2, pages_per_compute_block, page_size, head_dim), x.dtype) for x in pool[:n_data]]
    scratch += [pltpu.VMEM((2, pages_per_compute_block, page_size), jnp.float32) for _ in pool[n_data:]]
    write = bool(new)
    assert not (write and latent), "the latent mode writes nothing"
    if write:  # the write's chunks: only the call that writes holds them
        chunk = write_chunk_rows(page_size)
        scratch += [pltpu.VMEM((2, num_kv_heads, chunk, head_dim), pool[0].dtype),
                    pltpu.VMEM((2, num_kv_heads, chunk, head_dim), jnp.float32),
                    pltpu.VMEM((2, num_kv_heads, head_dim), jnp.float32)]
        if quantized:
            scratch += [pltpu.VMEM((2, num_kv_heads, page_size), jnp.float32),
                        pltpu.VMEM((2, num_kv_heads, 1), jnp.float32)]
    scratch += [pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA(())]
    # The write's order: rows with a slot by slot (the chunks' rows together), then the rest.
    has_slot = slots >= 0
    write_order = jnp.argsort(jnp.where(has_slot, slots, jnp.iinfo(jnp.int32).max)).astype(jnp.int32)
    num_writes = has_slot.sum(dtype=jnp.int32).reshape(1)
    prefetch = (layer.reshape(1), tile.seq, tile.first_pos + tile.rows, tile.rows, block_tables.reshape(-1), slots,
                write_order, num_writes)
    # Operands: prefetch, q, new, pool; the pool (after q and new) is aliased to the outputs after o.
    first_pool = len(prefetch) + 1 + len(new)
    kernel = functools.partial(
        _kernel, group=group, pages_per_seq=pages_per_seq, pages_per_compute_block=pages_per_compute_block,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, quantized=quantized, write=write,
        latent=latent)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(num_tiles, num_kv_heads),
            in_specs=[tile_spec] + [any_spec] * (len(new) + len(pool)),
            out_specs=[out_spec] + ([any_spec] * len(pool) if write else []),
            scratch_shapes=scratch,
        ),
        out_shape=[jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows_m, out_dim), jnp.float32)]
        + ([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pool] if write else []),
        input_output_aliases={first_pool + i: 1 + i for i in range(len(pool))} if write else {},
        # Sequential: the first program's writes must precede every read.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=f"flat_ragged_tpu_q{tile_q}_ppcb{pages_per_compute_block}" + (f"_latent{latent}" if latent else ""),
    )(*prefetch, qt, *new, *pool)
    o = outs[0].reshape(num_tiles, num_kv_heads, tile_q, group, out_dim).transpose(0, 2, 1, 3, 4)
    return o.reshape(num_tiles, tile_q, num_q_heads, out_dim), (tuple(outs[1:]) if write else pool)


@functools.partial(jax.jit, static_argnames=("block_q", "pages_per_compute_block", "decode_tiles", "prefill_chunks",
                                             "scale", "soft_cap", "sliding_window", "interpret", "latent_dim"))
def flat_ragged_tpu(q, k_new, v_new, k_pool, v_pool, layer, block_tables, q_starts, q_lens, kv_lens, slots, k_scales,
                    v_scales, *, block_q, pages_per_compute_block, decode_tiles, prefill_chunks, scale, soft_cap,
                    sliding_window, interpret, latent_dim=None):
    """``flat_ragged_attention``'s ``impl="tpu"``: the same arguments (all
    checked, ``scale`` resolved, tiling resolved) and result ``(out, k_pool,
    v_pool, k_scales, v_scales)``. The first class's call writes the new
    K/V (the entry's door makes sure a class runs); with ``k_new`` None
    nothing is written. With ``latent_dim`` (C; ``v_pool`` is ``k_pool``,
    nothing to write) each latent page is copied into VMEM once, attended as
    keys and its first C columns as values: out [T, N, C]."""
    t_total, num_q_heads, head_dim = q.shape
    quantized = k_scales is not None
    if latent_dim:
        pool = (k_pool,) + ((k_scales,) if quantized else ())
    else:
        pool = (k_pool, v_pool) + ((k_scales, v_scales) if quantized else ())
    new = ()
    if k_new is not None:
        if quantized:
            (kq, ks), (vq, vs) = common.quantize_kv(k_new, k_pool.dtype), common.quantize_kv(v_new, v_pool.dtype)
            new = (kq.astype(jnp.float32), vq.astype(jnp.float32), ks[..., None], vs[..., None])
        else:  # the values the pool will hold, in f32 (the kernel merges them into chunks in f32)
            new = tuple(x.astype(p.dtype).astype(jnp.float32) for x, p in ((k_new, k_pool), (v_new, v_pool)))
    else:
        slots = jnp.full((t_total,), -1, jnp.int32)
    out_dim = latent_dim or head_dim
    out = jnp.zeros((t_total, num_q_heads, out_dim), q.dtype)
    classes = [(q_lens == 1, decode_tiles, 1), (q_lens > 1, prefill_tiles(t_total, prefill_chunks, block_q), block_q)]
    for rows, num_tiles, tile_q in classes:
        if num_tiles == 0:
            continue
        t = tiles(jnp.where(rows, q_lens, 0), kv_lens, num_tiles=num_tiles, tile_q=tile_q)
        first_row = q_starts[t.seq] + t.row0  # [U]
        o, pool = _call(q, new, pool, layer, block_tables, t, first_row, slots, tile_q=tile_q,
                        pages_per_compute_block=pages_per_compute_block, scale=scale, soft_cap=soft_cap,
                        sliding_window=sliding_window, interpret=interpret, latent=latent_dim)
        new = ()  # written once, by the first class's call
        r = jnp.arange(tile_q, dtype=jnp.int32)
        dest = jnp.where(r[None, :] < t.rows[:, None], first_row[:, None] + r[None, :], t_total)
        out = out.at[dest.reshape(-1)].set(o.reshape(-1, num_q_heads, out_dim).astype(q.dtype), mode="drop")
    if latent_dim:  # read only
        return out, k_pool, v_pool, k_scales, v_scales
    pool = tuple(pool) + (None, None) * (not quantized)
    return (out, *pool)

