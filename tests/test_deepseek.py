"""The DeepSeek-V3 decoder (models.deepseek) against transformers.

Two tiny random checkpoints written by ``transformers.DeepseekV3ForCausalLM``
(no download): one all dense (``first_k_dense_replace`` >= layers) with a
full query projection (DeepSeek-V2-Lite's attention), default RoPE and
``rope_interleave`` off; one with a query LoRA, a dense first layer then
two mixture-of-experts layers (sigmoid routing with a random correction
bias, 4 groups of which 2 are kept, top-2 of 8 experts, a shared expert,
``routed_scaling_factor``), YaRN RoPE with mscale and interleaved RoPE dims;
and one written by ``transformers.DeepseekV2ForCausalLM`` (softmax routing,
``group_limited_greedy``, unnormalized weights, two shared experts, RoPE
on complex pairs).
Weights are random at unit-ish scale, norms included, so a mapping error
cannot hide behind ones. transformers expands the latent to per-head K/V;
ours attends in the absorbed form over latent pages: the oracle computes
the other formulation, not a copy of ours.

Checked: logits through flat mixed batches (prefill chunks beside decode
tokens) on a latent pool full of NaN, at every chunk's last token, within
``LOGIT_ATOL`` (f32 on both sides, matmul precision "highest"); greedy
continuations through the serving engine, with prefix caching and (``-m
slow``) with recompute preemption, equal to ``generate(do_sample=False)``; the pool's
bytes per token equal the MLA maths; bad configs refused by name.
"""

import json  # noqa: I001  (family_helpers before torch: it sets HF_HUB_OFFLINE before transformers loads)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tests.family_helpers  # noqa: F401

import torch

from models.deepseek.config import config_from_hf
from models.deepseek.loader import load_hf_deepseek
from models.deepseek.model import DeepseekModel, init_params
from models.llm import LLM
from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.memory import ModelPreset
from paged_jax.paging.kv_cache import init_kv_pool
from paged_jax.tiers.connector import KVTransferConfig
from tests.decoder_helpers import mixed_calls
from tests.deepseek_helpers import (
    CHECKPOINTS,
    DIMS,
    NEW_TOKENS,
    PROMPTS,
    SCHEDULE,
    check_schedule,
    write_checkpoint,
)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """(name, folder, the transformers model, its logits per prompt f32[n, V])."""
    return write_checkpoint(request.param, tmp_path_factory)


def test_the_config_reads_what_transformers_computes(checkpoint):
    name, folder, hf, _ = checkpoint
    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    assert config.latent_dim == 40 and (config.router is None) == (name == "dense")
    assert config.query_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    if name == "moe":
        assert config.num_dense_layers == 1 and config.router.topk_group == 2 and config.num_shared_experts == 1
    if name == "v2":
        assert (config.router.scoring, config.router.n_group, config.router.norm_topk_prob) == ("softmax", 4, False)


@pytest.mark.parametrize("expanded_min_tokens", [None, 6], ids=["absorbed", "expanded-from-6"])
def test_ragged_batches_match_transformers(checkpoint, expanded_min_tokens):
    """Three sequences through flat mixed batches on a latent pool full of
    NaN: each chunk's last logits equal transformers' at that position,
    with every row absorbed and with chunks of 6 tokens and more expanded
    (beside absorbed decode tokens in the same calls)."""
    name, folder, _, want = checkpoint
    model = load_hf_deepseek(folder)
    model = DeepseekModel(model.config, model.params, expanded_min_tokens=expanded_min_tokens)
    check_schedule(f"{name} {expanded_min_tokens}", mixed_calls(model, SCHEDULE), want)


@pytest.mark.slow  # 2 min on 2 loaded cores; the kernel's latent mode by default: tests/test_latent_attention.py
@pytest.mark.parametrize("checkpoint", ["moe"], indirect=True)
def test_the_tpu_kernels_latent_mode_serves_the_model(checkpoint):
    """The same batches with the attention on the flat TPU kernel (Pallas
    interpret mode; its latent mode: keys and values the latent pages):
    transformers' logits. (The GPU kernel's latent mode wants C and R
    powers of two >= 16, this checkpoint's R is 8: tests/test_latent_attention.py
    runs it at such sizes.)"""
    name, folder, _, want = checkpoint
    check_schedule(name, mixed_calls(load_hf_deepseek(folder, impl="pallas_tpu"), SCHEDULE), want)


