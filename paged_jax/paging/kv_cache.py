"""The KV page pool: K and V pages for every layer, written through slot mappings.

Layout, per layer: ``[num_kv_heads, num_pages, page_size, head_dim]`` (the
layout of JAX's Pallas paged-attention kernels: one KV head's pages are
contiguous, so a kernel program that owns a KV head streams its pages). All
layers are stacked in front, ``[num_layers, K, P, L, H]``, so the decoder can
``lax.scan`` over layers with the pool in the carry and update it in place.

Token ``t`` of a sequence lives in page ``block_table[t // L]`` at offset
``t % L``: flat slot ``page * L + offset`` of the pool viewed as
``[K, P * L, H]`` (vLLM's *slot mapping*). Slot ``-1`` means "no token"
(padding) and is dropped on write.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from paged_jax.checks import check_int
from paged_jax.paging.page_state import NO_PAGE
from pallas_kernels.common import check_kv_dtype, is_quantized, quantize_kv


@struct.dataclass
class KVPool:
    """K and V pages for all layers.

    Attributes:
      k: [num_layers, num_kv_heads, num_pages, page_size, head_dim], float
        (f32, bf16, f16), or quantized (int8, float8_e4m3fn, float8_e5m2)
        with scales.
      v: same shape and dtype as ``k``; None in a *latent* pool (MLA,
        :func:`init_latent_pool`): one KV head whose vector per token is
        the compressed K/V and the RoPE key, the values its first
        ``kv_lora_rank`` entries (:mod:`paged_jax.attention.latent`), so
        nothing is stored twice.
      k_scale, v_scale: f32[num_layers, num_kv_heads, num_pages, page_size]
        per-token, per-KV-head scales of a quantized pool (``x ~= x_q *
        scale``, ``pallas_kernels.common.quantize_kv``); None for a float
        pool. Every whole-page operation (copy-on-write, swap) moves them
        with their pages: it maps over the pool's leaves, whose third axis
        is always the page.
    """

    k: jax.Array  # [layers, K, P, L, H]
    v: jax.Array | None  # [layers, K, P, L, H]; None in a latent pool
    k_scale: jax.Array | None = None  # f32[layers, K, P, L] (quantized pools)
    v_scale: jax.Array | None = None  # f32[layers, K, P, L] (quantized pools)

    @property
    def latent(self) -> bool:
        """A latent pool (MLA): K pages only, the values read from them."""
        return self.v is None

    @property
    def quantized(self) -> bool:
        """Quantized pages (int8 or fp8) with per-token scales."""
        return self.k_scale is not None

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def head_dim(self) -> int:
        return self.k.shape[4]

    @property
    def nbytes(self) -> int:
        """Bytes held by K and V together (scales included)."""
        return sum(x.nbytes for x in jax.tree.leaves(self))


def default_kv_dtype() -> jnp.dtype:
    """The K/V page dtype serving uses unless told: bf16 on GPU and TPU
    (half the bytes each decode step reads), f32 on CPU (where XLA's bf16
    arithmetic is slower than f32: FACTS.md)."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def init_kv_pool(
    *,
    num_layers: int,
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    dtype=jnp.float32,
) -> KVPool:
    """A zeroed pool. Memory: ``2 * num_layers * num_kv_heads * num_pages *
    page_size * head_dim * itemsize`` bytes.

    With a quantized ``dtype`` (int8, float8_e4m3fn, float8_e5m2, or
    ``"fp8"`` for float8_e4m3fn) the pool also holds f32 scales per token
    and KV head (``H + 4`` bytes per token and head instead of ``2 H`` for
    bf16); writes quantize (:func:`write_layer_kv`), attention dequantizes.
    The pages are allocated in exactly ``dtype``, never a wider stand-in.

    Raises:
      ValueError: a size that is not a positive int (``num_pages`` >= 2: the
        null page plus one usable page), or a dtype outside
        ``pallas_kernels.common.KV_DTYPES`` (float64 would silently be f32
        without ``jax_enable_x64``, an integer would truncate K and V,
        float8_e4m3fnuz has other NaN and zero encodings).
    """
    for name, value, low in (
        ("num_layers", num_layers, 1),
        ("num_kv_heads", num_kv_heads, 1),
        ("num_pages", num_pages, 2),
        ("page_size", page_size, 1),
        ("head_dim", head_dim, 1),
    ):
        check_int(name, value, low)
    dtype = check_kv_dtype("dtype", dtype)
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    if not is_quantized(dtype):
        return KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    return KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                  k_scale=jnp.zeros(shape[:-1], jnp.float32), v_scale=jnp.zeros(shape[:-1], jnp.float32))


