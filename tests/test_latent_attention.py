"""MLA over latent pages (the latent pool: its bytes, writes, copy-on-write
and swap; then attention): the absorbed form (multi-query attention over the
latent, keys and values the same pages) equals the expanded form (per-head
K/V projected up) equals dense attention in float64 over the same latents,
for page sizes and lengths 0, 1, L - 1, L, L + 1, decode and prefill rows,
with NaN in every slot no sequence owns."""

import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention.batch import RaggedBatch, Tiling, batch_shape
from paged_jax.attention.latent import (
    absorbed_paged_attention,
    absorbed_ragged_attention,
    expanded_paged_attention,
    expanded_ragged_attention,
    latent_ragged_attention,
)
from paged_jax.memory import get_preset
from paged_jax.paging.kv_cache import copy_pages, init_latent_pool, write_layer_kv, write_layer_latent
from paged_jax.paging.swap import gather_pages, scatter_pages

N, H, R, C, O = 4, 8, 4, 16, 6  # noqa: E741 (heads, nope dim, rope dim, latent rank, value dim)
DIMS = (N, H, R, C, O)
KERNEL_DIMS = (16, 8, 16, 32, 6)  # the GPU kernel reads a latent as two power-of-two tiles >= 16 (C and R)


def _dense(q_nope, q_pe, latents, w_uk, w_uv, kv_len, q_len, scale):
    """One sequence in float64: q [T, N, *], latents [kv_len, C + R] -> [q_len, N, O]."""
    N, C, O = q_nope.shape[1], w_uk.shape[-1], w_uv.shape[-1]  # noqa: N806, E741
    c, k_pe = latents[:, :C], latents[:, C:]
    k = np.einsum("SC,NHC->SNH", c, w_uk)
    v = np.einsum("SC,NCO->SNO", c, w_uv)
    out = np.zeros((q_len, N, O))
    for t in range(q_len):
        pos = kv_len - q_len + t
        logits = (np.einsum("NH,SNH->NS", q_nope[t], k[: pos + 1]) + np.einsum("NR,SR->NS", q_pe[t], k_pe[: pos + 1]))
        logits *= scale
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[t] = np.einsum("NS,SNO->NO", p, v[: pos + 1])
    return out


