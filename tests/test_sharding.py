"""Sharded serving equals unsharded.

8 faked CPU devices (tests/conftest.py). The truth is always the unsharded
path: one device, one pool, one page state.

Which attention path: the XLA reference (``impl="auto"`` on CPU) inside
``shard_map``. JAX 0.10.2's TPU interpret mode hangs inside ``shard_map``
over several faked CPU devices on 2 cores (each device thread blocks in a
host callback), so the TPU kernel is not run here; the Pallas kernels are
tested in interpret mode on one device (test_kernels.py), and on a GPU
``device_check.sh`` runs them natively.
"""

import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sharded_cases import TINY_GQA, decode_sharded, decode_unsharded, make_prompts

from models.llama import Llama, LlamaConfig
from models.ragged import RaggedModel
from models.sharded import KV_SPEC, ShardedLlama, ShardedRaggedModel, make_data_parallel_engine
from paged_jax.distributed.data_parallel import DataParallelEngine, merged_stats
from paged_jax.distributed.sharding import (
    DATA,
    MODEL,
    default_model_size,
    head_layout,
    init_distributed,
    make_mesh,
    parse_mesh,
)
from paged_jax.engine.core import Engine, EngineConfig, Request

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
# Sharded vs unsharded logits: f32, differing only in the order of the
# all-reduce sums (measured: about 1e-5 on the tiny model, 2e-4 on SmolLM2
# logits of magnitude up to about 25).
TINY_ATOL = 1e-4
SMOLLM2_ATOL = 2e-3


# --- layouts and meshes ------------------------------------------------------


@pytest.mark.parametrize("n, k, m", [(9, 3, 1), (9, 3, 2), (9, 3, 3), (9, 3, 4), (9, 3, 8), (9, 3, 9),
                                     (8, 2, 8), (32, 8, 4), (32, 8, 8), (32, 8, 16), (4, 4, 8), (12, 4, 8),
                                     (6, 6, 4), (14, 2, 4), (28, 4, 8)])
