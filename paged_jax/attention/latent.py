"""Multi-head latent attention (MLA) over latent pages: DeepSeek-V2's
attention (DeepSeek-AI, 2024, section 2.1), kept by DeepSeek-V3 and Kimi K2.

What a token caches. Per layer, one vector of ``C + R`` values: the
compressed K/V ``c`` (``kv_lora_rank`` = C, 512 in DeepSeek-V3) and the
RoPE key ``k_pe`` shared by every head (``qk_rope_head_dim`` = R, 64): 576
values, where GQA with the same 128 heads of 128 + 64 would cache
``2 * 128 * 192``. The pages are a pool of one KV head and head dim
``C + R`` (``[layers, 1, P, L, C + R]``), and there is no V pool: a value
is the first C entries of the same vector, so the same pages are passed as
keys and values and nothing is stored twice.

The attention of head ``n`` of a query with ``q_nope`` (H_nope = 128) and
``q_pe`` (R) parts, over a key token with latent ``c`` and ``k_pe``::

    score = q_nope . (W_UK[n] c) + q_pe . k_pe           (times scale)
    out_n = W_UV[n]^T sum_s softmax(score)_s c_s

Two forms compute it (vLLM's MLA backends and FlashMLA use both):

- **absorbed** (:func:`absorbed_paged_attention`, and
  :func:`absorbed_ragged_attention` on the engine's flat batch through
  its one door, :func:`paged_jax.attention.ragged.attend`, so the flat
  Pallas kernels serve it too): ``W_UK[n]`` is folded
  into the query, ``q_lat = W_UK[n]^T q_nope`` (C values), so every head
  attends the cached ``[c, k_pe]`` directly: multi-query attention with
  one KV head of C + R (the paged attention this package already has,
  keys and values the same pages), the output's first C columns the
  attended latent, and ``W_UV[n]`` applied after. Per key token and head
  it costs ``2 (C + R) + 2 C`` flops and reads each latent once for all
  heads: the decode form.
- **expanded** (:func:`expanded_paged_attention`): each attended token's
  latent is projected up to per-head keys ``[W_UK[n] c, k_pe]`` and values
  ``W_UV[n]^T c``, then ordinary attention with query/key head dim
  H_nope + R and value head dim H_v. The up-projection costs
  ``2 S N (H_nope + H_v) C`` flops for S key tokens whatever the number of
  queries T, and then each (query, key, head) ``2 (H_nope + R) + 2 H_v``;
  the absorbed form pays ``2 (C + R) + 2 C`` there instead. With
  DeepSeek-V3's sizes (C = 512, R = 64, H_nope = H_v = 128) expanded wins
  by flops once a sequence has more than about
  ``(H_nope + H_v) C / ((C + R) + C - (H_nope + R) - H_v) = 170`` query
  tokens in the call: long prefill chunks; decode (T = 1) is absorbed.
  Measured (``experiments.kernels.mla_prefill_bench``,
  ``results/mla_prefill_bench.md``: one sequence of 1,024 tokens, 16
  heads, f32, 2 Xeon cores): on the engine's flat batch expanded /
  absorbed time 1.31, 1.75, 1.31 at 16, 64 and 128 query tokens, 0.82,
  0.79, 0.80 at 256, 512 and 1,024 (padded, 4.12, 2.16, 1.69 and 0.96,
  0.95, 0.98), so the crossover lies between 128 and 256, where the flops
  put it.

On the engine's flat batch (:func:`latent_ragged_attention`, what
:mod:`models.deepseek.model` calls) the choice is made per row, inside one
program: rows that bring at least :data:`EXPANDED_MIN_TOKENS` (256) query
tokens go expanded (:func:`expanded_ragged_attention`: the XLA ragged
path's work items, each block of latents projected up once for a tile of
:data:`EXPANDED_TILE_Q` queries), every other row (decode tokens, short
chunks) absorbed through :func:`paged_jax.attention.ragged.attend`. The
expanded pass is compiled only into programs of at least 256 tokens, and
costs nothing in a call without a long row (its work loop's trip count is
the call's). The Pallas kernels' latent mode serves every row absorbed
(FlashMLA's and tpu-inference's choice for their kernels; where expanded
prefill wins on an accelerator was not measured here: no device), so the
split applies to ``impl="xla"``.

Axis letters: the alphabet of ``models/__init__.py``; C latent rank, R
RoPE key dim (``qk_rope_head_dim``), and here H is the non-RoPE query/key
head dim (``qk_nope_head_dim``) and O the value head dim (``v_head_dim``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.attention import ragged
from paged_jax.attention.batch import RaggedBatch
from paged_jax.attention.paged import (
    check_paged_attention,
    gather_pages,
    query_positions,
    resolve_impl,
    unchecked_xla_paged_attention,
)
from paged_jax.checks import check_int
from pallas_kernels import common


def per_head_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w[n]`` for each head ``n``, in float32: x [..., N, A], w [N, A, Z]
    -> f32[..., N, Z] (the absorptions ``W_UK`` and ``W_UV``). One batched
    matmul with the heads as its batch axis, the query rows merged: XLA's
    CPU backend runs ``einsum("TNH,NHC->TNC")`` with the head axis inside
    5-20x slower at decode sizes (16 heads of DeepSeek-V3's 128 x 512, 4
    to 32 rows: measured with ``experiments.kernels.mla_decode_bench``'s
    machine), the same result."""
    lead, (n, a) = x.shape[:-2], x.shape[-2:]
    rows = x.reshape(-1, n, a).astype(jnp.float32)  # [M, N, A]
    out = jax.lax.dot_general(rows, w.astype(jnp.float32), (((2,), (1,)), ((1,), (0,))))  # [N, M, Z]
    return jnp.swapaxes(out, 0, 1).reshape(*lead, n, w.shape[-1])


