"""The flat ragged kernel (``pallas_kernels.flat_ragged_attention``) against a
float64 oracle, on CPU (Pallas interpret mode; TPU interpret mode for the
Mosaic kernel).

Each case is a packed token batch with sequences of the interesting lengths
(0, 1, L - 1, L, L + 1 and long), their rows in a shuffled order, padding
rows at the end holding NaN queries and NaN new K/V; the pool holds NaN in
every slot no sequence owns (the new tokens' slots included, until the call
writes them) and in every other layer, so a read outside a row, before the
write or of another layer shows. The oracle writes the new K/V with the
engine's ``kv_cache.write_layer_kv`` and attends each sequence over the pages
it owns in float64 NumPy (``common.ref_sequence_attention``); the kernel's
written pool must equal that write bit for bit.

Interpret mode is slow (the TPU one most): the default run takes a covering
sample of the product of page size, head dim, GQA group, page dtype, options
and batch class; a broader sweep is marked slow.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.presets import PRESETS
from paged_jax.paging.kv_cache import KVPool, write_layer_kv
from pallas_kernels import common
from pallas_kernels.flat_ragged_attention import (
    FlatBlockSizes,
    flat_ragged_paged_attention,
    ref_flat_ragged_paged_attention,
    unchecked_flat_ragged_paged_attention,
)
from tests.decoder_helpers import small_mixed_batch

LAYERS, LAYER = 3, 1

TOLERANCES = {
    # f32 against f64: summation order over up to ~600 keys.
    "float32": dict(atol=5e-5, rtol=5e-5),
    # The GPU kernel multiplies bf16 pages in bf16 (q rounded to 8 bits of mantissa), f32 accumulation.
    "bfloat16": dict(atol=2e-2, rtol=2e-2),
}
"""Kernel-versus-oracle tolerance, keyed by the dtype the kernel multiplies
in: bf16 pages (float pools are multiplied in the page dtype) or f32 (f32
pools; quantized pools, dequantized into f32 by their scales; the oracle
reads the same quantized values, so quantization error is not compared)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration: sizes, options, batch class."""

    page_size: int = 16
    num_kv_heads: int = 2
    group: int = 2
    head_dim: int = 64
    page_dtype: str = "float32"
    q_dtype: str = "float32"
    batch: str = "mixed"  # "decode", "prefill" or "mixed"
    sliding_window: int | None = None
    soft_cap: float | None = None

    @property
    def id(self):
        opts = "".join((f"-w{self.sliding_window}" if self.sliding_window else "",
                        f"-cap{self.soft_cap:g}" if self.soft_cap else ""))
        return (f"{self.batch}-L{self.page_size}-K{self.num_kv_heads}G{self.group}-H{self.head_dim}-"
                f"{self.page_dtype}{'' if self.q_dtype == 'float32' else '-q' + self.q_dtype}{opts}")


def lengths(case: Case):
    """``(q_lens, kv_lens)`` of the case's class; the edge lengths 0, 1,
    L - 1, L, L + 1 and a long one appear in every class."""
    page = case.page_size
    long = 2 * page + page // 2 + 3
    kv = [0, 1, page - 1, page, page + 1, long]
    if case.batch == "decode":
        q = [0, 1, 1, 1, 1, 1]
    elif case.batch == "prefill":
        q = [0, 0, min(page - 1, 12), 2, min(page + 1, 9), 7]  # row 1 idle: cached, nothing new
    else:
        q = [0, 1, 1, 3, min(page + 1, 9), 1]
    return np.array(q, np.int32), np.array(kv, np.int32)


def build(case: Case, seed: int = 0, *, q_lens=None, kv_lens=None, shared=None):
    """Arrays for ``case``: ``dict`` of the kernel's arguments (the pool as a
    ``KVPool``) and the static sizes (one decode tile per sequence, one
    chunk more than the batch has).

    ``shared``: ``(s, t, n)``: sequence ``t``'s first ``n`` pages are sequence
    ``s``'s (same-step prefix sharing: ``t`` reads what ``s`` writes).
    """
    r = np.random.default_rng(seed)
    if q_lens is None:
        q_lens, kv_lens = lengths(case)
    q_lens, kv_lens = np.asarray(q_lens, np.int32), np.asarray(kv_lens, np.int32)
    page, kh, h = case.page_size, case.num_kv_heads, case.head_dim
    n = kh * case.group
    num_seqs = len(q_lens)
    need = [-(-int(k) // page) for k in kv_lens]
    pages_per_seq = max(need) + 1  # a spare entry past every sequence's pages
    num_pages = sum(need) + 3
    perm = r.permutation(num_pages)
    tables = r.integers(0, num_pages, (num_seqs, pages_per_seq)).astype(np.int32)  # past the length: anything
    c = 0
    for s, k in enumerate(need):
        tables[s, :k] = perm[c:c + k]
        c += k
    if shared is not None:
        src, dst, count = shared
        tables[dst, :count] = tables[src, :count]
    # Rows in a shuffled sequence order, padding rows at the end.
    order = r.permutation(num_seqs)
    q_starts = np.zeros(num_seqs, np.int32)
    row = 0
    for s in order:
        q_starts[s] = row
        row += q_lens[s]
    t_total = max(8, 1 << int(row - 1).bit_length())
    slots = np.full(t_total, -1, np.int32)
    cached = np.zeros((num_pages, page), bool)
    for s in range(num_seqs):
        for pos in range(kv_lens[s]):
            p, o = tables[s, pos // page], pos % page
            if pos >= kv_lens[s] - q_lens[s]:
                slots[q_starts[s] + pos - (kv_lens[s] - q_lens[s])] = p * page + o
            else:
                cached[p, o] = True
    if shared is not None:  # the reader's copy of the shared pages comes from the writer
        cached[:] &= ~np.isin(np.arange(num_pages)[:, None] * page + np.arange(page)[None, :], slots)

    shape = (LAYERS, kh, num_pages, page, h)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    k[LAYER][:, cached] = r.normal(size=(kh, int(cached.sum()), h))
    v[LAYER][:, cached] = r.normal(size=(kh, int(cached.sum()), h))
    pool = _pool(k, v, case.page_dtype)
    q = np.full((t_total, n, h), np.nan, np.float32)
    new_k = np.full((t_total, kh, h), np.nan, np.float32)
    new_v = np.full((t_total, kh, h), np.nan, np.float32)
    real = int(q_lens.sum())
    q[:real] = r.normal(size=(real, n, h))
    new_k[:real] = r.normal(size=(real, kh, h))
    new_v[:real] = r.normal(size=(real, kh, h))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return dict(
        q=jnp.asarray(q, case.q_dtype), k_new=jnp.asarray(new_k), v_new=jnp.asarray(new_v), pool=pool,
        block_tables=i32(tables), q_starts=i32(q_starts), q_lens=i32(q_lens), kv_lens=i32(kv_lens), slots=i32(slots),
        decode_tiles=num_seqs, prefill_chunks=int((q_lens > 1).sum()) + 1,
    )


def _pool(k, v, page_dtype) -> KVPool:
    """The NaN-holed f32 pool in ``page_dtype``: quantized pools hold NaN in
    the scales of every NaN slot, and in the pages where the dtype has a NaN
    (fp8); int8's are saturated."""
    dtype = jnp.dtype(page_dtype)
    if not common.is_quantized(dtype):
        return KVPool(k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype))
    out = []
    for x in (k, v):
        hole = np.isnan(x[..., 0])
        xq, s = common.quantize_kv(jnp.asarray(np.nan_to_num(x)), dtype)
        s = jnp.where(hole, jnp.nan, s)
        fill = jnp.nan if jnp.issubdtype(dtype, jnp.floating) else 127
        xq = jnp.where(hole[..., None], fill, xq.astype(jnp.float32)).astype(dtype)
        out += [xq, s]
    return KVPool(k=out[0], v=out[2], k_scale=out[1], v_scale=out[3])