def test_head_layout_puts_each_query_head_once_beside_its_kv_head(n, k, m):
    lay = head_layout(n, k, m)
    kv_per, q_per = lay.kv_heads_per_device, lay.q_heads_per_device
    assert len(lay.kv_slots) == m * kv_per and len(lay.q_slots) == m * q_per and q_per % kv_per == 0
    assert sorted(q for q in lay.q_slots if q >= 0) == list(range(n))
    assert set(h for h in lay.kv_slots if h >= 0) == set(range(k))
    for j, q in enumerate(lay.q_slots):
        if q >= 0:
            device, local = divmod(j, q_per)
            assert lay.kv_slots[device * kv_per + local // (q_per // kv_per)] == q // (n // k)
    assert lay.padded == (-1 in lay.q_slots + lay.kv_slots)
    assert lay.replicated == (m > k)
    if k % m == 0:  # the even case costs nothing
        assert not lay.padded and (kv_per, q_per) == (k // m, n // m)


def test_head_layout_of_smollm2_on_8_devices():
    """3 KV heads over 8 devices: heads 0 and 1 on three devices each, head 2
    on two; 9 query heads in 2 slots per device, 7 of 16 slots zero heads."""
    lay = head_layout(9, 3, 8)
    assert lay.kv_slots == (0, 0, 0, 1, 1, 1, 2, 2)
    assert lay.q_slots == (0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, 7, 8, -1)
    assert head_layout(9, 3, 2).kv_slots == (0, 1, 2, -1)  # K > M, uneven: one zero KV head


def test_mesh_specs_and_defaults():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh("model=8") == {"model": 8}
    mesh = make_mesh(2, 4)
    assert dict(mesh.shape) == {DATA: 2, MODEL: 4} and mesh.devices.size == 8
    assert dict(make_mesh(model=2).shape) == {DATA: 4, MODEL: 2}
    assert dict(make_mesh(num_kv_heads=8).shape) == {DATA: 1, MODEL: 8}  # all on the model axis
    assert default_model_size(8, 3) == 1  # 3 KV heads split evenly over none of 8, 4, 2
    assert default_model_size(6, 3) == 6 and default_model_size(8, 2) == 8


@pytest.mark.parametrize("spec, match", [
    ("data=2,pipe=4", "must be data=N or model=N"),
    ("data=0", "data must be a positive integer"),
    ("data=2,data=2", "each at most once"),
    ("", "mesh spec must be like"),
])
def test_bad_mesh_specs_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_mesh(spec)


def test_meshes_that_do_not_fit_the_devices_are_refused():
    with pytest.raises(ValueError, match=r"data=3 x model=3 = 9 devices, but 8 are given"):
        make_mesh(3, 3)
    with pytest.raises(ValueError, match="model=3 does not divide the 8 devices"):
        make_mesh(model=3)


def test_an_uneven_mlp_split_names_both_numbers():
    mesh = make_mesh(1, 3, devices=jax.devices()[:3])
    with pytest.raises(ValueError, match="mlp_dim=64 does not split evenly over model=3 devices"):
        ShardedLlama(Llama(TINY_GQA, rngs=nnx.Rngs(0)), mesh)


def _tiny_moe():
    import dataclasses

    from models.layers.moe import RouterConfig

    return dataclasses.replace(TINY_GQA, router=RouterConfig(num_experts=8, top_k=2, norm_topk_prob=True),
                               moe_mlp_dim=16)


def test_experts_split_whole_over_the_model_axis_and_an_uneven_split_is_named():
    """A mixture of experts splits by expert (expert parallelism), not by the
    dense MLP's columns, which would cut each expert's width: each device
    holds E / M whole experts and the whole router."""
    model = Llama(_tiny_moe(), rngs=nnx.Rngs(0))
    sharded = ShardedLlama(model, make_mesh(1, 4, devices=jax.devices()[:4]))
    w_gate = sharded.params["blocks"]["mlp"]["w_gate"][...]  # [L, E, D, I]
    assert w_gate.shape == (2, 8, 32, 16) and w_gate.addressable_shards[0].data.shape == (2, 2, 32, 16)
    assert sharded.params["blocks"]["mlp"]["router"][...].addressable_shards[0].data.shape == (2, 8, 32)
    assert sharded.local_config.expert_shards == 4
    with pytest.raises(ValueError, match="num_experts=8 does not split evenly over model=3 devices"):
        ShardedLlama(model, make_mesh(1, 3, devices=jax.devices()[:3]))


@pytest.fixture(scope="module")
def tiny_moe():
    model = Llama(_tiny_moe(), rngs=nnx.Rngs(3))
    prompts = make_prompts(8, TINY_GQA.vocab_size, seed=1)
    return model, prompts, decode_unsharded(model, prompts, steps=4)


@pytest.mark.parametrize("data, model_size", MESHES)
def test_experts_split_over_the_mesh_decode_as_unsharded(tiny_moe, data, model_size):
    """Qwen3-MoE's block with 8 experts over 1, 2, 4 or 8 devices of the
    model axis (and the data axis beside it): the unsharded tokens and
    logits."""
    model, prompts, (want_tokens, want_logits) = tiny_moe
    tokens, logits = decode_sharded(model, make_mesh(data, model_size), prompts, steps=4)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logits, want_logits, atol=TINY_ATOL, rtol=0)


def test_an_engine_serves_a_mixture_of_experts_over_the_mesh(tiny_moe):
    """The engine's model for one data shard (ShardedRaggedModel) with the
    experts split over 4 devices gives one device's greedy outputs."""
    model, prompts, _ = tiny_moe
    config = EngineConfig(max_seqs=4, max_seq_len=32, max_num_batched_tokens=16)
    requests = [Request(request_id=i, prompt_ids=p, max_new_tokens=5) for i, p in enumerate(prompts)]
    one = Engine(RaggedModel(model), model.config.make_kv_pool(40, 4), config)
    want = {o.request_id: o.output_ids for o in one.run(requests)}
    sharded = ShardedRaggedModel(model, make_mesh(1, 4, devices=jax.devices()[:4]))
    got = {o.request_id: o.output_ids for o in Engine(sharded, sharded.make_kv_pool(40, 4), config).run(requests)}
    assert got == want


def test_weights_and_pool_are_split_over_the_mesh():
    """Each device holds its share: query/KV heads and MLP columns over the
    model axis, pages over the data axis."""
    mesh = make_mesh(2, 4)
    sharded = ShardedLlama(Llama(TINY_GQA, rngs=nnx.Rngs(0)), mesh)
    lay = sharded.layout  # 3 KV heads on 4 devices: replicated, 3 query slots each
    assert (lay.kv_heads_per_device, lay.q_heads_per_device) == (1, 3)
    wq = sharded.params["blocks"]["attn"]["wq"][...]
    assert wq.shape == (2, 32, 12, 8) and wq.addressable_shards[0].data.shape == (2, 32, 3, 8)
    w_up = sharded.params["blocks"]["mlp"]["w_up"][...]
    assert w_up.addressable_shards[0].data.shape == (2, 32, 16)
    kv = sharded.make_kv_pool(5, 4)
    assert kv.k.shape == (2, 4, 10, 4, 8) and kv.k.sharding.spec == KV_SPEC
    assert kv.k.addressable_shards[0].data.shape == (2, 1, 5, 4, 8)


# --- decoding: sharded equals unsharded ------------------------------------


@pytest.fixture(scope="module")
def tiny():
    model = Llama(TINY_GQA, rngs=nnx.Rngs(0))
    prompts = make_prompts(8, TINY_GQA.vocab_size, seed=0)
    return model, prompts, decode_unsharded(model, prompts, steps=4)


@pytest.mark.parametrize("data, model_size", MESHES)
def test_tiny_sharded_decode_equals_unsharded(tiny, data, model_size):
    model, prompts, (want_tokens, want_logits) = tiny
    tokens, logits = decode_sharded(model, make_mesh(data, model_size), prompts, steps=4)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logits, want_logits, atol=TINY_ATOL, rtol=0)


