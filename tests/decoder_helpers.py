"""Decoder test helpers shared by the decoder tests (test files import from
here, never from each other): a NaN pool, and flat mixed batches run
through the page state."""

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig
from models.llama import Llama
from models.ragged import RaggedModel
from paged_jax.attention.batch import RaggedBatch, Tiling, batch_shape
from paged_jax.paging import page_state as ps
from paged_jax.paging.slots import flat_slot_mapping

PAGE_SIZE, NUM_PAGES = 4, 17  # the tiny decoder tests' pool unless a test says otherwise


def nan_pool(config: LlamaConfig, num_pages: int = NUM_PAGES, page_size: int = PAGE_SIZE, dtype=None):
    """A pool full of NaN: reading any slot no write filled poisons the
    output (an int8 pool: NaN scales)."""
    kv = config.make_kv_pool(num_pages, page_size, dtype)
    return jax.tree.map(lambda x: x if x.dtype == jnp.int8 else jnp.full_like(x, jnp.nan), kv)


def small_mixed_batch() -> RaggedBatch:
    """One flat mixed batch for pages of 4: row 0 prefills a 5-token prompt
    (pages 1, 2), row 1 decodes its third token (page 3), two padding
    tokens; logits at each row's last token."""
    q_lens = np.array([5, 1], np.int32)
    shape = batch_shape(q_lens, num_seq_rows=2, tiling=Tiling(min_tokens=8, max_prefill_chunks=2))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return RaggedBatch(tokens=i32([1, 2, 3, 4, 5, 6, 0, 0]), positions=i32([0, 1, 2, 3, 4, 2, 0, 0]),
                       slots=i32([4, 5, 6, 7, 8, 14, -1, -1]), block_tables=i32([[1, 2, 0, 0], [3, 0, 0, 0]]),
                       q_starts=i32([0, 5]), q_lens=i32(q_lens), kv_lens=i32([5, 3]), logits_rows=i32([4, 5]),
                       shape=shape)


def mixed_calls(model, schedule, *, page_size=PAGE_SIZE, num_pages=64, max_pages=16, tiling=None,
                kv_dtype=None):
    """Runs a decoder (a ``Llama``, or a paged model with ``make_kv_pool``
    such as ``models.deepseek.model.DeepseekModel``) over a schedule of flat
    mixed batches through the page state, on a pool full of NaN.
    ``schedule``: a list of calls, each a list of ``(row, chunk_tokens)``.
    Returns, per call, ``{row: f32[V] logits at the chunk's last token}``."""
    rm = RaggedModel(model) if isinstance(model, Llama) else model
    rows_n = 1 + max(row for call in schedule for row, _ in call)
    state = ps.init_page_state(num_pages=num_pages, max_seqs=rows_n, max_pages_per_seq=max_pages,
                               page_size=page_size)
    if isinstance(model, Llama):
        kv = nan_pool(model.config, num_pages, page_size, kv_dtype)
    else:
        kv = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), model.make_kv_pool(num_pages, page_size, kv_dtype))
    apply = jax.jit(rm.apply, donate_argnums=2)
    tiling = tiling or Tiling(prefill_tile_q=4, decode_pages_per_block=2, prefill_pages_per_block=2,
                              decode_work_chunk=4, prefill_work_chunk=4, min_tokens=8)
    out = []
    for call in schedule:
        num_new = np.zeros(rows_n, np.int32)
        for row, chunk in call:
            num_new[row] = len(chunk)
        shape = batch_shape(num_new, num_seq_rows=rows_n, tiling=tiling)
        lens_before = np.asarray(state.seq_lens)
        state, ok, _, _ = ps.unchecked_extend(state, jnp.asarray(num_new))
        assert bool(ok)
        t = shape.num_tokens
        tokens, positions, rows = np.zeros(t, np.int32), np.zeros(t, np.int32), np.full(t, -1, np.int32)
        starts, last = np.zeros(rows_n, np.int32), np.zeros(shape.num_logits, np.int32)
        offset = 0
        for i, (row, chunk) in enumerate(call):
            n = len(chunk)
            starts[row] = offset
            tokens[offset:offset + n] = chunk
            positions[offset:offset + n] = lens_before[row] + np.arange(n)
            rows[offset:offset + n] = row
            last[i] = offset + n - 1
            offset += n
        slots = flat_slot_mapping(state.block_tables, jnp.asarray(rows), jnp.asarray(positions),
                                     page_size=page_size)
        batch = RaggedBatch(tokens=jnp.asarray(tokens), positions=jnp.asarray(positions), slots=slots,
                            block_tables=state.block_tables, q_starts=jnp.asarray(starts),
                            q_lens=jnp.asarray(num_new), kv_lens=state.seq_lens, logits_rows=jnp.asarray(last),
                            shape=shape)
        logits, kv, _ = apply(rm.params, batch, kv)
        logits = np.asarray(logits)
        out.append({row: logits[i] for i, (row, _) in enumerate(call)})
    return out
