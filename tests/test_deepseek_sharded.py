"""The DeepSeek-V3 decoder over a mesh (models.deepseek.sharded): query heads,
dense and shared-expert columns and routed experts split over the model
axis, the latent pool replicated, on faked CPU devices (tests/conftest.py
fakes 8): flat batches give the unsharded logits, and an engine gives the
unsharded greedy outputs."""

import jax
import numpy as np
import pytest

from models.deepseek.config import config_from_hf
from models.deepseek.model import DeepseekModel, init_params
from models.deepseek.sharded import ShardedDeepseekModel
from paged_jax.distributed.sharding import make_mesh
from paged_jax.engine.core import Engine, EngineConfig, Request
from tests.decoder_helpers import mixed_calls
from tests.deepseek_helpers import CHECKPOINTS, DIMS, PROMPTS, SCHEDULE


def mesh(data: int, model: int):
    """A (data, model) mesh over the first ``data * model`` faked devices."""
    return make_mesh(data=data, model=model, devices=jax.devices()[:data * model])


@pytest.fixture(scope="module")
def model():
    """A random DeepSeek-V3 decoder of tests/test_deepseek.py's MoE shape (4 heads, a dense layer, then MoE
    layers of 8 experts with a shared expert; query LoRA, YaRN), at unit-ish scale."""
    config = config_from_hf({**DIMS, **CHECKPOINTS["moe"], "model_type": "deepseek_v3"})
    params = init_params(config, jax.random.key(3), std=0.3)
    params["moe"]["bias"] = 0.3 * jax.random.normal(jax.random.key(4), params["moe"]["bias"].shape)
    return DeepseekModel(config, params)


@pytest.mark.parametrize("model_size", [4])
def test_flat_batches_over_the_mesh_equal_one_device(model, model_size):
    """Prefill chunks and decode tokens in flat batches (an expanded chunk
    among them) on a NaN-filled replicated pool: each chunk's last logits
    equal the unsharded model's."""
    model = DeepseekModel(model.config, model.params, expanded_min_tokens=6)
    want = mixed_calls(model, SCHEDULE[:2])
    sharded = ShardedDeepseekModel(model, mesh(1, model_size))
    got = mixed_calls(sharded, SCHEDULE[:2])
    for call, (g, w) in enumerate(zip(got, want)):
        for row in w:
            np.testing.assert_allclose(g[row], w[row], atol=2e-5, rtol=1e-5, err_msg=f"call {call} row {row}")


def test_an_engine_over_four_devices_gives_one_devices_greedy_outputs(model):
    requests = lambda: [Request(request_id=i, prompt_ids=p, max_new_tokens=6, ignore_eos=True)  # noqa: E731
                        for i, p in enumerate(PROMPTS)]
    config = EngineConfig(max_seqs=4, max_seq_len=48, max_num_batched_tokens=16, enable_prefix_caching=True)
    want = Engine(model, model.make_kv_pool(64, 4), config).run(requests())
    sharded = ShardedDeepseekModel(model, mesh(1, 4))
    pool = sharded.make_kv_pool(64, 4)
    assert pool.k.sharding.is_fully_replicated and sharded.kv_bytes_per_device(64, 4) == 64 * 4 * 3 * 40 * 4
    got = Engine(sharded, pool, config).run(requests())
    assert [o.outputs[0].output_ids for o in got] == [o.outputs[0].output_ids for o in want]


def test_a_pool_off_the_mesh_is_refused_before_any_step(model):
    sharded = ShardedDeepseekModel(model, mesh(1, 4))
    elsewhere = jax.device_put(model.make_kv_pool(16, 4), jax.devices()[5])
    with pytest.raises(ValueError, match=r"kv.k lies on devices \[5\], outside the mesh's \[0, 1, 2, 3\]"):
        Engine(sharded, elsewhere, EngineConfig(max_seqs=2, max_seq_len=32, max_num_batched_tokens=16))
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        sharded.kv_bytes_per_device(16, "x")


def test_what_does_not_split_is_named(model):
    mesh3 = mesh(1, 3)
    with pytest.raises(ValueError, match="num_heads=4 does not split evenly over model=3 devices"):
        ShardedDeepseekModel(model, mesh3)
    with pytest.raises(ValueError, match="data axis must be 1, got data=2"):
        ShardedDeepseekModel(model, mesh(2, 2))
    with pytest.raises(ValueError, match="model must be a models.deepseek.model.DeepseekModel"):
        ShardedDeepseekModel(object(), mesh3)