def _case(page_size, kv_lens, q_lens, layers=None, seed=0, dims=DIMS):
    N, H, R, C, O = dims  # noqa: E741, N806
    rng = np.random.default_rng(seed)
    B, T = len(kv_lens), max(max(q_lens), 1)
    pages_per_seq = max(-(-max(kv_lens) // page_size), 1)
    num_pages = 1 + B * pages_per_seq
    pool = np.full((layers or 1, 1, num_pages, page_size, C + R), np.nan, np.float32)  # unowned: NaN
    tables = np.zeros((B, pages_per_seq), np.int32)
    perm = rng.permutation(np.arange(1, num_pages))  # pages scattered through the pool
    latents = []
    for b, n in enumerate(kv_lens):
        tables[b] = perm[b * pages_per_seq:(b + 1) * pages_per_seq]
        lat = rng.normal(size=(layers or 1, n, C + R)).astype(np.float32)
        latents.append(lat)
        for i in range(n):
            pool[:, 0, tables[b, i // page_size], i % page_size] = lat[:, i]
    q_nope = rng.normal(size=(B, T, N, H)).astype(np.float32)
    q_pe = rng.normal(size=(B, T, N, R)).astype(np.float32)
    w_uk = (rng.normal(size=(N, H, C)) / np.sqrt(C)).astype(np.float32)
    w_uv = (rng.normal(size=(N, C, O)) / np.sqrt(C)).astype(np.float32)
    return pool if layers else pool[0], tables, latents, q_nope, q_pe, w_uk, w_uv


@pytest.mark.parametrize("page_size", [1, 4, 5])
def test_absorbed_equals_expanded_equals_dense(page_size):
    L = page_size
    kv_lens = [0, 1, max(L - 1, 1), L, L + 1, 3 * L + 2]
    q_lens = [0, 1, 1, min(2, L), L + 1, 3]  # decode rows and prefill chunks
    pool, tables, latents, q_nope, q_pe, w_uk, w_uv = _case(L, kv_lens, q_lens)
    scale = 1 / np.sqrt(H + R)
    args = (jnp.asarray(q_nope), jnp.asarray(q_pe), jnp.asarray(pool), jnp.asarray(tables),
            jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32), jnp.asarray(w_uk), jnp.asarray(w_uv))
    absorbed = np.asarray(absorbed_paged_attention(*args, kv_lora_rank=C, scale=scale))
    expanded = np.asarray(expanded_paged_attention(*args, kv_lora_rank=C, scale=scale))
    for b, (n, q) in enumerate(zip(kv_lens, q_lens)):
        want = _dense(q_nope[b].astype(np.float64), q_pe[b].astype(np.float64), latents[b][0].astype(np.float64),
                      w_uk.astype(np.float64), w_uv.astype(np.float64), n, q, scale)
        np.testing.assert_allclose(absorbed[b, :q], want, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(expanded[b, :q], want, atol=2e-5, rtol=1e-4)
    assert np.isfinite(absorbed).all() and np.isfinite(expanded).all()  # NaN in unowned slots never reaches a row
    np.testing.assert_array_equal(absorbed[0], 0)  # an empty sequence's rows are zeros
    np.testing.assert_array_equal(expanded[0], 0)


def test_a_stacked_pool_reads_its_layer():
    kv_lens, q_lens = [5, 9], [1, 4]
    pool, tables, latents, q_nope, q_pe, w_uk, w_uv = _case(4, kv_lens, q_lens, layers=3, seed=1)
    for form in (absorbed_paged_attention, expanded_paged_attention):
        got = np.asarray(form(jnp.asarray(q_nope), jnp.asarray(q_pe), jnp.asarray(pool), jnp.asarray(tables),
                              jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32), jnp.asarray(w_uk),
                              jnp.asarray(w_uv), kv_lora_rank=C, scale=0.3, layer=2))
        for b, (n, q) in enumerate(zip(kv_lens, q_lens)):
            want = _dense(q_nope[b].astype(np.float64), q_pe[b].astype(np.float64), latents[b][2].astype(np.float64),
                          w_uk.astype(np.float64), w_uv.astype(np.float64), n, q, 0.3)
            np.testing.assert_allclose(got[b, :q], want, atol=2e-5, rtol=1e-4)


def test_bad_shapes_are_named():
    pool, tables, _, q_nope, q_pe, w_uk, w_uv = _case(4, [3], [1])
    args = dict(block_tables=jnp.asarray(tables), kv_lens=jnp.asarray([3]), q_lens=jnp.asarray([1]), scale=0.3)
    for change, needle in ((dict(kv_lora_rank=C + 1), "latent pages"),
                           (dict(kv_lora_rank=0), "kv_lora_rank"),
                           (dict(w_uk=jnp.asarray(w_uk[:, :, :-1])), "w_uk"),
                           (dict(w_uv=jnp.asarray(w_uv[1:])), "w_uv"),
                           (dict(q_pe=jnp.asarray(q_pe[:, :, :1])), "q_pe"),
                           (dict(latent_pages=jnp.concatenate([jnp.asarray(pool)] * 2)), "one KV head"),
                           (dict(kv_lens=jnp.asarray([99])), "kv_lens"),
                           (dict(scale=-1.0), "scale")):
        kwargs = dict(q_nope=jnp.asarray(q_nope), q_pe=jnp.asarray(q_pe), latent_pages=jnp.asarray(pool),
                      w_uk=jnp.asarray(w_uk), w_uv=jnp.asarray(w_uv), kv_lora_rank=C, **args)
        kwargs.update(change)
        for form in (absorbed_paged_attention, expanded_paged_attention):
            with pytest.raises(ValueError, match=needle):
                form(**kwargs)


def _flat(tables, kv_lens, q_lens, q_nope, q_pe):
    """The padded case as the engine's flat batch: ``(batch, flat q_nope
    [T, N, H], flat q_pe [T, N, R], each row's first flat token)``."""
    N, H, R = q_nope.shape[2], q_nope.shape[3], q_pe.shape[3]  # noqa: N806
    ql = np.asarray(q_lens, np.int32)
    shape = batch_shape(ql, num_seq_rows=len(ql), tiling=Tiling(prefill_tile_q=4, min_tokens=8))
    starts = np.concatenate([[0], np.cumsum(ql)[:-1]]).astype(np.int32)
    T = shape.num_tokens
    flat_nope, flat_pe = np.zeros((T, N, H), np.float32), np.zeros((T, N, R), np.float32)
    for b, (s0, q) in enumerate(zip(starts, q_lens)):
        flat_nope[s0:s0 + q], flat_pe[s0:s0 + q] = q_nope[b, :q], q_pe[b, :q]
    z = jnp.zeros(T, jnp.int32)
    batch = RaggedBatch(tokens=z, positions=z, slots=z, block_tables=jnp.asarray(tables), q_starts=jnp.asarray(starts),
                        q_lens=jnp.asarray(ql), kv_lens=jnp.asarray(kv_lens, jnp.int32),
                        logits_rows=jnp.zeros(1, jnp.int32), shape=shape)
    return batch, flat_nope, flat_pe, starts


def test_the_flat_batch_through_the_one_door_equals_the_padded_form():
    kv_lens, q_lens = [7, 1, 12, 4], [1, 1, 5, 3]  # decode rows and chunks, packed
    pool, tables, latents, q_nope, q_pe, w_uk, w_uv = _case(4, kv_lens, q_lens, layers=2, seed=3)
    batch, flat_nope, flat_pe, starts = _flat(tables, kv_lens, q_lens, q_nope, q_pe)
    ql = np.asarray(q_lens, np.int32)
    got = np.asarray(absorbed_ragged_attention(jnp.asarray(flat_nope), jnp.asarray(flat_pe), jnp.asarray(pool),
                                               jnp.int32(1), batch, jnp.asarray(w_uk), jnp.asarray(w_uv),
                                               kv_lora_rank=C, scale=0.25))
    for b, (s0, n, q) in enumerate(zip(starts, kv_lens, q_lens)):
        want = _dense(q_nope[b].astype(np.float64), q_pe[b].astype(np.float64), latents[b][1].astype(np.float64),
                      w_uk.astype(np.float64), w_uv.astype(np.float64), n, q, 0.25)
        np.testing.assert_allclose(got[s0:s0 + q], want, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(got[int(ql.sum()):], 0)


def _check_flat_against_dense(impl, page_size, seed=4, dims=KERNEL_DIMS):
    """``absorbed_ragged_attention`` through ``impl`` on the flat batch of
    lengths 0, 1, L - 1, L, L + 1 and longer (decode rows and chunks), NaN in
    every unowned slot, equals float64 dense attention."""
    L = page_size
    kv_lens, q_lens = [0, 1, L - 1, L, L + 1, 3 * L + 2], [0, 1, 1, 1, L + 1, 3]
    pool, tables, latents, q_nope, q_pe, w_uk, w_uv = _case(L, kv_lens, q_lens, layers=2, seed=seed, dims=dims)
    batch, flat_nope, flat_pe, starts = _flat(tables, kv_lens, q_lens, q_nope, q_pe)
    got = np.asarray(absorbed_ragged_attention(jnp.asarray(flat_nope), jnp.asarray(flat_pe), jnp.asarray(pool),
                                               jnp.int32(1), batch, jnp.asarray(w_uk), jnp.asarray(w_uv),
                                               kv_lora_rank=dims[3], scale=0.25, impl=impl))
    for b, (s0, n, q) in enumerate(zip(starts, kv_lens, q_lens)):
        want = _dense(q_nope[b].astype(np.float64), q_pe[b].astype(np.float64), latents[b][1].astype(np.float64),
                      w_uk.astype(np.float64), w_uv.astype(np.float64), n, q, 0.25)
        np.testing.assert_allclose(got[s0:s0 + q], want, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(got[sum(q_lens):], 0)


@pytest.mark.parametrize("page_size", [1, 4, 5])
def test_the_flat_batch_picks_each_rows_form_and_both_equal_dense(page_size):
    """Rows of at least ``min_tokens`` queries expanded (tiles of 3 queries
    here, so a long row spans several, each projecting its key blocks up
    once), the others absorbed, in one call: every row equals float64 dense
    attention over NaN-filled unowned slots, and the expanded pass alone
    leaves the short rows at zero."""
    L = page_size
    kv_lens, q_lens = [0, 1, L + 1, 3 * L + 7, 9, 2 * L + 6], [0, 1, L + 1, 7, 6, 2 * L + 6]
    pool, tables, latents, q_nope, q_pe, w_uk, w_uv = _case(L, kv_lens, q_lens, layers=2, seed=5)
    batch, flat_nope, flat_pe, starts = _flat(tables, kv_lens, q_lens, q_nope, q_pe)
    args = (jnp.asarray(flat_nope), jnp.asarray(flat_pe), jnp.asarray(pool), jnp.int32(1), batch, jnp.asarray(w_uk),
            jnp.asarray(w_uv))
    both = np.asarray(latent_ragged_attention(*args, kv_lora_rank=C, scale=0.25, impl="xla", expanded_min_tokens=6,
                                              expanded_tile_q=3))
    expanded = np.asarray(expanded_ragged_attention(*args, kv_lora_rank=C, scale=0.25, min_tokens=6, tile_q=3))
    for b, (s0, n, q) in enumerate(zip(starts, kv_lens, q_lens)):
        want = _dense(q_nope[b].astype(np.float64), q_pe[b].astype(np.float64), latents[b][1].astype(np.float64),
                      w_uk.astype(np.float64), w_uv.astype(np.float64), n, q, 0.25)
        np.testing.assert_allclose(both[s0:s0 + q], want, atol=2e-5, rtol=1e-4, err_msg=f"row {b}")
        if q >= 6:
            np.testing.assert_allclose(expanded[s0:s0 + q], want, atol=2e-5, rtol=1e-4, err_msg=f"row {b}")
        else:
            np.testing.assert_array_equal(expanded[s0:s0 + q], 0)
    np.testing.assert_array_equal(both[sum(q_lens):], 0)
    with pytest.raises(ValueError, match="tile_q must be"):
        expanded_ragged_attention(*args, kv_lora_rank=C, scale=0.25, min_tokens=6, tile_q=0)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_the_flat_kernels_latent_mode_equals_dense(impl, page_size):
    """The Pallas kernels (interpret mode) in their latent mode, each
    reading a latent once (the GPU kernel as two tiles, c and k_pe; the TPU
    kernel as one page copy whose first C columns are the values): both
    equal dense attention."""
    _check_flat_against_dense(impl, page_size)


def test_the_gpu_kernel_splits_a_query_group_too_large_for_one_program():
    """64 heads on one latent of 256 + 64 are over an A10's 99 KiB at 64
    rows (4*320*(16+64) + 4*64*16 = 106,496 bytes): tuned for that chip,
    the kernel gives each program half the heads (``group_splits`` 2),
    reading the same pages, and the result is the reference's."""
    from pallas_kernels import chips, tuning
    from pallas_kernels.flat_ragged_attention import flat_ragged_paged_attention

    chip = chips.generic_gpu("8.6")
    fitted = tuning.fit_gpu_tiling(tuning.GPUTiling(block_q=1, pages_per_compute_block=4, num_stages=2),
                                   group_pad_for=lambda bq: max(64, -(-16 // bq)), page_size=16, head_dim=320,
                                   itemsize=4, chip=chip)
    assert fitted.group_splits == 2 and fitted.block_q == 1
    kv_lens, q_lens = [0, 1, 15, 16, 17, 50], [0, 1, 1, 1, 17, 3]
    pool, tables, *_ = _case(16, kv_lens, q_lens, layers=2, seed=6, dims=(64, 8, 64, 256, 6))
    rng = np.random.default_rng(6)
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(32, 64, 320)), jnp.float32)  # the absorbed queries [q_lat, q_pe]
    pool = jnp.asarray(pool)
    args = (q, None, None, pool, pool, 1, jnp.asarray(tables), jnp.asarray(starts),
            jnp.asarray(q_lens, jnp.int32), jnp.asarray(kv_lens, jnp.int32), None)
    sizes = dict(decode_tiles=6, prefill_chunks=2, latent_dim=256, interpret=True)
    with chips.target(chip):
        got = np.asarray(flat_ragged_paged_attention(*args, impl="gpu", **sizes)[0])
    want = np.asarray(flat_ragged_paged_attention(*args, impl="reference", **sizes)[0])
    assert got.shape == (32, 64, 256)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    assert np.isfinite(got).all()


def test_the_latent_mode_is_refused_where_it_cannot_run():
    from pallas_kernels.flat_ragged_attention import check_latent_dim

    pool = jnp.zeros((1, 1, 4, 16, C + R))
    for latent_dim, other, k_new, impl, needle in ((0, pool, None, "xla", "latent_dim must be an int in"),
                                                   (C + R, pool, None, "xla", "latent_dim must be an int in"),
                                                   (1.5, pool, None, "xla", "latent_dim must be an int in"),
                                                   (C, pool + 0, None, "xla", "v_pool must be k_pool"),
                                                   (C, pool, pool, "xla", "writes nothing"),
                                                   (C, pool, None, "gpu", "power of two >= 16")):  # R = 4
        with pytest.raises(ValueError, match=needle):
            check_latent_dim(latent_dim, pool, other, k_new, impl)
    scales = jnp.ones((1, 1, 4, 16))
    with pytest.raises(ValueError, match="v_scales must be k_scales"):  # a latent has one scale
        check_latent_dim(C, pool, pool, None, "tpu", scales, scales + 0)
    check_latent_dim(C, pool, pool, None, "tpu")  # any split on the TPU kernel and in XLA
    check_latent_dim(C, pool, pool, None, "tpu", scales, scales)


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu"])
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_latent_pages_through_the_door_equal_their_dequantized_values(kv_dtype, impl):
    """An int8 / fp8 latent pool (one scale a token, keys and values alike)
    gives what a float pool holding the dequantized latents gives: the
    scales reach the attention and are applied once to keys and values (on
    the TPU kernel, from the one scale buffer its single page copy fills)."""
    from pallas_kernels.common import dequantize_kv, quantize_kv

    kv_lens, q_lens = [7, 1, 12, 4], [1, 1, 5, 3]
    pool, tables, _, q_nope, q_pe, w_uk, w_uv = _case(4, kv_lens, q_lens, layers=2, seed=5)
    pool = np.nan_to_num(pool)  # quantizing NaN slots is not the point here
    q_pages, scales = quantize_kv(jnp.asarray(pool), jnp.dtype(kv_dtype))  # [layers, 1, P, L, C + R], [.., L]
    batch, flat_nope, flat_pe, _ = _flat(tables, kv_lens, q_lens, q_nope, q_pe)
    args = (jnp.asarray(flat_nope), jnp.asarray(flat_pe))
    weights = (batch, jnp.asarray(w_uk), jnp.asarray(w_uv))
    got = absorbed_ragged_attention(*args, q_pages, jnp.int32(1), *weights, kv_lora_rank=C, scale=0.25,
                                    latent_scales=scales, impl=impl)
    want = absorbed_ragged_attention(*args, dequantize_kv(q_pages, scales), jnp.int32(1), *weights, kv_lora_rank=C,
                                     scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    exact = absorbed_ragged_attention(*args, jnp.asarray(pool), jnp.int32(1), *weights, kv_lora_rank=C, scale=0.25)
    assert np.abs(np.asarray(got) - np.asarray(exact)).max() > 1e-4  # the pages really were quantized


def test_latent_scales_are_checked_by_their_own_name_in_both_forms():
    """Both flat forms refuse an int8 pool without scales, scales beside a
    float pool and scales of the wrong shape, naming ``latent_scales`` (the
    expanded form took any of them before: an int8 pool read unscaled)."""
    from pallas_kernels.common import quantize_kv

    kv_lens, q_lens = [7, 4], [1, 3]
    pool, tables, _, q_nope, q_pe, w_uk, w_uv = _case(4, kv_lens, q_lens, layers=2, seed=5)
    q_pages, scales = quantize_kv(jnp.asarray(np.nan_to_num(pool)), jnp.dtype("int8"))
    batch, flat_nope, flat_pe, _ = _flat(tables, kv_lens, q_lens, q_nope, q_pe)
    args = (jnp.asarray(flat_nope), jnp.asarray(flat_pe))
    weights = (batch, jnp.asarray(w_uk), jnp.asarray(w_uv))
    for form in (absorbed_ragged_attention,
                 functools.partial(expanded_ragged_attention, min_tokens=1, tile_q=2)):
        for pages, sc, needle in ((q_pages, None, "latent_scales must be given exactly when latent_pool is quantized"),
                                  (jnp.asarray(pool), scales, "latent_scales must be given exactly when"),
                                  (q_pages, scales[..., :2], r"latent_scales must be f32\[2, 1, ")):
            with pytest.raises(ValueError, match=needle):
                form(*args, pages, jnp.int32(1), *weights, kv_lora_rank=C, scale=0.25, latent_scales=sc)


# ------------------------------------------------------------ the latent pool


def test_a_latent_pool_holds_what_the_maths_says_and_moves_with_swap_and_copy_on_write():
    v3 = get_preset("deepseek-v3")
    for dtype, name in ((jnp.bfloat16, "bfloat16"), (jnp.int8, None)):
        pool = init_latent_pool(num_layers=v3.num_layers, num_pages=3, page_size=4, latent_dim=576, dtype=dtype)
        assert pool.latent and pool.v is None
        per_token = pool.nbytes // (3 * 4)
        # bf16: 61 layers x 576 x 2 = 70,272 bytes a token, the maths'; int8: 576 + a 4-byte scale per layer.
        assert per_token == (v3.kv_bytes_per_token(name) if name else v3.num_layers * (576 + 4))
    pool = init_latent_pool(num_layers=2, num_pages=6, page_size=4, latent_dim=C + R)
    rng = np.random.default_rng(0)
    lat = jnp.asarray(rng.normal(size=(8, C + R)), jnp.float32)
    pool = write_layer_latent(pool, 1, lat, jnp.arange(4, 12, dtype=jnp.int32))  # pages 1 and 2 of layer 1
    np.testing.assert_array_equal(np.asarray(pool.k[1, 0, 1:3]).reshape(8, -1), np.asarray(lat))
    copied = copy_pages(pool, jnp.asarray([1]), jnp.asarray([4]))  # copy-on-write of page 1 to page 4
    assert copied.v is None
    np.testing.assert_array_equal(np.asarray(copied.k[:, :, 4]), np.asarray(pool.k[:, :, 1]))
    out = gather_pages(pool, [2, 1])  # swap out and back in, bit for bit
    back = scatter_pages(init_latent_pool(num_layers=2, num_pages=6, page_size=4, latent_dim=C + R), [5, 3], out)
    np.testing.assert_array_equal(np.asarray(back.k[:, :, [5, 3]]), np.asarray(pool.k[:, :, [2, 1]]))


def test_a_latent_pool_refuses_kv_writes_and_bad_latents():
    pool = init_latent_pool(num_layers=2, num_pages=4, page_size=4, latent_dim=20)
    with pytest.raises(ValueError, match="write_layer_latent"):
        write_layer_kv(pool, 0, jnp.zeros((1, 1, 20)), jnp.zeros((1, 1, 20)), jnp.asarray([4]))
    for latent, slots, layer, needle in ((jnp.zeros((2, 19)), [4, 5], 0, "latent must be"),
                                         (jnp.zeros((2, 20), jnp.int32), [4, 5], 0, "latent must be"),
                                         (jnp.zeros((2, 20)), [4, 4], 0, "slots"),
                                         (jnp.zeros((2, 20)), [4, 5], 2, "layer")):
        with pytest.raises(ValueError, match=needle):
            write_layer_latent(pool, layer, latent, jnp.asarray(slots, jnp.int32))


def test_mla_decode_bench_compares_equal_bytes(tmp_path):
    """experiments.kernels.mla_decode_bench at toy size: both sides read 576
    values a token; the table and the target line are written."""
    from experiments.kernels import mla_decode_bench

    rows = mla_decode_bench.main(["--batches", "2", "--contexts", "32", "--mla-heads", "4", "--gqa-heads", "4",
                                  "--min-seconds", "0.01", "--out", str(tmp_path)])
    assert [(r["batch"], r["context"], r["mla_heads"], r["gqa_kv_heads"], r["kv_mb"]) for r in rows] == [
        (2, 32, 4, 1, 0.1), (2, 32, 4, 2, 0.1)]
    assert all(r["x_gqa"] > 0 and r["core_x_gqa"] > 0 for r in rows)
    text = (tmp_path / "mla_decode_bench.md").read_text()
    assert "the MLA step at 4 heads within 1.5x the GQA step with 1 KV head:" in text
    assert "the MLA step at 4 heads within 1.5x the GQA step with 2 KV heads:" in text and "1 KV head of 288" in text


@pytest.mark.parametrize("argv, words", [(["--min-seconds", "nan"], "--min-seconds: must be a finite number > 0"),
                                         (["--min-seconds", "0"], "--min-seconds: must be a finite number > 0"),
                                         (["--out", __file__], "--out .* is not a writable folder")])
def test_the_mla_benchmarks_refuse_bad_flags_before_any_work(argv, words, capsys):
    from experiments.kernels import mla_decode_bench, mla_prefill_bench, moe_bench
    from experiments.memory import mla_capacity

    for script in (mla_decode_bench, mla_prefill_bench, moe_bench, mla_capacity):
        if "--min-seconds" in argv and script is mla_capacity:
            continue  # it times nothing
        with pytest.raises(SystemExit):
            script.parse_args(argv)
        assert re.search(words, capsys.readouterr().err), script.__name__
    with pytest.raises(SystemExit):
        mla_capacity.parse_args(["--budget-tokens", "1", "--max-seqs", "4"])
    assert "--budget-tokens must be >= --max-seqs" in capsys.readouterr().err


def test_mla_prefill_bench_times_both_forms(tmp_path):
    """experiments.kernels.mla_prefill_bench at toy size: a row per chunk length, both forms timed."""
    from experiments.kernels import mla_prefill_bench

    rows = mla_prefill_bench.main(["--context", "32", "--tokens", "4", "32", "--heads", "2", "--page-size", "8",
                                   "--min-seconds", "0.01", "--out", str(tmp_path)])
    assert [r["tokens"] for r in rows] == [4, 32] and all(r["absorbed_ms"] > 0 < r["expanded_ms"] for r in rows)
    assert all(r["flat_absorbed_ms"] > 0 < r["flat_expanded_ms"] for r in rows)
    text = (tmp_path / "mla_prefill_bench.md").read_text()
    assert "| flat expanded / absorbed |" in text and "The engine expands rows of 256 query tokens" in text
