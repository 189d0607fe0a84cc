"""The checkpoint families beyond Llama 2 / Mistral / Qwen2 (models.loading.hf_config,
models.layers.rope, the decoder's family options) against transformers.

Each family's checkpoint is tiny, random and written by the test
(tests/family_helpers.py: Llama 3.1 RoPE, Qwen3 with YaRN and a sliding
layer, Gemma 2 with small soft caps, Gemma 3 with 5 sliding : 1 global
layers and two RoPE bases, OLMo 2, Qwen3-MoE with 8 experts a layer, top-2
renormalized), loaded in f32 and compared with
transformers (f32, eager attention) on the same weights:

- logits at every position through the dense (training) forward, through
  the paged cache (chunked prefill then one-token decode, pages in reverse
  order) and through flat ragged batches of three sequences of different
  lengths on a pool full of NaN, within ``LOGIT_ATOL``;
- greedy continuations through the serving engine (``models.llm.LLM``,
  chunked prefill, page size 4) equal to ``generate(do_sample=False)``.

Both sides compute in f32, so they differ only by float summation order
(matmul precision "highest", conftest). Measured on 2 CPU cores: each
check's largest absolute logit difference (printed with ``-s``) was
between 1.0e-6 and 7.8e-6, against logits of standard deviation about 1;
we allow ``LOGIT_ATOL = 1e-4``.

The default run compiles what fits in about two minutes on 2 busy cores:
every family's dense and paged logits, Gemma 2's ragged batches and Gemma
3's engine run; ``-m slow`` adds the other families' ragged batches and
engine runs, the Pallas kernels in interpret mode and the weight dtypes.
The refusals (unknown rope types, mixture of experts, bad layer patterns,
...) are config-only and fast.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # noqa: I001  (family_helpers first: it sets HF_HUB_OFFLINE before transformers loads)
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.config import LlamaConfig
from models.layers.rope import inv_freq
from models.llama import Llama, forward_dense, make_step_fn
from models.llm import LLM
from models.loading.hf_config import config_from_hf
from models.loading.hf_loader import load_hf_model
from tests.decoder_helpers import mixed_calls
from tests.family_helpers import FAMILIES, VOCAB, WINDOW, hf_config, load_transformers, write_checkpoint

LOGIT_ATOL = 1e-4
PAGE_SIZE = 4
CHUNK = 8  # prefill chunk, tokens: one compiled width for every chunk
DECODED = 3  # each prompt's last tokens go through one-token decode steps
NEW_TOKENS = 8
PROMPT_LENS = (21, 27, 30)  # each longer than three windows


def families(*default: str) -> list:
    """Every family, as indirect parameters of the ``family`` fixture; those
    not in ``default`` run only with ``-m slow`` (each family's checks
    compile their own programs: the default run keeps under two minutes on
    2 busy cores)."""
    return [pytest.param(n, marks=() if n in default else pytest.mark.slow) for n in FAMILIES]


ALL = tuple(FAMILIES)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    write_checkpoint(folder, name)
    hf = load_transformers(folder)
    model = load_hf_model(folder)
    with torch.no_grad():  # causal: each prompt's logits at every position, one pass each
        want = [hf(torch.tensor([ids])).logits[0].numpy() for ids in prompts()]
    return name, hf, model, want


def show(name, path, got, want):
    print(f"{name} {path}: max |logit difference| {np.abs(got - want).max():.2e}, logit std {want.std():.2f}")
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_ATOL, err_msg=f"{name} {path}")


# ----------------------------------------------------------------------------- what was read


@pytest.mark.parametrize("family", families(*ALL), indirect=True)
def test_config_is_what_the_family_computes(family):
    name, hf, model, _ = family
    c = model.config
    assert c.num_params == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert c.num_params == sum(p.numel() for p in hf.parameters())  # tied weights counted once on both sides
    assert model.embed[...].dtype == jnp.float32
    expect = {
        "llama3": dict(qk_norm=None, norm_placement="pre", tie_embeddings=True, sliding_window=None),
        "qwen3": dict(qk_norm="head", head_dim=32, layer_types=("full_attention", "sliding_attention"),
                      sliding_window=WINDOW),
        "gemma2": dict(norm_plus_one=True, norm_placement="pre_post", mlp_activation="gelu_tanh", embed_scale=8.0,
                       attn_soft_cap=2.0, final_soft_cap=3.0, query_scale=8 ** -0.5,
                       layer_types=("sliding_attention", "full_attention"), tie_embeddings=True),
        "gemma3": dict(qk_norm="head", attn_soft_cap=None, final_soft_cap=4.0, local_rope_theta=100.0,
                       rope_theta=10000.0, layer_types=("sliding_attention",) * 5 + ("full_attention",)),
        "olmo2": dict(qk_norm="full", norm_placement="post", tie_embeddings=False),
        "qwen3moe": dict(qk_norm="head", head_dim=32, moe_mlp_dim=32, sliding_window=None),
    }[name]
    if name == "qwen3moe":
        assert (c.router.num_experts, c.router.top_k, c.router.scoring, c.router.norm_topk_prob) == (
            8, 2, "softmax", True)
    assert {k: getattr(c, k) for k in expect} == expect
    assert (c.rope_scaling.rope_type if c.rope_scaling else None) == {
        "llama3": "llama3", "qwen3": "yarn", "gemma3": "linear"}.get(name)


# ----------------------------------------------------------------------------- logits


def padded(ids, width):
    return jnp.asarray([ids + [0] * (width - len(ids))], jnp.int32)  # [1, width]


def paged_logits(step, model, ids) -> np.ndarray:
    """f32[T, V] at every position: the prompt but its last ``DECODED``
    tokens prefilled in chunks of ``CHUNK`` (one padded width), then those
    decoded one call each; pages taken in reverse order."""
    pages = 64 // PAGE_SIZE
    kv = model.config.make_kv_pool(pages + 1, PAGE_SIZE)
    table = jnp.arange(pages, 0, -1, dtype=jnp.int32)[None]
    out, done = [], 0
    prefill = len(ids) - DECODED
    while done < len(ids):
        n = min(CHUNK, prefill - done) if done < prefill else 1
        logits, kv = step(padded(ids[done:done + n], CHUNK if n > 1 else 1), kv, table,
                          jnp.asarray([done + n], jnp.int32), jnp.asarray([n], jnp.int32))
        out.append(np.asarray(logits[0, :n]))
        done += n
    return np.concatenate(out)


@pytest.mark.parametrize("family", families(*ALL), indirect=True)
def test_dense_and_paged_logits_match_transformers(family):
    name, _, model, want = family
    step = make_step_fn(model, all_logits=True)
    width = max(PROMPT_LENS)
    for ids, w in zip(prompts(), want):
        show(name, "dense", np.asarray(forward_dense(model, padded(ids, width))[0, : len(ids)]), w)
        got = paged_logits(step, model, ids)
        show(name, "paged", got, w)
        assert (got.argmax(-1) == w.argmax(-1)).all()


@pytest.mark.parametrize("family", families("gemma2"), indirect=True)
def test_ragged_batches_match_transformers(family):
    """Three sequences through flat mixed batches (prefill chunks beside
    decode tokens) on a NaN pool: each chunk's last logits equal
    transformers' at that position."""
    name, _, model, want = family
    p = prompts()
    schedule = [
        [(0, p[0][:13]), (1, p[1][:6])],
        [(0, p[0][13:20]), (1, p[1][6:7]), (2, p[2][:22])],
        [(0, p[0][20:21]), (1, p[1][7:27]), (2, p[2][22:23])],
    ]
    got = mixed_calls(model, schedule, page_size=PAGE_SIZE)
    seen = [0, 0, 0]
    for call, logits in zip(schedule, got):
        for row, chunk in call:
            seen[row] += len(chunk)
            show(name, f"ragged row {row} at {seen[row]}", logits[row], want[row][seen[row] - 1])


