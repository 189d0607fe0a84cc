"""Random-weight presets of real architectures, and the packaged request lengths."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import provenance, serve_sharegpt, serving, sharegpt
from models.llama import Llama, LlamaConfig
from models.presets import PRESETS, random_model

PUBLISHED_PARAMS = {
    # Parameter counts of the published checkpoints (Hugging Face model cards / safetensors index totals).
    "llama-3-8b": 8_030_261_248,
    "qwen2.5-7b": 7_615_616_512,
    "smollm2-135m": 134_515_008,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_shapes_hold_the_published_parameter_count(name):
    model = nnx.eval_shape(lambda: random_model(name))  # abstract: no 16 GB of weights
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(int(np.prod(x.shape)) for x in leaves) == PUBLISHED_PARAMS[name] == PRESETS[name].num_params
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}


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
