"""Random-weight presets of real architectures, and the packaged request lengths."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.lib import provenance, serving, sharegpt
from experiments.serving import serve_sharegpt
from models.llama import Llama, LlamaConfig, forward_dense
from models.presets import PRESETS, PUBLISHED_CONFIGS, bytes_to_build, random_model
from models.layers.rope import RopeScaling

PUBLISHED_PARAMS = {
    # Parameter counts of the published checkpoints (Hugging Face model cards / safetensors index totals).
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "smollm2-135m": 134_515_008,
    # The text decoder of google/gemma-3-12b-it: 262,208 * 3,840 = 1,006,878,720 embedding (tied), plus the
    # final norm's 3,840, plus 10,759,151,616 in the layers: the Gemma 3 report's "10,759M non-embedding".
    "gemma-3-12b": 1_006_878_720 + 3_840 + 10_759_151_616,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_shapes_hold_the_published_parameter_count(name):
    model = nnx.eval_shape(lambda: random_model(name))  # abstract: no 16 GB of weights
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(int(np.prod(x.shape)) for x in leaves) == PUBLISHED_PARAMS[name] == PRESETS[name].num_params
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}


def test_published_configs_map_to_the_family_fields():
    """The presets built from published config.json values carry each family's
    options (models.loading.hf_config.config_from_hf, the checkpoint loader's mapping)."""
    assert set(PUBLISHED_CONFIGS) <= set(PRESETS)
    llama = PRESETS["llama-3.1-8b"]
    assert llama.rope_theta == 500000.0 and llama.max_seq_len == 131072 and not llama.tie_embeddings
    assert llama.rope_scaling == RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192,
                                             low_freq_factor=1.0, high_freq_factor=4.0)
    assert dataclasses.replace(llama, rope_scaling=None, max_seq_len=8192) == PRESETS["llama-3-8b"]
    qwen = PRESETS["qwen3-8b"]
    assert (qwen.num_layers, qwen.num_q_heads, qwen.num_kv_heads, qwen.head_dim, qwen.model_dim, qwen.mlp_dim,
            qwen.vocab_size) == (36, 32, 8, 128, 4096, 12288, 151936)
    assert qwen.qk_norm == "head" and qwen.rope_theta == 1e6 and qwen.sliding_window is None and not qwen.qkv_bias
    gemma = PRESETS["gemma-3-12b"]
    assert (gemma.num_layers, gemma.model_dim, gemma.mlp_dim, gemma.num_q_heads, gemma.num_kv_heads, gemma.head_dim,
            gemma.vocab_size) == (48, 3840, 15360, 16, 8, 256, 262208)
    # Five sliding layers, then a global one: layers 5, 11, ..., 47 are global.
    assert [i for i, sliding in enumerate(gemma.sliding_layers) if not sliding] == list(range(5, 48, 6))
    assert gemma.sliding_window == 1024 and gemma.local_rope_theta == 10000.0 and gemma.rope_theta == 1e6
    assert gemma.rope_scaling == RopeScaling(rope_type="linear", factor=8.0)
    assert gemma.query_scale == 256 ** -0.5 and gemma.embed_scale == math.sqrt(3840)
    assert gemma.final_soft_cap is None and gemma.attn_soft_cap is None and gemma.tie_embeddings
    assert (gemma.qk_norm, gemma.norm_plus_one, gemma.norm_placement, gemma.mlp_activation) == (
        "head", True, "pre_post", "gelu_tanh")


def test_bytes_to_build_gemma_3_12b():
    # bf16 weights: 11,766,034,176 * 2 = 23,532,068,352 B; the largest stacked tensor is one MLP
    # projection, 48 * 3,840 * 15,360 = 2,831,155,200 elements, drawn in f32: 11,324,620,800 B.
    assert bytes_to_build("gemma-3-12b", jnp.bfloat16) == 23_532_068_352 + 11_324_620_800
    with pytest.raises(ValueError, match="unknown preset 'gemma-3-12B'"):
        bytes_to_build("gemma-3-12B", jnp.bfloat16)


def _small_gemma_3(monkeypatch) -> LlamaConfig:
    """The Gemma-3-12B preset cut to 6 layers (its 5 sliding : 1 global) of
    width 16; one width for all keeps the eager draws' compilations few."""
    small = dataclasses.replace(PRESETS["gemma-3-12b"], vocab_size=16, model_dim=16, mlp_dim=16, num_layers=6,
                                num_q_heads=1, num_kv_heads=1, head_dim=16, sliding_window=4,
                                layer_types=PRESETS["gemma-3-12b"].layer_types[:6])
    monkeypatch.setitem(PRESETS, "gemma-3-small", small)
    return small