@pytest.mark.parametrize("pages", [pytest.param(256, id="roomy"),
                                   pytest.param(14, id="preempting", marks=pytest.mark.slow)])
def test_greedy_continuations_through_the_engine_match_transformers(checkpoint, pages):
    """Through the serving engine (chunked prefill, page size 4, prefix
    caching, a prompt again afterwards to hit it; a pool small enough to
    preempt by recompute): the tokens of ``generate(do_sample=False)``."""
    name, folder, hf, _ = checkpoint
    model = load_hf_deepseek(folder)
    prompts = PROMPTS + [PROMPTS[0]]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    engine = Engine(model, model.make_kv_pool(pages, 4),
                    EngineConfig(max_seqs=4, max_seq_len=48, max_num_batched_tokens=16, enable_prefix_caching=True))
    requests = [Request(request_id=i, prompt_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True)
                for i, p in enumerate(prompts)]
    outs = engine.run(requests[:3]) + engine.run(requests[3:])  # the last hits the first's cached pages
    assert {o.request_id: o.outputs[0].output_ids for o in outs} == dict(enumerate(want))
    if pages == 14:
        assert engine.stats.preemptions > 0
    else:
        assert engine.stats.prefix_hit_tokens == 20  # the repeated prompt's 5 full pages


def test_llm_serves_the_folder(checkpoint):
    """``LLM`` takes a DeepSeek-V3 folder like any other (a latent pool,
    token-id prompts without a tokenizer, the config's EOS as the stop
    token); a quantized pool is refused by name."""
    _, folder, hf, _ = checkpoint
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        llm = LLM(str(folder), kv_tokens=256, page_size=4, max_seqs=2)
    assert llm.engine.kv.latent and llm.engine.kv.head_dim == 40
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                            eos_token_id=DIMS["eos_token_id"])[0, len(p):].tolist() for p in PROMPTS[:2]]
    assert [o.output_ids for o in llm.generate(PROMPTS[:2], max_tokens=6)] == want
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        int8 = LLM(str(folder), kv_tokens=256, page_size=4, max_seqs=2, kv_dtype="int8")
    assert int8.engine.kv.latent and int8.engine.kv.k.dtype == np.int8 and int8.engine.kv.k_scale is not None
    got = [o.output_ids for o in int8.generate(PROMPTS[:2], max_tokens=6)]
    assert [len(ids) for ids in got] == [6, 6]  # the tokens: test_quantized_latent_pages_match_transformers


@pytest.mark.parametrize("checkpoint", ["moe"], indirect=True)
def test_the_benchmarks_take_the_folder(checkpoint):
    """The benchmarks' preflight reads the folder's DeepSeek config (its
    latent pool's bytes a token, its weights) and their engines are built
    on a latent pool (experiments.lib.serving.make_engine, which
    bench_serving and the online figures build through)."""
    import argparse

    from experiments.lib import preflight, serving

    _, folder, _, _ = checkpoint
    config = preflight.model_config(str(folder))
    assert config.kv_bytes_per_token("float32") == 3 * 40 * 4 and config.kv_bytes_per_token("int8") == 3 * 44
    assert preflight.check_kv_budget(argparse.ArgumentParser(), "--kv-budget-tokens", 64, 4, config,
                                     kv_dtype="float32", weight_dtype="float32") == 17 * 4 * 480
    engine = serving.make_engine(load_hf_deepseek(folder), kv_tokens=64, page_size=4, max_seqs=2, max_seq_len=32)
    assert engine.kv.latent and engine.kv.num_pages == 17
    (out,) = engine.run([Request(request_id=0, prompt_ids=PROMPTS[0][:9], max_new_tokens=3, ignore_eos=True)])
    assert len(out.outputs[0].output_ids) == 3