@pytest.mark.parametrize("family", families(*ALL), indirect=True)
def test_window_and_soft_caps_change_the_answer(family):
    """The features each family adds are not no-ops here: without them the
    dense logits move far beyond the tolerance (so the comparisons above
    tested them)."""
    name, _, model, want = family
    c = model.config
    changes = {"llama3": dict(rope_scaling=None), "qwen3": dict(layer_types=None, sliding_window=None),
               "gemma2": dict(attn_soft_cap=None), "gemma3": dict(local_rope_theta=None),
               "olmo2": dict(qk_norm=None),
               "qwen3moe": dict(router=c.router and dataclasses.replace(c.router, norm_topk_prob=False))}[name]
    other = dataclasses.replace(c, **changes)
    twin = nnx.eval_shape(lambda: Llama(other, rngs=nnx.Rngs(0)))
    state = nnx.state(model)
    if name == "olmo2":  # no q/k norm weights in the twin
        state = nnx.state(model, nnx.Not(nnx.Any(nnx.PathContains("q_norm"), nnx.PathContains("k_norm"))))
    nnx.update(twin, state)
    ids = prompts()[2]
    got = np.asarray(forward_dense(twin, padded(ids, max(PROMPT_LENS)))[0, : len(ids)])
    assert np.abs(got - want[2]).max() > 100 * LOGIT_ATOL


@pytest.mark.parametrize("family", [pytest.param(n, marks=pytest.mark.slow) for n in ("qwen3", "gemma2", "gemma3")],
                         indirect=True)  # the families with layers of two kinds; Pallas interpret mode is slow on CPU