def test_a_shard_never_reads_another_shards_pages(tiny):
    """(2, 4) mesh: after the prefill, every page of data shard 1 (its null
    page too) becomes NaN. Shard 0's rows decode exactly as before, bit for
    bit, and stay finite; shard 1's rows do read the poison (NaN)."""
    model, prompts, _ = tiny
    mesh = make_mesh(2, 4)
    clean_tokens, clean_logits = decode_sharded(model, mesh, prompts, steps=4)

    def poison(kv, sharded):
        half = kv.k.shape[2] // 2  # data shard 1 owns global pages [half, 2 * half)
        nan = lambda x: jax.device_put(x.at[:, :, half:].set(jnp.nan), x.sharding)  # noqa: E731
        return type(kv)(k=nan(kv.k), v=nan(kv.v))

    tokens, logits = decode_sharded(model, mesh, prompts, steps=4, poison=poison)
    np.testing.assert_array_equal(logits[:4], clean_logits[:4])
    np.testing.assert_array_equal(tokens[:4], clean_tokens[:4])
    assert np.all(np.isfinite(logits[:4]))
    assert np.all(np.isnan(logits[4:, 1:]))


def test_page_ids_and_lengths_are_checked_per_shard():
    """A block table naming a page past its shard's range, or lengths past a
    row's table, fail on the host before anything runs (inside the program
    they would be clamped, within the shard, to a wrong answer)."""
    sharded = ShardedLlama(Llama(TINY_GQA, rngs=nnx.Rngs(0)), make_mesh(2, 4))
    kv = sharded.make_kv_pool(5, 4)  # 5 pages per shard: local ids 0..4
    tokens, lens = np.zeros((2, 3), np.int32), np.array([3, 3], np.int32)
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 5.*local to each data shard: \[0, 5\)"):
        sharded.forward(tokens, kv, np.array([[1, 2], [5, 1]], np.int32), lens, lens)
    with pytest.raises(ValueError, match="kv_lens must be in"):
        sharded.forward(tokens, kv, np.array([[1, 2], [3, 1]], np.int32), np.array([3, 9], np.int32), lens)
    with pytest.raises(ValueError, match="split evenly over data=2"):
        sharded.forward(np.zeros((3, 3), np.int32), kv, np.ones((3, 2), np.int32), np.ones(3, np.int32),
                        np.ones(3, np.int32))