def test_scaled_down_gemma_3_preset_builds(monkeypatch):
    small = _small_gemma_3(monkeypatch)
    model = random_model("gemma-3-small", param_dtype=jnp.float32)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(int(np.prod(x.shape)) for x in leaves) == small.num_params
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.float32)}


@pytest.mark.slow  # compiles the mixed sliding/global layer scan: about 40 s on 2 busy cores
def test_scaled_down_gemma_3_preset_runs(monkeypatch):
    _small_gemma_3(monkeypatch)
    model = random_model("gemma-3-small", param_dtype=jnp.float32)
    logits = forward_dense(model, jnp.arange(10, dtype=jnp.int32)[None] % 16)
    assert logits.shape == (1, 10, 16) and bool(jnp.isfinite(logits).all())


def test_serving_lays_a_hybrid_budget_out_by_group_and_orca_keeps_one_table(monkeypatch):
    """make_engine on Gemma 3's layer pattern: paging gets a table per layer
    group in pages of one layer; a reservation policy (the contiguous
    baseline) keeps every layer's pages in one table, as Orca does, where
    a grouped pool would be refused."""
    _small_gemma_3(monkeypatch)
    model = random_model("gemma-3-small", param_dtype=jnp.float32)
    kw = dict(kv_tokens=256, page_size=16, max_seqs=2, max_seq_len=64)
    paged, orca = serving.make_engine(model, **kw), serving.make_engine(model, reservation="max", **kw)
    assert paged.kv_manager.groups.num_groups == 6 and paged.kv.num_layers == 1 and paged.kv.num_pages == 16 * 6 + 1
    assert orca.kv_manager.groups.num_groups == 1 and orca.kv.num_layers == 6 and orca.kv.num_pages == 17


@pytest.mark.slow  # 20 s on 2 quiet cores; default twin: the make_engine layouts test above
def test_serve_cli_serves_a_hybrid_preset_in_both_modes(monkeypatch, tmp_path):
    # the packaged requests' chat template needs token ids up to 34,519
    monkeypatch.setitem(PRESETS, "gemma-3-small-vocab", dataclasses.replace(_small_gemma_3(monkeypatch),
                                                                            vocab_size=35000))
    results = serve_sharegpt.main(["--model", "gemma-3-small-vocab", "--num-requests", "2", "--max-output-len", "2",
                                   "--kv-budget-tokens", "2048", "--no-compile-cache", "--out", str(tmp_path)])
    assert [r.mode for r in results] == ["paged", "contiguous"]


def test_random_model_refuses_bad_input():
    with pytest.raises(ValueError, match=r"unknown preset 'llama-8b'; expected one of \["):
        random_model("llama-8b")
    with pytest.raises(ValueError, match="param_dtype must be a float dtype, got int8"):
        random_model("smollm2-135m", param_dtype=jnp.int8)


def test_packaged_requests_keep_the_lengths_and_the_template():
    data = json.loads(sharegpt.PACKAGED_REQUESTS.read_text())
    assert len(data["requests"]) == sharegpt.PACKAGED_LIMIT
    prefix, suffix = data["template_prefix_ids"], data["template_suffix_ids"]
    requests = sharegpt.packaged_requests(50, 64, vocab_size=49152)
    for r, (prompt_len, output_len) in zip(requests, data["requests"]):
        assert len(r.prompt_ids) == prompt_len and r.max_new_tokens == min(output_len, 64) and r.ignore_eos
        assert r.prompt_ids[:len(prefix)] == prefix and r.prompt_ids[-len(suffix):] == suffix
        assert prompt_len + output_len <= sharegpt.MAX_SEQ_LEN
    again = sharegpt.packaged_requests(50, 64, vocab_size=49152)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in requests]  # seeded
    assert all(0 <= t < 49152 for r in requests for t in r.prompt_ids)
    with pytest.raises(ValueError, match=r"vocab_size=100 cannot hold the chat template's token ids"):
        sharegpt.packaged_requests(5, 8, vocab_size=100)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        sharegpt.packaged_requests(5, 8, vocab_size=49152, seed=-1)
    with pytest.raises(ValueError, match="num_requests=1001 exceeds the 1000 packaged requests"):
        sharegpt.packaged_requests(1001, 8, vocab_size=49152)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1, got vocab_size=0"):
        sharegpt.packaged_requests(5, 8, vocab_size=0)


