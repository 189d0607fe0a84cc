"""The flat token batch, as every attention over it sees it: its door's
checks, its query tiles and the key blocks a tile reads.

A flat batch packs the ``T`` query tokens of one model call in one array
(vLLM v1's layout; tpu-inference's ragged paged attention packs tokens the
same way): sequence ``s`` owns rows ``[q_starts[s], q_starts[s] +
q_lens[s])``, the last ``q_lens[s]`` of its ``kv_lens[s]`` cached tokens, so
query ``t`` of it sits at position ``kv_lens[s] - q_lens[s] + t``.

Both the XLA work list (``paged_jax.attention.ragged``) and the flat Pallas
kernels (:mod:`pallas_kernels.flat_ragged_attention`) cut the batch into
*tiles*: up to ``tile_q`` consecutive query tokens of one sequence, in
sequence order. :func:`tiles` derives them on device from the lengths;
:func:`count_work` runs the same formula on the host (NumPy), so the host's
counts are the device's. A tile reads the key blocks :func:`tile_blocks`
gives: keys up to its last query's position (causal), from its first
query's window start with a sliding window.

:func:`check_flat_batch` is the door every flat-batch entry shares: shapes,
dtypes, the layer, the lengths (eager: refused outside their ranges; traced:
clamped, so no row can read past its block table) and sequences' rows that
neither overlap nor pass ``T``.

Axis letters: the alphabet of ``models/__init__.py``; U tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common


def cdiv(a, b):
    """``ceil(a / b)`` for integers (Python, NumPy or traced)."""
    return (a + b - 1) // b


def tile_blocks(first_pos, last_pos, *, block_tokens: int, sliding_window: int | None = None, xp=np):
    """Key blocks a query tile attends: ``(first_block, num_blocks)``.

    A tile whose queries sit at positions ``[first_pos, last_pos]`` sees keys
    ``[0, last_pos]`` (causal), or ``(first_pos - sliding_window, last_pos]``
    with a window; in blocks of ``block_tokens`` keys. ``xp`` is ``numpy``
    on the host and ``jax.numpy`` on device: one formula, so the host's
    counts are the device's.
    """
    hi = last_pos // block_tokens + 1
    if sliding_window is None:
        lo = xp.zeros_like(hi)
    else:
        lo = xp.maximum(first_pos - sliding_window + 1, 0) // block_tokens
    return lo, hi - lo


class Tiles(NamedTuple):
    """The query tiles of a flat batch (all i32[U]). Tiles past the batch's
    last one have ``rows = 0`` (and a clamped ``seq``): they do nothing.

    Attributes:
      seq: the sequence a tile belongs to.
      row0: its first query's index within the sequence's queries.
      rows: its query tokens, ``<= tile_q``.
      first_pos: its first query's position.
    """

    seq: jax.Array
    row0: jax.Array
    rows: jax.Array
    first_pos: jax.Array

    @property
    def last_pos(self):
        """The position of each tile's last query (``first_pos - 1`` for an
        empty tile)."""
        return self.first_pos + self.rows - 1


def tiles(q_lens, kv_lens, *, num_tiles: int, tile_q: int, xp=jnp) -> Tiles:
    """The first ``num_tiles`` tiles of ``tile_q`` query tokens: sequence
    ``s`` takes ``ceil(q_lens[s] / tile_q)`` of them, in sequence order.

    Args:
      q_lens, kv_lens: i32[E] as in the module docstring; a sequence with
        ``q_lens = 0`` takes no tile.
      num_tiles: U, static; tiles past the batch's last are empty, and a
        batch needing more than U loses the rest (callers check it with
        :func:`count_work`).
      tile_q: query tokens per tile.
      xp: ``jax.numpy`` (device) or ``numpy`` (host).
    """
    i32 = np.int32 if xp is np else jnp.int32
    q_lens, kv_lens = xp.asarray(q_lens).astype(i32), xp.asarray(kv_lens).astype(i32)
    tiles_per_seq = cdiv(q_lens, tile_q)  # [E]
    tile_end = xp.cumsum(tiles_per_seq)
    ids = xp.arange(num_tiles, dtype=i32)
    seq = xp.minimum(xp.searchsorted(tile_end, ids, side="right"), q_lens.shape[0] - 1).astype(i32)
    real = ids < tile_end[-1]
    row0 = (ids - (tile_end - tiles_per_seq)[seq]) * tile_q
    rows = xp.where(real, xp.clip(q_lens[seq] - row0, 0, tile_q), 0).astype(i32)
    first_pos = (kv_lens[seq] - q_lens[seq] + row0).astype(i32)
    return Tiles(seq=seq, row0=row0.astype(i32), rows=rows, first_pos=first_pos)


def prefill_tiles(num_tokens: int, prefill_chunks: int, block_q: int) -> int:
    """Chunk tiles of ``block_q`` tokens a call of ``num_tokens`` rows with up
    to ``prefill_chunks`` chunks needs at most: ``num_tokens // block_q +
    prefill_chunks`` (the chunks' tokens are at most ``num_tokens``, and each
    adds at most one partial tile); 0 without chunks."""
    return num_tokens // block_q + prefill_chunks if prefill_chunks else 0


def count_work(q_lens, kv_lens, *, tile_q: int, block_tokens: int,
               sliding_window: int | None = None) -> tuple[int, int]:
    """Host side: ``(num_tiles, num_blocks)`` a flat batch with these lengths
    needs with tiles of ``tile_q`` queries and key blocks of
    ``block_tokens`` (NumPy, exact; :func:`tiles` and :func:`tile_blocks`,
    the device's formula).

    Args:
      q_lens, kv_lens: i32[E] as in the module docstring.
      tile_q: query tokens per tile.
      block_tokens: keys per block.
      sliding_window: a query at ``p`` sees keys in ``(p - window, p]``.
    """
    q_lens = np.asarray(q_lens, np.int64)
    num_tiles = int(cdiv(q_lens, tile_q).sum())
    if num_tiles == 0:
        return 0, 0
    t = tiles(q_lens, kv_lens, num_tiles=num_tiles, tile_q=tile_q, xp=np)
    _, n = tile_blocks(t.first_pos, t.last_pos, block_tokens=block_tokens, sliding_window=sliding_window)
    return num_tiles, int(n.sum())


def check_tiles(q_lens, kv_lens, *, num_tiles: int, tile_q: int, what: str = "num_tiles") -> None:
    """Raises ValueError when the lengths are concrete (not traced) and need
    more than ``num_tiles`` tiles of ``tile_q`` queries (the rest of the work
    would be dropped); ``what`` names the argument in the message."""
    if any(isinstance(x, jax.core.Tracer) for x in (q_lens, kv_lens)):
        return
    need = int(cdiv(np.asarray(q_lens, np.int64), tile_q).sum())
    if num_tiles < need:
        raise ValueError(f"{what}={num_tiles} is below the {need} tiles these lengths need (work would be dropped)")


def rows_conflict(q_starts, q_lens, num_rows: int, *, xp=jnp):
    """Whether a flat batch's sequences claim rows they cannot: a start
    below 0, rows past ``num_rows``, or two sequences' rows overlapping
    (``q_lens`` 0 claims nothing). With ``xp=jnp`` it runs under ``jit``
    (E x E comparisons; E is at most a few hundred).

    Args:
      q_starts, q_lens: integer [E].
      num_rows: T, the batch's query rows.

    Returns:
      bool[] (``xp``'s).
    """
    live = q_lens > 0
    # Out of range first, without adding (int32 starts near 2**31 would wrap past T); then in-range rows, whose
    # ends are at most 2 T.
    outside = live & ((q_starts < 0) | (q_starts > num_rows) | (q_lens > num_rows) | (q_starts > num_rows - q_lens))
    starts = xp.clip(q_starts, 0, num_rows)
    ends = starts + xp.clip(q_lens, 0, num_rows)
    both = live[:, None] & live[None, :] & ~xp.eye(live.shape[0], dtype=bool)
    overlap = both & (starts[:, None] < ends[None, :]) & (starts[None, :] < ends[:, None])
    return overlap.any() | outside.any()


def check_flat_batch(q, k_pool, v_pool, layer, block_tables, q_starts, q_lens, kv_lens, k_scales, v_scales):
    """The checks every flat-batch door shares: shapes and dtypes; when the
    values are concrete, the layer and lengths in range and sequences' rows
    inside ``T`` without overlap.

    Args:
      q: [T, N, H] (an array or a ``jax.ShapeDtypeStruct``).
      k_pool, v_pool: [layers, K, P, L, H] of one page dtype.
      layer: an integer scalar.
      block_tables: i32[E, pages_per_seq].
      q_starts, q_lens, kv_lens: integer [E].
      k_scales, v_scales: f32[layers, K, P, L] exactly when the pool is
        quantized (``common.check_scales``).

    Returns:
      ``(layer, (q_starts, q_lens, kv_lens))``: the layer as i32[] and the
      lengths as i32, clamped to their ranges (under ``jit`` nothing can be
      read, and no row may read past its block table; rows that overlap are
      the caller's to poison, :func:`rows_conflict`).

    Raises:
      ValueError: shapes or dtypes that do not fit each other, a ``q``
        that is not float, ``layer`` None, no sequence or no query row, a
        block table that is not integer or has no column; (eager) a layer outside the
        pool, lengths that do not fit int32 or fall outside their ranges
        (``common.checked_lengths``), sequences whose rows overlap or pass
        ``T``.
    """
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim], got shape {getattr(q, 'shape', q)}")
    if getattr(k_pool, "ndim", None) != 5 or getattr(v_pool, "shape", None) != k_pool.shape:
        raise ValueError(
            "k_pool and v_pool must both be [layers, K, P, L, H], got shapes "
            f"{getattr(k_pool, 'shape', k_pool)} and {getattr(v_pool, 'shape', v_pool)}"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):  # an integer q would come back truncated, silently
        raise ValueError(f"q must be a float array, got dtype {q.dtype}")
    if q.shape[2] != k_pool.shape[4] or q.shape[1] % k_pool.shape[1]:
        raise ValueError(f"q {q.shape} does not fit the pool {k_pool.shape}: head dims differ, or query heads "
                         "are not a multiple of KV heads")
    num_seqs = getattr(q_lens, "shape", (None,))[0]
    for name, x in (("q_starts", q_starts), ("q_lens", q_lens), ("kv_lens", kv_lens)):
        if getattr(x, "shape", None) != (num_seqs,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer [E={num_seqs}] array, got {getattr(x, 'shape', x)}")
        if not isinstance(x, jax.core.Tracer) and x.size:  # int64 / uint32 values must survive the cast to int32
            lo, hi = int(np.min(np.asarray(x))), int(np.max(np.asarray(x)))
            if lo < -2**31 or hi >= 2**31:
                raise ValueError(f"{name} must fit int32, got values in [{lo}, {hi}]")
    if (getattr(block_tables, "ndim", None) != 2 or block_tables.shape[0] != num_seqs or block_tables.shape[1] < 1
            or not jnp.issubdtype(block_tables.dtype, jnp.integer)):
        raise ValueError(f"block_tables must be an integer [E={num_seqs}, pages_per_seq >= 1] array, got "
                         f"{getattr(block_tables, 'dtype', type(block_tables).__name__)}"
                         f"{list(getattr(block_tables, 'shape', ()))}")
    if num_seqs < 1 or q.shape[0] < 1:  # the kernels' grids need both; an empty call has nothing to attend
        raise ValueError(f"a call needs at least one sequence and one query row, got E={num_seqs} and T={q.shape[0]}")
    if v_pool.dtype != k_pool.dtype:
        raise ValueError(f"k_pool and v_pool must share one dtype, got {k_pool.dtype} and {v_pool.dtype}")
    common.check_scales("k_pool", k_pool.dtype, k_pool.shape, k_scales, v_scales)
    if layer is None:  # checked_layer's None means a one-layer stack; this door reads a stacked pool
        raise ValueError(f"layer must be an integer scalar, the layer of the [{k_pool.shape[0]}, ...] pool to read, "
                         "got None")
    layer = common.checked_layer(layer, k_pool.shape[0])[0]  # i32[], in range (clamped under jit)
    i32 = jnp.int32
    kv_lens, q_lens = common.checked_lengths(block_tables, k_pool.shape[2], k_pool.shape[3], kv_lens.astype(i32),
                                             q_lens.astype(i32))  # ranges, named (eager); clamped
    if not any(isinstance(x, jax.core.Tracer) for x in (q_starts, q_lens, kv_lens)):
        ql, qs = np.asarray(q_lens), np.asarray(q_starts)
        if rows_conflict(qs, ql, q.shape[0], xp=np):
            raise ValueError(f"sequences' query rows overlap or pass T={q.shape[0]}: q_starts={qs.tolist()} "
                             f"q_lens={ql.tolist()}")
    # Under jit a start cannot be checked: clamped into the rows, so no output lands past T (or wraps to its end);
    # the door poisons the output of such a call (rows_conflict on the starts as given).
    return layer, (jnp.clip(q_starts.astype(i32), 0, q.shape[0] - 1), q_lens, kv_lens)