def _check_shapes(q_nope, q_pe, latent, w_uk, w_uv, kv_lora_rank, *, flat: bool) -> tuple[int, int]:
    """The shapes both forms and both layouts share (``flat``: the engine's
    [T, ...] queries and the stacked pool; else [B, T, ...] and a layer's
    pages or the stacked pool). Returns ``(C, R)``; a ValueError names the
    argument."""
    C = check_int("kv_lora_rank", kv_lora_rank)
    axes = "T, N" if flat else "B, T, N"
    lead = axes.count(",") + 1  # the query axes before the head dim
    if q_nope.ndim != lead + 1 or q_pe.ndim != lead + 1 or q_pe.shape[:lead] != q_nope.shape[:lead]:
        raise ValueError(f"q_nope must be [{axes}, H] and q_pe [{axes}, R] with the same {axes}, got "
                         f"q_nope{list(q_nope.shape)} q_pe{list(q_pe.shape)}")
    N, H, R = q_nope.shape[-2], q_nope.shape[-1], q_pe.shape[-1]
    if latent.ndim not in ((5,) if flat else (4, 5)) or latent.shape[-1] != C + R or latent.shape[-4] != 1:
        layers = "layers" if flat else "(layers,)"
        raise ValueError(f"the latent pages must be [{layers} 1, P, L, kv_lora_rank + R = {C + R}] (one KV head), "
                         f"got {list(latent.shape)}")
    if w_uk.shape != (N, H, C):
        raise ValueError(f"w_uk must be [N, H, C] = {[N, H, C]}, got {list(w_uk.shape)}")
    if w_uv.ndim != 3 or w_uv.shape[:2] != (N, C):
        raise ValueError(f"w_uv must be [N, C, O] with N={N}, C={C}, got {list(w_uv.shape)}")
    return C, R


def _check_latent_scales(latent_pool, latent_scales) -> None:
    """``latent_scales`` f32[layers, 1, P, L] exactly when ``latent_pool`` is
    int8 / fp8 (one scale a token: keys and values are the same vector); a
    ValueError names ``latent_pool`` and ``latent_scales``."""
    common.check_scales("latent_pool", latent_pool.dtype, latent_pool.shape, latent_scales, latent_scales,
                        scale_names=("latent_scales", "latent_scales"))


