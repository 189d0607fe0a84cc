"""DeepSeek-V3 at its published shapes (models.deepseek.presets) and the
latent-versus-GQA capacity script (experiments.memory.mla_capacity)."""

import dataclasses

import jax.numpy as jnp
import pytest

from models.deepseek.presets import PRESETS, get_preset, narrow, num_params, random_deepseek, with_layers
from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.memory import PRESETS as KV_PRESETS
from paged_jax.memory import dtype_bytes


def test_deepseek_v3_preset_is_the_published_model():
    c = get_preset("deepseek-v3")
    assert (c.num_layers, c.model_dim, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
            c.qk_rope_head_dim, c.v_head_dim, c.vocab_size) == (61, 7168, 128, 1536, 512, 128, 64, 128, 129280)
    assert (c.num_dense_layers, c.router.num_experts, c.router.top_k, c.router.n_group, c.router.topk_group,
            c.router.routed_scaling_factor, c.num_shared_experts, c.moe_mlp_dim) == (3, 256, 8, 8, 4, 2.5, 1, 2048)
    assert (c.rope_scaling.rope_type, c.rope_scaling.factor, c.mscale_all_dim) == ("yarn", 40.0, 1.0)
    assert num_params(c) == 671_026_419_200  # the report's 671 B (the card's 685 B adds the MTP module)
    # The KV maths' preset (paged_jax.memory) describes the same cache.
    kv = KV_PRESETS["deepseek-v3"]
    assert (kv.num_layers, kv.kv_lora_rank + kv.qk_rope_head_dim) == (c.num_layers, c.latent_dim)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_narrow_keeps_the_cache_and_a_pool_holds_the_maths_bytes(dtype):
    """Tiny widths, the same latent pool: its bytes a token are the
    published model's (paged_jax.memory), page by page."""
    c = get_preset("deepseek-v3")
    small = narrow(c)
    assert (small.num_layers, small.latent_dim, small.num_dense_layers) == (61, 576, 3)
    assert num_params(small) < 20_000_000
    model = random_deepseek(small, num_layers=4, dtype="float32")
    page_size, pages = 16, 5
    pool = model.make_kv_pool(pages, page_size, dtype=jnp.dtype(dtype))
    per_token = pool.nbytes / (pages * page_size)
    assert per_token * 61 / 4 == KV_PRESETS["deepseek-v3"].kv_bytes_per_token(dtype)
    assert per_token == 4 * 576 * dtype_bytes(dtype)


def test_random_deepseek_serves_a_request_at_few_layers():
    model = random_deepseek(narrow(PRESETS["deepseek-v3"]), num_layers=4, dtype="float32", impl="xla")
    assert (model.config.num_layers, model.config.num_dense_layers) == (4, 3)  # three dense, one MoE
    engine = Engine(model, model.make_kv_pool(8, 4), EngineConfig(max_seqs=2, max_seq_len=16,
                                                                   max_num_batched_tokens=8))
    out = engine.run([Request(request_id=0, prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=3, ignore_eos=True)])
    assert len(out[0].outputs[0].output_ids) == 3


@pytest.mark.parametrize("call, message", [
    (lambda: get_preset("deepseek-v4"), "unknown DeepSeek preset 'deepseek-v4'; expected one of"),
    (lambda: with_layers(PRESETS["deepseek-v3"], 0), "num_layers"),
    (lambda: with_layers(PRESETS["deepseek-v3"], 62), "num_layers"),
    (lambda: narrow(PRESETS["deepseek-v3"], num_experts=1), "num_experts"),
    (lambda: random_deepseek(narrow(PRESETS["deepseek-v3"]), num_layers=1, dtype="int8"), "dtype must be one of"),
    (lambda: random_deepseek(narrow(PRESETS["deepseek-v3"]), num_layers=1, seed=-1), "seed"),
])
def test_bad_preset_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_presets_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["deepseek-v3"].num_layers = 1


@pytest.mark.slow  # ~40-60 s: two decoders of 61 and 126 layers compiled and served
def test_mla_capacity_script_counts_sequences_at_equal_memory(tmp_path):
    """experiments.memory.mla_capacity at toy size: the latent pool holds the
    bytes of the GQA pool's sequences, and its peak concurrency is what the
    maths counts."""
    from experiments.memory import mla_capacity

    out = mla_capacity.main(["--context", "32", "--new-tokens", "7", "--page-size", "8", "--gqa-sequences", "1",
                             "--gqa-requests", "2", "--mla-requests", "10", "--budget-tokens", "256",
                             "--out", str(tmp_path)])
    gqa, mla = out["rows"]
    assert out["maths"] == pytest.approx((126 * 2 * 8 * 128) / (61 * 576))
    assert gqa["peak_running"] == gqa["maths_sequences"] == 1
    assert mla["maths_sequences"] == 7 and mla["peak_running"] == 7  # floor(29 pages / 4)
    assert gqa["preemptions"] == mla["preemptions"] == 0
    assert mla["kv_bytes"] <= gqa["kv_bytes"] + mla["page_bytes"]  # the null page each
    assert "## The maths at full size" in (tmp_path / "mla_capacity.md").read_text()
