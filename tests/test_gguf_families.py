"""GGUF files of the families beyond Llama 2 (models.loading.gguf_loader,
models.loading.gguf_families) against transformers.

Each family's tiny random checkpoint (tests/family_helpers.py) is written as
a GGUF in the test the way llama.cpp's converter writes it (conversion/
llama.py, qwen.py, gemma.py, olmo.py of ggml-org/llama.cpp): gguf-py's
tensor names (``gguf.get_tensor_name_map``, the converter's
``map_tensor_name``), its metadata keys, the q/k row permutation for
``llama``, ``1 + w`` in Gemma's norms, Llama 3.1's RoPE scaling as
``rope_freqs.weight`` factors. Two things a GGUF cannot say are set in the
folder first, since llama.cpp fixes them per architecture: Qwen3's sliding
window (no qwen3 key; the checkpoint then has none) and Gemma's
``query_pre_attn_scalar`` (llama.cpp uses the head dim below 27B).

Then, against transformers (f32, eager attention):

- the GGUF's config equals the one the Hugging Face loader reads from the
  folder, field for field;
- our logits from the GGUF equal transformers' from the original folder
  (dense forward; a paged ragged batch of three sequences on a NaN pool),
  and the serving engine loaded from the GGUF path continues greedily as
  ``generate`` does;
- where transformers (5.24, 5.25) reads the architecture's GGUFs (every family but
  OLMo 2), our logits equal transformers' from the same GGUF file: an
  oracle for the tensor conventions that shares nothing with our loader or
  with the test's writer's inverse. It also runs on a Q8_0 file (Gemma 2),
  whose dequantized weights both sides share, so the 1e-4 holds there too.

Measured on 2 CPU cores: the largest logit differences were 8e-7 to 4.4e-6
(Q8_0 against the f32 folder: 0.13). The default run checks every family's
config and dense logits, both oracles and one engine run (Llama 3.1, through
``LLM("x.gguf")``); ``-m slow`` adds the paged ragged batches and the other
families' engine runs (the GGUF decides only the config and the weights,
which the default checks pin down; tests/test_families.py runs the paged
paths of the same configs by default).
"""

import json
import math
import pathlib
import warnings

import gguf  # noqa: I001  (family_helpers first: it sets HF_HUB_OFFLINE before transformers loads)
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.config import LlamaConfig
from models.layers.rope import inv_freq
from models.llama import forward_dense
from models.llm import LLM, load_model
from models.loading.gguf_families import hf_config_fields, llama3_from_factors
from models.loading.gguf_loader import load_gguf
from models.loading.hf_config import config_from_hf
from models.loading.hf_loader import read_hf_config
from models.smollm2 import load_llama_gguf
from models.tokenizer import load_tokenizer
from tests.decoder_helpers import mixed_calls
from tests.family_helpers import FAMILIES, VOCAB, load_transformers, write_checkpoint

GGUF_FAMILIES = tuple(FAMILIES)

LOGIT_ATOL = 1e-4
Q8_ATOL = 0.3  # Q8_0 against the f32 folder: 8-bit weights moved Gemma 2's logits (std about 1.5) by 0.13
PROMPT_LENS = (21, 27, 30)  # longer than three Gemma windows
NEW_TOKENS = 6
ARCHS = {"llama3": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3moe", "gemma2": "gemma2", "gemma3": "gemma3",
         "olmo2": "olmo2"}
"""family -> GGUF ``general.architecture``."""
TRANSFORMERS_ARCHS = {"qwen3moe": "qwen3_moe"}
"""GGUF architectures transformers' reader renames (``load_gguf_checkpoint``)."""
F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENS]


# ----------------------------------------------------------------------------- writing a GGUF as llama.cpp does


