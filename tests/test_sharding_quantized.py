"""Quantized K/V pages (int8, fp8) on a device mesh equal the same pages on
one device.

8 faked CPU devices (tests/conftest.py); the truth is the unsharded path
with the same page dtype. A quantized pool's scales ``f32[layers, K', P,
L]`` are sharded as their pages (KV heads over ``model``, pages over
``data``), so each device quantizes the K/V of its own heads on write and
dequantizes them on read, with no communication.

Where the op order is the same, the result is the same bit for bit: layer
0's pages and scales (its K/V come from the embedding through per-head
projections, computed alike on one device and on a mesh). From layer 1 on,
the residual stream differs in the order of the model axis's all-reduce
sums (about 1e-6, as for f32 pages: test_sharding.py), so scales differ in
their last bits and a K/V value near a rounding boundary of its page dtype
can land on the other side. Measured over 2 prompt sets, 3 dtypes and
meshes (2, 2), (2, 4), (1, 8), (4, 2): logits within 1.0e-5 in 23 of 24
runs; in one (int8, (1, 8)) 236 of 2,560 logits off by up to 1.0e-2, where
int8 pages themselves move logits by 0.11 from f32 pages. Hence the stated
tolerance: greedy tokens equal, the median logit within ``TINY_ATOL``, and
every logit within ``FLIP_FRACTION`` of the page dtype's own quantization
error (the f32 pool's logits against the quantized pool's, one device);
pages written by a prefill equal bit for bit in layer 0, and in at least
``SAME_BYTES`` of their bytes in layer 1.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from sharded_cases import (
    PAGE_SIZE,
    TINY_GQA,
    block_tables,
    decode_sharded,
    decode_unsharded,
    make_prompts,
    mixed_split,
    padded_rows,
)

from models.llama import Llama, forward
from models.ragged import RaggedModel
from models.sharded import (
    KV_SPEC,
    SCALE_SPEC,
    ShardedLlama,
    ShardedRaggedModel,
    kv_pool_specs,
    make_data_parallel_engine,
)
from paged_jax.distributed.sharding import make_mesh
from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.kv_cache import copy_pages
from paged_jax.paging.swap import gather_pages, scatter_pages
from tests.decoder_helpers import small_mixed_batch

TINY_ATOL = 1e-4
FLIP_FRACTION = 0.25  # measured worst: 1.0e-2 / 0.11 = 0.09
SAME_BYTES = 0.99  # measured: 1.0 after the prefills checked here
QUANTIZED = [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2]
DTYPE_IDS = ["int8", "e4m3fn", "e5m2"]


def mesh_of(data: int, model: int):
    """A ``(data, model)`` mesh over the first ``data * model`` devices."""
    return make_mesh(data, model, devices=jax.devices()[: data * model])


@pytest.fixture(scope="module")
def model():
    return Llama(TINY_GQA, rngs=nnx.Rngs(0))


# --- the pool ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [*QUANTIZED, "fp8", jnp.float32], ids=[*DTYPE_IDS, "fp8-alias", "f32"])
@pytest.mark.parametrize("data, model_size", [(2, 2), (2, 4)])
def test_a_sharded_pool_is_its_dtype_on_every_device(model, dtype, data, model_size):
    """Every shard of K and V is exactly the dtype asked for ("fp8" is
    float8_e4m3fn), never a wider stand-in; a quantized pool's scales are
    f32 and sharded as their pages (spec of rank 4); each device holds
    exactly ``kv_bytes_per_device`` bytes. TINY_GQA's 3 KV heads over 2
    devices are padded to 4 (2 a device), over 4 replicated (1 a device)."""
    sharded = ShardedLlama(model, mesh_of(data, model_size))
    kv = sharded.make_kv_pool(5, 4, dtype)
    want = jnp.dtype(jnp.float8_e4m3fn if dtype == "fp8" else dtype)
    quantized = want != jnp.float32
    k_local = {2: 2, 4: 1}[model_size]
    assert sharded.layout.kv_heads_per_device == k_local
    assert kv.quantized == quantized and kv.k.shape == (2, 4, 5 * data, 4, 8)
    for x in (kv.k, kv.v):
        assert x.dtype == want and x.sharding.spec == KV_SPEC
        assert {(s.data.dtype, s.data.shape) for s in x.addressable_shards} == {(want, (2, k_local, 5, 4, 8))}
    scales = (kv.k_scale, kv.v_scale)
    if quantized:
        for s in scales:
            assert s.dtype == jnp.float32 and s.shape == (2, 4, 5 * data, 4) and s.sharding.spec == SCALE_SPEC
            shards = {(t.data.dtype, t.data.shape) for t in s.addressable_shards}
            assert shards == {(jnp.dtype(jnp.float32), (2, k_local, 5, 4))}
    else:
        assert scales == (None, None)
    # 2 (K, V) * 2 layers * k_local heads * 5 pages * 4 tokens * (8 bytes + a 4-byte scale), or 8 f32s
    per_token = 8 * want.itemsize + (4 if quantized else 0)
    assert sharded.kv_bytes_per_device(5, 4, dtype) == 2 * 2 * k_local * 5 * 4 * per_token
    for device in sharded.mesh.devices.flat:
        held = sum(s.data.nbytes for leaf in jax.tree.leaves(kv) for s in leaf.addressable_shards
                   if s.device == device)
        assert held == sharded.kv_bytes_per_device(5, 4, dtype)


def test_pool_specs_are_shaped_as_the_pool():
    assert kv_pool_specs(False).k == KV_SPEC and kv_pool_specs(False).k_scale is None
    specs = kv_pool_specs(True)
    assert (specs.k, specs.v, specs.k_scale, specs.v_scale) == (KV_SPEC, KV_SPEC, SCALE_SPEC, SCALE_SPEC)
    assert len(SCALE_SPEC) == 4 and len(KV_SPEC) == 5


def test_bad_pool_arguments_are_refused(model):
    sharded = ShardedLlama(model, mesh_of(1, 2))
    for count in (lambda *a: sharded.make_kv_pool(*a), lambda *a: sharded.kv_bytes_per_device(*a)):
        with pytest.raises(ValueError, match="pages_per_shard must be an int >= 2, got pages_per_shard=-3"):
            count(-3, 4, jnp.int8)  # kv_bytes_per_device gave a negative byte count
        with pytest.raises(ValueError, match="page_size must be an int >= 1, got page_size=2.5"):
            count(4, 2.5, jnp.int8)
    for call in (lambda: sharded.make_kv_pool(4, 4, "float8_e4m3fnuz"),
                 lambda: sharded.kv_bytes_per_device(4, 4, jnp.float64)):
        with pytest.raises(ValueError, match="dtype"):
            call()
    engine_model = ShardedRaggedModel(model, mesh_of(1, 2))
    pool = engine_model.make_kv_pool(4, 4, jnp.int8)
    engine_model.check_kv_pool(pool)  # a quantized pool is welcome
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        engine_model.check_kv_pool(type(pool)(k=pool.k, v=pool.v))


# --- whole-page moves ---------------------------------------------------------


def _filled(kv):
    """``kv`` with every leaf replaced by distinct random values of its
    dtype, placed with the leaf's sharding."""
    rng = np.random.default_rng(3)
    return jax.tree.map(lambda x: jax.device_put(jnp.asarray(rng.normal(size=x.shape) * 3, x.dtype), x.sharding),
                        kv)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "e4m3fn"])
