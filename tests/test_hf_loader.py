"""Hugging Face checkpoint folders (models.loading.hf_loader) against transformers.

Each architecture's checkpoint is tiny, random and written by the test with
``save_pretrained`` (no download): llama in bf16 and sharded, mistral in f16
with a 5-token sliding window (shorter than every prompt, so it matters in
prefill and decode), qwen2 in f32, sharded, with random q/k/v biases and tied
embeddings. Weights are random at unit-ish scale (norm scales and biases
too), so a mapping error cannot hide behind zeros or ones.

Both sides run in f32 on the same weights (the bf16 / f16 tensors upcast
exactly), so they differ only by float summation order. Measured on 2 CPU
cores (matmul precision "highest", conftest), over every position of every
prompt: the largest absolute logit difference is 2e-6 to 6e-6 against logits
of standard deviation about 1.0 (paged prefill and dense forward alike); we
allow ``LOGIT_ATOL = 1e-4``. About 90 s in all on 2 cores, most of it
compiling the engine's programs for three model shapes.
Greedy continuations through the paged engine (chunked prefill, page size 4)
must equal ``generate(do_sample=False)`` token for token.
"""

import dataclasses
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from flax import nnx

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import torch  # noqa: E402  (the test extra: the oracle must be there, never skipped)
import transformers  # noqa: E402
from tokenizers import Tokenizer as RawTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers

from models.loading.hf_loader import load_hf, load_hf_model, load_hf_tokenizer, read_hf_config  # noqa: E402
from models.llama import Llama, forward_dense, make_step_fn  # noqa: E402
from models.ragged import RaggedModel  # noqa: E402
from paged_jax.engine.core import Engine, EngineConfig, Request  # noqa: E402

LOGIT_ATOL = 1e-4
NEW_TOKENS = 12
PAGE_SIZE = 4
VOCAB = 384  # the model's; the tokenizer uses the first 320 ids

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size pages.",
    "What is the capital of France? The capital of France is Paris.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]
TEMPLATE = ("{{ bos_token if bos_token else '' }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")
DIMS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
# name: (config class, extra config fields, stored dtype, max_shard_size or None, Qwen-style tokenizer)
CASES = {
    "llama": (transformers.LlamaConfig, dict(head_dim=24, bos_token_id=0, eos_token_id=1), torch.bfloat16, "100KB",
              False),
    "mistral": (transformers.MistralConfig, dict(sliding_window=5, bos_token_id=0, eos_token_id=1), torch.float16,
                None, False),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True, eos_token_id=3), torch.float32, "100KB",
              True),
}