@pytest.mark.parametrize("checkpoint", ["moe"], indirect=True)
def test_what_cannot_take_a_deepseek_model_says_where_it_goes(checkpoint, capsys):
    """serve_sharegpt (paged against a contiguous cache, which has no latent
    form) refuses the folder before loading it, naming what serves it; LLM
    refuses a DeepSeek preset's name (671B weights) with how to build one."""
    from experiments.serving import serve_sharegpt

    _, folder, _, _ = checkpoint
    with pytest.raises(SystemExit):
        serve_sharegpt.main(["--model", str(folder), "--num-requests", "2"])
    err = capsys.readouterr().err
    assert "is a DeepSeek (MLA) model" in err and "bench_serving" in err
    with pytest.raises(ValueError, match=r"DeepSeek preset \(671,026,419,200 weights.*random_deepseek"):
        LLM("deepseek-v3")


@pytest.mark.parametrize("checkpoint", ["moe"], indirect=True)  # one MoE checkpoint is enough for the server
def test_the_server_serves_the_folder(checkpoint):
    """The OpenAI server on an MLA model (a DeepSeek folder without a
    tokenizer: token-id prompts): a completion's tokens are ``generate``'s,
    and ``/metrics`` reports the latent pool."""
    import httpx

    from server import ThreadedServer, build_app

    _, folder, hf, _ = checkpoint
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        llm = LLM(str(folder), kv_tokens=256, page_size=4, max_seqs=2)
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, do_sample=False,
                           eos_token_id=DIMS["eos_token_id"])[0, len(PROMPTS[0]):].tolist()
    with ThreadedServer(build_app(llm, model_name="tiny-deepseek")) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/v1/completions", json={"model": "tiny-deepseek", "prompt": PROMPTS[0], "max_tokens": 5,
                                               "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        metrics = http.get("/metrics").text
    assert body["choices"][0]["token_ids"] == want and body["prompt_token_ids"] == PROMPTS[0]
    assert body["usage"]["completion_tokens"] == len(want)
    assert "paged_jax:" in metrics


@pytest.mark.parametrize("transport", ["host", "jax_transfer"])
def test_latent_pages_cross_between_engines(transport):
    """Prefill/decode disaggregation on an MLA model: a producer engine keeps
    the latent pages (no V), a consumer loads them over either transport;
    outputs equal one engine's."""
    config = config_from_hf({**DIMS, **CHECKPOINTS["moe"], "model_type": "deepseek_v3",
                             "moe_intermediate_size": 32})
    model = DeepseekModel(config, init_params(config, jax.random.key(1), std=0.2))

    def engine(kv_transfer=None):
        return Engine(model, model.make_kv_pool(64, 4), EngineConfig(max_seqs=2, max_seq_len=48,
                                                                     max_num_batched_tokens=32,
                                                                     kv_transfer=kv_transfer))

    def requests(max_new):
        return [Request(request_id=i, prompt_ids=p, max_new_tokens=max_new, ignore_eos=True)
                for i, p in enumerate(PROMPTS[:2])]

    want = {o.request_id: o.outputs[0].output_ids for o in engine().run(requests(NEW_TOKENS))}
    producer = engine(KVTransferConfig("producer", transport=transport))
    producer.run(requests(1))
    consumer = engine(KVTransferConfig("consumer", address=producer.kv_manager.offload.remote.address,
                                       transport=transport, timeout_s=10))
    outs = consumer.run(requests(NEW_TOKENS))
    assert {o.request_id: o.outputs[0].output_ids for o in outs} == want
    assert [o.num_remote_cached_tokens for o in outs] == [20, 16] and not consumer.kv_manager.offload.remote.refused
    producer.close()
    consumer.close()