def test_copy_on_write_and_swap_move_pages_with_their_scales(model, dtype):
    """On a sharded engine pool ((1, 4): replicated KV heads), a page copy
    under ``jit`` and a swap round trip through host memory move K, V and
    both scales, bit for bit, touch no other page, and keep every leaf's
    sharding (so the next step takes the pool without a reshard)."""
    engine_model = ShardedRaggedModel(model, mesh_of(1, 4))
    kv = _filled(engine_model.make_kv_pool(8, 4, dtype))
    before = [np.asarray(x) for x in jax.tree.leaves(kv)]
    shardings = [x.sharding for x in jax.tree.leaves(kv)]

    copied = jax.jit(copy_pages)(kv, jnp.array([2, 5, -1], jnp.int32), jnp.array([6, 1, 3], jnp.int32))
    for old, new, sharding in zip(before, jax.tree.leaves(copied), shardings):
        assert new.sharding.is_equivalent_to(sharding, new.ndim)
        want = old.copy()
        want[:, :, [6, 1]] = old[:, :, [2, 5]]
        assert np.asarray(new).tobytes() == want.tobytes()

    host = gather_pages(kv, [3, 7])
    assert host.quantized and {d.platform for d in host.k.devices()} == {"cpu"}
    swapped = scatter_pages(kv, [4, 2], host, source=[1, 0])  # page 7 -> 4, 3 -> 2
    for old, new, sharding in zip(before, jax.tree.leaves(swapped), shardings):
        assert new.sharding.is_equivalent_to(sharding, new.ndim)
        want = old.copy()
        want[:, :, [4, 2]] = old[:, :, [7, 3]]
        assert np.asarray(new).tobytes() == want.tobytes()