def save_tokenizer(folder: pathlib.Path, qwen_style: bool) -> None:
    """A byte-level BPE trained on ``SENTENCES`` (320 ids, the specials
    first), saved as transformers saves one. Qwen style: no BOS, EOS
    ``<|im_end|>``, the chat template inside tokenizer_config.json (older
    transformers); otherwise BOS ``<s>``, EOS ``</s>``, the template in
    chat_template.jinja (transformers 5)."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    special = dict(bos_token=None, eos_token="<|im_end|>") if qwen_style else dict(bos_token="<s>", eos_token="</s>")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, **special)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    if qwen_style:
        (folder / "chat_template.jinja").unlink()
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = TEMPLATE
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def write_checkpoint(folder: pathlib.Path, name: str) -> None:
    config_cls, extra, dtype, shard, qwen_style = CASES[name]
    torch.manual_seed(list(CASES).index(name))
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**DIMS, **extra))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:  # Qwen2's q/k/v biases
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    save_tokenizer(folder, qwen_style)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    write_checkpoint(folder, name)
    torch.set_num_threads(2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # fixed-length continuations, as the engine's ignore_eos
    model, tok = load_hf(folder)
    prompts = [tok.encode(tok.apply_chat_template(s)) for s in SENTENCES[1:]]
    return name, folder, hf, model, tok, prompts


def test_checkpoint_is_what_the_case_claims(case):
    name, folder, _, model, _, _ = case
    _, extra, dtype, shard, _ = CASES[name]
    files = sorted(folder.glob("*.safetensors"))
    assert (folder / "model.safetensors.index.json").is_file() == bool(shard)
    assert len(files) > 1 if shard else len(files) == 1
    want = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
    with safetensors.safe_open(str(files[0]), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {want}
    c = model.config
    assert (c.num_layers, c.model_dim, c.mlp_dim, c.num_q_heads, c.num_kv_heads, c.vocab_size) == (2, 64, 96, 4, 2, VOCAB)
    assert c.head_dim == extra.get("head_dim", 16) and c.rope_theta == 1000.0 and c.rms_norm_eps == 1e-5
    assert c.sliding_window == extra.get("sliding_window")
    assert c.qkv_bias == (name == "qwen2") and c.tie_embeddings == (name == "qwen2")
    assert model.embed[...].dtype == jnp.float32
    assert c.num_params == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


WIDTH = 64  # prompts are padded to this, so each path compiles once


def paged_prefill_all(step, model, ids):
    """Logits at every prompt position from one paged prefill call (pages
    used in reverse order)."""
    pages = WIDTH // PAGE_SIZE
    kv = model.config.make_kv_pool(pages + 1, PAGE_SIZE)
    table = jnp.arange(pages, 0, -1, dtype=jnp.int32)[None]
    n = jnp.asarray([len(ids)], jnp.int32)
    logits, _ = step(padded(ids), kv, table, n, n)
    return np.asarray(logits[0, : len(ids)])


def padded(ids):
    return jnp.asarray([ids + [0] * (WIDTH - len(ids))], jnp.int32)  # [1, WIDTH]


def dense_all(model, ids):
    """Logits at every prompt position from the dense (training) forward;
    causal, so the padding after the prompt changes nothing before it."""
    return np.asarray(forward_dense(model, padded(ids))[0, : len(ids)])


def test_logits_match_transformers(case):
    name, _, hf, model, _, prompts = case
    window = model.config.sliding_window
    step = make_step_fn(model, all_logits=True)
    for ids in prompts:
        assert len(ids) <= WIDTH and (window is None or len(ids) > 3 * window)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].numpy()  # [T, V]
        for got in (paged_prefill_all(step, model, ids), dense_all(model, ids)):
            print(f"{name}: max |logit difference| {np.abs(got - want).max():.2e}, logit std {want.std():.2f}")
            np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_ATOL, err_msg=name)
            assert (got.argmax(-1) == want.argmax(-1)).all()
    if window is not None:  # the window changes the answer, so the comparison above tested it
        unwindowed = nnx.eval_shape(lambda: Llama(dataclasses.replace(model.config, sliding_window=None),
                                                  rngs=nnx.Rngs(0)))
        nnx.update(unwindowed, nnx.state(model))
        assert np.abs(dense_all(unwindowed, ids) - want).max() > 100 * LOGIT_ATOL


# One family through the engine by default (Mistral's window and Qwen2's biases: a slow extra; their logits,
# dense and paged, are checked against transformers above in every run).
@pytest.mark.parametrize("case", ["llama", *(pytest.param(n, marks=pytest.mark.slow) for n in CASES if n != "llama")],
                         indirect=True)
def test_greedy_through_engine_matches_generate(case):
    """The paged engine (prefill in chunks of at most 16 tokens, three
    sequences sharing calls, page size 4) against ``generate``."""
    name, _, hf, model, _, prompts = case
    engine = Engine(RaggedModel(model), model.config.make_kv_pool(64, PAGE_SIZE),
                    EngineConfig(max_seqs=4, max_seq_len=96, max_num_batched_tokens=16))
    outs = engine.run([Request(request_id=i, prompt_ids=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
                       for i, ids in enumerate(prompts)])
    got = {o.request_id: o.output_ids for o in outs}
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert got[i] == out[0, len(ids):].tolist(), (name, i)


def test_tokenizer_matches_transformers(case):
    name, folder, _, _, tok, _ = case
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.encode(SENTENCES[0])) == SENTENCES[0]
    if name == "qwen2":
        assert tok.bos_id is None and tok.stop_ids == (tok.eos_id,) == (hf_tok.convert_tokens_to_ids("<|im_end|>"),)
        assert not text.startswith("<s>")
    else:
        assert (tok.bos_id, tok.eos_id) == (0, 1) and text.startswith("<s><|im_start|>user\n")
        assert tok.stop_ids == (1, 3)  # </s> and <|im_end|>


# ----------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def mistral_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral_base")
    write_checkpoint(folder, "mistral")
    return folder


def edited_config(tmp_path, base, **fields):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_missing_config_names_the_file(tmp_path, mistral_folder):
    folder = tmp_path / "ckpt"
    shutil.copytree(mistral_folder, folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"ckpt/config\.json"):
        load_hf_model(folder)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_hf_model(tmp_path / "nowhere")


@pytest.mark.parametrize("fields, match", [
    (dict(model_type="gemma"), r"config\.json: field 'model_type' is 'gemma'; supported: llama, mistral, qwen2"),
    (dict(hidden_act="gelu"), r"config\.json: field 'hidden_act' is 'gelu'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     r"config\.json: field 'rope_parameters' is .*; rope type 'llama3' needs 'low_freq_factor'"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}),
     r"config\.json: field 'rope_scaling' is .*; rope type 'dynamic' is not supported"),
    (dict(sliding_window=0), r"config\.json: field 'sliding_window' is 0; expected an int >= 1"),
    (dict(num_key_value_heads=3), r"config\.json: the fields do not make a valid decoder: num_q_heads must be"),
    (dict(hidden_size="64"), r"config\.json: field 'hidden_size' is '64'"),
    (dict(quantization_config={"quant_method": "gptq"}), r"config\.json: field 'quantization_config'"),
])
def test_bad_config_field_names_file_field_and_value(tmp_path, mistral_folder, fields, match):
    with pytest.raises(ValueError, match=match):
        read_hf_config(edited_config(tmp_path, mistral_folder, **fields))


@pytest.mark.parametrize("fields, match", [
    (dict(model_type="llama", attention_bias=True), r"field 'attention_bias' is True; .*o_proj"),
    (dict(model_type="llama", mlp_bias=True), r"field 'mlp_bias' is True"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
     r"field 'max_window_layers' is 1; a sliding window on some layers only"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=4,
          layer_types=["full_attention", "sliding_attention"]), r"field 'layer_types' is"),
    (dict(model_type="qwen2", layer_types=["full_attention", "chunked_attention"]),
     r"unknown layer types \['chunked_attention'\]"),
])
def test_unsupported_features_are_refused(tmp_path, mistral_folder, fields, match):
    with pytest.raises(ValueError, match=match):
        read_hf_config(edited_config(tmp_path, mistral_folder, **fields))


def test_qwen2_window_on_every_layer_is_taken(tmp_path, mistral_folder):
    folder = edited_config(tmp_path, mistral_folder, model_type="qwen2", use_sliding_window=True, sliding_window=4,
                           max_window_layers=0)
    config = read_hf_config(folder)
    assert config.sliding_window == 4 and config.qkv_bias


def test_missing_tensor_names_file_and_tensor(tmp_path, mistral_folder):
    folder = tmp_path / "ckpt"
    shutil.copytree(mistral_folder, folder)
    path = folder / "model.safetensors"
    with safetensors.safe_open(str(path), framework="numpy") as f:  # f16: NumPy reads it
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    up = tensors.pop("model.layers.1.mlp.up_proj.weight")
    safetensors.numpy.save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"ckpt/model\.safetensors' lacks tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf_model(folder)
    # A bias the config does not announce has no place to go.
    tensors["model.layers.1.mlp.up_proj.weight"] = up
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float16)
    safetensors.numpy.save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"has no place for: \['model\.layers\.0\.self_attn\.o_proj\.bias'\]"):
        load_hf_model(folder)
    # A tensor of the wrong shape.
    del tensors["model.layers.0.self_attn.o_proj.bias"]
    tensors["model.norm.weight"] = np.ones(63, np.float16)
    safetensors.numpy.save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"tensor 'model\.norm\.weight' has shape \[63\], config\.json implies \[64\]"):
        load_hf_model(folder)


def test_missing_shard_names_index_and_shard(tmp_path):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "llama")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"index\.json' lists shard '{shard.name}', which does not exist"):
        load_hf_model(folder)
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_hf_model(folder)


def test_shards_outside_the_folder_and_string_eos_ids_are_refused(tmp_path, mistral_folder):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "llama")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = next(iter(data["weight_map"]))
    shutil.copy(folder / data["weight_map"][name], tmp_path / "elsewhere.safetensors")
    data["weight_map"][name] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"names shard files outside the checkpoint folder: \['\.\./elsewhere"):
        load_hf_model(folder)
    tok_folder = tmp_path / "tok"
    shutil.copytree(mistral_folder, tok_folder)
    cfg = json.loads((tok_folder / "config.json").read_text())
    cfg["eos_token_id"] = ["2"]  # a string would be dropped, and generation not stop there
    (tok_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json': field 'eos_token_id' must be a token id"):
        load_hf_tokenizer(tok_folder)


def test_serve_sharegpt_model_flag(tmp_path, mistral_folder):
    from experiments.serving.serve_sharegpt import parse_args

    out = ["--out", str(tmp_path / "out"), "--no-compile-cache"]
    assert parse_args(out).model == "smollm2"
    assert parse_args(out + ["--model", str(mistral_folder)]).model == str(mistral_folder)
    bad = edited_config(tmp_path, mistral_folder, model_type="gemma")
    for folder in (bad, tmp_path / "nowhere"):
        with pytest.raises(SystemExit):
            parse_args(out + ["--model", str(folder)])


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, mistral_folder):
    """A tokenizer whose ids the model's vocabulary does not hold (here
    SmolLM2's 49,152 tokens beside a 384-token model) would fail at the first
    request; load_hf refuses it, naming both sizes."""
    from models.tokenizer import load_tokenizer

    folder = tmp_path / "ckpt"
    shutil.copytree(mistral_folder, folder)
    load_tokenizer().hf_tokenizer.save(str(folder / "tokenizer.json"))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if key in tok_config:
            tok_config[key] = "<|im_end|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    with pytest.raises(ValueError, match=r"tokenizer.json has 49152 tokens, more than config.json's vocab_size=384"):
        load_hf(folder)