@pytest.mark.parametrize("impl", ["pallas_ragged", "pallas_gpu"])
def test_pallas_kernels_take_the_per_layer_windows_and_soft_cap(family, impl):
    """The Pallas kernels (interpret mode here) under the per-layer
    ``lax.cond`` give the XLA path's logits: prefill (the ragged kernel),
    then decode (``pallas_gpu``'s decode kernel)."""
    name, _, model, want = family
    ids = prompts()[0]
    show(name, impl, paged_logits(make_step_fn(model, impl=impl, all_logits=True), model, ids), want[0])


# ----------------------------------------------------------------------------- serving


@pytest.mark.parametrize("family", families("gemma3"), indirect=True)
def test_engine_greedy_matches_generate(family):
    name, hf, model, _ = family
    llm = LLM((model, None), kv_tokens=256, page_size=PAGE_SIZE, max_seqs=4, max_seq_len=64,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    outs = llm.generate(prompts(), max_tokens=NEW_TOKENS)
    for ids, out in zip(prompts(), outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out.output_ids == ref[0, len(ids):].tolist(), name


# ----------------------------------------------------------------------------- RoPE against transformers


@pytest.mark.parametrize("model_type, rope", [
    ("llama", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    ("llama", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 2.0,
               "high_freq_factor": 3.0, "original_max_position_embeddings": 64}),
    ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ("qwen3", {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
               "original_max_position_embeddings": 32768}),
    ("qwen3", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
               "beta_fast": 16, "beta_slow": 2, "truncate": False}),
    ("qwen3", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
               "mscale": 0.7, "mscale_all_dim": 1.0}),
    ("qwen3", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64,
               "attention_factor": 0.9}),
])
def test_rope_frequencies_equal_transformers(model_type, rope):
    """Our inverse frequencies and attention factor for a config (read by
    our parser) against transformers' ``ROPE_INIT_FUNCTIONS`` on the same
    config, head dim 128 as the real checkpoints."""
    hf = transformers.AutoConfig.for_model(model_type, hidden_size=256, num_attention_heads=2, head_dim=128,
                                           num_key_value_heads=2, max_position_embeddings=131072,
                                           rope_parameters=dict(rope))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
    ours = config_from_hf(hf.to_dict())
    # Same f32 formulas, but NumPy's pow and torch's differ in the last bit
    # for some dims, and llama3's smoothing carries that a few ulps further.
    np.testing.assert_allclose(inv_freq(128, ours.rope_theta, ours.rope_scaling), want_freq.numpy(), rtol=2e-6, atol=0)
    assert ours.rope_scaling.attention_factor == pytest.approx(want_factor, rel=1e-12)


def test_old_style_gemma3_rope_fields():
    """Configs written before transformers 5: ``rope_theta``,
    ``rope_local_base_freq``, ``rope_scaling`` and ``sliding_window_pattern``
    at the top level (Gemma-3-4B's shape)."""
    cfg = dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
               rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window=1024, sliding_window_pattern=6)
    c = config_from_hf(cfg)
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention",) + ("sliding_attention",) * 2
    assert (c.sliding_window, c.attn_soft_cap, c.final_soft_cap, c.query_scale) == (1024, None, None, 256 ** -0.5)
    gemma2 = config_from_hf(dict(cfg, model_type="gemma2", num_hidden_layers=3))  # defaults: caps 50 / 30
    assert gemma2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (gemma2.attn_soft_cap, gemma2.final_soft_cap, gemma2.local_rope_theta) == (50.0, 30.0, None)


def test_config_survives_a_json_round_trip():
    """models.loading.checkpoint stores the config as JSON: the RoPE scaling and
    layer types come back as a dict and a list and are rebuilt."""
    c = config_from_hf(json.loads(json.dumps(hf_config("gemma3").to_dict())))
    again = LlamaConfig(**json.loads(json.dumps(dataclasses.asdict(c))))
    assert again == c and hash(again) == hash(c)


# ----------------------------------------------------------------------------- refusals


def base(name: str) -> dict:
    return hf_config(name).to_dict()