# --- decoding: sharded equals unsharded -------------------------------------------


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(8, TINY_GQA.vocab_size, seed=0)


@pytest.mark.parametrize("dtype, data, model_size", [
    ("int8", 2, 4), *(pytest.param(*case, marks=pytest.mark.slow) for case in (("float8_e4m3fn", 2, 2),
                                                                                ("float8_e5m2", 1, 8)))])
def test_a_prefill_writes_the_unsharded_pages(model, prompts, dtype, data, model_size):
    """One prefill of 8 ragged prompts, on one device and on the mesh; every
    token's K/V compared by (row, position, KV head), each mesh KV slot
    against the head it holds (replicas included): layer 0 bit for bit,
    pages and scales; layer 1's scales within f32 rounding of the
    all-reduce order and at least ``SAME_BYTES`` of its pages' bytes
    equal; zero (padding) heads hold zeros."""
    lens = np.array([len(p) for p in prompts], np.int32)
    tokens, per_seq = padded_rows(prompts), -(-int(lens.max()) // PAGE_SIZE)
    one_tables = block_tables(8, 1, per_seq)
    one = jax.jit(lambda t, kv: forward(model, t, kv, one_tables, lens, lens)[1])(
        tokens, TINY_GQA.make_kv_pool(8 * per_seq + 1, PAGE_SIZE, dtype))
    sharded = ShardedLlama(model, mesh_of(data, model_size))
    pages_per_shard = 8 // data * per_seq + 1
    mesh_tables = block_tables(8, data, per_seq)
    _, mesh = sharded.forward(tokens, sharded.make_kv_pool(pages_per_shard, PAGE_SIZE, dtype), mesh_tables, lens,
                              lens)
    assert mesh.k.dtype == jnp.dtype(dtype)

    row = np.repeat(np.arange(8), lens)  # every written token: its row, position, pages and offset
    pos = np.concatenate([np.arange(n) for n in lens])
    mesh_page = row // (8 // data) * pages_per_shard + mesh_tables[row, pos // PAGE_SIZE]  # global page id
    check_written_pages(one, mesh, sharded.layout.kv_slots, one_tables[row, pos // PAGE_SIZE], mesh_page,
                        pos % PAGE_SIZE)


def check_written_pages(one, mesh, kv_slots, one_pages, mesh_pages, offsets, *, exact_layer_0=True):
    """The tokens written at ``(one_pages, offsets)`` of the one-device pool
    ``one`` and at ``(mesh_pages, offsets)`` (global page ids) of the mesh
    pool ``mesh``, each mesh KV slot against the head it holds
    (``kv_slots``): layer 0 bit for bit, pages and scales, if
    ``exact_layer_0``; otherwise, and in layer 1, scales within f32
    rounding and at least ``SAME_BYTES`` of the pages' bytes equal; zero
    (padding) heads hold zeros."""
    slots = np.asarray(kv_slots)
    real = slots >= 0
    for name in ("k", "v", "k_scale", "v_scale"):
        # [layers, slots, tokens(, H)]: the one-device pool's heads in the mesh's slot order
        want = np.asarray(getattr(one, name))[:, :, one_pages, offsets][:, slots[real]]
        got_all = np.asarray(getattr(mesh, name))[:, :, mesh_pages, offsets]
        got = got_all[:, real]
        assert (got_all[:, ~real].astype(np.float32) == 0).all(), name
        if exact_layer_0:
            assert got[0].tobytes() == want[0].tobytes(), name  # layer 0: same op order, same bits
        for layer in range(1 if exact_layer_0 else 0, len(got)):
            if name.endswith("scale"):
                np.testing.assert_allclose(got[layer], want[layer], rtol=1e-5, atol=0)
            else:
                same = (got[layer].view(np.uint8) == want[layer].view(np.uint8)).mean()
                assert same >= SAME_BYTES, (name, layer, same)


@pytest.mark.parametrize("dtype", ["int8", pytest.param("float8_e4m3fn", marks=pytest.mark.slow)])
def test_the_engines_ragged_call_on_quantized_pages_equals_one_device(model, dtype):
    """ShardedRaggedModel.apply (the engine's model call: a flat ragged batch
    under shard_map), (1, 4) mesh, replicated KV heads: a mixed batch (a
    5-token prefill beside a decode token) on an int8 / fp8 pool gives
    RaggedModel.apply's logits on one device within the stated tolerance
    and writes the same pages (:func:`check_written_pages`), layer 0 not bit
    for bit: this path's K projection on a device's heads rounds in another
    order than on all heads (measured: scales 1 ulp apart, pages equal)."""
    batch = small_mixed_batch()
    one_model, sharded = RaggedModel(model), ShardedRaggedModel(model, mesh_of(1, 4))
    f32_logits, _, _ = jax.jit(one_model.apply)(one_model.params, batch, TINY_GQA.make_kv_pool(17, 4, jnp.float32))
    want, one, _ = jax.jit(one_model.apply)(one_model.params, batch, TINY_GQA.make_kv_pool(17, 4, dtype))
    got, mesh, _ = jax.jit(sharded.apply)(sharded.params, batch, sharded.make_kv_pool(17, 4, dtype))
    assert mesh.k.dtype == jnp.dtype(dtype)
    assert mesh.k_scale.sharding.is_equivalent_to(NamedSharding(sharded.mesh, SCALE_SPEC), 4)
    check_logits(np.asarray(got), np.asarray(want), np.asarray(f32_logits))
    written = np.asarray(batch.slots)[np.asarray(batch.slots) >= 0]
    check_written_pages(one, mesh, sharded.sharded.layout.kv_slots, written // 4, written // 4, written % 4,
                        exact_layer_0=False)


def check_logits(got, want, f32):
    """The stated tolerance (module docstring): the median within
    ``TINY_ATOL``, every logit within ``FLIP_FRACTION`` of the page dtype's
    quantization error (``f32``: the same logits from f32 pages)."""
    diff = np.abs(got - want)
    assert np.median(diff) <= TINY_ATOL, np.median(diff)
    quantization_error = np.abs(f32 - want).max()
    assert diff.max() <= FLIP_FRACTION * quantization_error, (diff.max(), quantization_error)


@pytest.fixture(scope="module")
def f32_logits(model, prompts):
    """One device, f32 pages: the yardstick of quantization error."""
    return decode_unsharded(model, prompts, steps=3, split=mixed_split(prompts))[1]


# One int8 and one fp8 case (padded, replicated heads) by default; the rest ~8 s of CPU each.
MIXED_CASES = [("int8", 2, 2)] + [pytest.param(*case, marks=pytest.mark.slow) for case in (
    ("float8_e4m3fn", 2, 4), ("int8", 2, 4), ("int8", 1, 8), ("float8_e4m3fn", 2, 2), ("float8_e4m3fn", 4, 2), ("float8_e5m2", 2, 2),
    ("float8_e5m2", 2, 4))]


@pytest.mark.parametrize("dtype, data, model_size", MIXED_CASES)
def test_sharded_quantized_mixed_batch_equals_unsharded(model, prompts, f32_logits, dtype, data, model_size):
    """ShardedLlama.forward on an int8 / fp8 pool: a first call prefilling
    whole prompts and half prompts, a mixed second call (the prompts' rest
    beside first decode tokens), then 3 decode calls, give the unsharded
    pool's greedy tokens, and logits within the stated tolerance (module
    docstring); TINY_GQA's 3 KV heads padded to 4 on model=2, replicated
    on model=4 and 8."""
    split = mixed_split(prompts)
    assert (split < [len(p) for p in prompts]).any() and (split == [len(p) for p in prompts]).any()
    want_tokens, want_logits = decode_unsharded(model, prompts, steps=3, kv_dtype=dtype, split=split)
    tokens, logits = decode_sharded(model, mesh_of(data, model_size), prompts, steps=3, kv_dtype=dtype, split=split)
    np.testing.assert_array_equal(tokens, want_tokens)
    check_logits(logits, want_logits, f32_logits)


# --- the engine -------------------------------------------------------------------


def engine_requests(n: int, max_new_tokens: int) -> list[Request]:
    """``n`` requests with ragged prompts; the first asks for 2 greedy
    samples, which fork the prompt's pages and then copy-on-write the
    shared last page."""
    prompts = make_prompts(n, TINY_GQA.vocab_size, seed=1, lo=3, hi=11)
    return [Request(request_id=i, prompt_ids=p, max_new_tokens=max_new_tokens,
                    sampling=SamplingParams(n=2) if i == 0 else SamplingParams()) for i, p in enumerate(prompts)]


def outputs_of(engine, requests):
    return {o.request_id: [c.output_ids for c in o.outputs] for o in engine.run(requests)}


def check_engine_pool(engine, dtype, shard_shape):
    """Every device's K and V shard is ``dtype`` of ``shard_shape``; the
    scales stay f32 and sharded as the pages after the engine's steps."""
    kv = engine.kv
    for x in (kv.k, kv.v):
        assert {(s.data.dtype, s.data.shape) for s in x.addressable_shards} == {(jnp.dtype(dtype), shard_shape)}
    for s in (kv.k_scale, kv.v_scale):
        assert s.dtype == jnp.float32 and s.sharding.is_equivalent_to(NamedSharding(s.sharding.mesh, SCALE_SPEC), 4)


@pytest.mark.slow  # ~30 s of CPU (two engines' programs); the engine's model call is checked by default above
def test_sharded_engine_on_int8_pages_equals_one_device(model):
    """The engine over ShardedRaggedModel ((1, 2) mesh: the ragged apply under
    shard_map, 3 KV heads padded to 2 a device) on an int8 pool gives one
    device's greedy outputs on an int8 pool, a copy-on-write fork included;
    the pool is int8 on both devices before and after."""
    config = EngineConfig(max_seqs=4, max_seq_len=32, max_num_batched_tokens=16, enable_prefix_caching=False)
    requests = engine_requests(4, 8)
    want = outputs_of(Engine(RaggedModel(model), TINY_GQA.make_kv_pool(16, 4, jnp.int8), config), requests)
    sharded = ShardedRaggedModel(model, mesh_of(1, 2))
    engine = Engine(sharded, sharded.make_kv_pool(16, 4, jnp.int8), config, check_page_state=True)
    check_engine_pool(engine, jnp.int8, (2, 2, 16, 4, 8))
    assert outputs_of(engine, requests) == want
    check_engine_pool(engine, jnp.int8, (2, 2, 16, 4, 8))
    assert engine.accounting()["used"] == 0


@pytest.mark.slow  # ~40 s of CPU each: three engines' programs
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_data_parallel_engine_swapping_quantized_pages_equals_one_device(model, dtype):
    """make_data_parallel_engine on a (2, 2) mesh with int8 / fp8 pages and
    pools small enough to preempt by swap: the greedy outputs equal one
    engine's on one device with the same page dtype and pool."""
    config = EngineConfig(max_seqs=4, max_seq_len=32, max_num_batched_tokens=16, preemption_mode="swap",
                          enable_prefix_caching=False)
    requests = engine_requests(8, 12)  # 12 pages (11 usable): 4 sequences of up to 22 tokens do not fit
    one = Engine(RaggedModel(model), TINY_GQA.make_kv_pool(12, 4, dtype), config)
    want = outputs_of(one, requests)
    assert one.stats.swap_outs > 0
    dp = make_data_parallel_engine(model, mesh_of(2, 2), config, pages_per_shard=12, page_size=4, kv_dtype=dtype,
                                   check_page_state=True)
    for engine in dp.engines:
        check_engine_pool(engine, dtype, (2, 2, 12, 4, 8))
    assert outputs_of(dp, requests) == want
    assert sum(e.stats.swap_outs for e in dp.engines) > 0
    for engine in dp.engines:
        check_engine_pool(engine, dtype, (2, 2, 12, 4, 8))
        assert engine.accounting()["used"] == 0


# --- the serving script -------------------------------------------------------------


def test_serve_sharegpt_takes_a_quantized_pool_on_a_mesh(tmp_path):
    from experiments.serving import serve_sharegpt

    for flag, want in (("fp8", "float8_e4m3fn"), ("int8", "int8"), ("float8_e5m2", "float8_e5m2")):
        args = serve_sharegpt.parse_args(["--kv-dtype", flag, "--mesh", "data=2,model=4", "--out", str(tmp_path)])
        assert args.kv_dtype == want and args.mesh_sizes == {"data": 2, "model": 4}