QUANTIZED_ATOL = {"int8": 0.1, "float8_e4m3fn": 0.5}
"""Logit tolerance with quantized latent pages (one scale a token and layer)
on the dense checkpoint (logits of standard deviation about 1): measured
0.040 (int8) and 0.19 (fp8); 0.081 and 0.28 on the DeepSeek-V2 one."""


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("checkpoint", ["dense"], indirect=True)
def test_quantized_latent_pages_match_transformers(checkpoint, kv_dtype):
    """int8 / fp8 latent pages (a scale a token: 4 bytes beside the 576 of
    DeepSeek-V3's latent) through flat mixed batches: logits near
    transformers' (quantization error only), the argmax kept where
    transformers' margin is clear, and the pool's bytes a token the maths'.
    On the dense checkpoint: with experts, the perturbation can change a
    token's routing, a jump no tolerance describes (int8 moved the MoE
    checkpoint's logits by 1.5 at one position where fp8 moved them by at
    most 0.25; not traced further).
    test_latent_attention checks the quantized attention exactly."""
    name, folder, _, want = checkpoint
    model = load_hf_deepseek(folder)
    p = PROMPTS
    schedule = [[(0, p[0][:13]), (1, p[1][:6])], [(0, p[0][13:20]), (1, p[1][6:17]), (2, p[2][:22])]]
    got = mixed_calls(model, schedule, kv_dtype=jnp.dtype(kv_dtype))
    seen, worst, flips = [0, 0, 0], 0.0, []
    for call, logits in zip(schedule, got):
        for row, chunk in call:
            seen[row] += len(chunk)
            w = want[row][seen[row] - 1]
            worst = max(worst, float(np.abs(logits[row] - w).max()))
            top2 = np.sort(w)[-2:]
            if top2[1] - top2[0] > 2 * QUANTIZED_ATOL[kv_dtype] and logits[row].argmax() != w.argmax():
                flips.append((row, seen[row]))
    print(f"{name} {kv_dtype}: largest logit difference {worst:.2e}")
    assert worst <= QUANTIZED_ATOL[kv_dtype] and not flips, (worst, flips)
    pool = model.make_kv_pool(5, 4, jnp.dtype(kv_dtype))
    assert pool.nbytes == 5 * 4 * model.config.num_layers * (model.config.latent_dim + 4)


def test_a_latent_pool_holds_the_mla_bytes_per_token():
    """One token costs ``layers * (kv_lora_rank + qk_rope_head_dim) * itemsize``
    bytes in the pool, what paged_jax.memory counts for MLA."""
    config = config_from_hf({**DIMS, **CHECKPOINTS["moe"], "model_type": "deepseek_v3",
                             "moe_intermediate_size": 32})
    model = DeepseekModel(config, init_params(config, jax.random.key(0)))
    pool = model.make_kv_pool(9, 4)
    per_token = sum(x.nbytes for x in jax.tree.leaves(pool)) / (9 * 4)
    preset = ModelPreset(name="tiny-mla", num_layers=3, kv_lora_rank=32, qk_rope_head_dim=8, num_params=1,
                         source="this test")
    assert per_token == 3 * 40 * 4 == preset.kv_bytes_per_token("float32")


@pytest.mark.parametrize("base, field, value, words", [
    ("moe", "model_type", "deepseek_v4", "expected one of deepseek_v3, kimi_k2, deepseek_v2"),
    ("moe", "topk_method", "greedy", "noaux_tc"),
    ("moe", "scoring_func", "softmax", "sigmoid"),
    ("moe", "hidden_act", "gelu", "silu"),
    ("moe", "qk_rope_head_dim", 7, "even"),
    ("moe", "n_group", 3, "divisible"),
    ("moe", "kv_lora_rank", 0, "kv_lora_rank"),
    ("v2", "topk_method", "noaux_tc", "'greedy' or 'group_limited_greedy'"),
    ("v2", "scoring_func", "sigmoid", "softmax"),
    ("v2", "norm_topk_prob", True, "never normalizes"),
    ("v2", "n_group", 3, "divisible"),
    # YaRN's numbers named as given, not as the attention factor derived from them.
    ("moe", "rope_parameters", {**CHECKPOINTS["moe"]["rope_parameters"], "mscale": "x"}, "'mscale' must be a finite"),
    ("moe", "rope_parameters", {**CHECKPOINTS["moe"]["rope_parameters"], "mscale_all_dim": float("nan")},
     "'mscale_all_dim' must be a finite"),
    ("moe", "rope_parameters", {**CHECKPOINTS["moe"]["rope_parameters"], "mscale": -1}, "'mscale' must be a finite"),
])
def test_bad_configs_are_refused_by_name(base, field, value, words):
    model_type = "deepseek_v2" if base == "v2" else "deepseek_v3"
    cfg = {**DIMS, **CHECKPOINTS[base], "model_type": model_type, "moe_intermediate_size": 32, field: value}
    with pytest.raises(ValueError, match=words):
        config_from_hf(cfg, "x/config.json")


def test_a_kimi_k2_config_reads_as_deepseek_v3():
    """Kimi K2 ships ``model_type: kimi_k2`` with ``DeepseekV3ForCausalLM``'s
    architecture: the same decoder, field for field."""
    cfg = {**DIMS, **CHECKPOINTS["moe"], "moe_intermediate_size": 32}
    v3 = config_from_hf({**cfg, "model_type": "deepseek_v3"}, "x/config.json")
    assert config_from_hf({**cfg, "model_type": "kimi_k2"}, "x/config.json") == v3


