"""Our SmolLM2 (GGUF -> NNX, paged KV) equals transformers loading the same GGUF.

Both run in f32 on the same dequantized weights, so they differ only by
float summation order. Measured on 2 CPU cores: the largest absolute logit
difference over every position of the three prompts is about 1.5e-4, against
logits of magnitude up to about 25 (standard deviation about 3.4); we allow
1e-3 absolute. Greedy continuations must match token for token.
"""

import os
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

from models.gguf_loader import smollm2_gguf_path  # noqa: E402
from models.llama import make_step_fn  # noqa: E402
from models.smollm2 import generate_greedy, load_smollm2  # noqa: E402

import torch  # noqa: E402  (the test extra: the oracle must be there, never skipped)
import transformers  # noqa: E402

LOGIT_ATOL = 1e-3
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def ours():
    model, tok = load_smollm2()
    return model, tok, make_step_fn(model), make_step_fn(model, all_logits=True)


@pytest.fixture(scope="module")
def hf():
    torch.set_num_threads(2)
    path = pathlib.Path(smollm2_gguf_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompts(ours):
    tok = ours[1]
    return [
        tok.apply_chat_template("What is the capital of France?"),
        "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein",
        "def fibonacci(n):\n    ",
    ]


def paged_prefill(step, model, ids, width=64, page_size=16):
    """One prefill call, tokens padded to ``width`` (one compilation for all
    prompts), through a fresh pool whose pages are used in reverse order."""
    assert len(ids) <= width
    pages = width // page_size
    kv = model.config.make_kv_pool(pages + 1, page_size)
    table = jnp.arange(pages, 0, -1, dtype=jnp.int32)[None]  # [1, pages]
    n = jnp.asarray([len(ids)], jnp.int32)
    tokens = jnp.asarray([ids + [0] * (width - len(ids))], jnp.int32)  # [1, width]
    logits, _ = step(tokens, kv, table, n, n)
    return np.asarray(logits[0])


def test_logits_match_transformers(ours, hf, prompts):
    model, tok, step, step_all = ours
    for text in prompts:
        ids = tok.encode(text)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].numpy()  # [T, V]
        got_all = paged_prefill(step_all, model, ids)[: len(ids)]  # [T, V]
        got_last = paged_prefill(step, model, ids)  # [V]
        np.testing.assert_allclose(got_all, want, rtol=0, atol=LOGIT_ATOL, err_msg=text)
        np.testing.assert_allclose(got_last, want[-1], rtol=0, atol=LOGIT_ATOL, err_msg=text)
        assert (got_all.argmax(-1) == want.argmax(-1)).all()


def test_greedy_continuation_matches_transformers(ours, hf, prompts):
    model, tok, step, _ = ours
    for text in prompts:
        ids = tok.encode(text)
        got = generate_greedy(model, ids, max_new_tokens=NEW_TOKENS, stop_ids=tok.stop_ids, step=step)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=list(tok.stop_ids), pad_token_id=tok.pad_id)
        want = out[0, len(ids):].tolist()
        assert got == want, (text, tok.decode(got), tok.decode(want))


def test_capital_of_france(ours):
    model, tok, step, _ = ours
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = generate_greedy(model, prompt, tokenizer=tok, max_new_tokens=NEW_TOKENS, step=step)
    assert tok.decode(out) == "The capital of France is Paris."
    assert out[-1] == tok.eos_id  # stopped at <|im_end|>