def check_latent(q_nope, q_pe, latent_pages, block_tables, kv_lens, q_lens, w_uk, w_uv, kv_lora_rank: int, *,
                 scale: float, layer=None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Checks what the two forms share, the paged attention's door
    included (:func:`paged_jax.attention.paged.check_paged_attention`, with
    the absorbed query's shape).

    Args:
      q_nope: [B, T, N, H]; q_pe: [B, T, N, R].
      block_tables: i32[B, pages_per_seq]; kv_lens, q_lens: i32[B].
      latent_pages: [1, P, L, C + R] (or a stacked pool ``[layers, 1, P, L, C + R]``).
      w_uk: [N, H, C] each head's key up-projection; w_uv: [N, C, O] its value up-projection.
      kv_lora_rank: C.
      scale: the logit scale (> 0); layer: a stacked pool's layer, or None.

    Returns:
      ``(kv_lens, q_lens, layer)`` clamped as the paged attention's door
      returns them.

    Raises:
      ValueError: naming the argument whose shape disagrees, and the shape
        expected; lengths or a layer the paged attention refuses.
    """
    C, R = _check_shapes(q_nope, q_pe, latent_pages, w_uk, w_uv, kv_lora_rank, flat=False)
    q = jax.ShapeDtypeStruct(q_nope.shape[:3] + (C + R,), jnp.float32)
    _, kv_lens, q_lens, layer = check_paged_attention(q, latent_pages, latent_pages, block_tables, kv_lens, q_lens,
                                                      impl="xla", scale=scale, layer=layer)
    return kv_lens, q_lens, layer


def absorbed_paged_attention(q_nope: jax.Array, q_pe: jax.Array, latent_pages: jax.Array, block_tables: jax.Array,
                             kv_lens: jax.Array, q_lens: jax.Array, w_uk: jax.Array, w_uv: jax.Array, *,
                             kv_lora_rank: int, scale: float, layer: jax.Array | int | None = None) -> jax.Array:
    """MLA in the absorbed form: multi-query attention over the latent pages.

    Args:
      q_nope: [B, T, N, H] queries' non-RoPE part; q_pe: [B, T, N, R] their
        RoPE part (rotated). Row ``b`` has ``q_lens[b]`` real tokens, the
        last ``q_lens[b]`` of its ``kv_lens[b]``.
      latent_pages: [1, P, L, C + R] the latent pool (one KV head; ``[c,
        k_pe]`` per token, the new tokens' written), or with ``layer`` the
        stacked ``[layers, 1, P, L, C + R]``.
      block_tables: i32[B, pages_per_seq]; kv_lens, q_lens: i32[B].
      w_uk: [N, H, C]; w_uv: [N, C, O].
      kv_lora_rank: C.
      scale: the logit scale (DeepSeek: ``1 / sqrt(H + R)``, times YaRN's
        mscale squared).
      layer: which layer of a stacked pool.

    Returns:
      f32[B, T, N, O] each head's output before the output projection;
      padding rows are finite and meaningless.

    Raises:
      ValueError: from :func:`check_latent` (shapes, lengths past a row's
        table or ``q_lens > kv_lens`` in an eager call, a layer outside
        the pool, a scale that is not positive).
    """
    kv_lens, q_lens, layer = check_latent(q_nope, q_pe, latent_pages, block_tables, kv_lens, q_lens, w_uk, w_uv,
                                          kv_lora_rank, scale=scale, layer=layer)
    q_lat = per_head_matmul(q_nope, w_uk)
    q = jnp.concatenate([q_lat, q_pe.astype(jnp.float32)], axis=-1)  # [B, T, N, C + R]
    # Keys and values are the same pages: the value of a token is its latent (the k_pe columns come out and
    # are dropped; FlashMLA computes them too, as one 576-wide pass).
    out = unchecked_xla_paged_attention(q, latent_pages, latent_pages, block_tables, kv_lens, q_lens, layer,
                                        scale=scale)
    o_lat = out[..., :kv_lora_rank].astype(jnp.float32)  # [B, T, N, C]
    return per_head_matmul(o_lat, w_uv)


def expanded_paged_attention(q_nope: jax.Array, q_pe: jax.Array, latent_pages: jax.Array, block_tables: jax.Array,
                             kv_lens: jax.Array, q_lens: jax.Array, w_uk: jax.Array, w_uv: jax.Array, *,
                             kv_lora_rank: int, scale: float, layer: jax.Array | int | None = None) -> jax.Array:
    """MLA in the expanded form: the attended tokens' latents projected up to
    per-head keys and values, then causal attention. Arguments, result and
    errors as :func:`absorbed_paged_attention` (the same numbers up to
    float rounding); the gather reads ``pages_per_seq * L`` key tokens per
    row, masked past ``kv_lens``.
    """
    kv_lens, q_lens, layer = check_latent(q_nope, q_pe, latent_pages, block_tables, kv_lens, q_lens, w_uk, w_uv,
                                          kv_lora_rank, scale=scale, layer=layer)
    lat = gather_pages(latent_pages, block_tables, layer)[0].astype(jnp.float32)  # [B, S, C + R]
    S = lat.shape[1]
    s = jnp.arange(S, dtype=jnp.int32)
    lat = jnp.where((s[None, :] < kv_lens[:, None])[..., None], lat, 0.0)  # unowned slots may hold anything
    c, k_pe = lat[..., :kv_lora_rank], lat[..., kv_lora_rank:]
    k_nope = jnp.einsum("BSC,NHC->BSNH", c, w_uk.astype(jnp.float32))
    v = jnp.einsum("BSC,NCO->BSNO", c, w_uv.astype(jnp.float32))
    logits = (jnp.einsum("BTNH,BSNH->BNTS", q_nope.astype(jnp.float32), k_nope)
              + jnp.einsum("BTNR,BSR->BNTS", q_pe.astype(jnp.float32), k_pe)) * scale
    q_pos = query_positions(kv_lens, q_lens, q_nope.shape[1])  # [B, T]
    mask = (s[None, None, :] <= q_pos[:, :, None]) & (s[None, None, :] < kv_lens[:, None, None])  # [B, T, S]
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(p.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)  # a padding row sees no key: zeros
    return jnp.einsum("BNTS,BSNO->BTNO", p, v)


def absorbed_ragged_attention(q_nope: jax.Array, q_pe: jax.Array, latent_pool: jax.Array, layer: jax.Array,
                              batch: RaggedBatch, w_uk: jax.Array, w_uv: jax.Array, *, kv_lora_rank: int,
                              scale: float, impl: str = "auto",
                              latent_scales: jax.Array | None = None) -> jax.Array:
    """MLA in the absorbed form on the engine's flat batch
    (:class:`paged_jax.attention.batch.RaggedBatch`: prefill chunks and
    decode tokens packed): the absorbed query through
    :func:`paged_jax.attention.ragged.attend`, keys and values the same
    latent pages.

    Args:
      q_nope: [T, N, H]; q_pe: [T, N, R] the flat batch's queries.
      latent_pool: [layers, 1, P, L, C + R] the stacked latent pool, this
        call's latents written.
      layer: i32[] the layer.
      batch: the flat batch.
      w_uk: [N, H, C]; w_uv: [N, C, O].
      kv_lora_rank: C; scale: the logit scale; impl: as ``attend``.
      latent_scales: f32[layers, 1, P, L] the per-token scales of an int8 /
        fp8 latent pool (``KVPool.k_scale``: one a token, keys and values
        alike, since they are the same vector), None for float pages.

    Returns:
      f32[T, N, O]; zeros in padding rows.

    Raises:
      ValueError: shapes that disagree (named); ``latent_scales`` not
        f32[layers, 1, P, L] exactly when the pool is int8 / fp8; what
        ``attend`` refuses.
    """
    C, _ = _check_shapes(q_nope, q_pe, latent_pool, w_uk, w_uv, kv_lora_rank, flat=True)
    _check_latent_scales(latent_pool, latent_scales)
    q_lat = per_head_matmul(q_nope, w_uk)
    q = jnp.concatenate([q_lat, q_pe.astype(jnp.float32)], axis=-1)  # [T, N, C + R]
    out = ragged.attend(q, latent_pool, latent_pool, layer, batch, impl=impl, scale=scale, k_scales=latent_scales,
                        v_scales=latent_scales, latent_dim=C)  # [T, N, C]
    return per_head_matmul(out, w_uv)



EXPANDED_MIN_TOKENS = 256
"""Query tokens from which a row of the flat batch attends in the expanded
form (:func:`latent_ragged_attention`): the crossover measured between 128
and 256 (module docstring), where DeepSeek-V3's sizes put it (~170)."""
EXPANDED_TILE_Q = 256
"""Query tokens per tile of the expanded pass: each block of latents is
projected up once per tile, so a tile must hold enough queries to repay it
(the crossover's count)."""


def expanded_ragged_attention(q_nope: jax.Array, q_pe: jax.Array, latent_pool: jax.Array, layer: jax.Array,
                              batch: RaggedBatch, w_uk: jax.Array, w_uv: jax.Array, *, kv_lora_rank: int,
                              scale: float, latent_scales: jax.Array | None = None,
                              min_tokens: int = EXPANDED_MIN_TOKENS, tile_q: int = EXPANDED_TILE_Q) -> jax.Array:
    """MLA in the expanded form on the engine's flat batch, for the rows
    with at least ``min_tokens`` query tokens (others get zeros): the XLA
    ragged path's tiles and work items
    (:func:`paged_jax.attention.ragged.unchecked_ragged_paged_attention`'s
    ``expand``), each work item's latents projected up to per-head keys and
    values once for its tile of ``tile_q`` queries.

    Args:
      q_nope, q_pe, latent_pool, layer, batch: as :func:`absorbed_ragged_attention`.
      w_uk, w_uv, kv_lora_rank, scale, latent_scales: as there too.
      min_tokens: a row's query tokens from which it is served here
        (static).
      tile_q: query tokens per tile (static).

    Returns:
      f32[T, N, O]; zeros in the other rows and in padding rows.

    Raises:
      ValueError: shapes that disagree (named); ``latent_scales`` not
        f32[layers, 1, P, L] exactly when the pool is int8 / fp8;
        ``min_tokens`` or ``tile_q`` not a positive int.
    """
    C, _ = _check_shapes(q_nope, q_pe, latent_pool, w_uk, w_uv, kv_lora_rank, flat=True)
    _check_latent_scales(latent_pool, latent_scales)
    check_int("min_tokens", min_tokens)
    check_int("tile_q", tile_q)
    T, N = q_nope.shape[:2]
    if T < min_tokens:  # no row of this program can be long
        return jnp.zeros((T, N, w_uv.shape[2]), jnp.float32)
    long = batch.q_lens >= min_tokens
    tiling = batch.shape.tiling
    q = jnp.concatenate([q_nope.astype(jnp.float32), q_pe.astype(jnp.float32)], axis=-1)  # [T, N, H + R]
    out = ragged.unchecked_ragged_paged_attention(
        q, latent_pool, latent_pool, layer, batch.block_tables, batch.q_starts, jnp.where(long, batch.q_lens, 0),
        jnp.where(long, batch.kv_lens, 0),
        # each long row adds at most one partial tile: T // tile_q + (long rows <= T // min_tokens)
        num_tiles=T // tile_q + T // min_tokens, tile_q=tile_q, pages_per_block=tiling.prefill_pages_per_block,
        work_chunk=1, scale=scale, k_scales=latent_scales, value_dim=C,
        expand=(w_uk, w_uv))
    return out.astype(jnp.float32)


def latent_ragged_attention(q_nope: jax.Array, q_pe: jax.Array, latent_pool: jax.Array, layer: jax.Array,
                            batch: RaggedBatch, w_uk: jax.Array, w_uv: jax.Array, *, kv_lora_rank: int,
                            scale: float, impl: str = "auto", latent_scales: jax.Array | None = None,
                            expanded_min_tokens: int | None = EXPANDED_MIN_TOKENS,
                            expanded_tile_q: int = EXPANDED_TILE_Q) -> jax.Array:
    """MLA on the engine's flat batch, each row in the form its cost picks
    (module docstring): rows of at least ``expanded_min_tokens`` query
    tokens expanded (:func:`expanded_ragged_attention`), the others absorbed
    (:func:`absorbed_ragged_attention`); every row absorbed on the Pallas
    kernels or with ``expanded_min_tokens=None``.

    Args:
      q_nope, q_pe, latent_pool, layer, batch: as :func:`absorbed_ragged_attention`.
      w_uk, w_uv, kv_lora_rank, scale, impl, latent_scales: as there too.
      expanded_min_tokens: static; None: absorbed only.
      expanded_tile_q: the expanded pass's tile (static).

    Returns:
      f32[T, N, O]; zeros in padding rows.

    Raises:
      ValueError: ``expanded_min_tokens`` (unless None) or
        ``expanded_tile_q`` not a positive int, whatever the batch; as the
        two forms.
    """
    if expanded_min_tokens is not None:
        check_int("expanded_min_tokens", expanded_min_tokens)
    check_int("expanded_tile_q", expanded_tile_q)
    T = q_nope.shape[0]
    if expanded_min_tokens is None or resolve_impl(impl) not in ("xla", "xla_loop") or T < expanded_min_tokens:
        return absorbed_ragged_attention(q_nope, q_pe, latent_pool, layer, batch, w_uk, w_uv,
                                         kv_lora_rank=kv_lora_rank, scale=scale, impl=impl,
                                         latent_scales=latent_scales)
    long = batch.q_lens >= expanded_min_tokens
    short = batch.replace(q_lens=jnp.where(long, 0, batch.q_lens))
    out = absorbed_ragged_attention(q_nope, q_pe, latent_pool, layer, short, w_uk, w_uv, kv_lora_rank=kv_lora_rank,
                                    scale=scale, impl=impl, latent_scales=latent_scales)
    return out + expanded_ragged_attention(q_nope, q_pe, latent_pool, layer, batch, w_uk, w_uv,
                                           kv_lora_rank=kv_lora_rank, scale=scale, latent_scales=latent_scales,
                                           min_tokens=expanded_min_tokens, tile_q=expanded_tile_q)
