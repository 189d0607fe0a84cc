"""Flat ragged paged attention: one call attends a packed token batch and
writes its new K/V into the pool.

The batch is the engine's flat batch as it is (:mod:`pallas_kernels.flat_batch`):
``q`` is ``[T, N, H]``, sequence ``s`` owns rows ``[q_starts[s], q_starts[s]
+ q_lens[s])``, the last ``q_lens[s]`` of its ``kv_lens[s]`` cached tokens; no
row is padding for another sequence's sake. The pool is the stacked ``[layers,
K, P, L, H]`` pool, read in place at ``layer``. The call writes the new
tokens' K/V (``k_new``, ``v_new`` ``[T, K, H]``) at their flat ``slots``
(``page * L + offset``, -1 for none), quantized for an int8 or fp8 pool
exactly as ``paged_jax.paging.kv_cache.write_layer_kv`` does, and returns the pool:
the caller donates it, so it is updated in place.

Work is cut into query tiles (:func:`pallas_kernels.flat_batch.tiles`, the
formula of the XLA work list): up to ``block_q`` consecutive query tokens of
one sequence. Two classes with their own tiling, as the batch's static shape
says which it has: decode (one-token sequences: one tile each, ``block_q =
1``, ``decode_tiles`` of them) and chunks (``block_q`` tokens, ``T // block_q
+ prefill_chunks`` tiles: at most one partial tile per chunk). A
decode-only call runs only the first, a prefill-only call only the second.

Implementations (``impl``):

* ``"gpu"``: a Pallas kernel in Triton lowering, grid ``(tiles, K, 1,
  k_splits)``: one program holds a tile's ``block_q`` tokens times the ``G``
  query heads of one KV head (``block_q * G_pad`` rows; the body of
  ``pallas_kernels.paged_attention_gpu.flash_paged_call``, whose rows are here
  tiles rather than padded sequences) and walks exactly the pages its
  queries see (causal limit, sliding window) with an online softmax in f32.
  GPU programs run in no order, and the engine relies on a sequence reading
  K/V another sequence writes in the same call (same-step prefix sharing,
  ``paged_jax.engine.kv_manager``), so the call first writes the new K/V with one
  XLA scatter on the donated pool (in place) and then attends.
* ``"tpu"``: a Pallas Mosaic kernel (:mod:`pallas_kernels.flat_ragged_tpu`):
  scalar prefetch of tiles and tables, a sequential grid whose first program
  writes every new token's K/V into its page by DMA before any program reads.
* ``"reference"``: plain jnp, a per-sequence ``lax.map`` over each sequence's
  whole block table; the same write. Slow, jittable, the truth beside the
  kernels (tests also hold all three to a float64 oracle).

Validated once, at :func:`flat_ragged_paged_attention`;
:func:`unchecked_flat_ragged_paged_attention` trusts its inputs (the engine
calls it after its own door, ``paged_jax.attention.ragged.check_attend``).

Sources: vLLM v1's flat batches; tpu-inference's ragged paged attention v3
(``tpu_inference/kernels/ragged_paged_attention/v3/kernel.py``: packed
tokens with ``cu_q_lens`` offsets, decode / prefill / mixed cases by the
batch's static shape, new K/V passed to the kernel and written into the cache
by it); FlashAttention's online softmax (Dao et al. 2022).

Axis letters: the alphabet of ``models/__init__.py``; U tiles, Q tokens of a
tile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import common, flat_ragged_tpu
from pallas_kernels.flat_batch import check_flat_batch, check_tiles, prefill_tiles, rows_conflict, tiles
from pallas_kernels.paged_attention_gpu import flash_paged_call

IMPLS = ("gpu", "tpu", "reference")
"""What :func:`flat_ragged_paged_attention` runs on: the Triton kernel, the
Mosaic kernel, or the jnp reference."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlatBlockSizes:
    """Tiling of :func:`flat_ragged_paged_attention`.

    Attributes:
      prefill_rows: rows (tokens times the padded query group ``G_pad``) a
        chunk tile's program holds: ``block_q = max(1, prefill_rows //
        G_pad)`` (a power of two). Not tuned on a GPU yet: 64 is the row
        count of the padded kernels' chunk programs at SmolLM2's heads
        (``block_q`` 16 times ``G_pad`` 4).
      keys_per_block: keys a program attends per loop step:
        ``pages_per_compute_block = max(1, keys_per_block // L)``, so a step
        is never under one page (Triton: a power of two >= 16).
      decode_k_splits: programs sharing one decode sequence's pages
        (flash-decoding; a power of two), for few long sequences.
      num_warps, num_stages: Triton launch parameters.
    """

    prefill_rows: int = 64
    keys_per_block: int = 64
    decode_k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        common.check_block_sizes(self, positive=("prefill_rows", "keys_per_block", "decode_k_splits", "num_warps",
                                                 "num_stages"), pow2=("prefill_rows", "keys_per_block",
                                                                      "decode_k_splits"))

    def block_q(self, group: int) -> int:
        """Query tokens per chunk tile for ``group`` query heads per KV head."""
        return max(1, self.prefill_rows // pl.next_power_of_2(group))

    def pages_per_compute_block(self, page_size: int) -> int:
        """Pages per loop step for pages of ``page_size`` tokens."""
        return max(1, self.keys_per_block // page_size)

    def check(self, impl: str, page_size: int) -> None:
        """Raises ValueError unless the ``"gpu"`` kernel can tile pages of
        ``page_size``: ``pages_per_compute_block * page_size`` must be a
        power of two >= 16 (Triton tiles)."""
        keys = self.pages_per_compute_block(page_size) * page_size
        if impl == "gpu" and (keys < 16 or keys & (keys - 1)):
            raise ValueError(f"the gpu kernel attends blocks of a power of two >= 16 keys (Triton tiles); page_size="
                             f"{page_size} gives {self.pages_per_compute_block(page_size)} * {page_size} = {keys}")


def write_new_kv(k_pool, v_pool, k_scales, v_scales, layer, k_new, v_new, slots):
    """The new tokens' K/V written into layer ``layer`` of the pool, in place
    (one scatter on the whole stacked pool; the op ``kv_cache.write_layer_kv``
    issues, bit for bit): quantized per token and KV head
    (``common.quantize_kv``) for an int8 or fp8 pool.

    Args:
      k_pool, v_pool: [layers, K, P, L, H].
      k_scales, v_scales: f32[layers, K, P, L] or None (float pool).
      layer: i32[] in the pool.
      k_new, v_new: [T, K, H] float.
      slots: i32[T] flat slot ``page * L + offset``; -1 (padding) writes
        nothing.

    Returns:
      ``(k_pool, v_pool, k_scales, v_scales)`` updated.
    """
    num_pages, page_size = k_pool.shape[2], k_pool.shape[3]
    page = jnp.where(slots < 0, num_pages, slots // page_size)  # out of range: dropped
    offset = slots % page_size

    def put(pool, new):  # pool[layer, :, page[t], offset[t]] = new[t]
        return pool.at[layer, :, page, offset].set(new.astype(pool.dtype), mode="drop")

    if k_scales is None:
        return put(k_pool, k_new), put(v_pool, v_new), None, None
    (kq, ks), (vq, vs) = common.quantize_kv(k_new, k_pool.dtype), common.quantize_kv(v_new, v_pool.dtype)
    return put(k_pool, kq), put(v_pool, vq), put(k_scales, ks), put(v_scales, vs)


def flat_ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_new: jax.Array | None,  # [T, K, H] float, or None: nothing to write
    v_new: jax.Array | None,  # [T, K, H]
    k_pool: jax.Array,  # [layers, K, P, L, H] float, or quantized (int8, fp8)
    v_pool: jax.Array,  # [layers, K, P, L, H]
    layer: int | jax.Array,  # i32[]
    block_tables: jax.Array,  # i32[E, pages_per_seq]
    q_starts: jax.Array,  # i32[E]
    q_lens: jax.Array,  # i32[E]
    kv_lens: jax.Array,  # i32[E]
    slots: jax.Array | None,  # i32[T], or None with k_new None
    *,
    k_scales: jax.Array | None = None,  # f32[layers, K, P, L] with quantized pools
    v_scales: jax.Array | None = None,  # f32[layers, K, P, L] with quantized pools
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    decode_tiles: int,
    prefill_chunks: int,
    block_sizes: FlatBlockSizes = FlatBlockSizes(),
    impl: str = "gpu",
    interpret: bool | None = None,
    latent_dim: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """Causal GQA attention of a flat token batch over its sequences' pages,
    the new tokens' K/V written first.

    Args:
      q: [T, N, H] unscaled queries, flat: sequence ``s`` owns rows
        ``q_starts[s] + t`` for ``t < q_lens[s]``; rows no sequence owns are
        padding (zeros out).
      k_new, v_new: [T, K, H] float K/V of the call's tokens (row ``t`` the
        token of query row ``t``), or both None to write nothing.
      k_pool, v_pool: [layers, K, P, L, H] the stacked pool (donate it).
      layer: the layer to write and read, in place.
      block_tables: i32[E, pages_per_seq] each sequence's pages; entries past
        its length may be any page id of the pool.
      q_starts, q_lens, kv_lens: i32[E]; query ``t`` of sequence ``s`` sits at
        position ``kv_lens[s] - q_lens[s] + t`` and sees keys at positions
        ``<=`` its own; ``q_lens[s] = 0`` leaves the sequence out. Lengths past
        a row's table are refused eagerly and clamped under ``jit``;
        sequences whose rows overlap, start below 0 or pass ``T`` are
        refused eagerly and make every output row NaN under ``jit``.
      slots: i32[T] flat slot of each row's new K/V (-1: none); the slots of
        a sequence's new tokens are those its block table gives their
        positions (the engine's slot mapping), else it reads stale K/V.
      k_scales, v_scales: f32[layers, K, P, L] per-token scales of a
        quantized pool, else None.
      scale: logit scale, default ``1 / sqrt(H)``.
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``.
      sliding_window: a query at ``p`` sees keys in ``(p - window, p]``.
      decode_tiles: static, tiles for one-token sequences (at least their
        number; 0: the call has none).
      prefill_chunks: static, chunks of 2+ tokens the call may carry (0:
        none); chunk tiles are :func:`prefill_tiles`.
      block_sizes: tiling.
      impl: one of :data:`IMPLS`.
      interpret: Pallas interpret mode; default: unless on the kernel's
        backend.
      latent_dim: MLA's absorbed form (``paged_jax.attention.latent``): C,
        the pool holds latents ``[c, k_pe]`` (H = C + R, one KV head),
        ``v_pool`` is ``k_pool`` and a value is a key's first C columns; the
        output is [T, N, C] and nothing is written (``k_new`` None). Both
        kernels read each latent once: the GPU kernel as two power-of-two
        tiles (C and R each a power of two >= 16), the TPU kernel as one
        page DMA into one VMEM buffer whose first C columns are the values.

    Returns:
      ``(out, k_pool, v_pool, k_scales, v_scales)``: out [T, N, H] (latent:
      [T, N, C]) in
      ``q.dtype`` (computed in f32; zeros in padding rows, non-finite where a
      logit or value a row sees is), the pool with the new K/V written (scales
      None for a float pool).

    Raises:
      ValueError: an unknown ``impl``; shapes or dtypes that do not fit each
        other; a ``latent_dim`` outside (0, H), with new K/V, with
        ``v_pool`` not ``k_pool``, or (gpu) whose parts are not powers of
        two >= 16; options that are not positive; static sizes below 0 (or
        both 0); a page
        size the kernel cannot tile; (eager) a layer outside the pool,
        lengths outside their ranges, rows that overlap or pass ``T``, more
        one-token sequences than ``decode_tiles`` or chunks than
        ``prefill_chunks``, or slots that are not distinct slots of the pool
        or -1.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got impl={impl!r}")
    for name, value in (("decode_tiles", decode_tiles), ("prefill_chunks", prefill_chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {name}={value!r}")
    if not decode_tiles and not prefill_chunks:
        raise ValueError("a call attends something: decode_tiles and prefill_chunks cannot both be 0")
    if not isinstance(block_sizes, FlatBlockSizes):
        raise ValueError(f"block_sizes must be a FlatBlockSizes, got {type(block_sizes).__name__}")
    common.validate_options(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    check_latent_dim(latent_dim, k_pool, v_pool, k_new, impl, k_scales, v_scales)  # before conversion: v_pool is k_pool
    traced = isinstance(q_starts, jax.core.Tracer) or isinstance(q_lens, jax.core.Tracer)
    claimed = (q_starts, q_lens)  # as given: the clamped starts below could hide a start past T
    layer, (q_starts, q_lens, kv_lens) = check_flat_batch(q, k_pool, v_pool, layer, block_tables, q_starts, q_lens,
                                                          kv_lens, k_scales, v_scales)
    # NumPy pools or scales are checked as arrays; the write needs JAX's (``.at``).
    k_pool, v_pool = jnp.asarray(k_pool), jnp.asarray(v_pool)
    k_scales, v_scales = (None, None) if k_scales is None else (jnp.asarray(k_scales), jnp.asarray(v_scales))
    block_sizes.check(impl, k_pool.shape[3])
    _check_new_kv(q, k_new, v_new, k_pool, slots)
    _check_slots_follow_tables(slots, block_tables, q_starts, q_lens, kv_lens, k_pool.shape[3])
    ql, kl = jnp.where(q_lens == 1, 1, 0), jnp.where(q_lens == 1, kv_lens, 0)
    check_tiles(ql, kl, num_tiles=decode_tiles, tile_q=1, what="decode_tiles")
    if not isinstance(q_lens, jax.core.Tracer):
        chunks = int(np.sum(np.asarray(q_lens) > 1))
        if chunks > prefill_chunks:
            raise ValueError(f"prefill_chunks={prefill_chunks} is below the {chunks} chunks of 2+ tokens in q_lens "
                             "(work would be dropped)")
    out, *pool = unchecked_flat_ragged_paged_attention(
        q, k_new, v_new, k_pool, v_pool, layer, block_tables, q_starts, q_lens, kv_lens, slots, k_scales=k_scales,
        v_scales=v_scales, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, decode_tiles=decode_tiles,
        prefill_chunks=prefill_chunks, block_sizes=block_sizes, impl=impl, interpret=interpret, latent_dim=latent_dim)
    if traced:
        # Checked eagerly; under jit a sequence's output could land in another's rows, silently: all NaN.
        out = jnp.where(rows_conflict(*claimed, q.shape[0]), jnp.nan, out)
    return (out, *pool)


def check_latent_dim(latent_dim, k_pool, v_pool, k_new, impl: str, k_scales=None, v_scales=None) -> None:
    """Raises ValueError unless ``latent_dim`` is None or an MLA latent
    split the ``impl`` can run: an int in (0, H), the same pool (and the
    same scales) as keys and values, nothing to write, and on ``"gpu"`` both
    parts (C and H - C) powers of two >= 16. "The same" is identity: under
    ``jit`` pass the one array once and use it twice inside the traced
    function (two arguments are two tracers, refused though equal)."""
    if latent_dim is None:
        return
    head_dim = k_pool.shape[-1]
    if not isinstance(latent_dim, int) or isinstance(latent_dim, bool) or not 0 < latent_dim < head_dim:
        raise ValueError(f"latent_dim must be an int in (0, {head_dim}) (C of the pool's C + R), got "
                         f"latent_dim={latent_dim!r}")
    if v_pool is not k_pool:
        raise ValueError("latent_dim: the values are the latents, so v_pool must be k_pool (the same array)")
    if v_scales is not k_scales:
        raise ValueError("latent_dim: a latent has one scale, so v_scales must be k_scales (the same array)")
    if k_new is not None:
        raise ValueError("latent_dim: the latent attention writes nothing; write the latents first and pass "
                         "k_new=v_new=slots=None")
    parts = (latent_dim, head_dim - latent_dim)
    if impl == "gpu" and any(n < 16 or n & (n - 1) for n in parts):
        raise ValueError(f"the gpu kernel reads a latent as two Triton tiles, each a power of two >= 16: latent_dim="
                         f"{latent_dim} and the rest {head_dim - latent_dim} (of head dim {head_dim})")


def _check_new_kv(q, k_new, v_new, k_pool, slots) -> None:
    """The new K/V and slots: both None, or float [T, K, H] with i32[T]
    slots that are distinct flat slots of the pool or -1 (eager)."""
    if k_new is None or v_new is None or slots is None:
        if not (k_new is None and v_new is None and slots is None):
            given = ", ".join(f"{n} {'set' if x is not None else 'None'}"
                              for n, x in (("k_new", k_new), ("v_new", v_new), ("slots", slots)))
            raise ValueError(f"k_new, v_new and slots must be given together (or all None to write nothing), got "
                             f"{given}")
        return
    want = (q.shape[0], k_pool.shape[1], k_pool.shape[4])
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if getattr(x, "shape", None) != want or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float [T, K, H] = {list(want)} array, got "
                             f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}")
    if getattr(slots, "shape", None) != (q.shape[0],) or slots.dtype != jnp.int32:
        raise ValueError(f"slots must be i32[T={q.shape[0]}], got {getattr(slots, 'dtype', None)}"
                         f"{list(getattr(slots, 'shape', ()))}")
    if not isinstance(slots, jax.core.Tracer):
        ids = np.asarray(slots)
        real = ids[ids != -1]
        limit = k_pool.shape[2] * k_pool.shape[3]
        if ((real < 0) | (real >= limit)).any() or len(set(real.tolist())) != real.size:
            raise ValueError(f"slots must be distinct flat slots in [0, {limit}) or -1 (padding), got {ids.tolist()}")


def _check_slots_follow_tables(slots, block_tables, q_starts, q_lens, kv_lens, page_size: int) -> None:
    """(eager) Each sequence's new tokens go to the slots its block table
    gives their positions, and every row no sequence owns to -1: a slot
    elsewhere would overwrite another sequence's cached K/V."""
    if slots is None or any(isinstance(x, jax.core.Tracer) for x in (slots, block_tables, q_starts, q_lens, kv_lens)):
        return
    tables, ids = np.asarray(block_tables), np.asarray(slots)
    want = np.full_like(ids, -1)
    for s, (start, n, length) in enumerate(zip(np.asarray(q_starts), np.asarray(q_lens), np.asarray(kv_lens))):
        positions = np.arange(length - n, length)
        want[start:start + n] = tables[s, positions // page_size] * page_size + positions % page_size
    wrong = np.flatnonzero(ids != want)
    if wrong.size:
        raise ValueError(f"slots must be each sequence's block-table slots for its new tokens and -1 elsewhere: row "
                         f"{int(wrong[0])} has slot {int(ids[wrong[0]])}, its table gives {int(want[wrong[0]])} "
                         f"({wrong.size} rows differ)")


def unchecked_flat_ragged_paged_attention(q, k_new, v_new, k_pool, v_pool, layer, block_tables, q_starts, q_lens,
                                          kv_lens, slots, *, k_scales=None, v_scales=None, scale=None, soft_cap=None,
                                          sliding_window=None, decode_tiles: int, prefill_chunks: int,
                                          block_sizes: FlatBlockSizes = FlatBlockSizes(), impl: str = "gpu",
                                          interpret: bool | None = None, latent_dim: int | None = None):
    """:func:`flat_ragged_paged_attention` trusting its inputs: the same
    arguments and result, with i32 lengths in their ranges, rows that do not
    overlap, tile counts that hold the batch, valid slots, ``layer`` an
    i32[] in the pool and ``latent_dim`` as its door checks. No check here
    nor under it."""
    options = dict(scale=common.resolve_scale(scale, q.shape[-1]), soft_cap=soft_cap, sliding_window=sliding_window)
    sizes = dict(decode_tiles=decode_tiles, prefill_chunks=prefill_chunks, block_sizes=block_sizes)
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    if impl == "tpu":
        out, *pool = flat_ragged_tpu.flat_ragged_tpu(
            q, k_new, v_new, k_pool, v_pool, layer, block_tables, q_starts, q_lens, kv_lens, slots, k_scales,
            v_scales, block_q=block_sizes.block_q(q.shape[1] // k_pool.shape[1]),
            pages_per_compute_block=block_sizes.pages_per_compute_block(k_pool.shape[3]),
            decode_tiles=decode_tiles, prefill_chunks=prefill_chunks,
            interpret=common.interpret_default(interpret, "tpu"), latent_dim=latent_dim, **options)
        return (out, *pool)
    if k_new is not None:
        k_pool, v_pool, k_scales, v_scales = write_new_kv(k_pool, v_pool, k_scales, v_scales, layer, k_new, v_new,
                                                          slots)
    if impl == "gpu":
        out = _gpu(q, k_pool, v_pool, layer, block_tables, q_starts, q_lens, kv_lens, k_scales, v_scales,
                   interpret=common.interpret_default(interpret, "gpu"), latent_dim=latent_dim, **sizes, **options)
    else:
        out = _reference(q, k_pool, v_pool, layer, block_tables, q_starts, q_lens, kv_lens, k_scales, v_scales,
                         **options)
        out = out if latent_dim is None else out[..., :latent_dim]
    return out, k_pool, v_pool, k_scales, v_scales


@functools.partial(jax.jit, static_argnames=("decode_tiles", "prefill_chunks", "block_sizes", "scale", "soft_cap",
                                             "sliding_window", "interpret", "latent_dim"))
def _gpu(q, k_pool, v_pool, layer, block_tables, q_starts, q_lens, kv_lens, k_scales, v_scales, *, decode_tiles,
         prefill_chunks, block_sizes, scale, soft_cap, sliding_window, interpret, latent_dim):
    """The Triton kernel over each class's tiles: [T, N, H] (latent: [T, N,
    C]) in ``q.dtype``."""
    t_total, num_q_heads, head_dim = q.shape
    out_dim = head_dim if latent_dim is None else latent_dim
    group = num_q_heads // k_pool.shape[1]
    ppcb = block_sizes.pages_per_compute_block(k_pool.shape[3])
    block_q = block_sizes.block_q(group)
    out = jnp.zeros((t_total, num_q_heads, out_dim), q.dtype)
    for rows, num_tiles, tile_q, k_splits in (
        (q_lens == 1, decode_tiles, 1, block_sizes.decode_k_splits),
        (q_lens > 1, prefill_tiles(t_total, prefill_chunks, block_q), block_q, 1),
    ):
        if num_tiles == 0:
            continue
        t = tiles(jnp.where(rows, q_lens, 0), kv_lens, num_tiles=num_tiles, tile_q=tile_q)
        r = jnp.arange(tile_q, dtype=jnp.int32)
        src = q_starts[t.seq][:, None] + t.row0[:, None] + r[None, :]  # [U, Q] flat rows
        real = r[None, :] < t.rows[:, None]
        # Each tile is a "sequence" of the kernel: its queries are the last
        # ``rows`` of ``first_pos + rows`` keys, so positions and the causal
        # limit come out right; its pages are its sequence's.
        o = flash_paged_call(
            q[jnp.where(real, src, 0)], k_pool, v_pool, layer.reshape(1), block_tables[t.seq],
            t.first_pos + t.rows, t.rows, k_scales, v_scales, block_q=tile_q, pages_per_compute_block=ppcb,
            k_splits=k_splits, num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages, scale=scale,
            soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret, latent=latent_dim)  # [U, Q, N, O]
        dest = jnp.where(real, src, t_total).reshape(-1)
        out = out.at[dest].set(o.reshape(-1, num_q_heads, out_dim), mode="drop")
    return out


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
def _reference(q, k_pool, v_pool, layer, block_tables, q_starts, q_lens, kv_lens, k_scales, v_scales, *,
               scale, soft_cap, sliding_window):
    """Plain jnp: each sequence's queries (a window of ``T`` rows from its
    start) against its whole block table, one sequence at a time
    (``lax.map``). [T, N, H] in ``q.dtype``."""
    t_total, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pool.shape[1], k_pool.shape[3]
    group = num_q_heads // num_kv_heads
    num_keys = block_tables.shape[1] * page_size
    t = jnp.arange(t_total, dtype=jnp.int32)
    k_pos = jnp.arange(num_keys, dtype=jnp.int32)

    def one(args):
        pages, q_start, q_len, kv_len = args  # [J], scalars

        def gather(pool, scales):  # pool[layer, :, pages]: [J, K, L, H] -> f32[K, S, H]
            x = pool[layer, :, pages].astype(jnp.float32)
            if scales is not None:
                x = x * scales[layer, :, pages][..., None]
            return x.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_keys, head_dim)

        k, v = gather(k_pool, k_scales), gather(v_pool, v_scales)
        q_real = t < q_len
        qs = q[jnp.clip(q_start + t, 0, t_total - 1)].astype(jnp.float32) * scale  # [T, N, H]
        q_pos = kv_len - q_len + t  # [T]
        key_real = k_pos < kv_len
        mask = (k_pos[None, :] <= q_pos[:, None]) & key_real[None, :] & q_real[:, None]  # [T, S]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        logits = jnp.einsum("TKGH,KSH->KGTS", qs.reshape(t_total, num_kv_heads, group, head_dim), k)
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(mask, logits, -jnp.inf)  # replaced, not added: NaN where no one looks stays out
        m = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
        v = jnp.where(key_real[None, :, None], v, 0.0)  # 0 * NaN is NaN
        denom = jnp.where(q_real[None, None, :], p.sum(-1), 1.0)  # [K, G, T]; a real row sees its own key
        o = jnp.einsum("KGTS,KSH->KGTH", p, v) / denom[..., None]
        o = jnp.where(q_real[None, None, :, None], o, 0.0).transpose(2, 0, 1, 3)  # [T, K, G, H]
        o = o.reshape(t_total, num_q_heads, head_dim)
        return o, jnp.where(q_real, q_start + t, t_total)

    outs, dest = jax.lax.map(one, (block_tables, q_starts, q_lens, kv_lens))  # [E, T, N, H], [E, T]
    out = jnp.zeros(q.shape, jnp.float32).at[dest.reshape(-1)].set(outs.reshape(-1, num_q_heads, head_dim),
                                                                   mode="drop")
    return out.astype(q.dtype)


ref_flat_ragged_paged_attention = functools.partial(flat_ragged_paged_attention, impl="reference")
"""The jnp reference of :func:`flat_ragged_paged_attention`, same positional
arguments (checked at the same door)."""