def test_packaged_lengths_are_what_build_requests_samples():
    """Independent of the file: tokenize and sample again with the SmolLM2
    tokenizer; the first requests' lengths are the file's."""
    from models.tokenizer import load_tokenizer

    requests, _, _ = sharegpt.build_requests(load_tokenizer(), 20, max_output_len=10**9)
    data = json.loads(sharegpt.PACKAGED_REQUESTS.read_text())
    assert [[len(r.prompt_ids), r.max_new_tokens] for r in requests] == data["requests"][:20]


@pytest.mark.slow  # 60-80 s: the whole CLI at a 35k vocabulary in bf16; tests/test_hf_loader.py and test_fp8.py run the CLI
def test_serve_cli_with_a_preset(monkeypatch, tmp_path):
    """The whole CLI on a (tiny, test-only) preset: packaged requests, no
    tokenizer, bf16 weights and K/V, both modes, table written."""
    monkeypatch.setitem(PRESETS, "tiny-test", LlamaConfig(
        vocab_size=35000, model_dim=32, mlp_dim=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8))
    results = serve_sharegpt.main(["--model", "tiny-test", "--num-requests", "3", "--max-output-len", "2",
                                   "--dtype", "bfloat16", "--kv-dtype", "bfloat16", "--kv-budget-tokens", "4096",
                                   "--no-compile-cache", "--out", str(tmp_path)])
    assert [r.mode for r in results] == ["paged", "contiguous"]
    assert all(r.kv_dtype == r.weights_dtype == "bfloat16" and r.generated_tokens == results[0].generated_tokens
               for r in results)
    for r in results:  # the parts of the engine's time are disjoint: compilation is in none of them
        assert r.model_s + r.host_s <= r.wall_s + 0.02, r
    text = (tmp_path / "serve_sharegpt.md").read_text()
    prov, rows = provenance.read_csv(tmp_path / "serve_sharegpt.csv")
    assert rows[0]["weights_dtype"] == "bfloat16" and prov["seeds"] == "random_weights=0, prompt_ids=0"
    assert "tiny-test (random weights)" in text and "weights bfloat16, K/V bfloat16" in text
    with pytest.raises(SystemExit):
        serve_sharegpt.parse_args(["--model", "tiny-test", "--num-requests", "1001", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        serve_sharegpt.parse_args(["--kv-dtype", "float16", "--out", str(tmp_path)])


def test_pool_pages_add_the_null_page_to_whole_pages():
    # 8,192 tokens in pages of 16: 512 pages, and the null page; 100 tokens fill 6 whole pages of 16.
    assert serving.pool_pages(8192, 16) == 513 and serving.pool_pages(100, 16) == 7
    with pytest.raises(ValueError, match="kv_tokens must hold at least one page"):
        serving.pool_pages(15, 16)
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        serving.pool_pages(64, 0)
    config = LlamaConfig(vocab_size=64, model_dim=16, mlp_dim=32, num_layers=1, num_q_heads=2, num_kv_heads=1,
                         head_dim=8)
    engine = serving.make_engine(Llama(config, rngs=nnx.Rngs(0)), kv_tokens=100, page_size=16, max_seqs=4,
                                 max_seq_len=64)
    assert engine.kv.num_pages == 7 and engine.kv.page_size == 16
    assert engine.config.max_num_batched_tokens == 256 and engine.config.max_seq_len == 64
    for bad in (0, -5, True, 2.5):  # refused, not raised silently to max_seqs
        with pytest.raises(ValueError, match="max_batched_tokens must be an int >= 1"):
            serving.make_engine(Llama(config, rngs=nnx.Rngs(0)), kv_tokens=100, page_size=16, max_seqs=4,
                                max_seq_len=64, max_batched_tokens=bad)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_agree_with_the_memory_tables(name):
    """The memory tables (paged_jax.memory) carry the same published shapes."""
    from paged_jax import memory

    config, table = PRESETS[name], memory.PRESETS[name]
    assert (config.num_layers, config.num_kv_heads, config.head_dim, config.num_params) == (
        table.num_layers, table.num_kv_heads, table.head_dim, table.num_params)
    assert config.kv_bytes_per_token(jnp.bfloat16) == table.kv_bytes_per_token("bfloat16")
    assert (config.sliding_window, sum(config.sliding_layers)) == (table.sliding_window, table.num_sliding_layers)