@pytest.fixture(scope="module")
def smollm2():
    from models.smollm2 import load_smollm2

    model, tok = load_smollm2()
    texts = ["What is the capital of France?", "def fibonacci(n):", "The quick brown fox", "Paged attention",
             "Bonjour, je m'appelle", "1, 2, 3, 5, 8,", "import jax", "Once upon a time"]
    prompts = [tok.encode(tok.apply_chat_template(t)) if i % 2 else tok.encode(t) for i, t in enumerate(texts)]
    return model, prompts, decode_unsharded(model, prompts, steps=3, page_size=16)


@pytest.mark.slow  # ~70 s; TINY_GQA has SmolLM2's 9 / 3 heads and runs every mesh by default
@pytest.mark.parametrize("data, model_size", MESHES)
def test_smollm2_sharded_decode_equals_unsharded(smollm2, data, model_size):
    """SmolLM2 (9 query heads, 3 KV heads: replicated and padded on model
    axes of 2, 4 and 8): greedy tokens identical, logits within f32
    tolerance, over a prefill of 8 ragged prompts and 3 decode steps."""
    model, prompts, (want_tokens, want_logits) = smollm2
    tokens, logits = decode_sharded(model, make_mesh(data, model_size), prompts, steps=3, page_size=16)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logits, want_logits, atol=SMOLLM2_ATOL, rtol=0)


# --- the engine over the data axis ------------------------------------------


@pytest.fixture(scope="module")
def sharegpt_requests():
    from experiments.lib.sharegpt import load_conversations, sample_requests
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    conversations, _ = load_conversations()
    sampled = sample_requests(conversations[:400], tok.encode_batch, 24, seed=0)
    # Prompts cut to their first 24 tokens (the test is about placement and
    # pages, not long prompts); outputs of 1 to 24 tokens, so sequences grow
    # past what admission planned and the small pools preempt.
    return [Request(request_id=i, prompt_ids=tok.encode(r.prompt)[:24], max_new_tokens=1 + (i * 7) % 24)
            for i, r in enumerate(sampled)]


@pytest.mark.slow  # ~45 s; the two-process test below serves over a mesh in the default run
def test_engine_on_a_2x4_mesh_serves_sharegpt_like_one_device(sharegpt_requests):
    """24 ShareGPT requests through one engine per data shard (each tensor
    parallel over 4 devices, its own pool of 16 usable pages: one 64-token
    sequence, so the shards preempt) give the greedy outputs of one engine
    on one device; each shard's page state holds only its own page ids, and
    every page ends free."""
    config = LlamaConfig(vocab_size=49152, model_dim=32, mlp_dim=64, num_layers=2, num_q_heads=9,
                         num_kv_heads=3, head_dim=8)
    model = Llama(config, rngs=nnx.Rngs(1))
    engine_config = EngineConfig(max_seqs=4, max_seq_len=64, max_num_batched_tokens=32,
                                 enable_prefix_caching=False)
    one = Engine(RaggedModel(model), config.make_kv_pool(17, 4), engine_config, check_page_state=True)
    want = {o.request_id: o.output_ids for o in one.run(sharegpt_requests)}

    dp = make_data_parallel_engine(model, make_mesh(2, 4), engine_config, pages_per_shard=17, page_size=4,
                                   check_page_state=True)
    got = {o.request_id: o.output_ids for o in dp.run(sharegpt_requests)}
    assert got == want
    shards = [list(dp.placement.values()).count(d) for d in range(2)]
    assert min(shards) >= 8, shards  # placement spreads the load
    assert all(e.stats.preemptions > 0 for e in dp.engines)  # each shard preempted among its own
    for engine in dp.engines:
        assert engine.kv.k.shape[2] == 17  # its own 17 pages, no other shard's
        assert int(jnp.max(engine.state.block_tables)) < 17
        assert engine.accounting() == {"free": 16, "cached": 0, "used": 0, "total": 16}
    merged = merged_stats(dp)  # one set of statistics for the mesh
    assert merged.generated_tokens == sum(len(o) for o in got.values())
    assert merged.preemptions == sum(e.stats.preemptions for e in dp.engines)
    assert merged.host_s >= 0 and 0 <= merged.kv_token_fraction <= 1
    assert merged.mean_concurrency == pytest.approx(sum(e.stats.mean_concurrency for e in dp.engines))