@pytest.mark.parametrize("name, fields, match", [
    ("llama3", dict(rope_parameters={"rope_type": "funky", "rope_theta": 1e4}),
     r"config\.json: field 'rope_parameters' is .*; rope type 'funky' is not supported"),
    ("llama3", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     r"field 'rope_parameters' is .*; rope type 'dynamic' is not supported"),
    ("llama3", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
     r"field 'rope_scaling' is .*; rope type 'longrope' is not supported"),
    ("llama3", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0}),
     r"field 'rope_parameters' is .*; rope type 'llama3' needs 'high_freq_factor'"),
    ("llama3", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 4.0,
                                     "high_freq_factor": 1.0}),
     r"field 'rope_parameters' is .*not a valid 'llama3' RoPE: high_freq_factor must be > low_freq_factor"),
    ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
     r"field 'rope_parameters' is .*; rope type 'yarn' needs 'factor'"),
    ("qwen3", dict(num_experts=8, num_experts_per_tok=2), r"field 'num_experts' is 8; mixture-of-experts fields"),
    ("qwen3moe", dict(decoder_sparse_step=2), r"field 'decoder_sparse_step' is 2; only every layer sparse"),
    ("qwen3moe", dict(mlp_only_layers=[0]), r"field 'mlp_only_layers' is \[0\]; dense layers among"),
    ("qwen3moe", dict(num_experts_per_tok=9), r"the routing fields do not make a valid router: top_k"),
    ("qwen3moe", dict(num_experts=None), r"field 'num_experts'"),
    ("gemma3", dict(model_type="gemma3"), r"field 'model_type' is 'gemma3'; this is the multimodal Gemma 3 config"),
    ("gemma3", dict(layer_types=["sliding_attention"] * 5),
     r"field 'layer_types' is \[.*\]; expected a list of 6 layer types"),
    ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention"]),
     r"field 'layer_types' is .*; unknown layer types \['chunked_attention'\]"),
    ("gemma3", dict(layer_types=None, sliding_window_pattern=0), r"field 'sliding_window_pattern' is 0"),
    ("qwen3", dict(use_sliding_window=False), r"field 'layer_types' is .*marks sliding layers, but use_sliding_window"),
    ("qwen3", dict(attention_bias=True), r"field 'attention_bias' is True; qwen3's attention_bias adds an o_proj bias"),
    ("olmo2", dict(attention_bias=True), r"field 'attention_bias' is True"),
    ("gemma2", dict(hidden_activation="gelu"), r"field 'hidden_activation' is 'gelu'; Gemma's MLP is GeGLU"),
    ("gemma3", dict(use_bidirectional_attention=True), r"field 'use_bidirectional_attention' is True"),
    ("gemma3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     r"field 'rope_parameters' is .*; gemma3_text expects RoPE parameters per layer type"),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     r"scaled RoPE on the sliding layers is not supported"),
    ("gemma2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     r"partial rotary embeddings are not supported"),
])
def test_what_the_decoder_cannot_compute_is_refused_by_name(name, fields, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**base(name), **fields})


def test_unsupported_weight_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"param_dtype must be one of \('float32', 'bfloat16', 'float16'\), "
                                         r"got param_dtype='int8'"):
        load_hf_model(tmp_path, param_dtype=jnp.int8)


def test_a_folder_without_a_tokenizer_serves_token_ids(tmp_path):
    from models.llm import load_model

    write_checkpoint(tmp_path, "gemma3")
    with pytest.warns(UserWarning, match="has no tokenizer.json; serving without a tokenizer"):
        model, tokenizer, name = load_model(tmp_path)
    assert tokenizer is None and model.config.num_layers == hf_config("gemma3").num_hidden_layers


def test_decoder_config_refuses_bad_layer_patterns():
    fields = dict(vocab_size=VOCAB, model_dim=64, mlp_dim=96, num_layers=2, num_q_heads=4, num_kv_heads=2,
                  head_dim=16)
    with pytest.raises(ValueError, match=r"layer_types must be None or one of .* \(2 layers\)"):
        LlamaConfig(**fields, layer_types=("full_attention",), sliding_window=4)
    with pytest.raises(ValueError, match=r"layer_types marks sliding layers but sliding_window is None"):
        LlamaConfig(**fields, layer_types=("full_attention", "sliding_attention"))
    with pytest.raises(ValueError, match=r"sliding_window=4 is set but layer_types marks no sliding layer"):
        LlamaConfig(**fields, layer_types=("full_attention",) * 2, sliding_window=4)
    with pytest.raises(ValueError, match=r"qk_norm must be one of \(None, 'head', 'full'\), got qk_norm='q'"):
        LlamaConfig(**fields, qk_norm="q")
    with pytest.raises(ValueError, match=r"attn_soft_cap must be"):
        LlamaConfig(**fields, attn_soft_cap=0.0)


@pytest.mark.slow
def test_bf16_checkpoint_loads_in_each_weight_dtype(tmp_path):
    """A bf16 checkpoint read into f32, bf16 and f16 weights: every leaf
    takes the asked dtype and the bf16 values upcast exactly."""
    write_checkpoint(tmp_path, "gemma2", dtype=torch.bfloat16)
    f32 = load_hf_model(tmp_path)
    for dtype in (jnp.bfloat16, jnp.float16):
        model = load_hf_model(tmp_path, param_dtype=dtype)
        assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(dtype)}
    bf16 = load_hf_model(tmp_path, param_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf16.embed[...].astype(jnp.float32)), np.asarray(f32.embed[...]))
