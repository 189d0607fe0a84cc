"""Our SmolLM2 (GGUF -> NNX, paged KV) equals transformers loading the same GGUF.

The oracle is transformers in float64 on the dequantized weights, with its
plain ("eager") attention: ``GgufConfig(dequantize=True)`` keeps it off the
packed-weight GGUF kernels and ggml's attention that transformers 5 grafts on
when the ``kernels`` package can fetch them, which compute in float32 or lower
and would make the oracle depend on the machine. Ours runs in float32.

Measured on 2 CPU cores (Intel Xeon, AVX-512): ours against the float64
oracle is at most 1.2e-4 over every position of the three prompts (logits up
to about 28 in magnitude, standard deviation about 3.4); transformers' own
float32 run is 3e-5 to 8e-5 from it, and so is our dense, unpaged forward,
under every instruction set XLA can be held to here (``--xla_cpu_max_isa``
AVX2, SSE4_2). CI's machines are not this one: one CI run saw 4.8e-3
between ours and transformers' float32 on the chat prompt (rows 18 on),
another 1.1e-2 between ours and the float64 oracle on the same prompt (row 0
at 4e-5, rows 1 on 1.7e-3 to 1.1e-2: only where attention mixes two or more
keys); neither reproduced here, not in one process running the whole default
suite in order. We allow 5e-2 absolute: 4.5x the largest excursion CI has
shown and 10x below a real error (one prompt token changed moves every later
row's logits by at least 0.5). A failure's message names the CPU and gives,
row by row, transformers' float32 and our dense forward against the same
oracle, so the next excursion says whether float32 itself is that far off on
that machine or the paged path adds to it. Argmax must agree wherever the
oracle's top-two margin exceeds twice the tolerance; greedy continuations
must match token for token.
"""

import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import torch  # noqa: E402  (the test extra: the oracle must be there, never skipped)
import transformers  # noqa: E402

from models.llama import make_step_fn  # noqa: E402
from models.loading.gguf_loader import smollm2_gguf_path  # noqa: E402
from models.smollm2 import generate_greedy, load_smollm2  # noqa: E402
from tests.decoder_helpers import mixed_calls  # noqa: E402

LOGIT_ATOL = 5e-2
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
        str(path.parent), gguf_file=path.name, dtype=torch.float64, attn_implementation="eager",
        quantization_config=transformers.GgufConfig(dequantize=True),
    )
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    return model.eval()


def oracle_logits(hf, ids):
    """transformers' float64 logits for one sequence, as float32 numpy: f32[len(ids), vocab]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy().astype(np.float32)


def cpu_features() -> str:
    """The CPU's model and the flags that change how float32 maths may be
    done (AVX-512, its bf16 instructions, AMX), for failure messages: CI's
    machines are not this one."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cpu unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    wanted = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return f"{model}; {' '.join(wanted)}"