def test_data_parallel_engine_rejects_bad_input():
    with pytest.raises(ValueError, match="with at least one engine"):
        DataParallelEngine([])
    with pytest.raises(ValueError, match="with at least one engine"):
        DataParallelEngine([None, None])
    mesh = make_mesh(2, 4)
    with pytest.raises(ValueError, match="data axis must be 1, got data=2"):
        ShardedRaggedModel(Llama(TINY_GQA, rngs=nnx.Rngs(0)), mesh)
    dp = make_data_parallel_engine(Llama(TINY_GQA, rngs=nnx.Rngs(0)), make_mesh(8, 1),
                                   EngineConfig(max_seqs=2, max_seq_len=16, max_num_batched_tokens=16),
                                   pages_per_shard=5, page_size=4)
    requests = [Request(request_id=0, prompt_ids=[1, 2], max_new_tokens=2),
                Request(request_id=0, prompt_ids=[3], max_new_tokens=2)]
    with pytest.raises(ValueError, match="request_id 0 appears twice"):
        dp.run(requests)
    assert dp.placement == {} and not dp.has_unfinished()
    with pytest.raises(ValueError, match="max_new_tokens"):
        dp.run([Request(request_id=1, prompt_ids=[1], max_new_tokens=0)])
    assert dp.placement == {}
    with pytest.raises(ValueError, match="request_id 7 was never added"):
        dp.abort(7)


# --- two processes -----------------------------------------------------------


def test_init_distributed_refuses_half_an_environment(monkeypatch):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
    with pytest.raises(ValueError, match="set both JAX_NUM_PROCESSES and JAX_PROCESS_ID"):
        init_distributed()
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match="0 <= id < count"):
        init_distributed()


@pytest.mark.slow  # ~95 s on 2 cores (two processes compiling); the tiny meshes cover sharding by default
def test_two_processes_on_localhost_agree_with_one():
    """``jax.distributed`` over two local processes (4 faked CPU devices
    each, gloo collectives): a (2, 4) mesh with one data shard per process,
    and a (1, 8) mesh whose model-axis all-reduces cross processes, decode
    exactly as one device does; the two processes serve 12 requests
    together, one engine each, with one device's greedy outputs. Bounded in
    time; a free port; both processes are ended whatever happens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = pathlib.Path(__file__).with_name("distributed_worker.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "result.json"
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_NUM_PROCESSES="2",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PLATFORMS="cpu")
        procs = [subprocess.Popen([sys.executable, str(worker), str(out)], env={**env, "JAX_PROCESS_ID": str(i)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
        try:
            logs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert [p.returncode for p in procs] == [0, 0], "\n\n".join(log[-3000:] for log in logs)
        import json

        result = json.loads(out.read_text())
    assert (result["process_count"], result["devices"], result["local_devices"]) == (2, 8, 4)
    for mesh in ("2x4", "1x8"):
        assert result[mesh]["tokens_equal"], result
        assert result[mesh]["max_logit_diff"] < TINY_ATOL, result
    engine = result["engine"]  # process 0's view: its own shard's engine, everyone's outputs
    assert engine["local_engines"] == 1 and 0 < engine["local_outputs"] < engine["requests"], result
    assert engine["same_outputs"] == engine["requests"] == 12, result