def call(a, impl, case=None, **kwargs):
    """The checked entry on ``build``'s arrays; ``(out, KVPool)``."""
    pool = a["pool"]
    options = {} if case is None else dict(sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    out, *leaves = flat_ragged_paged_attention(
        a["q"], a["k_new"], a["v_new"], pool.k, pool.v, LAYER, a["block_tables"], a["q_starts"], a["q_lens"],
        a["kv_lens"], a["slots"], k_scales=pool.k_scale, v_scales=pool.v_scale, decode_tiles=a["decode_tiles"],
        prefill_chunks=a["prefill_chunks"], impl=impl, **options, **kwargs)
    return out, KVPool(*leaves)


def engine_write(a) -> KVPool:
    """The pool after the engine's own K/V write (``kv_cache.write_layer_kv``)."""
    return write_layer_kv(a["pool"], jnp.int32(LAYER), a["k_new"], a["v_new"], a["slots"])


def oracle(a, written: KVPool, case: Case) -> np.ndarray:
    """f64 [T, N, H]: each sequence's queries over the slots it owns in the
    written pool (dequantized), zeros elsewhere."""
    q = np.asarray(a["q"]).astype(np.float64)
    k, v = (np.asarray(x[LAYER]).astype(np.float64) for x in (written.k, written.v))
    if written.quantized:
        k = k * np.asarray(written.k_scale[LAYER])[..., None]
        v = v * np.asarray(written.v_scale[LAYER])[..., None]
    out = np.zeros(q.shape)
    tables, page = np.asarray(a["block_tables"]), case.page_size
    for s, (start, ql, kl) in enumerate(zip(*(np.asarray(a[n]) for n in ("q_starts", "q_lens", "kv_lens")))):
        if ql == 0:
            continue
        pos = np.arange(kl)
        pages, offsets = tables[s, pos // page], pos % page
        out[start:start + ql] = common.ref_sequence_attention(
            q[start:start + ql], k[:, pages, offsets].swapaxes(0, 1), v[:, pages, offsets].swapaxes(0, 1),
            scale=1 / math.sqrt(case.head_dim), soft_cap=case.soft_cap, sliding_window=case.sliding_window)
    return out


def assert_pool_bits(got: KVPool, want: KVPool):
    """Every leaf equal bit for bit, but for the payloads of NaNs (XLA's CPU
    scatter on a float8_e5m2 pool rewrites every NaN byte 0x7e of the pool
    as 0x7f; the TPU kernel's DMAs copy bytes as they are): NaN exactly
    where ``want`` has NaN, every other element's bytes identical."""
    for name in ("k", "v", "k_scale", "v_scale"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if g is None:
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, name
        nan = np.isnan(np.asarray(w.astype(jnp.float32)))
        assert np.array_equal(np.isnan(np.asarray(g.astype(jnp.float32))), nan), f"{name}: NaN elsewhere"
        g, w = np.asarray(g), np.asarray(w)
        assert g[~nan].tobytes() == w[~nan].tobytes(), f"{name} differs from write_layer_kv's"


def check_against_oracle(case: Case, impl: str, seed: int = 0, **kwargs):
    a = build(case, seed)
    out, pool = call(a, impl, case, **kwargs)
    written = engine_write(a)
    assert_pool_bits(pool, written)
    want = oracle(a, written, case)
    got = np.asarray(out.astype(jnp.float32))
    real = np.zeros(got.shape[0], bool)
    for start, ql in zip(np.asarray(a["q_starts"]), np.asarray(a["q_lens"])):
        real[start:start + ql] = True
    assert np.all(np.isfinite(got[real])), "NaN in an unowned slot reached an output"
    assert np.all(got[~real] == 0), "padding rows must be zeros"
    multiply = case.page_dtype if (impl == "gpu" and case.page_dtype == "bfloat16") else "float32"
    tol = TOLERANCES["bfloat16" if case.q_dtype == "bfloat16" else multiply]
    np.testing.assert_allclose(got[real], want[real], **tol)


# A covering sample of page size x head dim x group x page dtype x options x class.
DEFAULT_CASES = [
    Case(batch="decode", page_size=16, num_kv_heads=2, group=4, head_dim=64),
    Case(batch="prefill", page_size=16, num_kv_heads=1, group=1, head_dim=128, page_dtype="bfloat16",
         q_dtype="bfloat16"),
    Case(batch="mixed", page_size=64, num_kv_heads=2, group=3, head_dim=64, page_dtype="int8", sliding_window=20),
    Case(batch="mixed", page_size=256, num_kv_heads=1, group=8, head_dim=256, page_dtype="float8_e4m3fn",
         soft_cap=5.0),
]
SLOW_CASES = [
    Case(batch="mixed", page_size=16, num_kv_heads=1, group=2, head_dim=128, page_dtype="float8_e5m2",
         sliding_window=7),
    Case(batch="decode", page_size=256, num_kv_heads=2, group=8, head_dim=128, page_dtype="bfloat16"),
    Case(batch="prefill", page_size=64, num_kv_heads=2, group=7, head_dim=64, page_dtype="int8", soft_cap=30.0),
    Case(batch="mixed", page_size=32, num_kv_heads=4, group=1, head_dim=256, sliding_window=40),
    Case(batch="decode", page_size=16, num_kv_heads=1, group=5, head_dim=64, page_dtype="float8_e4m3fn",
         sliding_window=3, soft_cap=2.0),
    Case(batch="prefill", page_size=256, num_kv_heads=1, group=3, head_dim=256, page_dtype="float8_e5m2",
         sliding_window=300),
    Case(batch="mixed", page_size=16, num_kv_heads=2, group=6, head_dim=128, page_dtype="bfloat16",
         q_dtype="bfloat16", soft_cap=10.0),
]


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("impl", ["gpu", "reference"])
def test_equals_float64_oracle(case, impl):
    check_against_oracle(case, impl)


@pytest.mark.parametrize("case", [DEFAULT_CASES[0], DEFAULT_CASES[2]], ids=lambda c: c.id)
def test_tpu_kernel_equals_float64_oracle(case):
    check_against_oracle(case, "tpu")


SWEEP = [(c, "tpu") for c in DEFAULT_CASES[1:2] + DEFAULT_CASES[3:]] + [
    (c, impl) for c in SLOW_CASES for impl in ("gpu", "tpu", "reference")]
"""The slow sweep: every case and implementation the default run leaves out."""


@pytest.mark.slow
@pytest.mark.parametrize("case, impl", SWEEP, ids=[f"{impl}-{c.id}" for c, impl in SWEEP])
def test_equals_float64_oracle_sweep(case, impl):
    check_against_oracle(case, impl, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_other_block_sizes_equal_float64_oracle(impl):
    """Decode tiles split over two programs each (flash-decoding, gpu) and
    one-page steps over short chunk tiles."""
    sizes = FlatBlockSizes(prefill_rows=8, keys_per_block=16, decode_k_splits=2)
    check_against_oracle(Case(batch="mixed", page_size=16, num_kv_heads=2, group=3, head_dim=64, sliding_window=9),
                         impl, seed=2, block_sizes=sizes)


@pytest.mark.parametrize("impl", ["gpu", "tpu", "reference"])
def test_a_sequence_reads_what_another_writes_in_the_same_call(impl):
    """Same-step prefix sharing: sequence 1's first page is sequence 0's,
    which sequence 0's chunk fills in this very call; sequence 1 (a decode
    after it) must read the new K/V, not the NaN that was there."""
    case = Case(batch="mixed", page_size=16, num_kv_heads=1, group=2, head_dim=64)
    a = build(case, 3, q_lens=[16, 1], kv_lens=[16, 17], shared=(0, 1, 1))
    out, pool = call(a, impl)
    written = engine_write(a)
    assert_pool_bits(pool, written)
    got, want = np.asarray(out), oracle(a, written, case)
    assert np.all(np.isfinite(got[:17]))
    np.testing.assert_allclose(got[:17], want[:17], **TOLERANCES["float32"])


@pytest.mark.parametrize("impl", ["gpu", pytest.param("tpu", marks=pytest.mark.slow)])
def test_neighbours_are_isolated_to_the_bit(impl):
    """Changing every other sequence's cached pages and new K/V leaves one
    sequence's outputs unchanged, bit for bit."""
    case = Case(batch="mixed", page_size=16, num_kv_heads=1, group=2, head_dim=64)
    a = build(case, 4)
    me = 4  # 9 queries at positions 8..16, two pages
    out, _ = call(a, impl)
    tables, kv_lens = np.asarray(a["block_tables"]), np.asarray(a["kv_lens"])
    mine = {int(tables[me, p]) for p in range(-(-int(kv_lens[me]) // 16))}
    others = np.ones(a["pool"].num_pages, bool)
    others[list(mine)] = False
    r = np.random.default_rng(9)
    k = np.asarray(a["pool"].k).copy()
    k[LAYER][:, others] = r.normal(size=k[LAYER][:, others].shape)
    rows = np.arange(a["q"].shape[0])
    start, ql = int(a["q_starts"][me]), int(a["q_lens"][me])
    not_mine = (rows < start) | (rows >= start + ql)
    k_new = np.asarray(a["k_new"]).copy()
    k_new[not_mine] = r.normal(size=k_new[not_mine].shape)
    changed = dict(a, pool=a["pool"].replace(k=jnp.asarray(k)), k_new=jnp.asarray(k_new))
    out2, _ = call(changed, impl)
    assert not np.array_equal(np.asarray(out), np.asarray(out2))  # the others did change
    np.testing.assert_array_equal(np.asarray(out2)[start:start + ql], np.asarray(out)[start:start + ql])


def test_writes_nothing_else_and_nothing_without_new_kv():
    """Only the new tokens' slots of the layer change; with ``k_new`` None the
    pool comes back unchanged and the output is that of the written pool."""
    case = Case(batch="mixed", page_size=16, num_kv_heads=2, group=2, head_dim=64, page_dtype="int8")
    a = build(case, 5)
    _, pool = call(a, "gpu")
    before, after = np.asarray(a["pool"].k_scale), np.asarray(pool.k_scale)
    slots = np.asarray(a["slots"])
    slots = slots[slots >= 0]
    touched = np.zeros(before.shape, bool)
    touched[LAYER][:, slots // 16, slots % 16] = True
    assert np.array_equal(np.isnan(before) & ~touched, np.isnan(after) & ~touched)
    assert np.array_equal(np.nan_to_num(before)[~touched], np.nan_to_num(after)[~touched])
    assert np.all(np.isfinite(after[touched]))
    written = engine_write(a)
    out, *same = flat_ragged_paged_attention(
        a["q"], None, None, written.k, written.v, LAYER, a["block_tables"], a["q_starts"], a["q_lens"],
        a["kv_lens"], None, k_scales=written.k_scale, v_scales=written.v_scale, decode_tiles=a["decode_tiles"],
        prefill_chunks=a["prefill_chunks"], impl="gpu")
    assert_pool_bits(KVPool(*same), written)
    want = oracle(a, written, case)
    real = np.asarray(a["slots"]) >= 0
    np.testing.assert_allclose(np.asarray(out)[real], want[real], **TOLERANCES["float32"])


def test_the_reference_is_the_kernels_twin_on_a_hand_case():
    """One sequence of two tokens in page 1 (page 0 NaN), head dim 2, one
    head, scale 1: the call writes token 1 (k1 = [0, 0], v1 = [0, 1]) beside
    the cached token 0 (k0 = [1, 0], v0 = [1, 0]); query row 0 is token 1's:
    q = [1, 0], logits [1, 0], softmax [e, 1] / (e + 1) = [0.731059,
    0.268941], which is also the output."""
    k = np.full((1, 1, 2, 2, 2), np.nan, np.float32)
    v = np.full((1, 1, 2, 2, 2), np.nan, np.float32)
    k[0, 0, 1, 0], v[0, 0, 1, 0] = [1, 0], [1, 0]
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    args = (jnp.asarray([[[1.0, 0.0]]]), jnp.asarray([[[0.0, 0.0]]]), jnp.asarray([[[0.0, 1.0]]]),
            jnp.asarray(k), jnp.asarray(v), 0, i32([[1]]), i32([0]), i32([1]), i32([2]), i32([3]))
    for fn in (ref_flat_ragged_paged_attention, functools.partial(flat_ragged_paged_attention, impl="tpu")):
        out, kp, vp, _, _ = fn(*args, scale=1.0, decode_tiles=1, prefill_chunks=0,
                               block_sizes=FlatBlockSizes(keys_per_block=2))
        np.testing.assert_allclose(np.asarray(out)[0, 0], [0.731059, 0.268941], atol=1e-6)
        np.testing.assert_array_equal(np.asarray(vp)[0, 0, 1, 1], [0.0, 1.0])


def test_bad_inputs_are_refused_eagerly_and_clamped_under_jit():
    case = Case(batch="mixed", page_size=16, num_kv_heads=1, group=2, head_dim=64)
    a = build(case, 6)
    cap = a["block_tables"].shape[1] * 16
    long = np.asarray(a["kv_lens"]).copy()
    long[5] = cap + 1
    with pytest.raises(ValueError, match=r"kv_lens must be in \[0, pages_per_seq \* page_size = "):
        call(dict(a, kv_lens=jnp.asarray(long)), "gpu")
    for change, needle in (
        (dict(decode_tiles=1), "decode_tiles=1 is below the 3 tiles"),
        (dict(prefill_chunks=0), "prefill_chunks=0 is below the 2 chunks"),
        (dict(decode_tiles=0, prefill_chunks=0), "cannot both be 0"),
        (dict(slots=a["slots"].at[1].set(a["slots"][0])), "slots must be distinct flat slots"),
        (dict(k_new=None), "must be given together"),
        (dict(k_new=a["k_new"][:, :, :8]), r"k_new must be a float \[T, K, H\]"),
        (dict(q_starts=a["q_starts"].at[2].set(a["q_starts"][1])), "overlap or pass T"),
        (dict(q=a["q"].astype(jnp.int32)), "q must be a float array, got dtype int32"),
        (dict(kv_lens=np.asarray(a["kv_lens"], np.int64) + 2**32), r"kv_lens must fit int32"),
        (dict(block_tables=a["block_tables"].astype(jnp.float32)), "block_tables must be an integer"),
        (dict(block_tables=a["block_tables"][:, :0]), r"pages_per_seq >= 1"),
    ):
        with pytest.raises(ValueError, match=needle):
            call(dict(a, **change), "gpu")
    # A slot off its sequence's table would overwrite another sequence's cached K/V: refused eagerly.
    owned = int(np.flatnonzero(np.asarray(a["slots"]) >= 0)[0])
    free = int(np.setdiff1d(np.arange(a["pool"].k.shape[2] * 16), np.asarray(a["slots"]))[-1])
    with pytest.raises(ValueError, match=f"row {owned} has slot {free}, its table gives"):
        call(dict(a, slots=a["slots"].at[owned].set(free)), "gpu")
    padding = int(np.flatnonzero(np.asarray(a["slots"]) < 0)[0])
    with pytest.raises(ValueError, match=f"row {padding} has slot {free}, its table gives -1"):
        call(dict(a, slots=a["slots"].at[padding].set(free)), "gpu")
    with pytest.raises(ValueError, match="at least one sequence and one query row"):
        call(dict(a, q=a["q"][:0], k_new=a["k_new"][:0], v_new=a["v_new"][:0], slots=a["slots"][:0],
                  q_lens=jnp.zeros_like(a["q_lens"]), q_starts=jnp.zeros_like(a["q_starts"])), "gpu")
    with pytest.raises(ValueError, match="impl must be one of"):
        call(a, "cuda")
    with pytest.raises(ValueError, match="layer must be an integer scalar"):  # not layer 0 silently
        flat_ragged_paged_attention(a["q"], None, None, a["pool"].k, a["pool"].v, None, a["block_tables"],
                                    a["q_starts"], a["q_lens"], a["kv_lens"], None, decode_tiles=6, prefill_chunks=3)
    with pytest.raises(ValueError, match="layer must be in"):
        flat_ragged_paged_attention(a["q"], None, None, a["pool"].k, a["pool"].v, LAYERS, a["block_tables"],
                                    a["q_starts"], a["q_lens"], a["kv_lens"], None, decode_tiles=6, prefill_chunks=3)
    odd = dict(a, pool=KVPool(k=a["pool"].k[:, :, :, :12], v=a["pool"].v[:, :, :, :12]))
    with pytest.raises(ValueError, match="page_size=12 gives 5 \\* 12 = 60"):
        call(dict(odd, slots=jnp.full_like(a["slots"], -1)), "gpu")
    with pytest.raises(ValueError, match="prefill_rows must be a power of two"):
        FlatBlockSizes(prefill_rows=48)
    # Under jit the length is clamped to the row's table: nothing past it is read.
    fn = jax.jit(lambda kl: call(dict(a, kv_lens=kl), "gpu")[0])
    clamped = long.copy()
    clamped[5] = cap
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(long))), np.asarray(fn(jnp.asarray(clamped))))
    # Rows a sequence cannot own cannot be refused under jit: a negative start (it wrapped to row T - 1, another
    # sequence's), or rows that overlap another's. Every output row is NaN instead of a silently wrong answer.
    first = int(np.argmin(np.asarray(a["q_starts"])))
    assert int(a["q_starts"][first]) == 0 and int(a["q_lens"][first]) > 0
    starts = jax.jit(lambda qs: call(dict(a, q_starts=qs), "gpu")[0])
    assert np.isnan(np.asarray(starts(a["q_starts"].at[first].set(-1)))).all()
    assert np.isfinite(np.asarray(starts(a["q_starts"]))).all()
    assert np.isnan(np.asarray(starts(a["q_starts"].at[2].set(a["q_starts"][1])))).all()
    # So do starts past T (clamped, a one-row sequence would land in a padding row), int32-wrapping ones included;
    # eagerly they are refused.
    one = int(np.flatnonzero(np.asarray(a["q_lens"]) == 1)[0])
    T = a["q"].shape[0]
    for start in (T, T + 100, 2**31 - 1):
        assert np.isnan(np.asarray(starts(a["q_starts"].at[one].set(start)))).all(), start
        with pytest.raises(ValueError, match="overlap or pass T"):
            call(dict(a, q_starts=a["q_starts"].at[one].set(start), k_new=None, v_new=None, slots=None), "gpu")


def test_scales_that_are_not_arrays_are_refused_by_name():
    case = Case(batch="decode", page_size=16, num_kv_heads=1, group=2, head_dim=64, page_dtype="int8")
    a = build(case, 3)
    assert a["pool"].k_scale is not None
    for bad, needle in ((a["pool"].k_scale.tolist(), "k_scales must be an f32.* array, got list"),
                        (1.0, "k_scales must be an f32.* array, got float")):
        with pytest.raises(ValueError, match=needle):
            call(dict(a, pool=dataclasses.replace(a["pool"], k_scale=bad)), "reference")
    # NumPy pools and scales are arrays: served as JAX's (the write crashed on them).
    want, _ = call(a, "reference")
    numpy_pool = jax.tree.map(np.asarray, a["pool"])
    got, _ = call(dict(a, pool=numpy_pool), "reference")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


PRESET_HEADS = sorted({(c.num_q_heads, c.num_kv_heads, c.head_dim) for c in PRESETS.values()})


@pytest.mark.parametrize("heads", PRESET_HEADS, ids=lambda h: f"N{h[0]}K{h[1]}H{h[2]}")
def test_gpu_kernel_lowers_to_triton_at_every_presets_heads(heads):
    """Both classes of the GPU kernel (decode tiles, chunk tiles), stacked
    bf16 pool, traced layer, lower to Triton IR on this GPU-less machine
    (``lowering_platforms=("cuda",)``: Pallas' Triton lowering refuses
    shapes, indexing and ops Triton cannot take); and with fp8 pages."""
    num_q_heads, num_kv_heads, head_dim = heads
    t_total, num_seqs = 64, 8

    def lower(page_dtype):
        pool = jnp.zeros((2, num_kv_heads, 16, 16, head_dim), page_dtype)
        scales = jnp.zeros(pool.shape[:-1], jnp.float32) if common.is_quantized(page_dtype) else None
        i32 = jnp.zeros((num_seqs,), jnp.int32)

        def fn(layer, q, k, v):
            return unchecked_flat_ragged_paged_attention(
                q, k, v, pool, pool, layer, jnp.zeros((num_seqs, 4), jnp.int32), i32, i32, i32,
                jnp.zeros((t_total,), jnp.int32), k_scales=scales, v_scales=scales, decode_tiles=num_seqs,
                prefill_chunks=4, impl="gpu", interpret=False)

        new = jnp.zeros((t_total, num_kv_heads, head_dim), jnp.bfloat16)
        return jax.jit(fn).trace(jnp.int32(1), jnp.zeros((t_total, num_q_heads, head_dim), jnp.bfloat16), new,
                                 new).lower(lowering_platforms=("cuda",)).as_text()

    for page_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        text = lower(page_dtype)
        assert text.count("xla.gpu.triton") >= 2  # one launch per class


def engine_tokens(config, impl, *, prompt_lens, page_size, num_pages, budget, kv_dtype=jnp.float32):
    """Greedy tokens (5 per request) of an engine over a random-weight
    ``config``, prompts of ``prompt_lens`` tokens: calls mix chunks and
    decodes."""
    from flax import nnx

    from models.llama import Llama
    from models.ragged import RaggedModel
    from paged_jax.engine.core import Engine, EngineConfig, Request

    model = Llama(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    requests = [Request(request_id=i, prompt_ids=rng.integers(0, config.vocab_size, int(n)).tolist(),
                        max_new_tokens=5) for i, n in enumerate(prompt_lens)]
    engine = Engine(RaggedModel(model, impl=impl), config.make_kv_pool(num_pages, page_size, dtype=kv_dtype),
                    EngineConfig(max_seqs=4, max_seq_len=128, max_num_batched_tokens=budget))
    return {o.request_id: o.output_ids for o in engine.run(requests)}


@pytest.mark.slow  # about a minute per kernel in interpret mode on 2 cores (many batch shapes compile)
@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_engine_through_the_flat_kernel_equals_xla(impl):
    """The engine through the flat kernel (interpret mode; it writes each
    layer's K/V itself) gives the XLA work list's greedy tokens: a tiny
    two-layer model with two query heads per KV head, pages of 4, a budget
    of 16 tokens, so prompts are chunked beside decodes. (tests/test_llama.py
    runs ``pallas_gpu`` on another tiny model by default.)"""
    from models.config import LlamaConfig

    config = LlamaConfig(vocab_size=97, model_dim=32, mlp_dim=48, num_layers=2, num_q_heads=4, num_kv_heads=2,
                         head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5)
    sizes = dict(prompt_lens=(3, 9, 20), page_size=4, num_pages=40, budget=16)
    assert engine_tokens(config, impl, **sizes) == engine_tokens(config, "xla", **sizes)


@pytest.mark.slow  # about a minute per kernel in interpret mode on 2 cores
@pytest.mark.parametrize("impl, kv_dtype", [("pallas_gpu", jnp.float32), ("pallas_gpu", jnp.int8),
                                            ("pallas_tpu", jnp.float32)], ids=["gpu", "gpu-int8", "tpu"])
def test_engine_at_smollm2_shapes_through_the_flat_kernel_equals_xla(impl, kv_dtype):
    """SmolLM2's attention shapes (9 query heads over 3 KV heads of 64; two
    layers, random weights, vocabulary 512), prompts of 3 to 70 tokens."""
    config = dataclasses.replace(PRESETS["smollm2-135m"], num_layers=2, vocab_size=512)
    sizes = dict(prompt_lens=(3, 17, 40, 70), page_size=16, num_pages=48, budget=64, kv_dtype=kv_dtype)
    assert engine_tokens(config, impl, **sizes) == engine_tokens(config, "xla", **sizes)


@pytest.mark.parametrize("impl, writes", [("xla", 1), ("pallas_gpu", 0), ("pallas_tpu", 0)])
def test_forward_ragged_lets_the_flat_kernel_write(monkeypatch, impl, writes):
    """With a flat kernel the decoder issues no K/V scatter of its own (the
    kernel's call writes); the XLA path scatters once per layer body."""
    from flax import nnx

    from models import llama, ragged
    from models.config import LlamaConfig
    from paged_jax.attention import ragged as ragged_attention

    calls = []

    def counting(real):
        def wrapper(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        return wrapper

    for module in (ragged, ragged_attention):
        monkeypatch.setattr(module, "unchecked_write_layer_kv", counting(module.unchecked_write_layer_kv))
    config = LlamaConfig(vocab_size=97, model_dim=32, mlp_dim=48, num_layers=2, num_q_heads=4, num_kv_heads=2,
                         head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5)
    model = llama.Llama(config, rngs=nnx.Rngs(0))
    batch = small_mixed_batch()
    kv = config.make_kv_pool(8, 4)
    jax.eval_shape(lambda b, kv: ragged.forward_ragged(model, b, kv, impl=impl), batch, kv)
    assert len(calls) == writes


def _tiny_call(impl, **config):
    """One jitted ``forward_ragged`` call of a tiny model (one layer unless
    ``config`` says otherwise) on a mixed batch (a 5-token prompt and a
    decode), into a NaN pool but for the decode's cached tokens:
    ``(logits, kv)``."""
    from flax import nnx

    from models import llama, ragged
    from models.config import LlamaConfig

    config = LlamaConfig(**{**dict(vocab_size=97, model_dim=32, mlp_dim=48, num_layers=1, num_q_heads=4,
                                   num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5), **config})
    model = llama.Llama(config, rngs=nnx.Rngs(0))
    batch = small_mixed_batch()
    kv = config.make_kv_pool(8, 4)
    r = np.random.default_rng(0)
    k = np.full(kv.k.shape, np.nan, np.float32)
    v = np.full(kv.v.shape, np.nan, np.float32)
    shape = (2, config.num_layers, 2, 2, 16)
    k[:, :, 3, :2], v[:, :, 3, :2] = r.normal(size=shape)  # the decode's positions 0, 1 (page 3)
    kv = kv.replace(k=jnp.asarray(k), v=jnp.asarray(v))
    return jax.jit(lambda b, kv: ragged.forward_ragged(model, b, kv, impl=impl))(batch, kv)


# pallas_gpu by default in tests/test_llama.py's engine test
@pytest.mark.parametrize("impl", [pytest.param("pallas_gpu", marks=pytest.mark.slow), "pallas_tpu"])
def test_decoder_through_the_flat_kernel_equals_xla(impl):
    """A decoder call with the kernel writing the layer's K/V: logits equal
    the XLA path's, the pool its scatter's bit for bit (NaN pool: nothing
    unwritten is read)."""
    (logits, kv, _), (want, want_kv, _) = _tiny_call(impl), _tiny_call("xla")
    assert np.all(np.isfinite(np.asarray(logits)))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-4, rtol=1e-4)
    assert_pool_bits(kv, want_kv)


@pytest.mark.slow  # two layers, two attention branches: about 30 s in interpret mode
def test_decoder_with_mixed_sliding_and_global_layers_through_the_flat_kernel():
    """Sliding and global layers under the per-layer cond (the scatter
    outside it, the kernel only attending): logits equal the XLA path's;
    layer 0's K/V bit for bit (layer 1's come from layer 0's outputs, which
    differ in the last bits)."""
    mixed = dict(num_layers=2, sliding_window=3, layer_types=("sliding_attention", "full_attention"))
    (logits, kv, _), (want, want_kv, _) = _tiny_call("pallas_gpu", **mixed), _tiny_call("xla", **mixed)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-4, rtol=1e-4)
    assert_pool_bits(KVPool(k=kv.k[:1], v=kv.v[:1]), KVPool(k=want_kv.k[:1], v=want_kv.v[:1]))


@pytest.mark.parametrize("page_dtype", ["bfloat16", "int8"])
def test_tpu_kernel_writes_chunks_of_a_large_page_bit_for_bit(page_dtype):
    """Pages of 64: the TPU kernel writes K/V by 32-row chunks (a tiled page
    takes no one-token DMA), read, merged and written back. A 40-token chunk
    at positions 20..59 spans both chunks of a page, a decode at 33 sits in
    the second, one at 63 ends a page: the pool equals the engine's scatter
    bit for bit, and nothing else changes."""
    case = Case(batch="mixed", page_size=64, num_kv_heads=2, group=2, head_dim=64, page_dtype=page_dtype)
    a = build(case, 11, q_lens=[40, 1, 1], kv_lens=[60, 34, 64])
    _, pool = call(a, "tpu")
    assert_pool_bits(pool, engine_write(a))