def assert_logits_match(got, want, what, noise=None):
    """``got`` (ours, f32[..., vocab]) within LOGIT_ATOL of the oracle's ``want``, and the same argmax
    wherever the oracle's top-two margin leaves room for the tolerance. The message gives every row's
    largest difference, so a failure says where it starts, and the machine; ``noise()``, when given, is
    called on failure only and its text added (what float32 does on this machine)."""
    err = np.abs(got - want).max(-1)
    if not (err <= LOGIT_ATOL).all():
        extra = f"; {noise()}" if noise is not None else ""
        raise AssertionError(f"{what}: max |ours - float64 oracle| per row {np.round(err, 5).tolist()}; "
                             f"{cpu_features()}{extra}")
    top2 = np.sort(want, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * LOGIT_ATOL
    assert (got.argmax(-1) == want.argmax(-1))[clear].all(), what


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


def float32_noise(hf, ids, want) -> str:
    """How far transformers in float32 (the same weights, this machine) and
    our dense, unpaged forward are from the float64 oracle's ``want``, per
    row: a failure's measure of what float32 does here, and whether the
    paged path adds to it."""
    import copy

    from models.llama import forward_dense

    with torch.no_grad():
        f32 = copy.deepcopy(hf).to(torch.float32)(torch.tensor([ids])).logits[0].numpy()
    model, _ = load_smollm2()
    dense = np.asarray(forward_dense(model, jnp.asarray([ids], jnp.int32))[0])
    return (f"transformers float32 per row {np.round(np.abs(f32 - want).max(-1), 5).tolist()}; ours dense, unpaged, "
            f"per row {np.round(np.abs(dense - want).max(-1), 5).tolist()}")


def test_logits_match_transformers(ours, hf, prompts):
    model, tok, step, step_all = ours
    for text in prompts:
        ids = tok.encode(text)
        want = oracle_logits(hf, ids)  # [T, V]
        got_all = paged_prefill(step_all, model, ids)[: len(ids)]  # [T, V]
        got_last = paged_prefill(step, model, ids)  # [V]
        noise = functools.partial(float32_noise, hf, ids, want)
        assert_logits_match(got_all, want, text, noise)
        assert_logits_match(got_last, want[-1], text, noise)


@pytest.mark.slow  # ~25 s; the logits test above checks the same forward at every position
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


@pytest.mark.slow  # 30-45 s; the logits test covers the paged path on SmolLM2, tests/test_llama.py mixed batches
def test_mixed_batches_match_transformers(ours, hf, prompts):
    """Three prompts prefilled in chunks that share calls with each other's
    decode tokens (page size 16: chunks end at a page boundary, inside a
    page, and span pages), then decoded together: every chunk's last-token
    logits equal transformers on the sequence so far, and the greedy tokens
    equal its argmax."""
    from paged_jax.attention.batch import Tiling

    model, tok, _, _ = ours
    a, b, c = (tok.encode(t) for t in prompts)
    assert (len(a), len(b), len(c)) == (37, 19, 7)
    schedule = [
        [(0, a[:16]), (1, b[:5])],  # a page-boundary chunk + a short one
        [(0, a[16:30]), (1, b[5:]), (2, c)],  # inside a page; rest of b (across pages); all of c
        [(0, a[30:]), (1, [tok.eos_id]), (2, [17])],  # the rest, across pages + two decodes
        [(0, [28]), (1, [905]), (2, [11])],  # decode only
    ]
    got = mixed_calls(model, schedule, page_size=16, num_pages=24, max_pages=8,
                      tiling=Tiling(prefill_tile_q=8, min_tokens=16))
    full = {row: [t for call in schedule for r, chunk in call if r == row for t in chunk] for row in range(3)}
    # causal: one pass over each whole sequence gives every prefix's logits
    want = {row: oracle_logits(hf, seq) for row, seq in full.items()}
    seen = {row: 0 for row in full}
    for call, logits in zip(schedule, got):
        for row, chunk in call:
            seen[row] += len(chunk)
            assert_logits_match(logits[row], want[row][seen[row] - 1], f"row {row} after {seen[row]} tokens")


@pytest.mark.slow  # ~18 s; tests/test_train.py covers the loss and its gradients on tiny models by default
def test_dense_loss_matches_transformers_and_gradients_are_finite(ours, hf):
    """The training path on SmolLM2: our dense next-token loss of a chat
    exchange equals transformers' ``labels=`` loss on the same GGUF (ours f32,
    the oracle f64, on the same dequantized weights; the mean of ~40 log-probabilities that
    each agree to about 1e-4), and its gradient is finite and non-zero."""
    from flax import nnx

    from models.train import dense_loss, make_batch

    model, tok, _, _ = ours
    text = tok.apply_chat_template("Explain paged attention in one sentence.") + (
        "Paged attention stores the KV cache in fixed-size blocks, so memory is allocated on demand.<|im_end|>")
    ids = tok.encode(text)
    batch = make_batch(np.asarray([ids]))
    got = float(dense_loss(model, batch)[0])
    with torch.no_grad():
        want = float(hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    assert abs(got - want) < 1e-4, (got, want)

    graphdef, params = nnx.split(model)
    grads = jax.tree.leaves(jax.grad(lambda p: dense_loss(nnx.merge(graphdef, p), batch)[0])(params))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    assert float(sum(jnp.sum(g * g) for g in grads)) > 0