def write_layer_pages(pool: jax.Array, layer: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """Writes new tokens' K (or V) into one layer of the stacked pool, in place.

    Same semantics as :func:`write_pages` applied to
    ``pool[layer]``, but as one scatter on the whole ``[layers, K, P, L, H]``
    array. Why: inside the layer scan the pool is a loop carry, and XLA
    updates a carry in place only if the scatter targets the carry itself;
    ``pool.at[layer].set(write_pages(pool[layer], ...))`` copies the layer
    out and back, which moves the whole pool every step. Measured on CPU,
    SmolLM2 shapes, 1024 pages of 16 tokens, the 30 layers' KV writes and
    decode attention alone: 112 ms a step that way, 6.7 ms this way (and
    independent of the pool size). Indexing the 5-D pool directly matters
    too: the same scatter on a ``[layers, K, P * L, H]`` view ran ~150x
    slower.

    Args:
      pool: [layers, K, P, L, H].
      layer: i32[] layer index.
      new: [N_tok, K, H] values for ``N_tok`` tokens.
      slots: i32[N_tok] flat slot ``page * L + offset``; -1 (padding) is
        skipped.

    Returns:
      [layers, K, P, L, H] the updated pool.
    """
    num_pages, page_size = pool.shape[2], pool.shape[3]
    page = jnp.where(slots < 0, num_pages, slots // page_size)  # out of range: dropped
    offset = slots % page_size
    # pool[layer, :, page[n], offset[n]] = new[n]: updates [N_tok, K, H]
    return pool.at[layer, :, page, offset].set(new.astype(pool.dtype), mode="drop")


def check_pool(kv: KVPool) -> None:
    """Raises ValueError unless ``kv`` is a well-formed pool: K and V of one
    shape ``[layers, K, P, L, H]`` and one page dtype
    (``pallas_kernels.common.KV_DTYPES``), float without scales or quantized
    (int8, fp8) with f32 scales ``k.shape[:-1]`` (quantized pages without
    scales would store truncated K/V; float ones with scales would be read
    as if scaled). Static facts only, so it runs under ``jit``."""
    if kv.v is None:
        _check_latent_pool(kv)
        return
    if getattr(kv.k, "ndim", None) != 5 or getattr(kv.v, "shape", None) != kv.k.shape:
        raise ValueError(f"kv pool K and V must both be [layers, K, P, L, H] of one shape, got "
                         f"{getattr(kv.k, 'shape', kv.k)} and {getattr(kv.v, 'shape', kv.v)}")
    if kv.v.dtype != kv.k.dtype:
        raise ValueError(f"kv pool K and V must share one dtype, got {kv.k.dtype} and {kv.v.dtype}")
    check_kv_dtype("kv pool dtype", kv.k.dtype)
    quantized = is_quantized(kv.k.dtype)
    if quantized != (kv.k_scale is not None) or quantized != (kv.v_scale is not None):
        article = "an" if kv.k.dtype.name[0] in "aeiou" else "a"
        needs = "needs k_scale and v_scale" if quantized else "takes neither k_scale nor v_scale"
        raise ValueError(f"{article} {kv.k.dtype} kv pool {needs} (a quantized pool needs them and a float one has "
                         f"none); got k_scale {'set' if kv.k_scale is not None else 'None'}, v_scale "
                         f"{'set' if kv.v_scale is not None else 'None'}")
    for name, x in (("k_scale", kv.k_scale), ("v_scale", kv.v_scale)):
        if x is not None and (getattr(x, "shape", None) != kv.k.shape[:-1] or x.dtype != jnp.float32):
            raise ValueError(f"kv pool {name} must be f32{list(kv.k.shape[:-1])}, got "
                             f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}")


def _check_latent_pool(kv: KVPool) -> None:
    """:func:`check_pool` for a latent pool (``v`` None): K of one head
    ``[layers, 1, P, L, D]``, no ``v_scale``, a ``k_scale`` exactly when
    quantized."""
    if getattr(kv.k, "ndim", None) != 5 or kv.k.shape[1] != 1:
        raise ValueError(f"a latent kv pool (v None) must hold K as [layers, 1, P, L, D] (one KV head), got "
                         f"{getattr(kv.k, 'shape', kv.k)}")
    check_kv_dtype("kv pool dtype", kv.k.dtype)
    quantized = is_quantized(kv.k.dtype)
    if kv.v_scale is not None or quantized != (kv.k_scale is not None):
        raise ValueError(f"a latent {kv.k.dtype} kv pool takes {'a k_scale' if quantized else 'no k_scale'} and no "
                         f"v_scale; got k_scale {'set' if kv.k_scale is not None else 'None'}, v_scale "
                         f"{'set' if kv.v_scale is not None else 'None'}")
    if kv.k_scale is not None and (getattr(kv.k_scale, "shape", None) != kv.k.shape[:-1]
                                   or kv.k_scale.dtype != jnp.float32):
        raise ValueError(f"kv pool k_scale must be f32{list(kv.k.shape[:-1])}, got "
                         f"{getattr(kv.k_scale, 'dtype', type(kv.k_scale).__name__)}"
                         f"{list(getattr(kv.k_scale, 'shape', ()))}")


def _check_layer(pool: KVPool, layer) -> None:
    """(eager ``layer`` only) an integer scalar in ``[0, num_layers)``, or a ValueError naming it."""
    if isinstance(layer, jax.core.Tracer):
        return
    index = None if isinstance(layer, (bool, str)) else np.asarray(layer)
    if index is None or index.ndim != 0 or index.dtype.kind not in "iu":
        raise ValueError(f"layer must be an integer scalar, got layer={layer!r}")
    if not 0 <= int(index) < pool.num_layers:
        raise ValueError(f"layer must be in [0, num_layers={pool.num_layers}), got layer={layer!r}")


def init_latent_pool(*, num_layers: int, num_pages: int, page_size: int, latent_dim: int,
                     dtype=jnp.float32) -> KVPool:
    """A zeroed latent pool for multi-head latent attention (MLA, DeepSeek-V2
    section 2.1; DeepSeek-V3, Kimi K2): per layer and token one vector of
    ``latent_dim`` = ``kv_lora_rank + qk_rope_head_dim`` values (576 for
    DeepSeek-V3), K of one head ``[num_layers, 1, P, L, latent_dim]`` and no
    V (``KVPool.v`` None). Memory: ``num_layers * latent_dim * itemsize``
    bytes a token (``paged_jax.memory.ModelSpec.kv_bytes_per_token``), plus
    ``num_layers * 4`` for a quantized pool's per-token scale.

    Page state, block tables, copy-on-write (:func:`copy_pages`) and swap
    (:mod:`paged_jax.paging.swap`) work on it unchanged: they map over the
    pool's leaves.

    Raises:
      ValueError: as :func:`init_kv_pool` (``latent_dim`` for ``head_dim``).
    """
    pool = init_kv_pool(num_layers=num_layers, num_kv_heads=1, num_pages=num_pages, page_size=page_size,
                        head_dim=latent_dim, dtype=dtype)
    return KVPool(k=pool.k, v=None, k_scale=pool.k_scale)


def write_layer_latent(pool: KVPool, layer: jax.Array, latent: jax.Array, slots: jax.Array) -> KVPool:
    """Writes new tokens' latents ``f32[N_tok, D]`` (``[c, k_pe]``) into one
    layer of a latent pool at flat ``slots`` (i32[N_tok], -1 dropped),
    quantized per token for an int8 / fp8 pool.

    Raises:
      ValueError: not a latent pool; ``latent`` not a float ``[N_tok, D]``
        with the pool's D; (eager) a ``layer`` outside the pool or
        ``slots`` that are not distinct slots of the pool or -1, one per
        token (:func:`check_slots`).
    """
    if not pool.latent:
        raise ValueError("write_layer_latent takes a latent pool (init_latent_pool, v None); write K and V with "
                         "write_layer_kv")
    check_pool(pool)
    _check_layer(pool, layer)
    if getattr(latent, "ndim", None) != 2 or latent.shape[1] != pool.head_dim or not jnp.issubdtype(
            latent.dtype, jnp.floating):
        raise ValueError(f"latent must be a float [N_tok, {pool.head_dim}] array, got "
                         f"{getattr(latent, 'dtype', type(latent).__name__)}{list(getattr(latent, 'shape', ()))}")
    check_slots(pool, slots, latent.shape[0])
    slots = jnp.asarray(slots, jnp.int32)
    new = latent[:, None, :]  # [N_tok, 1, D]: one KV head
    if not pool.quantized:
        return KVPool(k=write_layer_pages(pool.k, layer, new, slots), v=None)
    q, scale = quantize_kv(new, pool.k.dtype)
    return KVPool(k=write_layer_pages(pool.k, layer, q, slots), v=None,
                  k_scale=write_layer_pages(pool.k_scale, layer, scale, slots))


def write_layer_kv(pool: KVPool, layer: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> KVPool:
    """Writes new tokens' K and V into one layer of the pool, in place
    (:func:`write_layer_pages`); a quantized pool stores them quantized to
    its dtype (int8, fp8) per token and KV head
    (``pallas_kernels.common.quantize_kv``) with their scales.

    Args:
      pool: the pool.
      layer: i32[] layer index.
      k, v: [N_tok, K, H] float values.
      slots: i32[N_tok] flat slots; -1 is skipped.

    Returns:
      The updated pool.

    Raises:
      ValueError: a malformed pool (:func:`check_pool`); ``k`` or ``v`` not
        float ``[N_tok, K, H]`` with the pool's heads, or holding different
        token counts; (eager) a ``layer`` that is not an integer scalar in
        ``[0, layers)`` (under ``jit`` such a write is dropped), or ``slots``
        that are not distinct slots of the pool or -1, one per token.
    """
    check_pool(pool)
    if pool.latent:
        raise ValueError("write_layer_kv takes a K/V pool; a latent pool (v None) takes write_layer_latent")
    _check_layer(pool, layer)
    want = (pool.num_kv_heads, pool.head_dim)
    for name, x in (("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3 or tuple(x.shape[1:]) != want or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float [N_tok, K={want[0]}, H={want[1]}] array (the pool's heads), got "
                             f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must hold the same tokens, got {k.shape[0]} and {v.shape[0]}")
    check_slots(pool, slots, k.shape[0])
    return unchecked_write_layer_kv(pool, layer, k, v, jnp.asarray(slots, jnp.int32))


def check_slots(pool: KVPool, slots: jax.Array, num_tokens: int) -> None:
    """The slot check of :func:`write_layer_kv`, for a caller that validates
    once and then calls :func:`unchecked_write_layer_kv` (a decoder: once
    per model call, not once per layer).

    Raises:
      ValueError: (eager ``slots`` only; under ``jit`` a slot outside the
        pool is dropped) ``slots`` that are not an integer ``[num_tokens]``
        array of distinct flat slots of the pool or -1.
    """
    if isinstance(slots, jax.core.Tracer):
        return
    ids = np.asarray(slots)
    limit = pool.num_pages * pool.page_size
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.shape[0] != num_tokens:
        raise ValueError(f"slots must be an integer [N_tok={num_tokens}] array, got {ids.dtype}{list(ids.shape)}")
    real = ids[ids != -1]
    if ((real < 0) | (real >= limit)).any() or len(set(real.tolist())) != real.size:
        raise ValueError(f"slots must be distinct flat slots in [0, {limit}) or -1 (padding), got {ids.tolist()}")


def unchecked_write_layer_kv(pool: KVPool, layer: jax.Array, k: jax.Array, v: jax.Array,
                             slots: jax.Array) -> KVPool:
    """:func:`write_layer_kv` trusting its arguments (a well-formed pool,
    checked slots); same result."""
    if not pool.quantized:
        return KVPool(k=write_layer_pages(pool.k, layer, k, slots), v=write_layer_pages(pool.v, layer, v, slots))
    (kq, ks), (vq, vs) = quantize_kv(k, pool.k.dtype), quantize_kv(v, pool.v.dtype)  # [N_tok, K, H], f32[N_tok, K]
    return KVPool(k=write_layer_pages(pool.k, layer, kq, slots), v=write_layer_pages(pool.v, layer, vq, slots),
                  k_scale=write_layer_pages(pool.k_scale, layer, ks, slots),
                  v_scale=write_layer_pages(pool.v_scale, layer, vs, slots))


def write_pages(pages: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """Writes new tokens' K (or V) into one layer's pages.

    Args:
      pages: [K, P, L, H] one layer's pages.
      new: [N_tok, K, H] values for ``N_tok`` tokens.
      slots: i32[N_tok] flat slot per token; -1 (padding) is skipped.

    Returns:
      [K, P, L, H] the updated pages.
    """
    return write_layer_pages(pages[None], 0, new, slots)[0]


def copy_pages(pool: KVPool, src: jax.Array, dst: jax.Array) -> KVPool:
    """Copies whole pages ``src[i] -> dst[i]`` in every layer (copy-on-write).

    Args:
      pool: the pool.
      src, dst: i32[n] page ids; ``NO_PAGE`` (-1) entries are skipped.

    Raises:
      ValueError: a malformed pool (:func:`check_pool`), ``src`` and
        ``dst`` of different shapes, or (eager) ids that are not integers
        in ``[-1, num_pages)``.
    """
    check_pool(pool)
    if jnp.shape(src) != jnp.shape(dst) or jnp.ndim(src) != 1:
        raise ValueError(f"src and dst must be i32[n] of one shape, got {jnp.shape(src)} and {jnp.shape(dst)}")
    for name, ids in (("src", src), ("dst", dst)):
        if not isinstance(ids, jax.core.Tracer):
            if np.asarray(ids).dtype.kind not in "iu":
                raise ValueError(f"{name} must be integer page ids, got dtype {np.asarray(ids).dtype}")
            bad = np.asarray(ids)[(np.asarray(ids) < NO_PAGE) | (np.asarray(ids) >= pool.num_pages)]
            if bad.size:
                raise ValueError(f"{name} must be page ids in [0, num_pages={pool.num_pages}) or -1, "
                                 f"got {bad.tolist()}")
    skip = (src == NO_PAGE) | (dst == NO_PAGE)
    dst = jnp.where(skip, pool.num_pages, dst)
    src = jnp.where(skip, 0, src)

    def one(x):  # [layers, K, P, ...]: K/V pages and scales alike
        return x.at[:, :, dst].set(x[:, :, src], mode="drop")

    return jax.tree.map(one, pool)