def gguf_representable(folder: pathlib.Path, name: str) -> None:
    """Sets what a GGUF cannot carry to what llama.cpp assumes (module
    docstring), in the folder's config.json."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    if name == "qwen3":
        cfg.update(use_sliding_window=False, layer_types=["full_attention"] * cfg["num_hidden_layers"])
    if name in ("gemma2", "gemma3"):
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    path.write_text(json.dumps(cfg))


def permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (conversion/llama.py)."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors(rope: dict, dim: int) -> np.ndarray:
    """``LlamaModel.generate_extra_tensors`` (conversion/llama.py): one RoPE
    factor per pair. (The converter reads the original context from the top
    level of config.json, default 8192; transformers 5 keeps it inside
    ``rope_parameters``, where this reads it.)"""
    freqs = np.float32(1.0) / (np.float32(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high, old = (rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(folder: pathlib.Path, name: str, path: pathlib.Path, qtype=F32, tokenizer=None) -> None:
    """The folder's checkpoint as llama.cpp's converter would write it
    (``TextModel.set_gguf_parameters`` and each family's overrides);
    matrices in ``qtype``, vectors in F32; ``tokenizer(writer)`` adds
    tokenizer metadata."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = ARCHS[name]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    layers, heads, kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = cfg["rope_parameters"]
    full = rope.get("full_attention", rope)
    w.add_rope_freq_base(full["rope_theta"])
    if full["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif full["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":  # Qwen2MoeModel.set_gguf_parameters (conversion/qwen.py)
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if tokenizer is not None:
        tokenizer(w)
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, layers)
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    if arch == "qwen3moe":  # Qwen2MoeModel.modify_tensors: each layer's experts stacked, one tensor a projection
        experts = sorted({int(n.split(".")[5]) for n in tensors if ".mlp.experts." in n})
        for i in range(layers):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                tensors[f"model.layers.{i}.mlp.experts.{proj}.weight"] = np.stack(
                    [tensors.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for e in experts])
    for hf_name, data in tensors.items():
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute(data, heads, heads if "q_proj" in hf_name else kv)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            data = data + 1
        new = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert new is not None, hf_name
        if qtype != F32 and data.ndim >= 2:
            w.add_tensor(new, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(new, data.astype(np.float32))
    if full["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(full, head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference_logits(hf) -> list[np.ndarray]:
    with torch.no_grad():  # causal: each prompt's logits at every position, one pass each
        return [hf(torch.tensor([ids])).logits[0].numpy() for ids in prompts()]


def show(name, what, got, want, atol=LOGIT_ATOL):
    print(f"{name} {what}: max |logit difference| {np.abs(got - want).max():.2e}")
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=f"{name} {what}")


def dense(model, ids) -> np.ndarray:
    width = max(PROMPT_LENS)
    padded = jnp.asarray([ids + [0] * (width - len(ids))], jnp.int32)  # [1, width]
    return np.asarray(forward_dense(model, padded)[0, : len(ids)])


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(f"gguf-{name}")
    write_checkpoint(folder, name)
    gguf_representable(folder, name)
    path = folder / "model.gguf"
    write_gguf(folder, name, path)
    hf = load_transformers(folder)
    return name, folder, path, hf, load_llama_gguf(path), reference_logits(hf)


def families(*default: str) -> list:
    return [pytest.param(n, marks=() if n in default else pytest.mark.slow) for n in GGUF_FAMILIES]


ALL = GGUF_FAMILIES


# ----------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("family", families(*ALL), indirect=True)
def test_config_equals_the_folders(family):
    name, folder, path, _, model, _ = family
    assert LlamaConfig(**load_gguf(path).config) == read_hf_config(folder) == model.config


@pytest.mark.parametrize("family", families(*ALL), indirect=True)
def test_dense_logits_match_transformers_on_the_folder(family):
    name, _, _, _, model, want = family
    for ids, w in zip(prompts(), want):
        show(name, "dense", dense(model, ids), w)


@pytest.mark.parametrize("family", families(*ALL), indirect=True)
def test_logits_match_transformers_reading_the_same_gguf(family):
    """transformers' own GGUF reader (``gguf_file=``; the folder's config,
    since transformers maps few of these architectures' keys) on our file."""
    name, folder, path, hf, model, _ = family
    if TRANSFORMERS_ARCHS.get(ARCHS[name], ARCHS[name]) not in GGUF_SUPPORTED_ARCHITECTURES:
        assert name == "olmo2", f"transformers reads {ARCHS[name]} GGUFs now: compare them"
        pytest.skip(f"transformers {transformers.__version__} does not read olmo2 GGUFs")
    other = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=path.name, config=hf.config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = other(torch.tensor([prompts()[2]])).logits[0].numpy()
    show(name, "against transformers' GGUF reader", dense(model, prompts()[2]), want)


@pytest.mark.parametrize("family", families(), indirect=True)  # the same config and weights as dense
def test_paged_ragged_batch_matches_transformers(family):
    """Three sequences, prefill chunks beside a decode token, on a NaN
    pool: the second call reads the pages the first wrote."""
    name, _, _, _, model, want = family
    p = prompts()
    schedule = [[(0, p[0][:20]), (1, p[1][:9]), (2, p[2][:14])],
                [(0, p[0][20:21]), (1, p[1][9:27]), (2, p[2][14:30])]]
    got = mixed_calls(model, schedule, page_size=4)
    seen = [0, 0, 0]
    for call, logits in zip(schedule, got):
        for row, chunk in call:
            seen[row] += len(chunk)
            show(name, f"ragged row {row} at {seen[row]}", logits[row], want[row][seen[row] - 1])


@pytest.mark.parametrize("family", families(), indirect=True)  # 27 s each; the logits tests are the default twin
def test_engine_from_the_gguf_path_matches_generate(family):
    """``LLM(path.gguf)``: the file has no tokenizer, so prompts are ids."""
    name, _, path, hf, _, _ = family
    llm = LLM(str(path), kv_tokens=256, page_size=4, max_seqs=4, max_seq_len=64, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    assert llm.tokenizer is None
    outs = llm.generate(prompts(), max_tokens=NEW_TOKENS)
    for ids, out in zip(prompts(), outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out.output_ids == ref[0, len(ids):].tolist(), name


def test_q8_0_gemma2(tmp_path):
    """Quantized matrices: equal to transformers reading the same Q8_0 file
    (both dequantize with gguf-py), close to the f32 folder."""
    write_checkpoint(tmp_path, "gemma2")
    gguf_representable(tmp_path, "gemma2")
    path = tmp_path / "q8.gguf"
    write_gguf(tmp_path, "gemma2", path, qtype=Q8_0)
    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {Q8_0}
    hf = load_transformers(tmp_path)
    other = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, config=hf.config, dtype=torch.float32, attn_implementation="eager").eval()
    ids = prompts()[2]
    got = dense(load_llama_gguf(path), ids)
    with torch.no_grad():
        show("gemma2", "Q8_0 against transformers' GGUF reader", got, other(torch.tensor([ids])).logits[0].numpy())
        want = hf(torch.tensor([ids])).logits[0].numpy()
    show("gemma2", "Q8_0 against the f32 folder", got, want, atol=Q8_ATOL)
    assert np.abs(got - want).max() > LOGIT_ATOL  # the file really is quantized


# ----------------------------------------------------------------------------- tokenizers


def byte_tokenizer(pre: str = "smollm", model: str = "gpt2"):
    """Tokenizer metadata for a 256-token byte-level vocabulary (one token
    per byte, no merges), id 2 the end of sequence."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()

    def add(w):
        w.add_tokenizer_model(model)
        w.add_tokenizer_pre(pre)
        w.add_token_list([chars[b] for b in range(256)])
        w.add_token_types([3 if b == 2 else 1 for b in range(256)])
        w.add_token_merges([])
        w.add_eos_token_id(2)
        w.add_bos_token_id(1)

    return add


def test_llm_uses_the_gguf_tokenizer(tmp_path):
    write_checkpoint(tmp_path, "olmo2")
    path = tmp_path / "tok.gguf"
    write_gguf(tmp_path, "olmo2", path, tokenizer=byte_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported tokenizer loads without a word
        model, tokenizer, _ = load_model(path)
    text = "Hi, GGUF!"
    assert tokenizer.encode(text) == list(text.encode())
    hf = load_transformers(tmp_path)
    got = dense(model, list(text.encode()))
    with torch.no_grad():
        show("olmo2", "text prompt", got, hf(torch.tensor([list(text.encode())])).logits[0].numpy())


@pytest.mark.parametrize("model, pre, match", [
    ("llama", "default", r"tokenizer.ggml.model 'llama' \(SentencePiece"),
    ("gpt2", "deepseek-llm", r"tokenizer.ggml.pre 'deepseek-llm'"),
])
def test_unsupported_tokenizers_leave_token_id_workloads(tmp_path, model, pre, match):
    write_checkpoint(tmp_path, "olmo2")
    path = tmp_path / "tok.gguf"
    write_gguf(tmp_path, "olmo2", path, tokenizer=byte_tokenizer(pre, model))
    with pytest.warns(UserWarning, match=match):
        _, tokenizer, _ = load_model(path)
    assert tokenizer is None
    with pytest.raises(ValueError, match=match):
        load_tokenizer(path)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_pre_tokenizers_split_as_transformers_reading_the_gguf(tmp_path, pre):
    """A byte-level vocabulary with merges that cross what each pattern
    splits (digit runs, contractions, spaces before words, newlines): our
    ids equal transformers' tokenizer built from the same file. (Not
    ``smollm``: transformers' GGUF reader has no split for it and would keep
    a digit run whole where SmolLM2 splits every digit, a difference
    SmolLM2's own vocabulary, without multi-digit tokens, never shows;
    tests/test_tokenizer.py checks that file.)"""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    tokens = [chars[b] for b in range(256)]
    merges = []
    for text in ("12", "123", "1234", "'s", "Ġt", "Ġth", "Ġthe", "ĊĊ", "ĠĠ", "ĠĠĠ", "he", "hel", "hell",
                 "hello", "Ġhello", ",Ġ", "!!"):
        best = max((i for i in range(1, len(text)) if text[:i] in tokens and text[i:] in tokens), default=None)
        assert best is not None, text
        merges.append(f"{text[:best]} {text[best:]}")
        tokens.append(text)

    def add(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_token_merges(merges)
        w.add_eos_token_id(2)

    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    add(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("hello the 1234567 thing's\n\n  hello, world!!", "  the  12 3\t\nhe's hello123", "ümlaut 99"):
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), (pre, text)
        assert ours.decode(ours.encode(text)) == text


# ----------------------------------------------------------------------------- Llama 3.1+ RoPE factors


@pytest.mark.parametrize("rope, head_dim", [
    ({"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, 128),  # Llama 3.1
    ({"rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, 64),  # Llama 3.2 1B
    ({"rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 3.0,
      "original_max_position_embeddings": 64}, 128),  # thresholds other than Meta's
])
def test_llama3_factors_read_back_to_transformers_frequencies(rope, head_dim):
    """The converter's factors -> our scaling -> frequencies equal to
    transformers' ``llama3`` on the original parameters; Meta's own
    parameters come back exactly."""
    rope = {"rope_type": "llama3", **rope}
    scaling = llama3_from_factors(llama3_factors(rope, head_dim), head_dim, rope["rope_theta"], "<test>")
    hf = transformers.AutoConfig.for_model("llama", hidden_size=256, num_attention_heads=2, head_dim=head_dim,
                                           num_key_value_heads=2, max_position_embeddings=131072,
                                           rope_parameters=dict(rope))
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    np.testing.assert_allclose(inv_freq(head_dim, rope["rope_theta"], scaling), want.numpy(), rtol=2e-6, atol=0)
    if rope["low_freq_factor"] == 1.0:
        assert (scaling.factor, scaling.original_max_position_embeddings, scaling.low_freq_factor,
                scaling.high_freq_factor) == (rope["factor"], 8192, 1.0, 4.0)


def test_llama3_factors_nothing_reproduces_are_refused():
    factors = np.random.default_rng(0).uniform(1, 8, 64).astype(np.float32)
    with pytest.raises(ValueError, match="rope_freqs.weight .* matches no llama3 RoPE scaling"):
        llama3_from_factors(factors, 128, 500000.0, "<test>")
    assert llama3_from_factors(np.ones(64, np.float32), 128, 500000.0, "<test>") is None


# ----------------------------------------------------------------------------- refusals


def meta(arch: str, **keys) -> dict:
    base = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5, "attention.sliding_window": 8}
    if arch != "gemma2":
        del base["attention.sliding_window"]
    out = {"general.architecture": arch} | {f"{arch}.{k}": v for k, v in base.items()}
    return out | {f"{arch}.{k}" if not k.startswith("general.") else k: v for k, v in keys.items()}


SHAPES = {"token_embd.weight": (VOCAB, 64)}


@pytest.mark.parametrize("fields, factors, match", [
    (meta("gemma3n"), None, r"architecture 'gemma3n' is Gemma 3n"),
    (meta("phi3"), None, r"architecture must be one of \[.*\], got 'phi3'"),
    (meta("qwen3", expert_count=8), None, r"qwen3.expert_count=8; mixture-of-experts"),
    (meta("llama", **{"rope.dimension_count": 8}), None, r"llama.rope.dimension_count=8; partial RoPE"),
    (meta("qwen3", **{"attention.value_length": 8}), None, r"qwen3.attention.value_length=8; value heads"),
    (meta("llama", **{"rope.scaling.type": "longrope"}), None, r"llama.rope.scaling.type='longrope'; supported"),
    (meta("qwen3", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                      "rope.scaling.original_context_length": 32, "rope.scaling.yarn_ext_factor": 0.5}), None,
     r"RoPE scaling keys \['qwen3.rope.scaling.yarn_ext_factor'\] have no transformers equivalent"),
    (meta("olmo2", **{"attention.sliding_window": 4096}), None, r"olmo2.attention.sliding_window=4096; sliding"),
    (meta("qwen3"), np.full(8, 2.0, np.float32), r"'rope_freqs.weight' is not expected for qwen3"),
    (meta("gemma2", **{"attention.sliding_window": None}), None, r"lacks metadata key 'gemma2.attention.sliding"),
    (meta("llama", block_count=None), None, r"lacks metadata key 'llama.block_count'"),
    (meta("llama", **{"general.architecture": None}), None, r"lacks metadata key 'general.architecture'"),
])
def test_what_the_decoder_cannot_compute_is_refused_by_name(fields, factors, match):
    fields = {k: v for k, v in fields.items() if v is not None}  # None: the key is absent
    with pytest.raises(ValueError, match=match):
        hf_config_fields(fields, SHAPES, factors, "<test>")


def test_gemma_query_scale_follows_llama_cpp():
    """llama.cpp's ``f_attention_scale``: ``n_embd / n_head`` for the 27B
    layer counts (46 for Gemma 2, 62 for Gemma 3), else the head dim."""
    for arch, layers, want in (("gemma2", 46, 64 // 4), ("gemma2", 42, 32), ("gemma3", 62, 64 // 4),
                               ("gemma3", 26, 32)):
        fields = meta(arch, block_count=layers, **{"attention.key_length": 32, "attention.value_length": 32,
                                                   "attention.sliding_window": 8})
        config = config_from_hf(hf_config_fields(fields, SHAPES, None, "<test>"))
        assert config.query_scale == want ** -0.5, (arch, layers)
        assert config.sliding_layers[:6] == ((True, False) * 3 if arch == "gemma2" else (True,) * 5 + (False,))



@pytest.mark.parametrize("family", families("qwen3"), indirect=True)
def test_serve_sharegpt_checks_a_gguf_before_loading(family, tmp_path):
    from experiments.serving import serve_sharegpt

    _, _, path, _, _, _ = family
    args = serve_sharegpt.parse_args(["--model", str(path), "--out", str(tmp_path)])
    assert args.model == str(path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(SystemExit):
        serve_sharegpt.parse_args(["--model", str(bad), "--out", str(tmp_path)])