def test_greedy_v2_routing_ignores_the_groups():
    """DeepSeek-V2-Lite's ``topk_method: greedy``: plain top-k over every
    expert, whatever ``n_group`` says."""
    cfg = {**DIMS, **CHECKPOINTS["v2"], "model_type": "deepseek_v2", "topk_method": "greedy"}
    router = config_from_hf(cfg, "x/config.json").router
    assert (router.n_group, router.topk_group, router.scoring) == (1, 1, "softmax")


@pytest.mark.parametrize("checkpoint", ["moe"], indirect=True)
def test_tensors_the_decoder_has_no_place_for_are_refused_by_name(checkpoint, tmp_path):
    """A tensor the config does not count would change what the checkpoint
    computes: refused by name (an undercounted layer, an extra expert, a
    bias). A multi-token-prediction layer past the decoder's (it holds
    ``eh_proj``, as DeepSeek-V3's layer 61 does) is not read."""
    import shutil

    import safetensors.numpy

    _, folder, _, _ = checkpoint
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")

    def variant(name, change_tensors=None, change_config=None):
        d = tmp_path / name
        shutil.copytree(folder, d)
        if change_tensors:
            t = dict(tensors)
            change_tensors(t)
            safetensors.numpy.save_file(t, d / "model.safetensors", metadata={"format": "pt"})
        if change_config:
            cfg = json.loads((d / "config.json").read_text())
            cfg.update(change_config)
            (d / "config.json").write_text(json.dumps(cfg))
        return d

    expert = {k.replace("experts.0.", "experts.8."): v for k, v in tensors.items() if "experts.0." in k}
    layer = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if "layers.2." in k}
    for d, needle in ((variant("bias", lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.ones(64)})),
                       r"no place for: \['model.layers.0.self_attn.o_proj.bias'\]"),
                      (variant("expert", lambda t: t.update(expert)), "model.layers.1.mlp.experts.8.down_proj"),
                      (variant("fewer", change_config={"num_hidden_layers": 2, "num_nextn_predict_layers": 1}),
                       "model.layers.2.input_layernorm"),
                      (variant("layer", lambda t: t.update(layer), {"num_nextn_predict_layers": 0}),
                       "model.layers.3.")):
        with pytest.raises(ValueError, match=needle):
            load_hf_deepseek(d)
    mtp = {**layer, "model.layers.3.eh_proj.weight": np.ones((64, 128), np.float32)}
    model = load_hf_deepseek(variant("mtp", lambda t: t.update(mtp), {"num_nextn_predict_layers": 1}))
    assert model.config.num_layers == 3


def test_weights_of_other_shapes_are_refused_by_name():
    config = config_from_hf({**DIMS, **CHECKPOINTS["moe"], "model_type": "deepseek_v3",
                             "moe_intermediate_size": 32})
    params = init_params(config, jax.random.key(0))
    params["moe"]["w_uk"] = params["moe"]["w_uk"][:, :, :3]
    with pytest.raises(ValueError, match=r"params\['moe'\]\['w_uk'\]: shape \(2, 4, 3, 32\)"):
        DeepseekModel(config, params)
    params = init_params(config, jax.random.key(0))
    params["final_norm"] = params["final_norm"].astype(bool)
    with pytest.raises(ValueError, match=r"params\['final_norm'\] has dtype bool; expected one of"):
        DeepseekModel(config, params)
    params = init_params(config, jax.random.key(0))
    params["moe"]["router"] = params["moe"]["router"].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="router's weights are float32"):
        DeepseekModel(config, params)
    with pytest.raises(ValueError, match="dtype must be one of"):
        init_params(config, jax.random.key(0), jnp.int8)
    with pytest.raises(ValueError, match="latent pool"):  # a GQA pool for an MLA model
        Engine(DeepseekModel(config, init_params(config, jax.random.key(0))),
               init_kv_pool(num_layers=3, num_kv_heads=1, num_pages=9, page_size=4, head_dim=40),
               EngineConfig(max_seqs=2, max_seq_len=16, max_num_batched_tokens=16))
